"""The in-process `DataLayer`'s own cost: admission throughput and next-batch latency, with and without stages.

    python bench/datalayer.py                      # 400 steps x 64 groups of 8 samples x ~100 tokens
    python bench/datalayer.py --steps 50 --backlog 256   # a quick look
    (run from the repository root)

Target (issue 6): admit >= 2,000 groups/s, next-batch p50 < 5 ms.

Each step leases a step's worth of tasks, admits one pre-built group per lease (built outside the timers: rollout
workers build them), publishes a version every step and assembles the step's batch. Versions lag by 0-3, rewards are
0/1 with some all-equal groups (the zero-variance filter drops them), trajectories carry metrics and text, as real
ones do. Scenarios:
- `default`: the default stages (zero-variance filter, FIFO, max_staleness 4);
- `all`: curators (GRESO, filter-solved), zero-variance + length + format filters, EDF, replay 25 % (recent), lag
  decay 0.9, and mixing over a two-env `MixtureEnv`.
`next_batch` is timed on the call that assembles the batch (the cached repeats other ranks make cost ~1 us). Then the
same with a standing backlog of `--backlog` buffered groups (serving scans and orders the whole buffer), and the cost
and size of one pickled `state_dict()`.

Reading the figures: once more than 64 steps have been served, each assembling call also evicts the oldest batch from
the layer's 64-step retry cache, and freeing its groups (tuples of ~100k Python ints and floats for 64 x 8 x 100
tokens) costs ~2 ms: compare `--steps 60` (stages only, ~0.1-0.6 ms) with the default 400. The snapshot holds those 64
cached batches too, hence its size.
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time

from astratk.dataflow.datalayer import DataLayer
from astratk.dataflow.stages import EDF, GRESO, FilterSolved, FormatFilter, LengthFilter, Mixing, Replay
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.mixture import MixtureEnv
from astratk.records import Group, Task, Trajectory, WeightRef
from astratk.spec import DataflowSpec, PolicySpec, RunSpec, TrainerSpec


def make_spec(scenario: str, groups_per_step: int, prefetch_steps: float) -> RunSpec:
    trainer = TrainerSpec(groups_per_step=groups_per_step)
    if scenario == "default":
        return RunSpec(policies=[PolicySpec(trainer=trainer)], dataflow=DataflowSpec(prefetch_steps=prefetch_steps))
    env = MixtureEnv({"a": ArithmeticEnv(levels=[1, 2]), "b": ArithmeticEnv(levels=[3, 4])}, weights={"a": 3, "b": 1})
    dataflow = DataflowSpec(prefetch_steps=prefetch_steps, curators=[GRESO(), FilterSolved()],
                            filters=[LengthFilter(max_tokens=4096), FormatFilter(pattern=r"\d")], order=EDF(),
                            replay=Replay(ratio=0.25), lag_decay=0.9, mixing=Mixing({"a": 3, "b": 1}))
    return RunSpec(env=env, policies=[PolicySpec(trainer=trainer)], dataflow=dataflow).validate()


def make_group(task: Task, lease_id: str, version: int, rng: random.Random, samples: int, tokens: int) -> Group:
    n_prompt = 30
    solved = rng.random()
    trajs = []
    for i in range(samples):
        n = max(1, int(rng.gauss(tokens - n_prompt, 20)))
        reward = 1.0 if solved > 0.85 else 0.0 if solved < 0.15 else float(rng.random() < solved)
        trajs.append(Trajectory(
            task_id=task.task_id, group_id=f"{lease_id}/{i}", policy_id="main", role="policy",
            tokens=tuple(rng.randrange(32000) for _ in range(n_prompt + n)), n_prompt=n_prompt, loss_mask=(1,) * n,
            behavior_logprobs=tuple(-rng.random() for _ in range(n)), behavior_versions=(version,) * n,
            reward=reward, metrics={"turns": 1.0}, text=f"the answer is {rng.randrange(1000)}"))
    return Group(f"{lease_id}/policy", task, "main", tuple(trajs))


def run(scenario: str, args: argparse.Namespace) -> dict[str, float]:
    spec = make_spec(scenario, args.groups_per_step, args.prefetch_steps)
    dl = DataLayer(spec)
    rng = random.Random(0)
    admit_s, lease_s, batch_ms, cached_us, admitted = 0.0, 0.0, [], [], 0
    step = version = 0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        leases = dl.lease(args.groups_per_step * 2)
        lease_s += time.perf_counter() - t0
        groups = [make_group(lease.task, lease.lease_id, max(0, version - rng.randrange(4)), rng, args.samples,
                             args.tokens) for lease in leases]
        t0 = time.perf_counter()
        for lease, g in zip(leases, groups):
            dl.admit(lease.lease_id, [g])
        admit_s += time.perf_counter() - t0
        admitted += len(leases)
        t0 = time.perf_counter()
        batch = dl.next_batch("main", step)
        elapsed = time.perf_counter() - t0
        if batch is not None:
            batch_ms.append(elapsed * 1e3)
            t0 = time.perf_counter()
            dl.next_batch("main", step, 1, 2)
            cached_us.append((time.perf_counter() - t0) * 1e6)
            step += 1
            version += 1
            dl.publish_version(WeightRef("main", version, "memory://bench"))
    backlog = backlog_latency(dl, scenario, step, version, rng, args)
    t0 = time.perf_counter()
    blob = pickle.dumps(dl.state_dict())
    snap_ms = (time.perf_counter() - t0) * 1e3
    m = dl.metrics()
    return {"admit_groups_per_s": admitted / admit_s, "lease_tasks_per_s": admitted / lease_s,
            "batches": len(batch_ms), "next_batch_p50_ms": statistics.median(batch_ms),
            "next_batch_p99_ms": _pct(batch_ms, 99), "cached_next_batch_us": statistics.median(cached_us),
            **backlog, "snapshot_ms": snap_ms, "snapshot_mb": len(blob) / 1e6,
            "groups_received": m["data/main/groups_received"],
            **{k.rsplit("/", 1)[1]: v for k, v in m.items() if v and ("dropped" in k or "skipped" in k)}}


def backlog_latency(dl: DataLayer, scenario: str, step: int, version: int, rng: random.Random,
                    args: argparse.Namespace) -> dict[str, float]:
    """Fill the buffer to `--backlog` groups, then time assembling batches from it. Results are admitted only for
    leases the layer issued, and back-pressure would stop leasing long before: the layer's state moves into one
    whose prefetch allows the backlog (a run with a deep `prefetch_steps`), which then leases and admits it."""
    want = args.backlog
    deep = DataLayer(make_spec(scenario, args.groups_per_step, want / args.groups_per_step + 2))
    deep.load_state_dict(dl.state_dict())
    dl = deep
    while dl.metrics()["data/main/buffer_groups"] < want:  # filters drop some: admit until the buffer holds enough
        leases = dl.lease(64)
        assert leases, "the deep layer leased nothing: raise its prefetch"
        for lease in leases:
            dl.admit(lease.lease_id, [make_group(lease.task, lease.lease_id, max(0, version - rng.randrange(4)), rng,
                                                 args.samples, args.tokens)])
    # The same step assembled 20 times from the same backlog (the state restored before each, outside the timer):
    # later steps would train from later versions, and the backlog would go stale under them.
    state, times = pickle.dumps(dl.state_dict()), []
    for _ in range(20):
        dl.load_state_dict(pickle.loads(state))
        t0 = time.perf_counter()
        batch = dl.next_batch("main", step)
        times.append((time.perf_counter() - t0) * 1e3)
        assert batch is not None, "the backlog holds no batch for this step"
    return {"backlog_groups": float(args.backlog), "backlog_next_batch_p50_ms": statistics.median(times)}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--groups-per-step", type=int, default=64)
    p.add_argument("--prefetch-steps", type=float, default=2.0)
    p.add_argument("--samples", type=int, default=8, help="trajectories per group")
    p.add_argument("--tokens", type=int, default=100, help="mean tokens per trajectory (30 of them prompt)")
    p.add_argument("--backlog", type=int, default=2048, help="buffered groups for the backlog measurement")
    args = p.parse_args()
    print(f"{args.steps} steps x {args.groups_per_step} groups/step, {args.samples} samples x ~{args.tokens} tokens; "
          "target: admit >= 2000 groups/s, next-batch p50 < 5 ms")
    for scenario in ("default", "all"):
        r = run(scenario, args)
        print(f"\n[{scenario}]")
        for k, v in r.items():
            print(f"  {k:32s} {v:12.3f}" if isinstance(v, float) and not v.is_integer() else f"  {k:32s} {v:12.0f}")
        ok = r["admit_groups_per_s"] >= 2000 and r["next_batch_p50_ms"] < 5
        print(f"  {'target met':32s} {'yes' if ok else 'NO':>12s}")


if __name__ == "__main__":
    main()
