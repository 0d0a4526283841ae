"""The dataflow layer (AstraFlow's programmable middle): task leasing, admission, per-policy
buffers, batch serving.

`DataLayer` is the one stateful coordinator; it runs as a Dask actor on the control worker or
in-process. `DataLayerClient` hides which, and owns the client-side waiting (an actor call never
blocks the actor).

The names load on first use, so that importing a submodule (`astratk.spec` imports the stage
contracts) does not load the data layer with numpy and fsspec.
"""

from __future__ import annotations

from astratk._lazy import lazy_names

_LAZY = {
    "DataLayer": "astratk.dataflow.datalayer",
    "Lease": "astratk.dataflow.datalayer",
    "DataLayerClient": "astratk.dataflow.client",
}

__getattr__ = lazy_names("astratk.dataflow", _LAZY)


__all__ = ["DataLayer", "DataLayerClient", "Lease"]
