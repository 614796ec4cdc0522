"""Every Python code block of the README and the documentation runs as written.

The Python of one page (its ``code-block:: python`` blocks and the Python files it
``literalinclude``\\ s, in order) runs in one namespace, as a reader who pastes the page
top to bottom would run it, in a temporary working directory. The default and needle
models load from the cache the other tests share. A page that registers a method or a
metric leaves the registries as it found them.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import pytest

from captum_attention import METHODS
from captum_attention.attr import REGISTRY
from captum_attention.metrics import METRICS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.rst"))]

_RST = re.compile(
    r"^\.\. code-block:: python\n(?:[ \t]+:[^\n]*\n)*\n(?P<body>(?:(?:   [^\n]*)?\n)+)"
    r"|^\.\. literalinclude:: (?P<path>\S+)\n(?P<options>(?:[ \t]+:[^\n]*\n)*)",
    re.MULTILINE,
)
_MARKDOWN = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> list[tuple[str, str]]:
    """``(where, code)`` of each piece of Python the page shows, in order."""
    text = page.read_text()
    if page.suffix == ".md":
        return [(f"{page.name}[{i}]", code) for i, code in enumerate(_MARKDOWN.findall(text))]
    blocks = []
    for index, match in enumerate(_RST.finditer(text)):
        if match["body"] is not None:
            blocks.append((f"{page.name}[{index}]", "\n".join(line[3:] for line in match["body"].splitlines())))
        elif ":language: python" in match["options"]:
            included = page.parent / match["path"]
            blocks.append((str(included.relative_to(ROOT)), included.read_text()))
    return blocks


def test_the_blocks_are_found():
    assert len(python_blocks(ROOT / "docs" / "quickstart.rst")) == 1
    assert len(python_blocks(ROOT / "README.md")) >= 2
    assert [where for where, _ in python_blocks(ROOT / "docs" / "adding_a_method.rst")][0].endswith("max_head_attention.py")


def test_no_page_shows_python_as_a_plain_literal_block():
    """``::`` literal blocks would escape the test: Python goes in ``code-block:: python``."""
    for page in PAGES[1:]:
        for match in re.finditer(r"::\n\n((?:    [^\n]*\n|\n)+)", page.read_text()):
            code = match[1]
            assert not re.search(r"^\s+(import |from \w+ import |\w+ = \w+\()", code, re.MULTILINE), (page.name, code[:80])


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_every_python_block_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    registries = [(registry, dict(registry)) for registry in (METHODS, REGISTRY, METRICS)]
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    try:
        for where, code in python_blocks(page):
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the documentation's own code
    finally:
        for registry, before in registries:
            registry.clear()
            registry.update(before)
        matplotlib.pyplot.close("all")
