"""Local worker start-up: forked from a fork server (`cluster.worker_start: forkserver`) against spawned (`spawn`),
side by side, alternating, each round in a fresh process (a fork server lives as long as the process that started
it, so a round that reused one would hide its own start).

Each round starts a pool cluster (control + `--workers` rollout workers, each importing the rollout tasks as it
starts, as a run's do), adds one worker to the elastic pool, kills a rollout worker and waits for its nanny to bring
it back, then runs a 3-step tiny-model smoke run on a cluster of its own. Prints per-mode medians of each phase's wall
time and the CPU time of the whole process tree (this process, its fork server and every worker), and their ratios.

    python bench/worker_start.py                 # 3 rounds per mode, 2 rollout workers
    python bench/worker_start.py --rounds 5 --workers 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("spawn", "forkserver")
PHASES = ("up_s", "add_s", "restart_s", "run_s", "cpu_s")


def _tree_cpu() -> float:
    """CPU seconds of this process and every process it started, the fork server's forks included: the server is
    stopped first (it reaps its forks, and its own usage then counts toward this process's children)."""
    import resource
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # private, a no-op without a server: the bench's bookkeeping only
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _wait(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def child(mode: str, workers: int) -> dict[str, float]:
    from distributed import Client

    import astratk
    from astratk.quick import smoke
    from astratk.runtime.pools import start_pool_cluster
    from astratk.spec import ClusterSpec, RunSpec

    spec = RunSpec(cluster=ClusterSpec(rollout_workers=workers, worker_start=mode)).validate()
    out: dict[str, float] = {}
    t = time.perf_counter()
    cluster = start_pool_cluster(spec)
    with Client(cluster) as client:
        client.wait_for_workers(workers + 1, timeout=120)
        client.run(lambda: __import__("astratk.rollout.tasks"))  # every worker has imported what a run needs
        out["up_s"] = time.perf_counter() - t

        t = time.perf_counter()
        cluster.scale_pool(workers + 1)
        client.wait_for_workers(workers + 2, timeout=120)
        out["add_s"] = time.perf_counter() - t

        infos = client.scheduler_info(n_workers=-1)["workers"]
        victim = next(a for a, w in infos.items() if w["name"] != "control")
        name = infos[victim]["name"]
        pid = client.run(os.getpid, workers=[victim])[victim]
        t = time.perf_counter()
        os.kill(pid, signal.SIGKILL)

        def back() -> bool:
            now = client.scheduler_info(n_workers=-1)["workers"]
            return any(w["name"] == name and a != victim for a, w in now.items())

        _wait(back, f"the nanny to restart worker {name}")
        out["restart_s"] = time.perf_counter() - t
    cluster.close()

    with tempfile.TemporaryDirectory() as tmp:
        run_spec = astratk.Run.from_config(str(ROOT / "tutorials" / "quickstart.yaml"), "--output_dir", tmp).spec
        run_spec = smoke(run_spec, steps=3, heldout=16)
        run_spec = dataclasses.replace(run_spec, cluster=dataclasses.replace(run_spec.cluster, worker_start=mode,
                                                                                keep_warm_s=0))
        t = time.perf_counter()
        astratk.Run(run_spec, printer=lambda line: None).start()
        out["run_s"] = time.perf_counter() - t
    out["cpu_s"] = _tree_cpu()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="rollout workers (plus the control worker)")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1 or args.workers < 1:
        ap.error("--rounds and --workers must be >= 1")
    if args.child:
        print(json.dumps(child(args.child, args.workers)))
        return
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    env = {**os.environ, "ASTRATK_DASHBOARD": "0"}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            proc = subprocess.run([sys.executable, __file__, "--child", mode, "--workers", str(args.workers)],
                                  capture_output=True, text=True, env=env, timeout=900, check=False)
            if proc.returncode != 0:
                sys.exit(f"round {r} ({mode}) failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            results[mode].append(row)
            print(f"round {r} {mode:10s} " + "  ".join(f"{k} {v:6.2f}" for k, v in row.items()), flush=True)
    med = {m: {k: statistics.median(row[k] for row in rows) for k in PHASES} for m, rows in results.items()}
    print(f"\nmedians over {args.rounds} rounds, {args.workers} rollout workers + control:")
    print("| phase | spawn | forkserver | spawn / forkserver |\n|---|---|---|---|")
    for k in PHASES:
        s, f = med["spawn"][k], med["forkserver"][k]
        print(f"| {k} | {s:.2f} | {f:.2f} | {s / f:.2f}x |")


if __name__ == "__main__":
    main()
