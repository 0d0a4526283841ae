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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# What agent and multi-turn episodes report, read from the trajectories' metrics under the names envs give them
# (the first name present counts; unparseable calls add up): AgentEnv's `calls` are its turns; the actions an env
# cannot read are search's `invalid_actions`, DB's `format_errors` and household's `no_action_turns`. An episode whose
# env reads tool calls or actions at all reports one of those counters (0 when none failed): it counts among
# `tool_episodes`, and only such episodes are told about tool calls (a solver + verifier conversation has no tools).
AGENT_METRICS: dict[str, tuple[str, ...]] = {
    "tool_episodes": ("tool_call_errors", "invalid_actions", "format_errors", "no_action_turns"),
    "tool_calls": ("tool_calls",),
    "unparsed_calls": ("tool_call_errors", "invalid_actions", "format_errors", "no_action_turns"),
    "turns": ("turns", "calls"),
    "turn_limit": ("turn_limit", "turn_limit_hit"),
    "context_limit": ("context_exhausted",),
}


def agent_counts(metrics: Mapping[str, float]) -> dict[str, float] | None:
    """One episode's agent figures (`AGENT_METRICS`), or None for an episode that is not an agent's (no tool calls
    and no turns counted)."""
    if not any(k in metrics for k in ("tool_calls", "turns", "calls")):
        return None
    out = {}
    for name, keys in AGENT_METRICS.items():
        present = [k for k in keys if k in metrics]
        if name == "unparsed_calls":  # each its own kind of miss: added
            out[name] = sum(float(metrics[k]) for k in present)
        elif name == "tool_episodes":  # the env reads tool calls or actions
            out[name] = float(bool(present))
        else:
            out[name] = float(metrics[present[0]]) if present else 0.0
    return out


@dataclass(frozen=True)
class AgentReading:
    """Agent and multi-turn episodes of a window: totals over `episodes` (`AGENT_METRICS`), and whether the model's
    prompt showed it its tools (None: not known, or an env whose tool protocol is plain text in its prompt)."""

    episodes: int
    tool_episodes: float = 0.0
    tool_calls: float = 0.0
    unparsed_calls: float = 0.0
    turns: float = 0.0
    turn_limit: float = 0.0
    context_limit: float = 0.0
    tools_shown: bool | None = None
    tool_format: str | None = None

    @classmethod
    def of(cls, per_episode: list[dict[str, float]], tools_shown: bool | None = None,
           tool_format: str | None = None) -> AgentReading | None:
        """The reading of episodes' `agent_counts` (None when there are none)."""
        if not per_episode:
            return None
        totals = {name: sum(e.get(name, 0.0) for e in per_episode) for name in AGENT_METRICS}
        return cls(len(per_episode), **totals, tools_shown=tools_shown, tool_format=tool_format)

    def per_episode(self, name: str) -> float:
        return getattr(self, name) / self.episodes if self.episodes else 0.0

    @property
    def has_tools(self) -> bool:
        """Whether the episodes' env reads tool calls or actions (`AGENT_METRICS`)."""
        return bool(self.tool_episodes or self.tool_calls or self.unparsed_calls or self.tools_shown is not None)

    def line(self) -> str:
        shown = ("" if self.tools_shown is None else
                 f"; tools in the prompt: {'yes' if self.tools_shown else 'NO'}"
                 + (f" ({self.tool_format})" if self.tool_format else ""))
        calls = (f"{self.per_episode('tool_calls'):.2f} tool calls and {self.per_episode('unparsed_calls'):.2f} "
                 "unparseable per episode, " if self.has_tools else "no tools, ")
        return (f"agent: {self.episodes} episodes, {calls}"
                f"{self.per_episode('turns'):.1f} turns per episode; {self.per_episode('turn_limit'):.0%} ended at the "
                f"turn limit, {self.per_episode('context_limit'):.0%} at the context limit{shown}")

    def advice(self, max_new_tokens: int) -> list[str]:
        """What to change for the agent's part, most likely first."""
        out = []
        if self.tools_shown is False:
            out.append("the model never saw its tools: its chat template drops them and tool_format is 'template'; "
                       "set the env's tool_format: auto (or hermes) so astratk writes them into the system message")
        if self.episodes and self.tool_calls == 0 and self.has_tools:
            tried = f" ({self.unparsed_calls:.0f} it could not parse)" if self.unparsed_calls else ""
            out.append(f"the model made no tool call in {self.episodes} episodes{tried}: name the tools and show one "
                       "call in "
                       "the system prompt (a worked example), or start from a model trained on tool use; an env "
                       "whose tasks need no tool gives the tools nothing to learn from")
        attempted = self.tool_calls + self.unparsed_calls
        if self.tool_calls and self.unparsed_calls / attempted >= 0.2:
            out.append(f"{self.unparsed_calls:.0f} of {attempted:.0f} tool calls could not be parsed: show the call "
                       f"format in the system prompt, and raise rollout.max_new_tokens (now {max_new_tokens}) if "
                       "calls are cut off before </tool_call>")
        if self.episodes and self.turn_limit / self.episodes >= 0.3:
            out.append(f"{self.turn_limit / self.episodes:.0%} of episodes ran out of turns: raise the env's "
                       "max_turns, or reward earlier answers")
        if self.episodes and self.context_limit / self.episodes >= 0.3:
            out.append(f"{self.context_limit / self.episodes:.0%} of episodes filled the context: a larger context "
                       "budget (the env's max_context, the engine's max_model_len), or shorter tool outputs")
        return out


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
    agent: AgentReading | None = None  # tool calls, turns and endings of agent and multi-turn episodes
    env_advice: tuple[str, ...] = ()  # what the env reads in its own trajectory metrics (`Env.signal_advice`)

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
    out.extend(r.env_advice)  # the env knows its own failure modes (a judge that says no to everything) best
    if r.agent is not None:  # an agent that never calls its tools is the first thing to fix
        out.extend(r.agent.advice(max_new_tokens))
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
    if r.agent is not None:
        parts.append(r.agent.line())
    line = "; ".join(parts) + "."
    todo = advice(r, group_size=group_size, temperature=temperature, max_new_tokens=max_new_tokens,
                  max_staleness=max_staleness)
    return line + (" To get signal: " + "; ".join(todo) if todo else "")


def trajectory_means(metrics: Mapping[str, float], policy_id: str) -> dict[str, float]:
    """A policy's trajectory metric means from the data layer's metrics (`data/<policy>/traj/<role>/<name>_mean`),
    keyed `<role>/<name>` as `Env.signal_advice` reads them."""
    prefix = f"data/{policy_id}/traj/"
    return {k[len(prefix):-len("_mean")]: float(v) for k, v in metrics.items()
            if k.startswith(prefix) and k.endswith("_mean")}


def env_advice(env: Any, means: Mapping[str, float]) -> tuple[str, ...]:
    """The env's own advice on these means; an env whose hook fails gives none (advice must never stop a run)."""
    hook = getattr(env, "signal_advice", None)
    if hook is None or not means:
        return ()
    try:
        return tuple(str(line) for line in hook(means))
    except Exception:  # noqa: BLE001 - a user env's bug in its advice hook must not end the run it advises
        return ()


def episode_totals(name: str, trajectories: Sequence[Any]) -> dict[str, float]:
    """The episodes among `trajectories` and their calls, tokens and seconds to frozen model `name`, each episode
    counted once whichever of its trajectories carry the counts (they all do: `astratk.rollout.frozen.with_counts`)."""
    episodes = {t.group_id: t.metrics for t in trajectories}
    out = {"episodes": float(len(episodes))}
    for what in ("calls", "tokens", "seconds"):
        out[what] = sum(float(m.get(f"frozen/{name}/{what}", 0.0)) for m in episodes.values())
    return out


def totals_line(name: str, totals: Mapping[str, float]) -> str:
    """One line on a frozen model's work (a run's end, a probe): replies, tokens, episodes and time per reply."""
    calls, episodes = totals["calls"], totals["episodes"]
    if not calls:
        return f"frozen model {name!r}: no episode called it; do the env's roles reach it (frozen.roles)?"
    return (f"frozen model {name!r}: {calls:.0f} replies ({totals['tokens']:.0f} tokens) in {episodes:.0f} episodes, "
            f"{calls / max(episodes, 1):.2f} per episode, {1000 * totals['seconds'] / calls:.0f} ms per reply; "
            "never trained on")
