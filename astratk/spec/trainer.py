"""How a policy trains (`TrainerSpec`, with its divergence guard `DivergenceSpec`), and the names its fields choose
from: Lightning's accelerators and precisions, the loss aggregations, the loggers and what each needs installed."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from astratk.registry import check_choice
from astratk.spec.base import Section, finite, positive

# How per-token losses become a step's loss (`astratk.training.aggregation` computes each).
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                 "token-sum")


def _mlflow_store() -> str | None:
    if os.environ.get("MLFLOW_TRACKING_URI") or importlib.util.find_spec("sqlalchemy"):
        return None
    return ("its local store (a SQLite database: MLflow 3 refuses new file stores) needs the full mlflow package, "
            "not mlflow-skinny: pip install mlflow, or set MLFLOW_TRACKING_URI to your tracking server")


@dataclass(frozen=True)
class LoggerNeeds:
    """What a trainer logger (`trainer.loggers`) needs here; `astratk.training.loggers` builds it."""

    modules: tuple[str, ...] = ()  # importable modules it needs (any one of them); () for none
    install: str = ""  # the command that installs them
    check: Callable[[], str | None] | None = None  # a further requirement: None when met, else what is missing + fix


LOGGERS: dict[str, LoggerNeeds] = {
    "csv": LoggerNeeds(),
    "tensorboard": LoggerNeeds(("tensorboard", "tensorboardX"), "pip install tensorboard"),
    "wandb": LoggerNeeds(("wandb",), "pip install wandb"),
    "mlflow": LoggerNeeds(("mlflow",), "pip install mlflow", _mlflow_store),
}


def check_loggers(names: Sequence[str], key: str = "trainer.loggers") -> list[str]:
    """`names` as a list, or a ValueError naming the bad entry and the fix: an unknown name (with the choices),
    a repeated one, or one whose package is not installed (with the pip command)."""
    if isinstance(names, str):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
            f"{key}: expected a list of logger names, e.g. [{names!r}]; got the string {names!r}")
    for i, name in enumerate(names):
        check_choice("logger", name, LOGGERS, where=f"{key}[{i}]")
        if name in names[:i]:
            raise ValueError(f"{key}[{i}]: {name!r} is listed twice")
        needs = LOGGERS[name]
        if needs.modules and not any(importlib.util.find_spec(m) for m in needs.modules):
            raise ValueError(f"{key}[{i}]: the {name!r} logger needs {' or '.join(needs.modules)}, which is not "
                             f"installed here: {needs.install} (or drop {name!r} from {key})")
        if needs.check is not None and (problem := needs.check()):
            raise ValueError(f"{key}[{i}]: the {name!r} logger: {problem} (or drop {name!r} from {key})")
    return list(names)


@dataclass
class DivergenceSpec(Section):
    """The trainer's divergence guard (`astratk.training.divergence`). A step whose loss or gradient norm
    is not finite, or whose gradient norm is above `spike_factor` x the median norm of the last `window`
    steps it accepted, is skipped: no weight update, nothing published, counted in
    `train/<policy>/skipped_steps`. `max_skips` skipped steps in a row stop the run, saying why. The
    defaults never fire on a healthy run: finite values, and norms within 100x of their median."""

    SPEC_KEY = "trainer.divergence"

    spike_factor: float | None = 100.0
    """a gradient norm above this many times the running median is a spike; null: only non-finite loss or gradient norm
    skips a step"""
    window: int = 100
    """accepted steps whose gradient norms make the running median (spikes are looked for once it holds 10)"""
    max_skips: int = 3
    """skipped steps in a row that stop the run"""

    def validate(self, key: str = "trainer.divergence") -> None:
        f = self.spike_factor
        if f is not None and not 1.0 < f < float("inf"):
            raise ValueError(f"{key}.spike_factor must be > 1 (a gradient norm this many times its "
                             f"running median is a spike) or null (non-finite values only), got {f}")
        for name in ("window", "max_skips"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key}.{name} must be an integer >= 1, got {v!r}")


# Lightning's accelerator names and precision values that a trainer accepts ("auto": see TrainerSpec).
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true", "bf16-mixed-if-native")


@dataclass
class TrainerSpec(Section):
    SPEC_KEY = "trainer"

    max_steps: int = 200
    """optimiser steps (data-layer batches) to train; max_time_s may end training earlier"""
    max_time_s: float | None = None
    """stop training after this many seconds (None: run max_steps)"""
    groups_per_step: int = 16
    """prompts per optimiser step (each with rollout.group_size samples)"""
    lr: float = 1e-4
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """clip the gradient's global norm to this before each update (0: no clipping)"""
    publish_every: int = 1
    """publish weights every k optimiser steps"""
    publish_in_background: bool = True
    """Write each publication on a background thread while the next step computes: the trainer only copies the weights
    out (one write in flight; checkpoints and the end of training wait for it). False: the trainer blocks until the
    store has the version. The synchronous mode always blocks."""
    aggregation: str = "seq-mean-token-sum-norm"
    """how per-token losses become the step's loss: token-mean, seq-mean-token-mean, seq-mean-token-sum,
    seq-mean-token-sum-norm (Dr. GRPO; the default) or token-sum"""
    horizon: int | None = None
    """H for seq-mean-token-sum-norm; None = rollout.max_new_tokens"""
    batch_timeout_s: float = 300.0
    """longest wait for one step's batch: then the run stops early, saying what became of the data (the wait also ends,
    normally, at max_time_s)"""
    kl_coef: float = 0.0
    """> 0: add kl_coef * KL(pi || reference) per token (reference = the starting model)"""
    kl_estimator: str = "k3"
    """k3 (non-negative) or k1 (astratk.training.regularizers)"""
    entropy_coef: float = 0.0
    """> 0: subtract entropy_coef * H(pi) per token (entropy bonus)"""
    max_staleness: int | None = None
    """this policy's staleness bound; None: dataflow.max_staleness"""
    checkpoint_every: int | None = 100
    """save a Lightning checkpoint (and a matching data-layer snapshot) every k steps into <run
    dir>/checkpoints/<policy>, for resume_from; None: no checkpoints"""
    checkpoint_keep: int | None = 3
    """checkpoints kept, the newest; None keeps all"""
    micro_batch_tokens: int | str | None = "auto"
    """Cut each optimiser step's batch into micro-batches of at most this many padded tokens (rows x longest row) and
    accumulate their gradients: activation memory scales with it, the update is the same. None: one forward. auto:
    one forward while the step's tokens fit half the memory available at the first step, by an estimate of the
    model's activation bytes per token (`astratk.training.activations`), micro-batches of that size above it."""
    share_prompts: bool = True
    """Run each distinct prompt of a step's batch once and continue every sample from its cache (the G samples of a
    group share their prompt): the same log-probs and gradients, fewer tokens through forward and backward
    (quickstart: 2.7x faster). Checked against the padded forward on the first batch; a model that differs falls back
    with a warning. Off under FSDP."""
    updates_per_batch: int = 1
    """Optimiser updates per data-layer batch (PPO's mini-batches): the step's batch is cut into this many row slices,
    each one AdamW update in turn, and the weights are published once after the last. Losses that need the proximal
    policy (decoupled_ppo, DPPO recompute, TIS/MIS) get it from one no-grad forward before the first update, so their
    trust region binds on the later slices. 1: one update per batch. Versions and max_steps count batches, not
    updates."""
    loggers: list[str] = field(default_factory=lambda: ["csv"])
    """Lightning loggers of the trainer's per-step metrics, by name (astratk.training.loggers): csv, tensorboard, wandb
    (offline unless WANDB_MODE is set), mlflow; [] for none (the run's metrics.nc does not need them)."""
    accelerator: str = "auto"
    """Where and how the trainer runs, with Lightning's own names and meaning (`pl.Trainer`). accelerator: auto (the GPU
    when torch sees one), cpu, gpu / cuda, mps."""
    devices: int = 1
    """Devices per trainer process. A run's in-process trainer uses one; more is data parallel in a trainer job
    (`astratk train fit`)."""
    precision: str = "auto"
    """auto: bf16-mixed on a CUDA GPU with bf16, else 32-true; bf16-mixed-if-native: bf16-mixed wherever the device
    computes bf16 in hardware (a CPU with AMX or AVX512-BF16 too; emulated bf16 runs 1.7-3.4x slower than fp32 on a
    CPU without them), else 32-true; or any of PRECISIONS."""
    strategy: str = "auto"
    """Lightning's strategy name (auto, ddp, fsdp...)."""
    gpu_memory_fraction: float | None = None
    """On a GPU: the share of its memory this trainer's process may allocate (torch's set_per_process_memory_fraction),
    so that a rollout worker on the same GPU keeps its own (rollout.engine_args.gpu_memory_utilization); checked at
    start against the others. None: no cap."""
    divergence: DivergenceSpec | None = field(default_factory=DivergenceSpec)
    """Skip steps whose loss or gradient norm is not finite or spikes, and stop after divergence.max_skips of them in a
    row (DivergenceSpec); null: no guard."""

    def validate(self, key: str = "trainer") -> None:
        """Ranges; `aggregation` and `loggers` name entries of other modules' tables
        (`astratk.spec.rules`)."""
        positive(key, max_steps=self.max_steps, groups_per_step=self.groups_per_step, lr=self.lr,
                  publish_every=self.publish_every, batch_timeout_s=self.batch_timeout_s)
        u = self.updates_per_batch
        if isinstance(u, bool) or not isinstance(u, int) or u < 1:
            raise ValueError(f"{key}.updates_per_batch must be an integer >= 1 (optimiser updates per "
                             f"data-layer batch; 1 = one update), got {u!r}")
        finite(key, lr=self.lr, weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                kl_coef=self.kl_coef, entropy_coef=self.entropy_coef)
        if self.max_time_s is not None and not self.max_time_s > 0:
            raise ValueError(f"{key}.max_time_s must be > 0 seconds or null (run max_steps), got "
                             f"{self.max_time_s}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(f"{key}: weight_decay and grad_clip must be >= 0 (grad_clip 0 = no "
                             f"clipping), got {self.weight_decay}, {self.grad_clip}")
        if self.horizon is not None and self.horizon < 1:
            raise ValueError(f"{key}.horizon must be >= 1 token or null (rollout.max_new_tokens), "
                             f"got {self.horizon}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"{key}: kl_coef and entropy_coef must be >= 0 (0 = off), got "
                             f"{self.kl_coef}, {self.entropy_coef}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"{key}.max_staleness must be >= 0 or null (dataflow.max_staleness), "
                             f"got {self.max_staleness}")
        if self.checkpoint_keep is not None and self.checkpoint_keep < 1:
            raise ValueError(f"{key}.checkpoint_keep must be >= 1 or null (keep all), got {self.checkpoint_keep}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"{key}.checkpoint_every must be >= 1 step or null (no checkpoints), "
                             f"got {self.checkpoint_every}")
        check_micro_batch_tokens(self.micro_batch_tokens, f"{key}.micro_batch_tokens")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"{key}.kl_estimator: unknown {self.kl_estimator!r}; "
                             "choose 'k1' or 'k3'")
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"{key}.accelerator: unknown {self.accelerator!r}; choose one of "
                             f"{sorted(ACCELERATORS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"{key}.precision: unknown {self.precision!r}; choose one of "
                             f"{sorted(PRECISIONS)}")
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise ValueError(f"{key}.devices must be a number of devices >= 1, got {self.devices!r}")
        f = self.gpu_memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError(f"{key}.gpu_memory_fraction must be a fraction of the GPU's memory in "
                             f"(0, 1] (e.g. 0.5) or null (no cap), got {f!r}")
        if self.divergence is not None:
            self.divergence.validate(f"{key}.divergence")


def check_micro_batch_tokens(value: object, key: str) -> None:
    """`trainer.micro_batch_tokens` is an integer >= 1, auto or None; anything else is refused in one line."""
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an integer >= 1 (padded tokens per micro-batch), auto (sized from the model "
                         f"and the memory available) or null (the whole step's batch in one forward); got {value!r}")
