"""GPU placement on a real GPU (skipped without CUDA): TorchEngine's `device`/`dtype: auto` put the model, the KV
cache and every batch tensor on the GPU in bf16; `gpu_memory_utilization` caps the batch and the process's allocator
(and is given back at close); a trainer's `gpu_memory_fraction` holds during a fit; fractions that cannot fit on this
GPU fail at start; one rollout worker per GPU sees its own GPU as cuda:0 (two GPUs or more).

The decisions themselves are tested on the CPU with a faked CUDA runtime (tests/unit/test_gpu_placement.py).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines import TorchEngine
from astratk.engines import torch_kvcache as kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _fraction(index: int = 0) -> float | None:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    return None if getter is None else getter(index)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, intermediate_size=512, tie_word_embeddings=True,
                      max_position_embeddings=1024, initializer_range=0.1)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _requests(n: int, prompt: int, new: int) -> list[GenerationRequest]:
    return [GenerationRequest(tuple(range(1 + i, 1 + i + prompt)), SamplingParams(max_tokens=new, seed=i))
            for i in range(n)]


def test_auto_serves_on_the_gpu_in_bf16_with_the_kv_cache_there(model_dir, monkeypatch):
    devices = []
    init = kv._GrowingLayer.lazy_initialization

    def record(self, k, v):
        init(self, k, v)
        devices.append((self._k.device.type, self._k.dtype))

    monkeypatch.setattr(kv._GrowingLayer, "lazy_initialization", record)
    engine = TorchEngine(model_dir, max_batch=64)
    try:
        bf16 = torch.cuda.get_device_capability(0)[0] >= 8
        assert engine._device.type == "cuda" and next(engine._model.parameters()).dtype == (
            torch.bfloat16 if bf16 else torch.float32)
        completions = asyncio.run(engine.generate(_requests(16, 20, 12)))
        assert all(len(c.token_ids) == 12 for c in completions)
        assert devices and all(d == ("cuda", torch.bfloat16 if bf16 else torch.float32) for d in devices)
    finally:
        engine.close()


def test_the_memory_budget_caps_batches_and_the_process(model_dir):
    from astratk.engines.memory import MARGIN, model_budget

    total = torch.cuda.get_device_properties(0).total_memory
    probe = TorchEngine(model_dir, dtype="float32")
    assert probe.memory is None  # no budget given: no cap
    sizes = model_budget(probe._model, "cuda:0", 1.0)
    probe.close()
    # a share that holds the weights and 16 rows of 512 + 512 tokens, so 33 requests take 3 batches
    fraction = (sizes.weight_bytes + 16.5 * sizes.row_bytes(512, 512)) / ((1 - MARGIN) * total)
    engine = TorchEngine(model_dir, dtype="float32", max_batch=256, gpu_memory_utilization=fraction)
    try:
        rows = engine.memory.rows(512, 512)
        assert rows == 16
        if _fraction() is not None:
            assert _fraction() == pytest.approx(fraction)
        completions = asyncio.run(engine.generate(_requests(2 * rows + 1, 512, 512)))
        assert len(completions) == 2 * rows + 1
        assert engine.stats["max_batch_seen"] <= rows and engine.stats["budget_capped_batches"] >= 2
        with pytest.raises(torch.OutOfMemoryError):  # the allocator refuses past the share
            torch.empty(int(1.5 * fraction * total), dtype=torch.uint8, device="cuda")
    finally:
        engine.close()
    if _fraction() is not None:
        assert _fraction() == 1.0  # given back
    torch.empty(int(1.5 * fraction * total), dtype=torch.uint8, device="cuda")  # and allowed again


def test_fractions_beyond_the_free_memory_fail_at_start():
    from astratk.runtime.checks import check_gpu_memory
    from astratk.spec import PolicySpec, RolloutSpec, RunSpec, StartError, TrainerSpec

    free, _ = torch.cuda.mem_get_info(0)
    spec = RunSpec(policies=[PolicySpec(trainer=TrainerSpec(gpu_memory_fraction=0.6))],
                   rollout=RolloutSpec(engine_args={"gpu_memory_utilization": 0.3})).validate()
    with pytest.raises(StartError, match=r"is shared by .* = 1\.20 of its memory"):
        check_gpu_memory(spec)
    hog = torch.empty(int(free * 0.8), dtype=torch.uint8, device="cuda")  # someone else's memory, as it were
    try:
        spec.rollout.engine_args["gpu_memory_utilization"] = 0.1
        spec.policies[0].trainer.gpu_memory_fraction = 0.5
        with pytest.raises(StartError, match=r"GiB free of .* ask for 0\.70"):
            check_gpu_memory(spec)
    finally:
        del hog
        torch.cuda.empty_cache()


def test_the_trainer_share_holds_during_a_fit():
    import lightning.pytorch as pl

    from astratk.training.memory import GpuMemoryShare

    seen = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def training_step(self, batch, batch_idx):
            seen.append(_fraction())
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.randn(4, 8), batch_size=2)
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[GpuMemoryShare(0.3)])
    trainer.fit(Module(), data)
    if _fraction() is not None:
        assert seen == [pytest.approx(0.3)] * 2 and _fraction() == 1.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_rollout_worker_per_gpu_sees_its_own_first():
    from distributed import Client

    from astratk.runtime.pools import start_pool_cluster
    from astratk.spec import ClusterSpec, RunSpec

    spec = RunSpec(cluster=ClusterSpec(rollout_gpus="all")).validate()
    with start_pool_cluster(spec) as cluster, Client(cluster) as client:
        client.wait_for_workers(torch.cuda.device_count() + 1, timeout=120)

        def own():
            import os

            import torch

            return os.environ.get("CUDA_VISIBLE_DEVICES"), str(torch.cuda.get_device_properties(0).uuid)

        seen = client.run(own)
        names = {a: str(w["name"]) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
    from astratk.gpu import cuda_visible_devices, visible_gpus

    by_name = {names[a]: v for a, v in seen.items()}
    n = torch.cuda.device_count()
    assert [by_name[f"rollout-{i}"][0] for i in range(n)] == [cuda_visible_devices(i, visible_gpus()) for i in range(n)]
    assert len({by_name[f"rollout-{i}"][1] for i in range(n)}) == n  # each worker's cuda:0 is another GPU
