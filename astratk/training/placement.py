"""Where a policy's trainer runs: Lightning's `accelerator`, `devices`, `precision` and `strategy`, resolved on this
machine. Apart from the trainer's wiring (`astratk.training.build`) because a run checks its placement before it
starts anything: that check needs torch, not Lightning (whose import alone took 3.4 s here), so a wrong setting is
reported at once."""

from __future__ import annotations

from typing import Any

from astratk.gpu import bf16_native
from astratk.spec import TrainerSpec


def placement(ts: TrainerSpec, key: str = "trainer") -> dict[str, Any]:
    """Lightning's `accelerator`, `devices`, `precision` and `strategy` for this trainer, with
    "auto" resolved on this machine: the GPU when torch sees one; bf16-mixed on a CUDA GPU that has
    bf16, 32-true elsewhere. "bf16-mixed-if-native" is bf16-mixed wherever the trainer's device computes bf16 in
    hardware (a CPU with AMX or AVX512-BF16 too), else 32-true. A GPU asked for and absent, or bf16 on a GPU without it, fails here,
    naming the key, before anything trains.

    >>> from astratk.spec import TrainerSpec
    >>> import torch
    >>> torch.cuda.is_available() or placement(TrainerSpec()) == {
    ...     "accelerator": "cpu", "devices": 1, "precision": "32-true", "strategy": "auto"}
    True
    """
    import torch

    cuda = torch.cuda.is_available()
    if ts.accelerator in ("gpu", "cuda") and not cuda:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"{key}.accelerator is {ts.accelerator!r} but torch {torch.__version__} "
                         f"({build}) sees no CUDA device; set {key}.accelerator: auto or cpu, or "
                         "install a CUDA build of torch")
    on_gpu = ts.accelerator in ("gpu", "cuda") or (ts.accelerator == "auto" and cuda)
    # native bf16 (compute capability >= 8.0), as the engines decide: torch's is_bf16_supported() also counts
    # emulated bf16 (a T4 says yes), which would be slower than fp32 there
    bf16 = on_gpu and bf16_native("cuda")
    precision = ts.precision
    if precision == "auto":
        precision = "bf16-mixed" if bf16 else "32-true"
    elif precision == "bf16-mixed-if-native":
        precision = "bf16-mixed" if (bf16 if on_gpu else bf16_native("cpu")) else "32-true"
    elif on_gpu and precision.startswith("bf16") and not bf16:
        raise ValueError(f"{key}.precision is {precision!r} but this GPU "
                         f"({torch.cuda.get_device_name()}) has no bf16; use 16-mixed or 32-true")
    accelerator = "gpu" if on_gpu else ("cpu" if ts.accelerator == "auto" else ts.accelerator)
    return {"accelerator": accelerator, "devices": ts.devices, "precision": precision,
            "strategy": ts.strategy}
