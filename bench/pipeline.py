"""Trainer steps/s and the share of wall time the trainer waits for data, measured side by side in one run.

1. trainer alone: `PolicyModule` optimiser steps on batches collated from pre-generated groups (no waiting), same
   shapes as the run (groups_per_step x group_size sequences of the env's prompts and the model's completions);
2. the whole pipeline: `astratk run` on the same config with a time budget; steps/s, data-wait share, rollout
   samples/s, from the run's summary and metrics.

    python bench/pipeline.py --config tutorials/quickstart.yaml --seconds 60

Also the whole run's steps/s and samples/s (wall time from start-up to the last evaluation), generated samples/s
(dropped groups included) and the groups dropped. The ratio pipeline/trainer-alone says how close the asynchronous pipeline comes to keeping the trainer busy.
"""

from __future__ import annotations

import argparse
import time

import torch

from astratk.cpu import run_threads


def trainer_alone(spec, model_path: str, steps: int) -> float:
    """Optimiser steps/s on one step's batch of real rollouts made up front by the real path (rollout service,
    in-process data layer, collate), so the trainer never waits."""
    from astratk.dataflow.datalayer import DataLayer
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService
    from astratk.runtime.deploy import publish_initial
    from astratk.training.collate import collate
    from astratk.training.module import PolicyModule
    from astratk.weights.store import WeightStore

    p = spec.policies[0]
    store = WeightStore("memory://bench-pipeline")
    publish_initial(store, p.policy_id, model_path)
    service = RolloutService(RunContext("bench", spec, {p.policy_id: model_path}, store.url))
    datalayer = DataLayer(spec)
    while (groups := datalayer.next_batch(p.policy_id, 0)) is None:
        for res in service.score(service.rollout(datalayer.lease(spec.rollout.tasks_per_chunk))):
            datalayer.admit(res.lease_id, list(res.groups))
    batch = collate(groups, service.engine(p.policy_id).tokenizer.pad_token_id)
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
    torch.set_num_threads(run_threads(spec).trainer)
    model_path = str(ensure_model(spec.policies[0].model, spec.env))
    alone = trainer_alone(spec, model_path, args.steps)
    result = Run(spec, printer=lambda s: None).start()
    s = result.summary
    ds = result.metrics()
    pipeline = s["steps"] / s["train_time_s"]
    samples = float(ds["train_sequences"].sum()) / s["train_time_s"]
    generated = float(ds["acquisition_samples"].sum()) / s["train_time_s"] if "acquisition_samples" in ds else 0.0
    dropped = float(ds["dropped"].sum()) if "dropped" in ds else 0.0
    whole = s["steps"] / s["wall_time_s"]
    compute = float(ds["train_step_compute_s"].mean())
    print(f"config {args.config}; torch threads per process {run_threads(spec).trainer}; "
          f"{spec.policies[0].trainer.groups_per_step} groups x {spec.rollout.group_size} samples per step")
    print(f"{'measure':<44}{'value':>12}")
    print(f"{'trainer alone, steps/s':<44}{alone:>12.2f}")
    print(f"{'pipeline, steps/s':<44}{pipeline:>12.2f}")
    print(f"{'ratio pipeline / trainer alone':<44}{pipeline / alone:>12.2f}")
    print(f"{'pipeline, trainer compute s/step':<44}{compute:>12.3f}")
    print(f"{'pipeline, share of wall time waiting for data':<44}{s['data_wait_fraction']:>12.1%}")
    print(f"{'pipeline, trained samples/s':<44}{samples:>12.1f}")
    print(f"{'pipeline, generated samples/s (with dropped)':<44}{generated:>12.1f}")
    print(f"{'pipeline, groups dropped (all reasons)':<44}{dropped:>12.0f}")
    print(f"{'whole run (start-up + evals), steps/s':<44}{whole:>12.2f}")
    print(f"{'whole run, trained samples/s':<44}{float(ds['train_sequences'].sum()) / s['wall_time_s']:>12.1f}")


if __name__ == "__main__":
    main()
