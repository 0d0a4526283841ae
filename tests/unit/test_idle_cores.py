"""A waiting trainer lends its cores to the rollout workers on its host (`astratk.idle_cores`)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from astratk import idle_cores
from astratk.spec import ClusterSpec, DataflowSpec, RunSpec
from astratk.training.data import GroupStream, StepTicket


@pytest.fixture
def lender_dir(tmp_path):
    yield tmp_path / "idle"
    idle_cores.uninstall()


def _in_thread(fn):
    """Run `fn` on a fresh thread (torch's thread count is per thread, as on an engine's batcher thread)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_marker_lends_while_held_and_a_dead_process_lends_nothing(lender_dir):
    marker = idle_cores.IdleMarker(lender_dir, lend=2)
    assert idle_cores.lent_threads(lender_dir) == 0  # no directory yet
    with marker.waiting():
        assert idle_cores.lent_threads(lender_dir) == 2
        assert idle_cores.lent_threads(lender_dir / "other-run") == 0
    assert idle_cores.lent_threads(lender_dir) == 0
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    (lender_dir / f"{dead.stdout.strip()}-3").touch()  # a trainer killed while it waited
    (lender_dir / "junk").touch()
    assert idle_cores.lent_threads(lender_dir) == 0
    with idle_cores.IdleMarker(lender_dir, lend=0).waiting():  # lends nothing: marks nothing
        assert idle_cores.lent_threads(lender_dir) == 0


def test_the_engine_thread_borrows_while_the_trainer_waits_and_gives_back(lender_dir, monkeypatch):
    monkeypatch.setattr(idle_cores, "CHECK_EVERY_S", 0.0)
    idle_cores.install(lender_dir, own=1, cap=3)

    def adjusted():
        idle_cores.adjust()
        return torch.get_num_threads()

    assert _in_thread(adjusted) == 1
    marker = idle_cores.IdleMarker(lender_dir, lend=1)
    with marker.waiting():
        assert _in_thread(adjusted) == 2
    with marker.waiting():
        other = idle_cores.IdleMarker(lender_dir, lend=5)
        other.path = lender_dir / f"{os.getppid()}-5"  # a second trainer (another live process) waits too
        with other.waiting():
            assert _in_thread(adjusted) == 3  # capped at the cores
    assert _in_thread(adjusted) == 1
    idle_cores.uninstall()
    assert _in_thread(lambda: (idle_cores.adjust(), torch.get_num_threads())[1]) == torch.get_num_threads()


def test_threads_are_read_at_most_every_check_interval(lender_dir, monkeypatch):
    monkeypatch.setattr(idle_cores, "CHECK_EVERY_S", 60.0)
    lender = idle_cores.install(lender_dir, own=1, cap=4)
    assert lender.threads() == 1
    with idle_cores.IdleMarker(lender_dir, lend=1).waiting():
        assert lender.threads() == 1  # the last reading still stands
        monkeypatch.setattr(idle_cores, "CHECK_EVERY_S", 0.0)
        assert lender.threads() == 2


def test_only_work_on_lent_threads_is_counted(lender_dir, monkeypatch):
    monkeypatch.setattr(idle_cores, "CHECK_EVERY_S", 0.0)
    lender = idle_cores.install(lender_dir, own=1, cap=2)

    def batch(seconds):
        idle_cores.adjust()
        time.sleep(seconds)  # a decode step
        idle_cores.adjust()
        time.sleep(seconds)
        idle_cores.settle()  # the batch is done

    _in_thread(lambda: batch(0.05))
    assert lender.borrowed_s == 0  # nothing lent
    with idle_cores.IdleMarker(lender_dir, lend=1).waiting():
        _in_thread(lambda: batch(0.05))
        time.sleep(0.2)  # the engine idles between batches: not counted
        _in_thread(lambda: batch(0.05))
    assert 0.18 <= lender.borrowed_s < 0.3


def _spec(**cluster):
    return dataclasses.replace(RunSpec(), cluster=ClusterSpec(**cluster))


@pytest.mark.parametrize(("spec", "lend"), [
    (_spec(), 1),
    (_spec(rollout_workers=2), 0),  # 1 thread over 2 workers
    (_spec(lend_idle_cores=False), 0),
    (_spec(torch_threads=1), 0),  # threads given by hand are used as given
    (_spec(processes=False), 0),  # one process: it has every core already
    (dataclasses.replace(_spec(), dataflow=DataflowSpec(synchronous=True)), 0),  # each phase has every core
])
def test_who_lends(spec, lend):
    assert idle_cores.lend_per_worker(spec, 1, spec.cluster.local_rollout_workers()) == lend
    assert idle_cores.lend_per_worker(_spec(), 4, 2) == 2


class _SlowData:
    """A data layer whose batch comes after a while; it records whether the trainer's marker was up meanwhile."""

    def __init__(self, directory):
        self.directory, self.seen = directory, []

    def next_batch(self, *args):
        return None

    def metrics(self):
        return {}

    def drops(self):
        return {}

    def wait_batch(self, *args, **kwargs):
        self.seen.append(idle_cores.lent_threads(self.directory))
        return [_Group()]


@dataclasses.dataclass
class _Group:
    group_id: str = "g"


def test_the_stream_marks_only_its_wait(lender_dir, monkeypatch):
    data = _SlowData(lender_dir)
    stream = GroupStream(data, "main", pad_id=0)  # type: ignore[arg-type]
    stream.idle_marker = idle_cores.IdleMarker(lender_dir, lend=1)
    monkeypatch.setattr("astratk.training.data.collate", lambda groups, pad: groups)
    assert stream.resolve(StepTicket(0)) == [_Group()]
    assert data.seen == [1]  # up while it waited
    assert idle_cores.lent_threads(lender_dir) == 0  # down once the batch is in hand
