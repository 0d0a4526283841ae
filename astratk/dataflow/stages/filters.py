"""Group filters: after rollout and advantages, decide which groups join the buffer (the second stage point).

- `zero_variance` drops a group whose rewards are all equal, or that has one sample (no learning signal: "dynamic
  sampling"); reason `zero_variance`.
- `length_filter` drops a group when more than `max_fraction` of its completions are too long, too short, or
  (opt-in) unfinished; reasons `too_long`, `too_short`, `unfinished`.
- `format_filter` drops a group when more than `max_fraction` of its completion texts do not match `pattern`;
  reason `bad_format`.

`DataflowSpec.filter_zero_variance: true` (the default) is sugar for a `zero_variance` filter first in the list.
"""

from __future__ import annotations

import re

from astratk.dataflow.stages.base import GroupFilter
from astratk.records import Group


class ZeroVariance(GroupFilter):
    """Drop groups with no learning signal (AstraFlow's zero-advantage filter, DAPO's dynamic sampling in post-filter
    form): all rewards equal, or a single sample.

    >>> from astratk.records import Task, Trajectory
    >>> t = lambda r: Trajectory("t", "g", "main", "policy", (1, 2), 1, (1,), (-1.0,), (0,), reward=r)
    >>> f = ZeroVariance()
    >>> f.check(Group("g", Task("t", "e", "p"), "main", (t(1.0), t(1.0)))), f.check(Group("g", Task("t", "e", "p"),
    ...     "main", (t(1.0), t(0.0))))
    ('zero_variance', None)
    """

    name = "zero_variance"

    def check(self, group: Group) -> str | None:
        rewards = group.rewards
        return "zero_variance" if len(set(rewards)) <= 1 else None


def _too_many(bad: int, total: int, max_fraction: float) -> bool:
    return total > 0 and bad > max_fraction * total


class LengthFilter(GroupFilter):
    """Drop groups whose completions are out of a length range: more than `max_fraction` of them (0: any one) longer
    than `max_tokens` policy-produced tokens, shorter than `min_tokens`, or, with `drop_unfinished`, cut off by the
    token budget. Checked in that order; the first failing check names the drop."""

    name = "length_filter"

    def __init__(self, max_tokens: int | None = None, min_tokens: int = 0, drop_unfinished: bool = False,
                 max_fraction: float = 0.0) -> None:
        if max_tokens is not None and max_tokens < min_tokens:
            raise ValueError(f"length_filter: max_tokens ({max_tokens}) < min_tokens ({min_tokens})")
        if not 0.0 <= max_fraction < 1.0:
            raise ValueError(f"length_filter: max_fraction must be in [0, 1), got {max_fraction}")
        self.max_tokens, self.min_tokens = max_tokens, int(min_tokens)
        self.drop_unfinished, self.max_fraction = bool(drop_unfinished), float(max_fraction)

    def check(self, group: Group) -> str | None:
        lengths = [sum(t.loss_mask) for t in group.trajectories]
        n = len(lengths)
        if self.max_tokens is not None and _too_many(sum(x > self.max_tokens for x in lengths), n, self.max_fraction):
            return "too_long"
        if _too_many(sum(x < self.min_tokens for x in lengths), n, self.max_fraction):
            return "too_short"
        if self.drop_unfinished and _too_many(sum(not t.finished for t in group.trajectories), n, self.max_fraction):
            return "unfinished"
        return None


class FormatFilter(GroupFilter):
    """Drop groups where more than `max_fraction` of the completion texts (`Trajectory.text`, as the env decoded them)
    do not contain a match of the regular expression `pattern` (e.g. `"\\\\boxed\\\\{"` for math answers).

    >>> FormatFilter(pattern=r"\\d+$").pattern
    '\\\\d+$'
    """

    name = "format_filter"

    def __init__(self, pattern: str, max_fraction: float = 0.0) -> None:
        try:
            self._regex = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"format_filter: pattern {pattern!r} is not a regular expression: {e}") from None
        if not 0.0 <= max_fraction < 1.0:
            raise ValueError(f"format_filter: max_fraction must be in [0, 1), got {max_fraction}")
        self.pattern, self.max_fraction = pattern, float(max_fraction)

    def check(self, group: Group) -> str | None:
        bad = sum(self._regex.search(t.text) is None for t in group.trajectories)
        return "bad_format" if _too_many(bad, len(group.trajectories), self.max_fraction) else None
