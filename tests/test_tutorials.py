"""The tutorials: gallery scripts that state their claims as assertions.

The documentation build (``tests/test_project.py::test_docs_build_without_warnings``,
in the default test set wherever the ``docs`` extra is installed, as continuous
integration installs it) executes every tutorial through sphinx-gallery, so a claim that
stops holding fails the build; without sphinx, each tutorial runs here as a script.
"""

from __future__ import annotations

import ast
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


def _docs_build_runs_them() -> bool:
    """Whether ``test_docs_build_without_warnings`` executes the tutorials in this
    environment (sphinx and sphinx-gallery installed, as continuous integration installs
    them with the ``docs`` extra)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("sphinx", "sphinx_gallery"))


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_each_tutorials_claims_hold_where_no_docs_build_runs_them(path, monkeypatch):
    """Without sphinx the docs build is skipped, so each tutorial runs here as a script
    and its assertions (its claims) are checked all the same."""
    if _docs_build_runs_them():
        pytest.skip("the docs build executes the tutorials and their assertions")
    import runpy

    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(path.parent)
    try:
        runpy.run_path(str(path), run_name="__main__")
    except ModuleNotFoundError as missing:  # a tutorial's own extra (shap, scikit-learn)
        pytest.skip(f"{path.name} needs {missing.name}: pip install -e '.[docs]'")
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")
