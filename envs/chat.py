"""Chat-template helpers shared by envs: the env owns the template, the engine sees token ids only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Render `messages` with the tokenizer's chat template (generation prompt added) and encode without adding
    special tokens again (the template already holds them)."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """End-of-turn and end-of-text ids: a completion ends at whichever the model emits first."""
    ids = []
    for token in ("<|im_end|>", tokenizer.eos_token):
        if token is None:
            continue
        i = tokenizer.convert_tokens_to_ids(token)
        if isinstance(i, int) and i != tokenizer.unk_token_id and i not in ids:
            ids.append(i)
    return tuple(ids)
