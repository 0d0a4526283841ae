"""SQLite for the db env: databases built from a spec (schema + rows) and cached by content, and read-only queries
rendered for an agent (writes refused by an authorizer, a time limit, a row limit).

Extend the read-only rule in `_read_only` (the SQLite authorizer): anything it does not allow is denied.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astratk.envs.agentbench.household import cache_root

# -------------------------------------------------------------------------------------------------- databases


def build_database(conn: sqlite3.Connection, spec: Mapping[str, Any]) -> None:
    """Create the spec's tables and insert its rows (ATTACH refused: a spec writes only its own database)."""
    no_attach = (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH)
    conn.set_authorizer(lambda action, *_: sqlite3.SQLITE_DENY if action in no_attach else sqlite3.SQLITE_OK)
    conn.executescript(spec["schema_sql"])
    for table, rows in spec.get("rows", {}).items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", table):
            raise ValueError(f"table name {table!r} is not a plain identifier")
        if rows:
            conn.executemany(f'INSERT INTO "{table}" VALUES ({", ".join("?" * len(rows[0]))})', rows)
    conn.commit()
    conn.set_authorizer(None)


def materialise(spec: Mapping[str, Any], cache_dir: str | os.PathLike | None = None) -> Path:
    """The SQLite file for a spec, written once per content key (temporary file, then an atomic rename)."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    final = cache_root(cache_dir) / "sqlite" / f"db-{key}.sqlite"
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp)
        try:
            build_database(conn, spec)
        finally:
            conn.close()
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


def schema_text(conn: sqlite3.Connection) -> str:
    return "\n".join(r[0] + ";" for r in conn.execute(
        "SELECT sql FROM sqlite_master WHERE type IN ('table', 'view') AND sql IS NOT NULL AND name NOT LIKE "
        "'sqlite_%' ORDER BY rowid"))


# ----------------------------------------------------------------------------------------------- read-only SQL

_READ_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                 getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
_READ_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                 "foreign_key_list"}


def _read_only(action: int, arg1: str | None, *_: Any) -> int:
    if action in _READ_ACTIONS or (action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in _READ_PRAGMAS):
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


@dataclass(frozen=True)
class QueryResult:
    text: str  # what the agent sees
    error: bool = False
    timed_out: bool = False
    truncated: bool = False


def _cell(v: Any, max_chars: int) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bytes):
        return f"<blob of {len(v)} bytes>"
    s = str(v)
    return s if len(s) <= max_chars else s[:max_chars] + "..."


def run_query(db_file: str | os.PathLike, sql: str, *, max_rows: int = 20, time_limit_s: float = 1.0,
              max_cell_chars: int = 100) -> QueryResult:
    """Run one statement read-only and render the result (or the error) for the agent."""
    conn = sqlite3.connect(f"{Path(db_file).resolve().as_uri()}?mode=ro", uri=True)
    stopped = []
    deadline = time.monotonic() + time_limit_s

    def past_deadline() -> int:  # called every 1000 VM instructions; nonzero interrupts the statement
        if time.monotonic() > deadline:
            stopped.append(True)
            return 1
        return 0

    try:
        conn.set_authorizer(_read_only)
        if hasattr(conn, "setlimit"):  # Python >= 3.11: no multi-megabyte strings (randomblob(1e9), printf tricks)
            conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1_000_000)
        conn.set_progress_handler(past_deadline, 1000)
        cur = conn.execute(sql)
        rows = cur.fetchmany(max_rows + 1)
        columns = [d[0] for d in cur.description or ()]
    except (sqlite3.Error, sqlite3.Warning) as e:
        if stopped:
            return QueryResult(f"Error: the query ran longer than {time_limit_s:g} s and was stopped.", True, True)
        hint = " (the database is read-only: only SELECT queries run)" if "authoriz" in str(e) else ""
        return QueryResult(f"Error: {e}{hint}", error=True)
    finally:
        conn.close()
    if not columns:
        return QueryResult("The statement returned no result.")
    truncated = len(rows) > max_rows
    lines = [" | ".join(columns)] + [" | ".join(_cell(v, max_cell_chars) for v in r) for r in rows[:max_rows]]
    if not rows:
        lines.append("(0 rows)")
    if truncated:
        lines.append(f"(first {max_rows} rows shown; there are more: aggregate or add LIMIT)")
    return QueryResult("\n".join(lines), truncated=truncated)
