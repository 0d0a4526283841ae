"""`bench/gpu_suite.py --smoke`: the GPU suite's code, run on the CPU with tiny sizes, so that it cannot rot between
the runs on a GPU. Every row is in the JSON with its status and headline figures, and in the markdown table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_smoke_run_reports_every_row(tmp_path):
    sys.path.append(str(ROOT))
    from bench.gpu_suite import ROW_IDS
    from bench.gpu_suite_rows import HEADLINE, TITLES

    out = tmp_path / "suite.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--smoke", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["mode"] == "smoke" and payload["machine"]["device"] == "cpu"
    rows = {r["id"]: r for r in payload["rows"]}
    assert list(rows) == list(ROW_IDS)
    # the CPU cannot run Lightning's FSDP; everything else runs here, LoRA where this build has it
    expected_skips = {"e2e_fsdp"}
    import astratk.spec

    if not hasattr(astratk.spec, "LoraSpec"):
        expected_skips.add("publish_lora")
    for row_id, row in rows.items():
        if row_id == "hub_engine" and row["status"].startswith("skipped: "):  # no Hub here: said, and skipped
            assert "Qwen/Qwen2.5-0.5B-Instruct" in row["status"], row
            continue
        if row_id in expected_skips:
            assert row["status"].startswith("skipped: "), row
            continue
        assert row["status"] == "measured", row
        missing = [k for k in HEADLINE[row_id] if k not in row["figures"]]
        assert not missing, (row_id, missing)
    assert rows["engine_vs_generate"]["figures"]["engine_tokens_per_s"] > 0
    assert rows["publish_sparse_delta"]["figures"]["pulled"] == "delta"
    assert rows["e2e_async"]["figures"]["steps"] == rows["e2e_sync"]["figures"]["steps"] == 2
    assert rows["real_engine"]["figures"]["engine_tokens_per_s"] > 0 and rows["real_e2e"]["figures"]["steps"] == 2
    assert rows["real_trainer_step"]["figures"]["lora_step_s"] > 0
    # the step rows time Lightning steps without writing checkpoints (1.6 GB for SmolLM2 into the working directory)
    assert not (tmp_path / "checkpoints").exists()
    table = out.with_suffix(".md").read_text()
    assert "CPU smoke" in table and all(f"| {TITLES[r]} |" in table for r in ROW_IDS)
