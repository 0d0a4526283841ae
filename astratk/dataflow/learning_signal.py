"""Learning signal: how many groups carry one, and what to change when too few do.

Group-relative RL learns only from groups whose rewards differ: a task the policy always fails (or always solves)
gives a group of equal rewards, which the zero-variance filter drops. A model that solves a task with probability p
gives a group of G samples with signal with probability 1 - p^G - (1 - p)^G, so a weak model on a hard task (p ~ 1%,
G = 8: 8%) leaves its trainer waiting while almost everything is dropped. `SignalReading` is what a window of a run
(or a probe) saw: groups, drops by reason, mean reward, truncation, greedy accuracy; `advice` turns it into the
changes that would help, in words, naming the config keys and their current values; `describe` is the one line a
run prints while it starves and `astratk probe` prints after sampling.

Example:
    >>> r = SignalReading(groups=105, admitted=7, dropped={"zero_variance": 98}, samples=840, reward_mean=0.011,
    ...                   unfinished=0.62, greedy_accuracy=0.094)
    >>> print(describe(r, group_size=8, temperature=1.0, max_new_tokens=16))  # doctest: +NORMALIZE_WHITESPACE
    105 groups rolled out, 7 with signal (7%), 98 dropped (zero_variance 98); mean reward 0.011 sampled vs 0.094
    greedy (held-out); 62% of samples hit max_new_tokens. To get signal: lower rollout.temperature (now 1: greedy
    decoding scores 8.5x the sampled reward); raise rollout.max_new_tokens (now 16: 62% of samples stop there); larger
    rollout.group_size (now 8: a task solved 1.1% of the time gives a group with signal 8% of the time; 32 would give
    30%); an easier task or a curriculum (dataflow.curators: [curriculum]), or a supervised warm start
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SignalReading:
    """What a window of a run or a probe saw, for one policy."""

    groups: int  # groups rolled out (received by the data layer)
    admitted: int  # groups that passed every filter (carry signal)
    dropped: dict[str, float] = field(default_factory=dict)  # groups dropped, by reason
    samples: int = 0  # scored samples
    reward_mean: float | None = None  # mean reward of the scored samples
    unfinished: float | None = None  # share of samples that hit max_new_tokens
    greedy_accuracy: float | None = None  # held-out accuracy at greedy decoding, where known

    @property
    def signal_share(self) -> float:
        return self.admitted / self.groups if self.groups else 0.0


def group_signal_probability(p: float, group_size: int) -> float:
    """Chance that a group of `group_size` samples of a task solved with probability `p` has unequal 0/1 rewards."""
    p = min(1.0, max(0.0, p))
    return max(0.0, 1.0 - p ** group_size - (1.0 - p) ** group_size)


def advice(r: SignalReading, *, group_size: int, temperature: float, max_new_tokens: int,
           max_staleness: int | None = None) -> list[str]:
    """What to change, most likely to help first, each naming its config key and current value."""
    out: list[str] = []
    drops = dict(sorted(r.dropped.items(), key=lambda kv: -kv[1]))
    main = next(iter(drops), None)
    mean = r.reward_mean
    if main == "stale":
        out.append(f"raise dataflow.max_staleness (now {max_staleness}) or train faster than rollouts arrive "
                   "(trainer.groups_per_step, fewer rollout.max_inflight_chunks)")
    elif main in ("too_long", "too_short", "unfinished", "bad_format"):
        what = "length_filter" if main != "bad_format" else "format_filter"
        out.append(f"the {what} in dataflow.filters drops most groups ({main}): relax or remove it")
    elif main == "failed":
        out.append("rollouts fail every attempt: read the rollout workers' log for the error")
    if mean is not None and mean >= 0.9 and main == "zero_variance":
        out.append(f"harder tasks, or dataflow.curators: [filter_solved] (mean reward {mean:.2f}: most groups are "
                   "all solved)")
        return out
    if main not in (None, "zero_variance"):
        return out
    if (r.greedy_accuracy is not None and mean is not None and temperature > 0.3
            and r.greedy_accuracy > max(2.0 * mean, mean + 0.05)):
        ratio = f"{r.greedy_accuracy / mean:.1f}x" if mean > 0 else "more than"
        out.append(f"lower rollout.temperature (now {temperature:g}: greedy decoding scores {ratio} the sampled "
                   "reward)")
    if r.unfinished is not None and r.unfinished >= 0.2:
        out.append(f"raise rollout.max_new_tokens (now {max_new_tokens}: {r.unfinished:.0%} of samples stop there)")
    if mean is not None and mean < 0.5:
        now = group_signal_probability(mean, group_size)
        bigger = max(32, 4 * group_size)
        out.append(f"larger rollout.group_size (now {group_size}: a task solved {mean:.1%} of the time gives a group "
                   f"with signal {now:.0%} of the time; {bigger} would give {group_signal_probability(mean, bigger):.0%})")
        out.append("an easier task or a curriculum (dataflow.curators: [curriculum]), or a supervised warm start")
    return out


def describe(r: SignalReading, *, group_size: int, temperature: float, max_new_tokens: int,
             max_staleness: int | None = None) -> str:
    """One line: the counts, the mean reward (and greedy accuracy where known), truncation, and `advice`."""
    drops = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.dropped.items(), key=lambda kv: -kv[1]))
    dropped = sum(r.dropped.values())
    parts = [f"{r.groups} groups rolled out, {r.admitted} with signal ({r.signal_share:.0%}), {dropped:.0f} dropped"
             + (f" ({drops})" if drops else "")]
    if r.reward_mean is not None:
        greedy = f" sampled vs {r.greedy_accuracy:.3f} greedy (held-out)" if r.greedy_accuracy is not None else ""
        parts.append(f"mean reward {r.reward_mean:.3f}{greedy}")
    if r.unfinished is not None and r.unfinished > 0:
        parts.append(f"{r.unfinished:.0%} of samples hit max_new_tokens")
    line = "; ".join(parts) + "."
    todo = advice(r, group_size=group_size, temperature=temperature, max_new_tokens=max_new_tokens,
                  max_staleness=max_staleness)
    return line + (" To get signal: " + "; ".join(todo) if todo else "")
