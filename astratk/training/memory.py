"""`GpuMemoryShare`: a trainer process's share of its GPU (`trainer.gpu_memory_fraction`).

Why a callback: the in-process trainer and `astratk train fit` both run `astratk.training.build.callbacks`, and only
once Lightning has placed the module does the process know its GPU (`trainer.strategy.root_device`). The share is
added to whatever else this process holds on that GPU (a threads-mode cluster's engines) through
`astratk.gpu.reserve_memory`, which caps torch's caching allocator at the sum; it is given back when the fit ends.
"""

from __future__ import annotations

from typing import Any

from astratk import gpu
from astratk.training._pl import pl


class GpuMemoryShare(pl.Callback):
    """Cap this process's CUDA allocations on the trainer's GPU at `fraction` of its memory during the fit (no-op
    on the CPU).

    Example:
        >>> trainer = pl.Trainer(callbacks=[GpuMemoryShare(0.5)], accelerator="gpu")  # doctest: +SKIP
    """

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self._release: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda" and self._release is None:
            self._release = gpu.reserve_memory(device, self.fraction, self)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._release is not None:
            self._release()
            self._release = None
