"""astratk: reinforcement learning of LLM agents with AstraFlow's autonomous components and DRPO.

`import astratk` starts nothing and imports little; the public names load on first use:

    >>> import astratk
    >>> run = astratk.Run.from_config("tutorials/quickstart.yaml")  # doctest: +SKIP
    >>> result = run.start()  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from astratk._addons import hide_mismatched_addons

__version__ = "0.1.0"
HIDDEN_ADDONS = hide_mismatched_addons()  # CUDA-built torchvision & co. next to a CPU torch: see astratk/_addons.py

_LAZY = {
    "Run": "astratk.runtime.run",
    "RunSpec": "astratk.spec",
    "PolicySpec": "astratk.spec",
    "load_spec": "astratk.config",
    "DataLayer": "astratk.dataflow.datalayer",
    "WeightStore": "astratk.weights.store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'astratk' has no attribute {name!r}")


__all__ = ["DataLayer", "PolicySpec", "Run", "RunSpec", "WeightStore", "load_spec"]
