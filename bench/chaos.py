"""Chaos run: kill rollout workers, the control worker (the data layer's) and the trainer at random during training,
and check that nothing is lost, nothing is trained twice, and how long training stalls.

    python bench/chaos.py                 # both phases: ~6 kills of workers, then a trainer kill and resume
    python bench/chaos.py --kills 10 --steps 40 --seed 3
    python bench/chaos.py --phase workers # or: --phase trainer

Phase "workers" (one run in this process, a local cluster of worker processes: control + 2 rollout workers): a chaos
thread waits until training is under way, then SIGKILLs a worker chosen at random every 3-8 s (the control worker at
most every third kill, so the data layer's replacement has time to come up), `--kills` times. Each nanny restarts its
worker; a lost data layer is replaced from its newest snapshot. Checked at the end: every step trained
(`--steps`), no group trained twice (the trainer's group ids), no task lost (`task_accounting`: leased = completed +
dropped + open). Reported: the kills, and the stall after each (the longest gap between two trained steps that spans
the kill, against the median gap).

Phase "trainer": `astratk run` in a subprocess with checkpoints every 2 steps, SIGKILLed (the whole process group:
driver, in-process trainer, cluster) once a checkpoint past step 4 exists, then resumed with `resume_from`. Checked:
the resumed run trains to `--steps`, without a repeated group and without a lost task. Reported: the seconds from
the resumed run's start to its first trained step.

Prints one table and writes it as JSON (`--out`). Figures go to BENCHMARKS.md ("Chaos").
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _small_spec(out: Path, steps: int, workers: int) -> Any:
    from astratk.envs.math.arithmetic import ArithmeticEnv
    from astratk.losses.drpo import DRPO
    from astratk.spec import (
        ClusterSpec,
        DataflowSpec,
        EvalSpec,
        ModelSpec,
        PolicySpec,
        RolloutSpec,
        RunSpec,
        TinyModelSpec,
        TrainerSpec,
    )

    tiny = TinyModelSpec(warm_start_steps=60, warm_start_batch=32)
    return RunSpec(
        name="chaos", output_dir=str(out / "runs"), env=ArithmeticEnv(levels=[1, 2], n_heldout=32),
        policies=[PolicySpec(model=ModelSpec(tiny=tiny), loss=DRPO(),
                             trainer=TrainerSpec(max_steps=steps, groups_per_step=4))],
        rollout=RolloutSpec(group_size=4, max_new_tokens=6, tasks_per_chunk=4),
        dataflow=DataflowSpec(max_staleness=8, filter_zero_variance=False, lease_timeout_s=30.0),
        cluster=ClusterSpec(rollout_workers=workers, startup_timeout_s=180),
        eval=EvalSpec(interval_s=1e6, max_tasks=32), progress=False)


def _pids(client: Any) -> dict[str, int]:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    names = {a: str(w.get("name")) for a, w in workers.items()}
    return {names[a]: pid for a, pid in client.run(os.getpid, workers=list(names)).items()}


def phase_workers(out: Path, steps: int, kills: int, seed: int) -> dict[str, Any]:
    from astratk.runtime.acquisition import task_accounting
    from astratk.runtime.session import Session

    spec = _small_spec(out, steps, workers=2)
    rng = random.Random(seed)
    done: list[tuple[float, str]] = []  # (wall time of the kill, worker name)
    run_dir = out / "workers-run"
    run_dir.mkdir(parents=True, exist_ok=True)

    def chaos(session: Session) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and session.deployment.datalayer.metrics().get(
                "data/main/groups_served", 0) < 8:
            time.sleep(0.2)
        since_control = 3
        while len(done) < kills and session.state not in ("finished", "failed"):
            time.sleep(rng.uniform(3.0, 8.0))
            try:
                pids = _pids(session.client)
            except Exception as e:  # noqa: BLE001 - a worker is restarting: try again at the next tick
                print(f"chaos: workers not listable now ({e!r}); next tick", flush=True)
                continue
            names = sorted(n for n in pids if n.startswith("rollout"))
            if since_control >= 3 and "control" in pids:
                names.append("control")
            if not names:
                continue
            name = rng.choice(names)
            since_control = 0 if name == "control" else since_control + 1
            os.kill(pids[name], signal.SIGKILL)
            done.append((time.time(), name))
            print(f"chaos: killed {name} (pid {pids[name]})", flush=True)

    served: list[float] = []  # wall times at which the data layer served another step's batch

    def monitor(session: Session) -> None:
        last = 0.0
        while session.state not in ("finished", "failed"):
            try:
                n = session.deployment.datalayer.metrics(timeout=5).get("data/main/groups_served", 0.0)
            except Exception:  # noqa: BLE001 - the data layer is being replaced: keep polling
                n = last
            if n > last:
                served.append(time.time())
                last = n
            time.sleep(0.1)

    with Session(spec, run_dir, lambda s: None) as session:
        threads = [threading.Thread(target=f, args=(session,), daemon=True) for f in (chaos, monitor)]
        for t in threads:
            t.start()
        summary = session.train()
        session.state = "finished"
        for t in threads:
            t.join(10)
        ids = list(session.group_ids.get("main", []))
        counters = dict(session.counters)
    gaps = [b - a for a, b in itertools.pairwise(served)]
    median_gap = statistics.median(gaps) if gaps else float("nan")
    stalls = []
    for when, name in done:
        spanning = [b - a for a, b in itertools.pairwise(served) if a <= when <= b]
        stalls.append({"worker": name, "stall_s": round(spanning[0], 2) if spanning else None})
    accounting = task_accounting(counters)
    return {"phase": "workers", "steps": summary["steps"], "steps_wanted": steps, "kills": len(done),
            "kills_control": sum(1 for _, n in done if n == "control"), "groups_trained": len(ids),
            "groups_doubled": len(ids) - len(set(ids)), "tasks_lost": accounting["tasks_lost"],
            "tasks_dropped_failed": accounting["tasks_dropped_failed"],
            "data_restores": counters.get("data/restores", 0.0), "median_step_gap_s": round(median_gap, 2),
            "longest_stall_s": max((s["stall_s"] or 0.0 for s in stalls), default=0.0), "stalls": stalls}


def phase_trainer(out: Path, steps: int) -> dict[str, Any]:
    from astratk.config import dump_spec

    spec = _small_spec(out, steps, workers=1)
    spec.policies[0].trainer.checkpoint_every = 2
    config = out / "trainer-run.yaml"
    config.write_text(dump_spec(spec))
    cli = [sys.executable, "-m", "astratk.cli", "run", "--config", str(config)]
    first = subprocess.Popen(cli, cwd=out, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    runs = Path(spec.output_dir)
    deadline, killed_at = time.monotonic() + 600, None
    while time.monotonic() < deadline and first.poll() is None:
        ckpts = list(runs.glob("chaos-*/checkpoints/main/step=*.ckpt"))
        if any(int(p.stem.split("=")[1]) >= 4 for p in ckpts):
            os.killpg(first.pid, signal.SIGKILL)
            killed_at = max(int(p.stem.split("=")[1]) for p in ckpts)
            break
        time.sleep(0.5)
    first.wait(30)
    if killed_at is None:
        return {"phase": "trainer", "error": f"the first run ended (code {first.returncode}) before a checkpoint "
                                             "past step 4"}
    [old] = [p for p in runs.iterdir() if p.is_dir()]
    t0 = time.time()
    resumed = subprocess.run([*cli, "--resume_from", str(old)], cwd=out, capture_output=True, text=True,
                             timeout=900, check=False)
    if resumed.returncode != 0:
        return {"phase": "trainer", "error": resumed.stderr[-2000:]}
    new = max((p for p in runs.iterdir() if p.is_dir() and p != old), key=lambda p: p.stat().st_mtime)
    summary = json.loads((new / "summary.json").read_text())
    import xarray as xr

    ds = xr.open_dataset(new / "metrics.nc")
    counters = {k.removeprefix("counter_").replace("_", "/", 1): v for k, v in ds.attrs.items()
                if k.startswith("counter_data_")}
    from astratk.runtime.acquisition import task_accounting

    accounting = task_accounting(counters)
    first_step_s = float(ds["train_time_s"].sel(policy="main").isel(step=0)) if ds.sizes.get("step") else None
    # the resumed run trains from the checkpoint's step on: the policy's last version is the whole run's step count
    return {"phase": "trainer", "killed_after_checkpoint": killed_at, "steps_after_resume": summary["steps"],
            "steps": summary["final_version"], "steps_wanted": steps, "tasks_lost": accounting["tasks_lost"],
            "resume_wall_s": round(time.time() - t0, 1),
            "first_step_after_resume_s": None if first_step_s is None else round(first_step_s, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", choices=["workers", "trainer", "both"], default="both")
    p.add_argument("--kills", type=int, default=6)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "chaos.json"))
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.out).with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    results = []
    if args.phase in ("workers", "both"):
        results.append(phase_workers(work, args.steps, args.kills, args.seed))
        print(yaml.safe_dump(results[-1], sort_keys=False))
    if args.phase in ("trainer", "both"):
        results.append(phase_trainer(work, max(10, args.steps // 2)))
        print(yaml.safe_dump(results[-1], sort_keys=False))
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    ok = all(r.get("tasks_lost", 1) == 0 and r.get("groups_doubled", 0) == 0 and r.get("steps") == r.get("steps_wanted")
             for r in results)
    print("chaos:", "nothing lost, nothing doubled, every step trained" if ok else "FAILED: see above")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
