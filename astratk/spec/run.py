"""A policy (`PolicySpec`: its model, loss, trainer, corrections), a frozen model (`FrozenSpec`: served, never
trained) and the whole run (`RunSpec`), whose `validate()` runs every section's own checks and then the rules between
sections (`astratk.spec.rules`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from astratk.contracts import Env, PolicyLoss, TokenCorrection, check_double_weighting
from astratk.spec import rules
from astratk.spec.base import Section, default_plugin
from astratk.spec.cluster import ClusterSpec
from astratk.spec.dataflow import DataflowSpec
from astratk.spec.eval import EvalSpec
from astratk.spec.model import ModelSpec
from astratk.spec.rollout import RolloutSpec
from astratk.spec.trainer import TrainerSpec
from astratk.spec.weights import WeightsSpec


@dataclass
class PolicySpec(Section):
    SPEC_KEY = "policies[0]"

    policy_id: str = "main"
    """this policy's name: weight versions, metrics and env roles refer to it"""
    roles: list[str] = field(default_factory=lambda: ["policy"])
    """env roles this policy plays"""
    model: ModelSpec = field(default_factory=ModelSpec)
    """the model this policy trains: a directory or Hub id, or the built-in tiny model"""
    loss: PolicyLoss = field(default_factory=lambda: default_plugin("loss", "drpo"))
    """the policy loss, as class_path (a short name such as drpo, dppo_tv, ppo_clip, decoupled_ppo, or a dotted path)
    and init_args; DRPO by default"""
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    """the trainer of this policy (Lightning): budget, optimiser, placement"""
    corrections: list[TokenCorrection] = field(default_factory=list)
    """mismatch corrections, applied in order"""

    def validate(self, key: str = "policies[0]") -> None:
        """Its own fields; which env roles exist is the env's business (`astratk.spec.rules`)."""
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
        check_double_weighting(self.loss, self.corrections, key)
        self.trainer.validate(f"{key}.trainer")


@dataclass
class FrozenSpec(Section):
    """A model served on the rollout pool and never trained: a simulated user, an opponent or partner, a judge an
    env asks in its episodes. It plays env roles as a policy does (`roles`), on the same rollout workers (each worker
    that runs an episode serves both; `rollout_<name>` is its resource label, as for a policy), and every episode's
    calls to it are counted apart (`frozen/<name>/calls`, `tokens`, `seconds` in the trajectories' metrics). What it
    generates is never trained on: its role's trajectories are counted and left out of every batch."""

    SPEC_KEY = "frozen[0]"

    name: str = "frozen"
    """its name: env routes, metrics and resource labels refer to it (distinct from every policy's id)"""
    roles: list[str] = field(default_factory=list)
    """env roles it plays (e.g. [user])"""
    model: ModelSpec = field(default_factory=ModelSpec)
    """the model served: a directory, Hub id, GGUF file or pypi: wheel file, or the built-in tiny model; never
    LoRA adapters nor a warm start (nothing of it trains)"""
    engine: str | None = None
    """its rollout engine (torch, vllm, or a dotted path); null: the run's rollout.engine"""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """engine arguments over the run's rollout.engine_args (e.g. {dtype: bfloat16})"""
    temperature: float | None = None
    """its sampling temperature (0: greedy), whatever the env asks; null: the env's or the run's"""
    max_new_tokens: int | None = None
    """the most tokens one of its replies may have; null: the env's or the run's rollout.max_new_tokens"""

    def validate(self, key: str = "frozen[0]") -> None:
        if not isinstance(self.name, str) or not self.name.strip() or "/" in self.name:
            raise ValueError(f"{key}.name: give a non-empty name without '/' (it names metrics and a resource "
                             f"label), got {self.name!r}")
        if isinstance(self.roles, str) or not self.roles or not all(isinstance(r, str) for r in self.roles):
            raise ValueError(f"{key}.roles: give the env roles this model plays as a list, e.g. [user], got "
                             f"{self.roles!r}")
        self.model.validate(f"{key}.model")
        if self.model.lora is not None:
            raise ValueError(f"{key}.model.lora: a frozen model trains nothing; serve the model as it is (remove "
                             "lora), or make it a policy to train adapters")
        if self.model.warm_start is not None:
            raise ValueError(f"{key}.model.warm_start: a frozen model is served as it is; warm-start it in a run of "
                             "its own and give that model's directory as model.path")
        if not isinstance(self.engine_args, dict):
            raise ValueError(f"{key}.engine_args: a mapping of engine arguments, got {self.engine_args!r}")  # noqa: TRY004
        t = self.temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf")):
            raise ValueError(f"{key}.temperature: a number >= 0 (0: greedy) or null, got {t!r}")
        n = self.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"{key}.max_new_tokens: an integer >= 1 or null, got {n!r}")


@dataclass
class RunSpec(Section):
    SPEC_KEY = ""

    name: str = "run"
    """the run's name: its directory under output_dir is <name>-<date>-<time>-<4 hex digits>"""
    output_dir: str = "runs"
    """where run directories are written"""
    seed: int = 0
    """seed of the run: task order, sampling and the trainer"""
    env: Env = field(default_factory=lambda: default_plugin("env", "arithmetic"))
    """the environment, as class_path (a short name such as arithmetic, math_word, search, code, or a dotted path) and
    init_args"""
    policies: list[PolicySpec] = field(default_factory=lambda: [PolicySpec()])
    """the policies trained together; each plays one or more of the env's roles. `--policies.help` lists every
    policy key; a flag such as --policies.trainer.max_time_s 300 sets it on the last policy of the list (the only one
    in a single-policy run): set the others' in the YAML file"""
    frozen: list[FrozenSpec] = field(default_factory=list)
    """models served beside the policies and never trained (a simulated user, an opponent, a judge), each playing
    env roles: `FrozenSpec`"""
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
        """Check every section's fields and the rules between sections (`astratk.spec.rules`); raise ValueError
        naming the key and the fix. Returns the spec (`RunSpec(...).validate()` chains)."""
        return rules.validate(self)

    def policy(self, policy_id: str) -> PolicySpec:
        for p in self.policies:
            if p.policy_id == policy_id:
                return p
        raise KeyError(f"no policy {policy_id!r}; policies are "
                       f"{[p.policy_id for p in self.policies]}")

    def role_routes(self) -> dict[str, str]:
        """env role -> the policy_id (or frozen model's name) that plays it."""
        return {**{role: p.policy_id for p in self.policies for role in p.roles},
                **{role: f.name for f in self.frozen for role in f.roles}}

    def frozen_model(self, name: str) -> FrozenSpec | None:
        """The frozen model of that name, or None (a policy's id, or unknown)."""
        return next((f for f in self.frozen if f.name == name), None)

    def served_ids(self) -> list[str]:
        """Every model the rollout workers serve: the policies' ids, then the frozen models' names (each is a
        worker resource label `rollout_<id>`)."""
        return [p.policy_id for p in self.policies] + [f.name for f in self.frozen]

