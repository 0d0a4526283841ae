"""A pre-flight for a run: will its rollouts carry learning signal?

`probe(spec)` (also `Run(spec).probe()` in a notebook and `astratk probe --config ...`) builds each policy's starting
model as the run would, serves it in this process with the run's engine and sampling, and rolls out `n_tasks` train
tasks with `rollout.group_size` samples each through the same rollout service and scoring a run uses (no cluster, no
trainer). It reports, per policy: the mean sampled reward, pass@1 and pass@k (k = group size; a sample passes when it
scores >= 1), the share of groups whose rewards differ (the ones a run trains on; the rest the zero-variance filter
drops), truncation at `rollout.max_new_tokens`, greedy held-out accuracy (what the run's first evaluation would say)
and the same advice a starving run prints (`astratk.dataflow.learning_signal`). For agent and multi-turn envs it
also reports tool calls, unparseable calls and turns per episode, turn-limit and context-limit endings, and whether
the tools reached the model's prompt (`astratk.models.tools`). Each policy runs with every core
of this machine, as nothing else runs.

Example:
    >>> report = astratk.Run(spec).probe(n_tasks=32)  # doctest: +SKIP
    >>> report.policies["main"].signal_share  # doctest: +SKIP
    0.41
"""

from __future__ import annotations

import concurrent.futures
import html
import math
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from astratk.dataflow.learning_signal import (
    AgentReading,
    SignalReading,
    advice,
    agent_counts,
    describe,
    env_advice,
    episode_totals,
    totals_line,
)
from astratk.models import ensure_model
from astratk.models.tools import tool_status
from astratk.records import Lease, RunContext


@dataclass
class PolicyProbe:
    """What one policy's sampled groups showed."""

    policy_id: str
    groups: int
    signal_groups: int
    samples: int
    reward_mean: float
    pass_at_1: float
    pass_at_k: float
    k: int
    unfinished: float
    greedy_accuracy: float | None
    advice: list[str] = field(default_factory=list)
    line: str = ""
    agent: AgentReading | None = None  # agent and multi-turn envs: tool calls, turns, endings, tools in the prompt

    @property
    def signal_share(self) -> float:
        return self.signal_groups / self.groups if self.groups else 0.0


@dataclass
class ProbeReport:
    n_tasks: int
    seconds: float
    tokens: int
    policies: dict[str, PolicyProbe]
    too_long: int = 0  # train tasks dropped before generation: their prompt leaves no room in the model's context
    # frozen model -> its replies over the probed episodes: episodes, calls, tokens, seconds (astratk.rollout.frozen)
    frozen: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def nothing_to_train(self) -> bool:
        """Every probed task was dropped before generation: a run of this config would stop with nothing to train."""
        return self.too_long >= self.n_tasks

    def __str__(self) -> str:
        rows = [(f"probe: {self.n_tasks} train tasks in {self.seconds:.0f}s ({self.tokens / max(self.seconds, 1e-9):.0f} "
                "sampled tokens/s)")]
        if self.nothing_to_train:
            rows.append(f"nothing to train: all {self.n_tasks} tasks were dropped before generation, each prompt "
                        "longer than the model's context (the lines above name the context); a run would stop at "
                        "once. Shorten the prompts, or use a model with a longer context")
        elif self.too_long:
            rows.append(f"{self.too_long} of {self.n_tasks} tasks were dropped before generation, their prompts longer "
                        "than the model's context: a run drops such tasks too, counted "
                        "(data/tasks_dropped_prompt_too_long)")
        for p in self.policies.values():
            greedy = f", greedy held-out {p.greedy_accuracy:.3f}" if p.greedy_accuracy is not None else ""
            rows.append(f"policy {p.policy_id!r}: mean reward {p.reward_mean:.3f}, pass@1 {p.pass_at_1:.3f}, "
                        f"pass@{p.k} {p.pass_at_k:.3f}{greedy}; {p.signal_share:.0%} of groups carry signal "
                        f"({p.signal_groups}/{p.groups}); {p.unfinished:.0%} of samples hit max_new_tokens")
            if p.agent is not None:
                rows.append("  " + p.agent.line())
            if not p.groups:
                rows.append("  no group was rolled out for this policy: nothing to judge the signal by")
                continue
            rows.append("  " + ("to get more signal: " + "; ".join(p.advice) if p.advice else
                                "enough signal to train: every group with unequal rewards is a learning step's input"))
        rows.extend(totals_line(name, f) for name, f in self.frozen.items())
        return "\n".join(rows)

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(str(self))}</pre>"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c passing (1 - C(n-c, k) / C(n, k))."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def probe(spec: Any, n_tasks: int = 32, *, printer: Callable[[str], None] = print,
          eval_tasks: int | None = None) -> ProbeReport:
    """Roll out `n_tasks` train tasks (group_size samples each) and evaluate `eval_tasks` held-out tasks greedily
    (default `n_tasks`), in this process; see the module docstring. Runs on a thread of its own: the rollout
    service runs its episodes on an event loop, and a notebook's thread has one running already."""

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="astratk-probe") as pool:
        return pool.submit(_probe, spec, n_tasks, printer, eval_tasks).result()


def _probe(spec: Any, n_tasks: int, printer: Callable[[str], None], eval_tasks: int | None) -> ProbeReport:
    import torch

    from astratk import cpu
    from astratk.rollout.service import RolloutService
    from astratk.runtime.checks import check_frozen_model
    from astratk.runtime.deploy import publish_initial
    from astratk.weights.store import WeightStore

    if n_tasks < 1:
        raise ValueError(f"probe: n_tasks must be >= 1, got {n_tasks}")
    spec.validate()
    paths = {p.policy_id: str(ensure_model(p.model, spec.env, log=printer, key=f"policies[{i}].model"))
             for i, p in enumerate(spec.policies)}
    tools = {}
    for pid, path in paths.items():
        lines, shown = tool_status(spec.env, pid, path)
        for line in lines:
            printer(f"probe: {line}")
        if shown is not None:
            tools[pid] = shown
    for i, f in enumerate(spec.frozen):  # the frozen models the episodes call (a simulated user), as a run serves them
        paths[f.name] = str(ensure_model(f.model, spec.env, log=printer, key=f"frozen[{i}].model"))
        check_frozen_model(paths[f.name], f"frozen[{i}].model")
    t0 = time.perf_counter()  # sampling only: a model's build or warm start above is not the engine's speed
    with tempfile.TemporaryDirectory(prefix="astratk-probe-") as store_url:
        store = WeightStore.from_spec(store_url, spec.weights)
        for i, p in enumerate(spec.policies):
            if p.model.lora is not None:  # adapters start from version 0 in the store; full models need nothing
                publish_initial(store, p.policy_id, paths[p.policy_id], p.model.lora, key=f"policies[{i}].model.lora")
        service = RolloutService(RunContext(f"probe-{uuid.uuid4().hex[:8]}", spec, paths, store_url))
        torch.set_num_threads(cpu.cores())  # alone on the machine: every core
        routes = spec.role_routes()
        roles = {role: pid for role, pid in routes.items() if role in spec.env.roles}
        tasks = _first(spec.env.tasks("train"), n_tasks)
        leases = [Lease(f"probe{i}", task, roles, deadline=math.inf) for i, task in enumerate(tasks)]
        printer(f"probe: sampling {len(tasks)} tasks x {spec.rollout.group_size} at temperature "
                f"{spec.rollout.temperature:g}, {spec.rollout.max_new_tokens} new tokens ...")
        results = service.score(service.rollout(leases))
        greedy = _greedy(service, spec, eval_tasks or n_tasks, printer)
        for engine in list(service._engines.values()) + list(service._bases.values()):
            close = getattr(engine, "close", None)
            if close is not None and not hasattr(engine, "engine"):  # adapter views close with their engine
                close()
    groups = [g for res in results for g in res.groups]
    tokens = sum(len(t.tokens) - t.n_prompt for g in groups for t in g.trajectories)
    policies = {p.policy_id: _summarise(p.policy_id, [g for g in groups if g.policy_id == p.policy_id], spec,
                                        greedy.get(p.policy_id), tools.get(p.policy_id)) for p in spec.policies}
    too_long = sum(1 for res in results if res.dropped == "prompt_too_long")
    every = [t for g in groups for t in g.trajectories]
    frozen = {f.name: episode_totals(f.name, every) for f in spec.frozen}
    return ProbeReport(len(tasks), time.perf_counter() - t0, tokens, policies, too_long, frozen)


def _means(trajectories: list[Any]) -> dict[str, float]:
    """Trajectory metric means keyed `<role>/<name>`, as a run's data layer keeps them (`Env.signal_advice`)."""
    sums: dict[str, list[float]] = {}
    for t in trajectories:
        for name, value in t.metrics.items():
            sums.setdefault(f"{t.role}/{name}", []).append(float(value))
    return {k: sum(v) / len(v) for k, v in sums.items()}


def _first(iterable: Any, n: int) -> list[Any]:
    out = []
    for item in iterable:
        out.append(item)
        if len(out) >= n:
            break
    if not out:
        raise ValueError("probe: the env has no train tasks")
    return out


def _greedy(service: Any, spec: Any, n: int, printer: Callable[[str], None]) -> dict[str, float]:
    """Greedy held-out accuracy of each policy (the roles it plays), as the run's first evaluation computes it."""
    out = {}
    try:
        if len(spec.policies) == 1:
            pid = spec.policies[0].policy_id
            out[pid] = service.evaluate_versions({pid: None}, n)["accuracy"]
        else:
            record = service.evaluate_versions({p.policy_id: None for p in spec.policies}, n)
            for p in spec.policies:
                mine = [record[f"accuracy_{r}"] for r in p.roles if f"accuracy_{r}" in record]
                if mine:
                    out[p.policy_id] = sum(mine) / len(mine)
    except Exception as e:  # noqa: BLE001 - an env without held-out tasks still gets its sampled figures
        printer(f"probe: no greedy held-out accuracy ({type(e).__name__}: {e})")
    return out


def _summarise(pid: str, groups: list[Any], spec: Any, greedy: float | None,
               tools: tuple[bool, str] | None = None) -> PolicyProbe:
    k = spec.rollout.group_size
    rewards = [[float(t.reward) for t in g.trajectories if t.reward is not None] for g in groups]
    rewards = [r for r in rewards if r]
    flat = [x for r in rewards for x in r]
    signal = sum(1 for r in rewards if max(r) != min(r))
    samples = [t for g in groups for t in g.trajectories]
    shown, fmt = tools if tools is not None else (None, None)
    agent = AgentReading.of([c for t in samples if (c := agent_counts(t.metrics)) is not None], shown, fmt)
    passed = [(len(r), sum(1 for x in r if x >= 1.0)) for r in rewards]
    p1 = sum(c / n for n, c in passed) / len(passed) if passed else 0.0
    pk = sum(pass_at_k(n, c, min(k, n)) for n, c in passed) / len(passed) if passed else 0.0
    reading = SignalReading(groups=len(groups), admitted=signal,
                            dropped={"zero_variance": float(len(groups) - signal)} if len(groups) > signal else {},
                            samples=len(flat), reward_mean=sum(flat) / len(flat) if flat else None,
                            unfinished=(sum(1 for t in samples if not t.finished) / len(samples)) if samples else None,
                            greedy_accuracy=greedy, agent=agent,
                            env_advice=env_advice(spec.env, _means(samples)))
    options = {"group_size": k, "temperature": spec.rollout.temperature,
               "max_new_tokens": spec.rollout.max_new_tokens}
    todo = (advice(reading, **options) if reading.signal_share < 0.5
            or (agent and agent.advice(spec.rollout.max_new_tokens)) else [])
    return PolicyProbe(pid, len(groups), signal, len(flat), reading.reward_mean or 0.0, p1, pk, k,
                       reading.unfinished or 0.0, greedy, todo, describe(reading, **options), agent)
