"""Trainer steps/s and the share of wall time the trainer waits for data, measured side by side in one run.

1. trainer alone: `PolicyModule` optimiser steps on batches collated from pre-generated groups (no waiting), same
   shapes as the run (groups_per_step x group_size sequences of the env's prompts and the model's completions);
2. the whole pipeline: `astratk run` on the same config with a time budget; steps/s, data-wait share, rollout
   samples/s, from the run's summary and metrics.

    python bench/pipeline.py --config tutorials/quickstart.yaml --seconds 60

The ratio pipeline/trainer-alone says how close the asynchronous pipeline comes to keeping the trainer busy.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch


def trainer_alone(spec, model_path: str, steps: int) -> float:
    """Optimiser steps/s on real rollouts generated once up front (the trainer never waits)."""
    import dataclasses

    from astratk.contracts import SamplingParams
    from astratk.dataflow.advantages import get_advantage
    from astratk.dataflow.datalayer import Lease
    from astratk.engines.torch_engine import TorchEngine
    from astratk.records import Group
    from astratk.rollout.service import _groups_by_role
    from astratk.training.collate import collate
    from astratk.training.module import PolicyModule

    p = spec.policies[0]
    engine = TorchEngine(model_path)
    tasks = [t for _, t in zip(range(p.trainer.groups_per_step), spec.env.tasks("train"))]
    sampling = SamplingParams(temperature=spec.rollout.temperature, max_tokens=spec.rollout.max_new_tokens)

    async def roll() -> list[Group]:
        out = []
        for i, task in enumerate(tasks):
            lease = Lease(f"b{i}", task, {"policy": p.policy_id}, 0.0)
            eps = await asyncio.gather(*(spec.env.rollout(task, {"policy": engine}, sampling,
                                                          policy_ids=lease.routes, group_id=f"b{i}/{j}")
                                         for j in range(spec.rollout.group_size)))
            trajs = [t.with_reward(r) for ep in eps for t, r in zip(ep, spec.env.score(task, ep))]
            [g] = _groups_by_role(lease, trajs, "bench")
            out.append(dataclasses.replace(g, advantages=tuple(get_advantage("dr_grpo")(g.rewards))))
        return out

    groups = asyncio.run(roll())
    engine.close()
    batch = collate(groups, engine.tokenizer.pad_token_id)
    module = PolicyModule(model_path, p.loss, lr=p.trainer.lr, horizon=spec.rollout.max_new_tokens)
    opt = module.configure_optimizers()
    module.log_dict = lambda *a, **k: None  # no Trainer attached here
    for i in range(steps + 2):
        if i == 2:
            start = time.perf_counter()  # two warm-up steps
        loss = module.training_step(batch, i)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return steps / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tutorials/quickstart.yaml")
    ap.add_argument("--seconds", type=float, default=60.0, help="training time budget of the pipeline run")
    ap.add_argument("--steps", type=int, default=20, help="trainer-alone steps")
    args = ap.parse_args()

    from astratk.config import load_spec
    from astratk.models import ensure_model
    from astratk.runtime.run import Run

    spec = load_spec(args.config, ["--eval.interval_s", "1000", "--eval.max_tasks", "64"])
    spec.policies[0].trainer.max_time_s = args.seconds
    torch.set_num_threads(spec.cluster.torch_threads)
    model_path = str(ensure_model(spec.policies[0].model, spec.env))
    alone = trainer_alone(spec, model_path, args.steps)
    result = Run(spec, printer=lambda s: None).start()
    s = result.summary
    ds = result.metrics()
    pipeline = s["steps"] / s["train_time_s"]
    samples = float(ds["train_sequences"].sum()) / s["train_time_s"]
    compute = float(ds["train_step_compute_s"].mean())
    print(f"config {args.config}; torch threads per process {spec.cluster.torch_threads}; "
          f"{spec.policies[0].trainer.groups_per_step} groups x {spec.rollout.group_size} samples per step")
    print(f"{'measure':<44}{'value':>12}")
    print(f"{'trainer alone, steps/s':<44}{alone:>12.2f}")
    print(f"{'pipeline, steps/s':<44}{pipeline:>12.2f}")
    print(f"{'ratio pipeline / trainer alone':<44}{pipeline / alone:>12.2f}")
    print(f"{'pipeline, trainer compute s/step':<44}{compute:>12.3f}")
    print(f"{'pipeline, share of wall time waiting for data':<44}{s['data_wait_fraction']:>12.1%}")
    print(f"{'pipeline, trained samples/s':<44}{samples:>12.1f}")


if __name__ == "__main__":
    main()
