"""What a db-env reply says and whether its answer is right: the first action (a tag or a JSON tool call) and the
matching of an answer against the gold values (numbers with rounding, text case-insensitively, lists in or out of
order). `db.py`'s docstring states the rules; a new answer form is parsed in `split_answer`, a new action in
`first_action`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from astratk.envs.multiturn import parse_tags, parse_tool_call

SQL_TOOL = '{"name": "sql", "arguments": {"query": "SELECT ..."}}'


def format_value(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(round(v, 6)) if isinstance(v, float) else str(v)


def _number(s: str) -> float | None:
    s = s.strip().lstrip("$")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        x = float(s)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def same_value(given: str, gold: str) -> bool:
    a, g = _number(given), _number(gold)
    if a is not None and g is not None:
        if math.isclose(a, g, rel_tol=1e-9, abs_tol=1e-9):
            return True
        decimals = len(gold.strip().partition(".")[2])  # gold rounded to d decimals accepts what rounds to it
        return decimals > 0 and abs(round(a, decimals) - g) < 10 ** -(decimals + 2)
    return " ".join(given.split()).casefold() == " ".join(gold.split()).casefold()


def split_answer(text: str, is_list: bool) -> list[str]:
    text = text.strip()
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, list):
        flat = [x for v in value for x in (v if isinstance(v, list) else [v])]  # rows as lists: flatten one level
        return [format_value(v) for v in flat]
    parts = re.split(r"[\n,;]", text) if is_list else [text]
    return [p.strip().strip("\"'`").rstrip(".").strip() for p in parts if p.strip()]


def answers_match(text: str, gold: Sequence[str], *, is_list: bool, ordered: bool) -> bool:
    given = split_answer(text, is_list)
    if len(given) != len(gold):
        return False
    if ordered or not is_list:
        return all(same_value(a, g) for a, g in zip(given, gold, strict=True))
    remaining = list(gold)
    for a in given:
        j = next((j for j, g in enumerate(remaining) if same_value(a, g)), None)
        if j is None:
            return False
        remaining.pop(j)
    return True


def first_action(text: str) -> tuple[str, str] | None:
    """("sql", query) or ("answer", text) from the reply's first action tag or JSON tool call; ("invalid", what is
    wrong) for a malformed tool call; None without either."""
    tags = parse_tags(text, ["sql", "answer", "tool_call"])
    if not tags:
        return None
    kind, content = tags[0]
    if kind != "tool_call":
        return kind, content
    call = parse_tool_call(content)
    if call.error:
        return "invalid", f"{call.error}, e.g. {SQL_TOOL}"
    args = call.arguments
    if call.name != "sql" or not isinstance(args, dict) or not isinstance(args.get("query"), str):
        return "invalid", f"the one tool is sql, called as {SQL_TOOL}"
    return "sql", args["query"].strip()
