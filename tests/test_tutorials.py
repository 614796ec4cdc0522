"""The tutorials run as shipped."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).parent.parent / "tutorials").glob("*.py"))


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_tutorial_runs(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    assert "Transformer Attribution" in capsys.readouterr().out
