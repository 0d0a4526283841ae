"""`cluster.torch_threads: auto` on a localhost cluster of your own, against the thread count it chose before.

Starts a real `dask scheduler` and two `dask worker`s (control; rollout + score) on 127.0.0.1, then runs the
quickstart against it for a fixed training time, once with `auto` (each host's cores split among the processes
working there) and once with `--threads_before` threads everywhere (what `auto` chose before: each host's cores for
every process), and once as a local run for reference. Prints steps and steps/s side by side.

    python bench/own_cluster_threads.py --time 60 --threads_before 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
QUICKSTART = Path(__file__).parents[1] / "tutorials" / "quickstart.yaml"


def cluster(tmp: Path) -> tuple[str, list[subprocess.Popen]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    sched = tmp / "scheduler.json"
    procs = [subprocess.Popen([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                               "--scheduler-file", str(sched)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    while not sched.exists():
        time.sleep(0.2)
    address = json.loads(sched.read_text())["address"]
    for name, res in (("control", "control=1"), ("rollout-0", "rollout_main=1,score=1")):
        procs.append(subprocess.Popen([str(BIN / "dask"), "worker", address, "--name", name, "--nthreads", "1",
                                       "--host", "127.0.0.1", "--resources", res, "--no-dashboard"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return address, procs


def run(args: list[str], tmp: Path) -> tuple[int, float, str]:
    out = subprocess.run([str(BIN / "astratk"), "run", "--config", str(QUICKSTART), "--output_dir", str(tmp / "runs"),
                          *args], capture_output=True, text=True, check=True).stdout
    steps, seconds = re.search(r"training: (\d+) steps in (\d+)s", out).groups()
    cpu = next(line for line in out.splitlines() if line.startswith("CPU:"))
    return int(steps), float(seconds), cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", type=float, default=60.0)
    ap.add_argument("--threads_before", type=int, default=os.cpu_count() or 2)
    a = ap.parse_args()
    budget = ["--trainer.max_time_s", str(a.time), "--eval.interval_s", "1000", "--eval.max_tasks", "64"]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = []
        address, procs = cluster(tmp)
        try:
            own = ["--cluster.scheduler_address", address, *budget]
            rows.append(("own cluster, auto (per host)", *run(own, tmp)))
            rows.append((f"own cluster, {a.threads_before} threads (auto before)",
                         *run([*own, "--cluster.torch_threads", str(a.threads_before)], tmp)))
        finally:
            for p in procs:
                p.terminate()
        rows.append(("local cluster, auto", *run(budget, tmp)))
    print(f"{'run':40s} {'steps':>6s} {'train s':>8s} {'steps/s':>8s}")
    for name, steps, seconds, cpu in rows:
        print(f"{name:40s} {steps:6d} {seconds:8.0f} {steps / seconds:8.3f}   {cpu[:110]}")
    print(f"auto per host vs before: {rows[0][1] / rows[0][2] / (rows[1][1] / rows[1][2]):.2f}x steps/s")


if __name__ == "__main__":
    main()
