"""The one place a policy's Lightning trainer is wired, for both ways a run trains.

- In process (`astratk run` with one policy, a notebook): `build_trainer` returns the Trainer,
  the `PolicyModule` and the data module, ready to `fit`.
- A trainer job (`astratk train fit`, `astratk.runtime.trainer_job`): LightningCLI builds the
  module and the Trainer from config, so the module's typed constructor stays the job's config;
  every piece the command line does not give comes from here: `module_args`, `group_stream`,
  `trainer_flags`, `checkpoint_args`, `callbacks`, `loggers`, `fit_result`.

Everything derives from the run's `PolicySpec` / `TrainerSpec` plus what the caller holds: the data
layer's handle, the weight store and the directories to write to. Nothing here knows Dask or
deployments.

Extending: a new trainer setting goes into `TrainerSpec`, then here, once, for both paths.

Example:
    >>> from astratk.spec import RunSpec
    >>> spec = RunSpec()
    >>> module_args(spec, "main")["lr"] == spec.policies[0].trainer.lr
    True
    >>> trainer_flags(spec.policies[0].trainer)["max_steps"]
    200
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astratk.dataflow.client import DataLayerClient
from astratk.spec import RunSpec, TrainerSpec
from astratk.training._pl import pl
from astratk.training.data import GroupStream, RolloutDataModule
from astratk.training.loggers import log_config, make_loggers
from astratk.training.memory import GpuMemoryShare
from astratk.training.module import PolicyModule
from astratk.training.placement import placement
from astratk.training.recorder import ProgressPrinter, StepRecorder, StopFile
from astratk.weights.store import WeightStore


def module_args(spec: RunSpec, policy_id: str) -> dict[str, Any]:
    """`PolicyModule`'s keyword arguments for `policy_id`: all but the model directory."""
    p = spec.policy(policy_id)
    ts = p.trainer
    return {"loss": p.loss, "policy_id": policy_id, "lr": ts.lr, "weight_decay": ts.weight_decay,
            "temperature": spec.rollout.temperature, "aggregation": ts.aggregation,
            "horizon": ts.horizon or spec.rollout.max_new_tokens, "corrections": p.corrections,
            "kl_coef": ts.kl_coef, "kl_estimator": ts.kl_estimator,
            "entropy_coef": ts.entropy_coef, "micro_batch_tokens": ts.micro_batch_tokens,
            "lora": p.model.lora, "share_prompts": ts.share_prompts, "updates_per_batch": ts.updates_per_batch}


def group_stream(spec: RunSpec, policy_id: str, datalayer: DataLayerClient, model_path: str, *,
                 start_step: int = 0, max_steps: int | None = None, rank: int = 0,
                 world_size: int = 1) -> GroupStream:
    """The policy's step batches from `datalayer`, padded with the model's pad token; `max_steps`
    defaults to the policy's `trainer.max_steps`."""
    from astratk.models.loading import load_tokenizer

    ts = spec.policy(policy_id).trainer
    tokenizer = load_tokenizer(model_path)  # checked to round-trip, as the engines load it
    # padding is masked out of the loss: any id does; the pad token, else end-of-text (Llama-style tokenizers)
    pad_id = None if tokenizer is None else next(
        (i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), None)
    if pad_id is None:
        raise ValueError(f"the model directory {model_path!r} of policy {policy_id!r} has no tokenizer with a pad "
                         "or end-of-text token; the trainer pads batches with one (save the tokenizer with it)")
    return GroupStream(datalayer, policy_id, pad_id, start_step=start_step,
                       max_steps=ts.max_steps if max_steps is None else max_steps,
                       timeout_s=ts.batch_timeout_s, rank=rank, world_size=world_size)


def trainer_flags(ts: TrainerSpec, key: str = "trainer") -> dict[str, Any]:
    """The Lightning Trainer flags a policy's `trainer:` section sets, placement included. The
    values also pass LightningCLI's validation (it takes `max_time` as a dict of ints only), so the
    trainer job puts them into its config."""
    return {**placement(ts, key), "max_steps": ts.max_steps, "max_time": _duration(ts.max_time_s),
            "gradient_clip_val": ts.grad_clip or None,
            "enable_checkpointing": bool(ts.checkpoint_every), "num_sanity_val_steps": 0,
            "log_every_n_steps": 1, "enable_progress_bar": False, "enable_model_summary": False}


def _duration(seconds: float | None) -> dict[str, int] | None:
    """`max_time_s` in Lightning's dict form (`timedelta(**d)`), exact to the microsecond."""
    if not seconds:
        return None
    whole = math.floor(seconds)
    micro = round((seconds - whole) * 1e6)
    return {"seconds": whole, "microseconds": micro} if micro else {"seconds": whole}


def checkpoint_args(ts: TrainerSpec, dirpath: str | Path) -> dict[str, Any] | None:
    """`ModelCheckpoint`'s arguments, or None when the policy writes no checkpoints: every
    `checkpoint_every` steps into `dirpath/step=K.ckpt`, all kept (resume finds them by step, and
    the data layer snapshots itself when each one's version is published)."""
    if not ts.checkpoint_every:
        return None
    return {"dirpath": str(dirpath), "filename": "{step}",
            "every_n_train_steps": ts.checkpoint_every, "save_top_k": -1, "save_last": False,
            "enable_version_counter": False}


class PruneCheckpoints(pl.Callback):
    """Keep the newest `keep` checkpoints (`step=K.ckpt`) in the directory ModelCheckpoint writes to; older ones are
    deleted after each step (on the global rank 0 only)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep

    def _prune(self, trainer: pl.Trainer) -> None:
        if trainer.global_rank != 0:
            return
        for cb in trainer.checkpoint_callbacks:
            dirpath = getattr(cb, "dirpath", None)
            if not dirpath or not Path(dirpath).is_dir():
                continue
            ckpts = sorted((p for p in Path(dirpath).glob("step=*.ckpt") if p.stem[5:].isdigit()),
                           key=lambda p: int(p.stem[5:]))
            for old in ckpts[:-self.keep]:
                old.unlink(missing_ok=True)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._prune(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._prune(trainer)


def callbacks(spec: RunSpec, policy_id: str, *, stream: GroupStream, store: WeightStore,
              stop_file: str | Path, progress: bool = True,
              printer: Callable[[str], None] = print, status: Callable[[], str] | None = None,
              extra: Callable[[], dict[str, float]] | None = None,
              ) -> tuple[list[pl.Callback], StepRecorder]:
    """The callbacks every trainer of `policy_id` runs, and the step recorder among them.

    They publish the weights every `publish_every` steps (to `store`, telling the stream's data
    layer), record each step's metrics (plus what `extra()` returns), stop after the step in which
    `stop_file` appears and, when the spec asks for progress and `progress` is true, print a
    progress line (plus what `status()` returns), and cap the process's share of its GPU at
    `trainer.gpu_memory_fraction` when set. With `trainer.divergence` set, a guard skips (and does
    not publish) steps whose loss or gradient norm is not finite or spikes, and stops the run after
    `max_skips` of them in a row. The publisher comes before the recorder, so a step's row holds
    its publication's metrics."""
    from astratk.training.divergence import DivergenceGuard
    from astratk.training.publish import WeightPublisher

    recorder = StepRecorder(stream, extra=extra)
    stream.stop_file = Path(stop_file)  # a stop also ends a wait for a batch, not only the step after it
    ts = spec.policy(policy_id).trainer
    publisher = WeightPublisher(store, stream.datalayer, policy_id, ts.publish_every,
                                publish_skipped=spec.dataflow.synchronous, background=ts.publish_in_background)
    out: list[pl.Callback] = [publisher, recorder, StopFile(stop_file)]
    if ts.checkpoint_every and ts.checkpoint_keep:  # runs after ModelCheckpoint (a trainer's own callbacks come last)
        out.append(PruneCheckpoints(ts.checkpoint_keep))
    if ts.divergence is not None:
        out.append(DivergenceGuard(ts.divergence, policy_id, recorder,
                                   printer=printer if spec.progress and progress else None))
    if spec.progress and progress:
        out.append(ProgressPrinter(recorder, status, printer=printer))
    if (fraction := spec.policy(policy_id).trainer.gpu_memory_fraction) is not None:
        out.append(GpuMemoryShare(fraction))  # on a GPU: this process's share (trainer.gpu_memory_fraction)
    return out, recorder


def loggers(ts: TrainerSpec, root: str | Path) -> Any:
    """The policy's Lightning loggers under `root/lightning`; False for none (not [], and not None,
    which would give Lightning's own default logger)."""

    return make_loggers(ts.loggers, Path(root), "lightning") or False


def fit_result(recorder: StepRecorder, error: BaseException | None = None) -> dict[str, Any]:
    """What a finished fit reports to the run, in process or through a trainer job's steps.json:
    every step's metrics row, the seconds spent waiting for data, the groups trained on in order,
    and `stop_reason`: why it ended before its last step, in words (the stream starved, training
    diverged, or `error`, an exception the fit raised), None when it did not."""
    stream = recorder.stream
    reason = recorder.stop_reason or stream.stop_reason
    if error is not None:
        reason = (f"the trainer failed after {len(recorder.rows)} step(s): "
                  f"{type(error).__name__}: {' '.join(str(error).split())}")
    return {"rows": recorder.rows, "data_wait_s": stream.total_wait_s,
            "group_ids": stream.group_ids, "stop_reason": reason}


@dataclass(frozen=True)
class PolicyTrainer:
    """One policy's trainer in this process; `fit()` trains to the end and returns `fit_result`."""

    trainer: pl.Trainer
    module: PolicyModule
    datamodule: RolloutDataModule
    recorder: StepRecorder

    @property
    def stream(self) -> GroupStream:
        return self.datamodule.stream

    def fit(self, ckpt_path: str | Path | None = None) -> dict[str, Any]:
        """Train; `fit_result`. An exception the fit raises does not lose the steps before it: the
        result keeps them, with the failure as `stop_reason` and the exception under `error` (the
        run writes its outputs, then raises it)."""
        try:
            self.trainer.fit(self.module, datamodule=self.datamodule,
                             ckpt_path=str(ckpt_path) if ckpt_path is not None else None)
        except Exception as e:  # noqa: BLE001 - reported with the steps gathered so far
            return {**fit_result(self.recorder, e), "error": e}
        return fit_result(self.recorder)


def build_trainer(spec: RunSpec, policy_id: str, *, model_path: str, stream: GroupStream,
                  store: WeightStore, run_dir: str | Path, stop_file: str | Path,
                  printer: Callable[[str], None] = print, status: Callable[[], str] | None = None,
                  extra: Callable[[], dict[str, float]] | None = None) -> PolicyTrainer:
    """The in-process trainer of `policy_id` on one device (`placement`): the module from `model_path`,
    batches from `stream` (`group_stream`), weights published to `store`, checkpoints in
    `run_dir/checkpoints/<policy>`, loggers in `run_dir/lightning`; it stops after the step in
    which `stop_file` appears."""
    ts = spec.policy(policy_id).trainer
    key = f"policies[{[p.policy_id for p in spec.policies].index(policy_id)}].trainer"
    flags = trainer_flags(ts, key)
    if ts.devices != 1:
        raise ValueError(f"{key}.devices is {ts.devices}: the run's in-process trainer uses one "
                         "device; train on several as a trainer job (`astratk deploy`, then "
                         f"`astratk train fit --policy_id {policy_id}`), or set {key}.devices: 1")
    module = PolicyModule(model_path, **module_args(spec, policy_id))
    steps, recorder = callbacks(spec, policy_id, stream=stream, store=store, stop_file=stop_file,
                                printer=printer, status=status, extra=extra)
    ckpt = checkpoint_args(ts, Path(run_dir) / "checkpoints" / policy_id)
    if ckpt is not None:
        steps.append(pl.callbacks.ModelCheckpoint(**ckpt))

    made = loggers(ts, run_dir)
    log_config(made, spec)  # the whole resolved config, the loss's class and arguments included
    trainer = pl.Trainer(logger=made, callbacks=steps, **flags)
    return PolicyTrainer(trainer, module, RolloutDataModule(stream), recorder)
