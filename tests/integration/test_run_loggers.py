"""A run's loggers get more than the trainer's steps: the resolved config (loss class and arguments), every held-out
evaluation and the data layer's throughput and drops, read back from the CSV and TensorBoard files."""

from __future__ import annotations

import csv

import pytest
import yaml

from astratk.runtime.run import Run
from tests.integration.test_local_run import small_spec

pytestmark = pytest.mark.integration


def test_csv_and_tensorboard_get_config_evaluations_and_counters(tmp_path):
    spec = small_spec(tmp_path, loggers=["csv", "tensorboard"])
    spec.metrics_every_s = 1.0
    result = Run(spec, printer=lambda s: None).start()
    root = result.run_dir / "lightning"
    [version] = [p for p in root.glob("version_*") if p.is_dir()]
    hparams = yaml.safe_load((version / "hparams.yaml").read_text())
    assert hparams["policies.0.loss.class_path"] == "astratk.losses.drpo.DRPO"
    assert hparams["policies.0.loss.init_args.delta"] == 0.5
    rows = list(csv.DictReader((version / "metrics.csv").open()))
    columns = set(rows[0])
    assert {"eval/main/accuracy", "data/main/samples_received", "train/main/loss"} <= columns, sorted(columns)
    evals = [(int(r["step"]), float(r["eval/main/accuracy"])) for r in rows if r.get("eval/main/accuracy")]
    assert [s for s, _ in evals][:1] == [0] and evals[-1][0] == result.summary["final_version"]
    assert evals[-1][1] == pytest.approx(result.summary["accuracy_after"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in (root / "tensorboard").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"eval/main/accuracy", "train/main/loss"} <= tags, sorted(tags)
