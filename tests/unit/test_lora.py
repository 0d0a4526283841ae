"""LoRA through PEFT (`model.lora`), from the config to the export: the spec and its start checks, a trainer that
trains the adapters only (KL reference = the base, no second copy; adapter-only checkpoints), a weight store that
holds adapter tensors only (full and sparse-delta versions), TorchEngine adapters that sample as the PEFT model does
and share one base between policies in a rollout service, and exports that reload as the trained model.

The base is a tiny random Qwen2 with the character tokenizer (head_dim 32, two layers); "trained" adapters are
PEFT's initial adapters plus seeded noise on A and B.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import warnings

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from astratk.cli import main
from astratk.config import dump_spec, load_spec
from astratk.contracts import GenerationRequest, SamplingParams
from astratk.dataflow.client import DataLayerClient
from astratk.dataflow.datalayer import DataLayer
from astratk.engines import TorchEngine
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.workflows import SolverVerifierEnv
from astratk.losses.drpo import DRPO
from astratk.models import build_char_tokenizer
from astratk.models import lora as L
from astratk.models.export import PROVENANCE, export_hf
from astratk.models.loading import load_causal_lm
from astratk.models.tokenizer import save_char_tokenizer
from astratk.records import RunContext, TrainBatch
from astratk.rollout.service import RolloutService
from astratk.runtime.deploy import publish_initial
from astratk.runtime.run import Run
from astratk.spec import DataflowSpec, LoraSpec, ModelSpec, PolicySpec, RolloutSpec, RunSpec
from astratk.training.logprobs import token_logprobs
from astratk.training.module import PolicyModule
from astratk.weights import make_delta
from astratk.weights.store import WeightStore

LORA = LoraSpec(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj"])
LP_TOL = 1e-5  # engine vs PEFT model, both fp32 (the engine's decode and the trainer's forward: ~1e-6 measured)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    tok = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, intermediate_size=128, tie_word_embeddings=True,
                         max_position_embeddings=128, initializer_range=0.1, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).float()
    path = tmp_path_factory.mktemp("lora-base")
    model.save_pretrained(path)
    save_char_tokenizer(tok, path)
    return str(path)


def _trained(base_dir: str, seed: int, lora: LoraSpec = LORA) -> PeftModel:
    """The base with PEFT adapters moved away from their initialisation (seeded noise on A and B)."""
    model = L.add_lora(load_causal_lm(base_dir), lora).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _prompts(n: int = 4) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(3)
    return [tuple(torch.randint(5, 60, (k,), generator=g).tolist()) for k in (3, 7, 5, 9)[:n]]


def _requests(seed: int = 0, n: int = 4) -> list[GenerationRequest]:
    return [GenerationRequest(p, SamplingParams(temperature=0.8, max_tokens=6, seed=seed + i))
            for i, p in enumerate(_prompts(n))]


def _check_logprobs(model: torch.nn.Module, requests, completions, version: int) -> None:
    """The engine's behaviour log-probs are the model's own, recomputed by the trainer's formula."""
    for r, c in zip(requests, completions):
        assert c.versions == (version,) * len(c.token_ids)
        ids = torch.tensor([list(r.prompt_ids) + list(c.token_ids)])
        with torch.no_grad():
            lp = token_logprobs(model, ids, torch.ones_like(ids), r.params.temperature)[0, len(r.prompt_ids) - 1:]
        torch.testing.assert_close(torch.tensor(c.logprobs), lp, rtol=0, atol=LP_TOL)


def _batch(model: torch.nn.Module) -> TrainBatch:
    """Two on-policy rows of 8 tokens (row 1 right-padded by 2), completion = the last 4 real targets."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 60, (2, 8), generator=g)
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[1, 6:] = 0
    input_ids[1, 6:] = 0
    loss_mask = torch.zeros(2, 7)
    loss_mask[0, 3:7] = 1
    loss_mask[1, 1:5] = 1
    with torch.no_grad():
        lp = token_logprobs(model, input_ids, attention_mask, 1.0)
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                      behavior_logprobs=lp * loss_mask, advantages=torch.tensor([[1.0] * 7, [-1.0] * 7]),
                      weights=loss_mask.clone(), versions=torch.zeros(2, 7, dtype=torch.long), n_groups=1)


def _train_steps(module: PolicyModule, steps: int) -> None:
    optimizer = module.configure_optimizers()
    batch = _batch(module.model)
    for _ in range(steps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a Trainer warns
            loss = module.training_step(batch, 0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


# ---------------------------------------------------------------------------------------------------- spec
@pytest.mark.parametrize(("lora", "field"), [
    ({"r": 0}, "r"), ({"alpha": 0.0}, "alpha"), ({"dropout": 1.0}, "dropout"),
    ({"target_modules": []}, "target_modules"), ({"target_modules": "q_proj"}, "target_modules"),
    ({"target_modules": ["q_proj", "q_proj"]}, "target_modules")])
def test_spec_ranges_name_the_key(lora, field):
    with pytest.raises(ValueError, match=rf"^policies\[0\]\.model\.lora\.{field}"):  # at construction or in validate
        RunSpec(policies=[{"model": {"lora": lora}}]).validate()


def test_spec_from_yaml_and_back(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("policies:\n  - model:\n      lora: {r: 4, target_modules: [q_proj, v_proj]}\n")
    spec = load_spec(path)
    assert spec.policies[0].model.lora == LoraSpec(r=4, target_modules=["q_proj", "v_proj"])
    (tmp_path / "dumped.yaml").write_text(dump_spec(spec))
    assert load_spec(tmp_path / "dumped.yaml").policies[0].model.lora == spec.policies[0].model.lora
    (tmp_path / "plain.yaml").write_text("policies:\n  - model: {}\n")
    assert load_spec(tmp_path / "plain.yaml").policies[0].model.lora is None  # full fine-tuning by default


def test_unknown_target_module_is_one_line_at_start_and_nothing_is_written(base_dir, tmp_path, capsys):
    # the tiny model (built from model.tiny) and a local directory are checked from their configs alone, as the run
    # is made (`Run(spec)`: astratk.runtime.checks)
    for model in (ModelSpec(lora=LoraSpec(target_modules=["q_proj", "qkv"])),
                  ModelSpec(path=base_dir, lora=LoraSpec(target_modules=["q_proj", "qkv"]))):
        with pytest.raises(ValueError) as e:
            Run(RunSpec(policies=[PolicySpec(model=model)]))
        message = str(e.value)
        assert message.startswith("policies[0].model.lora.target_modules: 'qkv' names no layer") and "\n" not in message
        assert "'q_proj'" in message  # the layers that would do
    # a container module is not a layer LoRA can adapt
    with pytest.raises(ValueError, match=r"'self_attn' names Qwen2Attention layers, which LoRA cannot adapt"):
        Run(RunSpec(policies=[PolicySpec(model=ModelSpec(path=base_dir, lora=LoraSpec(target_modules=["self_attn"])))]))
    # `astratk run`: one line on stderr, exit 2, no run directory
    config = tmp_path / "bad.yaml"
    config.write_text(f"output_dir: {tmp_path / 'runs'}\npolicies:\n  - model:\n      path: {base_dir}\n"
                      "      lora: {target_modules: [q_proj, qkv]}\n")
    assert main(["run", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "policies[0].model.lora.target_modules" in err
    assert not (tmp_path / "runs").exists()
    # and when the adapters are made (publish_initial, the trainer): before any version is written
    store = WeightStore(f"memory://lora-bad-{tmp_path.name}")
    with pytest.raises(ValueError, match=r"^policies\[1\]\.model\.lora\.target_modules: 'qkv'"):
        publish_initial(store, "main", base_dir, LoraSpec(target_modules=["qkv"]), key="policies[1].model.lora")
    assert store.latest("main") is None and store.adapter_config("main") is None


def test_an_engine_without_adapters_is_refused_for_lora_policies():
    spec = RunSpec(policies=[PolicySpec(model=ModelSpec(lora=LORA))], rollout=RolloutSpec(engine="scripted"))
    with pytest.raises(ValueError, match=r"^rollout\.engine: 'scripted' .* cannot apply LoRA adapters, and "
                                         r"policies\[0\]\.model\.lora is set"):
        spec.validate()


# ---------------------------------------------------------------------------------------------------- trainer
def test_trainer_trains_the_adapters_only(base_dir):
    module = PolicyModule(base_dir, DRPO(delta=0.5), horizon=7, lora=LORA, lr=1e-2)
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    [group] = module.configure_optimizers().param_groups
    assert {id(p) for p in group["params"]} == {id(p) for p in module.model.parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in module.model.named_parameters() if not p.requires_grad}
    start = module.weights()
    assert set(start) == set(get_peft_model_state_dict(module.model)) and L.is_adapter_state(start)
    assert all(torch.count_nonzero(v) == 0 for k, v in start.items() if "lora_B" in k)  # B = 0: the base's output
    _train_steps(module, 2)
    after = dict(module.model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in frozen.items())  # the base did not move
    moved = module.weights()
    assert all(not torch.equal(moved[k], start[k]) for k in start)  # A and B both moved (A once B != 0)
    assert module.hparams["lora"] == dataclasses.asdict(LORA)  # plain values in the checkpoint


def test_initial_adapter_is_version_zero_and_the_base_behaviour(base_dir, tmp_path):
    store = WeightStore(f"memory://lora-v0-{tmp_path.name}")
    publish_initial(store, "main", base_dir, LORA)
    v0, ref = store.pull("main", None, 0)
    module = PolicyModule(base_dir, DRPO(), horizon=7, lora=LORA)
    assert ref.version == 0 and v0.keys() == module.weights().keys()
    assert all(torch.equal(v0[k], v) for k, v in module.weights().items())  # the trainer starts from version 0
    recorded = L.lora_from_config(store.adapter_config("main"))  # PEFT keeps target modules as a set
    assert recorded == dataclasses.replace(LORA, target_modules=sorted(LORA.target_modules))
    ids = torch.tensor([_prompts()[3]])
    with torch.no_grad():
        torch.testing.assert_close(module.model(ids).logits, load_causal_lm(base_dir)(ids).logits, rtol=0, atol=0)


def test_kl_reference_is_the_base_with_adapters_off(base_dir):
    module = PolicyModule(base_dir, DRPO(delta=0.5), horizon=7, lora=LORA, kl_coef=0.1)
    assert module.reference is None  # no second copy of the model
    _train_steps(module, 2)
    batch = _batch(module.model)
    with torch.no_grad():
        base = token_logprobs(load_causal_lm(base_dir), batch.input_ids, batch.attention_mask, 1.0)
        policy = token_logprobs(module.model, batch.input_ids, batch.attention_mask, 1.0)
    reference = module._reference_logprobs(batch)
    torch.testing.assert_close(reference, base, rtol=0, atol=1e-6)
    assert not torch.allclose(policy, base, atol=1e-3)
    assert module.step_metrics["train/main/kl_ref_mean"] > 0  # the term ran against the base


def test_checkpoints_hold_the_adapters_and_restore_them(base_dir):
    module = PolicyModule(base_dir, DRPO(delta=0.5), horizon=7, lora=LORA, lr=1e-2)
    _train_steps(module, 2)
    module.policy_version = 2
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    assert set(checkpoint["state_dict"]) == {f"model.{n}" for n, p in module.model.named_parameters()
                                             if p.requires_grad}
    fresh = PolicyModule(base_dir, DRPO(delta=0.5), horizon=7, lora=LORA)
    fresh.on_load_checkpoint(checkpoint)  # what Lightning calls, then load_state_dict(strict=strict_loading)
    fresh.load_state_dict(checkpoint["state_dict"], strict=fresh.strict_loading)
    assert fresh.policy_version == 2
    assert all(torch.equal(v, module.weights()[k]) for k, v in fresh.weights().items())
    del checkpoint["state_dict"][next(iter(checkpoint["state_dict"]))]
    with pytest.raises(ValueError, match="lacks 1 adapter tensors"):
        PolicyModule(base_dir, DRPO(delta=0.5), horizon=7, lora=LORA).on_load_checkpoint(checkpoint)


# ---------------------------------------------------------------------------------------------------- store
def test_the_store_holds_adapter_tensors_only_with_sparse_deltas(base_dir, tmp_path):
    full = WeightStore(f"memory://lora-full-{tmp_path.name}")
    publish_initial(full, "main", base_dir)  # the same model, fully fine-tuned
    store = WeightStore(f"memory://lora-store-{tmp_path.name}", full_every=10)
    publish_initial(store, "main", base_dir, LORA)
    v0 = store.latest("main")
    n_adapter = sum(v.numel() for v in L.adapter_state(L.add_lora(load_causal_lm(base_dir), LORA)).values())
    assert v0.nbytes < 4 * n_adapter + 4096  # fp32 adapter tensors plus the safetensors header
    assert v0.nbytes < full.latest("main").nbytes / 10
    publish_initial(full, "main", base_dir, LORA)
    assert full.adapter_config("main") is not None
    publish_initial(full, "main", base_dir)  # the same store restarted with full fine-tuning: no adapter record left
    assert full.adapter_config("main") is None
    state, _ = store.pull("main", None, 0)
    new = {k: v.clone() for k, v in state.items()}
    key = next(k for k in new if "lora_B" in k)
    new[key][0, :3] = 0.5  # a sparse update: three elements of one B
    ref1 = store.publish("main", 1, new)
    assert ref1.kind == "delta" and ref1.nbytes < v0.nbytes / 4
    delta, _ = store.pull("main", have_version=0)
    assert delta.changes[key][0].tolist() == [0, 1, 2]
    engine = TorchEngine(base_dir)
    try:
        view = engine.add_adapter("main", LORA, state, 0)
        view.load_weights(delta, 1)  # the engine applies the adapter delta in place
        assert view.version == 1 and engine.version == 0  # the base keeps its own version
        assert torch.equal(engine._adapters.get("main").tensors[key], new[key])
        with pytest.raises(ValueError, match="the delta needs base version 0"):
            view.load_weights(delta, 1)
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------------- engine
def test_engine_samples_as_the_peft_model_at_each_adapter_version(base_dir):
    trained1, trained2 = _trained(base_dir, 1), _trained(base_dir, 2)
    initial = L.initial_adapter(base_dir, LORA)
    engine = TorchEngine(base_dir, batch_window_s=0.01)
    try:
        view = engine.add_adapter("main", LORA, initial, 0)
        requests = _requests()
        _check_logprobs(load_causal_lm(base_dir), requests, asyncio.run(view.generate(requests)), 0)  # B = 0
        view.load_weights(L.adapter_state(trained1), 3)
        _check_logprobs(trained1, requests, asyncio.run(view.generate(requests)), 3)
        delta = make_delta(L.adapter_state(trained1), L.adapter_state(trained2), base_version=3, version=4)
        view.load_weights(delta, 4)
        _check_logprobs(trained2, requests, asyncio.run(view.generate(requests)), 4)
        # requests without an adapter run the base alone, at the engine's own version
        _check_logprobs(load_causal_lm(base_dir), requests, asyncio.run(engine.generate(requests)), 0)
        with pytest.raises(KeyError, match="no adapter 'other'"):
            engine.submit(requests, adapter="other")
    finally:
        engine.close()


@pytest.mark.parametrize("mix", [True, False], ids=["mixed-batch", "one-adapter-per-batch"])
def test_two_adapters_share_the_base(base_dir, mix):
    """Concurrent calls of two adapters and of the base: with `mix_adapters` (the default) they share one batch, one
    base forward with each row's adapter added (`torch_lora_mix`); without it each batch runs one adapter's rows.
    Either way each token carries its adapter's version and the completions equal those of each adapter served alone
    (seeded sampling), in the callers' order. Adapter b targets fewer layers than a (b's rows skip the others)."""
    models = {"a": _trained(base_dir, 1), "b": _trained(base_dir, 2, LoraSpec(r=2, target_modules=["v_proj"]))}
    specs = {"a": LORA, "b": LoraSpec(r=2, target_modules=["v_proj"])}
    engine = TorchEngine(base_dir, batch_window_s=0.05, mix_adapters=mix)
    try:
        base_params = {id(p) for p in engine._model.parameters()}
        views = {n: engine.add_adapter(n, specs[n], L.adapter_state(models[n]), v) for n, v in (("a", 5), ("b", 7))}
        assert sorted(engine.adapters) == ["a", "b"] and views["a"].engine is views["b"].engine
        base = {n for n, _ in engine._model.named_parameters() if "lora_" not in n}
        assert len(base) == len(dict(load_causal_lm(base_dir).named_parameters()))  # the base is held once
        assert base_params <= {id(p) for p in engine._model.parameters()}  # ... as the same tensors
        requests = _requests()

        async def all_three():
            return await asyncio.gather(views["b"].generate(requests), engine.generate(requests),
                                        views["a"].generate(requests))

        out_b, out_base, out_a = asyncio.run(all_three())
        assert engine.stats["batches"] == (1 if mix else 3) and engine.stats["mixed_batches"] == int(mix)
        assert engine.stats["max_batch_seen"] == (3 if mix else 1) * len(requests)
        _check_logprobs(models["a"], requests, out_a, 5)
        _check_logprobs(models["b"], requests, out_b, 7)
        _check_logprobs(load_causal_lm(base_dir), requests, out_base, 0)
        alone = {n: asyncio.run(views[n].generate(requests)) for n in views}
        assert [c.token_ids for c in out_a] == [c.token_ids for c in alone["a"]]
        assert [c.token_ids for c in out_b] == [c.token_ids for c in alone["b"]]
        # after a mixed batch, a batch of one adapter applies it alone again (the hooks are gone)
        _check_logprobs(models["a"], requests, alone["a"], 5)
    finally:
        engine.close()


def test_a_mixed_batch_prefills_a_shared_prefix_per_adapter_and_keeps_each_adapters_prefixes(base_dir):
    """Prompts that share a long prefix (an agent's system message) across two adapters: the prefix is prefilled
    once per adapter, and a next turn of each finds its own adapter's K/V in the prefix cache, never the other's."""
    models = {"a": _trained(base_dir, 1), "b": _trained(base_dir, 2)}
    engine = TorchEngine(base_dir, batch_window_s=0.05, prefix_cache_mb=64)
    try:
        views = {n: engine.add_adapter(n, LORA, L.adapter_state(models[n]), 1) for n in models}
        g = torch.Generator().manual_seed(5)
        system = tuple(torch.randint(5, 60, (40,), generator=g).tolist())
        prompts = [system + tuple(torch.randint(5, 60, (k,), generator=g).tolist()) for k in (3, 6, 4)]
        requests = [GenerationRequest(p, SamplingParams(temperature=0.8, max_tokens=5, seed=i))
                    for i, p in enumerate(prompts)]

        async def both(reqs):
            return await asyncio.gather(views["a"].generate(reqs), views["b"].generate(reqs))

        out_a, out_b = asyncio.run(both(requests))
        assert engine.stats["mixed_batches"] == 1
        _check_logprobs(models["a"], requests, out_a, 1)
        _check_logprobs(models["b"], requests, out_b, 1)
        nxt = [GenerationRequest(r.prompt_ids + c.token_ids + (7, 8), r.params) for r, c in zip(requests, out_a)]
        hits = engine.stats["prefix_hits"]
        out_a2, out_b2 = asyncio.run(both(nxt))
        assert engine.stats["prefix_hits"] - hits == 2 * len(nxt)  # every row reused a prefix of its own adapter
        _check_logprobs(models["a"], nxt, out_a2, 1)
        _check_logprobs(models["b"], nxt, out_b2, 1)
    finally:
        engine.close()


def test_policies_on_one_base_share_one_engine_in_the_rollout_service(base_dir, tmp_path):
    env = SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=8))
    policies = [PolicySpec(policy_id=pid, roles=[pid], model=ModelSpec(path=base_dir, lora=LORA))
                for pid in ("solver", "verifier")]
    spec = RunSpec(env=env, policies=policies, rollout=RolloutSpec(group_size=2, max_new_tokens=4),
                   dataflow=DataflowSpec(filter_zero_variance=False)).validate()
    store = WeightStore(f"memory://lora-service-{tmp_path.name}")
    for pid in ("solver", "verifier"):
        publish_initial(store, pid, base_dir, LORA)
    service = RolloutService(RunContext("lora", spec, {"solver": base_dir, "verifier": base_dir}, store.url))
    [res] = service.rollout(DataLayerClient(DataLayer(spec)).lease(1))
    views = {(purpose, pid): service.engine(pid, purpose) for pid in ("solver", "verifier")
             for purpose in ("rollout", "eval")}
    engines = {id(v.engine) for v in views.values()}
    assert len(engines) == 1 and list(service._bases) == [base_dir]  # one base model in the process
    assert sorted(views[("rollout", "solver")].engine.adapters) == sorted(f"{p}/{q}" for p, q in views)
    assert {t.behavior_versions for g in res.groups for t in g.trajectories} == {(0,) * 4}
    trained = L.adapter_state(_trained(base_dir, 1))
    store.publish("solver", 1, trained)
    assert service.sync("solver") == 1 and service.sync("verifier") == 0  # each adapter moves on its own
    assert views[("rollout", "solver")].version == 1 and views[("eval", "solver")].version == 0
    [res] = service.rollout(DataLayerClient(DataLayer(spec)).lease(1))
    versions = {g.policy_id: {v for t in g.trajectories for v in t.behavior_versions} for g in res.groups}
    assert versions == {"solver": {1}, "verifier": {0}}


# ---------------------------------------------------------------------------------------------------- export
def test_export_writes_a_peft_adapter_and_on_request_merged_weights(base_dir, tmp_path):
    trained = _trained(base_dir, 4)
    store_dir = tmp_path / "weights"
    store = WeightStore(str(store_dir))
    publish_initial(store, "main", base_dir, LORA)
    store.publish("main", 1, L.adapter_state(trained))
    ids = torch.tensor([_prompts()[3], _prompts()[3][::-1]])
    with torch.no_grad():
        want = trained(ids).logits

    adapter_dir = export_hf(store_dir, tmp_path / "adapter", base_model=base_dir)
    assert {p.name for p in adapter_dir.iterdir()} == {L.CONFIG_FILE, L.WEIGHTS_FILE, PROVENANCE}
    record = json.loads((adapter_dir / PROVENANCE).read_text())
    assert record["export_kind"] == "peft_adapter" and record["version"] == 1
    config = json.loads((adapter_dir / L.CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == base_dir and config["r"] == 4
    peft = PeftModel.from_pretrained(load_causal_lm(base_dir), str(adapter_dir)).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(ids).logits, want, rtol=0, atol=1e-6)

    merged_dir = export_hf(store_dir, tmp_path / "merged", base_model=base_dir, merge=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-4)
    assert json.loads((merged_dir / PROVENANCE).read_text())["export_kind"] == "merged_lora"
    assert (merged_dir / "tokenizer.json").is_file()
    assert main(["export", str(store_dir), str(tmp_path / "cli"), "--base-model", base_dir, "--merge"]) == 0
    assert json.loads((tmp_path / "cli" / PROVENANCE).read_text())["export_kind"] == "merged_lora"

    # version 0 exports the base's behaviour; an adapter for another model is refused naming the version
    v0 = export_hf(store_dir, tmp_path / "v0", base_model=base_dir, version=0, merge=True)
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(v0)(ids).logits,
                                   load_causal_lm(base_dir)(ids).logits, rtol=0, atol=1e-5)
    other = WeightStore(str(tmp_path / "other"))
    other.set_adapter_config("main", L.adapter_config(LoraSpec(r=4, target_modules=["k_proj"])))
    other.publish("main", 0, L.adapter_state(trained))
    with pytest.raises(ValueError, match=r"version 0 in .*the adapter does not fit the model"):
        export_hf(tmp_path / "other", tmp_path / "bad", base_model=base_dir)


def test_export_of_a_lora_checkpoint(base_dir, tmp_path):
    module = PolicyModule(base_dir, DRPO(delta=0.5), horizon=7, lora=LORA, lr=1e-2)
    _train_steps(module, 2)
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": 2}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "step=2.ckpt")
    out = export_hf(tmp_path / "step=2.ckpt", tmp_path / "adapter")
    peft = PeftModel.from_pretrained(load_causal_lm(base_dir), str(out)).eval()
    ids = torch.tensor([_prompts()[1]])
    with torch.no_grad():
        torch.testing.assert_close(peft(ids).logits, copy.deepcopy(module.model).eval()(ids).logits, rtol=0,
                                   atol=1e-6)
