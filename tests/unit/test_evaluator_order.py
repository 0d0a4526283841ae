"""The periodic held-out evaluation starts after the first one is done: both run on the same rollout workers, and the
records, the printed lines and the loggers' rows then come in version order (v0 first)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest

from astratk.runtime.evaluation import Evaluator
from astratk.spec import EvalSpec, RunSpec


class Client:
    def __init__(self):
        self.submitted = []

    def submit(self, fn, ctx, versions, *args, **kwargs):
        self.submitted.append(versions)
        return SimpleNamespace(result=lambda timeout: {"version": 2.0, "accuracy": 0.5, "published_at": 0.0})


def test_the_periodic_loop_waits_for_the_first_evaluation():
    spec = RunSpec(eval=EvalSpec(interval_s=0.05))
    store = SimpleNamespace(latest=lambda pid: SimpleNamespace(version=2))
    client = Client()
    evaluator = Evaluator(client, SimpleNamespace(spec=spec), "main", store)
    first: concurrent.futures.Future = concurrent.futures.Future()
    evaluator.start(evaluated={"main": 0}, after=first)
    try:
        time.sleep(0.5)
        assert client.submitted == []  # v2 is due, but v0's evaluation is still running
        first.set_result({"version": 0.0, "accuracy": 0.25})
        deadline = time.monotonic() + 10
        while not client.submitted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.submitted == [{"main": None}]  # then the newest, as every periodic evaluation
    finally:
        evaluator.stop()


def test_a_stopped_loop_ends_while_it_waits():
    evaluator = Evaluator(Client(), SimpleNamespace(spec=RunSpec()), "main", SimpleNamespace(latest=lambda pid: None))
    evaluator.start(after=concurrent.futures.Future())
    evaluator.stop(timeout=5)
    assert not evaluator._thread.is_alive()


def test_an_evaluation_in_flight_is_said_in_words():
    future: concurrent.futures.Future = concurrent.futures.Future()
    client = SimpleNamespace(submit=lambda *a, **k: future)
    evaluator = Evaluator(client, SimpleNamespace(spec=RunSpec(eval=EvalSpec(max_tasks=64))), "main",
                          SimpleNamespace(latest=lambda pid: None))
    assert evaluator.running() is None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        done = pool.submit(evaluator.evaluate, 0)
        deadline = time.monotonic() + 10
        while evaluator.running() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert evaluator.running().startswith("main v0 for ") and evaluator.running().endswith("on 64 held-out tasks")
        future.set_result({"version": 0.0, "accuracy": 0.5, "published_at": 0.0})
        done.result(timeout=10)
    assert evaluator.running() is None


# --------------------------------------------------------------- eval.timeout_s: time on the worker, not in the queue
class SlowService:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def evaluate_versions(self, versions, max_tasks, pass_k):
        time.sleep(self.seconds)
        return {"version": 0.0, "accuracy": 0.5, "published_at": 0.0}


HOLDING = threading.Event()  # the cluster runs in this process: a rollout chunk's stand-in says it has the slot


def hold(seconds: float) -> None:
    HOLDING.set()
    time.sleep(seconds)


def chunk_holding_the_slot(client, seconds: float):
    """A rollout chunk's stand-in that has started (holds the worker's one rollout slot): an evaluation, which goes
    ahead of queued chunks, now queues behind it."""
    HOLDING.clear()
    chunk = client.submit(hold, seconds, resources={"rollout_main": 1}, pure=False)
    assert HOLDING.wait(30)
    return chunk


@pytest.fixture(scope="module")
def dask_client():
    """A real in-process Dask cluster whose one worker holds one rollout slot, as a rollout worker does."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, processes=False, threads_per_worker=2, resources={"rollout_main": 1},
                      dashboard_address=None) as cluster, Client(cluster) as client:
        yield client


def evaluator_on(client, monkeypatch, *, run_s: float, eval_timeout_s: float) -> Evaluator:
    from astratk.rollout import tasks

    monkeypatch.setattr(tasks, "get_service", lambda ctx: SlowService(run_s))
    spec = RunSpec(eval=EvalSpec(timeout_s=eval_timeout_s))
    return Evaluator(client, SimpleNamespace(spec=spec), "main", SimpleNamespace(latest=lambda pid: None))


@pytest.mark.slow
def test_time_queued_behind_a_rollout_chunk_does_not_count_against_eval_timeout(dask_client, monkeypatch):
    evaluator = evaluator_on(dask_client, monkeypatch, run_s=1.0, eval_timeout_s=2.5)
    chunk = chunk_holding_the_slot(dask_client, 4.0)
    t0 = time.monotonic()
    record = evaluator.evaluate(0)  # waited ~4 s for the slot, ran 1 s: within eval.timeout_s
    assert record["accuracy"] == 0.5 and time.monotonic() - t0 >= 3.0 and chunk.done()


@pytest.mark.slow
def test_an_evaluation_running_past_eval_timeout_is_given_up_and_says_so(dask_client, monkeypatch):
    evaluator = evaluator_on(dask_client, monkeypatch, run_s=4.0, eval_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"more than eval\.timeout_s \(2s\) on its worker; it queued \d+s"):
        evaluator.evaluate(0)
    assert time.monotonic() - t0 < 10 and evaluator.records == [] and evaluator.running() is None


@pytest.mark.slow
def test_the_whole_wait_is_bounded_even_if_it_never_starts(dask_client, monkeypatch):
    evaluator = evaluator_on(dask_client, monkeypatch, run_s=0.1, eval_timeout_s=60.0)
    chunk = chunk_holding_the_slot(dask_client, 4.0)
    with pytest.raises(TimeoutError, match=r"more than 2s in all .* had not started"):
        evaluator.evaluate(0, timeout_s=2.0)
    chunk.result()


@pytest.mark.slow
def test_an_abandoned_evaluation_leaves_no_record_and_no_line(dask_client, monkeypatch):
    evaluator = evaluator_on(dask_client, monkeypatch, run_s=4.0, eval_timeout_s=120.0)
    lines = []
    evaluator.on_record = lines.append
    future = evaluator.evaluate_in_background(0, timeout_s=120.0, start_after_s=0.0)
    deadline = time.monotonic() + 20
    while evaluator.running() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    evaluator.abandon()
    with pytest.raises(TimeoutError, match="given up: the run is ending"):
        future.result(timeout=10)
    assert evaluator.records == [] and lines == [] and evaluator.running() is None


def test_the_summary_says_the_gain_is_unknown_when_an_evaluation_failed():
    from astratk.runtime.run import Run

    def report(before: float, after: float) -> str:
        lines: list[str] = []
        summary = {"accuracy_before": before, "accuracy_after": after, "accuracy_gain": after - before,
                   "accuracy_best": after, "final_version": 3, "time_to_target_s": None, "target_gain": 0.15,
                   "train_time_s": 60.0, "steps": 3, "data_wait_fraction": 0.1, "wall_time_s": 90.0}
        Run._report(SimpleNamespace(print=lines.append, spec=RunSpec()), summary, {})
        return "\n".join(lines)

    assert "gain +25.0 points" in report(0.25, 0.5)
    nan = float("nan")
    assert "gain unknown (the first version's evaluation failed: see above)" in report(nan, 0.5)
    assert "gain unknown (the first and last version's evaluation failed" in report(nan, nan)
    assert "+nan" not in report(0.25, nan)
