"""The library type-checks and the documentation builds without warnings (the tutorials
rendered, not run: ``tests/test_tutorials.py`` runs them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from captum_attention import METHODS

ROOT = Path(__file__).parent.parent


USER_CODE = """
import torch
from captum_attention import AttentionRollout, GradSAM

model = torch.nn.Module()
ids = torch.zeros(1, 3, dtype=torch.long)
scores = GradSAM(model).attribute(ids, target=0)
print(scores.shape)
pair = GradSAM(model).attribute(ids, target=0, return_maps=True)
scores_too, maps = pair
rows = AttentionRollout(model).attribute(ids, head_fusoin="max")
"""


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """mypy's error lines on the library and, in the same run, on ``user_code.py``
    (:data:`USER_CODE`)."""
    pytest.importorskip("mypy")
    folder = tmp_path_factory.mktemp("typed")
    user_code = folder / "user_code.py"
    user_code.write_text(USER_CODE)
    # a cache of its own: mypy's shared one reports a cached module's errors under the path it had then
    arguments = [str(ROOT / "captum_attention"), str(user_code), "--ignore-missing-imports", "--cache-dir", str(folder / "cache")]
    # its own process: run in this one, mypy leaves millions of objects alive and raises the
    # collector's thresholds, and every later test pays for it in garbage collections
    run = subprocess.run([sys.executable, "-m", "mypy", *arguments], capture_output=True, text=True)
    assert not run.stderr, run.stderr
    return [line.replace(str(user_code), user_code.name) for line in run.stdout.splitlines() if ": error:" in line]


def test_library_type_checks(mypy_errors):
    assert not [line for line in mypy_errors if not line.startswith("user_code.py:")], mypy_errors


def test_attribute_calls_are_typed_by_their_options(mypy_errors):
    """``return_maps`` picks the return type (``@overload``), a misspelt option is an error."""
    errors = [line for line in mypy_errors if line.startswith("user_code.py:")]
    assert errors and all(line.startswith("user_code.py:11:") for line in errors), mypy_errors
    assert 'Unexpected keyword argument "head_fusoin"' in errors[0]


def test_docs_build_without_warnings(tmp_path):
    build = pytest.importorskip("sphinx.cmd.build")
    status = build.build_main(["-q", "-W", "--keep-going", "-D", "plot_gallery=0", "-b", "html", str(ROOT / "docs"), str(tmp_path)])
    assert status == 0
    pages = list(tmp_path.rglob("*.html"))
    external = re.compile(r"<(?:script|link)[^>]+(?:src|href)=\"(?:https?:)?//")
    assert pages and not [page.name for page in pages if external.search(page.read_text())]  # works offline
    assert not list(tmp_path.rglob("sg_execution_times.html"))  # its tables pull CDN scripts
    api = re.sub(r'<(span|div) class="math[^"]*">.*?</\1>', "", (tmp_path / "api.html").read_text(), flags=re.S)
    assert not re.search(r"\^\{|_\{|\\mathrm", re.sub(r"<[^>]+>", "", api))  # no raw LaTeX in prose
    names = [cls.get_name() for cls in METHODS.values()]
    index = re.sub(r"<[^>]+>", "", (tmp_path / "index.html").read_text())
    assert all(name in index for name in names)  # the method list comes from the registry


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
