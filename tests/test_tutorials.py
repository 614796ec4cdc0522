"""The tutorials: gallery scripts that state their claims as assertions.

Each runs here as a script in a fresh interpreter, so a claim that stops holding fails
its test. Together they take minutes, so they run under their own marker
(``pytest -m tutorials``; continuous integration runs ``-m "zoo or tutorials"`` after the
default set); the default set's documentation build renders them without running them.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).parent.parent / "tutorials").glob("plot_*.py"))


def test_the_gallery_holds_the_tutorials():
    assert len(TUTORIALS) >= 7
    assert not [p.name for p in (Path(__file__).parent.parent / "tutorials").glob("*.py") if p not in TUTORIALS]


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_each_tutorial_has_a_title_and_checks_its_claims(path):
    tree = ast.parse(path.read_text())
    title = (ast.get_docstring(tree) or "").splitlines()
    assert len(title) > 1 and set(title[1]) == {"="}, "sphinx-gallery needs a title underlined with '='"
    claims = [node for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert claims, "each tutorial asserts at least one claim its text makes about its result"


@pytest.mark.tutorials
@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_each_tutorials_claims_hold(path):
    environment = {**os.environ, "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1"}
    environment.pop("TRITON_INTERPRET", None)  # set by conftest.py for the kernels' tests; a reader's run has none
    run = subprocess.run([sys.executable, path.name], cwd=path.parent, env=environment, capture_output=True, text=True)
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", run.stderr)
    if run.returncode and missing and missing.group(1).split(".")[0] != "captum_attention":  # a tutorial's own extra (shap, scikit-learn)
        pytest.skip(f"{path.name} needs {missing.group(1)}: pip install -e '.[docs]'")
    assert run.returncode == 0, run.stderr[-3000:]
