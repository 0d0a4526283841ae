"""What `VLLMEngine`'s constructor hands `vllm.LLM`: the arguments it sets itself, the CPU KV cache's default size and
the LoRA ranks vLLM accepts.

An option the engine decides goes into `llm_args`; one a run decides comes from `rollout.engine_args` (the
constructor's `**engine_args`) and passes through untouched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The CPU KV cache's default ceiling. Why: max_batch x max_model_len positions is what a full batch of the longest
# sequences needs, but real models declare long contexts (SmolLM2: 8192 positions, 46 KB per position in fp32: 22.5
# GiB at max_batch 64, which vLLM refuses on a 24 GiB machine). Paged attention holds what a batch actually uses;
# sequences that do not fit wait (vLLM preempts and resumes them). `kv_cache_bytes` sets the size explicitly.
KV_CEILING_BYTES = 2 << 30


def default_kv_bytes(max_batch: int, max_len: int, per_token: int) -> int:
    """The CPU KV cache vLLM gets by default: room for a full batch of the longest sequences, at most
    `KV_CEILING_BYTES` (but always one whole sequence), at least 16 MiB."""
    return max(16 << 20, min(max_batch * max_len * per_token, max(KV_CEILING_BYTES, max_len * per_token)))


def kv_bytes_per_token(config: Mapping[str, Any], dtype: str) -> int:
    """Bytes of K and V one position takes in every layer of the model `config` (an HF config.json) in `dtype`."""
    layers, heads = config["num_hidden_layers"], config.get("num_key_value_heads") or 1
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * layers * heads * head_dim * DTYPE_BYTES[dtype]


def has_tokenizer(path: str) -> bool:
    """Whether the model directory holds tokenizer files (without them vLLM starts with no tokenizer)."""
    return any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def vllm_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` (1, 8, 16, 32, ...) that holds rank `r`."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if r <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {r} exceeds vLLM's largest max_lora_rank, 512")


def llm_args(path: str, config: Mapping[str, Any], engine_args: Mapping[str, Any], *, dtype: str, seed: int,
             max_len: int, max_batch: int, enable_prefix_caching: bool, tokenizer: bool, lora_rank: int | None,
             max_loras: int, cpu: bool, enforce_eager: bool | None, kv_cache_bytes: int | None) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM` for the model at `path`: processed log-probs (the sampled distribution),
    vLLM's own generation defaults ignored (requests say everything), LoRA when `lora_rank` is set, eager mode on CPU
    and, there, a bounded KV cache (`default_kv_bytes`) unless `engine_args` or `kv_cache_bytes` size it."""
    args = dict(
        model=path, dtype=dtype, seed=seed, max_model_len=max_len, max_num_seqs=max_batch,
        logprobs_mode="processed_logprobs", max_logprobs=20, enable_prefix_caching=enable_prefix_caching,
        generation_config="vllm", skip_tokenizer_init=not tokenizer, **engine_args)
    if lora_rank is not None:  # LoRA adapters (astratk.engines.vllm_lora); vLLM reloads evicted ones from disk
        args.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=max_loras + 1,
                    max_cpu_loras=4 * (max_loras + 1))  # + 1: the zero adapter base requests run with
    args["enforce_eager"] = cpu if enforce_eager is None else enforce_eager
    if cpu and "kv_cache_memory_bytes" not in engine_args:
        args["kv_cache_memory_bytes"] = kv_cache_bytes or default_kv_bytes(max_batch, max_len,
                                                                           kv_bytes_per_token(config, dtype))
    elif kv_cache_bytes is not None:
        args["kv_cache_memory_bytes"] = kv_cache_bytes
    return args
