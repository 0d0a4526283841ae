"""The simulated-user recipe on the real model, at smoke length: SmolLM2-135M-Instruct as the agent and, frozen, as
the customer, each through its own chat template; the customer's replies reach the agent and are counted apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from astratk.config import parse
from astratk.runtime.probe import probe

pytestmark = pytest.mark.integration

RECIPE = Path(__file__).resolve().parents[2] / "tutorials" / "simulated_user_real_model.yaml"


def test_the_recipe_probes_smollm2_serving_a_frozen_smollm2_customer(smollm2_dir, tmp_path):
    config = yaml.safe_load(RECIPE.read_text())
    [policy], [customer] = config["policies"], config["frozen"]
    assert policy["model"]["path"] == customer["model"]["path"]  # one model, two parts: the trained and the frozen
    policy["model"] = {"path": str(smollm2_dir)}  # the raw model (the recipe's warm start takes minutes)
    customer["model"]["path"] = str(smollm2_dir)
    customer["max_new_tokens"] = 8
    config["env"]["init_args"]["max_turns"] = 2
    config["rollout"].update(group_size=2, max_new_tokens=12)
    (tmp_path / "smoke.yaml").write_text(yaml.safe_dump(config))
    report = probe(parse(["--config", str(tmp_path / "smoke.yaml")]), n_tasks=1, eval_tasks=1,
                   printer=lambda line: None)
    calls = report.frozen["customer"]
    assert calls["episodes"] == 2 and calls["calls"] >= 2, calls  # the customer answered the agent's first turns
    assert 2 <= calls["tokens"] <= 8 * calls["calls"], calls  # its own cap of 8 tokens, not the agent's 12
    assert "frozen model 'customer': " in str(report) and "ms per reply" in str(report)
    assert report.policies["main"].agent is not None  # the agent's turns and endings are read as in a run


def test_the_judge_recipe_probes_smollm2_judged_by_a_frozen_smollm2(smollm2_dir, tmp_path):
    config = yaml.safe_load((RECIPE.parent / "judge_real_model.yaml").read_text())
    [policy], [judge] = config["policies"], config["frozen"]
    policy["model"]["path"] = judge["model"]["path"] = str(smollm2_dir)
    config["rollout"].update(group_size=2, max_new_tokens=12)
    (tmp_path / "smoke.yaml").write_text(yaml.safe_dump(config))
    report = probe(parse(["--config", str(tmp_path / "smoke.yaml")]), n_tasks=1, eval_tasks=1,
                   printer=lambda line: None)
    calls = report.frozen["judge"]
    assert calls["episodes"] == 2 and calls["calls"] == 2, calls  # one verdict per answer
    assert 1 <= calls["tokens"] <= 2 * 4, calls  # judge_max_tokens: 4
    assert 0.0 <= report.policies["main"].greedy_accuracy <= 1.0  # held out: the ground truth, judge or no judge
