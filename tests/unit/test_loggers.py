"""Lightning loggers by name (`TrainerSpec.loggers`, `astratk.training.loggers`): a short in-process fit of the real
`PolicyModule` (tiny Qwen2, DRPO, no Dask) with csv + tensorboard writes the trainer's `train/<policy>/...` metrics
to both, read back from the CSV and from the TensorBoard event file; bad names fail at config time with the fix."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch
import yaml
from torch.utils.data import DataLoader
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk.config import parse
from astratk.losses.drpo import DRPO
from astratk.records import TrainBatch
from astratk.spec import PolicySpec, RunSpec, TrainerSpec
from astratk.training import loggers
from astratk.training.logprobs import token_logprobs
from astratk.training.module import PolicyModule

STEPS = 2


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=128, num_hidden_layers=1, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_qwen2_loggers")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def _batch(model_path: str, b: int = 4, width: int = 10, prompt: int = 3) -> TrainBatch:
    """Random rows; mu = the model's own log-probs minus 0.1 (so |pi - mu| > 0), advantages +-1."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 64, (b, width), generator=g)
    attention_mask = torch.ones(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width - 1)
    loss_mask[:, prompt - 1:] = 1.0
    with torch.no_grad():
        lp = token_logprobs(Qwen2ForCausalLM.from_pretrained(model_path), input_ids, attention_mask, 1.0)
    advantages = torch.tensor([1.0, -1.0] * (b // 2))[:, None].expand(b, width - 1) * loss_mask
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                      behavior_logprobs=(lp - 0.1) * loss_mask, advantages=advantages.contiguous(), weights=loss_mask,
                      versions=torch.zeros(b, width - 1, dtype=torch.long), n_groups=2,
                      rewards=torch.rand(b, generator=g), roles=("policy",) * b)


def test_fit_writes_metrics_to_csv_and_tensorboard(model_path, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "quickstart-20260101-000000-abcd"
    made = loggers.make_loggers(["csv", "tensorboard"], run_dir, "lightning")
    assert [type(lg).__name__ for lg in made] == ["CSVLogger", "TensorBoardLogger"]
    module = PolicyModule(model_path, DRPO(delta=0.5), horizon=8)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=made, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(module, train_dataloaders=DataLoader([_batch(model_path)] * STEPS, batch_size=None,
                                                     collate_fn=lambda x: x))

    # CSV where runs have always written it: <run dir>/lightning/version_0/metrics.csv
    with (run_dir / "lightning" / "version_0" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(STEPS))
    assert float(rows[0]["train/main/loss/tv_mean"]) > 0

    # TensorBoard in its own folder (a shared one would make the two loggers number their versions apart)
    logdir = run_dir / "lightning" / "tensorboard" / "version_0"
    assert list(logdir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/main/loss", "train/main/reward_mean", "train/main/loss/w_min"} <= set(tags)
    assert "hp_metric" not in tags  # no placeholder metric
    tv = events.Scalars("train/main/loss/tv_mean")
    assert [e.step for e in tv] == list(range(STEPS))
    assert tv[0].value == pytest.approx(float(rows[0]["train/main/loss/tv_mean"]), rel=1e-6)


def test_no_loggers_is_allowed_and_csv_is_the_default(tmp_path):
    assert loggers.make_loggers([], tmp_path, "lightning") == []
    assert TrainerSpec().loggers == ["csv"]
    assert TrainerSpec().loggers is not TrainerSpec().loggers  # a fresh list per spec


@pytest.mark.parametrize(("names", "message"), [
    (["csv", "tensorbord"],
     r"trainer.loggers\[1\]: unknown logger 'tensorbord'; choose one of \['csv', 'mlflow', 'tensorboard', 'wandb'\]"),
    (["csv", "csv"], r"trainer.loggers\[1\]: 'csv' is listed twice"),
    ("csv", r"trainer.loggers: expected a list of logger names, e.g. \['csv'\]"),
])
def test_bad_logger_names_fail_with_the_fix(names, message):
    with pytest.raises(ValueError, match=message):
        loggers.check_loggers(names)


@pytest.mark.parametrize(("name", "install"), [("wandb", "pip install wandb"), ("mlflow", "pip install mlflow"),
                                               ("tensorboard", "pip install tensorboard")])
def test_a_logger_whose_package_is_missing_names_the_install(monkeypatch, name, install):
    import importlib.util

    real = importlib.util.find_spec
    absent = set(loggers.LOGGERS[name].modules)
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m in absent else real(m, *a))
    with pytest.raises(ValueError, match=rf"trainer.loggers\[0\]: the '{name}' logger needs .*: {install}"):
        loggers.check_loggers([name])


def test_run_spec_validates_loggers_and_yaml_sets_them(tmp_path):
    with pytest.raises(ValueError, match=r"policies\[0\]\.trainer\.loggers\[0\]: unknown logger 'tb'"):
        RunSpec(policies=[PolicySpec(trainer=TrainerSpec(loggers=["tb"]))]).validate()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"policies": [{"trainer": {"loggers": ["csv", "tensorboard"]}}]}))
    assert parse(["--config", str(path)]).policies[0].trainer.loggers == ["csv", "tensorboard"]


@pytest.mark.slow  # seconds: left out of the fast tier
def test_wandb_offline_and_mlflow_local_store_when_installed(model_path, tmp_path, monkeypatch):
    """The `loggers` extra (.ci/run installs it): W&B logs offline into the run directory, MLflow into a SQLite store
    there; both see the trainer's metrics."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    for var in ("WANDB_MODE", "MLFLOW_TRACKING_URI"):  # unset here, restored after (Lightning sets WANDB_MODE=dryrun)
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # not the user's home
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # not logged in: offline
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    run_dir = tmp_path / "run-x"
    made = loggers.make_loggers(["wandb", "mlflow"], run_dir, "lightning")
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=made, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(PolicyModule(model_path, DRPO(delta=0.5), horizon=8),
                train_dataloaders=DataLoader([_batch(model_path)] * STEPS, batch_size=None, collate_fn=lambda x: x))
    for lg in made:
        lg.finalize("success")
    assert list((run_dir / "lightning" / "wandb").glob("offline-run-*/run-*.wandb"))
    client = MlflowClient(f"sqlite:///{run_dir.resolve() / 'lightning' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("astratk")
    assert experiment.artifact_location.startswith((run_dir.resolve() / "lightning").as_uri())
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run-x"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/main/loss/tv_mean")] == [0, 1]


def test_wandb_goes_online_only_for_a_logged_in_user(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    netrc = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    assert not loggers.wandb_logged_in()  # no file
    netrc.write_text("machine example.com login a password b\n")
    assert not loggers.wandb_logged_in()  # another host
    netrc.write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    netrc.chmod(0o600)
    assert loggers.wandb_logged_in()
    netrc.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert loggers.wandb_logged_in()


def test_flat_config_names_the_loss_and_its_arguments():
    from astratk.losses.drpo import DRPO
    from astratk.spec import PolicySpec, RunSpec

    flat = loggers.flat_config(RunSpec(policies=[PolicySpec(loss=DRPO(delta=0.7))]))
    assert flat["policies.0.loss.class_path"] == "astratk.losses.drpo.DRPO"
    assert flat["policies.0.loss.init_args.delta"] == 0.7
    assert flat["rollout.group_size"] >= 1 and flat["env.class_path"].endswith("ArithmeticEnv")
    assert all(isinstance(v, (bool, int, float, str)) for v in flat.values())


def test_an_evaluation_that_ends_before_the_trainer_exists_reaches_its_loggers():
    """The starting model is evaluated while the trainer starts; on a quick machine that evaluation can end before the
    trainer (and its loggers) exist. It is kept and logged, at its version's step, as the loggers arrive."""
    import threading

    from astratk.runtime.live_metrics import LiveMetrics

    class Logger:
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step):
            self.rows.append((step, metrics))

        def save(self):
            pass

    metrics = LiveMetrics()
    metrics.spec = RunSpec()
    metrics.state, metrics.print, metrics._logger_error = "starting", print, None
    metrics.trainer_loggers, metrics._early_evals, metrics._loggers_lock = [], [], threading.Lock()
    metrics._log_eval({"version": 0, "accuracy": 0.25, "n": 8})
    logger = Logger()
    metrics.attach_loggers([logger])
    metrics.state = "training"
    metrics._log_eval({"version": 2, "accuracy": 0.5, "n": 8})
    assert logger.rows == [(0, {"eval/main/accuracy": 0.25}), (2, {"eval/main/accuracy": 0.5})]
