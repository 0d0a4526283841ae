"""A run whose model is a Hub id, resolved offline from a cache in huggingface_hub's layout: `astratk run` as a user
runs it, with HF_HUB_OFFLINE=1. The resolved commit is pinned in config.yaml and recorded in summary.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.models import ensure_model
from astratk.spec import ModelSpec, TinyModelSpec
from tests.hubcache import put_in_hub_cache

pytestmark = pytest.mark.integration


def test_astratk_run_with_a_hub_id_offline(tmp_path):
    env_args = {"levels": [1], "n_heldout": 16}
    tiny = TinyModelSpec(warm_start_steps=10, warm_start_batch=8, warm_start_target=None)
    built = ensure_model(ModelSpec(tiny=tiny), ArithmeticEnv(**env_args), cache_dir=tmp_path / "cache",
                         log=lambda s: None)
    commit = "c0ffee" + "0" * 34
    put_in_hub_cache(Path(built), tmp_path / "hub", "acme/tiny-arith", commit=commit)
    config = {
        "name": "hub", "output_dir": str(tmp_path / "runs"),
        "env": {"class_path": "arithmetic", "init_args": env_args},
        "policies": [{"model": {"path": "acme/tiny-arith"}, "trainer": {"max_steps": 2, "groups_per_step": 2}}],
        "rollout": {"group_size": 4, "max_new_tokens": 4, "tasks_per_chunk": 2},
        "dataflow": {"filter_zero_variance": False},
        "eval": {"interval_s": 5, "max_tasks": 16},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    cli = [sys.executable, "-m", "astratk.cli", "run", "--config", str(tmp_path / "run.yaml")]
    proc = subprocess.run(cli, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Hub acme/tiny-arith@{commit}" in proc.stdout
    [run_dir] = (tmp_path / "runs").iterdir()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["policies"][0]["model"] == {**saved["policies"][0]["model"], "path": "acme/tiny-arith",
                                             "revision": commit}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["models"]["main"]["revision"] == commit
    assert summary["models"]["main"]["directory"].endswith(f"snapshots/{commit}")
    assert summary["steps"] == 2

    # a wrong id: one line naming the key and the id, exit non-zero, no run directory
    bad = [*cli, "--policies", '[{"model": {"path": "acme/nope"}}]']
    proc = subprocess.run(bad, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env, check=False)
    assert proc.returncode != 0
    assert "policies[0].model.path: cannot resolve Hub id 'acme/nope'" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert len(list((tmp_path / "runs").iterdir())) == 1
