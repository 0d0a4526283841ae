"""CPU placement (`astratk.cpu`): thread plans from the cores and the run's placement, and oneDNN Linear layers that
compute what `nn.Linear` computes, forward and backward, with the same parameters and state dict."""

from __future__ import annotations

import pytest
import torch

from astratk import cpu
from astratk.spec import ClusterSpec, DataflowSpec, PolicySpec, RunSpec, WorkerClass

pytestmark = pytest.mark.skipif(not cpu._onednn_available(), reason="this torch has no oneDNN linear")


@pytest.mark.parametrize(("cores", "workers", "sync", "trainer", "rollout"), [
    (2, 1, False, 1, 1),  # this project's CI: the trainer and one rollout worker work at once
    (2, 1, True, 2, 2),  # they take turns: each gets both cores
    (16, 1, False, 8, 8),
    (16, 3, False, 4, 4),  # four processes at once: four cores each
    (1, 1, False, 1, 1),  # never zero
    (4, 8, False, 1, 1),  # more workers than cores: one each
])
def test_auto_thread_plan_splits_the_cores(cores, workers, sync, trainer, rollout):
    plan = cpu.plan_threads("auto", rollout_workers=workers, synchronous=sync, n_cores=cores)
    assert (plan.trainer, plan.rollout) == (trainer, rollout)
    assert plan.trainer + plan.rollout * workers <= max(cores, 1 + workers) or sync
    assert "auto" in plan.reason


def test_an_integer_setting_is_used_everywhere():
    plan = cpu.plan_threads(3, rollout_workers=4, synchronous=False, n_cores=2)
    assert (plan.trainer, plan.rollout) == (3, 3) and "torch_threads: 3" in plan.reason


def test_run_threads_counts_the_rollout_pools(monkeypatch):
    monkeypatch.setattr(cpu, "cores", lambda: 12)
    spec = RunSpec(cluster=ClusterSpec(pools=[WorkerClass("fast", 2), WorkerClass("slow", 1),
                                              WorkerClass("graders", 2, resources={"score": 1})]))
    assert cpu.run_threads(spec).rollout == 12 // 4  # 3 rollout workers + the trainer; graders carry no rollout label
    two = RunSpec(policies=[PolicySpec("a", roles=["x"]), PolicySpec("b", roles=["y"])])
    assert (cpu.run_threads(two).rollout, cpu.run_threads(two).trainer) == (4, 4)  # two trainers, one worker
    assert cpu.run_threads(RunSpec(dataflow=DataflowSpec(synchronous=True))).trainer == 12
    threads = cpu.run_threads(RunSpec(cluster=ClusterSpec(processes=False)))
    assert (threads.trainer, threads.rollout) == (12, 12)


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5, True])
def test_torch_threads_must_be_auto_or_a_positive_integer(bad):
    with pytest.raises(ValueError, match="torch_threads"):
        ClusterSpec(torch_threads=bad).validate()


def test_an_unknown_linear_backend_is_refused():
    with pytest.raises(ValueError, match="cpu_linear.*choose one of"):
        ClusterSpec(cpu_linear="mkl").validate()
    with pytest.raises(ValueError, match="cpu_linear"):
        cpu.set_linear_backend("mkl")


@pytest.fixture
def onednn():
    before = cpu._backend
    cpu.set_linear_backend("onednn")
    yield
    cpu.set_linear_backend(before)


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 96, bias=False))


def test_onednn_layers_compute_what_linear_computes_forward_and_backward(onednn):
    plain, fast = _mlp(), cpu.use_linear_backend(_mlp())
    assert all(type(m) is cpu.OneDNNLinear for m in fast.modules() if isinstance(m, torch.nn.Linear))
    assert plain.state_dict().keys() == fast.state_dict().keys()
    x = torch.randn(8, 40, 64)  # 320 rows: above the small-product cut
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = plain(x1), fast(x2)
    torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)
    for (name, p1), (_, p2) in zip(plain.named_parameters(), fast.named_parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_frozen_weight_gets_no_gradient_and_inference_needs_no_graph(onednn):
    fast = cpu.use_linear_backend(_mlp())
    fast[0].weight.requires_grad_(False)
    x = torch.randn(512, 64, requires_grad=True)
    fast(x).sum().backward()
    assert fast[0].weight.grad is None and fast[0].bias.grad is not None and x.grad is not None
    with torch.inference_mode():
        assert not fast(torch.randn(512, 64)).requires_grad


def test_small_products_and_other_dtypes_fall_back_to_torch(onednn, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "_linear", lambda *a: calls.append(a) or torch.nn.functional.linear(*a))
    fast = cpu.use_linear_backend(_mlp())
    fast(torch.randn(2, 64))  # 2 x 64 x 256: below the cut
    assert not calls
    fast(torch.randn(512, 64))
    assert calls
    half = cpu.use_linear_backend(_mlp().half())
    assert all(type(m) is torch.nn.Linear for m in half.modules() if isinstance(m, torch.nn.Linear))


def test_the_torch_backend_leaves_models_alone():
    before = cpu._backend
    try:
        cpu.set_linear_backend("torch")
        assert all(type(m) is torch.nn.Linear for m in cpu.use_linear_backend(_mlp()).modules()
                   if isinstance(m, torch.nn.Linear))
        assert cpu.linear_backend() == "torch"
    finally:
        cpu.set_linear_backend(before)


def test_lora_adapters_wrap_onednn_layers(onednn):
    from astratk.models import build_char_tokenizer, build_tiny_model
    from astratk.models.lora import add_lora
    from astratk.spec import LoraSpec, TinyModelSpec

    base = cpu.use_linear_backend(build_tiny_model(TinyModelSpec(num_layers=1), build_char_tokenizer()))
    model = add_lora(base, LoraSpec(r=4), "lora")
    model(input_ids=torch.randint(1, 200, (8, 40))).logits.sum().backward()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    assert any(type(m) is cpu.OneDNNLinear for m in model.modules())


def test_a_cluster_of_your_own_splits_each_hosts_cores_among_the_processes_working_there():
    from astratk.cpu import HostFacts, plan_shared_hosts

    here = HostFacts("laptop", 2, None)
    # every worker on 127.0.0.1 beside the driver (the docs' localhost recipe), 2 cores: one rollout worker and the
    # trainer share them, one thread each (before: each took both cores, and they fought over them)
    trainer, threads, why = plan_shared_hosts(here, {"tcp://127.0.0.1:1": HostFacts("laptop", 2, None)}, trainers=1,
                                              synchronous=False)
    assert (trainer, threads) == (1, {"tcp://127.0.0.1:1": 1}) and "share its 2 cores" in why
    # the synchronous mode alternates: each takes every core in its turn
    trainer, threads, _ = plan_shared_hosts(here, {"a": HostFacts("laptop", 2, None)}, trainers=1, synchronous=True)
    assert (trainer, threads) == (2, {"a": 2})
    # rollout workers on other hosts get their host's cores, split among those on it; OMP_NUM_THREADS caps a worker
    big = HostFacts("node", 16, None)
    trainer, threads, _ = plan_shared_hosts(HostFacts("head", 8, None),
                                            {"n1": big, "n2": big, "n3": HostFacts("node", 16, 1)}, trainers=2,
                                            synchronous=False)
    assert trainer == 4 and threads == {"n1": 5, "n2": 5, "n3": 1}


def test_bf16_on_a_cpu_without_bf16_units_is_said_with_the_keys_to_change(monkeypatch):
    from astratk import cpu
    from astratk.spec import PolicySpec, RolloutSpec, RunSpec, TrainerSpec

    assert isinstance(cpu.has_bf16_units(), bool)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bf16 = RunSpec(policies=[PolicySpec(trainer=TrainerSpec(precision="bf16-mixed"))],
                   rollout=RolloutSpec(engine_args={"dtype": "bfloat16"}))
    monkeypatch.setattr(cpu, "has_bf16_units", lambda: False)
    line = cpu.bf16_warning(bf16)
    assert line is not None and "main: trainer.precision bf16-mixed" in line
    assert "rollout.engine_args.dtype bfloat16" in line and "trainer.precision: bf16-mixed-if-native" in line
    if_native = RunSpec(policies=[PolicySpec(trainer=TrainerSpec(precision="bf16-mixed-if-native"))],
                        rollout=RolloutSpec(engine_args={"dtype": "bfloat16-if-native"}))
    assert cpu.bf16_warning(if_native) is None  # they take float32 on this CPU: nothing slow to warn about
    assert cpu.bf16_warning(RunSpec()) is None  # nothing asks for bf16: nothing to say
    gpu_engine = RunSpec(rollout=RolloutSpec(engine_args={"dtype": "bfloat16", "device": "cuda"}))
    assert cpu.bf16_warning(gpu_engine) is None
    monkeypatch.setattr(cpu, "has_bf16_units", lambda: True)  # AMX or AVX512-BF16: bf16 is the fast path
    assert cpu.bf16_warning(bf16) is None
