"""Build the tiny Qwen2-architecture model from a `TinyModelSpec`: fresh, seeded weights, nothing downloaded.

Why Qwen2: every engine (TorchEngine through HF transformers, vLLM on CPU and GPU) loads it unchanged, so the toy
model exercises the same code path as a real checkpoint. Why head_dim >= 32: vLLM's CPU attention supports head
sizes 32, 64, 80, ... only.

Example:
    >>> from astratk.models import build_char_tokenizer
    >>> model = build_tiny_model(TinyModelSpec(), build_char_tokenizer())  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk.spec import TinyModelSpec


def check_tiny_spec(spec: TinyModelSpec) -> None:
    """Reject shapes the engines cannot serve, naming the fields to change (the rules live with the spec, which
    `RunSpec.validate` checks at parse time)."""
    spec.validate("model.tiny")


def tiny_config(spec: TinyModelSpec, tokenizer) -> Qwen2Config:
    check_tiny_spec(spec)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,  # saves vocab x hidden parameters; the vocabulary is tiny anyway
        bos_token_id=None,
        eos_token_id=[im_end, tokenizer.eos_token_id],  # a turn ends at <|im_end|>
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        use_cache=True,
    )


def build_tiny_model(spec: TinyModelSpec, tokenizer) -> Qwen2ForCausalLM:
    """A freshly initialised fp32 model; the same spec (seed included) gives bit-identical weights.

    The global torch RNG is forked, so building a model does not shift the caller's random stream.
    """
    config = tiny_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    return model.float()
