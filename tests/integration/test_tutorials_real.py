"""The tutorials on the real model (SmolLM2-135M-Instruct) as notebooks, as tests/integration/test_tutorials.py runs
the others: a file of their own so that pytest-xdist can run them beside those (it hands out whole files)."""

from __future__ import annotations

import pytest

from tests.integration.test_tutorials import REAL_MODEL, run_notebook, short_environment

pytestmark = [pytest.mark.integration, pytest.mark.realmodel]


@pytest.fixture(scope="module")
def short_env(tmp_path_factory):
    return short_environment(tmp_path_factory)


@pytest.mark.parametrize("name", REAL_MODEL)
def test_real_model_tutorial_runs_as_a_notebook_from_its_folder(name, short_env, monkeypatch):
    run_notebook(name, short_env, monkeypatch)
