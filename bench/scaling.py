"""Scheduler scaling efficiency from 1 to 32 simulated rollout workers, and time from a worker's death to its tasks
running elsewhere (issue 6 targets).

What is real and what is simulated:
- real: a `dask scheduler` process, N `distributed.Worker`s each registered on their own (own server, heartbeats,
  one task thread, labels `rollout_main=1, score=1`), and, in the `astratk` path, the real acquisition loop
  (`astratk.runtime.acquisition.Acquisition`), the real data layer as a Dask actor on a `control` worker, and the real
  `admit_task`, with leases, admission and counters;
- simulated: the rollout itself. A rollout Dask task sleeps `--task-ms` (200 ms: latency-bound, like waiting on an
  inference server) and returns empty `LeaseResult`s; scoring returns them unchanged. No model.
- hosting: 32 worker processes would not fit on 2 cores, so the N workers live in `--hosts` processes (N / hosts
  `Worker`s on each process's event loop). The scheduler sees N separate workers either way; what a real pool adds
  (engines, GPUs) is not what is measured here.

Efficiency(N) = throughput(N) / (N x throughput(1)), throughput = rollout chunks completed per second (steady state,
after a warm-up). "CPU busy" is the share of all cores used by the scheduler, the worker hosts and this process (the
client and acquisition loop): near 100% the figure measures this machine, not the scheduler. The `dask` path submits bare `rollout -> score -> admit` chains with the same resources and the
same in-flight target (2 per worker), so the two rows separate Dask's overhead from astratk's.

Heterogeneous: a real run of the tiny model on two classes (one slowed down 3x, simulated: `WorkerClass.slowdown`)
reports each service's tasks/s while busy and version lag, from the run's metrics.nc.

Death: two workers (own processes, 4 task threads each); 4 tasks of 5 s pinned to the victim (`workers=`,
`allow_other_workers=True`); the victim is SIGKILLed (sockets close: the scheduler notices at once) or SIGSTOPped
(a hung host: only heartbeats can tell, after `distributed.scheduler.worker-ttl`, 5 minutes by default, set to
`--ttl-s` here); reported: seconds from the signal to each task starting on the survivor.

    python bench/scaling.py                         # both paths, N = 1 2 4 8 16 32, death figures, hetero run
    python bench/scaling.py --paths astratk --workers 1 8 32 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DASK = str(Path(sys.executable).parent / "dask")
TASK_S = 0.2


# ------------------------------------------------------------------------------------ processes we start and stop
def start_scheduler(tmp: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    file = tmp / f"scheduler-{time.monotonic_ns()}.json"
    # --no-dashboard alone still serves Dask's HTTP routes on 0.0.0.0:8787
    proc = subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                             "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 60
    while not file.exists() or not file.read_text().strip():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise TimeoutError("the dask scheduler did not write its scheduler file within 60 s")
        time.sleep(0.1)
    time.sleep(0.2)
    return proc, json.loads(file.read_text())["address"]


def start_host(address: str, names: list[str], resources: dict[str, float], nthreads: int = 1) -> subprocess.Popen:
    """One process hosting several Workers (this file, `--host-workers`)."""
    return subprocess.Popen([sys.executable, __file__, "--host-workers", address, ",".join(names),
                             json.dumps(resources), str(nthreads)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


async def _host(address: str, names: list[str], resources: dict[str, float], nthreads: int) -> None:
    from distributed import Worker

    workers = [Worker(address, name=n, nthreads=nthreads, resources=resources, host="127.0.0.1", dashboard=False)
               for n in names]
    await asyncio.gather(*workers)
    await asyncio.gather(*(w.finished() for w in workers))


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def cpu_seconds(procs: list[subprocess.Popen]) -> float:
    """CPU time used so far by this process and the ones we started (scheduler, worker hosts)."""
    import psutil

    total = 0.0
    for pid in [os.getpid(), *(p.pid for p in procs)]:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def wait_workers(client, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(client.scheduler_info(n_workers=-1)["workers"]) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {n} workers to join")
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------- simulated tasks
def sim_rollout(ctx, leases):
    from distributed import get_worker

    from astratk.records import LeaseResult

    time.sleep(TASK_S)
    return [LeaseResult(lease.lease_id, (), TASK_S, str(get_worker().name)) for lease in leases]


def sim_score(ctx, results):
    return results


def bare_rollout(i):
    time.sleep(TASK_S)
    return i


def bare_score(x):
    return x


def bare_admit(x):
    return {"leases": 1.0}


# --------------------------------------------------------------------------------------------- throughput
def rate(done_at: list[float], t0: float, warmup: float, seconds: float) -> float:
    """Completions per second in [t0 + warmup, t0 + warmup + seconds]: the least-squares slope of the cumulative count
    against time (completions come in bursts, so first-to-last counting would be off by a burst)."""
    import numpy as np

    t = np.array(sorted(x for x in done_at if t0 + warmup <= x <= t0 + warmup + seconds))
    if len(t) < 3:
        return len(t) / seconds
    return float(np.polyfit(t, np.arange(1, len(t) + 1), 1)[0])


def throughput_dask(client, n: int, seconds: float, warmup: float) -> float:
    """Bare chains, 2 in flight per worker (acquisition's default), FIRST_COMPLETED loop like acquisition's."""
    from distributed import wait

    inflight: set = set()
    done_at: list[float] = []
    i = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < warmup + seconds:
        while len(inflight) < 2 * n:
            r = client.submit(bare_rollout, i, resources={"rollout_main": 1}, pure=False)
            s = client.submit(bare_score, r, resources={"score": 1}, pure=False)
            inflight.add(client.submit(bare_admit, s, pure=False))
            i += 1
        done, _ = wait(list(inflight), timeout=5, return_when="FIRST_COMPLETED")
        now = time.monotonic()
        for f in done:
            inflight.discard(f)
            done_at.append(now)
    client.cancel(list(inflight))
    return rate(done_at, t0, warmup, seconds)


def throughput_astratk(client, n: int, seconds: float, warmup: float, tasks_per_chunk: int) -> float:
    """The real Acquisition + DataLayer actor + admit_task; rollout and score simulated (module docstring)."""
    import astratk.runtime.acquisition as acq
    from astratk.dataflow.client import DataLayerClient
    from astratk.dataflow.datalayer import DataLayer
    from astratk.records import RunContext
    from astratk.spec import DataflowSpec, RolloutSpec, RunSpec

    spec = RunSpec(rollout=RolloutSpec(tasks_per_chunk=tasks_per_chunk, max_inflight_chunks=2),
                   dataflow=DataflowSpec(prefetch_steps=1e6))  # no back-pressure: no trainer consumes here
    actor = client.submit(DataLayer, spec, actor=True, resources={"control": 1}, pure=False).result(60)
    handle = DataLayerClient(actor)
    real = acq.rollout_task, acq.score_task
    acq.rollout_task, acq.score_task = sim_rollout, sim_score  # the one substitution: no model (undone below)
    acquisition = acq.Acquisition(client, handle, RunContext("bench", spec, {}, "memory://bench"))
    done_at: list[float] = []
    collect = acquisition._collect

    def timed_collect(done):  # the completion time of every chunk, as the loop sees it
        before = len(acquisition._inflight)
        collect(done)
        done_at.extend([time.monotonic()] * (before - len(acquisition._inflight)))

    acquisition._collect = timed_collect
    t0 = time.monotonic()
    acquisition.start()
    try:
        time.sleep(warmup + seconds)
        errors = list(acquisition.errors)
    finally:
        acquisition.stop()
        acq.rollout_task, acq.score_task = real
    if errors:
        raise RuntimeError(f"acquisition errors: {errors[:3]}")
    return rate(done_at, t0, warmup, seconds)


def scaling(paths: list[str], sizes: list[int], hosts: int, seconds: float, warmup: float,
            tasks_per_chunk: int) -> None:
    from distributed import Client

    tmp = Path(tempfile.mkdtemp(prefix="astratk-scaling-"))
    print(f"rollout task {TASK_S * 1000:.0f} ms, 2 chunks in flight per worker, up to {hosts} host processes, "
          f"{seconds:.0f}s measured after {warmup:.0f}s warm-up; {os.cpu_count()} CPU cores")
    for path in paths:
        base = None
        label = f"{path} (tasks/chunk {tasks_per_chunk})" if path == "astratk" else path
        print(f"\n{label:>24}  {'workers':>7}  {'chunks/s':>9}  {'ideal':>7}  {'of ideal':>8}  {'efficiency':>10}  "
              f"{'CPU busy':>8}")
        for n in sizes:
            sched, address = start_scheduler(tmp)
            k = min(hosts, n)
            names = [[f"rollout-{i}" for i in range(n) if i % k == h] for h in range(k)]
            procs = [sched] + [start_host(address, ns, {"rollout_main": 1, "score": 1}) for ns in names]
            if path == "astratk":
                procs.append(start_host(address, ["control"], {"control": 1}))
            try:
                with Client(address, timeout=60) as client:
                    wait_workers(client, n + (path == "astratk"))
                    cpu0, t0 = cpu_seconds(procs), time.monotonic()
                    if path == "dask":
                        thr = throughput_dask(client, n, seconds, warmup)
                    else:
                        thr = throughput_astratk(client, n, seconds, warmup, tasks_per_chunk)
                    busy = (cpu_seconds(procs) - cpu0) / (time.monotonic() - t0) / (os.cpu_count() or 1)
            finally:
                stop(procs)
            base = base or thr
            ideal = n / TASK_S
            print(f"{'':>24}  {n:>7}  {thr:>9.1f}  {ideal:>7.0f}  {thr / ideal:>8.2f}  {thr / (n * base):>10.2f}  "
                  f"{busy:>8.0%}")


# ----------------------------------------------------------------------------------------------------- death
def started(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def death(sig: signal.Signals, ttl_s: float, task_s: float = 5.0, n_tasks: int = 4) -> list[float]:
    """Seconds from `sig` on the victim to each of its tasks starting on the survivor."""
    from distributed import Client, wait

    tmp = Path(tempfile.mkdtemp(prefix="astratk-death-"))
    log = tmp / "starts.jsonl"
    env = {"DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": f"{ttl_s}s"}
    sched, address = start_scheduler(tmp, env)
    victim = start_host(address, ["victim"], {"rollout_main": 4}, nthreads=4)
    survivor = start_host(address, ["survivor"], {"rollout_main": 4}, nthreads=4)
    procs = [sched, victim, survivor]

    def task(i: int, path: str, seconds: float) -> int:
        from distributed import get_worker

        with open(path, "a") as f:  # one short line per start: O_APPEND keeps lines whole
            f.write(json.dumps({"task": i, "worker": get_worker().name, "t": time.time()}) + "\n")
        time.sleep(seconds)
        return i

    try:
        with Client(address, timeout=60) as client:
            wait_workers(client, 2)
            addr = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
            futures = [client.submit(task, i, str(log), task_s, resources={"rollout_main": 1},
                                     workers=[addr["victim"]], allow_other_workers=True, pure=False)
                       for i in range(n_tasks)]
            deadline = time.monotonic() + 60
            while len({r["task"] for r in started(log) if r["worker"] == "victim"}) < n_tasks:
                if time.monotonic() > deadline:
                    raise TimeoutError("the victim never started all its tasks")
                time.sleep(0.05)
            t_signal = time.time()
            os.kill(victim.pid, sig)
            wait(futures, timeout=task_s + ttl_s + 60)
            retried = {r["task"]: r["t"] for r in started(log) if r["worker"] == "survivor"}
            if sig == signal.SIGSTOP:
                os.kill(victim.pid, signal.SIGKILL)
            return [retried[i] - t_signal for i in range(n_tasks) if i in retried]
    finally:
        stop(procs)


def deaths(ttl_s: float) -> None:
    print("\ntime from a worker's death to its tasks running elsewhere (4 tasks in flight on the victim)")
    for sig, what in ((signal.SIGKILL, "SIGKILL (process dies, sockets close)"),
                      (signal.SIGSTOP, f"SIGSTOP (hung; worker-ttl {ttl_s:.0f}s)")):
        delays = death(sig, ttl_s)
        print(f"  {what:<40} rerun after median {statistics.median(delays):.2f}s, max {max(delays):.2f}s "
              f"({len(delays)} of 4 rerun)")


# ------------------------------------------------------------------------------------- heterogeneous pool run
def hetero(steps: int, slowdown: float, out: Path) -> None:
    """A real run (tiny model, arithmetic) on two simulated hardware classes; per-service and per-class figures
    from its metrics.nc."""
    from astratk.envs.math.arithmetic import ArithmeticEnv
    from astratk.losses.drpo import DRPO
    from astratk.runtime.run import Run
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
        WorkerClass,
    )

    spec = RunSpec(
        name="hetero", output_dir=str(out), env=ArithmeticEnv(levels=[1], n_heldout=16), progress=False,
        policies=[PolicySpec(model=ModelSpec(tiny=TinyModelSpec(warm_start_steps=30)), loss=DRPO(delta=0.5),
                             trainer=TrainerSpec(max_steps=steps, groups_per_step=4))],
        rollout=RolloutSpec(group_size=4, max_new_tokens=6, tasks_per_chunk=4),
        dataflow=DataflowSpec(max_staleness=8, filter_zero_variance=False),
        cluster=ClusterSpec(pools=[WorkerClass("gpu_fast", 1), WorkerClass("gpu_slow", 1, slowdown=slowdown)]),
        eval=EvalSpec(interval_s=600, max_tasks=16))
    result = Run(spec, printer=lambda line: None).start()
    ds = result.metrics()
    print(f"\nheterogeneous pool, {steps} steps: gpu_fast (slowdown 1) + gpu_slow (slowdown {slowdown:g}, simulated)")
    print(f"  {'service':>10}  {'class':>8}  {'tasks':>5}  {'tasks/s busy':>12}  {'tokens/s':>8}  {'lag mean':>8}  "
          f"{'lag max':>7}")
    for name in ds.service.values:
        r = ds.sel(service=name)
        print(f"  {name:>10}  {r.service_hardware.values!s:>8}  {float(r.service_tasks):>5.0f}  "
              f"{float(r.service_tasks_per_s):>12.1f}  {float(r.service_tokens_per_s):>8.0f}  "
              f"{float(r.service_version_lag_mean):>8.2f}  {float(r.service_version_lag_max):>7.0f}")
    fast, slow = (float(ds.hardware_tasks_per_s.sel(hardware=h)) for h in ("gpu_fast", "gpu_slow"))
    print(f"  per-class speed ratio fast/slow: {fast / slow:.2f} (simulated {slowdown:g}); metrics: "
          f"{result.files['metrics']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", default=["dask", "astratk"], choices=["dask", "astratk"])
    ap.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--hosts", type=int, default=4, help="processes that host the simulated workers")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured window per size")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--tasks-per-chunk", type=int, default=1, help="leases per rollout task in the astratk path")
    ap.add_argument("--ttl-s", type=float, default=10.0, help="worker-ttl for the hung-worker case")
    ap.add_argument("--no-death", action="store_true")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--no-hetero", action="store_true")
    ap.add_argument("--hetero-steps", type=int, default=20)
    ap.add_argument("--slowdown", type=float, default=3.0, help="the slow class's simulated slowdown")
    args = ap.parse_args()
    if not args.no_scaling:
        scaling(args.paths, args.workers, args.hosts, args.seconds, args.warmup, args.tasks_per_chunk)
    if not args.no_death:
        deaths(args.ttl_s)
    if not args.no_hetero:
        hetero(args.hetero_steps, args.slowdown, Path(tempfile.mkdtemp(prefix="astratk-hetero-")))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--host-workers":
        address, names, resources, nthreads = sys.argv[2:6]
        asyncio.run(_host(address, names.split(","), json.loads(resources), int(nthreads)))
    else:
        main()
