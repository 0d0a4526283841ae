"""The stage contracts: what the data layer calls at AstraFlow's three points.

Every stage is a small object whose constructor is its config (YAML `class_path` / `init_args`; keep each init argument
as an attribute of the same name, which `astratk.config.dump_spec` reads back) and which implements
`state_dict / load_state_dict / metrics`. State is plain Python data (dicts, lists, numbers, strings), plus records
(`Group`) for stages that hold samples; everything pickles.

Extending: subclass `Curator`, `GroupFilter` or one of the serving bases, and name it in a config by dotted path (or add
a short name to `astratk.registry.REGISTRY["stage"]`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from astratk.records import Group, Task


class Stage:
    """Common base: a name for metric keys, a snapshot of its state, and its metrics.

    Stateless stages keep the defaults. `name` is the metric and counter label (`data/stage/<name>/...`,
    `data/tasks_skipped_<name>`); the data layer suffixes duplicates (`format_filter_2`)."""

    name: str = "stage"

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"stage {self.name!r} keeps no state, but was given {sorted(state)}")

    def metrics(self) -> dict[str, float]:
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


# ----------------------------------------------------------------------------------------------- before rollout
class Curator(Stage):
    """Decides, before rollout, whether a task is worth rolling out; learns from each admitted outcome.

    The data layer asks every curator in order (`should_submit`) and skips the task at the first refusal (counted as
    `data/tasks_skipped_<name>`). At admission it calls `update` with the rewards of the curated role (the env's first
    role: the solver in a workflow) and `on_version` whenever that role's policy publishes a new version.
    `version` is that policy's current version (in `should_submit`) or the group's behaviour version (in `update`).
    """

    def should_submit(self, task: Task, version: int) -> bool:
        return True

    def update(self, task: Task, rewards: Sequence[float], version: int) -> None:
        return None

    def on_version(self, version: int) -> None:
        return None


# ------------------------------------------------------------------------------------------------ after rollout
class GroupFilter(Stage):
    """Decides, after advantages are fixed, whether an admitted group joins its policy's buffer.

    `check` returns None to keep the group, or a short reason (`zero_variance`, `too_long`...) to drop it; the data
    layer counts the drop as `data/<policy_id>/groups_dropped_<reason>`. Filters decide per group (the unit of
    admission), never per trajectory: removing samples after advantages are fixed would leave a biased baseline."""

    def check(self, group: Group) -> str | None:
        return None


# ---------------------------------------------------------------------------------------------------- at serving
class ServingOrder(Stage):
    """Which buffered groups are served first: `order` returns the candidates (arrival order in) in serving order."""

    def order(self, groups: Sequence[Group]) -> list[Group]:
        return list(groups)


def rng_state(rng: random.Random) -> list[Any]:
    """`random.Random` state as JSON-able lists (its native state is nested tuples)."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state: Sequence[Any]) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def success_rate(rewards: Sequence[float], threshold: float) -> float:
    """Share of samples whose reward is above `threshold` (AstraFlow's filter-solved: reward > 0 is a success)."""
    return sum(r > threshold for r in rewards) / len(rewards) if rewards else 0.0
