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


def test_one_version_source_and_a_license():
    from importlib.metadata import metadata

    import captum_attention

    installed = metadata("captum-attention")
    assert installed["Version"] == captum_attention.__version__
    assert installed["License-Expression"] == "BSD-3-Clause"
    project = (ROOT / "pyproject.toml").read_text().split("[project]")[1].split("\n[")[0]
    assert 'dynamic = ["version"]' in project and "\nversion =" not in project
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert all(f"graft {folder}" in manifest for folder in ("docs", "tutorials", "benchmarks", "tests"))
