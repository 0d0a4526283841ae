"""The dataflow layer (AstraFlow's programmable middle): task leasing, admission, per-policy buffers, batch serving.

`DataLayer` is the one stateful coordinator; it runs as a Dask actor on the control worker or in-process.
`DataLayerHandle` hides which, and owns the client-side waiting (an actor call never blocks the actor).
"""

from astratk.dataflow.datalayer import DataLayer, Lease
from astratk.dataflow.handle import DataLayerHandle

__all__ = ["DataLayer", "DataLayerHandle", "Lease"]
