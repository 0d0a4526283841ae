"""`smoke(spec)`: the same run at a smoke-test budget: a tiny warm start, a few steps, a small evaluation.

For trying a configuration end to end in a minute (and how the test suite executes the tutorials: their
`ASTRATK_TUTORIAL_SHORT=1` mode). Everything else (env, losses, stages, cluster shape) stays as configured.

    >>> from astratk.spec import RunSpec
    >>> s = smoke(RunSpec(), steps=2)
    >>> s.policies[0].trainer.max_steps, s.policies[0].model.tiny.warm_start_steps
    (2, 30)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from astratk.spec import RunSpec


def smoke(spec: RunSpec, steps: int = 3, heldout: int = 16, cache_dir: str | None = None,
          max_new_tokens: int | None = None) -> RunSpec:
    """`spec` at a smoke budget: `steps` optimiser steps, `heldout` evaluation tasks, at most `max_new_tokens` per
    turn when given (a chat model's sentence-long answers are most of a small run's time on a CPU)."""
    spec = dataclasses.replace(spec)
    spec.policies = [dataclasses.replace(p) for p in spec.policies]
    for p in spec.policies:
        p.model = dataclasses.replace(p.model, cache_dir=cache_dir or p.model.cache_dir,
                                      tiny=dataclasses.replace(p.model.tiny, warm_start_steps=30,
                                                               warm_start_batch=32, warm_start_target=None))
        p.trainer = dataclasses.replace(p.trainer, max_steps=steps, max_time_s=None,
                                        groups_per_step=min(p.trainer.groups_per_step, 4), checkpoint_every=None)
    tokens = spec.rollout.max_new_tokens
    if max_new_tokens is not None:
        tokens = min(tokens, max_new_tokens)
    spec.rollout = dataclasses.replace(spec.rollout, group_size=min(spec.rollout.group_size, 4),
                                       tasks_per_chunk=min(spec.rollout.tasks_per_chunk, 4), max_new_tokens=tokens)
    spec.eval = dataclasses.replace(spec.eval, max_tasks=heldout, interval_s=1e6, pass_k=min(spec.eval.pass_k, 2))
    spec.dataflow = dataclasses.replace(spec.dataflow, filter_zero_variance=False, max_curator_skips=10_000)
    spec.progress = False
    spec.output_dir = os.environ.get("ASTRATK_TUTORIAL_OUTPUT", spec.output_dir)  # where the test suite wants it
    return spec


def tutorial_file(name: str) -> Path:
    """A file that ships in the repository's `tutorials/` folder (`quickstart.yaml`...), found from the repository root,
    from `tutorials/` itself (where Jupyter starts a notebook's kernel) or from any folder below the root."""
    here = Path.cwd()
    candidates = [here / name, here / "tutorials" / name] + [p / "tutorials" / name for p in here.parents]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"tutorials/{name} was not found from {here} (looked in this folder, its tutorials/ and "
                            "the tutorials/ folders above it): run the tutorial inside a clone of astratk")


def short_mode() -> bool:
    """True when the tutorials run in the test suite's short mode (`ASTRATK_TUTORIAL_SHORT=1`)."""
    return os.environ.get("ASTRATK_TUTORIAL_SHORT") == "1"
