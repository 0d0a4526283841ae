"""The contracts the autonomous components meet through: engines, envs and losses.

Core code depends on these and never on a concrete env or loss; configs name implementations by dotted path or by a
registry short name (`astratk.registry`).

Extending:
- an engine implements `Engine` (async `generate`, `load_weights`, `version`, `tokenizer`);
- an env subclasses `Env` (`tasks`, async `rollout`, `score`) and names roles, never policies;
- a loss subclasses `PolicyLoss`; its constructor is its config, `__call__` returns per-token losses already multiplied
  by the effective mask it returns. Aggregation over tokens happens once, in the trainer (`astratk.training.aggregation`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from astratk.records import Task, Trajectory

if TYPE_CHECKING:  # annotations only: the contracts (and the spec that names them) load without torch
    import torch

    from astratk.weights.delta import SparseDelta

# --------------------------------------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. temperature 0 means greedy (log-probs then come from the untempered softmax)."""

    temperature: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_k_logprobs: int = 0  # K > 0: return the top-K log-probs per token (DPPO's Top-K divergences), K <= 20
    # Generation also ends at the token whose decoded text completes one of these strings (searched in the generated
    # text only, not the prompt); that token is kept, as a stop token is. Needs an engine with a tokenizer.
    stop: tuple[str, ...] = ()
    # n > 1: n independent samples of the prompt, returned one after another in the request's place (see
    # `expand_samples`); sample j is seeded with seed + j when a seed is given.
    n: int = 1

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.top_k_logprobs <= 20:
            raise ValueError(f"top_k_logprobs must be in [0, 20], got {self.top_k_logprobs}")
        if isinstance(self.stop, str) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # log mu(token) of the distribution actually sampled (temperature applied)
    versions: tuple[int, ...]  # weight version that produced each token
    finish_reason: Literal["stop", "length"]
    # With `SamplingParams.top_k_logprobs = K > 0`: per token, the K most likely ids of the sampled distribution and
    # their log-probs (same temperature as `logprobs`), most likely first. Empty otherwise.
    topk_ids: tuple[tuple[int, ...], ...] = ()
    topk_logprobs: tuple[tuple[float, ...], ...] = ()


def expand_samples(requests: Sequence[GenerationRequest]) -> list[GenerationRequest]:
    """Requests with `params.n = k` become k requests with n = 1 (seeds seed, seed + 1, ... when seeded), in place:
    an engine returns `sum(r.params.n for r in requests)` completions, each request's samples together, in order."""
    out: list[GenerationRequest] = []
    for r in requests:
        if r.params.n == 1:
            out.append(r)
            continue
        seed = r.params.seed
        for j in range(r.params.n):
            params = replace(r.params, n=1, seed=None if seed is None else seed + j)
            out.append(GenerationRequest(r.prompt_ids, params))
    return out


class PromptTooLong(ValueError):
    """A prompt that leaves no room for a single new token in the model's context (`max_model_len`). The rollout
    service drops its task before generation, counted (`prompt_too_long`, with the task id); nothing retries it."""

    def __init__(self, n_prompt: int, max_model_len: int,
                 where: str = "the model's context (max_model_len: its max_position_embeddings)") -> None:
        super().__init__(f"a prompt of {n_prompt} tokens leaves no room for a new token in {where}, "
                         f"{max_model_len} positions; shorten the prompt, or allow a longer context")
        self.n_prompt, self.max_model_len = n_prompt, max_model_len


def fit_context(request: GenerationRequest, max_model_len: int | None) -> GenerationRequest:
    """`request` within a context of `max_model_len` positions (None: no limit): its token budget cut to the room the
    prompt leaves (the completion then ends as "length" at the last position), or `PromptTooLong` when the prompt
    leaves none. Engines and the rollout service apply it, so nothing generates past the model's position limit.

    >>> fit_context(GenerationRequest((1, 2, 3), SamplingParams(max_tokens=16)), 8).params.max_tokens
    5
    """
    if max_model_len is None:
        return request
    room = max_model_len - len(request.prompt_ids)
    if room < 1:
        raise PromptTooLong(len(request.prompt_ids), max_model_len)
    if request.params.max_tokens <= room:
        return request
    return replace(request, params=replace(request.params, max_tokens=room))


@runtime_checkable
class Engine(Protocol):
    """One model at one weight version. Concurrent `generate` calls are merged into batches by the engine.

    `generate` returns one completion per sample, in request order: a request with `params.n = k` has its k samples
    in its place (`expand_samples`). An engine may say how many positions its model holds (prompt + completion) as
    an `int` attribute `max_model_len` (TorchEngine and VLLMEngine do; None or absent: no limit known); the rollout
    service then fits every request into it (`fit_context`)."""

    @property
    def version(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]: ...

    def load_weights(self, state: Mapping[str, torch.Tensor] | SparseDelta, version: int) -> None:
        """Full or partial state by parameter name, or a `SparseDelta` whose `base_version` is the engine's version."""


# ------------------------------------------------------------------------------------------------------------ envs


class Env(abc.ABC):
    """What an agent does and how it is scored. An env names roles; `PolicySpec.routes` maps them to policies.

    `rollout` returns one trajectory per role for one episode; the rollout service runs `group_size` episodes of a
    task concurrently (their generate calls share the engine's batches) and assembles the group. `sampling` carries
    the run's temperature, token budget and seed; the env adds its stop tokens. `score` runs on CPU, possibly in
    another process, and returns one reward per trajectory (None = could not score; counted and dropped).
    """

    name: str = "env"
    roles: tuple[str, ...] = ("policy",)

    @abc.abstractmethod
    def tasks(self, split: str) -> Iterable[Task]:
        """`train`: a deterministic stream (may be endless); `heldout`: a fixed, finite list disjoint from train."""

    @abc.abstractmethod
    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]: ...

    @abc.abstractmethod
    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]: ...

    def score_with_metrics(self, task: Task, trajectories: Sequence[Trajectory]
                           ) -> list[tuple[float | None, dict[str, float]]]:
        """`score` plus per-trajectory scoring metrics (tests passed, sandbox isolation used...), which the rollout
        service merges into each trajectory's `metrics`. Envs whose scoring measures something override this."""
        return [(r, {}) for r in self.score(task, trajectories)]

    def demonstration(self, task: Task) -> str:
        """A reference completion for supervised warm starts; envs without one raise."""
        raise NotImplementedError(f"env {self.name!r} has no demonstrations; give model.path instead of a warm start")

    def demonstrations(self, task: Task) -> list[tuple[list[dict[str, str]], str]]:
        """(opening messages, reference completion) pairs for supervised warm starts; one per role for workflows, one
        per assistant turn for agents. A third item, OpenAI-style tool definitions, is passed to the chat template."""
        return [(self.messages(task), self.demonstration(task))]

    def messages(self, task: Task) -> list[dict[str, str]]:
        """The chat messages that open an episode (warm starts train on them; single-turn envs roll out from them)."""
        raise NotImplementedError(f"env {self.name!r} does not expose its opening messages")

    def signal_advice(self, means: Mapping[str, float]) -> list[str]:
        """What to change when a run or probe sees little learning signal, read from this env's own trajectory
        metrics: `means` maps `<role>/<metric>` to its mean over the episodes seen (a run's so far, a probe's). The
        lines join the generic advice of the starvation line and `astratk probe`, first. None by default."""
        return []

    def heldout_metrics(self, episodes: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        """Figures over a whole held-out evaluation beyond each role's mean score (a verifier's balanced accuracy,
        which a mean cannot give): `episodes` holds each greedy held-out episode's trajectories, scored (`reward`
        set; an episode that timed out is empty). Reported with the evaluation under these names. None by default."""
        return {}

    def grade(self, task: Task, text: str) -> float:
        """Reward of one completion text, for envs whose score is a pure function of the text."""
        raise NotImplementedError(f"env {self.name!r} has no text grader")


def split_tasks(split: str, heldout: Sequence[Task], train: Callable[[], Iterator[Task]]) -> Iterator[Task]:
    """`Env.tasks` for the common shape: a fixed held-out list and a train stream made on demand; any other split
    name is refused, naming the two."""
    if split == "heldout":
        return iter(heldout)
    if split != "train":
        raise ValueError(f"unknown split {split!r}; choose 'train' or 'heldout'")
    return train()


# ---------------------------------------------------------------------------------------------------------- losses


@dataclass
class LossInputs:
    """Everything a policy loss may use, per token, aligned as `TrainBatch` documents."""

    logprobs: torch.Tensor  # [B, T] log pi (requires grad), at the rollout temperature
    behavior_logprobs: torch.Tensor  # [B, T] log mu from the engine that sampled
    advantages: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] 1 on policy-produced completion tokens
    weights: torch.Tensor | None = None  # [B, T] per-token weights (serving stages, mismatch corrections); they scale
    #   token_losses but never the returned mask, so they do not change aggregation denominators
    # Filled by the trainer only when the loss asks for them (PolicyLoss.needs_*):
    proximal_logprobs: torch.Tensor | None = None  # [B, T] log pi_old: the trainer's no-grad forward at the start
    #   of the step (the proximal policy); recompute-anchored ablations, M2PO's clip form, TIS/MIS
    topk_ids: torch.Tensor | None = None  # [B, T, K] int64, the engine's top-K token ids at each position
    topk_behavior_logprobs: torch.Tensor | None = None  # [B, T, K] log mu of those ids (sampling temperature)
    topk_logprobs: torch.Tensor | None = None  # [B, T, K] log pi of those ids (requires grad)
    sampled_ids: torch.Tensor | None = None  # [B, T] int64, the sampled token at each position (input_ids[:, 1:]),
    #   filled with the top-K fields: a Top-K divergence matches it against topk_ids by id
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # sum over data-parallel ranks (all-reduce) for
    #   batch-wide statistics; None = single process (identity)


@dataclass
class LossOutputs:
    token_losses: torch.Tensor  # [B, T] per-token loss to minimise, already multiplied by `mask`
    mask: torch.Tensor  # [B, T] effective mask: the tokens that count in the aggregation denominator
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # scalar diagnostics, detached


class PolicyLoss(abc.ABC):
    """A policy loss. `required_aggregation` is None unless the loss only makes sense with one mode (GSPO).

    Declarations the trainer reads before a step: `needs_proximal` (fill `LossInputs.proximal_logprobs`),
    `needs_topk` (K > 0: ask the engine for top-K log-probs and fill the `topk_*` fields), `batch_statistics`
    (the loss computes statistics over the whole batch, e.g. M2PO's second moment: under DDP the trainer passes
    all-reduced values through `reduce`), `weights_by_behavior_ratio` (the loss itself multiplies each token by
    pi_prox / mu, as decoupled PPO does: a correction that re-weights by the same ratio is then refused, see
    `check_double_weighting`)."""

    required_aggregation: str | None = None
    needs_proximal: bool = False
    needs_topk: int = 0
    batch_statistics: bool = False
    weights_by_behavior_ratio: bool = False

    @abc.abstractmethod
    def __call__(self, inputs: LossInputs) -> LossOutputs: ...


@dataclass
class CorrectionOutput:
    weights: torch.Tensor  # [B, T] detached, multiplies LossInputs.weights (1 off the mask)
    keep: torch.Tensor  # [B, T] 0/1 in logprobs' dtype, multiplies LossInputs.loss_mask
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # detached scalars


class TokenCorrection(abc.ABC):
    """A per-token mismatch correction. The trainer applies a list of them in order before the loss
    (`weights *= out.weights`, `loss_mask *= out.keep`); each sees the previous ones' weights and mask."""

    name: str = "correction"
    needs_proximal: bool = True  # every correction compares the proximal policy with the engine's
    reweights: bool = True  # its `weights` multiply tokens by (a function of) pi_prox / mu; False: it only masks

    @abc.abstractmethod
    def __call__(self, inputs: LossInputs) -> CorrectionOutput: ...


def check_double_weighting(loss: PolicyLoss, corrections: list[TokenCorrection] | tuple[TokenCorrection, ...],
                           key: str = "policy") -> None:
    """Refuse a loss that weights each token by pi_prox / mu itself combined with a correction that weights by it again
    (decoupled PPO with `TIS` or `MIS(weight=True)`: the importance weight would be applied twice, w^2)."""
    if not getattr(loss, "weights_by_behavior_ratio", False):
        return
    for j, corr in enumerate(corrections):
        if getattr(corr, "reweights", True):
            raise ValueError(
                f"{key}.corrections[{j}]: {corr!r} weights each token by pi_prox / mu, which {type(loss).__name__} "
                f"already does: the weight would be applied twice. Keep MIS(weight=False) for its mask only, or use "
                f"the loss's own behavior_weight_cap (cap_mode 'mask' or 'truncate') instead")
