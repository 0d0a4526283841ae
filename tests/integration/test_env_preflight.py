"""A reward function in the user's own module that the workers cannot import fails the deployment at start, in one
line that names the module and how to make it importable (`astratk.runtime.preflight`); functions defined in the
driver itself travel by value and pass."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid

import distributed
import pytest

from astratk.envs.function import FunctionEnv
from astratk.records import RunContext
from astratk.runtime.deploy import deploy
from astratk.runtime.preflight import check_env_loads
from astratk.spec import PolicySpec, RunSpec, StartError

pytestmark = pytest.mark.integration

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]


@pytest.fixture(scope="module")
def cluster():
    """A cluster of your own whose worker started before the user's module existed (as `dask worker` processes on
    other machines are)."""
    with (distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                                   dashboard_address="127.0.0.1:0",
                                   resources={"control": 1, "rollout_main": 1, "score": 1}) as c,
          distributed.Client(c, set_as_default=False) as client):
        yield client


def user_module(tmp_path, monkeypatch):
    name = f"my_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        def exact(completions, answer, **kwargs):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    monkeypatch.setitem(sys.modules, name, module)
    return name, module


def test_an_unimportable_reward_module_fails_in_one_line(cluster, tmp_path, monkeypatch):
    name, module = user_module(tmp_path, monkeypatch)
    env = FunctionEnv(ROWS, module.exact, heldout=5)
    with pytest.raises(StartError) as e:
        check_env_loads(cluster, env, timeout_s=60)
    message = str(e.value)
    assert "\n" not in message
    assert f"cannot import {name!r}" in message and "(this process can)" in message
    assert "PYTHONPATH" in message and "pip install -e" in message


def test_deploy_checks_before_it_starts_anything(cluster, tmp_path, monkeypatch):
    name, module = user_module(tmp_path, monkeypatch)
    spec = RunSpec(env=FunctionEnv(ROWS, module.exact, heldout=5), policies=[PolicySpec()])
    ctx = RunContext(f"pre-{uuid.uuid4().hex[:6]}", spec, {"main": None}, f"memory://pre-{uuid.uuid4().hex[:6]}")
    with pytest.raises(StartError, match=f"cannot import {name!r}"):
        deploy(ctx, cluster, timeout_s=60)
    assert not cluster.list_datasets()  # no data layer was published


def test_functions_defined_in_the_driver_travel_by_value(cluster):
    def exact(completions, answer, **kwargs):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    check_env_loads(cluster, FunctionEnv(ROWS, exact, heldout=5), timeout_s=60)  # no error
