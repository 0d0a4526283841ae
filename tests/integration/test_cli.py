"""The real entry point with a tiny budget: `astratk run --config FILE` in a subprocess, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

pytestmark = pytest.mark.integration


def test_astratk_run_cli_end_to_end(tmp_path):
    config = {
        "name": "cli", "output_dir": str(tmp_path / "runs"),
        "env": {"class_path": "arithmetic", "init_args": {"levels": [1], "n_heldout": 16}},
        "policies": [{"model": {"cache_dir": str(tmp_path / "cache"),
                                "tiny": {"warm_start_steps": 10, "warm_start_batch": 8, "warm_start_target": None}},
                      "loss": {"class_path": "drpo", "init_args": {"delta": 0.2}},
                      "trainer": {"max_steps": 2, "groups_per_step": 2}}],
        "rollout": {"group_size": 4, "max_new_tokens": 4, "tasks_per_chunk": 2},
        "dataflow": {"filter_zero_variance": False},
        "eval": {"interval_s": 5, "max_tasks": 16},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    # `python -m astratk`: the package's __main__ must keep its CLI call under the main guard, or the local cluster's
    # worker processes (which re-import the main module) would run it again, and the run refuses to start
    cli = [sys.executable, "-m", "astratk", "run", "--config", str(path), "--rollout.temperature", "0.9"]
    proc = subprocess.run(cli, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "held-out accuracy:" in out and "training: 2 steps" in out
    assert "kept for the next run" not in out  # the command exits after its run: nothing to keep its cluster for
    metrics = Path(next(line.split(": ", 1)[1] for line in out.splitlines() if line.strip().startswith("metrics:")))
    assert metrics.is_file()
    from astratk.metrics import load

    evals = load(metrics)["eval_train_time_s"].values
    assert (evals[~np.isnan(evals)] >= 0).all()  # v0 was published before training began: 0 s, never negative
    saved = yaml.safe_load((metrics.parent / "config.yaml").read_text())
    assert saved["rollout"]["temperature"] == 0.9  # the override reached the run


def test_a_killed_run_keeps_the_metrics_it_wrote_while_training(tmp_path):
    """`metrics_every_s`: metrics.nc is rewritten while the run trains (attribute partial = 1, atomically), so that a
    run killed mid-way (SIGKILL: no clean-up at all) leaves its steps and evaluations on disk."""
    import os
    import signal
    import time

    from astratk.metrics import load

    config = {
        "name": "killed", "output_dir": str(tmp_path / "runs"), "metrics_every_s": 1.0,
        "env": {"class_path": "arithmetic", "init_args": {"levels": [1], "n_heldout": 16}},
        "policies": [{"model": {"cache_dir": str(tmp_path / "cache"),
                                "tiny": {"warm_start_steps": 10, "warm_start_batch": 8, "warm_start_target": None}},
                      "trainer": {"max_steps": 100000, "groups_per_step": 2}}],
        "rollout": {"group_size": 4, "max_new_tokens": 4, "tasks_per_chunk": 2},
        "dataflow": {"filter_zero_variance": False},
        "eval": {"interval_s": 2, "max_tasks": 8},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "astratk.cli", "run", "--config", str(path)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        ds = None
        while time.monotonic() < deadline:
            files = list((tmp_path / "runs").glob("killed-*/metrics.nc"))
            if files:
                ds = load(files[0])
                if ds.sizes.get("step", 0) >= 3 and ds.sizes.get("evaluation", 0) >= 2:
                    break
            assert proc.poll() is None, "the run ended before it was killed"
            time.sleep(0.5)
        else:
            raise AssertionError("timed out after 240 s waiting for metrics.nc with 3 steps and 2 evaluations")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its Dask workers, with no chance to clean up
        proc.wait(30)
    ds = load(files[0])  # still there, and whole
    assert ds.attrs["partial"] == 1 and ds.sizes["step"] >= 3
    assert (ds["train_time_s"].sel(policy="main").values[:3] >= 0).all()
    assert ds["eval_accuracy"].sizes["evaluation"] >= 2
