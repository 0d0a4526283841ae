"""How a local cluster's worker processes start: forked from a fork server that imported torch and transformers once,
or spawned afresh, each importing them itself.

A spawned worker is a new Python process that imports numpy, torch and transformers' model code before it can work:
about 4 s of CPU each on this project's 2-core machine, paid again by every worker, every restart of a killed worker
and every worker an elastic pool adds. With `cluster.worker_start: forkserver` (what `auto` picks on Linux when torch
sees no GPU) the first worker of a process starts Python's fork server (`multiprocessing.forkserver`), which imports
those libraries once (`astratk.runtime.forkserver_preload`); every worker after that is a fork of it. Measured here:
three workers ready in 5.1 s instead of 8.9 s, a restart 0.4 s instead of 1.6 s, and about 4 s of CPU saved per
worker after the first.

What a forked worker shares with a spawned one, and what it does not:
- Its environment is this process's at the moment the worker starts (the nanny passes it whole), with the nanny's
  values on top (thread counts, CUDA_VISIBLE_DEVICES), as a spawned worker's is; torch's thread count is set from it as
  the worker starts (`dask_setup`, a worker preload).
- The preloaded libraries read some variables once, when imported (HF_HUB_OFFLINE, HF_HOME, TORCH_LOGS, OMP_* and
  the like: `IMPORT_TIME_ENV`). When one of them differs from the fork server's, the worker is spawned instead (logged
  once per variable), so that it sees the value it was started with.
- Your own code (reward functions, envs, astratk itself) is never preloaded: every worker imports it fresh, as a
  spawned one does, so edits reach the next worker.
- `auto` spawns where torch sees a GPU: there a fork server is untested, and a worker's start is dominated by CUDA and
  the engine anyway. `cluster.worker_start: forkserver` asks for it on a GPU machine too; `spawn` is Dask's default.

Dask reads one start method for the whole process (`distributed.worker.multiprocessing-method`). This project's
nannies (`EnvNanny`) choose theirs per nanny instead, leaving the user's other Dask clusters as they were: the
`get_mp_context` that `distributed.nanny` and `distributed.process` call is wrapped to read the nanny's choice from a
context variable. Where a Dask release has moved that function, workers are spawned (logged once).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import forkserver
from typing import Any

import dask
import distributed.nanny
import distributed.process
import distributed.utils
from distributed import Nanny

from astratk.spec.cluster import WORKER_STARTS

log = logging.getLogger(__name__)

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
PRELOAD_MODULE = "astratk.runtime.forkserver_preload"  # what the fork server imports
WORKER_MODULE = "astratk.runtime.worker_start"  # every pool worker's preload: `dask_setup` sets torch's threads
# Variables that the fork server's libraries (and the interpreter, glibc) read once, when imported or started, and a
# user may set in the notebook: huggingface_hub's and transformers' cache, offline and endpoint settings, torch's
# logging, libgomp's settings, the hash seed, the allocator. A worker forked from a server started with other values
# would keep the server's. Left out on purpose: thread counts (each worker sets its own: `dask_setup`),
# CUDA_VISIBLE_DEVICES and the like (read when CUDA starts, in the worker), and what libraries set in this process
# as they load (Lightning's PYTORCH_NVML_BASED_CUDA_CHECK and KMP_*, TORCHINDUCTOR_*: read later, or not by these),
# and glibc's MALLOC_*: a plain Dask nanny leaves MALLOC_TRIM_THRESHOLD_ in this process's environment, which the pool
# keeps out of its workers on purpose (`astratk.runtime.pools.ALLOCATOR_ENV`); a fork keeps the server's defaults.
IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH_", "OMP_", "GOMP_", "USE_TORCH", "USE_TF",
                   "XDG_CACHE_HOME", "PYTHONHASHSEED", "LD_PRELOAD")

_method: contextvars.ContextVar[str | None] = contextvars.ContextVar("astratk_worker_start", default=None)
_lock = threading.Lock()
_server: dict[str, Any] = {}  # the fork server this module started: "pid", "env" (its environment at start)
_hooked: bool | None = None  # get_mp_context wrapped (None: not tried yet)
_logged: set[str] = set()


def resolve_start_method(method: str, key: str = "cluster.worker_start") -> str:
    """`forkserver` or `spawn` for `cluster.worker_start`: `auto` is `forkserver` on Linux where torch sees no GPU."""
    if method not in WORKER_STARTS:
        raise ValueError(f"{key}: unknown {method!r}; choose one of {list(WORKER_STARTS)}")
    available = "forkserver" in multiprocessing.get_all_start_methods()
    if method == "auto":
        if not (available and sys.platform.startswith("linux")):
            return "spawn"
        import torch

        return "spawn" if torch.cuda.is_available() else "forkserver"
    if method == "forkserver" and not available:
        raise ValueError(f"{key}: forkserver is not available on {sys.platform}; use spawn (or auto)")
    return method


def _hook() -> bool:
    """Wrap Dask's `get_mp_context` once so that a nanny's context variable picks the start method."""
    global _hooked
    with _lock:
        if _hooked is None:
            original = distributed.utils.get_mp_context
            users = (distributed.nanny, distributed.process)
            if all(getattr(m, "get_mp_context", None) is original for m in users):
                def get_mp_context() -> Any:
                    method = _method.get()
                    return original() if method is None else multiprocessing.get_context(method)

                for m in users:
                    m.get_mp_context = get_mp_context  # type: ignore[attr-defined]
                _hooked = True
            else:
                log.warning("this Dask release starts worker processes differently (distributed.nanny.get_mp_context "
                            "moved): local workers are spawned, not forked (cluster.worker_start)")
                _hooked = False
    return _hooked


def _import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in THREAD_ENV}


def _ensure_server(pre_spawn_env: Mapping[str, str]) -> dict[str, str] | None:
    """Start the fork server if it is not running (with `pre_spawn_env` in its environment: the nanny writes it into
    `os.environ` around every start anyway) and return the import-time part of its environment; None for a fork
    server this module did not start (another library's), whose environment and preload are unknown."""
    server = forkserver._forkserver
    with _lock:
        before = getattr(server, "_forkserver_pid", None)
        multiprocessing.get_context("forkserver").set_forkserver_preload([PRELOAD_MODULE])
        os.environ.update(pre_spawn_env)
        forkserver.ensure_running()
        pid = getattr(server, "_forkserver_pid", None)
        if pid is not None and pid != before:  # started now, by this call
            _server.update(pid=pid, env=_import_time_env(os.environ))
        return _server["env"] if pid is not None and pid == _server.get("pid") else None


def _log_once(key: str, message: str, *args: Any) -> None:
    """A warning the first time, a debug line every time after: why this worker is spawned."""
    if key not in _logged:
        _logged.add(key)
        log.warning(message, *args)
    else:
        log.debug(message, *args)


def choose(method: str, pre_spawn_env: Mapping[str, str]) -> str:
    """The start method for one worker start: `method`, or `spawn` where a fork would not give the worker what a
    spawn would (the hook is missing, the fork server is another library's, or an import-time variable changed)."""
    if method != "forkserver":
        return method
    if not _hook():
        log.debug("distributed.nanny.get_mp_context could not be wrapped: spawned")
        return "spawn"
    server_env = _ensure_server(pre_spawn_env)
    if server_env is None:
        _log_once("foreign", "a fork server this project did not start is running in this process: local workers are "
                             "spawned (cluster.worker_start)")
        return "spawn"
    wanted = _import_time_env({**os.environ, **pre_spawn_env})
    changed = sorted(k for k in set(wanted) | set(server_env) if wanted.get(k) != server_env.get(k))
    if changed:
        _log_once(",".join(changed), "%s changed since this process's fork server started; it is read once, at import "
                  "or start: workers that need the new value are spawned, not forked (about 4 s of CPU more each)",
                  ", ".join(changed))
        return "spawn"
    return "forkserver"


def dask_setup(worker: Any) -> None:
    """A pool worker's preload: torch's thread count from the worker's environment. A spawned worker's torch reads
    OMP_NUM_THREADS when it is imported; a forked one's was imported by the fork server, on one thread."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))


# --------------------------------------------------------------------------------------------------------- nannies
_env_lock = threading.Lock()
_env_starts = 0  # nanny starts in flight in this process that have not spawned their worker yet
_env_saved: dict[str, str | None] = {}  # the process's own values of the keys they overwrote


def _env_enter(keys: Sequence[str]) -> None:
    global _env_starts
    with _env_lock:
        _env_starts += 1
        for key in keys:
            _env_saved.setdefault(key, os.environ.get(key))


def _env_leave() -> None:
    """One start has spawned its process (or failed to): the last one in flight restores the saved values."""
    global _env_starts
    with _env_lock:
        _env_starts -= 1
        if _env_starts == 0:
            for key, value in _env_saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            _env_saved.clear()


class EnvNanny(Nanny):
    """A Nanny that starts its worker by `start_method` (`forkserver` or `spawn`, see the module) and gives this
    process its environment back. Dask's nanny writes its `pre-spawn-environ` (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1,
    MALLOC_TRIM_THRESHOLD_, PYTHONHASHSEED, ...) into `os.environ` before it starts a worker and never restores it,
    so everything the user's process starts afterwards (a second training process, a baseline in a subprocess) would
    run on one OpenMP thread: measured here as 0.22 against 0.44 optimizer steps/s for a torch training subprocess
    set to 2 threads.

    The values are restored as soon as the worker's process exists (its pid is known: the environment has been
    copied), not when the worker has connected seconds later, so the window in which a subprocess of the user's
    could inherit them is the start itself. A start reads the environment in a thread, so one start's restore waits
    for every other start still in flight. Nanny restarts of a killed worker go through here too."""

    def __init__(self, *args: Any, start_method: str = "spawn", pre_spawn_environ: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start_method = start_method
        if pre_spawn_environ is not None:  # this nanny's, instead of the global `distributed.nanny.pre-spawn-environ`
            self._own_pre_spawn(pre_spawn_environ, kwargs.get("env"))

    def _own_pre_spawn(self, pre_spawn: Mapping[str, Any], env: Mapping[str, Any] | None) -> None:
        """Dask's merge, with the given variables for the config's: a value this process has set wins (Dask's rule),
        read from before any start in flight wrote over it. A cluster that set the config around creating its
        nannies lost it when two creations overlapped (`dask.config.set` restores in the order it is left): a worker
        the pool added then ran on one thread instead of the run's count."""
        with _env_lock:
            own = {k: _env_saved[k] if k in _env_saved else os.environ.get(k) for k in pre_spawn}
        pre = {k: own[k] if own[k] is not None else str(v) for k, v in pre_spawn.items() if v is not None}
        if pre.get("PYTHONHASHSEED") in (None, "0"):  # Dask's fixed seed: the same hashes in every worker
            pre["PYTHONHASHSEED"] = "6640"
        environ = {k: os.environ.get(k, str(v)) for k, v in (dask.config.get("distributed.nanny.environ",
                                                                             default={}) or {}).items()
                   if v is not None}
        self.pre_spawn_env = pre
        self.env = {**pre, **environ, **{k: str(v) for k, v in (env or {}).items()}}

    async def instantiate(self) -> Any:
        _env_enter(list(self.pre_spawn_env))
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                _env_leave()

        async def leave_once_spawned() -> None:
            while True:  # WorkerProcess.process is the AsyncProcess; its pid is set right after the start
                proc = getattr(self.process, "process", None)
                if proc is not None and proc.pid is not None:
                    return leave()
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(leave_once_spawned())
        overlay = self.env
        try:
            method = choose(self.start_method, self.pre_spawn_env)
            token = _method.set(method)
            if method == "forkserver":  # the fork server's environment is old: the worker gets this process's now
                self.env = {**os.environ, **overlay}
                if self.process is not None:
                    self.process.env = self.env
            try:
                return await super().instantiate()
            finally:
                _method.reset(token)
        finally:
            self.env = overlay  # what later updates (rethreading a kept cluster) change
            if self.process is not None:
                self.process.env = overlay
            watcher.cancel()
            leave()
