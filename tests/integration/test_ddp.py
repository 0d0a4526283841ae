"""Data-parallel training across two CPU processes (Lightning DDP, gloo) gives the update of one process on the whole
batch, with each rank consuming its own shard of the step's batch from the data-layer actor.

The real path: a Dask cluster whose control worker hosts the `DataLayer` actor (`astratk.runtime.deploy`); fixed
groups (ragged lengths, an odd number of groups, so the ranks' token and sequence counts differ) are admitted to it;
each trainer rank attaches its own Dask client and its `GroupStream` asks `next_batch(policy, step, rank, 2)`, which
returns `groups[rank::2]` of the step's batch, collated per rank. The reference is one process asking for the same
step's batch with world_size 1. Compared: the groups each rank trained on, the all-reduced gradient (before
clipping) and the weights after the optimiser step, to 1e-6. SGD, because Adam's first step is ~lr x sign(gradient)
and would hide a wrong normalisation.

Why `ddp_spawn`: Lightning's `ddp` re-runs the launching command (here, pytest) once per extra rank, and `ddp_fork`
would fork a process that already runs a Dask client's threads. Spawned ranks re-import this module, so everything
they run is defined at module level.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk.dataflow.client import DataLayerClient
from astratk.losses.drpo import DRPO
from astratk.losses.m2po import M2PO
from astratk.records import Group, Task, Trajectory
from astratk.runtime.deploy import start_datalayer
from astratk.spec import DataflowSpec, PolicySpec, RunSpec, TrainerSpec
from astratk.training.data import GroupStream, RolloutDataModule
from astratk.training.module import PolicyModule

pytestmark = pytest.mark.integration

WORLD = 2
PAD = 0
H = 8  # horizon for seq-mean-token-sum-norm
# 5 groups (rank 0 gets 3, rank 1 gets 2) of 2 or 3 samples with ragged completions: every count differs by rank
GROUP_SIZES = (3, 2, 3, 2, 2)
TOLERANCE = 1e-6


class SGDPolicy(PolicyModule):
    """Plain SGD so that the weight update is linear in the gradient."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)


class ShardedData(RolloutDataModule):
    """This rank's shard of each step's batch from the data-layer actor: a Dask client of its own (a spawned rank
    has none), then the real `GroupStream` with the trainer's rank and world size."""

    def __init__(self, handle: DataLayerClient, scheduler: str) -> None:
        pl.LightningDataModule.__init__(self)
        self.handle, self.scheduler, self.client = handle, scheduler, None
        self.stream = None

    def setup(self, stage: str) -> None:
        from distributed import Client, default_client

        try:
            default_client()
        except ValueError:  # a spawned rank: the actor handle binds to this default client on its first call
            self.client = Client(self.scheduler, timeout=30)
        self.stream = GroupStream(self.handle, "main", PAD, max_steps=1, timeout_s=30,
                                  rank=self.trainer.global_rank, world_size=self.trainer.world_size)

    def teardown(self, stage: str) -> None:
        if self.client is not None:
            self.client.close()


class Record(pl.Callback):
    """Writes what this rank trained on and computed to <out>/<name>.pt (rank 0 returns only its weights)."""

    def __init__(self, out: str, name: str) -> None:
        self.out, self.name, self.grads = out, name, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # after the all-reduce, before clipping
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()}

    def on_train_end(self, trainer, pl_module) -> None:
        name = self.name.format(rank=trainer.global_rank)
        torch.save({"grads": self.grads, "metrics": dict(pl_module.step_metrics),
                    "groups": list(trainer.datamodule.stream.group_ids),
                    "weights": {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}},
                   Path(self.out) / f"{name}.pt")


def fit(model_path: str, loss, aggregation: str, micro_batch_tokens: int | None, data: RolloutDataModule,
        out: Path, name: str, devices: int = 1, updates: int = 1) -> None:
    module = SGDPolicy(model_path, loss, lr=0.5, aggregation=aggregation, horizon=H,
                       micro_batch_tokens=micro_batch_tokens, updates_per_batch=updates)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=devices,
                         strategy="ddp_spawn" if devices > 1 else "auto", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         gradient_clip_val=1.0, callbacks=[Record(str(out), name)])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ddp_spawn.*")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, datamodule=data)


def make_groups() -> list[Group]:
    g = torch.Generator().manual_seed(0)
    groups = []
    for i, size in enumerate(GROUP_SIZES):
        task = Task(f"t{i}", "synthetic", f"prompt {i}")
        trajs = []
        for j in range(size):
            n_prompt, n_completion = 3 + i % 2, int(torch.randint(1, H + 1, (1,), generator=g))
            tokens = tuple(int(x) for x in torch.randint(1, 64, (n_prompt + n_completion,), generator=g))
            # near the untrained model's log(1/64) = -4.16, so ratios are O(1) and M2PO's cut keeps some tokens
            mu = tuple(float(x) for x in -4.6 + torch.rand(n_completion, generator=g))
            trajs.append(Trajectory(task_id=task.task_id, group_id=f"g{i}", policy_id="main", role="policy",
                                    tokens=tokens, n_prompt=n_prompt, loss_mask=(1,) * n_completion,
                                    behavior_logprobs=mu, behavior_versions=(0,) * n_completion,
                                    reward=float(j % 2) + 0.1 * i))
        groups.append(Group(f"g{i}", task, "main", tuple(trajs)))
    return groups


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=128, num_hidden_layers=2, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_qwen2_ddp")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0", resources={"control": 1}) as cluster, Client(cluster) as c:
        yield c


def datalayer(client) -> DataLayerClient:
    """A fresh actor with the fixed groups admitted: one step's batch of all of them."""
    spec = RunSpec(policies=[PolicySpec(trainer=TrainerSpec(groups_per_step=len(GROUP_SIZES)))],
                   dataflow=DataflowSpec(filter_zero_variance=False))
    handle = DataLayerClient(start_datalayer(client, spec, timeout_s=60))
    leases = handle.lease(len(GROUP_SIZES))  # results are admitted only for leases the layer issued
    for lease, group in zip(leases, make_groups(), strict=True):
        assert handle.admit(lease.lease_id, [dataclasses.replace(group, task=lease.task)]).admitted == 1
    return handle


@pytest.mark.parametrize(("loss", "aggregation", "micro_batch_tokens"), [
    (DRPO(delta=0.5), "token-mean", None),
    (M2PO(tau=0.05), "seq-mean-token-mean", 24),  # batch statistics all-reduced, micro-batch counts differ by rank
], ids=["drpo-token-mean", "m2po-seq-mean-micro-batches"])
def test_two_rank_ddp_equals_one_process_on_the_global_batch(client, model_path, tmp_path, loss, aggregation,
                                                            micro_batch_tokens):
    handle = datalayer(client)
    whole = [g.group_id for g in handle.next_batch("main", 0, 0, 1)]  # step 0's batch, formed once
    assert len(whole) == len(GROUP_SIZES)
    fit(model_path, loss, aggregation, micro_batch_tokens, ShardedData(handle, client.scheduler.address), tmp_path,
        "single")
    fit(model_path, loss, aggregation, micro_batch_tokens, ShardedData(handle, client.scheduler.address), tmp_path,
        "rank{rank}", devices=WORLD)
    single = torch.load(tmp_path / "single.pt")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    # sharding: rank r trained on groups[r::2] of the one batch, the single process on all of it
    assert single["groups"] == whole
    assert [r["groups"] for r in ranks] == [whole[r::WORLD] for r in range(WORLD)]
    if micro_batch_tokens is not None:
        assert [r["metrics"]["train/main/micro_batches"] for r in ranks] == [4.0, 2.0]  # ragged on purpose
    if isinstance(loss, M2PO):  # the cut binds, and both ranks report the global batch's statistic
        assert 0.05 < single["metrics"]["train/main/loss/mask_frac"] < 0.95
        assert [r["metrics"]["train/main/loss/mask_frac"] for r in ranks] == pytest.approx(
            [single["metrics"]["train/main/loss/mask_frac"]] * WORLD)
    # normalisation: the averaged gradient is the global batch's, so the SGD step is the single process's
    scale = max(g.abs().max().item() for g in single["grads"].values())
    for r in ranks:
        grad_diff = max((r["grads"][n] - single["grads"][n]).abs().max().item() for n in single["grads"])
        weight_diff = max((r["weights"][n] - single["weights"][n]).abs().max().item() for n in single["weights"])
        assert grad_diff < TOLERANCE * max(scale, 1.0), f"gradient differs by {grad_diff:.3g} (largest {scale:.3g})"
        assert weight_diff < TOLERANCE, f"weights differ by {weight_diff:.3g}"
        assert r["metrics"]["train/main/loss"] == pytest.approx(single["metrics"]["train/main/loss"], rel=1e-5)
    assert scale > 1e-3 and max(single["weights"][n].sub(w).abs().max().item()  # a real update happened
                                for n, w in Qwen2ForCausalLM.from_pretrained(model_path).named_parameters()) > 1e-4


def test_two_rank_ddp_with_two_updates_per_batch(client, model_path, tmp_path):
    """`updates_per_batch: 2` under DDP: each rank cuts its own shard into two slices; update j averages the ranks'
    slice-j gradients with the counts of both ranks' slice j, so it is one process's update on the union of the
    ranks' slice j. Reference: SGD by hand on those unions, from the collated global batch, with the same clipping."""
    from astratk.training.collate import collate, select_rows

    handle = datalayer(client)
    groups = handle.next_batch("main", 0, 0, 1)
    fit(model_path, DRPO(delta=0.5), "token-mean", None, ShardedData(handle, client.scheduler.address), tmp_path,
        "rank{rank}", devices=WORLD, updates=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert [r["metrics"]["train/main/updates"] for r in ranks] == [2.0, 2.0]

    # the global batch's rows by group (sizes 3, 2, 3, 2, 2); rank r holds groups r::2, each cut in two halves
    batch = collate(groups, PAD)
    starts = [sum(GROUP_SIZES[:i]) for i in range(len(GROUP_SIZES))]
    shard = [[starts[i] + j for i in range(r, len(GROUP_SIZES), WORLD) for j in range(GROUP_SIZES[i])]
             for r in range(WORLD)]
    halves = [[torch.tensor(rows).tensor_split(2)[j].tolist() for rows in shard] for j in range(2)]
    module = SGDPolicy(model_path, DRPO(delta=0.5), lr=0.5, aggregation="token-mean", horizon=H)
    params = list(module.model.parameters())
    for j in range(2):
        union = select_rows(batch, torch.tensor(sorted(halves[j][0] + halves[j][1])))
        module.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a Trainer
            loss, _ = module._step(union)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        with torch.no_grad():
            for p in params:
                p -= 0.5 * p.grad
    expected = dict(module.model.named_parameters())
    start = dict(Qwen2ForCausalLM.from_pretrained(model_path).named_parameters())
    for r in ranks:
        diff = max((r["weights"][n] - expected[n]).abs().max().item() for n in expected)
        assert diff < TOLERANCE, f"rank weights differ from the two-update reference by {diff:.3g}"
    assert max((expected[n] - start[n]).abs().max().item() for n in start) > 1e-4  # real updates happened
