"""A run that cannot train ends early and says why, in one process (no Dask): groups of one refused at start, a
starved trainer stops (at its time limit, or after its batch timeout with the reason from the drop counters), a
diverging trainer skips bad steps without publishing them and stops after k in a row, and prompts longer than the
model's context are dropped before generation, counted with their task ids."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk.contracts import GenerationRequest, LossOutputs, PolicyLoss, PromptTooLong, SamplingParams
from astratk.dataflow.client import DataLayerClient
from astratk.dataflow.datalayer import DataLayer
from astratk.dataflow.drops import starvation_reason
from astratk.engines import ScriptedEngine, TorchEngine
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.multiturn import Budget, Conversation
from astratk.losses.drpo import DRPO
from astratk.models import build_char_tokenizer, ensure_model
from astratk.records import RunContext
from astratk.rollout.context import ContextLimit
from astratk.rollout.service import RolloutService
from astratk.rollout.tasks import admit_task
from astratk.runtime.acquisition import task_accounting
from astratk.runtime.deploy import publish_initial
from astratk.runtime.wrap_up import _stop_summary
from astratk.spec import (
    DataflowSpec,
    DivergenceSpec,
    ModelSpec,
    PolicySpec,
    RolloutSpec,
    RunSpec,
    TinyModelSpec,
    TrainerSpec,
)
from astratk.training.data import EndOfStream, GroupStream, RolloutDataModule
from astratk.training.divergence import DivergenceGuard
from astratk.training.module import PolicyModule
from astratk.training.publish import WeightPublisher
from astratk.training.recorder import StepRecorder
from astratk.weights.store import WeightStore


def raw_reward(rewards):
    """An advantage that learns from one sample (REINFORCE without a baseline)."""
    return list(rewards)


class ParityEnv(ArithmeticEnv):
    """Reward = parity of the completion's length: an untrained model's groups have reward variance."""

    def grade(self, task, text):
        return float(len(text) % 2)


class ConstantEnv(ArithmeticEnv):
    """Every completion scores 1: every group is zero-variance."""

    def grade(self, task, text):
        return 1.0


# ------------------------------------------------------------------------------------------------ groups of one


def test_group_size_one_is_refused_at_start_naming_the_key_and_why():
    with pytest.raises(ValueError, match=r"rollout.group_size is 1: every group of one sample has zero reward"):
        RunSpec(rollout=RolloutSpec(group_size=1)).validate()
    # without the filter, a group advantage still gives every group of one advantage 0
    spec = RunSpec(rollout=RolloutSpec(group_size=1), dataflow=DataflowSpec(filter_zero_variance=False))
    with pytest.raises(ValueError, match=r"rollout.group_size is 1: dataflow.advantage 'dr_grpo' compares"):
        spec.validate()
    # an advantage that learns from one sample, and no zero-variance filter: allowed
    RunSpec(rollout=RolloutSpec(group_size=1),
            dataflow=DataflowSpec(filter_zero_variance=False, advantage=f"{__name__}.raw_reward")).validate()
    RunSpec(rollout=RolloutSpec(group_size=2)).validate()


# ------------------------------------------------------------------------------------------- in-process trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    spec = ModelSpec(tiny=TinyModelSpec(warm_start_steps=5, warm_start_batch=8, warm_start_target=None),
                     cache_dir=str(tmp_path_factory.mktemp("cache")))
    return str(ensure_model(spec, ParityEnv(levels=[1], n_heldout=16), log=lambda s: None))


def wire(model_dir, tmp_path, env, **trainer):
    """An in-process data layer, weight store and rollout service for `env`; `roll()` rolls out and admits 2 tasks."""
    spec = RunSpec(env=env, policies=[PolicySpec(loss=DRPO(delta=0.2),
                                                 trainer=TrainerSpec(groups_per_step=2, lr=1e-3, **trainer))],
                   rollout=RolloutSpec(group_size=4, max_new_tokens=4),
                   dataflow=DataflowSpec(prefetch_steps=1)).validate()
    store = WeightStore(f"memory://early-{tmp_path.name}")
    publish_initial(store, "main", model_dir)
    handle = DataLayerClient(DataLayer(spec))
    service = RolloutService(RunContext("early", spec, {"main": model_dir}, store.url))

    def roll() -> None:
        admit_task(service.score(service.rollout(handle.lease(2))), handle)

    return spec, store, handle, roll


class Acquiring:
    """Rolls out and admits in a background thread while the trainer runs (the acquisition loop's stand-in)."""

    def __init__(self, roll) -> None:
        self.roll, self.stop = roll, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.roll()
            time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)


def trainer(callbacks=(), **flags) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=list(callbacks), **flags)


def test_a_starved_trainer_stops_after_its_batch_timeout_saying_why(model_dir, tmp_path):
    """Every group is zero-variance: before, the wait raised TimeoutError out of fit (and the run lost its
    metrics); now the fit ends cleanly and the stream says what became of the data."""
    _, _, handle, roll = wire(model_dir, tmp_path, ConstantEnv(levels=[1], n_heldout=8))
    stream = GroupStream(handle, "main", pad_id=0, max_steps=3, timeout_s=1.5)
    module = PolicyModule(model_dir, DRPO(delta=0.2), lr=1e-3, horizon=4)
    recorder = StepRecorder(stream)
    with Acquiring(roll):
        trainer([recorder], max_steps=3).fit(module, datamodule=RolloutDataModule(stream))
    assert recorder.rows == [] and stream.total_wait_s >= 1.5
    reason = stream.stop_reason
    assert reason.startswith("policy 'main' got no batch for step 0 in ")
    assert "groups rolled out since were dropped as zero-variance: rewards all equal" in reason
    assert handle.metrics()["data/main/groups_dropped_zero_variance"] > 0


def test_the_wait_for_a_batch_ends_at_the_trainers_time_limit(model_dir, tmp_path):
    """max_time 2 s, batch timeout 30 s: the fit ends at its deadline as a time-limited fit does (no stop reason).
    Before, it waited the whole batch timeout and raised."""
    _, _, handle, roll = wire(model_dir, tmp_path, ConstantEnv(levels=[1], n_heldout=8))
    stream = GroupStream(handle, "main", pad_id=0, max_steps=3, timeout_s=30)
    module = PolicyModule(model_dir, DRPO(delta=0.2), lr=1e-3, horizon=4)
    start = time.monotonic()
    with Acquiring(roll):
        trainer(max_steps=3, max_time={"seconds": 2}).fit(module, datamodule=RolloutDataModule(stream))
    assert time.monotonic() - start < 15
    assert stream.stop_reason is None and 1.0 < stream.total_wait_s < 15


class NaNLoss(PolicyLoss):
    """DRPO's token losses times NaN: every gradient is NaN."""

    def __call__(self, inputs):
        out = DRPO(delta=0.2)(inputs)
        return LossOutputs(out.token_losses * float("nan"), out.mask, out.metrics)


def test_divergence_guard_skips_unpublished_steps_and_stops_after_k(model_dir, tmp_path):
    """A non-finite loss: the steps are skipped (weights and optimiser untouched), counted, not published, and the
    second in a row stops the fit with the reason. Before, the NaN update reached the weights and was published."""
    _, store, handle, roll = wire(model_dir, tmp_path, ParityEnv(levels=[1], n_heldout=8))
    stream = GroupStream(handle, "main", pad_id=0, max_steps=5, timeout_s=30)
    module = PolicyModule(model_dir, NaNLoss(), lr=1e-3, horizon=4)
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    recorder = StepRecorder(stream)
    publisher = WeightPublisher(store, handle, "main", every=1)
    guard = DivergenceGuard(DivergenceSpec(max_skips=2), "main", recorder)
    fit = trainer([publisher, recorder, guard], max_steps=5)
    with Acquiring(roll):
        fit.fit(module, datamodule=RolloutDataModule(stream))
    assert stream.stop_reason is None
    assert len(recorder.rows) == 2 and fit.global_step == 2  # stopped after the second skip
    assert [r["train/main/skipped_steps"] for r in recorder.rows] == [1.0, 2.0]
    assert all(torch.equal(before[k], v) for k, v in module.model.state_dict().items())
    assert not fit.optimizers[0].state  # AdamW never stepped a parameter: no moments, no weight decay
    assert publisher.refs == [] and handle.version("main") == 0
    assert "diverged: 2 optimiser steps in a row were skipped (steps 0..1; the last: loss is nan)" in (
        recorder.stop_reason)


def test_healthy_steps_pass_the_guard_and_publish(model_dir, tmp_path):
    _, store, handle, roll = wire(model_dir, tmp_path, ParityEnv(levels=[1], n_heldout=8))
    stream = GroupStream(handle, "main", pad_id=0, max_steps=2, timeout_s=30)
    module = PolicyModule(model_dir, DRPO(delta=0.2), lr=1e-3, horizon=4)
    recorder = StepRecorder(stream)
    publisher = WeightPublisher(store, handle, "main", every=1)
    guard = DivergenceGuard(DivergenceSpec(), "main", recorder)
    with Acquiring(roll):
        trainer([publisher, recorder, guard], max_steps=2, gradient_clip_val=1.0).fit(
            module, datamodule=RolloutDataModule(stream))
    assert [r.version for r in publisher.refs] == [1, 2] and recorder.stop_reason is None
    assert all(r["train/main/skipped_steps"] == 0 and r["train/main/grad_norm"] > 0 for r in recorder.rows)


def test_spikes_over_the_running_median_are_skipped():
    guard = DivergenceGuard(DivergenceSpec(spike_factor=10.0, window=20, max_skips=3), "main")
    assert all(guard.check(0.5, n) is None for n in [1.0, 2.0, 1.5] * 3)  # 9 accepted: too few to judge a spike
    assert guard.check(0.5, 100.0) is None  # the 10th joins the window
    assert "is 67x the running median 1.5" in guard.check(0.5, 100.0)
    assert guard.check(0.5, 14.0) is None
    assert guard.check(float("inf"), 1.0) == "loss is inf"
    assert guard.check(0.5, float("nan"), scaler=True) is None  # fp16's loss scaler skips those itself


def test_a_skipped_step_is_not_published_and_versions_keep_counting_steps():
    published = []
    pub = WeightPublisher(SimpleNamespace(), SimpleNamespace(), "main", every=1)
    pub.publish = lambda module, version=None: published.append(version) or setattr(module, "policy_version",
                                                                                      version)
    module = SimpleNamespace(policy_version=0, step_skipped=False)
    for step, skipped in [(1, False), (2, True), (3, False), (4, True)]:
        module.step_skipped = skipped
        pub.on_train_batch_end(SimpleNamespace(global_step=step, max_steps=4, is_global_zero=True), module, None,
                               None, 0)
    # step 2 skipped: no version 2; step 3 publishes version 3; the last step (4) publishes even when skipped: the
    # data layer's final version (max_steps // publish_every) is what deployments and version barriers wait for
    assert published == [1, 3, 4]
    sync = WeightPublisher(SimpleNamespace(), SimpleNamespace(), "main", every=1, publish_skipped=True)
    sync.publish = pub.publish
    module.policy_version, published[:] = 0, []
    for step in (1, 2):
        module.step_skipped = True
        sync.on_train_batch_end(SimpleNamespace(global_step=step, max_steps=9, is_global_zero=True), module, None,
                                None, 0)
    assert published == [1, 2]  # synchronous mode: the data layer serves step k only once version k exists


def test_the_summary_says_whether_a_run_stopped_early_and_why():
    spec = RunSpec()
    rows = [{"train/main/skipped_steps": 0.0}, {"train/main/skipped_steps": 2.0}]
    assert _stop_summary(spec, {"main": {"rows": rows, "stop_reason": None}}) == {
        "stopped_early": False, "stop_reason": None, "skipped_steps": 2}
    assert _stop_summary(spec, {"main": {"rows": [], "stop_reason": "starved"}})["stop_reason"] == "starved"
    # A trainer that saw no rollout asks whether the workers are alive; where the driver saw an evaluation holding
    # them meanwhile, the reason says so instead.
    starved = starvation_reason("main", 0, 300.0, ({}, []), ({}, []))
    assert "are rollout workers running" in starved
    line = ("[starving] policy 'main': its trainer has waited 241s for a batch and no rollout arrived meanwhile: the "
            "rollout workers are evaluating (main v0 for 190s on 32 held-out tasks); evaluations share them with "
            "rollouts, so rollout.concurrent_chunks: 2 (an evaluation beside a rollout chunk), fewer eval.max_tasks "
            "or a longer eval.interval_s lets training start sooner")
    warnings = [{"policy": "other", "line": "x"}, {"policy": "main", "line": line}]
    reason = _stop_summary(spec, {"main": {"rows": [], "stop_reason": starved}}, warnings)["stop_reason"]
    assert reason == ("policy 'main' got no batch for step 0 in 300s: no rollout of this policy arrived meanwhile; "
                      "the rollout workers were evaluating (main v0 for 190s on 32 held-out tasks); evaluations share "
                      "them with rollouts, so rollout.concurrent_chunks: 2 (an evaluation beside a rollout chunk), "
                      "fewer eval.max_tasks or a longer eval.interval_s lets training start sooner")
    alive = [{"policy": "main", "line": "[starving] ... are the rollout workers alive? ..."}]
    assert _stop_summary(spec, {"main": {"rows": [], "stop_reason": starved}}, alive)["stop_reason"] == starved


# ------------------------------------------------------------------------------------------ prompts too long


def test_torch_engine_never_generates_past_its_position_limit():
    config = Qwen2Config(vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=256, max_position_embeddings=32)
    torch.manual_seed(0)
    engine = TorchEngine.from_model(Qwen2ForCausalLM(config).float().eval(), None)
    try:
        assert engine.max_model_len == 32
        [c] = asyncio.run(engine.generate([GenerationRequest((1,) * 28, SamplingParams(max_tokens=16, seed=0))]))
        assert len(c.token_ids) <= 4 and (len(c.token_ids) == 4 or c.finish_reason == "stop")
        with pytest.raises(PromptTooLong, match=r"a prompt of 32 tokens leaves no room for a new token in the "
                                                r"model's context \(max_model_len"):
            asyncio.run(engine.generate([GenerationRequest((1,) * 32, SamplingParams(max_tokens=4))]))
    finally:
        engine.close()


def test_context_limit_refuses_a_prompt_before_the_engine_sees_it():
    engine = ScriptedEngine(None, [[5] * 10], max_model_len=10)
    limited = ContextLimit(engine)
    [c] = asyncio.run(limited.generate([GenerationRequest((1,) * 7, SamplingParams(max_tokens=8))]))
    assert c.token_ids == (5, 5, 5) and c.finish_reason == "length"
    with pytest.raises(PromptTooLong):
        asyncio.run(limited.generate([GenerationRequest((1,) * 10, SamplingParams(max_tokens=8))]))
    assert len(engine.requests) == 1  # the refused request never reached the engine


def test_a_task_whose_prompt_does_not_fit_is_dropped_before_generation_with_its_id(model_dir, tmp_path):
    """A scripted engine with a 16-position context: every arithmetic prompt is longer. Before, nothing checked the
    length (TorchEngine generated past the limit; vLLM's refusal failed the chunk, retried until `failed`)."""
    env = ParityEnv(levels=[1], n_heldout=8)
    spec = RunSpec(env=env, rollout=RolloutSpec(engine="scripted", group_size=2, max_new_tokens=4,
                                                engine_args={"script": [[7]], "max_model_len": 16}),
                   dataflow=DataflowSpec(prefetch_steps=1)).validate()
    store = WeightStore(f"memory://long-{tmp_path.name}")
    publish_initial(store, "main", model_dir)
    handle = DataLayerClient(DataLayer(spec))
    service = RolloutService(RunContext("long", spec, {"main": model_dir}, store.url))
    leases = handle.lease(2)
    results = service.score(service.rollout(leases))
    assert [r.dropped for r in results] == ["prompt_too_long"] * 2 and all(not r.groups for r in results)
    admit_task(results, handle)
    admit_task(results, handle)  # a duplicate result counts once
    m = handle.metrics()
    assert m["data/tasks_dropped_prompt_too_long"] == 2 and m.get("data/leases_waiting_reissue", 0) == 0
    assert task_accounting(m)["tasks_lost"] == 0
    [drop] = [d for d in handle.drops() if d.reason == "prompt_too_long"]
    assert (drop.stage, drop.unit, drop.count) == ("rollout", "tasks", 2.0)
    assert set(drop.task_ids) == {lease.task.task_id for lease in leases}


def test_a_conversation_stops_at_the_engines_context_as_at_its_own_budget():
    tok = build_char_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "2+2?"}]
    n_prompt = len(Conversation.start(tok, messages, Budget()).tokens)
    engine = ScriptedEngine(tok, [list(tok("abc", add_special_tokens=False)["input_ids"]) + [end]],
                            max_model_len=n_prompt + 20)
    conv = Conversation.start(tok, messages, Budget(max_turns=8, max_context=1024))
    asyncio.run(conv.assistant_turn(engine, SamplingParams(max_tokens=64)))
    assert conv.max_context == n_prompt + 20  # the engine's, smaller than the budget's 1024
    conv.add_message("tool", "x" * 200)
    assert len(conv.tokens) == n_prompt + 20 and not conv.can_continue
    assert conv.metrics["context_exhausted"] == 1.0
    short = ScriptedEngine(tok, [[end]], max_model_len=n_prompt)
    with pytest.raises(PromptTooLong):
        asyncio.run(Conversation.start(tok, messages, Budget()).assistant_turn(short, SamplingParams()))


def test_end_of_stream_travels_as_a_batch():
    """Lightning moves batches to the device and refuses frozen dataclasses it cannot rebuild."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    end = EndOfStream(3, "why")
    assert move_data_to_device(end, torch.device("cpu")) is end


def test_trainer_jobs_forward_every_hook_of_the_policy_callbacks(tmp_path):
    """`astratk train fit` runs the policy's callbacks inside `DeploymentCallbacks`: a hook it does not forward
    (the divergence guard's `on_before_optimizer_step`, its checkpoint state) silently does nothing there."""
    from astratk.runtime.trainer_job import DeploymentCallbacks
    from astratk.training import build

    spec = RunSpec(policies=[PolicySpec(trainer=TrainerSpec(gpu_memory_fraction=0.5))])
    inner, _ = build.callbacks(spec, "main", stream=SimpleNamespace(datalayer=None), store=None,
                               stop_file=tmp_path / "STOP")
    assert any(isinstance(cb, DivergenceGuard) for cb in inner)
    hooks = [name for name in dir(pl.Callback) if not name.startswith("_") and callable(getattr(pl.Callback, name))
             and name != "setup"]
    missing = {(type(cb).__name__, name) for cb in inner for name in hooks
               if getattr(type(cb), name) is not getattr(pl.Callback, name)
               and getattr(DeploymentCallbacks, name) is getattr(pl.Callback, name)}
    assert not missing


def test_a_trainer_process_that_ends_early_stops_the_others_and_keeps_every_result(tmp_path):
    """Multi-policy runs: before, a trainer's non-zero exit raised RuntimeError and the run wrote nothing."""
    import collections
    import json
    import subprocess
    import sys

    from astratk.runtime.trainers import TrainerProcesses, trainer_dir

    def write_steps(pid: str, reason: str | None) -> str:
        path = trainer_dir(tmp_path, pid) / "steps.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{f"train/{pid}/loss": 0.5}]
        return (f"import json, pathlib; pathlib.Path({str(path)!r}).write_text(json.dumps("
                f"{{'rows': {rows!r}, 'data_wait_s': 1.0, 'group_ids': [], 'stop_reason': {reason!r}}}))")

    stop = trainer_dir(tmp_path, "b") / "STOP"
    procs = TrainerProcesses(RunSpec(), tmp_path, "dep", "tcp://x:1")
    procs.procs = {
        "a": subprocess.Popen([sys.executable, "-c", write_steps("a", "a starved") + "; raise SystemExit(1)"]),
        "b": subprocess.Popen([sys.executable, "-c", "import pathlib, time\n"
                               f"while not pathlib.Path({str(stop)!r}).exists(): time.sleep(0.05)\n"
                               + write_steps("b", "stopped: ignored")])}
    procs.tails = {pid: collections.deque(["last line"]) for pid in procs.procs}
    results = procs.wait(grace_s=30)
    assert results["a"]["stop_reason"] == "a starved" and results["b"]["stop_reason"] is None
    assert results["b"]["rows"] == [{"train/b/loss": 0.5}] and json.loads(stop.with_name("steps.json").read_text())
