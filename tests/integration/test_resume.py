"""Snapshot and resume on a real local Dask cluster.

Synchronous deterministic mode: a run resumed from a trainer checkpoint and the data-layer snapshot written at that
step trains on exactly the batches the uninterrupted run trained on, so every step metric after the checkpoint is
equal (not close: equal), on CPU with a seed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.runtime.run import Run
from tests.integration.test_local_run import small_spec

pytestmark = pytest.mark.integration

COMPARED = ["train_loss", "train_reward_mean", "train_completion_tokens_mean", "train_sequences", "train_groups",
            "train_policy_version", "train_behavior_version_min", "train_behavior_version_max",
            "train_staleness_max"]


class ParityEnv(ArithmeticEnv):
    """Reward = parity of the completion's length: an untrained model's groups have reward variance, so steps
    change the weights and the zero-variance filter drops some groups (rounds must then refill)."""

    def grade(self, task, text):
        return float(len(text) % 2)


def sync_spec(tmp_path, name: str, cache: str, steps: int, resume_from: str | None = None):
    spec = small_spec(tmp_path / name, max_steps=steps, checkpoint_every=2, lr=1e-3)
    spec.env = ParityEnv(levels=[1], n_heldout=16)
    spec.policies[0].model.cache_dir = cache
    spec.dataflow = dataclasses.replace(spec.dataflow, synchronous=True, filter_zero_variance=True)
    spec.eval = dataclasses.replace(spec.eval, interval_s=1e6, max_tasks=16)
    spec.progress = False
    spec.resume_from = resume_from
    return spec


def test_synchronous_resume_reproduces_the_uninterrupted_run(tmp_path):
    cache = str(tmp_path / "cache")
    full = Run(sync_spec(tmp_path, "full", cache, steps=5), printer=lambda s: None).start()
    ckpt = full.run_dir / "checkpoints" / "main" / "step=2.ckpt"
    assert ckpt.exists() and (full.run_dir / "checkpoints" / "main" / "step=4.ckpt").exists()
    lines: list[str] = []
    resumed = Run(sync_spec(tmp_path, "resumed", cache, steps=5, resume_from=str(ckpt)), printer=lines.append).start()
    assert any("resuming from" in line and "step=2.ckpt" in line for line in lines)
    a, b = full.metrics(), resumed.metrics()
    assert a.sizes["step"] == 5 and b.sizes["step"] == 3  # the resumed run trained steps 3, 4, 5
    for name in COMPARED:
        np.testing.assert_array_equal(a[name].values[..., 2:], b[name].values, err_msg=name)
    assert float(b["train_behavior_version_min"].values.ravel()[0]) == 2  # its own store starts at the checkpoint
    from astratk.weights.store import WeightStore

    assert WeightStore(str(full.run_dir / "weights")).latest("main").version == 5  # the source run is left alone
    assert WeightStore(str(resumed.run_dir / "weights")).latest("main").version == 5
    assert any("copied to" in line for line in lines)
    assert float(a["train_reward_mean"].std()) > 0  # the comparison is not of constants
    data = resumed.summary
    assert data["final_version"] == 5
    assert data["start_version"] == 2 and data["resumed_from"] == str(ckpt)
    assert any("(resumed, v2)" in line for line in lines)

    # resuming where nothing is left to train, or into the source run's own store, is refused before anything runs
    from astratk.runtime.resume import checkpoint_time_used

    last = full.run_dir / "checkpoints" / "main" / "step=4.ckpt"
    with pytest.raises(ValueError, match=r"at step 4, and policies\[0\]\.trainer\.max_steps is 4: nothing is left"):
        Run(sync_spec(tmp_path, "again", cache, steps=4, resume_from=str(last)))
    assert checkpoint_time_used(last) == 0.0  # no max_time_s: no Timer state
    same = sync_spec(tmp_path, "again", cache, steps=8, resume_from=str(last))
    same.weights.url = str(full.run_dir / "weights")
    with pytest.raises(ValueError, match="is the weight store of the run being resumed"):
        Run(same)


def test_asynchronous_resume_loses_and_duplicates_no_group(tmp_path):
    """Train 4 steps with checkpoints at 2 and 4; resume from step 2 as if the run had died after it. The resumed
    trainer never sees a group the first run trained on before its checkpoint, sees no group twice, and the
    restored data layer accounts for every task."""
    from astratk.runtime.acquisition import task_accounting
    from astratk.runtime.session import Session

    spec = small_spec(tmp_path, max_steps=4, checkpoint_every=2)
    spec.eval = dataclasses.replace(spec.eval, interval_s=1e6, max_tasks=16)
    spec.progress = False
    (tmp_path / "first").mkdir()
    with Session(spec, tmp_path / "first", lambda s: None) as first:
        first.train()
    per_step = spec.policies[0].trainer.groups_per_step
    before_ckpt = first.stream.group_ids[: 2 * per_step]
    spec.resume_from = str(tmp_path / "first" / "checkpoints" / "main" / "step=2.ckpt")
    (tmp_path / "second").mkdir()
    with Session(spec, tmp_path / "second", lambda s: None) as second:
        summary = second.train()
    again = second.stream.group_ids
    assert summary["steps"] == 2 and summary["final_version"] == 4
    assert len(again) == 2 * per_step and len(set(again)) == len(again)
    assert not set(again) & set(before_ckpt)
    accounting = task_accounting(second.counters)
    assert accounting["tasks_lost"] <= 0 and -accounting["tasks_lost"] <= second.counters.get("data/leases_expired", 0)
    assert second.counters["data/restores"] == 1
