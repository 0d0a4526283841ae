"""`astratk.quick.smoke`: a spec at a smoke budget, everything else as configured."""

from __future__ import annotations

from astratk.quick import smoke
from astratk.spec import RunSpec


def test_smoke_caps_steps_evaluation_and_tokens_only_when_asked():
    spec = RunSpec(rollout={"max_new_tokens": 32, "group_size": 8}, policies=[{"trainer": {"groups_per_step": 8}}])
    s = smoke(spec, steps=2, heldout=8)
    assert s.policies[0].trainer.max_steps == 2 and s.eval.max_tasks == 8
    assert s.rollout.max_new_tokens == 32 and s.rollout.group_size == 4 and s.policies[0].trainer.groups_per_step == 4
    assert smoke(spec, max_new_tokens=16).rollout.max_new_tokens == 16
    assert smoke(spec, max_new_tokens=64).rollout.max_new_tokens == 32  # a cap, never a raise
    assert spec.rollout.max_new_tokens == 32  # the spec given is left as it was
