"""Public names that load on first use (PEP 562 module `__getattr__`): `import astratk` stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `table[name]` (a module path) on first access of `name`.

    >>> getattr_ = lazy_names("pkg", {"sqrt": "math"})
    >>> getattr_("sqrt")(4.0)
    2.0
    """

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
