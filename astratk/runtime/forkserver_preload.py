"""Imported by the fork server that a local cluster's workers are forked from (`astratk.runtime.worker_start`), once
per process that starts workers: the third-party libraries every worker needs, so that no worker imports them
itself. Never imported anywhere else.

Nothing here may start a thread or initialise CUDA: a fork copies only the thread that forks, and CUDA does not
survive a fork. With one OpenMP/BLAS thread torch and numpy start no thread pool here; each worker sets its own
count as it starts. Your code and astratk's are left out on purpose: a worker imports them fresh, so edits reach it.
"""

from __future__ import annotations

import importlib
import os
import sys

for _key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_key] = "1"

import astratk._addons  # noqa: F401 - first: `import astratk` hides CUDA-built torchvision & co. next to a CPU torch (astratk/_addons.py)

# distributed: the worker itself; transformers.modeling_utils: every model class's base, which also loads
# torch._dynamo (1.2 s of the 4 s a spawned worker spends importing)
PRELOAD = ("numpy", "distributed", "torch", "transformers.modeling_utils")

for _name in PRELOAD:
    try:
        importlib.import_module(_name)
    except Exception as _e:  # noqa: BLE001 - a worker that needs it imports it itself and reports the error there
        print(f"astratk fork server: {_name} was not preloaded ({type(_e).__name__}: {_e})", file=sys.stderr)
