"""A waiting trainer's cores lent to the rollout workers (`cluster.lend_idle_cores`), off and on, side by side in one
invocation.

An asynchronous local run splits the cores between the trainer and the rollout workers. While the trainer waits for
data (the whole start, and every step of a rollout-bound run) its share idles, unless it is lent. Runs the given
config for a fixed training time with lending off, then on (the order alternates between repeats: the machine is
shared and drifts), and prints for each: optimizer steps, when the first step ended (seconds after the start),
tokens generated (`service_tokens`) and per second of training, and the share of training the trainer waited.

    python bench/idle_cores.py --config tutorials/real_model.yaml --time 120 --repeats 2
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent


def run(config: str, lend: bool, a: argparse.Namespace, out: Path) -> dict[str, float]:
    from astratk.metrics import load

    args = [str(BIN / "astratk"), "run", "--config", config, "--output_dir", str(out),
            "--trainer.max_time_s", str(a.time), "--cluster.lend_idle_cores", str(lend).lower(),
            "--eval.interval_s", "100000", "--eval.max_tasks", str(a.heldout), *a.extra]
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"astratk run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    text = proc.stdout
    steps, train_s, wait = re.search(r"training: (\d+) steps in (\d+)s, trainer waited for data (\d+)%", text).groups()
    first = re.search(r"first optimizer step began (\d+)s after the start .* ended at (\d+)s", text)
    cpu = next((line for line in text.splitlines() if line.startswith("CPU: torch threads")), "")
    metrics = Path(next(line.split(": ", 1)[1] for line in text.splitlines() if line.strip().startswith("metrics:")))
    ds = load(metrics)
    tokens = float(ds["service_tokens"].sum())
    return {"steps": int(steps), "train_s": float(train_s), "wait": float(wait) / 100, "tokens": tokens,
            "tokens_per_s": tokens / float(train_s), "first_step_end_s": float(first.group(2)) if first else float("nan"),
            "cpu_line": cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(Path(__file__).parents[1] / "tutorials" / "real_model.yaml"))
    ap.add_argument("--time", type=float, default=120.0, help="training seconds per run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--heldout", type=int, default=16, help="held-out tasks of the start and end evaluations")
    ap.add_argument("extra", nargs="*", help="more `astratk run` arguments, after --")
    a = ap.parse_args()
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.repeats):
            for lend in ((False, True) if i % 2 == 0 else (True, False)):
                r = run(a.config, lend, a, Path(d))
                rows[lend].append(r)
                print(f"repeat {i + 1}, lend {'on' if lend else 'off'}: {r['steps']} steps, first step ended at "
                      f"{r['first_step_end_s']:.0f}s, {r['tokens']:.0f} tokens, {r['tokens_per_s']:.1f} tokens/s of "
                      f"training, trainer waited {100 * r['wait']:.0f}%", flush=True)
        print(rows[True][0]["cpu_line"])

    def med(lend: bool, key: str) -> float:
        return statistics.median(r[key] for r in rows[lend])

    print(f"\n{'lend_idle_cores':16s} {'steps':>6s} {'first step ended':>17s} {'tokens/s of training':>21s} "
          f"{'trainer waited':>15s}   (medians of {a.repeats})")
    for lend in (False, True):
        print(f"{str(lend).lower():16s} {med(lend, 'steps'):6.1f} {med(lend, 'first_step_end_s'):16.0f}s "
              f"{med(lend, 'tokens_per_s'):21.1f} {100 * med(lend, 'wait'):14.0f}%")
    print(f"on / off: {med(True, 'tokens_per_s') / med(False, 'tokens_per_s'):.2f}x tokens/s, "
          f"{med(True, 'steps') / max(1.0, med(False, 'steps')):.2f}x steps, first step ended "
          f"{med(False, 'first_step_end_s') - med(True, 'first_step_end_s'):+.0f}s sooner")


if __name__ == "__main__":
    main()
