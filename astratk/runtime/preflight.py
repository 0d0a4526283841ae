"""Checks a deployment makes on its workers before it starts: the run's env loads there.

The env (with a FunctionEnv's reward functions, an AgentEnv's agent) travels to every worker pickled. Functions and
classes from a module travel *by name*: the worker imports the module, so a reward function in the user's own
`rewards.py` must be importable on the workers; ones defined in the notebook or script itself travel by value.
Without this check a worker that cannot import the module fails every rollout task deep inside Dask's
deserialisation, and the run starves. `check_env_loads` unpickles the env on each worker first and fails with one
line that names the worker, the module and how to make it importable.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

from astratk.spec import StartError


def _load(blob: bytes) -> str | None:
    """On a worker: None when the env unpickles; else the error, with the missing module's name when known."""

    try:
        pickle.loads(blob)
    except ModuleNotFoundError as e:
        return f"module:{e.name}:{e}"
    except Exception as e:  # noqa: BLE001 - reported to the driver as it is
        return f"error:{type(e).__name__}: {e}"
    return None


def check_env_loads(client: Any, env: Any, timeout_s: float) -> None:
    """Unpickle `env` on every worker of `client`'s cluster; `StartError` naming the first that cannot."""

    import cloudpickle

    blob = cloudpickle.dumps(env)
    workers = sorted(client.scheduler_info()["workers"].items(), key=lambda kv: str(kv[1].get("name")))
    futures = {info.get("name", addr): client.submit(_load, blob, workers=[addr], allow_other_workers=False,
                                                     pure=False, key=f"astratk-env-check-{i}-{id(blob)}")
               for i, (addr, info) in enumerate(workers)}
    for name, future in futures.items():
        try:
            problem = future.result(timeout=timeout_s)
        except TimeoutError:
            raise StartError(f"env: worker {name!r} did not load the run's env within {timeout_s:.0f}s "
                             "(cluster.startup_timeout_s)") from None
        if problem is None:
            continue
        kind, _, rest = problem.partition(":")
        if kind == "module":
            module, _, error = rest.partition(":")
            here = module.split(".")[0] in sys.modules
            raise StartError(
                f"env: worker {name!r} cannot import {module!r}, which the run's env or its reward functions need "
                f"({error.strip()}){' (this process can)' if here else ''}. Workers import a function's module by "
                "name: install it (pip install -e your package), or put its folder on PYTHONPATH before the workers "
                "start (a local run's workers start with this process's sys.path and PYTHONPATH), or define the "
                "function in the notebook or script that starts the run")
        raise StartError(f"env: worker {name!r} cannot load the run's env: {rest}")
