"""The periodic held-out evaluation starts after the first one is done: both run on the same rollout workers, and the
records, the printed lines and the loggers' rows then come in version order (v0 first)."""

from __future__ import annotations

import concurrent.futures
import time
from types import SimpleNamespace

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
