"""Run a tutorial as a script the way a notebook kernel runs it: `python tutorials/run.py 01_quickstart`.

Why not `python tutorials/01_quickstart.py`: Dask starts worker processes with multiprocessing's "spawn", which
re-imports the parent's main script in every child, so a script whose top level starts a cluster would start one in
each worker (Dask then reports "Nanny failed to start"). Notebooks have no main file, and neither has the code this
runner executes. The tutorials are percent-format scripts (`# %%` cells): Jupyter with jupytext and VS Code open
them as notebooks. `ASTRATK_TUTORIAL_SHORT=1` runs one at a smoke budget (how the test suite executes them).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    here = Path(__file__).resolve().parent
    names = sorted(p.stem for p in here.glob("[0-9][0-9]_*.py"))
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(f"usage: python tutorials/run.py NAME   (one of: {', '.join(names)})")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    matches = [n for n in names if n == argv[0].removesuffix(".py") or n.startswith(argv[0])]
    if len(matches) != 1:
        print(f"tutorials/run.py: {argv[0]!r} matches {matches or 'nothing'}; choose one of {names}",
              file=sys.stderr)
        return 2
    path = here / f"{matches[0]}.py"
    code = compile(path.read_text(), str(path), "exec")
    exec(code, {"__name__": "__tutorial__", "__builtins__": __builtins__})  # noqa: S102 - our own tutorial file
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
