"""How data-layer handles live through a lost control worker, without a cluster: stand-ins for distributed's actor
reproduce what it does when the actor's worker dies (a call in flight never answers; the scheduler then reports the
actor lost; a call that cannot reach the worker fails with "Unable to contact Actor's worker"). A handle must move to
the replacement as soon as it exists, not at its call timeout (60 s by default); the real kill is
tests/integration/test_datalayer_loss.py."""

from __future__ import annotations

import pickle
import threading
import time

import distributed
import pytest

from astratk.dataflow.client import DataLayerClient

TIMEOUT_S = 8.0  # the calls' timeout here; each test's handle must answer well before it


class _Pending:
    """A call that never answers (distributed's actor future once the worker holding the actor died)."""

    def result(self, timeout=None):
        time.sleep(timeout or 0)
        raise TimeoutError

    def done(self):
        return False


class _Answered:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def result(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.value

    def done(self):
        return True


class Actor:
    """Stands in for `distributed.Actor` (the handle recognises actors by their class name). `lost_after`: seconds
    after which the scheduler reports it lost (`__getattr__` raises as distributed's does); `unreachable`: calls fail
    with distributed's OSError; otherwise calls answer `answer`, or never when `hang`."""

    def __init__(self, key, answer=None, hang=False, unreachable=False, lost_after=None):
        self.key, self.answer, self.hang, self.unreachable = key, answer, hang, unreachable
        self.lost_at = None if lost_after is None else time.monotonic() + lost_after
        self._future = object()  # what distributed's actor waits on when its worker cannot be reached
        self.calls = 0

    def __reduce__(self):  # pickled copies keep who they are, and bind a new key reference when unpickled
        return (Actor, (self.key, self.answer, self.hang, self.unreachable))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if self.lost_at is not None and time.monotonic() >= self.lost_at:
            raise RuntimeError("Worker holding Actor was lost.  Status: lost")

        def call(*args, **kwargs):
            self.calls += 1
            if self.unreachable:
                return _Answered(error=OSError("Unable to contact Actor's worker"))
            return _Pending() if self.hang else _Answered(self.answer)

        return call


class Scheduler:
    """The published dataset: `dead` until `replace()`, then `new` (what the deploying process publishes)."""

    def __init__(self, dead, new):
        self.current, self.new, self.lookups = dead, new, 0

    def replace(self):
        self.current = self.new

    def get_dataset(self, name, default=None, **kwargs):
        assert name == "astratk-datalayer-run1"
        self.lookups += 1
        return pickle.loads(pickle.dumps(self.current))  # as a worker receives it


def worker_copy(actor):
    """The handle as a rollout chain carries it to a worker: pickled, with no `recover`, following the published
    actor."""
    handle = DataLayerClient(actor, call_timeout_s=TIMEOUT_S, recover=lambda: None,
                             published="astratk-datalayer-run1", poll_s=0.1)
    return pickle.loads(pickle.dumps(handle))


def replace_after(scheduler, seconds):
    timer = threading.Timer(seconds, scheduler.replace)
    timer.start()
    return timer


def test_a_copy_stuck_on_a_dead_actor_moves_to_the_published_replacement(monkeypatch):
    dead, new = Actor("DataLayer-1", hang=True), Actor("DataLayer-2", answer="admitted")
    scheduler = Scheduler(dead, new)
    monkeypatch.setattr(distributed, "get_client", lambda: scheduler)
    copy = worker_copy(dead)
    assert copy.recover is None and copy.target._future is None  # detached: never waits on the lost key
    replace_after(scheduler, 0.5)
    t = time.monotonic()
    assert copy.admit_many([]) == "admitted"
    assert time.monotonic() - t < 2.0  # the replacement plus a poll, not TIMEOUT_S
    assert copy.recoveries == 1 and copy.target.key == "DataLayer-2"
    assert copy.target._future is None


def test_a_copy_that_cannot_reach_the_actor_waits_for_the_replacement(monkeypatch):
    dead, new = Actor("DataLayer-1", unreachable=True), Actor("DataLayer-2", answer="released")
    scheduler = Scheduler(dead, new)
    monkeypatch.setattr(distributed, "get_client", lambda: scheduler)
    copy = worker_copy(dead)
    replace_after(scheduler, 0.5)
    t = time.monotonic()
    assert copy.release([("L1", 0)]) is None and copy.target.key == "DataLayer-2"
    assert time.monotonic() - t < 2.0


def test_a_copy_with_no_replacement_fails_at_its_timeout_naming_the_deployer(monkeypatch):
    dead = Actor("DataLayer-1", unreachable=True)
    monkeypatch.setattr(distributed, "get_client", lambda: Scheduler(dead, dead))
    copy = worker_copy(dead)
    copy.call_timeout_s = 1.0
    with pytest.raises(TimeoutError, match="no replacement was published as 'astratk-datalayer-run1'.*alive"):
        copy.lease(1)


def test_the_deployers_handle_recovers_when_the_scheduler_reports_the_actor_lost_mid_call():
    """A call in flight when the worker died never answers; the scheduler then reports the actor lost. The
    deploying process's handle starts the replacement at that report, not at the call's timeout."""
    dead, new = Actor("DataLayer-1", hang=True, lost_after=0.5), Actor("DataLayer-2", answer={"ok": 1.0})
    handle = DataLayerClient(dead, call_timeout_s=TIMEOUT_S, recover=lambda: new, poll_s=0.1)
    t = time.monotonic()
    assert handle.metrics() == {"ok": 1.0}
    assert time.monotonic() - t < 2.0
    assert handle.recoveries == 1 and handle.target is new
    assert dead._future is None  # its calls still in flight fail instead of waiting on the lost key


class _Late:
    """Answers `value` `after` seconds from its call: several poll slices."""

    def __init__(self, value, after):
        self.value, self.at = value, time.monotonic() + after

    def result(self, timeout=None):
        left = self.at - time.monotonic()
        if left > (timeout or 0):
            time.sleep(timeout or 0)
            raise TimeoutError
        time.sleep(max(left, 0))
        return self.value

    def done(self):
        return time.monotonic() >= self.at


def test_a_slow_answer_is_waited_for_and_the_data_layers_own_timeout_is_not_retried():
    slow = Actor("DataLayer-1")
    slow.__dict__["status"] = lambda: _Late("ready", after=0.3)  # several slices: the same actor, no replacement
    handle = DataLayerClient(slow, call_timeout_s=TIMEOUT_S, recover=lambda: None, poll_s=0.05)
    assert handle.status() == "ready" and handle.recoveries == 0

    own = Actor("DataLayer-1")
    own.__dict__["status"] = lambda: _Answered(error=TimeoutError("the data layer's own"))
    handle = DataLayerClient(own, call_timeout_s=TIMEOUT_S, recover=lambda: None, poll_s=0.05)
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="the data layer's own"):
        handle.status()
    assert time.monotonic() - t < 1.0 and handle.recoveries == 0


class _AnsweredAsTheSliceEnds:
    """The race: the answer arrives just after `result(timeout)` gave up on its slice, so `done()` is already true."""

    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        if timeout is not None:
            raise TimeoutError("timed out after 0.05 s.")  # the slice's, not the data layer's
        return self.value

    def done(self):
        return True


def test_an_answer_that_lands_as_a_slice_ends_is_returned_not_raised():
    """A trainer once stopped on "TimeoutError: timed out after 0.5 s." from its next_batch: the slice's timeout was
    taken for the data layer's own because the answer had arrived meanwhile."""
    actor = Actor("DataLayer-1")
    actor.__dict__["status"] = lambda: _AnsweredAsTheSliceEnds("ready")
    handle = DataLayerClient(actor, call_timeout_s=TIMEOUT_S, recover=lambda: None, poll_s=0.05)
    assert handle.status() == "ready" and handle.recoveries == 0
