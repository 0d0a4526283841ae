"""Is this run being started by a script's module-level code, outside `if __name__ == "__main__":`?

A local cluster's workers are new Python processes started the way `multiprocessing` starts them on every platform
Dask supports (spawn): each re-imports the script that started the run, as `__mp_main__`. A script that starts the
run at module level starts it again in every worker, which Python stops ("An attempt has been made to start a new
process before the current process has finished its bootstrapping phase") and Dask reports as pages of "Nanny failed
to start" tracebacks, once per worker. `check_main_guard` sees it before any worker starts: the script's module-level
frame is on the stack, and its line is not inside an `if __name__ == "__main__":` block. A notebook, `python -c`,
the `astratk` command and a call from a function the guard calls are all fine.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import FrameType

from astratk.spec import StartError


class MainGuardError(StartError):
    """A run started at a script's module level, where worker processes would start it again."""


def unguarded_caller(frame: FrameType | None = None) -> tuple[str, int] | None:
    """(script, line) when the main script's module-level code, outside its `__main__` guard, is on the stack."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:  # a notebook, `python -c`, an interactive shell: nothing for a worker to re-run
        return None
    path = str(Path(path).resolve())
    frame = frame if frame is not None else sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and frame.f_globals.get("__name__") in ("__main__", "__mp_main__"):
            try:
                same = str(Path(code.co_filename).resolve()) == path
            except OSError:
                same = False
            if same:
                return None if _guarded(path, frame.f_lineno) else (path, frame.f_lineno)
        frame = frame.f_back
    return None


def _guarded(path: str, line: int) -> bool:
    """Is `line` of `path` inside an `if __name__ == "__main__":` block (either operand order)? Unreadable or
    unparsable source counts as guarded: no false alarm."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            first, last = node.body[0].lineno, max(getattr(n, "end_lineno", n.lineno) or n.lineno for n in node.body)
            if first <= line <= last:
                return True
    return False


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def check_main_guard(what: str = "this run") -> None:
    """Raise MainGuardError (one line, with the fix) when worker processes would re-run the caller's script."""
    found = unguarded_caller(sys._getframe(1))
    if found is None:
        return
    path, line = found
    raise MainGuardError(
        f"{what} is started at module level of {path} (line {line}), outside `if __name__ == \"__main__\":`; its "
        "local cluster's worker processes re-run the script as they start and die. Put the run's code under "
        "`if __name__ == \"__main__\":` (or in a main() called there), or set cluster.processes: false")
