"""astratk: reinforcement learning of LLM agents with AstraFlow's autonomous components and DRPO.

`import astratk` starts nothing and imports little; the public names load on first use:

    >>> import astratk
    >>> run = astratk.Run.from_config("tutorials/quickstart.yaml")  # doctest: +SKIP
    >>> result = run.start()  # doctest: +SKIP
"""

from __future__ import annotations

from astratk._addons import hide_mismatched_addons
from astratk._lazy import lazy_names
from astratk._version import __version__ as __version__

HIDDEN_ADDONS = hide_mismatched_addons()  # CUDA-built torchvision & co. next to a CPU torch: see astratk/_addons.py

_LAZY = {
    "Run": "astratk.runtime.run",
    "RunSpec": "astratk.spec",
    "PolicySpec": "astratk.spec",
    "load_spec": "astratk.config",
    "DataLayer": "astratk.dataflow.datalayer",
    "WeightStore": "astratk.weights.store",
}

__getattr__ = lazy_names("astratk", _LAZY)


__all__ = ["DataLayer", "PolicySpec", "Run", "RunSpec", "WeightStore", "load_spec"]
