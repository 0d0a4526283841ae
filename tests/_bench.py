"""Importing a benchmark module in a test: `bench/` holds scripts, not a package, so its folder is put on `sys.path`
for the import only (a module's own imports of its siblings resolve then)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = str(Path(__file__).resolve().parents[1] / "bench")


def bench_module(name: str) -> ModuleType:
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCH)
