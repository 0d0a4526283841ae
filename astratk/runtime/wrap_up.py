"""How a `Session`'s run ends: the first and last versions' held-out evaluations (a failed one recorded, not raised),
every policy's rows and counters collected, and the summary of the run's numbers. Mixed into `Session`
(`astratk.runtime.session`); a new number in the summary goes into `_summary` (or `_stop_summary`, for why a trainer
stopped).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any

from astratk.dataflow.drops import NO_ROLLOUT
from astratk.dataflow.learning_signal import AGENT_METRICS, AgentReading, totals_line
from astratk.runtime.starvation import EVALUATING
from astratk.spec import RunSpec

# The quickstart's promise: +15 held-out accuracy points; time-to-target is measured against it.
TARGET_GAIN = 0.15


class WrapUp:
    """`Session`'s wrap-up; the attributes it reads are set by `Session.__init__`, its set-up and its run loop."""

    spec: RunSpec

    def _starvation_warnings(self) -> list[dict[str, Any]]:
        """The starvation monitor's lines (`Session` sets `starvation` once the run loop starts)."""
        starvation = getattr(self, "starvation", None)
        return list(starvation.warnings) if starvation is not None else []

    def _first_evaluation(self, future: Any, version: int) -> dict[str, float]:
        """The first version's evaluation, waited for once training is over: the rollout workers are free by then, so
        it starts within one chunk's time and runs `eval.timeout_s` at most (`Evaluator.evaluate` holds both bounds;
        this wait, `Evaluator.default_wait_s`, is their sum). A failed one is recorded with accuracy NaN, so that the
        run still writes what it gathered, and one still in flight is given up (no late record or line)."""

        wait_s = self.evaluator.default_wait_s()
        try:
            return future.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            why = f"not finished {wait_s:.0f}s after training (eval.timeout_s + rollout.episode_timeout_s)"
            self.evaluator.abandon()
        except Exception as e:  # noqa: BLE001 - reported; the run's outputs matter more
            why = f"{type(e).__name__}: {e}"
        self.print(f"held-out evaluation of the first version (v{version}) failed: {why}; the run's gain is not "
                   "known (raise eval.timeout_s, or lower eval.max_tasks, for an evaluation that fits)")
        return {"version": float(version), "accuracy": float("nan"), "n": 0.0, "error": 1.0,
                "evaluated_at": time.time(), "train_time_s": float("nan")}

    def _final_evaluation(self) -> dict[str, float]:
        """The last version's held-out evaluation; a failed one is recorded with accuracy NaN, so
        that the run still writes what it gathered. A periodic evaluation of exactly the newest versions is that
        evaluation already (greedy decoding on the same tasks gives the same accuracy): it is not run twice."""
        newest = {p.policy_id: getattr(self.deployment.store.latest(p.policy_id), "version", None)
                  for p in self.spec.policies}
        for record in reversed(list(self.evaluator.records)):
            if record.get("accuracy") == record.get("accuracy") and all(
                    int(record.get(f"version_{pid}", record["version"])) == v for pid, v in newest.items()):
                return record
        try:
            return self.evaluator.evaluate()
        except Exception as e:  # noqa: BLE001 - reported; the run's outputs matter more
            self.print(f"held-out evaluation of the last version failed: {e}")
            latest = self.deployment.store.latest(self.spec.policies[0].policy_id)
            return {"version": float(latest.version if latest else 0), "accuracy": float("nan"),
                    "n": 0.0, "error": 1.0, "evaluated_at": time.time(), "train_time_s": float("nan")}

    def _collect(self, results: dict[str, dict[str, Any]]) -> None:
        from astratk.runtime.evaluation import per_policy

        for pid, res in results.items():
            self.step_rows[pid] = res["rows"]
            self.group_ids[pid] = res["group_ids"]
        if len(self.spec.policies) == 1:  # every record, failed evaluations (accuracy NaN) too
            [p] = self.spec.policies
            self.eval_rows = {p.policy_id: sorted(self.evaluator.records,
                                                  key=lambda r: (r["version"], r["evaluated_at"]))}
        else:  # each policy's version, and the accuracy of the roles it plays
            self.eval_rows = per_policy(self.evaluator.records, self.spec)
        self._collect_counters()

    def _collect_counters(self) -> None:
        from astratk.runtime.acquisition import task_accounting

        data = self.deployment.datalayer.metrics()
        acquisition = self.deployment.acquisition
        # The acquisition loop's counters are the run's (a chunk may serve several policies); the
        # metrics dataset keeps them under the first policy.
        first = self.spec.policies[0].policy_id
        counts = {f"acquisition/{first}/{k.split('/', 1)[1]}": v
                  for k, v in acquisition.counts.items()}
        accounting = {f"acquisition/{k}": v for k, v in task_accounting(data).items()}
        starving = self.starvation.counters() if self.starvation is not None else {}
        self.counters = {**data, **counts, **accounting, **starving}
        self.drops = self.deployment.datalayer.drops()
        self.service_rows = acquisition.services.by_service()
        if acquisition.errors:
            self.print(f"{len(acquisition.errors)} rollout chunk(s) failed; first: "
                       f"{acquisition.errors[0]}")

    def _summary(self, base: dict[str, float], final: dict[str, float], train_time: float,
                 results: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The run's numbers. The headline keys are the first policy's (its steps and data wait;
        the evaluations cover every policy); a multi-policy run adds `<policy>_...` keys for each
        policy that trained here."""
        evals = [r for r in self.evaluator.records if r.get("accuracy") == r.get("accuracy")]
        goal = base["accuracy"] + TARGET_GAIN
        reached = sorted((r for r in evals if r["version"] > 0 and r["accuracy"] >= goal),
                         key=lambda r: r["train_time_s"])
        first = self.spec.policies[0].policy_id
        head = results.get(first, {"rows": [], "data_wait_s": 0.0})
        summary = {
            "policy_id": first,
            "model_path": self.model_paths[first],
            "accuracy_before": base["accuracy"],
            "start_version": self._first_version(),  # 0, or the resumed checkpoint's step
            "resumed_from": str(self.resume_point.checkpoint) if self.resume_point else None,
            "accuracy_after": final["accuracy"],
            "accuracy_best": max((r["accuracy"] for r in evals), default=float("nan")),  # nan: no evaluation ran
            "accuracy_gain": final["accuracy"] - base["accuracy"],
            "target_gain": TARGET_GAIN,
            "time_to_target_s": reached[0]["train_time_s"] if reached else None,
            "final_version": int(final["version"]),
            "steps": len(head["rows"]),
            "train_time_s": train_time,
            "data_wait_s": head["data_wait_s"],
            "data_wait_fraction": head["data_wait_s"] / max(train_time, 1e-9),
            "n_heldout": int(base["n"]),
            **_stop_summary(self.spec, results, self._starvation_warnings()),
            "starvation": [w["line"] for w in self.starvation.warnings[-10:]] if self.starvation else [],
        }
        agent = {p.policy_id: a for p in self.spec.policies if (a := self._agent_summary(p.policy_id)) is not None}
        if agent:
            summary["agent"] = agent
        if frozen := {f.name: self._frozen_summary(f.name) for f in self.spec.frozen}:
            summary["frozen"] = frozen
        if len(self.spec.policies) > 1:
            for p in self.spec.policies:
                if p.policy_id in results:
                    summary.update(self._policy_summary(p.policy_id, results[p.policy_id]))
        return summary

    def _agent_summary(self, pid: str) -> dict[str, Any] | None:
        """A policy's agent episodes over the whole run (tool calls, unparseable calls and turns per episode, the
        shares that ended at the turn or context limit, the tool format its model got); None for other envs."""
        counters = getattr(self, "counters", {})
        episodes = int(counters.get(f"data/{pid}/agent/episodes", 0))
        if not episodes:
            return None
        shown, fmt = getattr(self, "tools_shown", {}).get(pid, (None, None))
        r = AgentReading(episodes, **{n: counters.get(f"data/{pid}/agent/{n}", 0.0) for n in AGENT_METRICS},
                         tools_shown=shown, tool_format=fmt)
        return {"episodes": episodes, **{f"{n}_per_episode": r.per_episode(n) for n in AGENT_METRICS},
                "tools_shown": shown, "tool_format": fmt, "line": r.line()}

    def _frozen_summary(self, name: str) -> dict[str, Any]:
        """A frozen model's work over the run: the episodes that called it, its replies and their tokens, and the
        time an episode waited for a reply (`astratk.rollout.frozen`)."""
        counters = getattr(self, "counters", {})
        key = f"data/frozen/{name}/"
        totals = {"episodes": counters.get(key + "episodes", 0.0), "calls": counters.get(key + "episode_calls", 0.0),
                  "tokens": counters.get(key + "episode_tokens", 0.0),
                  "seconds": counters.get(key + "episode_ms", 0.0) / 1000}
        calls, episodes = totals["calls"], totals["episodes"]
        return {"episodes": int(episodes), "calls": int(calls), "tokens": int(totals["tokens"]),
                "calls_per_episode": calls / max(episodes, 1),
                "seconds_per_call": totals["seconds"] / calls if calls else float("nan"),
                "line": totals_line(name, totals)}

    def _policy_summary(self, pid: str, result: dict[str, Any]) -> dict[str, Any]:
        """One policy's numbers in a multi-policy run's summary: its fit and its evaluations."""
        ok = [r for r in self.eval_rows[pid] if r.get("accuracy") == r.get("accuracy")]
        return {f"{pid}_steps": len(result["rows"]),
                f"{pid}_final_version": int(ok[-1]["version"]) if ok else 0,
                f"{pid}_accuracy_before": ok[0]["accuracy"] if ok else float("nan"),
                f"{pid}_accuracy_after": ok[-1]["accuracy"] if ok else float("nan"),
                f"{pid}_data_wait_s": result["data_wait_s"]}


def _stop_summary(spec: RunSpec, results: dict[str, dict[str, Any]],
                  warnings: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """`stopped_early` (whether a trainer ended before its last step for a reason other than its
    time limit or a stop asked for), `stop_reason` (why, in words; the first policy's that has one)
    and `skipped_steps` (optimiser steps the divergence guard skipped, over every policy).

    A trainer sees only that no rollout arrived; where the driver's starvation monitor saw the rollout workers
    held by a held-out evaluation meanwhile (its last line for that policy says so), the reason says that instead
    of asking whether the workers are alive."""
    reasons = {p.policy_id: results[p.policy_id].get("stop_reason") for p in spec.policies if p.policy_id in results}
    pid, reason = next(((k, r) for k, r in reasons.items() if r), (None, None))
    if reason and NO_ROLLOUT in reason:
        last = next((w["line"] for w in reversed(warnings) if w.get("policy") == pid), "")
        if EVALUATING in last:
            reason = reason.split(NO_ROLLOUT)[0] + NO_ROLLOUT + "; the rollout workers were evaluating" + last.split(
                EVALUATING, 1)[1]
    skipped = sum(int(res["rows"][-1].get(f"train/{pid}/skipped_steps", 0)) for pid, res in results.items()
                  if res["rows"])
    return {"stopped_early": reason is not None, "stop_reason": reason, "skipped_steps": skipped}
