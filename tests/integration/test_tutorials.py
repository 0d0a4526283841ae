"""Every tutorial runs top to bottom, as a script, in its short mode (`ASTRATK_TUTORIAL_SHORT=1`: a smoke budget,
`astratk.quick.smoke`), with outputs and tiny models under a temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = sorted(p.name for p in (ROOT / "tutorials").glob("[0-9][0-9]_*.py"))


def test_there_are_six_tutorials():
    assert len(TUTORIALS) == 6, TUTORIALS


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("tutorials")


@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_runs_top_to_bottom(name, shared):
    env = {**os.environ, "ASTRATK_TUTORIAL_SHORT": "1", "ASTRATK_TUTORIAL_OUTPUT": str(shared / "runs"),
           "ASTRATK_CACHE": str(shared / "cache"), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, "tutorials/run.py", name], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"tutorials/{name} failed:\n{out[-4000:]}"
    assert "tutorial done" in proc.stdout, out[-2000:]
