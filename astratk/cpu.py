"""CPU placement: torch threads per process and the kernel behind `nn.Linear`, chosen from the machine.

Threads. A local run puts its trainer (this process) and its rollout workers on one machine. `cluster.torch_threads:
auto` gives each process a share of the cores it may use (`os.sched_getaffinity`): the synchronous mode alternates
rollout and training, so each gets every core; the asynchronous mode overlaps them, so the cores are split between
the trainer and the rollout workers (at least one each). `plan_threads` says what it chose and why; the run prints it.

Linear layers. torch runs fp32 `nn.Linear` through its BLAS (MKL in the PyPI wheels), which on some CPUs runs far
below the machine's peak: on the AMD EPYC machines of this project's CI, MKL reaches ~100 GFLOP/s per core in fp32
where oneDNN (shipped inside torch, `torch.ops.mkldnn._linear_pointwise`) reaches ~220 on the same shapes (measured
in `bench/engine_throughput.py`, "Linear kernels"). `cluster.cpu_linear` chooses: `torch` (torch's own), `onednn`,
or `auto`: a start-up micro-benchmark on a model-sized product picks oneDNN when it is at least 15% faster. oneDNN
layers are swapped in by class (`OneDNNLinear`, a `nn.Linear` with the same parameters and state dict), so weight
loads, LoRA adapters (PEFT wraps the layer) and checkpoints see an ordinary Linear. Its backward runs in oneDNN
too, so the trainer gains as the engines do. Results agree with torch's to fp32 rounding (summation order only).

Example:
    >>> set_linear_backend("auto")
    >>> model = use_linear_backend(model)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from astratk.gpu import bf16_native

LINEAR_BACKENDS = ("auto", "onednn", "torch")
_AUTO_MIN_SPEEDUP = 1.15
# Below this many multiply-adds (rows x in x out) oneDNN's fixed cost per call loses to torch's (measured here: 0.3x at
# 1 x 128 x 384, 0.9x at 16 x 128 x 384, 1.25x at 32 x 128 x 384, 1.03x at 1 x 576 x 1536): small products stay
# with torch.
_SMALL_PRODUCT = 1_200_000
_backend = "auto"  # this process's setting (`set_linear_backend`)
_measured: float | None = None  # oneDNN / torch speed on this machine, measured once per process


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadPlan:
    """torch threads for the trainer process and for each rollout worker, and why."""

    trainer: int
    rollout: int
    reason: str


def plan_threads(setting: int | str, *, rollout_workers: int, synchronous: bool, trainers: int = 1,
                 n_cores: int | None = None) -> ThreadPlan:
    """The threads each process gets (module docstring). An integer setting is used as given everywhere."""
    n = n_cores or cores()
    if setting != "auto":
        return ThreadPlan(int(setting), int(setting), f"cluster.torch_threads: {setting}")
    if synchronous:
        return ThreadPlan(n, max(1, n // max(1, rollout_workers)),
                          f"auto: {n} cores; the synchronous mode alternates rollout and training")
    processes = max(1, rollout_workers) + max(1, trainers)
    rollout = max(1, n // processes)
    trainer = max(1, (n - rollout * max(1, rollout_workers)) // max(1, trainers))
    return ThreadPlan(trainer, rollout, f"auto: {n} cores shared by {trainers} trainer(s) and {rollout_workers} "
                                        "rollout worker(s) working at once")


def run_threads(spec: Any) -> ThreadPlan:
    """The thread plan of a run (`RunSpec`): its local rollout workers (workers that carry rollout labels), its
    trainers (one per policy) and its mode. Threads mode (`cluster.processes: false`) is one process: every core.
    On a cluster of your own (`cluster.scheduler_address`) each rollout worker gets its host's cores here; a run
    replaces that with a plan per host once it knows its workers (`plan_shared_hosts`)."""
    c = spec.cluster
    setting = c.torch_threads
    if setting == "auto" and (not c.processes or c.scheduler_address is not None):
        n = cores()
        why = "threads mode: one process" if not c.processes else "a cluster of your own: each host's cores"
        return ThreadPlan(n, n, f"auto: {n} cores, {why}")
    return plan_threads(setting, rollout_workers=max(1, c.local_rollout_workers()),
                        synchronous=spec.dataflow.synchronous, trainers=len(spec.policies))




@dataclass(frozen=True)
class HostFacts:
    """What a process reports about where it runs: its host's name, the cores it may use, and OMP_NUM_THREADS when
    its environment sets it (a worker started with `OMP_NUM_THREADS=1`, as docs/cluster.md's recipe does)."""

    host: str
    cores: int
    omp: int | None


def host_facts() -> HostFacts:
    omp = os.environ.get("OMP_NUM_THREADS", "")
    return HostFacts(socket.gethostname(), cores(), int(omp) if omp.isdigit() and int(omp) > 0 else None)


def plan_shared_hosts(driver: HostFacts, rollout_workers: dict[str, HostFacts], *, trainers: int,
                      synchronous: bool) -> tuple[int, dict[str, int], str]:
    """`torch_threads: auto` on a cluster of your own: (the trainer's threads, each rollout worker's threads by
    address, why). Processes that work at once on one host share its cores: the rollout workers on a host split them,
    and on the driver's host the trainers (this process, or one process per policy) take their share too. A worker
    whose environment sets OMP_NUM_THREADS keeps at most that many. The synchronous mode alternates rollout and
    training, so there the trainers do not count against the rollout workers."""
    by_host: dict[str, list[str]] = {}
    for addr, facts in rollout_workers.items():
        by_host.setdefault(facts.host, []).append(addr)
    share_trainers = 0 if synchronous else max(1, trainers)
    threads: dict[str, int] = {}
    for host, addrs in by_host.items():
        here = share_trainers if host == driver.host else 0
        n = max(rollout_workers[a].cores for a in addrs)
        each = max(1, n // (len(addrs) + here))
        for a in addrs:
            omp = rollout_workers[a].omp
            threads[a] = min(each, omp) if omp else each
    local = [threads[a] for a in by_host.get(driver.host, [])]
    trainer = driver.cores if synchronous else max(1, (driver.cores - sum(local)) // max(1, trainers))
    shared = (f"{len(local)} rollout worker(s) on this host share its {driver.cores} cores with the trainer(s)"
              if local else "no rollout worker on this host")
    return trainer, threads, f"auto: a cluster of your own, {len(by_host)} host(s); {shared}"


# ------------------------------------------------------------------------------------------------------ Linear


def set_linear_backend(backend: str) -> None:
    """This process's choice for `nn.Linear` on CPU: auto, onednn or torch (module docstring)."""
    global _backend
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"cluster.cpu_linear: unknown {backend!r}; choose one of {list(LINEAR_BACKENDS)}")
    _backend = backend


def linear_backend() -> str:
    """The backend `use_linear_backend` applies in this process: onednn or torch ('auto' resolved)."""
    if _backend != "auto":
        return _backend if _onednn_available() else "torch"
    return "onednn" if onednn_speedup() >= _AUTO_MIN_SPEEDUP else "torch"


def onednn_speedup() -> float:
    """oneDNN's fp32 speed over torch's on a model-sized Linear ([64, 576] x [576, 1536]) with this process's
    threads, measured once (~0.1 s); 0 where oneDNN's linear is not available."""
    global _measured
    if _measured is None:
        _measured = _measure() if _onednn_available() else 0.0
    return _measured


def use_linear_backend(model: torch.nn.Module) -> torch.nn.Module:
    """Swap the CPU fp32/bf16 `nn.Linear` layers of `model` to `OneDNNLinear` when this process's backend is onednn
    (in place; returns the model). Layers on other devices, other dtypes and subclasses are left alone."""
    if linear_backend() != "onednn":
        return model
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
                and module.weight.dtype in (torch.float32, torch.bfloat16)):
            module.__class__ = OneDNNLinear
    return model


class OneDNNLinear(torch.nn.Linear):
    """`nn.Linear` computed by oneDNN on CPU (forward and backward); anything else falls back to `F.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.device.type != "cpu" or w.device.type != "cpu" or x.dtype != w.dtype
                or (x.numel() // max(1, x.shape[-1])) * w.numel() < _SMALL_PRODUCT):
            return torch.nn.functional.linear(x, w, self.bias)
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                        or (self.bias is not None and self.bias.requires_grad)):
            return _OneDNNLinearFn.apply(x, w, self.bias)
        return _linear(x, w, self.bias)


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias through oneDNN; x [..., in], w [out, in]."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


class _OneDNNLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = bias is not None
        return _linear(x, w, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _linear(grad, w.t().contiguous(), None)  # [..., out] @ [out, in]
        flat = grad.reshape(-1, grad.shape[-1])  # [M, out]
        if ctx.needs_input_grad[1]:
            xs = x.reshape(-1, x.shape[-1])  # [M, in]
            grad_w = _linear(flat.t().contiguous(), xs.t().contiguous(), None)  # [out, M] @ [M, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat.sum(0)
        return grad_x, grad_w, grad_b


def _onednn_available() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _measure(m: int = 64, k: int = 576, n: int = 1536, repeats: int = 8) -> float:
    x, w = torch.randn(m, k), torch.randn(n, k)
    try:
        _linear(x, w, None)
    except RuntimeError:
        return 0.0

    def seconds(fn: Any) -> float:
        fn(x, w, None)  # warm-up
        best = float("inf")
        for _ in range(3):  # the best of three rounds: other processes share these cores
            t = time.perf_counter()
            for _ in range(repeats):
                fn(x, w, None)
            best = min(best, time.perf_counter() - t)
        return best

    with torch.inference_mode():
        return seconds(torch.nn.functional.linear) / seconds(_linear)


def has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles or AVX512-BF16): `astratk.gpu.bf16_native`."""
    return bf16_native("cpu")


def bf16_warning(spec: Any) -> str | None:
    """One line when a run asks for bf16 on CPU processes of a CPU without bf16 units (`has_bf16_units`): which keys
    ask for it and what to set instead; None otherwise (or when the work runs on a GPU)."""
    if torch.cuda.is_available() or has_bf16_units():
        return None
    asked = [f"{p.policy_id}: trainer.precision {p.trainer.precision}" for p in spec.policies
             if str(p.trainer.precision).startswith("bf16") and not str(p.trainer.precision).endswith("if-native")]
    args = dict(spec.rollout.engine_args or {})
    if str(args.get("dtype", "")).lower() in ("bfloat16", "bf16") and str(args.get("device", "cpu")) in ("cpu", "auto"):
        asked.append(f"rollout.engine_args.dtype {args['dtype']}")
    if not asked:
        return None
    return (f"bf16 asked ({'; '.join(asked)}) on a CPU without bf16 matrix units (no AMX, no AVX512-BF16): torch "
            "emulates bf16 here and runs it 1.7-3.4x slower than float32; for speed on this machine set "
            "trainer.precision: bf16-mixed-if-native and rollout.engine_args.dtype: bfloat16-if-native (bf16 only "
            "where a CPU or GPU computes it natively)")

