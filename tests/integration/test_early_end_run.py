"""A run whose trainer starves ends early through the front door: `astratk run` writes metrics.nc and summary.json
(`stopped_early`, the reason in words) and exits 1 with that reason in one line, no traceback.

Every completion of `ConstantEnv` scores 1, so every group is zero-variance and dropped: the trainer never gets a
batch. Before, it waited `trainer.batch_timeout_s`, then a TimeoutError traceback ended the run with nothing but
config.yaml written. A threads cluster (`processes: false`) keeps it short and lets the env live in this module.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml

from astratk.cli import main
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.metrics import load

pytestmark = pytest.mark.integration


class ConstantEnv(ArithmeticEnv):
    """Arithmetic where every completion scores 1."""

    def grade(self, task, text):
        return 1.0


def test_a_starved_run_writes_its_outputs_and_exits_with_the_reason(tmp_path, capsys):
    config = {
        "name": "starved", "output_dir": str(tmp_path / "runs"), "progress": False,
        "env": {"class_path": f"{__name__}.ConstantEnv", "init_args": {"levels": [1], "n_heldout": 16}},
        "policies": [{"model": {"cache_dir": str(tmp_path / "cache"),
                                "tiny": {"warm_start_steps": 5, "warm_start_batch": 8, "warm_start_target": None}},
                      "trainer": {"max_steps": 4, "groups_per_step": 2, "batch_timeout_s": 3, "loggers": []}}],
        "rollout": {"group_size": 4, "max_new_tokens": 4, "tasks_per_chunk": 4},
        "cluster": {"processes": False, "rollout_workers": 1},
        "eval": {"interval_s": 60, "max_tasks": 16, "timeout_s": 120},
    }
    path = tmp_path / "starved.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["run", "--config", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    # the time it waited: the 3 s timeout, or a second more on a loaded machine (it is rounded from the clock)
    waited = re.match(r"astratk run: stopped early: policy 'main' got no batch for step 0 in (\d+)s: all ", err[0])
    assert waited and 3 <= int(waited.group(1)) <= 10, err[0]
    assert "groups rolled out since were dropped as zero-variance: rewards all equal" in err[0]
    [run_dir] = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] is True and summary["steps"] == 0
    assert summary["stop_reason"] == err[0].removeprefix("astratk run: stopped early: ")
    ds = load(run_dir / "metrics.nc")
    assert float(ds["data_groups_dropped_zero_variance"].sel(policy="main")) > 0
    # the first version is the last one: evaluated once (the final evaluation reuses it)
    assert ds.attrs["stopped_early"] == 1 and ds.sizes["evaluation"] >= 1


def test_a_run_whose_prompts_never_fit_stops_at_once_with_nothing_left_behind(tmp_path, capsys):
    # every prompt is longer than the engine's 16-position context: each task is dropped before generation. The run
    # stops within seconds of its first chunks (not at its time limit), exits non-zero with one line, and leaves no
    # run directory (before: 25 s, a full run directory and exit 0); `astratk probe` says it beforehand and exits 1
    config = {
        "name": "too-long", "output_dir": str(tmp_path / "runs"), "progress": False,
        "env": {"class_path": "arithmetic", "init_args": {"levels": [1], "n_heldout": 16}},
        "policies": [{"model": {"cache_dir": str(tmp_path / "cache"),
                                "tiny": {"warm_start_steps": 5, "warm_start_batch": 8, "warm_start_target": None}},
                      "trainer": {"max_steps": 4, "groups_per_step": 2, "max_time_s": 300, "loggers": []}}],
        "rollout": {"engine": "scripted", "engine_args": {"script": [[7]], "max_model_len": 16},
                    "group_size": 2, "max_new_tokens": 4, "tasks_per_chunk": 4},
        "cluster": {"processes": False, "rollout_workers": 1},
        "eval": {"interval_s": 60, "max_tasks": 8, "timeout_s": 120},
    }
    path = tmp_path / "too-long.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["probe", "--config", str(path), "--tasks", "4", "--eval_tasks", "2"]) == 1
    assert "nothing to train: all 4 tasks were dropped before generation" in capsys.readouterr().out
    started = time.monotonic()
    assert main(["run", "--config", str(path)]) == 2
    took = time.monotonic() - started
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("astratk run: nothing to train: all "), err
    assert "dropped before generation, each prompt longer than the model's context" in err[0]
    assert took < 120, took  # the trainer's 300 s limit was not waited out
    assert not (tmp_path / "runs").exists()  # no half-empty run directory (nor the output_dir made for it)
