"""What TLS on a local run's cluster costs (`cluster.local_tls`, on by default): the quickstart with it and without,
alternating, side by side in one invocation. Prints steps, steps/s and the whole run's wall time per mode.

    python bench/local_tls.py --time 60 --repeats 2
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
QUICKSTART = Path(__file__).parents[1] / "tutorials" / "quickstart.yaml"


def run(tls: bool, seconds: float, out: Path) -> tuple[int, float, float]:
    text = subprocess.run([str(BIN / "astratk"), "run", "--config", str(QUICKSTART), "--output_dir", str(out),
                           "--trainer.max_time_s", str(seconds), "--eval.interval_s", "1000", "--eval.max_tasks", "64",
                           "--cluster.local_tls", str(tls).lower()], capture_output=True, text=True,
                          check=True).stdout
    steps, train_s, whole_s = re.search(r"training: (\d+) steps in (\d+)s.*whole run (\d+)s", text).groups()
    return int(steps), float(train_s), float(whole_s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    rows: dict[bool, list[tuple[int, float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.repeats):
            for tls in (True, False):
                rows[tls].append(run(tls, a.time, Path(d)))
    rate = {tls: statistics.median(s / t for s, t, _ in r) for tls, r in rows.items()}
    print(f"{'local_tls':10s} {'steps (each run)':>20s} {'steps/s (median)':>18s} {'whole run s (each)':>20s}")
    for tls, r in rows.items():
        print(f"{tls!s:10s} {[s for s, _, _ in r]!s:>20s} {rate[tls]:18.3f} {[w for _, _, w in r]!s:>20s}")
    print(f"TLS / plain TCP: {rate[True] / rate[False]:.3f}x steps/s")


if __name__ == "__main__":
    main()
