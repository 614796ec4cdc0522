"""The import contract of the layers: maps -> capture -> attributions -> metrics -> presentation,
the metrics apart from the attributions.

Each module may import from its own layer and the layers before it, never from a later
one, lazy imports inside functions included (``_compat`` comes first of all; checkpoint
loading, then the demo corpus and models, come before presentation, which uses both).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "captum_attention"
ORDER = ["_compat", "maps", "capture", "attr", "metrics", "loading", "demo", "presentation"]
APART = {("metrics", "attr")}
"""Pairs of layers that never import each other whatever their order: the metrics take any
attribution tensor and reach the model through the capture alone."""


def layer(parts: tuple[str, ...]) -> str | None:
    """The layer of module ``captum_attention.<parts>``; None for the package root."""
    name = parts[0].removesuffix(".py") if parts else "__init__"
    if name in ("__init__", "__main__"):
        return None
    return name


def imported_modules(path: Path, package: Path) -> list[tuple[tuple[str, ...], int]]:
    """``(module path inside the package, line)`` of each import of the package in ``path``."""
    own = path.relative_to(package).with_suffix("").parts
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = own[: len(own) - node.level]
                targets = [base + tuple(node.module.split("."))] if node.module else [base + (a.name,) for a in node.names]
            elif node.module and node.module.split(".")[0] == package.name:
                targets = [tuple(node.module.split(".")[1:])]
            else:
                continue
            found += [(target, node.lineno) for target in targets]
        elif isinstance(node, ast.Import):
            found += [(tuple(a.name.split(".")[1:]), node.lineno) for a in node.names if a.name.split(".")[0] == package.name]
    return found


def violations(package: Path) -> list[str]:
    """Every import in ``package`` that runs against the layer order."""
    found = []
    for path in sorted(package.rglob("*.py")):
        own = layer(path.relative_to(package).parts)
        if own is None:
            continue  # the package root re-exports the public names of every layer
        if own not in ORDER:
            found.append(f"{path.relative_to(package)} is in no layer: add it to ORDER")
            continue
        for target, line in imported_modules(path, package):
            theirs = layer(target)
            theirs = theirs if theirs in ORDER else None  # a name imported from the root
            if theirs is None or ORDER.index(theirs) > ORDER.index(own) or (own, theirs) in APART:
                found.append(
                    f"{path.relative_to(package)}:{line} ({own}) imports {'.'.join(target) or 'the root'} "
                    f"({theirs or 'the package root'})"
                )
    return found


def test_no_module_imports_a_later_layer():
    assert violations(PACKAGE) == []


@pytest.mark.parametrize(
    "source, wrong",
    [
        ("from ..attr._base import format_scores\n", True),
        ("from captum_attention.metrics import kendall_tau\n", True),
        ("import captum_attention.presentation.cli\n", True),
        ("from .. import GradSAM\n", True),
        ("from ..capture.record import ForwardRecord\n", True),
        ("def lazy():\n    from ..capture import probes\n", True),
        ("from .common import fuse_heads\nfrom .kernel import KernelCall\n", False),
    ],
)
def test_the_contract_catches_wrong_arrows(tmp_path, source, wrong):
    package = tmp_path / "captum_attention"
    (package / "maps").mkdir(parents=True)
    (package / "maps" / "module.py").write_text(source)
    assert bool(violations(package)) == wrong


def test_a_metric_that_imports_an_attribution_is_caught(tmp_path):
    package = tmp_path / "captum_attention"
    (package / "metrics").mkdir(parents=True)
    (package / "metrics" / "module.py").write_text("from ..attr.grad_sam import GradSAM\n")
    assert violations(package) == ["metrics/module.py:1 (metrics) imports attr.grad_sam (attr)"]
