"""`bench/stability.py --quick`: two losses x two regimes (synchronous, forced 16-version lag) through real runs, every
snapshot evaluated, the table, JSON and figures written; then `--cell` reruns one cell into the same grid and `--resume`
skips what is done. Keeps the grid from rotting between its real (two-hour) runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "stability.py"), *args], check=False,
                          capture_output=True, text=True, timeout=900, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_quick_grid_then_one_cell_then_resume(tmp_path):
    out = tmp_path / "results"
    bench("--quick", "--smoke", "--out", str(out), cwd=tmp_path)  # --smoke: a 30-step warm start, small batches
    payload = json.loads((out / "stability.json").read_text())
    cells = {(c["loss"], c["regime"]): c for c in payload["cells"]}
    assert sorted(cells) == [("drpo_d0.2", "stale16"), ("drpo_d0.2", "sync"), ("pg_is", "stale16"),
                             ("pg_is", "sync")]
    initial = payload["initial"]
    for (loss, regime), c in cells.items():
        assert c["steps"] == 6 and c["updates"] == 2, (loss, regime, c["steps"])
        versions = [p["version"] for p in c["curve"]]
        assert versions == [0, 3, 6], (loss, regime, versions)  # --quick evaluates every 3 versions
        assert c["curve"][0]["accuracy"] == initial
        assert all(0.0 <= p["accuracy"] <= 1.0 for p in c["curve"])
        assert c["final"] == c["curve"][-1]["accuracy"] and c["best"] == max(p["accuracy"] for p in c["curve"])
        assert math.isfinite(c["pi_mu_abs_mean"]) and c["pi_mu_abs_mean"] >= 0
        assert isinstance(c["collapsed"], bool)
    # staleness: synchronous trains version k on version k's rollouts; the forced lag keeps samples old
    assert cells[("drpo_d0.2", "sync")]["staleness_mean"] == 0.0
    assert cells[("drpo_d0.2", "stale16")]["staleness_mean"] > 1.0
    assert "drpo_d0.2" in payload["table"] and "| loss | sync | stale16 |" in payload["table"]
    # the loss's own fractions: DRPO reports the share of tokens beyond its boundary; PG-IS has none to report
    assert 0.0 <= cells[("drpo_d0.2", "stale16")]["fractions"]["beyond_boundary_frac"] <= 1.0
    assert cells[("pg_is", "sync")]["fractions"] == {}
    for name in ("heatmap.html", "curves.html", "heatmap.png", "curves.png"):
        assert (out / name).stat().st_size > 0, name

    # one cell again (the tutorial's "rerun one cell"): replaced in the grid, not duplicated
    proc = bench("--cell", "pg_is:sync:0", "--smoke", "--steps", "3", "--eval-every", "3", "--heldout", "32", "--out", str(out),
                 cwd=tmp_path)
    lines = [json.loads(x) for x in (out / "cells.jsonl").read_text().splitlines()]
    assert len(lines) == 5 and lines[-1]["loss"] == "pg_is" and lines[-1]["steps"] == 3
    payload = json.loads((out / "stability.json").read_text())
    assert len(payload["cells"]) == 4 and {c["steps"] for c in payload["cells"] if c["loss"] == "pg_is"
                                           and c["regime"] == "sync"} == {3}
    assert "1 cells to run" in proc.stdout

    # --resume: nothing left to run; --report: the table and figures of what is there, running nothing
    proc = bench("--quick", "--smoke", "--resume", "--out", str(out), cwd=tmp_path)
    assert "4 cells in" in proc.stdout and "0 of the grid not run yet" in proc.stdout  # the rerun cell counted once
    (out / "heatmap.png").unlink()
    proc = bench("--quick", "--report", "--out", str(out), cwd=tmp_path)
    assert "0 of the grid not run yet" in proc.stdout and (out / "heatmap.png").stat().st_size > 0
    assert json.loads((out / "stability.json").read_text())["complete"] is True
    proc = bench("--report", "--out", str(out), cwd=tmp_path)  # against the full grid: partial, and says so
    payload = json.loads((out / "stability.json").read_text())
    assert payload["complete"] is False and len(payload["missing"]) == 132 - 4


def test_bad_arguments_say_what_to_give(tmp_path):
    for args, message in ((["--losses", "nope"], "unknown 'nope'"), (["--regimes", "x"], "unknown 'x'"),
                          (["--cell", "drpo_d0.2:sync"], "give LOSS:REGIME:SEED")):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "stability.py"), *args], check=False,
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr[-500:])
