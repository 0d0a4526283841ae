"""GPU placement shared by the engines, the trainers and the local cluster.

- `resolve_device` / `resolve_dtype`: what `rollout.engine_args.device` / `.dtype` mean on this machine. "auto" is
  the GPU, in bf16, when torch sees one that computes bf16 natively; else the CPU in fp32. "bfloat16-if-native" is
  bf16 wherever the device computes it in hardware, CPUs included (AMX or AVX512-BF16: `bf16_native("cpu")`), else
  fp32. A GPU asked for and absent, or bf16 on a GPU without it, fails naming the key.
- `reserve_memory`: this process's share of one GPU, summed over the holders in the process (a rollout worker's
  engines, an in-process trainer) and applied with `torch.cuda.set_per_process_memory_fraction`. Past it the caching
  allocator raises out-of-memory in this process, instead of taking memory that another process on the same GPU
  counts on (a colocated trainer and rollout worker).
- `check_fit`: the shares of everything placed on one GPU sum to at most 1 and fit in what is free now.
- `visible_gpus` / `rollout_gpus` / `cuda_visible_devices`: one local rollout worker per GPU, with
  CUDA_VISIBLE_DEVICES set per worker the way dask-cuda's `LocalCUDACluster` sets it (the list rotated so that the
  worker's own GPU is its `cuda:0`). Why not dask-cuda itself: no release of it installs beside this project's Dask
  (dask-cuda 26.10 needs rapids-dask-dependency 26.10, which pins dask < 2026.7.2; the project pins 2026.8.0).

torch is imported inside the functions: `astratk.spec.rules` calls them for every spec.

Example:
    >>> cuda_visible_devices(1, ["0", "1", "2"])
    '1,2,0'
    >>> check_fraction(0.4, "rollout.engine_args.gpu_memory_utilization")
    0.4
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16", "bfloat16-if-native")
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
GIB = float(1 << 30)

_SHARES: dict[int, dict[int, float]] = {}  # GPU index -> {holder id: fraction} in this process
_SHARES_LOCK = threading.Lock()


def _no_cuda(key: str, value: Any, fix: str | None = None) -> str:
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (f"{key} is {value!r} but torch {torch.__version__} ({build}) sees no CUDA device; "
            f"{fix or f'set {key}: auto or cpu'}, or install a CUDA build of torch")


def check_device_form(device: Any, key: str = "rollout.engine_args.device") -> re.Match | None:
    """Raise unless `device` is auto, cpu, cuda or cuda:N; the match of a cuda form (None: auto or cpu)."""
    match = re.fullmatch(r"cuda(?::(\d+))?", device) if isinstance(device, str) else None
    if device not in ("auto", "cpu") and match is None:
        raise ValueError(f"{key}: unknown device {device!r}; choose {DEVICE_FORMS}")
    return match


def resolve_device(device: str, key: str = "rollout.engine_args.device") -> str:
    """"cpu" or "cuda:N" for `device` (auto, cpu, cuda, cuda:N); auto is cuda:0 when torch sees a GPU."""
    import torch

    match = check_device_form(device, key)
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError(_no_cuda(key, device))
    index = int(match.group(1) or 0) if match else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"{key} is {device!r} but torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}; "
                         f"give one of them, or auto")
    return f"cuda:{index}"


def gpu_index(device: Any) -> int:
    """The index of a CUDA device given as "cuda", "cuda:N" or a torch.device."""
    import torch

    return torch.device(device).index or 0


def bf16_native(device: str) -> bool:
    """Whether the device computes bf16 in hardware: a GPU of compute capability 8.0 (Ampere) or newer; a CPU with
    AMX tiles or AVX512-BF16. Without them torch emulates bf16 matmuls, slower than fp32 (measured on an AVX-512
    Xeon without either: a 1600 x 576 x 1536 Linear 3.4x, a SmolLM2 prefill 2.2x, a bf16 engine 1.7x slower on
    multi-turn episodes)."""
    import torch

    if not device.startswith("cuda"):
        checks = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
        try:
            return any(bool(check()) for check in checks if check is not None)
        except Exception:  # noqa: BLE001 - an unknown CPU: assume the units are there (no warning rather than a wrong one)
            return True
    return torch.cuda.get_device_capability(gpu_index(device))[0] >= 8


def resolve_dtype(dtype: str, device: str, key: str = "rollout.engine_args.dtype") -> str:
    """The dtype an engine on `device` (resolved) runs: auto is bfloat16 on a GPU with native bf16, else float32;
    bfloat16-if-native is bfloat16 on any device with native bf16 (a CPU with AMX or AVX512-BF16 too), else float32."""
    import torch

    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"{key}: unknown dtype {dtype!r}; choose one of {list(ENGINE_DTYPES)}")
    cuda = device.startswith("cuda")
    if dtype == "auto":
        return "bfloat16" if cuda and bf16_native(device) else "float32"
    if dtype == "bfloat16-if-native":
        return "bfloat16" if bf16_native(device) else "float32"
    if dtype == "bfloat16" and cuda and not bf16_native(device):
        index = gpu_index(device)
        major, minor = torch.cuda.get_device_capability(index)
        raise ValueError(f"{key} is 'bfloat16' but {device} ({torch.cuda.get_device_name(index)}, compute "
                         f"capability {major}.{minor}) has no native bf16; use float16 or float32, or auto")
    return dtype


def check_fraction(value: Any, key: str) -> float | None:
    """A memory fraction in (0, 1], or None (no cap)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{key} must be a fraction of the GPU's memory in (0, 1] (e.g. 0.4) or null (no cap), "
                         f"got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------------------- this process's share


def reserve_memory(device: Any, fraction: float, holder: object) -> Callable[[], None]:
    """Add `holder`'s `fraction` of GPU `device` to this process's share and cap the process's caching allocator at
    the sum (at most 1); returns the function that takes it back (the cap returns to 1 when nothing holds a share).

    Several holders in one process (a rollout worker's rollout and evaluation engines; a threads-mode cluster's
    engines beside the trainer) add up, so each keeps what it was given."""
    index, token = gpu_index(device), id(holder)
    with _SHARES_LOCK:
        _SHARES.setdefault(index, {})[token] = fraction
        _apply_share(index)

    def release() -> None:
        with _SHARES_LOCK:
            if _SHARES.get(index, {}).pop(token, None) is not None:
                _apply_share(index)

    return release


def process_share(device: Any) -> float:
    """This process's share of GPU `device`: the sum of its holders' fractions (0: none reserved)."""
    with _SHARES_LOCK:
        return min(1.0, sum(_SHARES.get(gpu_index(device), {}).values()))


def _apply_share(index: int) -> None:
    import torch

    share = sum(_SHARES[index].values())
    torch.cuda.set_per_process_memory_fraction(min(1.0, share) if share else 1.0, index)


# ------------------------------------------------------------------------------------------ several processes


def check_fit(index: int, shares: Sequence[tuple[str, float]]) -> None:
    """The shares `(what, fraction)` placed on GPU `index` sum to at most 1 and fit in its free memory (what
    `torch.cuda.mem_get_info` reports, plus what this process's caching allocator holds unused); one-line errors
    name every key involved."""
    import torch

    if not shares:
        return
    total = sum(f for _, f in shares)
    asked = " + ".join(f"{what} {f:.2f}" for what, f in shares)
    name = torch.cuda.get_device_name(index)
    if total > 1.0 + 1e-9:
        raise ValueError(f"GPU {index} ({name}) is shared by {asked} = {total:.2f} of its memory, more than all of "
                         "it; lower them so that they sum to at most 1")
    free, capacity = torch.cuda.mem_get_info(index)
    # this process's own cache, unused, counts as free to the processes about to start
    free += torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    if total * capacity > free:
        raise ValueError(f"GPU {index} ({name}) has {free / GIB:.1f} GiB free of {capacity / GIB:.1f} GiB, but "
                         f"{asked} ask for {total:.2f} x {capacity / GIB:.1f} = {total * capacity / GIB:.1f} GiB; "
                         "lower them, or free the GPU (nvidia-smi shows who holds it)")


# ---------------------------------------------------------------------------------- one rollout worker per GPU


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices or UUIDs), in torch's order
    (entry i is cuda:i); all of the machine's when the variable is unset."""

    import torch

    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        names = [g.strip() for g in given.split(",") if g.strip()]
        return names[:torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def rollout_gpus(value: str | Sequence[int], key: str = "cluster.rollout_gpus") -> list[str]:
    """The GPUs of `cluster.rollout_gpus` ("all", or indices as torch numbers this process's GPUs: cuda:N), as
    CUDA_VISIBLE_DEVICES names them; errors name the key."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(_no_cuda(key, value, f"remove {key} (the rollout workers then use the CPU)"))
    visible = visible_gpus()
    if value == "all":
        return visible
    bad = [i for i in value if not 0 <= i < len(visible)]
    if bad:
        raise ValueError(f"{key}: torch sees {len(visible)} GPU(s), cuda:0 to cuda:{len(visible) - 1}, so "
                         f"{bad} name none of them; give indices among them, or all")
    return [visible[i] for i in value]


def cuda_visible_devices(i: int, visible: Sequence[Any]) -> str:
    """CUDA_VISIBLE_DEVICES for worker `i` of one worker per GPU in `visible`, as dask-cuda's
    `dask_cuda.utils.cuda_visible_devices` makes it: the list rotated so that GPU i comes first (the worker's
    cuda:0); the worker still sees the others after it."""
    names = [str(v) for v in visible]
    return ",".join(names[i:] + names[:i])
