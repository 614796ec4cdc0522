"""The tutorials: gallery scripts that state their claims as assertions.

The documentation build (``tests/test_project.py::test_docs_build_without_warnings``)
executes every tutorial through sphinx-gallery, so a claim that stops holding fails the
build; these tests check that each tutorial is built that way.
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
