"""vLLM on a CUDA GPU (skipped without CUDA or without the `vllm` extra): the same agreement and weight-update checks
as tests/vllm/ on CPU, run on the GPU build."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines import build_engine
from tests.vllm.test_vllm_engine import LP_TOL, _model, _save, prompts, trainer_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra")]


def test_vllm_gpu_matches_trainer_and_applies_updates(tmp_path):
    from astratk.models import build_char_tokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    tok = build_char_tokenizer()
    a, b = _model(0, len(tok)), _model(1, len(tok))
    engine = build_engine("vllm", _save(a, tok, tmp_path / "a"), max_batch=64, gpu_memory_utilization=0.2)
    fresh = build_engine("vllm", _save(b, tok, tmp_path / "b"), max_batch=64, gpu_memory_utilization=0.2)
    try:
        requests = [GenerationRequest(p, SamplingParams(temperature=0.0, max_tokens=16)) for p in prompts(tok)]
        for r, c in zip(requests, asyncio.run(engine.generate(requests))):
            ref = trainer_logprobs(a, r.prompt_ids, c.token_ids, 1.0)
            assert max(abs(x - y) for x, y in zip(c.logprobs, ref)) < 10 * LP_TOL  # GPU kernels: looser
        engine.load_weights({k: v.clone() for k, v in b.state_dict().items()}, version=1)
        after, expected = asyncio.run(engine.generate(requests)), asyncio.run(fresh.generate(requests))
        assert [c.token_ids for c in after] == [c.token_ids for c in expected]
        assert all(c.versions == (1,) * len(c.token_ids) for c in after)
    finally:
        engine.close()
        fresh.close()
