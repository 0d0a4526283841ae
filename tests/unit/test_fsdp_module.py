"""`PolicyModule` under FSDP2 on this CPU (two processes over gloo): ranks with different micro-batch counts stay in
step, the sharded step's gradient is the one-process whole-batch gradient, clipping sees the global norm, and
`weights()` gives rank 0 the whole model.

Lightning's `FSDPStrategy` refuses a CPU accelerator (and FSDP1 needs one), so the trainer here is a stand-in that
offers what the module uses from a strategy (its wrapped model, world size, reduce, all-gather, backward). The Lightning
path itself runs on a GPU (tests/gpu/test_fsdp_trainer.py, bench/gpu_suite.py)."""

from __future__ import annotations

import datetime
import os
import socket
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from astratk.losses.drpo import DRPO
from astratk.training.module import PolicyModule
from tests.unit.test_micro_batch import H, make_batch
from tests.unit.test_micro_batch import model_path as _model_path_fixture

model_path = _model_path_fixture
RANK_ROWS = ([0, 1, 2, 3, 4, 5], [6, 7])  # uneven shards: rank 0 cuts 2+ micro-batches at the budget, rank 1 one
BUDGET = 30
CLIP = 1e-3  # below the gradient's norm: clipping binds


def _stand_in_trainer(module: torch.nn.Module) -> SimpleNamespace:
    import torch.distributed as dist

    def reduce(t, reduce_op="sum"):
        t = t.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, reduce_op.upper()))
        return t

    def all_gather(t, group=None, sync_grads=False):
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t.contiguous())
        return torch.stack(out)

    strategy = SimpleNamespace(model=module, world_size=2, root_device=torch.device("cpu"), reduce=reduce,
                               all_gather=all_gather, backward=lambda loss, opt: loss.backward())
    return SimpleNamespace(strategy=strategy, world_size=2)


def _worker(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from astratk.records import TrainBatch
    from astratk.training.collate import micro_batches, select_rows

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    module = PolicyModule(path, DRPO(delta=0.5), horizon=H, micro_batch_tokens=BUDGET)
    for layer in module.model.model.layers:
        fully_shard(layer)
    fully_shard(module.model)  # the HF model is the root unit (its forward runs in training_step)
    module._trainer = _stand_in_trainer(module)
    module.log_dict = lambda *a, **k: None  # Lightning's logging needs a real Trainer
    batch = make_batch(path)
    part = select_rows(batch, torch.tensor(RANK_ROWS[rank]))
    assert isinstance(part, TrainBatch)
    own_count = len(micro_batches(part, BUDGET))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = module.training_step(part, 0)
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in module.model.named_parameters()}
    module.configure_gradient_clipping(None, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
    state = module.weights()
    torch.save({"grads": grads, "own_count": own_count, "metrics": dict(module.step_metrics), "state": state},
               f"{out}.{rank}")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # seconds: left out of the fast tier
@pytest.mark.timeout(240)
def test_sharded_step_equals_the_whole_batch_step(model_path, tmp_path):
    out = str(tmp_path / "r")
    mp.spawn(_worker, args=(_free_port(), model_path, out), nprocs=2, join=True)
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert r0["own_count"] > r1["own_count"] == 1  # the shards alone would issue different collectives
    counts = {r0["metrics"]["train/main/micro_batches"], r1["metrics"]["train/main/micro_batches"]}
    assert counts == {float(r0["own_count"])}  # both ran rank 0's count

    whole = PolicyModule(model_path, DRPO(delta=0.5), horizon=H)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole.training_step(make_batch(model_path), 0).backward()
    want = {n: p.grad for n, p in whole.model.named_parameters()}
    scale = max(g.abs().max().item() for g in want.values())
    for r in (r0, r1):
        assert r["grads"].keys() == want.keys()
        worst = max((r["grads"][n] - want[n]).abs().max().item() for n in want)
        assert worst <= 1e-5 * scale, f"sharded gradient differs by {worst:.3g} (largest {scale:.3g})"
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want.values()])).item()
    assert norm > CLIP
    for r in (r0, r1):
        assert r["metrics"]["train/main/grad_norm"] == pytest.approx(norm, rel=1e-4)
    plain = whole.model.state_dict()
    assert r1["state"] == {} and r0["state"].keys() == plain.keys()
    assert all(torch.equal(r0["state"][k], plain[k]) for k in plain)
