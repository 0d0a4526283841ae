"""The cluster-job door, end to end: a `dask scheduler`, `dask worker --resources ...` processes, `astratk deploy`
serving a two-policy solver + verifier workflow, and one `astratk train fit` process per policy, all separate
processes on localhost; `astratk status` reports the deployment while it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def config(tmp_path: Path, address: str) -> Path:
    tiny = {"warm_start_steps": 30, "warm_start_batch": 32, "warm_start_target": None}
    policy = {"model": {"tiny": tiny, "cache_dir": str(tmp_path / "cache")}, "loss": {"class_path": "drpo"},
              "trainer": {"max_steps": 3, "groups_per_step": 2, "batch_timeout_s": 120}}
    cfg = {"name": "sv", "output_dir": str(tmp_path / "runs"), "progress": True,
           "env": {"class_path": "solver_verifier", "init_args": {"base": {"class_path": "arithmetic",
                                                                           "init_args": {"levels": [1],
                                                                                         "n_heldout": 16}}}},
           "policies": [{"policy_id": "solver", "roles": ["solver"], **policy},
                        {"policy_id": "verifier", "roles": ["verifier"], **policy}],
           "rollout": {"group_size": 4, "max_new_tokens": 6, "tasks_per_chunk": 2},
           "dataflow": {"max_staleness": 8, "filter_zero_variance": False, "version_barrier": 1},
           "cluster": {"scheduler_address": address, "startup_timeout_s": 60},
           "eval": {"interval_s": 1000, "max_tasks": 8, "timeout_s": 120}}
    path = tmp_path / "sv.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def wait_for_line(proc: subprocess.Popen, lines: list[str], needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            lines.append(line.rstrip())
            if needle in line:
                return line
        elif proc.poll() is not None:
            break
    raise AssertionError(f"no line with {needle!r} within {timeout_s:.0f}s; output:\n" + "\n".join(lines[-30:]))


def test_two_policy_job_across_separate_processes(tmp_path):
    procs: list[subprocess.Popen] = []
    try:
        sched_file = tmp_path / "scheduler.json"
        procs.append(subprocess.Popen([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                                       "--no-dashboard", "--dashboard-address", "127.0.0.1:0",
                                       "--scheduler-file", str(sched_file)], env=ENV,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while not sched_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        address = json.loads(sched_file.read_text())["address"]
        for name, resources in (("control", "control=1"),
                                ("gpu-a", "rollout_solver=1,rollout_verifier=1,score=1")):
            procs.append(subprocess.Popen(
                [str(BIN / "dask"), "worker", address, "--name", name, "--nthreads", "1", "--host", "127.0.0.1",
                 "--resources", resources, "--no-dashboard", "--dashboard-address", "127.0.0.1:0"], env=ENV,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        cfg = config(tmp_path, address)
        deploy = subprocess.Popen([str(BIN / "astratk"), "deploy", "--config", str(cfg), "--deployment", "sv-it",
                                   "--detached_timeout_s", "3"], env=ENV,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(deploy)
        out: list[str] = []
        wait_for_line(deploy, out, "is serving", 240)
        run_config = wait_for_line(deploy, out, "--policy_id solver", 10).split("--run_config ")[1].split()[0]
        trainers = {pid: subprocess.Popen(
            [str(BIN / "astratk"), "train", "fit", "--run_config", run_config, "--policy_id", pid,
             "--deployment", "sv-it", "--scheduler", address, "--trainer.default_root_dir", str(tmp_path / pid),
             "--trainer.accelerator", "cpu", "--trainer.devices", "1",
             # the solver's trainer stops short of the run's 3 steps: the deployment then says it ended, serves
             # --detached_timeout_s more for another, and ends (before: "[starving]" lines for ever)
             *(["--trainer.max_steps", "2"] if pid == "solver" else [])],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in ("solver", "verifier")}
        procs.extend(trainers.values())
        status = subprocess.run([str(BIN / "astratk"), "status", "--scheduler", address], check=False, env=ENV,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "deployment 'sv-it'" in status.stdout and "solver: v" in status.stdout
        assert "control x1" in status.stdout and "rollout_verifier x1" in status.stdout
        for pid, proc in trainers.items():
            text, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"trainer {pid} failed:\n{text[-3000:]}"
        rest, _ = deploy.communicate(timeout=180)
        assert deploy.returncode == 0, "\n".join(out) + rest
        said = "\n".join(out) + rest
        assert "[detached] policy 'solver': its trainer ended after step 2 (v2 of 3)" in said, said[-3000:]
        assert "[detached] policy 'verifier': its trainer ended after step 3" in said
        assert "no trainer attached in the 3s since the last one ended: ending the deployment" in said
        assert "[starving]" not in said
        for pid, steps in (("solver", 2), ("verifier", 3)):
            rows = json.loads((tmp_path / pid / "steps.json").read_text())["rows"]
            assert len(rows) == steps and rows[-1][f"train/{pid}/policy_version"] == steps - 1
        run_dir = Path(run_config).parent
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["final_version"] == 2 and (run_dir / "metrics.nc").exists()
    finally:
        stop_all(procs)


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Terminate the processes a test started, newest first; kill any that has not ended 20 s later."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
