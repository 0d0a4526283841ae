"""The dataflow layer (AstraFlow's programmable middle): task leasing, admission, per-policy buffers, batch serving.

`DataLayer` is the one stateful coordinator; it runs as a Dask actor on the control worker or in-process.
`DataLayerClient` hides which, and owns the client-side waiting (an actor call never blocks the actor).

The names load on first use, so that importing a submodule (`astratk.spec` imports the stage contracts) does not
load the data layer with numpy and fsspec.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "DataLayer": "astratk.dataflow.datalayer",
    "Lease": "astratk.dataflow.datalayer",
    "DataLayerClient": "astratk.dataflow.client",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'astratk.dataflow' has no attribute {name!r}")


__all__ = ["DataLayer", "DataLayerClient", "Lease"]
