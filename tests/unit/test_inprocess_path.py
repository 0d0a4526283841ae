"""The whole data path in one process, no Dask: in-process data layer, a rollout service, the Lightning trainer.

This is the laptop/debugger path (and what the Dask tasks call): lease -> rollout -> score -> admit -> next_batch
-> collate -> DRPO step -> publish -> the service syncs the new version -> its tokens carry that version.
"""

import lightning.pytorch as pl
import pytest
import torch

from astratk.dataflow.client import DataLayerClient
from astratk.dataflow.datalayer import DataLayer
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.losses.drpo import DRPO
from astratk.models import ensure_model
from astratk.records import RunContext
from astratk.registry import resolve
from astratk.rollout.service import RolloutService
from astratk.runtime.deploy import publish_initial
from astratk.spec import DataflowSpec, ModelSpec, PolicySpec, RolloutSpec, RunSpec, TinyModelSpec, TrainerSpec
from astratk.training.data import GroupStream, RolloutDataModule
from astratk.training.module import PolicyModule
from astratk.training.publish import WeightPublisher
from astratk.weights.store import WeightStore


class ParityEnv(ArithmeticEnv):
    """Arithmetic whose reward is the parity of the completion's length, so an untrained model's groups still have
    reward variance (hence non-zero advantages and a real update)."""

    def grade(self, task, text):
        return float(len(text) % 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    env = ParityEnv(levels=[1], n_heldout=16)
    spec = ModelSpec(tiny=TinyModelSpec(warm_start_steps=5, warm_start_batch=8, warm_start_target=None),
                     cache_dir=str(tmp_path_factory.mktemp("cache")))
    return str(ensure_model(spec, env, log=lambda s: None)), env


@pytest.mark.parametrize("loss_name", ["drpo", "dppo_topk_tv"])
def test_in_process_path_trains_and_versions_reach_rollouts(model_dir, tmp_path, loss_name):
    """DRPO, and DPPO Top-K, whose top-K log-probs must travel engine -> trajectory -> collate -> trainer."""
    path, env = model_dir
    loss = DRPO(delta=0.2) if loss_name == "drpo" else resolve("loss", loss_name)()
    spec = RunSpec(env=env, policies=[PolicySpec(loss=loss,
                                                 trainer=TrainerSpec(groups_per_step=2, lr=1e-3))],
                   rollout=RolloutSpec(group_size=4, max_new_tokens=4),
                   dataflow=DataflowSpec(filter_zero_variance=False, prefetch_steps=1)).validate()
    store = WeightStore(f"memory://inproc-{tmp_path.name}")
    publish_initial(store, "main", path)
    handle = DataLayerClient(DataLayer(spec))
    service = RolloutService(RunContext("inproc", spec, {"main": path}, store.url))

    def roll_and_admit() -> None:
        leases = handle.lease(2)
        for res in service.score(service.rollout(leases)):
            handle.admit(res.lease_id, list(res.groups))

    roll_and_admit()  # step 0's data, sampled by version 0
    stream = GroupStream(handle, "main", pad_id=0, max_steps=2, timeout_s=5)
    module = PolicyModule(path, loss, lr=1e-3, horizon=4)
    before = {k: v.clone() for k, v in module.model.state_dict().items()}

    first_step: dict[str, float] = {}

    class RolloutBetweenSteps(pl.Callback):  # stands in for the asynchronous acquisition loop
        def on_train_batch_end(self, trainer, pl_module, *args):
            first_step.update(first_step or pl_module.step_metrics)
            roll_and_admit()

    publisher = WeightPublisher(store, handle, "main", every=1)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[publisher, RolloutBetweenSteps()])
    trainer.fit(module, datamodule=RolloutDataModule(stream))

    # step 0 trains on-policy (sampled by v0, trained at v0): through the real tokenizer, chat template, engine and
    # collate, the trainer's log-probs equal the engine's, so every ratio is 1 (to fp32 round-off)
    assert abs(first_step["train/main/loss/ratio_max"] - 1.0) < 1e-4
    assert abs(first_step["train/main/loss/ratio_mean"] - 1.0) < 1e-5
    if loss_name == "dppo_topk_tv":  # on-policy, the top-K divergence is 0 and nothing is masked
        assert first_step["train/main/loss/divergence_max"] < 1e-5
        assert first_step["train/main/loss/masked_frac"] == 0.0
    assert [r.version for r in publisher.refs] == [1, 2]
    assert handle.version("main") == 2
    changed = any(not torch.equal(before[k], v) for k, v in module.model.state_dict().items())
    assert changed
    # the rollouts between steps synced to the newest version, and their tokens say so
    assert service.engine("main").version == 2
    batch2 = handle.next_batch("main", 2)
    assert {t.behavior_versions[0] for g in batch2 for t in g.trajectories} == {2}
    assert stream.total_wait_s < 5
