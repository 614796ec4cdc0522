"""The library type-checks and the documentation builds without warnings, every tutorial
executed (with the claims each asserts)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_library_type_checks():
    api = pytest.importorskip("mypy.api")
    stdout, stderr, status = api.run([str(ROOT / "captum_attention"), "--ignore-missing-imports"])
    assert status == 0, stdout + stderr


def test_docs_build_without_warnings(tmp_path):
    build = pytest.importorskip("sphinx.cmd.build")
    status = build.build_main(["-q", "-W", "--keep-going", "-b", "html", str(ROOT / "docs"), str(tmp_path)])
    assert status == 0
