"""The method registry: each attribution class declares its name once (``method_name``).

:data:`METHODS` maps those names to the classes; the command line, the benchmarks and the
shared test table read it instead of listing the methods themselves.
"""

from __future__ import annotations

from typing import Any

METHODS: dict[str, Any] = {}
"""Registry name (e.g. ``"grad_sam"``) -> attribution class, in registration order."""


def register(name: str, cls: Any) -> None:
    """Add ``cls`` under ``name``; a second class with the same name is an error."""
    if METHODS.get(name, cls) is not cls:
        raise ValueError(f"Two attribution methods are registered as {name!r}: {METHODS[name].__name__} and {cls.__name__}.")
    METHODS[name] = cls
