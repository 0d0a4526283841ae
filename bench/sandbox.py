"""Sandbox throughput: executions per second of a trivial program and of a typical code-env grading (the harness
running a synthetic task's 5 hidden tests on a correct solution), for each isolation mode side by side, one at a time
and from `--threads` threads at once. The trivial program also runs without the per-run cgroup (`cgroup=False`, same
limits otherwise) beside the default, and the cgroup's own set-up and removal is timed alone.

    python bench/sandbox.py                 # 40 runs per cell, threads = CPU count
    python bench/sandbox.py --runs 10       # a quick look
    (run from the repository root)

Each cell reports runs/s and the median latency of one run; the isolation and cgroup named in each row are the ones
the results say were used (`SandboxResult.isolation`, `.cgroup`), not the ones asked for. Modes alternate cell by cell,
so drifting load on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor


def measure(fn, runs: int, threads: int) -> tuple[float, float, set[str]]:
    """(runs per second, median seconds per run, containments seen)."""
    fn()  # warm: first-use probes and page cache
    lat, seen = [], set()

    def one(_: int) -> None:
        t = time.perf_counter()
        seen.add(fn())
        lat.append(time.perf_counter() - t)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(runs)))
    return runs / (time.perf_counter() - start), statistics.median(lat), seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()

    from astratk.envs.code import cgroup as cgroups
    from astratk.envs.code.env import CodeEnv
    from astratk.envs.code.launch import bwrap_available
    from astratk.envs.code.sandbox import Sandbox

    modes = (["bwrap"] if bwrap_available() else []) + ["process"]
    if "bwrap" not in modes:
        print("bubblewrap unavailable (apt-get install -y bubblewrap): measuring the process fallback only")
    envs = {m: CodeEnv(levels=(2,), n_heldout=1, seed=0, isolation=m) for m in modes}
    task = next(iter(envs[modes[0]].tasks("heldout")))
    solution = envs[modes[0]].demonstration(task)

    layout, why = cgroups.probe()
    if layout is None:
        print(f"no per-run cgroup here ({why}): the cgroup rows measure the RAM-guard fallback only")

    def trivial(mode: str, cgroup: bool | None = None):
        sb = Sandbox(isolation=mode, max_procs=16, cgroup=cgroup)  # 16 x 512 MB passes the RAM guard without one

        def run() -> str:
            r = sb.run("pass")
            assert r.ok, r.stderr
            return f"{r.isolation}/{'cgroup' if r.cgroup else 'none'}"
        return run

    def no_cgroup(mode: str):
        return trivial(mode, cgroup=False)

    def harness(mode: str):
        env = envs[mode]

        def run() -> str:
            [s] = env.score_details(task, [solution])
            assert s.reward == 1.0, s
            return f"{s.isolation}/{'cgroup' if env.sandbox.cgroup else 'none'}"
        return run

    print(f"sandbox executions per second ({args.runs} runs per cell; {os.cpu_count()} CPUs; "
          f"task {task.task_id}, {len(task.info['tests'])} tests)")
    print(f"{'workload':<22}{'containment':<16}{'threads':>8}{'runs/s':>10}{'median ms':>11}")
    workloads = (("trivial program", (trivial, no_cgroup)), ("5-test harness", (harness,)))
    for name, makers in workloads:
        for threads in sorted({1, args.threads}):
            for mode in modes:
                for make in makers:  # with and without the cgroup in turn
                    rate, med, seen = measure(make(mode), args.runs, threads)
                    print(f"{name:<22}{'/'.join(sorted(seen)):<16}{threads:>8}{rate:>10.1f}{1000 * med:>11.1f}")
    if layout is not None:
        times = []
        for _ in range(max(args.runs, 20)):
            t = time.perf_counter()
            cgroups.RunCgroup(layout, 512 << 20, 66).close()
            times.append(time.perf_counter() - t)
        print(f"cgroup v{layout.version} create + set limits + remove, alone: median "
              f"{1000 * statistics.median(times):.2f} ms ({len(times)} times)")


if __name__ == "__main__":
    main()
