"""Every tutorial runs top to bottom as a real notebook: jupytext turns the percent-format script into a notebook and
nbclient executes it on a Jupyter kernel started in `tutorials/`, as Jupyter does when a user opens it there. Short
mode (`ASTRATK_TUTORIAL_SHORT=1`: a smoke budget, `astratk.quick.smoke`) keeps each to a minute or two, with outputs
under a temporary directory. `tutorials/run.py` (the script way) runs one from the repository root. The tutorials on
the real model (SmolLM2) run from tests/integration/test_tutorials_real.py: a file of their own, so that the suite's
two test processes share the notebooks' minutes (pytest-xdist hands out whole files)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = sorted(p.name for p in (ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
REAL_MODEL = [n for n in TUTORIALS if "smollm2" in (ROOT / "tutorials" / n).read_text().lower()]


def test_there_are_ten_tutorials():
    assert len(TUTORIALS) == 10, TUTORIALS
    assert REAL_MODEL == ["09_real_model.py", "10_tool_agent.py"], REAL_MODEL


@pytest.fixture(scope="module")
def short_env(tmp_path_factory):
    return short_environment(tmp_path_factory)


def short_environment(tmp_path_factory) -> dict[str, str]:
    shared = tmp_path_factory.mktemp("tutorials")
    # the models come from the suite's own cache ($ASTRATK_CACHE: CI starts it empty), as the real-model tests' do:
    # SmolLM2 is dequantized once per suite, not once more here
    return {"ASTRATK_TUTORIAL_SHORT": "1", "ASTRATK_TUTORIAL_OUTPUT": str(shared / "runs"), "OMP_NUM_THREADS": "1",
            "MPLBACKEND": "Agg"}


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") == "error":
            parts.append("\n".join(out.get("traceback", [])))
    return "".join(parts)


@pytest.mark.parametrize("name", [n for n in TUTORIALS if n not in REAL_MODEL])
def test_tutorial_runs_as_a_notebook_from_its_folder(name, short_env, monkeypatch):
    run_notebook(name, short_env, monkeypatch)


def run_notebook(name: str, short_env: dict[str, str], monkeypatch) -> None:
    """Tutorial `name` through a Jupyter kernel started in tutorials/, in short mode; it must print its last line."""
    jupytext = pytest.importorskip("jupytext")
    nbclient = pytest.importorskip("nbclient")
    for key, value in short_env.items():  # the kernel inherits this process's environment
        monkeypatch.setenv(key, value)
    nb = jupytext.read(ROOT / "tutorials" / name)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "tutorials")}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"tutorials/{name} failed in its notebook:\n{str(e)[-4000:]}")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "tutorial done" in "".join(_text(c) for c in code)
    if name.startswith("01"):  # the live view updated in place to the finished run, with the run's log in it
        views = [out for c in code for out in c.get("outputs", []) if out.get("output_type") == "display_data"
                 and "astratk run" in out.get("data", {}).get("text/html", "")]
        assert views, "the run's live view was not displayed"
        final = views[0]["data"]["text/html"]
        assert "<i>finished</i>" in final and "held-out accuracy" in final, final[-2000:]
        # the quickstart ends on its dashboard, displayed
        kinds = {k for out in code[-1].get("outputs", []) if out.get("output_type") in ("execute_result",
                                                                                       "display_data")
                 for k in out.get("data", {})}
        assert kinds & {"text/html", "application/vnd.holoviews_exec.v0+json"}, kinds


def test_run_py_runs_a_tutorial_as_a_script(short_env):
    env = {**os.environ, **short_env}
    # the shortest tutorial (06: ~26 s as a notebook, 01 ~42 s): the notebooks run each one; this checks the script path
    proc = subprocess.run([sys.executable, "tutorials/run.py", "06"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"tutorials/run.py 06 failed:\n{out[-4000:]}"
    assert "tutorial done" in proc.stdout, out[-2000:]
