"""The simulated-user env's tasks: the built-in customer-service requests (`KINDS`: four kinds, each drawing its goal
value from a seeded RNG), a user's own rows checked column by column (`check_row`, `read_rows`: an error names the row
or the file's line), what makes two tasks the same (`row_key`) and how a submitted value is read and compared
(`submitted_value`, `normalize_value`). `astratk.envs.simulated_user` runs the episodes.

Example:
    >>> import random
    >>> row = generated_row(random.Random(0), ["refund"])
    >>> normalize_value(row["goal"]) == normalize_value(row["goal"] + ".")
    True
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import string
from collections.abc import Mapping, Sequence
from typing import Any

from astratk.envs.dataset import load_rows
from astratk.envs.jsonl import records
from astratk.envs.multiturn import parse_tags

REQUIRED = ("instructions", "goal")
OPTIONAL = ("opening", "target", "answer")

# ------------------------------------------------------------------------------------------------ built-in tasks

NAMES = ("Ana", "Ben", "Chloe", "Daniel", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Keiko", "Liam", "Maya",
         "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe")
ITEMS = ("lamp", "backpack", "coffee grinder", "pair of boots", "desk chair", "phone case", "blender", "rain jacket",
         "bookshelf", "headset", "kettle", "yoga mat")
CITIES = ("Lisbon", "Porto", "Madrid", "Valencia", "Lyon", "Marseille", "Turin", "Naples", "Munich", "Hamburg",
          "Leipzig", "Vienna", "Graz", "Zurich", "Geneva", "Ghent", "Utrecht", "Aarhus", "Bergen", "Uppsala",
          "Tampere", "Krakow", "Brno", "Ljubljana", "Zagreb", "Cork", "Leeds", "Glasgow", "Seville", "Bologna")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")


@dataclasses.dataclass(frozen=True)
class Kind:
    """One built-in request: what the agent must find out, how the goal is drawn, and the user's side of it."""

    target: str
    instructions: str  # with {name}, {item}, {goal}
    openings: tuple[str, ...]  # with {item}
    answer: str  # with {goal}


def _order_number(rng: random.Random) -> str:
    return f"#W{rng.randrange(10 ** 6, 10 ** 7)}"


def _city(rng: random.Random) -> str:
    return rng.choice(CITIES)


def _date(rng: random.Random) -> str:
    return f"{rng.choice(MONTHS)} {rng.randint(1, 28)}"


def _card_digits(rng: random.Random) -> str:
    return f"{rng.randrange(10 ** 4):04d}"


KINDS: dict[str, Kind] = {
    "order_status": Kind(
        "the order number",
        "Your name is {name}. You ordered a {item} two weeks ago and it has not arrived; you want the shop to check "
        "on it. Your order number is {goal}: give it when the agent asks for it.",
        ("Hi, my {item} still hasn't arrived. Can you check on it?", "Hello, I ordered a {item} and it never came.",
         "Hey, where is my {item}? It should be here by now."),
        "My order number is {goal}."),
    "change_city": Kind(
        "the city the order should be sent to",
        "Your name is {name}. You are moving and want the {item} you ordered sent to {goal} instead of your old "
        "address. Say the city when the agent asks where to send it.",
        ("Hi, I need to change where my {item} is being sent.",
         "Hello, can I update the delivery address of my {item} order?",
         "Hey, I'm moving soon. Can my {item} go to my new place?"),
        "Please send it to {goal}."),
    "reschedule": Kind(
        "the new delivery date",
        "Your name is {name}. You will be away when your {item} is due, so you want it delivered on {goal} instead. "
        "Give that date when the agent asks which day suits you.",
        ("Hi, I won't be home when my {item} arrives. Can we move the delivery?",
         "Hello, I'd like to reschedule the delivery of my {item}.",
         "Hey, the delivery day for my {item} doesn't work for me."),
        "Could it come on {goal}?"),
    "refund": Kind(
        "the last four digits of the card to refund",
        "Your name is {name}. Your {item} arrived broken and you want your money back on the card ending in {goal}. "
        "Give those four digits when the agent asks which card to refund.",
        ("Hi, my {item} arrived broken and I want a refund.",
         "Hello, the {item} I got is damaged. I'd like my money back.",
         "Hey, I need a refund for a broken {item}."),
        "The card ends in {goal}."),
}
GOALS = {"order_status": _order_number, "change_city": _city, "reschedule": _date, "refund": _card_digits}


def generated_row(rng: random.Random, kinds: Sequence[str]) -> dict[str, str]:
    """One built-in task as a row (the columns a user's rows have, plus `kind`), drawn from `rng`."""
    kind = rng.choice(list(kinds))
    spec = KINDS[kind]
    name, item, goal = rng.choice(NAMES), rng.choice(ITEMS), GOALS[kind](rng)
    return {"kind": kind, "instructions": spec.instructions.format(name=name, item=item, goal=goal), "goal": goal,
            "opening": rng.choice(spec.openings).format(item=item), "target": spec.target,
            "answer": spec.answer.format(goal=goal)}


# ------------------------------------------------------------------------------------------------------ answers

_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_value(text: str) -> str:
    """What two values must share to match: lower case, no ASCII punctuation, single spaces ("#W12 " == "w12")."""
    return " ".join(text.lower().translate(_PUNCTUATION).split())


def submitted_value(text: str) -> str | None:
    """The first non-empty `<submit>` value in an agent message; None when it submits nothing."""
    return next((content for _, content in parse_tags(text, ("submit",)) if content), None)


# --------------------------------------------------------------------------------------------------------- rows


def _where(source: str, index: int, line: int | None) -> str:
    return f"{source}:{line}" if line is not None else f"{source} row {index}"


def check_row(row: Any, where: str) -> dict[str, Any]:
    """A user's row validated and normalised (goal as a string, optional columns None when absent); a ValueError
    names the row (or file line) and the column otherwise."""
    if not isinstance(row, Mapping):
        raise ValueError(  # noqa: TRY004 - a malformed row is a ValueError naming it
            f"{where}: expected a dict with the columns {list(REQUIRED)}, got {type(row).__name__}")
    missing = [c for c in REQUIRED if c not in row]
    if missing:
        raise ValueError(f"{where}: no {missing[0]!r} column (columns: {sorted(row)}); every row needs "
                         f"'instructions' (the user's hidden instructions) and 'goal' (the value the agent submits)")
    if not isinstance(row["instructions"], str) or not row["instructions"].strip():
        raise ValueError(f"{where}: 'instructions' must be a non-empty string: the user's hidden instructions")
    goal = row["goal"]
    if isinstance(goal, bool) or not isinstance(goal, str | int | float):
        raise ValueError(  # noqa: TRY004 - a malformed row is a ValueError naming it
            f"{where}: 'goal' must be a string or a number, got {type(goal).__name__}")
    goal = str(goal).strip()
    if not normalize_value(goal):
        raise ValueError(f"{where}: 'goal' is empty (or only punctuation); give the value the agent must find out "
                         "from the user and submit")
    out: dict[str, str | None] = {"instructions": row["instructions"].strip(), "goal": goal}
    for column in OPTIONAL:
        value = row.get(column)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{where}: {column!r} must be a non-empty string when given, got {value!r}")
        out[column] = value.strip() if value is not None else None
    out["id"] = str(row["id"]) if row.get("id") is not None else None
    return out


def read_rows(rows: Any, what: str) -> list[dict[str, Any]]:
    """Validated rows from a list of dicts, a `datasets.Dataset` or a data file (a JSONL error names its line)."""
    if isinstance(rows, str | os.PathLike):
        path = os.fspath(rows)
        if path.lower().endswith(".jsonl"):
            return [check_row(row, _where(path, i, line)) for i, (line, row) in enumerate(records(path))]
        rows, what = load_rows(path, what), path
    elif hasattr(rows, "to_list") and hasattr(rows, "column_names"):
        rows = rows.to_list()
    elif isinstance(rows, Mapping) or not isinstance(rows, Sequence):
        raise ValueError(f"{what}: expected a list of dicts or a data file path, got {type(rows).__name__}")
    return [check_row(row, _where(what, i, None)) for i, row in enumerate(rows)]


def row_key(row: Mapping[str, Any]) -> str:
    """What makes two tasks the same: the user's instructions and the goal (held-out tasks never appear in train)."""
    return hashlib.sha256(f"{row['instructions']}\x00{normalize_value(row['goal'])}".encode()).hexdigest()
