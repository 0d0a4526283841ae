"""The single-turn episode shared by envs. Chat encoding itself (`encode_chat`, `stop_token_ids`) is in
`astratk.models.chat`: the warm start uses it too. The env owns the template, the engine sees token ids only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.models.chat import encode_chat, stop_token_ids
from astratk.records import Trajectory


async def single_turn(engine: Any, messages: Sequence[dict[str, str]], sampling: Any, *, task: Any, group_id: str,
                      policy_id: str, role: str = "policy", seed_salt: int = 0) -> Any:
    """One completion of `messages` as a `Trajectory` (the single-turn episode of math, code and workflow roles):
    the chat prompt, the engine's stop tokens, the run's temperature/budget/top-K, the seed moved by `seed_salt` (so
    two roles of one episode draw differently), `text` decoded without special tokens."""

    tok = engine.tokenizer
    prompt = encode_chat(tok, messages)
    params = SamplingParams(temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                            stop_token_ids=stop_token_ids(tok),
                            seed=None if sampling.seed is None else sampling.seed + seed_salt,
                            top_k_logprobs=sampling.top_k_logprobs)
    [c] = await engine.generate([GenerationRequest(tuple(prompt), params)])
    n = len(c.token_ids)
    return Trajectory(task_id=task.task_id, group_id=group_id, policy_id=policy_id, role=role,
                      tokens=tuple(prompt) + c.token_ids, n_prompt=len(prompt), loss_mask=(1,) * n,
                      behavior_logprobs=c.logprobs, behavior_versions=c.versions, finished=c.finish_reason == "stop",
                      text=tok.decode(list(c.token_ids), skip_special_tokens=True),
                      metrics={"completion_tokens": float(n)}, behavior_topk_ids=c.topk_ids,
                      behavior_topk_logprobs=c.topk_logprobs)
