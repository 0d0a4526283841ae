"""`RunSpec`: the one configuration schema (DESIGN §2), shared by the notebook, the CLI and cluster jobs.

Plain dataclasses: defaults live here once, YAML only overrides (parsed by jsonargparse in `astratk.config`).
Plug-ins are typed by their contract (`env: Env`, `loss: PolicyLoss`), so YAML gives them as `class_path` /
`init_args` (a registry short name such as `drpo` is sugar for the dotted path) and a notebook passes instances:
`PolicySpec(loss=DRPO(delta=0.5))`. A constructor is its plug-in's config, so bad values fail at parse time; envs
and losses must be cheap to pickle (they travel to workers and the data-layer actor with the spec).
`RunSpec.validate()` checks cross-field rules and raises naming the key to change.

Extending: add a field with a default to the dataclass that owns the concept; later issues add stage specs here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astratk.contracts import Env, PolicyLoss, TokenCorrection
from astratk.registry import REGISTRY, resolve_path


@dataclass
class TinyModelSpec:
    """The built-in tiny Qwen2-architecture model (built and warm-started when `ModelSpec.path` is empty)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4  # head dimension = hidden_size / num_heads must be >= 32 (vLLM CPU attention)
    num_kv_heads: int = 2
    intermediate_size: int = 384
    # Longest sequence (prompt + every turn) the model serves; multi-turn envs (search, agents) need more than 256.
    # Engines size their KV cache by it (vLLM: max_batch x max_positions tokens).
    max_positions: int = 256
    # Supervised warm start on the env's demonstrations (astratk.models.warm_start): RL should start from well-formed,
    # partly right answers. It stops once the running exact-match on unseen train batches reaches the target (None:
    # run every step); the steps are a cap. Default arithmetic env: ~30% held-out in under a minute on one thread.
    warm_start_steps: int = 1000
    warm_start_batch: int = 32
    warm_start_lr: float = 1e-3
    warm_start_target: float | None = 0.3
    seed: int = 0


@dataclass
class ModelSpec:
    path: str | None = None  # an HF model directory (config, safetensors, tokenizer); None builds the tiny model
    tiny: TinyModelSpec = field(default_factory=TinyModelSpec)
    cache_dir: str | None = None  # default: $ASTRATK_CACHE or ~/.cache/astratk

    def validate(self, key: str) -> None:
        if self.path is not None:
            p = Path(self.path).expanduser()
            if not (p / "config.json").is_file():
                raise ValueError(f"{key}.path: {str(p)!r} is not an HF model directory (no config.json there); "
                                 f"give a directory saved with save_pretrained, or remove {key}.path to build the "
                                 "tiny model")
        t = self.tiny
        if t.hidden_size % t.num_heads or t.hidden_size // t.num_heads < 32:
            raise ValueError(f"{key}.tiny: hidden_size / num_heads must be an integer >= 32 (vLLM's CPU attention "
                             f"needs it); got {t.hidden_size} / {t.num_heads}")


@dataclass
class TrainerSpec:
    max_steps: int = 200
    max_time_s: float | None = None  # stop training after this many seconds (None: run max_steps)
    groups_per_step: int = 16  # prompts per optimiser step (each with rollout.group_size samples)
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    publish_every: int = 1  # publish weights every k optimiser steps
    aggregation: str = "seq-mean-token-sum-norm"
    horizon: int | None = None  # H for seq-mean-token-sum-norm; None = rollout.max_new_tokens
    batch_timeout_s: float = 300.0  # longest wait for one step's batch before the trainer fails, naming the wait
    kl_coef: float = 0.0  # > 0: add kl_coef * KL(pi || reference) per token (reference = the starting model)
    kl_estimator: str = "k3"  # k3 (non-negative) or k1 (astratk.training.regularizers)
    entropy_coef: float = 0.0  # > 0: subtract entropy_coef * H(pi) per token (entropy bonus)


@dataclass
class PolicySpec:
    policy_id: str = "main"
    roles: list[str] = field(default_factory=lambda: ["policy"])  # env roles this policy plays
    model: ModelSpec = field(default_factory=ModelSpec)
    loss: PolicyLoss = field(default_factory=lambda: _default("loss", "drpo"))
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    corrections: list[TokenCorrection] = field(default_factory=list)  # mismatch corrections, applied in order


def _check_engine(name: str) -> None:
    """`rollout.engine` names a known engine whose packages are installed (workers share the client's environment)."""
    path = resolve_path("engine", name)
    if path == REGISTRY["engine"]["vllm"] and importlib.util.find_spec("vllm") is None:
        from astratk.engines._vllm_compat import INSTALL_HINT

        raise ValueError(f"rollout.engine: {name!r} needs vLLM, which is not installed here: {INSTALL_HINT}")


@dataclass
class RolloutSpec:
    engine: str = "torch"
    group_size: int = 8  # samples per task; one group
    temperature: float = 1.0
    max_new_tokens: int = 8
    tasks_per_chunk: int = 8  # tasks per rollout Dask task (their episodes share engine batches)
    max_inflight_chunks: int = 2  # acquisition keeps this many chunks in flight per rollout worker
    max_batch: int = 512  # most sequences the engine decodes together
    # extra keyword arguments for the engine's constructor, e.g. {gpu_memory_utilization: 0.4} for vllm
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataflowSpec:
    max_staleness: int = 4  # drop groups whose oldest token is more than this many versions behind
    lease_timeout_s: float = 120.0  # a leased task not admitted by then is re-issued
    advantage: str = "dr_grpo"  # group advantage: dr_grpo | grpo | rloo (astratk.dataflow.advantages)
    filter_zero_variance: bool = True  # drop groups whose rewards are all equal (no learning signal), counted
    max_task_attempts: int = 3  # a task whose rollout failed this many times is dropped, counted
    prefetch_steps: float = 2.0  # back-pressure: lease only while buffered + in-flight tasks < this many steps' worth


@dataclass
class ClusterSpec:
    scheduler_address: str | None = None  # None: start a local cluster
    processes: bool = True  # local cluster of worker processes; False: threads in this process (debuggers)
    rollout_workers: int = 1
    threads_per_worker: int = 1
    torch_threads: int = 1  # per process; 2-core machines oversubscribe otherwise
    dashboard: bool = False
    startup_timeout_s: float = 120.0


@dataclass
class WeightsSpec:
    url: str | None = None  # fsspec URL of the weight store; None: <run dir>/weights
    keep_last: int | None = 32  # snapshots kept behind the newest (version 0 is always kept); None keeps all


@dataclass
class EvalSpec:
    interval_s: float = 15.0  # wall-clock interval between held-out evaluations during training
    max_tasks: int = 512  # held-out tasks evaluated each time (greedy decoding)
    timeout_s: float = 300.0


@dataclass
class RunSpec:
    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    env: Env = field(default_factory=lambda: _default("env", "arithmetic"))
    policies: list[PolicySpec] = field(default_factory=lambda: [PolicySpec()])
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    dataflow: DataflowSpec = field(default_factory=DataflowSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    weights: WeightsSpec = field(default_factory=WeightsSpec)
    progress: bool = True

    def validate(self) -> RunSpec:
        """Build every plug-in once and check ranges; raise ValueError naming the key and the fix."""
        env = self.env
        if not isinstance(env, Env):
            raise ValueError(f"env: expected an astratk.contracts.Env, got {type(env).__name__}")  # noqa: TRY004 - config errors are ValueErrors
        if not self.policies:
            raise ValueError("policies: at least one policy is required")
        seen: dict[str, str] = {}  # env role -> the policy that plays it
        for i, p in enumerate(self.policies):
            _validate_policy(p, f"policies[{i}]", env, seen)
        missing = [r for r in env.roles if r not in seen]
        if missing:
            raise ValueError(f"policies: no policy plays env {env.name!r} role(s) {missing}; add them to a "
                             "policy's roles")
        r = self.rollout
        _check_engine(r.engine)
        _positive("rollout", group_size=r.group_size, max_new_tokens=r.max_new_tokens,
                  tasks_per_chunk=r.tasks_per_chunk, max_inflight_chunks=r.max_inflight_chunks, max_batch=r.max_batch)
        if r.temperature <= 0:
            raise ValueError(f"rollout.temperature: training rollouts sample, so it must be > 0 (got "
                             f"{r.temperature}); greedy decoding is for evaluation")
        if self.dataflow.max_staleness < 0:
            raise ValueError(f"dataflow.max_staleness must be >= 0, got {self.dataflow.max_staleness}")
        _positive("dataflow", lease_timeout_s=self.dataflow.lease_timeout_s, prefetch_steps=self.dataflow.prefetch_steps,
                  max_task_attempts=self.dataflow.max_task_attempts)
        from astratk.dataflow.advantages import get_advantage

        try:
            get_advantage(self.dataflow.advantage)
        except ValueError as e:
            raise ValueError(f"dataflow.advantage: {e}") from None
        _positive("cluster", rollout_workers=self.cluster.rollout_workers,
                  threads_per_worker=self.cluster.threads_per_worker)
        _positive("eval", interval_s=self.eval.interval_s, max_tasks=self.eval.max_tasks)
        if self.weights.keep_last is not None and self.weights.keep_last < 1:
            raise ValueError(f"weights.keep_last must be >= 1 or null (keep all), got {self.weights.keep_last}")
        return self

    def policy(self, policy_id: str) -> PolicySpec:
        for p in self.policies:
            if p.policy_id == policy_id:
                return p
        raise KeyError(f"no policy {policy_id!r}; policies are {[p.policy_id for p in self.policies]}")

    def role_routes(self) -> dict[str, str]:
        """env role -> policy_id."""
        return {role: p.policy_id for p in self.policies for role in p.roles}


def _validate_policy(p: PolicySpec, key: str, env: Env, seen: dict[str, str]) -> None:
    """One policy's checks; records the roles it plays in `seen` (a role may be played by one policy only)."""
    from astratk.training.aggregation import AGGREGATIONS

    p.model.validate(f"{key}.model")
    if not isinstance(p.loss, PolicyLoss):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
            f"{key}.loss: expected an astratk.contracts.PolicyLoss, got {type(p.loss).__name__}")
    for role in p.roles:
        if role not in env.roles:
            raise ValueError(f"{key}.roles: env {env.name!r} has no role {role!r}; its roles are {list(env.roles)}")
        if role in seen:
            raise ValueError(f"{key}.roles: role {role!r} is already played by policy {seen[role]!r}")
        seen[role] = p.policy_id
    for j, corr in enumerate(p.corrections):
        if not isinstance(corr, TokenCorrection):
            raise ValueError(f"{key}.corrections[{j}]: expected an astratk.contracts.TokenCorrection, got "  # noqa: TRY004
                             f"{type(corr).__name__}")
    t = p.trainer
    _positive(f"{key}.trainer", max_steps=t.max_steps, groups_per_step=t.groups_per_step, lr=t.lr,
              publish_every=t.publish_every)
    if t.kl_coef < 0 or t.entropy_coef < 0:
        raise ValueError(f"{key}.trainer: kl_coef and entropy_coef must be >= 0 (0 = off), got "
                         f"{t.kl_coef}, {t.entropy_coef}")
    if t.kl_estimator not in ("k1", "k3"):
        raise ValueError(f"{key}.trainer.kl_estimator: unknown {t.kl_estimator!r}; choose 'k1' or 'k3'")
    if t.aggregation not in AGGREGATIONS:
        raise ValueError(f"{key}.trainer.aggregation: unknown {t.aggregation!r}; choose one of "
                         f"{sorted(AGGREGATIONS)}")


def _default(kind: str, name: str):
    from astratk.registry import resolve

    return resolve(kind, name)()


def _positive(key: str, **values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{key}.{name} must be > 0, got {v}")
