"""Small chunks against the engine's batch: `rollout.concurrent_chunks` 1 (one chunk at a time per rollout worker) and
2 (two at once, sharing the engine's batches), side by side in one invocation.

A chunk of `tasks_per_chunk` x `group_size` rows caps the engine's batch when the worker runs one chunk at a time, and
the worker idles between chunks (scheduling, the weight sync at each chunk's start). Runs the given config for a fixed
training time per setting and prints the rollout worker's tokens/s (`service_tokens_per_s`, generated tokens over its
busy time and over the run's wall time), steps and held-out accuracy.

    python bench/concurrent_chunks.py --config tutorials/real_model.yaml --time 120 --tasks_per_chunk 4 \
        --group_size 8 --max_new_tokens 16
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent


def run(config: str, concurrent: int, a: argparse.Namespace, out: Path) -> dict[str, float]:
    from astratk.metrics import load

    args = [str(BIN / "astratk"), "run", "--config", config, "--output_dir", str(out),
            "--trainer.max_time_s", str(a.time), "--rollout.tasks_per_chunk", str(a.tasks_per_chunk),
            "--rollout.group_size", str(a.group_size), "--rollout.max_new_tokens", str(a.max_new_tokens),
            "--rollout.concurrent_chunks", str(concurrent), "--eval.interval_s", "1000", "--eval.max_tasks", "32"]
    text = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    steps, train_s = re.search(r"training: (\d+) steps in (\d+)s", text).groups()
    metrics = Path(next(line.split(": ", 1)[1] for line in text.splitlines() if line.strip().startswith("metrics:")))
    ds = load(metrics)
    tokens = float(ds["service_tokens"].sum())
    busy = float(ds["service_busy_s"].sum())
    return {"steps": int(steps), "train_s": float(train_s), "tokens": tokens,
            "tokens_per_busy_s": tokens / busy if busy else float("nan"),
            "tokens_per_s": tokens / float(train_s)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(Path(__file__).parents[1] / "tutorials" / "real_model.yaml"))
    ap.add_argument("--time", type=float, default=120.0)
    ap.add_argument("--tasks_per_chunk", type=int, default=4)
    ap.add_argument("--group_size", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=16)
    a = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        for concurrent in (1, 2):
            rows[concurrent] = run(a.config, concurrent, a, Path(d))
    print(f"{'concurrent_chunks':18s} {'steps':>6s} {'tokens':>8s} {'tok/s of training':>18s} {'tok/s busy':>11s}")
    for c, r in rows.items():
        print(f"{c:<18d} {r['steps']:6d} {r['tokens']:8.0f} {r['tokens_per_s']:18.1f} {r['tokens_per_busy_s']:11.1f}")
    print(f"2 / 1: {rows[2]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x tokens/s, "
          f"{rows[2]['steps'] / max(1, rows[1]['steps']):.2f}x steps")


if __name__ == "__main__":
    main()
