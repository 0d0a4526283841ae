"""`DropLedger`: every drop on the data path as a value (`astratk.records.Drop`), kept beside the
flat counters.

Each part of the data layer counts its drops here with their stage, reason, unit and policy, so
readers (the run's metrics, dashboards, the model checker) get records instead of parsing counter
names.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from astratk.records import Drop


class DropLedger:
    """Example:

    >>> ledger = DropLedger()
    >>> ledger.add("serving", "stale", "groups", "main", 2)
    >>> ledger.records()
    [Drop(stage='serving', reason='stale', unit='groups', policy='main', count=2.0)]
    """

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str, str, str]] = Counter()

    def add(self, stage: str, reason: str, unit: str, policy: str = "", n: float = 1) -> None:
        self._counts[(stage, reason, unit, policy)] += n

    def records(self) -> list[Drop]:
        return [Drop(*key, count=float(n))  # type: ignore[arg-type]
                for key, n in self._counts.items()]

    def state_dict(self) -> list[tuple[Any, ...]]:
        return [(*key, n) for key, n in self._counts.items()]

    def load_state_dict(self, state: list[tuple[Any, ...]]) -> None:
        self._counts = Counter({tuple(row[:4]): row[4] for row in state})
