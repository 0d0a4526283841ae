"""Callbacks that watch training: a per-step metrics recorder (for the xarray metrics) and a live progress line."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from astratk.training._pl import pl


class StepRecorder(pl.Callback):
    """Keeps every step's metrics with its wall-clock time and the time the trainer waited for data, and why the fit
    was stopped before its last step when a callback stopped it (`stop_reason`: the divergence guard's)."""

    def __init__(self, stream: Any, extra: Callable[[], dict[str, float]] | None = None) -> None:
        self.stream = stream
        self.extra = extra
        self.rows: list[dict[str, float]] = []
        self.stop_reason: str | None = None
        self.t0: float | None = None
        self._step_start = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.t0 = time.time()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pid = pl_module.policy_id
        row = dict(pl_module.step_metrics)
        row[f"train/{pid}/step"] = float(trainer.global_step)
        row[f"train/{pid}/time_s"] = time.time() - (self.t0 or time.time())
        row[f"train/{pid}/step_compute_s"] = time.perf_counter() - self._step_start
        row[f"train/{pid}/data_wait_s"] = self.stream.last_wait_s
        if self.extra is not None:
            row.update(self.extra())
        self.rows.append(row)


class ProgressPrinter(pl.Callback):
    """One line every `every_s` seconds: step, version, reward, loss, data wait, plus what `status()` adds."""

    def __init__(self, recorder: StepRecorder, status: Callable[[], str] | None = None, every_s: float = 5.0,
                 printer: Callable[[str], None] = print) -> None:
        self.recorder = recorder
        self.status = status
        self.every_s = every_s
        self.printer = printer
        self._last = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s or not self.recorder.rows:
            return
        self._last = now
        pid = pl_module.policy_id
        row = self.recorder.rows[-1]
        recent = self.recorder.rows[-10:]
        reward = sum(r.get(f"train/{pid}/reward_mean", 0.0) for r in recent) / len(recent)
        wait = sum(r[f"train/{pid}/data_wait_s"] for r in recent) / len(recent)
        line = (f"[{row[f'train/{pid}/time_s']:6.1f}s] {pid} step {trainer.global_step:4d}  "
                f"v{pl_module.policy_version}  reward(10) {reward:.3f}  loss {row.get(f'train/{pid}/loss', 0):+.4f}"
                f"  stale {row.get(f'train/{pid}/staleness_mean', 0):.2f}  wait {wait:.2f}s")
        if self.status is not None:
            line += "  " + self.status()
        self.printer(line)


class StopFile(pl.Callback):
    """Stop training after the current step once `path` exists (how `Run.stop()` reaches trainers in this process
    and in trainer processes alike)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.path.exists():
            trainer.should_stop = True
