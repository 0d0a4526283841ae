"""`bench/vs_trl.py --quick`: both sides (astratk in process, TRL's GRPOTrainer in a subprocess) train the quickstart
model for a few seconds and every snapshot is evaluated by the shared function, so that the benchmark cannot rot
between its real runs. Needs the `bench` extra (trl); skipped without it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests._bench import bench_module

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_run_measures_both_sides(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "results"
    # one torch thread for TRL too: the test suite keeps every process on one (tests/conftest.py)
    # the quickstart model warm-started to 10% train exact-match, not its 30%: ~370 supervised steps, not ~490 (the
    # build is most of this test in CI, whose model cache starts empty); both sides start from it all the same
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vs_trl.py"), "--quick", "--trl-threads", "1",
                           "--astratk-set", "policies.0.model.tiny.warm_start_target=0.1",
                           "--out", str(out)], check=False, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((out / "quickstart.json").read_text())
    initial = payload["model"]["initial_accuracy"]
    assert 0.0 < initial < 1.0 and payload["model"]["n_heldout"] == 64
    runs = {r["side"]: r for r in payload["runs"]}
    assert sorted(runs) == ["astratk", "trl"] and len(payload["runs"]) == 2  # --quick: one lr, one seed per side
    for side, run in runs.items():
        curve = run["curve"]
        assert curve[0] == {"time_s": 0.0, "step": 0, "accuracy": initial}, side
        snaps = run["snapshots"]
        assert len(snaps) >= 2, (side, snaps)  # --quick keeps weights at 2, 4 and 6 s of training, and the last
        assert all(math.isfinite(s["accuracy"]) and 0.0 <= s["accuracy"] <= 1.0 for s in snaps), (side, snaps)
        times = [s["time_s"] for s in snaps]
        steps = [s["step"] for s in snaps]
        assert times == sorted(times) and len(set(times)) == len(times), (side, times)  # increasing training times
        assert steps == sorted(steps) and steps[-1] == run["steps"] > 0, (side, steps, run["steps"])
        assert 0 < times[-1] <= run["train_time_s"] + 1e-6 and run["train_time_s"] >= 6.0, (side, run)
        assert run["steps_per_s"] > 0 and run["samples_per_s"] > 0
    # the TRL side saw astratk's prompts and stops at its stop tokens
    check = runs["trl"]["check"]
    assert check["prompt_ids_equal"] and check["stops_equal"], check
    assert runs["trl"]["config"]["loss_type"] == "dr_grpo" and runs["trl"]["config"]["generation_batch_size"] == 128
    assert "| optimizer steps/s |" in payload["table"]
    assert (out / "quickstart.png").stat().st_size > 0 and (out / "quickstart.html").stat().st_size > 0


def test_snapshot_marks_are_dense_at_the_start_when_asked():
    vs_trl = bench_module("vs_trl")
    marks_for, parse_args = vs_trl.marks_for, vs_trl.parse_args
    assert marks_for(20, 5) == [5.0, 10.0, 15.0, 20.0]
    assert marks_for(12, 5) == [5.0, 10.0, 12.0]  # the end of training is always a mark
    assert marks_for(20, 5, 3, 1) == [1.0, 2.0, 3.0, 5.0, 10.0, 15.0, 20.0]
    assert marks_for(4, 5, 30, 1.5) == [1.5, 3.0, 4.0]  # the fine span is cut at the run's end
    args = parse_args(["--eval-fine", "30:1"])
    assert (args.fine_until, args.fine_every) == (30.0, 1.0)
    for bad in ("30", "a:b", "10:0"):
        with pytest.raises(SystemExit):
            parse_args(["--eval-fine", bad])
