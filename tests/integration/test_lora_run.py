"""LoRA end to end on the CPU with the tiny model: a real `astratk` run that trains adapters only (published versions
hold adapter tensors, the export reloads as the trained policy), and a two-policy run whose LoRA policies share one
base model in the rollout service (threads-mode cluster, so the test can look inside the service)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.workflows import SolverVerifierEnv
from astratk.losses.drpo import DRPO
from astratk.models import lora as L
from astratk.models.export import export_hf
from astratk.models.loading import load_causal_lm
from astratk.runtime.run import Run
from astratk.spec import (
    ClusterSpec,
    DataflowSpec,
    EvalSpec,
    LoraSpec,
    ModelSpec,
    PolicySpec,
    RolloutSpec,
    RunSpec,
    TinyModelSpec,
    TrainerSpec,
)
from astratk.weights.store import WeightStore

pytestmark = pytest.mark.integration

LORA = LoraSpec(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


def _model(tmp_path) -> ModelSpec:
    tiny = TinyModelSpec(warm_start_steps=30, warm_start_batch=32, warm_start_target=None)
    return ModelSpec(tiny=tiny, cache_dir=str(tmp_path / "cache"), lora=LORA)


def test_lora_run_publishes_adapters_and_exports_them(tmp_path):
    spec = RunSpec(
        name="lora", output_dir=str(tmp_path / "runs"), env=ArithmeticEnv(levels=[1], n_heldout=16),
        policies=[PolicySpec(model=_model(tmp_path), loss=DRPO(delta=0.5),
                             trainer=TrainerSpec(max_steps=3, groups_per_step=4, lr=1e-2))],
        rollout=RolloutSpec(group_size=4, max_new_tokens=6, tasks_per_chunk=4),
        dataflow=DataflowSpec(filter_zero_variance=False, synchronous=True),  # step k trains version k's rollouts
        cluster=ClusterSpec(rollout_workers=1, startup_timeout_s=120),
        eval=EvalSpec(interval_s=1000, max_tasks=16, timeout_s=120))
    result = Run(spec, printer=lambda s: None).start()
    assert result.summary["steps"] == 3 and result.summary["final_version"] == 3
    base = result.summary["model_path"]
    store = WeightStore(str(result.run_dir / "weights"))
    full_bytes = sum(t.numel() * t.element_size() for t in load_causal_lm(base).state_dict().values())
    for version in range(4):
        state, ref = store.pull("main", None, version)
        assert L.is_adapter_state(state) and ref.nbytes < full_bytes / 5  # adapter tensors only
    ds = result.metrics()
    assert ds["train_behavior_version_max"].sel(policy="main").values.tolist() == [0, 1, 2]  # rollouts ran on the
    #   published adapters, each token stamped with its adapter's version

    adapter = export_hf(result.run_dir, tmp_path / "adapter")
    merged = export_hf(result.run_dir, tmp_path / "merged", merge=True)
    state, _ = store.pull("main", None, 3)
    trained = L.add_lora(load_causal_lm(base), LORA).eval()
    trained.load_state_dict({k.replace(".weight", ".default.weight"): v for k, v in state.items()}, strict=False)
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    with torch.no_grad():
        want = trained(ids).logits
        got = PeftModel.from_pretrained(load_causal_lm(base), str(adapter)).eval()(ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(merged)(ids).logits, want, rtol=0,
                                   atol=1e-4)


def test_two_lora_policies_share_one_base_in_the_rollout_service(tmp_path, monkeypatch):
    from astratk.rollout import service as services
    from astratk.rollout.services import SERVICES

    env = SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=8))
    trainer = TrainerSpec(max_steps=2, groups_per_step=2, batch_timeout_s=120)
    spec = RunSpec(
        name="lora2", output_dir=str(tmp_path / "runs"), env=env,
        policies=[PolicySpec(policy_id=pid, roles=[pid], model=_model(tmp_path), trainer=trainer)
                  for pid in ("solver", "verifier")],
        rollout=RolloutSpec(group_size=2, max_new_tokens=6, tasks_per_chunk=2),
        dataflow=DataflowSpec(max_staleness=8, filter_zero_variance=False),
        cluster=ClusterSpec(rollout_workers=1, startup_timeout_s=120, processes=False),
        eval=EvalSpec(interval_s=1000, max_tasks=8, timeout_s=120))
    # The run releases its rollout service at its end (closing its engines): look at it as it is released.
    seen: list[dict] = []
    close = services.RolloutService.close

    def look_then_close(service):
        views = dict(service._engines)
        seen.append({"views": views, "bases": list(service._bases.values()),
                     "engine_ids": {id(v.engine) for v in views.values()},
                     "adapters": sorted(next(iter(service._bases.values())).adapters) if service._bases else [],
                     "versions": {key: v.version for key, v in views.items()}})
        close(service)

    monkeypatch.setattr(services.RolloutService, "close", look_then_close)
    before = set(SERVICES)
    result = Run(spec, printer=lambda s: None).start()
    assert result.summary["solver_final_version"] == 2 and result.summary["verifier_final_version"] == 2
    assert set(SERVICES) == before  # released, its engines closed
    [released] = seen  # this process's one rollout service
    views = released["views"]
    assert {pid for _, pid in views} == {"solver", "verifier"}
    assert len(released["bases"]) == 1 and len(released["engine_ids"]) == 1  # one base model
    assert released["adapters"] == sorted(f"{purpose}/{pid}" for purpose, pid in views)
    # the final evaluation moved both eval adapters to the last published versions (the rollout adapters stop
    # wherever the last rollout task found them)
    assert released["versions"][("eval", "solver")] == 2 and released["versions"][("eval", "verifier")] == 2


def test_lora_run_resumes_from_an_adapter_checkpoint_exactly(tmp_path):
    """Synchronous mode: a LoRA run resumed from its adapter-only checkpoint trains exactly the steps of the
    uninterrupted run (as tests/integration/test_resume.py checks for full fine-tuning)."""
    import numpy as np

    from tests.integration.test_resume import COMPARED, sync_spec

    def spec(name: str, resume_from: str | None = None) -> RunSpec:
        s = sync_spec(tmp_path, name, str(tmp_path / "cache"), steps=4, resume_from=resume_from)
        s.policies[0].model.lora = LORA
        s.policies[0].model.tiny = TinyModelSpec(warm_start_steps=30, warm_start_batch=32, warm_start_target=None)
        return s

    full = Run(spec("full"), printer=lambda s: None).start()
    ckpt = full.run_dir / "checkpoints" / "main" / "step=2.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["state_dict"] and all(".lora_" in k for k in saved["state_dict"])  # the adapters, not the base
    resumed = Run(spec("resumed", str(ckpt)), printer=lambda s: None).start()
    a, b = full.metrics(), resumed.metrics()
    assert a.sizes["step"] == 4 and b.sizes["step"] == 2
    for name in COMPARED:
        np.testing.assert_array_equal(a[name].values[..., 2:], b[name].values, err_msg=name)
    assert float(a["train_reward_mean"].std()) > 0
