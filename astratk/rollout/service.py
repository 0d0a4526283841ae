"""The rollout service (AstraFlow's RaaS): one per worker process, hosting the engines of the policies it serves.

A service is created lazily by the first rollout task that reaches its process (so a worker that joins mid-run needs
no setup step) and lives as long as the process. At the start of every task it syncs each engine to the newest
published weights (pull-based, from the weight store); a joining worker therefore catches up before its first
generation. It runs `group_size` episodes per task concurrently, so their generate calls share engine batches; each
episode samples with its own seed (`episode_seed`: run seed, lease id, episode index), so rollouts are reproducible.

Engines: one per (purpose, policy), except for policies trained with LoRA (`model.lora`): those that start from the
same model directory share one engine in the process, for every purpose, which holds the base model once and one
adapter per (purpose, policy) (`astratk.engines.adapters`). The adapter starts from the newest version in the store
(adapter tensors are small) and moves like any engine.

Extending: engines come from `astratk.registry` by `RolloutSpec.engine`; envs from the run's `env` spec.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from astratk import idle_cores
from astratk.contracts import Engine, Env, PromptTooLong, SamplingParams
from astratk.engines import build_engine
from astratk.records import Group, Lease, LeaseResult, RunContext, Task, Trajectory, opened
from astratk.rollout.bounded import BoundExceeded, bounded_episode, call_bounded, run_episodes
from astratk.rollout.context import limit_engines
from astratk.rollout.frozen import frozen_engines, with_counts
from astratk.rollout.lockstep import Lockstep
from astratk.rollout.services import service_for
from astratk.spec import LoraSpec
from astratk.weights.delta import SparseDelta
from astratk.weights.store import WeightStore

log = logging.getLogger(__name__)
TOO_LONG_LINES = 5  # tasks dropped as too long that get a log line each; past them, a count at 10, 100, 1000...


def get_service(ctx: RunContext) -> RolloutService:
    """The process-wide service for this run, created on first use; refused once the run has ended here
    (`astratk.rollout.services` keeps the record and releases it). `ctx` may arrive shipped (`records.Shipped`)."""
    ctx = opened(ctx)
    return service_for(ctx.run_id, lambda: RolloutService(ctx))


def _threads_here(ctx: RunContext) -> int:
    """This rollout worker's torch threads: the driver's per-host plan when it made one (a cluster of your own), else
    the run's plan (`astratk.cpu.run_threads`)."""
    from astratk import cpu

    if ctx.rollout_threads:
        try:
            from distributed import get_worker

            return ctx.rollout_threads.get(get_worker().address) or cpu.run_threads(ctx.spec).rollout
        except ValueError:  # not inside a Dask worker (a probe): the run's plan
            pass
    return cpu.run_threads(ctx.spec).rollout


def _quiet_transformers() -> None:
    """Per-load progress bars from transformers would flood worker logs at every engine start."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _service_name() -> str:
    try:
        from distributed import get_worker

        return str(get_worker().name)
    except (ImportError, ValueError):
        return f"pid{os.getpid()}"


class RolloutService:
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.spec = ctx.spec
        self._too_long = 0  # tasks this service dropped before generation (their log lines thin out)
        from astratk import cpu

        threads = _threads_here(ctx)
        torch.set_num_threads(threads)
        if idle_cores.lends(self.spec):  # a trainer on this host lends its cores while it waits for a batch
            idle_cores.install(idle_cores.run_dir_for(ctx.run_id), own=threads, cap=cpu.cores())
        else:  # not an earlier run's lender (a worker kept warm for the next run)
            idle_cores.uninstall()
        cpu.set_linear_backend(ctx.cpu_linear or self.spec.cluster.cpu_linear)  # the driver's choice when it made one
        _quiet_transformers()
        self.env: Env = self.spec.env
        self.store = WeightStore.from_spec(ctx.store_url, ctx.spec.weights)
        self.name = _service_name()
        self._engines: dict[tuple[str, str], Engine] = {}  # (purpose, policy_id) -> engine, or adapter view
        self._bases: dict[str, Engine] = {}  # model directory -> the engine its LoRA policies share
        self._lock = threading.Lock()  # one weight load at a time per engine (AstraFlow: loads are serialised)
        # rollout.eval_engine shared: the policies whose rollout engine the evaluation now running holds at its version
        # (such evaluations run one at a time)
        self._held: set[str] = set()
        self._shared_eval = threading.Lock()
        self._engines_lock = threading.Lock()

    def engine(self, policy_id: str, purpose: str = "rollout", *, rebuild_broken: bool = False) -> Engine:
        """The engine of `policy_id` for `purpose`, built on first use. An engine whose weight load failed half-way
        (VLLMEngine's `broken`) is replaced only by `sync` (`rebuild_broken`), which then loads the newest weights
        into the new one: anywhere else it is handed out as is, and its calls fail naming the cause."""
        with self._engines_lock:  # a worker with rollout_<policy>=2 runs two tasks at once: build each engine once
            frozen = self.spec.frozen_model(policy_id)
            if frozen is not None:  # one engine for rollouts and evaluations alike: its weights never change
                key = ("frozen", policy_id)
                if key not in self._engines:
                    r = self.spec.rollout
                    self._engines[key] = build_engine(frozen.engine or r.engine, self.ctx.model_paths[policy_id],
                                                      run_settings=self._engine_settings("rollout"),
                                                      **{**r.engine_args, **frozen.engine_args})
                return self._engines[key]
            lora = self.spec.policy(policy_id).model.lora
            if lora is not None:
                return self._adapter_engine(policy_id, purpose, lora, rebuild_broken)
            if purpose == "eval" and self._shares_eval(policy_id):
                purpose = "rollout"  # rollout.eval_engine: shared (`evaluate_versions` holds its version meanwhile)
            key = (purpose, policy_id)
            broken = getattr(self._engines.get(key), "broken", None)
            if broken is not None and rebuild_broken:
                warnings.warn(f"rebuilding the {purpose} engine of policy {policy_id!r}: {broken}", stacklevel=3)
                with contextlib.suppress(Exception):
                    self._engines.pop(key).close()
            if key not in self._engines:
                r = self.spec.rollout
                self._engines[key] = build_engine(r.engine, self.ctx.model_paths[policy_id],
                                                  run_settings=self._engine_settings(purpose), **r.engine_args)
            return self._engines[key]

    def close(self) -> None:
        """Close every engine this service built (adapter views, then the engines they share), each once."""
        with self._engines_lock:
            engines = [*self._engines.values(), *self._bases.values()]
            self._engines.clear()
            self._bases.clear()
        seen: set[int] = set()
        for engine in engines:
            if id(engine) not in seen and hasattr(engine, "close"):
                seen.add(id(engine))
                try:
                    engine.close()
                except Exception as e:  # noqa: BLE001 - the others are still closed; the run is over
                    log.warning("closing an engine of run %s: %s", self.ctx.run_id, e)

    def _engine_settings(self, purpose: str) -> dict[str, Any]:
        """Run-wide engine settings (`build_engine` passes each to engines that take it): rollout engines switch
        weights as `rollout.weight_updates` says; evaluation engines hold one version per evaluation."""
        r = self.spec.rollout
        return {"max_batch": r.max_batch,
                "weight_updates": r.weight_updates if purpose == "rollout" else "between_requests"}

    def _adapter_engine(self, policy_id: str, purpose: str, lora: LoraSpec, rebuild_broken: bool) -> Engine:
        """Under `_engines_lock`: the view of the policy's adapter on the engine of its model directory (module
        docstring), the engine built and the adapter attached on first use. A broken shared engine is rebuilt by
        `sync` as a policy's own engine is, and every view on it goes with it."""
        key, path = (purpose, policy_id), self.ctx.model_paths[policy_id]
        base = self._bases.get(path)
        broken = getattr(base, "broken", None)
        if broken is not None and rebuild_broken:
            warnings.warn(f"rebuilding the engine of {path!r} (LoRA policies' base): {broken}", stacklevel=4)
            with contextlib.suppress(Exception):
                self._bases.pop(path).close()
            for k in [k for k, v in self._engines.items() if getattr(v, "engine", None) is base]:
                del self._engines[k]
            base = None
        if key in self._engines:
            return self._engines[key]
        if base is None:
            r = self.spec.rollout
            ranks = [p.model.lora.r for p in self.spec.policies
                     if p.model.lora is not None and self.ctx.model_paths[p.policy_id] == path]
            # The rollout's settings whichever purpose builds it first: a switch happens only when a batch's own
            # adapter gets a new version, and an evaluation's adapter is loaded between evaluations, never during one.
            base = self._bases[path] = build_engine(
                r.engine, path, run_settings={**self._engine_settings("rollout"), "max_lora_rank": max(ranks),
                                              "max_loras": 2 * len(ranks)}, **r.engine_args)
        try:
            state, ref = self.store.pull(policy_id, None, None)  # the newest adapter, in full
        except KeyError:
            raise RuntimeError(f"policy {policy_id!r} trains LoRA adapters but has no published version in "
                               f"{self.store.url}; publish version 0 first (astratk.runtime.deploy.publish_initial)"
                               ) from None
        view = self._engines[key] = base.add_adapter(f"{purpose}/{policy_id}", lora, state, ref.version)
        return view

    def sync(self, policy_id: str, purpose: str = "rollout", version: int | None = None) -> int:
        """Move the engine to `version` (default: the newest published); returns the engine's version after.

        The store sends what is cheapest from the engine's version (`WeightStore.pull`): a sparse delta from it, or a
        full state. A rollout engine never moves back (an older `version`, e.g. a lagged one computed before another
        chunk's sync moved the engine on, leaves it where it is; in-flight mode would otherwise record a newer
        version then an older one within a sample); an evaluation engine loads the `version` asked, in full. A delta the engine refuses (a bf16 delta for an fp32 engine, a VLLMEngine without host
        weights) is replaced by the full state, with a warning naming the fix."""
        if self.spec.frozen_model(policy_id) is not None:  # served as loaded: nothing is ever published for it
            return self.engine(policy_id).version
        with self._lock:
            engine = self.engine(policy_id, purpose, rebuild_broken=True)
            if purpose == "rollout" and policy_id in self._held:  # an evaluation on this engine holds its version
                return engine.version
            if version is not None and (version == engine.version or (purpose == "rollout"
                                                                       and version < engine.version)):
                return engine.version
            try:
                payload, ref = self.store.pull(policy_id, engine.version, version)
            except KeyError:
                if version is None:  # nothing published yet
                    return engine.version
                raise
            if payload is None:
                return engine.version
            try:
                engine.load_weights(payload, ref.version)
            except ValueError as e:
                if not isinstance(payload, SparseDelta):
                    raise
                warnings.warn(f"engine {type(engine).__name__} of policy {policy_id!r} refused a weight delta ({e}); "
                              "loading full states instead. If the engine's dtype differs from the published one, "
                              "set weights.publish_dtype to the engine's dtype", stacklevel=2)
                payload, ref = self.store.pull(policy_id, None, ref.version)
                engine.load_weights(payload, ref.version)
        return engine.version

    def _lagged_version(self, policy_id: str) -> int | None:
        """With `rollout.weight_lag` L > 0: the version L behind the newest published, when that is newer than the
        engine's (an engine never moves back); None otherwise, which `sync` reads as "the newest" for L = 0 and as
        "stay" below."""
        lag = self.spec.rollout.weight_lag
        if not lag or self.spec.frozen_model(policy_id) is not None:
            return None
        ref = self.store.latest(policy_id)
        current = self.engine(policy_id).version
        if ref is None or ref.version - lag <= current:
            return current
        return ref.version - lag

    # ------------------------------------------------------------------------------------------------ rollout
    def rollout(self, leases: Sequence[Lease]) -> list[LeaseResult]:
        """Sync every routed engine to the newest weights, then roll out all leases concurrently. The worker's name
        and class are read per call: in a threads-mode cluster several workers share this process's service."""
        from astratk.rollout.hardware import worker_hardware  # on a worker only: it imports distributed

        policies = sorted({p for lease in leases for p in lease.routes.values()
                           if self.spec.frozen_model(p) is None})  # a frozen model's engine never changes
        synced = {pid: self.sync(pid, version=self._lagged_version(pid)) for pid in policies}
        hardware, slowdown = worker_hardware()
        stamp = {"service": _service_name(), "hardware": hardware, "synced_versions": synced}
        poll = self.spec.rollout.poll_s
        lender = idle_cores.lender()
        lent_before = lender.borrowed_s if lender is not None else 0.0
        with WeightWatcher(self, policies, poll) if poll is not None else contextlib.nullcontext():
            results = run_episodes(self._rollout_all(leases, stamp, slowdown))  # newer versions load meanwhile
        if lender is not None and (lent := lender.borrowed_s - lent_before) > 0:
            results = [dataclasses.replace(r, lent_s=lent) for r in results]
        return results

    async def _rollout_all(self, leases: Sequence[Lease], stamp: dict, slowdown: float) -> list[LeaseResult]:
        lock = None
        if self.spec.dataflow.synchronous:  # engine batches independent of timing (astratk.rollout.lockstep)
            lock = Lockstep()
            lock.expect([(lease.lease_id, i) for lease in leases for i in range(self.spec.rollout.group_size)])
        return list(await asyncio.gather(*(self._rollout_lease(lease, stamp, slowdown, lock) for lease in leases)))

    async def _rollout_lease(self, lease: Lease, stamp: dict, slowdown: float = 1.0, lock: Lockstep | None = None
                             ) -> LeaseResult:
        start = time.perf_counter()
        r = self.spec.rollout
        engines = {role: self.engine(pid) for role, pid in lease.routes.items()}
        if lock is not None:
            shared = {id(e): lock.engine(e) for e in engines.values()}  # one wrapper per engine: one batch each
            engines = {role: shared[id(e)] for role, e in engines.items()}
        engines = limit_engines(engines)  # outermost: a prompt too long is refused before it joins a batch
        # top-K log-probs only when a routed policy's loss needs them (DPPO Top-K): they cost memory per token
        top_k = max(self.spec.policy(pid).loss.needs_topk for pid in lease.routes.values()
                    if self.spec.frozen_model(pid) is None)
        sampling = SamplingParams(temperature=r.temperature, max_tokens=r.max_new_tokens, top_k_logprobs=top_k)
        episodes = [self._episode(lease.task, engines,
                                  dataclasses.replace(sampling, seed=episode_seed(self.spec.seed, lease.lease_id, i)),
                                  lease.routes, f"{lease.lease_id}/{i}")
                    for i in range(r.group_size)]
        if lock is not None:
            episodes = [lock.run((lease.lease_id, i), ep) for i, ep in enumerate(episodes)]
        what = f"an episode of task {lease.task.task_id!r} (rollout.episode_timeout_s)"
        try:
            episodes = await asyncio.gather(*(bounded_episode(ep, r.episode_timeout_s, what) for ep in episodes))
        except BoundExceeded as e:  # the attempt fails; the data layer re-issues the task (acquisition: admit_task)
            log.warning("%s", e)
            return LeaseResult(lease.lease_id, (), time.perf_counter() - start, attempt=lease.attempt,
                               failure="episode_timeout", **stamp)
        except PromptTooLong as e:  # every attempt would fail alike: the data layer drops the task, counted
            self._too_long += 1
            n = self._too_long
            if n <= TOO_LONG_LINES:  # the first ones in full; then a count at 10, 100, 1000...: never a flood
                log.warning("task %r dropped before generation: %s", lease.task.task_id, e)
            elif n == 10 ** len(str(n - 1)):
                log.warning("%d tasks dropped before generation on this worker so far, prompts longer than the "
                            "model's context (the latest: %r, %s); the metric data/tasks_dropped_prompt_too_long "
                            "counts them all, drop_task_ids names them", n, lease.task.task_id, e)
            return LeaseResult(lease.lease_id, (), time.perf_counter() - start, attempt=lease.attempt,
                               dropped="prompt_too_long", **stamp)
        if slowdown > 1.0:  # simulated slower hardware (astratk.runtime.pools): generation takes `slowdown` x as long
            await asyncio.sleep((slowdown - 1.0) * (time.perf_counter() - start))
        groups = _groups_by_role(lease, [t for episode in episodes for t in episode], stamp["service"])
        return LeaseResult(lease.lease_id, groups, time.perf_counter() - start, attempt=lease.attempt, **stamp)

    async def _episode(self, task: Task, engines: dict[str, Any], sampling: SamplingParams,
                       routes: Mapping[str, str], group_id: str) -> list[Trajectory]:
        """One episode of the env; the frozen models it calls count its calls (`astratk.rollout.frozen`)."""
        engines, counters = frozen_engines(engines, routes, self.spec)
        trajectories = await self.env.rollout(task, engines, sampling, policy_ids=routes, group_id=group_id)
        return with_counts(trajectories, counters)

    def score(self, results: Sequence[LeaseResult]) -> list[LeaseResult]:
        """Score each lease's episodes in one `env.score` call over all its roles' trajectories (a workflow's reward
        for one role may depend on another role's output, e.g. a verifier's on the solver's answer; `group_id`
        "<lease>/<episode>" pairs the roles of one episode), then split the rewards back into the role groups."""
        out = []
        r = self.spec.rollout
        for res in results:
            if not res.groups:
                out.append(res)
                continue
            flat = [t for g in res.groups for t in g.trajectories]
            task = res.groups[0].task
            try:
                scored = list(call_bounded(lambda task=task, flat=flat: self.env.score_with_metrics(task, flat),
                                           r.score_timeout_s,
                                           f"scoring of task {task.task_id!r} (rollout.score_timeout_s)"))
            except BoundExceeded as e:
                log.warning("%s", e)
                if r.score_timeout_reward is None:  # the attempt fails and is re-issued (admit_task releases it)
                    out.append(dataclasses.replace(res, groups=(), failure="score_timeout"))
                    continue
                scored = [(r.score_timeout_reward, {"score_timed_out": 1.0}) for _ in flat]
            rewards = [r for r, _ in scored]
            if len(rewards) != len(flat):
                raise ValueError(f"env {self.env.name!r}: score returned {len(rewards)} rewards for {len(flat)} "
                                 "trajectories")
            flat = [dataclasses.replace(t, metrics={**t.metrics, **m}) if m else t
                    for t, (_, m) in zip(flat, scored, strict=True)]
            groups, at = [], 0
            for g in res.groups:
                span = slice(at, at + len(g.trajectories))
                at = span.stop
                trajs = tuple(t if r is None else t.with_reward(r)
                              for t, r in zip(flat[span], rewards[span], strict=True))
                groups.append(dataclasses.replace(g, trajectories=trajs))
            out.append(dataclasses.replace(res, groups=tuple(groups)))
        return out

    # --------------------------------------------------------------------------------------------- evaluate
    def evaluate(self, policy_id: str, version: int | None, max_tasks: int) -> dict[str, float]:
        """Greedy held-out accuracy of `policy_id` at `version` (default newest) playing every role it plays (and,
        when it plays them all, the whole env); see `evaluate_versions`."""
        return self.evaluate_versions({policy_id: version}, max_tasks)

    def evaluate_versions(self, versions: dict[str, int | None], max_tasks: int, pass_k: int = 0
                          ) -> dict[str, float]:
        """`_evaluate_versions`; with `rollout.eval_engine` shared, the policies' rollout engines hold the evaluated
        versions until it is done (rollout chunks meanwhile sample from them, each token recording its version), and
        such evaluations run one at a time."""
        held = {pid for pid in versions if self._shares_eval(pid)}
        if not held:
            return self._evaluate_versions(versions, max_tasks, pass_k)
        with self._shared_eval:
            with self._lock:
                self._held = held
            try:
                return self._evaluate_versions(versions, max_tasks, pass_k)
            finally:
                with self._lock:
                    self._held = set()

    def _shares_eval(self, policy_id: str) -> bool:
        """Whether `policy_id`'s evaluations run on its rollout engine (`rollout.eval_engine`; a LoRA policy's
        adapters are views on one engine, `_adapter_engine`, either way)."""
        return self.spec.rollout.shares_eval_engine and self.spec.policy(policy_id).model.lora is None

    def _evaluate_versions(self, versions: dict[str, int | None], max_tasks: int, pass_k: int = 0
                           ) -> dict[str, float]:
        """Held-out evaluation with each policy of `versions` at its version (None: newest), on separate eval
        engines so rollouts keep their own versions. Roles are routed as in the run (`spec.role_routes()`); a role
        whose policy is not in `versions` is played by the first one given (a single-policy evaluation of a
        workflow). Reports greedy `accuracy` (the first role's), `accuracy_<role>`, `accuracy_env_<env>` for a
        mixture, `pass_at_<k>` (k samples at the rollout temperature; a task passes if any scores >= 1) and
        `sampled_accuracy` (mean@k: the mean score of those samples, the accuracy of one sample) when
        `pass_k` > 0, and `version_<policy>` for every policy evaluated."""
        start = time.perf_counter()
        synced = {pid: self.sync(pid, "eval", v) for pid, v in versions.items()}
        first = next(iter(versions))
        run_routes = self.spec.role_routes()
        routes = {role: run_routes[role] if run_routes.get(role) in versions
                  or self.spec.frozen_model(run_routes.get(role, "")) is not None else first for role in self.env.roles}
        engines = limit_engines({role: self.engine(pid, "eval") for role, pid in routes.items()})
        tasks = list(self.env.tasks("heldout"))[:max_tasks]
        greedy = SamplingParams(temperature=0.0, max_tokens=self.spec.rollout.max_new_tokens)

        lost = {"timed_out": 0, "too_long": 0}  # greedy episodes scored 0 without an answer (said in the eval line)

        async def one(task: Task, sampling: SamplingParams, tag: str) -> list[Trajectory]:
            episode = self._episode(task, engines, sampling, routes, f"eval/{task.task_id}/{tag}")
            try:
                return await bounded_episode(episode, self.spec.rollout.episode_timeout_s,
                                             f"a held-out episode of task {task.task_id!r} (rollout.episode_timeout_s)")
            except BoundExceeded as e:  # scored 0: evaluation must not drop tasks
                log.warning("%s", e)
                lost["timed_out"] += tag == "g"
                return []
            except PromptTooLong:  # a held-out prompt longer than the model's context: scored 0 likewise
                lost["too_long"] += tag == "g"
                return []

        async def run_all() -> tuple[list[list[Trajectory]], list[list[list[Trajectory]]]]:
            greedy_eps = asyncio.gather(*(one(t, greedy, "g") for t in tasks))
            sampled = asyncio.gather(*(asyncio.gather(*(
                one(t, SamplingParams(temperature=self.spec.rollout.temperature,
                                      max_tokens=self.spec.rollout.max_new_tokens,
                                      seed=episode_seed(self.spec.seed, f"eval/{t.task_id}", i)), f"s{i}")
                for i in range(pass_k))) for t in (tasks if pass_k > 0 else [])))
            return list(await greedy_eps), list(await sampled)

        episodes, sampled = run_episodes(run_all())

        def score(task: Task, trajs: list[Trajectory]) -> list[float | None]:
            try:
                return call_bounded(lambda: self.env.score(task, trajs), self.spec.rollout.score_timeout_s,
                                    f"held-out scoring of task {task.task_id!r} (rollout.score_timeout_s)")
            except BoundExceeded as e:
                log.warning("%s", e)
                return [None] * len(trajs)

        by_role: dict[str, list[float]] = {role: [] for role in self.env.roles}
        by_env: dict[str, list[float]] = {}
        scored_episodes: list[list[Trajectory]] = []  # for the env's own figures over the whole evaluation
        for task, trajs in zip(tasks, episodes, strict=True):
            scores = score(task, trajs)
            scored_episodes.append([dataclasses.replace(t, reward=sc) for t, sc in zip(trajs, scores, strict=True)])
            for role in self.env.roles:  # an unscorable episode counts as 0 (evaluation must not drop tasks)
                mine = [sc for sc, t in zip(scores, trajs, strict=True) if t.role == role and sc is not None]
                by_role[role].append(sum(mine) / len(mine) if mine else 0.0)
            by_env.setdefault(task.env, []).append(by_role[self.env.roles[0]][-1])
        out: dict[str, float] = {}
        if pass_k > 0:
            solver, passed, means = self.env.roles[0], 0, []
            for task, per_task in zip(tasks, sampled, strict=True):  # one episode is scored at a time, as above
                # each sample's solver scores; its accuracy is their mean, as for the greedy episode above (an
                # unscorable or timed-out sample counts as 0)
                solved = [[sc for sc, t in zip(score(task, ep), ep, strict=True) if t.role == solver and sc is not None]
                          for ep in per_task]
                passed += any(sc >= 1.0 for mine in solved for sc in mine)
                samples = [sum(mine) / len(mine) if mine else 0.0 for mine in solved]
                means.append(sum(samples) / len(samples) if samples else 0.0)
            out[f"pass_at_{pass_k}"] = passed / max(1, len(tasks))
            # mean@k: the accuracy of one sample at the rollout temperature (a greedy accuracy near 1 leaves no room
            # to measure; this one moves while RL sharpens the sampled policy)
            out["sampled_accuracy"] = sum(means) / max(1, len(means))
        rewards = by_role[self.env.roles[0]]  # the headline accuracy is the first role's (the solver's)
        version = synced[first]
        try:
            published_at = self.store.ref(first, version).published_at
        except KeyError:  # pruned in the instant since the load: the time is unknown, the accuracy still stands
            published_at = float("nan")
        if len(by_role) > 1:
            out.update({f"accuracy_{role}": sum(v) / max(1, len(v)) for role, v in by_role.items()})
        if len(by_env) > 1:
            out.update({f"accuracy_env_{env}": sum(v) / max(1, len(v)) for env, v in by_env.items()})
        out.update({f"version_{pid}": float(v) for pid, v in synced.items()})
        out.update({k: float(v) for k, v in self.env.heldout_metrics(scored_episodes).items()})
        return {"version": float(version), "accuracy": sum(rewards) / max(1, len(rewards)),
                "n": float(len(rewards)), "seconds": time.perf_counter() - start, "published_at": published_at,
                "episodes_timed_out": float(lost["timed_out"]), "episodes_too_long": float(lost["too_long"]), **out}


class WeightWatcher:
    """While a rollout chunk runs (a `with` block), load each routed policy's newest version (after `weight_lag`)
    every `poll_s` seconds on a daemon thread. The engine applies it between batches, or between decode steps in
    in-flight mode. A failed load is logged and retried at the next poll; the chunk never waits for the watcher."""

    def __init__(self, service: RolloutService, policies: Sequence[str], poll_s: float) -> None:
        self.service, self.policies, self.poll_s = service, list(policies), poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="astratk-weight-watcher", daemon=True)
        self.loads = 0

    def __enter__(self) -> WeightWatcher:  # noqa: PYI034 - typing.Self needs Python 3.11
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()  # a load in progress finishes on its own; the chunk's results do not wait for it

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            for pid in self.policies:
                if self._stop.is_set():  # the chunk is over: the next one syncs for itself
                    return
                try:
                    before = self.service.engine(pid).version
                    after = self.service.sync(pid, version=self.service._lagged_version(pid))
                    self.loads += after != before
                except Exception as e:  # noqa: BLE001 - the next poll retries; rollouts go on with what they have
                    log.warning("weight watcher: loading policy %r failed: %s", pid, e)


def episode_seed(run_seed: int, lease_id: str, episode: int) -> int:
    """The sampling seed of episode `episode` of a lease: a hash of (run seed, lease id, episode), < 2**62 (envs add
    small per-turn offsets). A re-issued lease samples the same completions, whichever worker runs it, and a
    synchronous run's rollouts are a function of the run seed."""
    digest = hashlib.blake2b(f"{run_seed}/{lease_id}/{episode}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _groups_by_role(lease: Lease, trajectories: list[Trajectory], service: str) -> tuple[Group, ...]:
    by_role: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_role.setdefault(t.role, []).append(dataclasses.replace(t, service=service))
    return tuple(Group(group_id=f"{lease.lease_id}/{role}", task=lease.task, policy_id=lease.routes[role],
                       trajectories=tuple(ts)) for role, ts in sorted(by_role.items()))
