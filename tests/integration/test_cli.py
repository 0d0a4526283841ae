"""The real entry point with a tiny budget: `astratk run --config FILE` in a subprocess, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    cli = [sys.executable, "-m", "astratk.cli", "run", "--config", str(path), "--rollout.temperature", "0.9"]
    proc = subprocess.run(cli, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "held-out accuracy:" in out and "training: 2 steps" in out
    metrics = Path(next(line.split(": ", 1)[1] for line in out.splitlines() if line.strip().startswith("metrics:")))
    assert metrics.is_file()
    saved = yaml.safe_load((metrics.parent / "config.yaml").read_text())
    assert saved["rollout"]["temperature"] == 0.9  # the override reached the run
