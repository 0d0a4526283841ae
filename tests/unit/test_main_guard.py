"""A run started at a script's module level (no `if __name__ == "__main__":`) is stopped in one line with the fix,
before any worker process starts (`astratk.runtime.main_guard`); guarded scripts, functions called from the guard,
`python -c` and notebooks are left alone. The wiring into a real run: tests/integration/test_front_door.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from astratk.runtime.main_guard import _guarded

CHECK = "from astratk.runtime.main_guard import check_main_guard\n"


def _script(tmp_path, body: str) -> subprocess.CompletedProcess:
    path = tmp_path / "train.py"
    path.write_text(CHECK + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          check=False)


def test_module_level_call_is_stopped_with_the_fix(tmp_path):
    proc = _script(tmp_path, """
        import os
        x = 1
        check_main_guard()
        print("not reached")
        """)
    assert proc.returncode != 0 and "not reached" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert "MainGuardError" in last and f"{tmp_path / 'train.py'} (line 5)" in last, last
    assert 'if __name__ == "__main__":' in last and "cluster.processes: false" in last


@pytest.mark.parametrize("body", [
    """
    if __name__ == "__main__":
        check_main_guard()
        print("ok")
    """,
    """
    def main():
        check_main_guard()
        print("ok")

    if "__main__" == __name__:
        main()
    """,
    """
    import sys
    if __name__ == "__main__":
        if len(sys.argv) > 0:
            for _ in range(1):
                check_main_guard()
        print("ok")
    """,
], ids=["guard", "main-function-reversed-test", "nested-in-guard"])
def test_guarded_scripts_pass(tmp_path, body):
    proc = _script(tmp_path, body)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_a_function_called_at_module_level_is_still_module_level(tmp_path):
    proc = _script(tmp_path, """
        def main():
            check_main_guard()

        main()
        """)
    assert proc.returncode != 0 and "(line 6)" in proc.stderr.strip().splitlines()[-1]


def test_python_dash_c_passes_and_an_import_counts_where_it_is_imported(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CHECK + "check_main_guard(); print('ok')"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]
    # a module that starts a run as it is imported: a worker re-importing main.py would import it again
    (tmp_path / "lib.py").write_text(CHECK + "check_main_guard()\n")
    (tmp_path / "main.py").write_text("import lib\nprint('ok')\n")
    proc = subprocess.run([sys.executable, "main.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          check=False)
    assert proc.returncode != 0 and "main.py (line 1)" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    (tmp_path / "main.py").write_text("if __name__ == '__main__':\n    import lib\n    print('ok')\n")
    proc = subprocess.run([sys.executable, "main.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          check=False)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_guard_detection_reads_the_source(tmp_path):
    path = tmp_path / "s.py"
    path.write_text('a = 1\nif __name__ == "__main__":\n    b = 2\n    c = 3\nd = 4\nif __name__ != "__main__":\n'
                    "    e = 5\n")
    assert [_guarded(str(path), n) for n in (1, 3, 4, 5, 7)] == [False, True, True, False, False]
    assert _guarded(str(tmp_path / "missing.py"), 1)  # unreadable: no false alarm
    (tmp_path / "bad.py").write_text("def (:\n")
    assert _guarded(str(tmp_path / "bad.py"), 1)


@pytest.mark.slow  # imports the whole run path in a subprocess: seconds
def test_a_run_started_at_module_level_stops_in_one_line_before_any_worker(tmp_path):
    """The wiring: `Run(...).start()` (blocking or in the background) at a script's module level is refused before
    the model is built or a worker spawned; with `cluster.processes: false` nothing is spawned, and it is allowed."""
    body = f"""
    from astratk import Run, RunSpec
    run = Run(RunSpec(name="guard", output_dir={str(tmp_path / 'runs')!r}))
    run.start(block=False)
    """
    proc = _script(tmp_path, body)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "run 'guard' is started at module level" in last and "(line 5)" in last, last
    assert "Nanny" not in proc.stderr and not (tmp_path / "runs").exists()
    assert len(proc.stderr.strip().splitlines()) < 15  # one short traceback, not pages
