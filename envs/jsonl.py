"""JSON Lines reading shared by the envs' file loaders (math, code, search, db): every defect raises a ValueError
naming the file and its 1-based line, so a user can fix the file.

Read as bytes and decoded line by line: a text-mode reader decodes ahead in blocks, so a bad byte would be reported on
the wrong line. A UTF-8 byte-order mark on line 1 is accepted; blank lines are skipped. Paths may be fsspec URLs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import fsspec


def records(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; a line that is not UTF-8, not JSON or not a JSON object
    raises ValueError("<path>:<line>: <what is wrong>")."""
    path = os.fspath(path)
    with fsspec.open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(  # noqa: TRY004 - a malformed file is a ValueError naming file and line
                    f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj
