"""Chat encoding: a tokenizer's chat template to token ids, and the tokens that end an assistant turn.

It lives beside the models (not the envs) because the core needs it too: the warm start encodes an env's messages
exactly as the env's episodes do, so the tiny model learns the prompts it will be sampled on. The env owns the
template; engines see token ids only.

Example:
    >>> from astratk.models import build_char_tokenizer
    >>> tok = build_char_tokenizer()
    >>> tok.decode(encode_chat(tok, [{"role": "user", "content": "1+1="}]))
    '<|im_start|>user\\n1+1=<|im_end|>\\n<|im_start|>assistant\\n'
    >>> [tok.convert_ids_to_tokens(i) for i in stop_token_ids(tok)]
    ['<|im_end|>', '<|endoftext|>']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["encode_chat", "stop_token_ids"]


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
