"""Seeded, levelled task splits shared by the synthetic math envs (arithmetic, word problems).

An env defines `_problem(rng, split, index) -> Task` (the level is `self.levels[index % len(self.levels)]`) and calls
`_init_splits`; it gets a fixed held-out list of `n_heldout` distinct prompts and an endless, deterministic train
stream that never repeats a held-out prompt.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Container, Iterator, Sequence

from astratk.contracts import split_tasks
from astratk.records import Task


class LevelledSplits:
    levels: tuple[int, ...]
    n_heldout: int
    seed: int

    def _problem(self, rng: random.Random, split: str, index: int) -> Task:
        raise NotImplementedError

    def _init_splits(self, levels: Sequence[int], known: Container[int], n_heldout: int, seed: int) -> None:
        unknown = [lv for lv in levels if lv not in known]
        if not levels or unknown:
            raise ValueError(f"levels must be a non-empty subset of {sorted(known)}; got {list(levels)}")  # type: ignore[call-overload]
        if n_heldout < 1:
            raise ValueError(f"n_heldout must be >= 1, got {n_heldout}")
        self.levels = tuple(int(lv) for lv in levels)
        self.n_heldout = n_heldout
        self.seed = seed
        self._heldout = self._draw_heldout()
        self._heldout_keys = {t.prompt for t in self._heldout}

    def _draw_heldout(self) -> list[Task]:
        rng = random.Random(f"{self.seed}/heldout")
        tasks: dict[str, Task] = {}
        for i in itertools.count():
            if len(tasks) == self.n_heldout:
                break
            if i > 100 * self.n_heldout:
                raise ValueError(f"levels {self.levels} have too few distinct problems for n_heldout="
                                 f"{self.n_heldout}")
            t = self._problem(rng, "heldout", i)
            tasks.setdefault(t.prompt, t)
        return list(tasks.values())

    def tasks(self, split: str) -> Iterator[Task]:
        return split_tasks(split, self._heldout, self._train_stream)

    def _train_stream(self) -> Iterator[Task]:
        rng = random.Random(f"{self.seed}/train")
        for i in itertools.count():
            t = self._problem(rng, "train", i)
            if t.prompt not in self._heldout_keys:
                yield t
