"""Runs one after another in one process: each on a local cluster of its own (`cluster.keep_warm_s: 0`) against each
on the cluster the previous run kept warm (the default), side by side in one process. Prints the wall time of every
run, the medians and their ratio, and the rollout worker's resident memory after each run (every run releases its
rollout services, so a kept worker must not grow from run to run).

Each mode runs its runs in turn: the quickstart's tiny model (`--model tiny`, a few steps) or SmolLM2-135M-Instruct
with LoRA (`--model smollm2`, the tutorial 9 config cut to one step). The first run of the warm mode starts the cluster
the others reuse, so it is reported but left out of the median, as the first run of the cold mode is (it builds or
loads the model into the cache).

    python bench/warm_cluster.py                     # tiny model, 5 runs per mode
    python bench/warm_cluster.py --model smollm2 --runs 3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def base_spec(model: str, out: str):
    import astratk
    from astratk.quick import smoke

    if model == "tiny":
        spec = astratk.Run.from_config(str(ROOT / "tutorials" / "quickstart.yaml"), "--output_dir", out).spec
        return smoke(spec, steps=4, heldout=16)
    spec = astratk.Run.from_config(str(ROOT / "tutorials" / "real_model.yaml"), "--output_dir", out).spec
    return smoke(spec, steps=1, heldout=4)


def worker_rss_mib() -> list[int]:
    import psutil

    # Dask retitles its worker processes ("dask worker [...]"); multiprocessing's resource tracker is left out
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                out.append(round(p.memory_info().rss / 2**20))
        except psutil.Error:
            continue
    return sorted(out)


def one_mode(base, runs: int, keep: bool) -> list[tuple[float, list[int]]]:
    from astratk.runtime.run import Run
    from astratk.runtime.warm import close_kept

    close_kept()
    out = []
    for _ in range(runs):
        spec = dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, keep_warm_s=300 if keep else 0))
        t = time.perf_counter()
        result = Run(spec, printer=lambda line: None).start()
        wall = time.perf_counter() - t
        assert result.summary["steps"] >= 1, result.summary
        out.append((wall, worker_rss_mib()))
        print(f"  {'kept' if keep else 'own '} cluster: {wall:6.2f} s   worker processes' RSS MiB {out[-1][1]}",
              flush=True)
    close_kept()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--runs", type=int, default=5, help="runs per mode (the first of each is left out of the median)")
    args = ap.parse_args()
    if args.runs < 2:
        sys.exit("bench/warm_cluster.py: --runs must be >= 2 (the first run of each mode is left out)")
    os.environ.setdefault("ASTRATK_DASHBOARD", "0")  # the drawing is the same in both modes; leave it out
    base = base_spec(args.model, tempfile.mkdtemp(prefix="astratk-warm-"))
    print(f"{args.runs} runs per mode, model {args.model}, {os.cpu_count()} cores")
    own = one_mode(base, args.runs, keep=False)
    kept = one_mode(base, args.runs, keep=True)
    m_own = statistics.median(w for w, _ in own[1:])
    m_kept = statistics.median(w for w, _ in kept[1:])
    print(f"median wall per run (runs 2..{args.runs}): own cluster {m_own:.2f} s, kept cluster {m_kept:.2f} s, "
          f"ratio {m_own / m_kept:.2f}x")
    first, last = kept[1][1], kept[-1][1]
    print(f"kept cluster's worker RSS after run 2: {first} MiB, after run {args.runs}: {last} MiB")


if __name__ == "__main__":
    main()
