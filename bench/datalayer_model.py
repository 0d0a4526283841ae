"""The data layer's model checker (tests/unit/test_datalayer_model.py) as a long search that counts what it ran.

    python bench/datalayer_model.py                     # 5,000 examples of up to 100 steps (~4 min here)
    python bench/datalayer_model.py --examples 200      # what the test suite runs
    (run from the repository root)

Hypothesis drives a real `DataLayer` through random interleavings and checks the data path's invariants after every
step (the test module's docstring lists them); it prints the examples and steps it ran, and the first failing
sequence if any invariant breaks. `pytest tests/unit/test_datalayer_model.py --hypothesis-profile=long` runs the same
search without the counts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, run_state_machine_as_test

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.unit.test_datalayer_model import DataLayerMachine

COUNTS = {"steps": 0, "examples": 0}


class CountingMachine(DataLayerMachine):
    @invariant()
    def count_step(self) -> None:  # invariants run after every step
        COUNTS["steps"] += 1

    def teardown(self) -> None:
        COUNTS["examples"] += 1
        super().teardown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=5000)
    p.add_argument("--steps", type=int, default=100, help="most steps per example")
    args = p.parse_args()
    start = time.perf_counter()
    run_state_machine_as_test(CountingMachine, settings=settings(
        max_examples=args.examples, stateful_step_count=args.steps, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))
    seconds = time.perf_counter() - start
    print(f"max_examples {args.examples}: {COUNTS['examples']} examples, {COUNTS['steps']} steps checked, "
          f"{seconds:.0f} s, no invariant broken")


if __name__ == "__main__":
    main()
