"""Two-policy solver + verifier: asynchronous astratk vs the same workload in the synchronous mode (issue 7 target;
AstraFlow reports 2.7x on GPUs).

Both runs train the same two policies (a solver and a verifier, each its own trainer process, started from the same
warm-started tiny model) for the same number of optimiser steps per policy, on the same local cluster shape:
- async: acquisition keeps rollouts in flight while both trainers train (max staleness 4, version barrier 1);
- sync: `dataflow.synchronous: true`: a round of rollouts is generated with the newest weights, then the solver
  trains on it, then the verifier (the classic loop); one rollout worker, staleness 0.
Reported per mode: wall-clock seconds per iteration (training time / steps; one iteration = one step of each
policy), the trainers' share of time waiting for data, and final greedy held-out accuracy of each role (solver:
answer correct after the retry; verifier: verdict matches the truth), evaluated on the same held-out tasks.

    python bench/async_vs_sync.py                  # 30 steps per policy each mode (~10 min on 2 CPU cores)
    python bench/async_vs_sync.py --steps 10 --heldout 64
    python bench/async_vs_sync.py --config tutorials/solver_verifier_real_model.yaml --steps 4 --heldout 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from astratk.config import load_spec
from astratk.runtime.run import Run

CONFIG = Path(__file__).resolve().parent.parent / "tutorials" / "solver_verifier_two_policies.yaml"


def spec_for(mode: str, args: argparse.Namespace, out: Path):
    spec = load_spec(args.config, ["--output_dir", str(out), "--name", f"bench-{mode}", "--eval.max_tasks",
                              str(args.heldout), "--eval.interval_s", "100000", "--progress", "false"])
    for p in spec.policies:
        p.trainer.max_steps = args.steps
        p.trainer.max_time_s = None
        if args.warm_start_steps is not None and p.model.tiny is not None:
            p.model.tiny = dataclasses.replace(p.model.tiny, warm_start_steps=args.warm_start_steps,
                                               warm_start_target=None)
    if mode == "sync":
        spec.dataflow = dataclasses.replace(spec.dataflow, synchronous=True, version_barrier=None)
    return spec.validate()


def measure(mode: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    t0 = time.time()
    result = Run(spec_for(mode, args, out), printer=lambda s: None).start()
    s = result.summary
    ds = result.metrics()
    row = {"wall_s": time.time() - t0, "train_s": s["train_time_s"], "s_per_iteration": s["train_time_s"] / args.steps,
           "wait_solver": s["solver_data_wait_s"] / max(s["train_time_s"], 1e-9),
           "wait_verifier": s["verifier_data_wait_s"] / max(s["train_time_s"], 1e-9)}
    # the measured phases, per iteration: the rollout workers' busy time (rollouts and evaluations) and each trainer's
    # step compute; perfect overlap on `cores` cores (each process on its own thread) can do no better than the
    # longest of them or their sum spread over the cores
    steps = max(args.steps, 1)
    evals = ds["eval_seconds"].isel(policy=0).dropna("evaluation").values  # the last runs after training ends
    row["rollout_busy_s"] = (float(np.nansum(ds["service_busy_s"].values)) + float(np.sum(evals[:-1]))) / steps
    for role in ("solver", "verifier"):
        row[f"compute_{role}_s"] = float(np.nansum(ds["train_step_compute_s"].sel(policy=role).values)) / steps
    phases = [row["rollout_busy_s"], row["compute_solver_s"], row["compute_verifier_s"]]
    row["overlap_ceiling_s"] = max(*phases, sum(phases) / args.cores)
    for role in ("solver", "verifier"):
        name = f"eval_accuracy_{role}"
        values = ds[name].sel(policy=role).dropna("evaluation").values if name in ds else []
        row[f"acc_{role}_before"] = float(values[0]) if len(values) else float("nan")
        row[f"acc_{role}_after"] = float(values[-1]) if len(values) else float("nan")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="optimiser steps per policy in each mode")
    ap.add_argument("--heldout", type=int, default=128, help="held-out tasks evaluated before and after")
    ap.add_argument("--warm-start-steps", type=int, default=None,
                    help="override the tutorial's warm start (fixed steps, no accuracy target)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the overlap ceiling spreads over")
    ap.add_argument("--config", type=Path, default=CONFIG,
                    help="the two-policy run (default: the tiny model's; tutorials/solver_verifier_real_model.yaml: "
                         "two LoRA policies on SmolLM2-135M-Instruct)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {mode: measure(mode, args, Path(tmp)) for mode in ("async", "sync")}
    print(f"two-policy solver + verifier, {args.steps} steps per policy, {args.heldout} held-out tasks; 2 CPU cores\n")
    print(f"{'mode':>6} {'s/iteration':>12} {'train s':>8} {'wait solver':>12} {'wait verifier':>14} "
          f"{'solver acc':>16} {'verifier acc':>16}")
    for mode, r in rows.items():
        print(f"{mode:>6} {r['s_per_iteration']:12.2f} {r['train_s']:8.1f} {r['wait_solver']:12.0%} "
              f"{r['wait_verifier']:14.0%} {r['acc_solver_before']:7.3f} -> {r['acc_solver_after']:.3f} "
              f"{r['acc_verifier_before']:7.3f} -> {r['acc_verifier_after']:.3f}")
    speedup = rows["sync"]["s_per_iteration"] / rows["async"]["s_per_iteration"]
    print(f"\nasync speed-up per iteration: {speedup:.2f}x (sync s/iteration / async s/iteration)")
    print("\nphases per iteration (rollout workers busy, incl. evaluations; each trainer's step compute):")
    for mode, r in rows.items():
        print(f"{mode:>6}: rollouts {r['rollout_busy_s']:.1f} s, solver step {r['compute_solver_s']:.1f} s, verifier step "
              f"{r['compute_verifier_s']:.1f} s; perfect overlap on {args.cores} cores: {r['overlap_ceiling_s']:.1f} s")
    a = rows["async"]
    print(f"async reaches {a['overlap_ceiling_s'] / a['s_per_iteration']:.0%} of the perfect-overlap ceiling of its own "
          f"phases ({a['overlap_ceiling_s']:.1f} s against {a['s_per_iteration']:.1f} s per iteration); that ceiling is "
          f"{rows['sync']['s_per_iteration'] / a['overlap_ceiling_s']:.2f}x sync")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "speedup": speedup, "args": vars(args)}, default=str,
                                        indent=2))


if __name__ == "__main__":
    main()
