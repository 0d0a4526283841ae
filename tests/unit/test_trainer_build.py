"""`astratk.training.build`, the one wiring of a policy's trainer: the module's defaults are the run config's, its
arguments follow the policy spec, and the in-process trainer publishes, records, checkpoints, logs and stops as the
spec says. (`training/` importing nothing from `runtime/`: tests/unit/test_layout.py.)"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from astratk.dataflow.client import DataLayerClient
from astratk.dataflow.datalayer import DataLayer
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.losses.drpo import DRPO
from astratk.models import ensure_model
from astratk.records import RunContext
from astratk.rollout.service import RolloutService
from astratk.runtime.deploy import publish_initial
from astratk.spec import DataflowSpec, ModelSpec, PolicySpec, RolloutSpec, RunSpec, TinyModelSpec, TrainerSpec
from astratk.training import build
from astratk.training.module import PolicyModule
from astratk.weights.store import WeightStore


def test_module_defaults_are_the_trainer_specs():
    """A `PolicyModule` built without arguments trains like a policy whose `trainer:` section is left empty (the
    module's lr default used to be 1e-3 against the config's 1e-4)."""
    params = inspect.signature(PolicyModule.__init__).parameters
    spec = TrainerSpec()
    for name in ("lr", "weight_decay", "aggregation", "kl_coef", "kl_estimator", "entropy_coef",
                 "micro_batch_tokens"):
        assert params[name].default == getattr(spec, name), name


def test_module_args_follow_the_policy_spec():
    loss = DRPO(delta=0.3)
    trainer = TrainerSpec(lr=3e-4, weight_decay=0.01, aggregation="token-mean", kl_coef=0.1, kl_estimator="k1",
                          entropy_coef=0.02, micro_batch_tokens=512, share_prompts=False, updates_per_batch=3)
    spec = RunSpec(policies=[PolicySpec(policy_id="solver", loss=loss, trainer=trainer)],
                   rollout=RolloutSpec(temperature=0.7, max_new_tokens=12))
    args = build.module_args(spec, "solver")
    assert args == {"loss": loss, "policy_id": "solver", "lr": 3e-4, "weight_decay": 0.01, "temperature": 0.7,
                    "aggregation": "token-mean", "horizon": 12, "corrections": [], "kl_coef": 0.1,
                    "kl_estimator": "k1", "entropy_coef": 0.02, "micro_batch_tokens": 512, "lora": None,
                    "share_prompts": False, "updates_per_batch": 3}
    spec.policies[0].trainer = dataclasses.replace(trainer, horizon=5)
    assert build.module_args(spec, "solver")["horizon"] == 5  # trainer.horizon wins over rollout.max_new_tokens
    with pytest.raises(KeyError):
        build.module_args(spec, "main")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    env = ArithmeticEnv(levels=[1], n_heldout=16)
    spec = ModelSpec(tiny=TinyModelSpec(warm_start_steps=5, warm_start_batch=8, warm_start_target=None),
                     cache_dir=str(tmp_path_factory.mktemp("cache")))
    return str(ensure_model(spec, env, log=lambda s: None)), env


def _data(spec: RunSpec, path: str, name: str, steps: int) -> tuple[WeightStore, DataLayerClient]:
    """A weight store with version 0 and an in-process data layer holding `steps` steps' groups."""
    store = WeightStore(f"memory://build-{name}")
    publish_initial(store, "main", path)
    handle = DataLayerClient(DataLayer(spec))
    service = RolloutService(RunContext(name, spec, {"main": path}, store.url))
    leases = handle.lease(2 * steps)  # every step's groups up front (prefetch_steps >= steps allows it)
    assert len(leases) == 2 * steps
    for res in service.score(service.rollout(leases)):
        handle.admit(res.lease_id, list(res.groups))
    return store, handle


def test_build_trainer_publishes_records_checkpoints_logs_and_stops(model_dir, tmp_path):
    path, env = model_dir
    trainer_spec = TrainerSpec(groups_per_step=2, max_steps=2, lr=3e-4, grad_clip=0.5, checkpoint_every=1,
                               batch_timeout_s=30)
    spec = RunSpec(env=env, policies=[PolicySpec(trainer=trainer_spec)],
                   rollout=RolloutSpec(group_size=4, max_new_tokens=4),
                   dataflow=DataflowSpec(filter_zero_variance=False, prefetch_steps=2)).validate()
    lines: list[str] = []

    def trainer(run_dir: Path) -> tuple[build.PolicyTrainer, WeightStore, DataLayerClient]:
        store, handle = _data(spec, path, f"{tmp_path.name}-{run_dir.name}", 2)
        stream = build.group_stream(spec, "main", handle, path)
        built = build.build_trainer(spec, "main", model_path=path, stream=stream, store=store, run_dir=run_dir,
                                    stop_file=run_dir / "STOP", printer=lines.append)
        return built, store, handle

    run_dir = tmp_path / "run"
    built, store, handle = trainer(run_dir)
    assert built.module.lr == 3e-4 and built.module.horizon == 4  # module_args
    assert built.trainer.gradient_clip_val == 0.5 and built.trainer.max_steps == 2  # trainer_flags
    result = built.fit()
    assert len(result["rows"]) == 2 and result["rows"][-1]["train/main/step"] == 2.0
    assert len(result["group_ids"]) == 4 and result["group_ids"] == built.stream.group_ids
    assert "weights/main/publish_s" in result["rows"][0]  # the publisher runs before the recorder
    assert store.latest("main").version == 2 and handle.version("main") == 2
    assert sorted(p.name for p in (run_dir / "checkpoints" / "main").iterdir()) == ["step=1.ckpt", "step=2.ckpt"]
    assert (run_dir / "lightning" / "version_0" / "metrics.csv").is_file()  # trainer.loggers: [csv]

    # a STOP file ends the fit after the step in which it is seen
    (tmp_path / "stopped").mkdir()
    (tmp_path / "stopped" / "STOP").touch()
    stopped, store, _ = trainer(tmp_path / "stopped")
    assert len(stopped.fit()["rows"]) == 1 and store.latest("main").version == 1


# ---------------------------------------------------------------------------------------------- placement
def test_placement_defaults_to_the_cpu_in_full_precision_here():
    import lightning.pytorch as pl
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU defaults")
    flags = build.placement(TrainerSpec())
    assert flags == {"accelerator": "cpu", "devices": 1, "precision": "32-true", "strategy": "auto"}
    trainer = pl.Trainer(**flags, logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert type(trainer.accelerator).__name__ == "CPUAccelerator" and trainer.precision == "32-true"
    assert build.placement(TrainerSpec(precision="bf16-mixed"))["precision"] == "bf16-mixed"  # CPUs have bf16


def test_placement_on_a_gpu_is_bf16_mixed_by_default(monkeypatch):
    """What a GPU user gets with no config change (the CUDA runtime faked: this machine has no GPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))  # an H100/H200
    flags = build.placement(TrainerSpec())
    assert (flags["accelerator"], flags["precision"]) == ("gpu", "bf16-mixed")
    assert build.placement(TrainerSpec(accelerator="cpu"))["precision"] == "32-true"  # the CPU asked for


@pytest.mark.parametrize("amx, avx512_bf16, expected", [(True, False, "bf16-mixed"), (False, True, "bf16-mixed"),
                                                       (False, False, "32-true")])
def test_bf16_mixed_if_native_is_bf16_only_where_the_cpu_has_bf16_units(monkeypatch, amx, avx512_bf16, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert build.placement(TrainerSpec(precision="bf16-mixed-if-native"))["precision"] == expected
    assert build.placement(TrainerSpec())["precision"] == "32-true"  # auto stays fp32 on a CPU


def test_bf16_mixed_if_native_on_gpus_follows_the_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # the host's CPU does not decide
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 5))  # a T4: fp32, no error
    assert build.placement(TrainerSpec(precision="bf16-mixed-if-native"))["precision"] == "32-true"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (8, 0))  # an A100
    assert build.placement(TrainerSpec(precision="bf16-mixed-if-native"))["precision"] == "bf16-mixed"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    flags = build.placement(TrainerSpec(precision="bf16-mixed-if-native", accelerator="cpu"))  # the CPU asked for
    assert (flags["accelerator"], flags["precision"]) == ("cpu", "32-true")


def test_a_gpu_asked_for_and_absent_or_bf16_without_it_fails_naming_the_key(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"policies\[1\]\.trainer\.accelerator is 'gpu' but torch .* no CUDA"):
        build.placement(TrainerSpec(accelerator="gpu"), "policies[1].trainer")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # a T4 (compute capability 7.5): torch's is_bf16_supported() says yes (emulated); the engines and the trainer
    # both say no, so they agree on fp32 and bf16 asked for is refused
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    with pytest.raises(ValueError, match=r"trainer\.precision is 'bf16-true' but this GPU \(Tesla T4\) has no bf16"):
        build.placement(TrainerSpec(precision="bf16-true"))
    assert build.placement(TrainerSpec())["precision"] == "32-true"  # auto: no bf16 on this GPU


def test_placement_values_are_checked_with_the_spec():
    for bad, match in (({"precision": "bf17"}, "trainer.precision: unknown 'bf17'"),
                       ({"accelerator": "tpu9"}, "trainer.accelerator: unknown 'tpu9'"),
                       ({"devices": 0}, "trainer.devices must be a number of devices >= 1")):
        with pytest.raises(ValueError, match=re.escape(match)):
            RunSpec(policies=[PolicySpec(trainer=TrainerSpec(**bad))]).validate()


def test_the_in_process_trainer_refuses_several_devices_before_building_anything(tmp_path):
    spec = RunSpec(policies=[PolicySpec(trainer=TrainerSpec(devices=2))]).validate()
    with pytest.raises(ValueError, match=r"policies\[0\]\.trainer\.devices is 2: .*astratk train fit"):
        build.build_trainer(spec, "main", model_path=str(tmp_path / "none"), stream=None, store=None,
                            run_dir=tmp_path, stop_file=tmp_path / "STOP")
    assert list(tmp_path.iterdir()) == []  # nothing written
