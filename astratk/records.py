"""The small, typed records that cross component boundaries (docs/architecture.md, "Records").

Only these records and `WeightRef`s cross Dask's scheduler; tensors move through the weight store or
are built by the trainer (`TrainBatch` is collated trainer-side from the groups the data layer
serves). Token sequences are plain tuples of ints so records pickle small and compare by value.

Extending: add a field with a default at the end, so records pickled by an older worker still load.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

# annotations only: records load without torch (they cross Dask's scheduler)
if TYPE_CHECKING:
    import torch

    from astratk.spec import RunSpec

Split = Literal["train", "heldout"]


@dataclass(frozen=True)
class Task:
    """One problem an env can roll out. `info` holds what scoring needs (the answer, unit tests,
    corpus ids...)."""

    task_id: str
    env: str
    prompt: str
    info: dict[str, Any] = field(default_factory=dict)
    split: Split = "train"


@dataclass(frozen=True)
class Trajectory:
    """One (episode, role): the tokens a policy saw and produced, and how the engine sampled them.

    `loss_mask`, `behavior_logprobs` and `behavior_versions` cover the completion, i.e. have length
    `len(tokens) - n_prompt`. Tokens the policy did not produce (tool or environment output in a
    multi-turn episode) have loss_mask 0, behaviour log-prob 0.0 and version -1.
    """

    task_id: str
    group_id: str
    policy_id: str
    role: str
    tokens: tuple[int, ...]
    n_prompt: int
    loss_mask: tuple[int, ...]
    # engine log-probs at the sampling temperature
    behavior_logprobs: tuple[float, ...]
    # weight version that produced each completion token; -1 for env tokens
    behavior_versions: tuple[int, ...]
    reward: float | None = None
    # False when the completion hit its token budget
    finished: bool = True
    # the rollout service (worker) that produced it
    service: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    # the completion as the env decoded it (graders read this; envs own tokenizers)
    text: str = ""
    # Only when the run's loss needs them (DPPO Top-K): per completion token, the engine's top-K ids
    # and log-probs; env tokens get empty tuples. Length len(tokens) - n_prompt, or empty.
    behavior_topk_ids: tuple[tuple[int, ...], ...] = ()
    behavior_topk_logprobs: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.tokens) - self.n_prompt
        if n < 0:
            raise ValueError(f"trajectory {self.group_id}: n_prompt={self.n_prompt} > "
                             f"len(tokens)={len(self.tokens)}")
        names: tuple[str, ...] = ("loss_mask", "behavior_logprobs", "behavior_versions")
        if self.behavior_topk_ids or self.behavior_topk_logprobs:
            names += ("behavior_topk_ids", "behavior_topk_logprobs")
        for name in names:
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.group_id}: len({name})={len(getattr(self, name))} must "
                    f"equal the completion length len(tokens) - n_prompt = {n}"
                )

    @property
    def completion(self) -> tuple[int, ...]:
        return self.tokens[self.n_prompt :]

    @property
    def version(self) -> int:
        """Lowest weight version on any policy-produced token (-1 if the policy produced none)."""
        # every token is the policy's (single turn): min() in C
        if self.loss_mask and min(self.loss_mask) > 0:
            return min(self.behavior_versions)
        produced = [v for v, m in zip(self.behavior_versions, self.loss_mask, strict=True) if m]
        return min(produced) if produced else -1

    def with_reward(self, reward: float) -> Trajectory:
        return dataclasses.replace(self, reward=float(reward))


@dataclass(frozen=True)
class Group:
    """The unit of admission, filtering, staleness, replay and batching: one role's samples for one
    task.

    Advantages are fixed at admission (one per trajectory, broadcast over its completion tokens by
    the collate). `weight` is set at serving (lag decay; `astratk.dataflow.stages.serving`) and
    multiplies every token's weight.
    """

    group_id: str
    task: Task
    policy_id: str
    trajectories: tuple[Trajectory, ...]
    advantages: tuple[float, ...] | None = None
    weight: float = 1.0

    @functools.cached_property
    def version(self) -> int:
        """A group's version is the lowest version on any of its tokens (the version staleness
        compares). Cached: serving reads it for every buffered group at every step (fields are
        frozen, so it cannot change)."""
        versions = [v for v in (t.version for t in self.trajectories) if v >= 0]
        return min(versions) if versions else -1

    @property
    def role(self) -> str:
        """The env role its samples play (one role per group); empty for a group without
        trajectories."""
        return self.trajectories[0].role if self.trajectories else ""

    @property
    def rewards(self) -> tuple[float, ...]:
        if any(t.reward is None for t in self.trajectories):
            raise ValueError(f"group {self.group_id} has unscored trajectories; run the env's "
                             "score() first")
        return tuple(float(t.reward) for t in self.trajectories)  # type: ignore[arg-type]


@dataclass(frozen=True)
class WeightRef:
    """A published weight version: small and picklable; the tensors stay in the weight store."""

    policy_id: str
    version: int
    uri: str
    kind: Literal["full", "delta"] = "full"
    base_version: int | None = None
    nbytes: int = 0
    checksum: str = ""
    # time.time() at publication
    published_at: float = 0.0


@dataclass(frozen=True)
class Lease:
    """One task handed out for rollout by the data layer (`astratk.dataflow.leases`). A re-issue
    keeps the lease id and counts the attempt, so a slow original and its re-issue cannot both be
    admitted."""

    lease_id: str
    task: Task
    # env role -> policy_id
    routes: dict[str, str]
    # on the data layer's clock
    deadline: float
    attempt: int = 1


# What became of one lease's result at the data layer (`astratk.dataflow.leases`): `new` (admitted),
# `late` (admitted after the lease had been dropped following its last attempt), `held` (synchronous
# mode: admitted with its round), `duplicate` (already admitted), `late_refused` or `unknown` (not a
# lease of this layer, or not its task).
AdmitStatus = Literal["new", "late", "held", "duplicate", "late_refused", "unknown"]


@dataclass(frozen=True)
class AdmitOutcome:
    lease_id: str
    status: AdmitStatus
    # groups that joined a buffer in this call (a completed synchronous round counts them all)
    admitted: int = 0

    @property
    def duplicate(self) -> bool:
        return self.status == "duplicate"


# where on the data path, in path order
DropStage = Literal["curation", "rollout", "admission", "serving"]
DROP_STAGES: tuple[DropStage, ...] = ("curation", "rollout", "admission", "serving")


@dataclass(frozen=True)
class Drop:
    """Data the data layer dropped, counted (`DataLayer.drops()`): where, why, what was dropped and
    whose.

    Units: `tasks` (refused by a curator, failed `max_task_attempts` times, or a prompt longer than
    the model's context: `prompt_too_long`), `results` (a rollout's result refused: `unknown_lease`,
    `late_refused`), `trajectories` (`unscored`), `groups` (`empty`, a filter's reason, `stale`,
    `overflow`). `policy` is "" for task-level drops. `task_ids`: the first tasks dropped, for drops
    counted per task (`prompt_too_long`)."""

    stage: DropStage
    reason: str
    unit: Literal["tasks", "results", "trajectories", "groups"]
    policy: str
    count: float
    task_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class AdmitReport:
    """`DataLayer.admit_many`'s answer: an outcome per lease, and the policies' versions after
    admission (the "current" of version-lag metrics)."""

    outcomes: tuple[AdmitOutcome, ...]
    versions: dict[str, int]

    @property
    def admitted(self) -> int:
        return sum(o.admitted for o in self.outcomes)

    @property
    def duplicates(self) -> int:
        return sum(o.duplicate for o in self.outcomes)


@dataclass
class TrainBatch:
    """Padded tensors for one rank's share of one optimiser step. Built by the trainer's collate,
    never shipped.

    Position t of every [B, T] tensor describes the prediction of `input_ids[:, t + 1]` from
    `input_ids[:, : t + 1]`, so the trainer's log-probs line up with them directly (T = longest
    sequence - 1).
    """

    # [B, T+1] int64, right-padded with pad_id
    input_ids: torch.Tensor
    # [B, T+1] int64, 1 on real tokens
    attention_mask: torch.Tensor
    # [B, T] float32, 1 on policy-produced completion tokens
    loss_mask: torch.Tensor
    # [B, T] float32, engine log-probs at the sampling temperature, 0 elsewhere
    behavior_logprobs: torch.Tensor
    # [B, T] float32, trajectory advantage broadcast over its completion tokens
    advantages: torch.Tensor
    # [B, T] float32, per-token sample weights from serving stages (1 by default)
    weights: torch.Tensor
    # [B, T] int64, behaviour version per token, -1 off the completion
    versions: torch.Tensor
    n_groups: int = 0
    # [B] float32
    rewards: torch.Tensor | None = None
    # [B, T, K] int64, engine's top-K ids (0 off the completion)
    topk_ids: torch.Tensor | None = None
    # [B, T, K] float32, their log mu (0 off the completion)
    topk_behavior_logprobs: torch.Tensor | None = None
    # [B] the env role of each row (workflows train one policy on several roles)
    roles: tuple[str, ...] = ()

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


# ------------------------------------------------------------------------------- rollout tasks
@dataclass(frozen=True)
class RunContext:
    """What a worker needs to serve a run: picklable, passed with every task. Treat it as immutable
    once shipped: it is pickled once per process and unpickled once per process (`__reduce__`)."""

    run_id: str
    # the whole run's configuration (`astratk.spec`)
    spec: RunSpec
    # policy_id -> HF model dir (version 0)
    model_paths: dict[str, str]
    store_url: str
    # the kernel behind CPU Linear layers the driver chose for `cluster.cpu_linear: auto` (onednn | torch), so that
    # every process of the run uses the same one (a worker's own micro-benchmark, taken while the machine is busy
    # starting the run, could choose otherwise); None: each process resolves `cluster.cpu_linear` itself
    cpu_linear: str | None = None
    # torch threads of each rollout worker by address, where the driver planned them per host (`torch_threads: auto`
    # on a cluster of your own: `astratk.cpu.plan_shared_hosts`); None: each process follows `cpu.run_threads`
    rollout_threads: dict[str, int] | None = None

    def __reduce__(self) -> tuple:
        """The context travels with every rollout and score task, and its env may hold data
        (arithmetic's held-out set: ~45 KB); pickling and unpickling it per task doubled the CPU
        cost of a rollout chunk (bench/scaling.py). So the bytes are made once here, and each
        receiving process rebuilds the object once."""
        blob = self.__dict__.get("_pickled")
        if blob is None:
            # envs may hold lambdas; Dask pickles task arguments with cloudpickle too
            import cloudpickle

            blob = cloudpickle.dumps((self.run_id, self.spec, self.model_paths, self.store_url, self.cpu_linear,
                                      self.rollout_threads))
            object.__setattr__(self, "_pickled", blob)
        return (ShippedContext, (blob,))


class Shipped:
    """An object pickled once where it is made, carried as bytes, and unpickled only where it is used (`open()`).

    Why: a Dask scheduler unpickles the arguments of every task it is sent (the task graph). A run's spec holds the
    user's env, whose reward functions come from the user's own modules; unpickling it on the scheduler would make
    the scheduler import them, and a scheduler on a head node has no reason to have that code. Shipped, the scheduler
    sees bytes only; the workers that run the task open it (once per process: cached by content)."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    @classmethod
    def of(cls, obj: Any) -> Shipped:
        import cloudpickle  # envs may hold lambdas

        return cls(cloudpickle.dumps(obj))

    def __reduce__(self) -> tuple:
        return (type(self), (self.blob,))

    def open(self) -> Any:
        obj = _OPENED.get(self.blob)
        if obj is None:
            if len(_OPENED) >= 8:  # a process serves few runs; keep the newest
                _OPENED.pop(next(iter(_OPENED)))
            obj = _OPENED[self.blob] = self._build(self.blob)
        return obj

    @staticmethod
    def _build(blob: bytes) -> Any:
        return pickle.loads(blob)


# pickled bytes -> what they carry, rebuilt once in this process
_OPENED: dict[bytes, Any] = {}


class ShippedContext(Shipped):
    """A `RunContext` as it travels (`RunContext.__reduce__`): bytes until a worker's task opens it. Its attributes
    read through to the opened context, so code handed one works as with the context itself."""

    __slots__ = ()

    @staticmethod
    def _build(blob: bytes) -> RunContext:
        ctx = RunContext(*pickle.loads(blob))
        object.__setattr__(ctx, "_pickled", blob)  # pickled again (a worker's own submissions): the same bytes
        return ctx

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.open(), name)


def opened(obj: Any) -> Any:
    """`obj` itself, or what it carries when it was shipped (`Shipped`)."""
    return obj.open() if isinstance(obj, Shipped) else obj


@dataclass(frozen=True)
class LeaseResult:
    lease_id: str
    groups: tuple[Group, ...]
    # generation time of this lease, including any simulated slowdown
    seconds: float
    # the worker that rolled it out
    service: str
    # that worker's class (`astratk.runtime.pools`)
    hardware: str = "default"
    # policy -> engine version at start
    synced_versions: dict[str, int] = dataclasses.field(default_factory=dict)
    # the lease's attempt (what `DataLayer.release` names when this attempt failed)
    attempt: int = 1
    # why this attempt produced no groups: "episode_timeout", "score_timeout" (rollout.*_timeout_s); None: it did
    failure: str | None = None
    # why the task was dropped before generation ("prompt_too_long": its prompt does not fit the model's context):
    # the data layer drops it, counted with its id, and never re-issues it (every attempt would end alike)
    dropped: str | None = None
    # seconds of its chunk in which the worker's engines also ran on threads a waiting trainer lent (`idle_cores`)
    lent_s: float = 0.0
