"""`model.warm_start` for a pretrained model: its settings are checked at validation, and the cache key follows what
changes the weights (`astratk.models.pretrained_warm`). The warm start itself runs on SmolLM2 in tutorial 10's smoke
run (tests/integration/test_tutorials.py)."""

from __future__ import annotations

import dataclasses

import pytest

from astratk.envs import price_total
from astratk.envs.agent import AgentEnv
from astratk.models.pretrained_warm import warm_key
from astratk.spec import ModelSpec, WarmStartSpec


def _env(**kw):
    return AgentEnv(price_total.rows(8), price_total.agent, price_total.reward, heldout=2,
                    demonstrations=price_total.demonstrations, **kw)


def test_settings_are_checked_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    ModelSpec(path=str(tmp_path), warm_start={"steps": 4}).validate("policies[0].model")
    with pytest.raises(ValueError, match=r"policies\[0\].model.warm_start applies to a pretrained model"):
        ModelSpec(warm_start=WarmStartSpec()).validate("policies[0].model")
    for bad, match in (({"steps": 0}, "steps must be > 0"), ({"lr": float("nan")}, "lr must be > 0"),
                       ({"target": 1.5}, "target: a fraction")):
        with pytest.raises(ValueError, match=match):
            ModelSpec(path=str(tmp_path), warm_start=bad).validate("policies[0].model")


def test_the_cache_key_follows_what_changes_the_weights(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    spec, env = WarmStartSpec(steps=8), _env()
    key = warm_key(tmp_path, spec, env)
    assert warm_key(tmp_path, dataclasses.replace(spec, heldout=2), env) == key  # only what is measured after
    assert warm_key(tmp_path, dataclasses.replace(spec, steps=9), env) != key
    assert warm_key(tmp_path, spec, _env(tool_format="template")) != key  # the demonstrations render otherwise
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)  # other weights
    assert warm_key(tmp_path, spec, env) != key


def test_the_cache_key_follows_what_the_env_demonstrates(tmp_path, monkeypatch):
    """Same settings, other demonstrations (a newer env teaching whole episodes): another warm start."""
    from astratk.envs.agentbench.db import DatabaseEnv

    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    spec, env = WarmStartSpec(steps=8), DatabaseEnv(n_heldout=2, cache_dir=str(tmp_path / "db"))
    key = warm_key(tmp_path, spec, env)
    assert warm_key(tmp_path, spec, DatabaseEnv(n_heldout=2, cache_dir=str(tmp_path / "db"))) == key
    monkeypatch.setattr(DatabaseEnv, "demonstrations", lambda self, task: [(self.messages(task), "<sql>x</sql>")])
    assert warm_key(tmp_path, spec, env) != key
