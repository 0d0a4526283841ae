"""A user's own env module on a cluster of their own: importable on the workers and the driver, not on the scheduler.

A scheduler (on a head node, say) has no reason to import a run's reward code, and Dask's scheduler unpickles the
arguments of every task it is sent. Before, the run's spec travelled as a plain object and the run died in Dask's
"Error during deserialization of the task graph ... No module named ..."; now the spec and the run's context travel
as bytes (`astratk.records.Shipped`) that only the workers open. Real processes: `dask scheduler`, two `dask worker`s
and `astratk run`, on localhost.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.test_cli_cluster import stop_all

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
MODULE = '''
from astratk.envs.math.arithmetic import ArithmeticEnv


class LastDigitEnv(ArithmeticEnv):
    """Arithmetic scored on the answer's last digit: the user's own reward, in the user's own module."""

    def grade(self, task, text):
        digits = [c for c in text if c.isdigit()]
        return float(bool(digits) and digits[-1] == str(task.answer)[-1])
'''


def test_a_user_env_module_that_the_scheduler_cannot_import(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "rmtask_user.py").write_text(MODULE)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    base.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with_code = {**base, "PYTHONPATH": str(user)}
    procs: list[subprocess.Popen] = []
    try:
        sched_file = tmp_path / "scheduler.json"
        procs.append(subprocess.Popen([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                                       "--no-dashboard", "--scheduler-file", str(sched_file)], env=base,
                                      cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while not sched_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        address = json.loads(sched_file.read_text())["address"]
        for name, resources in (("control", "control=1"), ("rollout-0", "rollout_main=1,score=1")):
            procs.append(subprocess.Popen(
                [str(BIN / "dask"), "worker", address, "--name", name, "--nthreads", "1", "--host", "127.0.0.1",
                 "--resources", resources, "--no-dashboard"], env=with_code, cwd=tmp_path,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        cfg = {"name": "user-code", "output_dir": str(tmp_path / "runs"), "progress": False,
               "env": {"class_path": "rmtask_user.LastDigitEnv", "init_args": {"levels": [1], "n_heldout": 8}},
               "policies": [{"model": {"cache_dir": str(tmp_path / "cache"),
                                       "tiny": {"warm_start_steps": 5, "warm_start_batch": 8,
                                                "warm_start_target": None}},
                             "trainer": {"max_steps": 2, "groups_per_step": 2, "batch_timeout_s": 120,
                                         "loggers": []}}],
               "rollout": {"group_size": 4, "max_new_tokens": 4, "tasks_per_chunk": 2},
               "dataflow": {"filter_zero_variance": False},
               "cluster": {"scheduler_address": address, "startup_timeout_s": 60},
               "eval": {"interval_s": 1000, "max_tasks": 8, "timeout_s": 120}}
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(cfg))
        run = subprocess.run([str(BIN / "astratk"), "run", "--config", str(path)], env=with_code, cwd=tmp_path,
                             capture_output=True, text=True, timeout=400, check=False)
        assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
        assert "training: 2 steps" in run.stdout
        assert "deserializ" not in run.stderr and "No module named" not in run.stderr
        # every worker is on this host beside the driver: the rollout worker and the trainer split its cores (before,
        # `torch_threads: auto` gave each of them all the cores, "a cluster of your own: each host's cores")
        cpu_line = next(line for line in run.stdout.splitlines() if line.startswith("CPU: torch threads"))
        assert "a cluster of your own, 1 host(s); 1 rollout worker(s) on this host share its" in cpu_line, cpu_line
        trainer, rollout = (int(x) for x in re.findall(r"trainer (\d+), each rollout worker (\d+)", cpu_line)[0])
        assert trainer + rollout <= max(2, os.cpu_count() or 2), cpu_line
    finally:
        stop_all(procs)
