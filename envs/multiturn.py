"""Multi-turn machinery shared by agent envs: a conversation in token space, tool calls parsed from generations,
environment output appended with loss mask 0, turn and token budgets, per-trajectory metrics.

The engine sees token ids only and nothing is re-tokenised: a `Conversation` starts from the chat
template's prompt, appends each assistant completion exactly as sampled (loss mask 1, its log-probs and versions),
and appends environment or tool output as the chat template would render the next message (loss mask 0, log-prob
0, version -1). The tokens between an assistant's content and the next generation prompt are derived once per
tokenizer and role from the template itself (`ChatTurns`), so any template with a fixed turn separator works.
Several messages after one assistant turn (one per tool call) are rendered together, as the template would render
them (Qwen2.5 merges consecutive tool messages into one user turn of `<tool_response>` blocks).

Example:
    >>> conv = Conversation.start(tok, [{"role": "user", "content": "2+2?"}], Budget(max_turns=3))  # doctest: +SKIP
    >>> turn = await conv.assistant_turn(engine, sampling)  # doctest: +SKIP
    >>> for call in parse_tool_calls(turn.text): conv.add_message("tool", run(call), tool_call=True)  # doctest: +SKIP
    >>> trajectory = conv.trajectory(task, group_id=gid, policy_id=pid, role="solver")  # doctest: +SKIP
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from astratk.contracts import Completion, Engine, GenerationRequest, PromptTooLong, SamplingParams

# tool calls are parsed in the core (the OpenAI endpoint answers with them too); envs import them from here as before
from astratk.models.chat import (  # noqa: F401
    _TOOL_CALL,
    ChatTurns,
    ToolCall,
    chat_turns,
    encode_chat,
    parse_tool_call,
    parse_tool_calls,
    stop_token_ids,
)
from astratk.records import Task, Trajectory

# ------------------------------------------------------------------------------------------------------- budgets


@dataclass(frozen=True)
class Budget:
    """Per-episode limits. `max_turns`: assistant turns; `max_tokens_per_turn`: None = the run's `max_new_tokens`;
    `max_context`: prompt + everything appended (a smaller context of the engine, its `max_model_len`, wins once the
    first turn has met the engine); `max_env_tokens`: longest environment/tool message, longer output is cut (and
    counted)."""

    max_turns: int = 4
    max_tokens_per_turn: int | None = None
    max_context: int = 1024
    max_env_tokens: int = 256

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_context < 2 or self.max_env_tokens < 1:
            raise ValueError(f"budget values must be positive: {self}")
        if self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1:
            raise ValueError(f"max_tokens_per_turn must be >= 1 or None, got {self.max_tokens_per_turn}")


# ---------------------------------------------------------------------------------------------------- tool calls


def parse_tags(text: str, names: Iterable[str]) -> list[tuple[str, str]]:
    """Action tags `<name>content</name>` for the given names, in the order they appear (small models learn this
    format fast). Unclosed tags are ignored."""
    alternatives = "|".join(re.escape(n) for n in names)
    pattern = re.compile(rf"<({alternatives})>(.*?)</\1>", re.DOTALL)
    return [(m.group(1), m.group(2).strip()) for m in pattern.finditer(text)]


# -------------------------------------------------------------------------------------------------- conversation


@dataclass
class Turn:
    text: str  # the assistant's text, special tokens removed
    completion: Completion
    truncated: bool  # hit the per-turn or context token budget before a stop token


@dataclass
class Conversation:
    """One role's token sequence over an episode. Build with `Conversation.start(...)`."""

    tokenizer: Any
    budget: Budget
    tokens: list[int]
    n_prompt: int
    turns_api: ChatTurns
    stop_ids: tuple[int, ...]
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    topk_ids: list[tuple[int, ...]] = field(default_factory=list)
    topk_logprobs: list[tuple[float, ...]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=lambda: {
        "turns": 0.0, "tool_calls": 0.0, "tool_errors": 0.0, "truncated_turns": 0.0, "env_tokens": 0.0,
        "env_truncations": 0.0, "policy_tokens": 0.0, "context_exhausted": 0.0})
    _last_close: str = ""
    # Messages appended since the last assistant turn, and where their tokens start: a further message re-renders them.
    _pending: list[dict[str, str]] = field(default_factory=list)
    _tail: int = 0
    # the engine's context (`max_model_len`), learnt at the first assistant turn; None: unknown or unlimited
    _engine_context: int | None = None

    @classmethod
    def start(cls, tokenizer: Any, messages: Sequence[Mapping[str, str]], budget: Budget = Budget(), *,
              chat: ChatTurns | None = None) -> Conversation:
        prompt = encode_chat(tokenizer, [dict(m) for m in messages])
        if len(prompt) >= budget.max_context:  # the rollout service drops such a task, counted
            raise PromptTooLong(len(prompt), budget.max_context, "the episode's budget.max_context")
        return cls(tokenizer, budget, list(prompt), len(prompt), chat or chat_turns(tokenizer),
                   stop_token_ids(tokenizer))

    # ------------------------------------------------------------------------------------------------ state
    @property
    def turns(self) -> int:
        return int(self.metrics["turns"])

    @property
    def max_context(self) -> int:
        """The episode's context: `budget.max_context`, or the engine's when smaller (known after the first turn)."""
        engine = self._engine_context
        return self.budget.max_context if engine is None else min(self.budget.max_context, engine)

    @property
    def room(self) -> int:
        """Tokens left in the context."""
        return self.max_context - len(self.tokens)

    @property
    def can_continue(self) -> bool:
        """Another assistant turn fits: turns left and at least one token of room."""
        return self.turns < self.budget.max_turns and self.room > 0

    # ------------------------------------------------------------------------------------------------ turns
    async def assistant_turn(self, engine: Engine, sampling: SamplingParams) -> Turn:
        """Generate the next assistant message from the whole conversation; append it with loss mask 1."""
        if not self.can_continue:
            raise RuntimeError(f"no assistant turn left: {self.turns}/{self.budget.max_turns} turns, "
                               f"{self.room} tokens of context room (check `can_continue` first)")
        limit = getattr(engine, "max_model_len", None)  # an optional attribute of the Engine protocol
        if self._engine_context is None and limit:
            self._engine_context = int(limit)
            if self.room <= 0:  # only before the first turn: from then on messages are cut to the room
                raise PromptTooLong(len(self.tokens), self.max_context)
        per_turn = self.budget.max_tokens_per_turn or sampling.max_tokens
        max_tokens = min(per_turn, self.room)
        params = SamplingParams(temperature=sampling.temperature, max_tokens=max_tokens, stop_token_ids=self.stop_ids,
                                seed=None if sampling.seed is None else sampling.seed + 7919 * self.turns,
                                top_k_logprobs=sampling.top_k_logprobs, stop=sampling.stop)
        [c] = await engine.generate([GenerationRequest(tuple(self.tokens), params)])
        n = len(c.token_ids)
        self.tokens += c.token_ids
        self.loss_mask += [1] * n
        self.logprobs += c.logprobs
        self.versions += c.versions
        self._extend_topk(c.topk_ids, c.topk_logprobs, n)
        truncated = c.finish_reason != "stop"
        ended = c.token_ids[-1] if n and not truncated else None
        self._last_close = (self.tokenizer.convert_ids_to_tokens(ended) or "") if ended is not None else ""
        self._pending = []
        text = self.tokenizer.decode(list(c.token_ids), skip_special_tokens=True)
        self.texts.append(text)
        m = self.metrics
        m["turns"] += 1
        m["policy_tokens"] += n
        m["truncated_turns"] += float(truncated)
        if self.room <= 0:
            m["context_exhausted"] = 1.0
        return Turn(text, c, truncated)

    def add_message(self, role: str, content: str, *, tool_call: bool = False, tool_error: bool = False) -> int:
        """Append an environment/tool/user message (loss mask 0) and the next generation prompt; returns the tokens
        added. Content longer than `budget.max_env_tokens` is cut (counted in `env_truncations`); if the message does
        not fit the context, what fits is kept and the conversation ends (`context_exhausted`). A further message
        before the next assistant turn replaces the tokens of this run with the template's rendering of all of them."""
        close = self._last_close
        before = len(self.tokens)
        # everything that may fail (the template) first: a refused message leaves the conversation as it was
        ids = self._encode(self.turns_api.continuation(role, content, close))
        frame_only = self.turns_api.frame_tokens(role, close, self._encode)
        truncated = len(ids) - len(frame_only) > self.budget.max_env_tokens
        if truncated:
            content_ids = self._encode(content)[: self.budget.max_env_tokens]
            content = self.tokenizer.decode(content_ids, skip_special_tokens=False) + " ...[truncated]"
            ids = self._encode(self.turns_api.continuation(role, content, close))
        pending = [*self._pending, {"role": role, "content": content}]
        if len(pending) > 1:
            ids = self._encode(self.turns_api.continuation_of(pending, close))
        if self._pending:
            self._retract()
        else:
            self._tail = before
        self._pending = pending
        self.metrics["env_truncations"] += float(truncated)
        if len(ids) >= self.room:  # the next turn would have no room at all
            ids = ids[: max(0, self.room)]
            self.metrics["context_exhausted"] = 1.0
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self._extend_topk((), (), len(ids))
        self.metrics["env_tokens"] += len(ids)
        self.record_tool_call(tool_call, tool_error)
        return len(self.tokens) - before

    def record_tool_call(self, tool_call: bool = True, tool_error: bool = False) -> None:
        """Count a tool/environment call; `add_message` does it for the output it appends. Call it directly for a
        call whose output is never appended (the action that ends the episode)."""
        self.metrics["tool_calls"] += float(tool_call)
        self.metrics["tool_errors"] += float(tool_error)

    def _retract(self) -> None:
        """Drop the tokens of the messages since the last assistant turn (env tokens no engine has seen yet)."""
        n, at = len(self.tokens) - self._tail, self._tail - self.n_prompt  # per-token lists cover the completion
        del self.tokens[self._tail:]
        for seq in (self.loss_mask, self.logprobs, self.versions, self.topk_ids, self.topk_logprobs):
            del seq[at:]  # top-K lists are empty or as long as the mask
        self.metrics["env_tokens"] -= n

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _extend_topk(self, ids: Sequence[tuple[int, ...]], lps: Sequence[tuple[float, ...]], n: int) -> None:
        if ids or self.topk_ids:  # keep top-K aligned with the completion once any turn has it
            if not self.topk_ids and len(self.loss_mask) > n:
                self.topk_ids = [()] * (len(self.loss_mask) - n)
                self.topk_logprobs = [()] * (len(self.loss_mask) - n)
            self.topk_ids += list(ids) if ids else [()] * n
            self.topk_logprobs += list(lps) if lps else [()] * n

    # ------------------------------------------------------------------------------------------------ output
    def trajectory(self, task: Task, *, group_id: str, policy_id: str, role: str, text: str | None = None,
                   metrics: Mapping[str, float] | None = None) -> Trajectory:
        """The episode as one trajectory; `text` (what graders read) defaults to the last assistant message."""
        finished = bool(self.texts) and not self.metrics["context_exhausted"] and not (
            self.metrics["truncated_turns"] and self.loss_mask and self.loss_mask[-1] == 1)
        return Trajectory(
            task_id=task.task_id, group_id=group_id, policy_id=policy_id, role=role, tokens=tuple(self.tokens),
            n_prompt=self.n_prompt, loss_mask=tuple(self.loss_mask), behavior_logprobs=tuple(self.logprobs),
            behavior_versions=tuple(self.versions), finished=finished,
            text=self.texts[-1] if text is None and self.texts else (text or ""),
            metrics={**self.metrics, "completion_tokens": self.metrics["policy_tokens"], **(metrics or {})},
            behavior_topk_ids=tuple(self.topk_ids), behavior_topk_logprobs=tuple(self.topk_logprobs))
