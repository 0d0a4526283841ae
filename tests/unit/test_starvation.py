"""Starvation explained while it happens: `StarvationMonitor` over a scripted data layer, and the advice it gives
(`astratk.dataflow.learning_signal`)."""

from __future__ import annotations

import doctest

import pytest

from astratk.dataflow import learning_signal
from astratk.dataflow.learning_signal import SignalReading, advice, group_signal_probability
from astratk.records import Drop
from astratk.runtime.starvation import StarvationMonitor
from astratk.spec import PolicySpec, RolloutSpec, RunSpec


def test_the_module_examples_hold():
    assert doctest.testmod(learning_signal, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0


def test_group_signal_probability():
    assert group_signal_probability(0.5, 2) == pytest.approx(0.5)
    assert group_signal_probability(0.0, 8) == 0.0 == group_signal_probability(1.0, 8)
    assert group_signal_probability(0.01, 8) == pytest.approx(1 - 0.99 ** 8 - 0.01 ** 8)


def _advice(**reading):
    return advice(SignalReading(**reading), group_size=8, temperature=1.0, max_new_tokens=16, max_staleness=4)


def test_advice_follows_what_was_seen():
    hard = _advice(groups=100, admitted=2, dropped={"zero_variance": 98}, samples=800, reward_mean=0.01,
                   unfinished=0.05, greedy_accuracy=0.2)
    assert hard[0].startswith("lower rollout.temperature (now 1:")
    assert not any("max_new_tokens" in a for a in hard)  # 5% truncated: not the problem
    assert any("rollout.group_size (now 8" in a for a in hard) and any("curriculum" in a for a in hard)
    cut = _advice(groups=100, admitted=2, dropped={"zero_variance": 98}, samples=800, reward_mean=0.01,
                  unfinished=0.7)
    assert any("raise rollout.max_new_tokens (now 16: 70%" in a for a in cut)
    assert not any("temperature" in a for a in cut)  # no greedy accuracy known: no claim about it
    easy = _advice(groups=100, admitted=2, dropped={"zero_variance": 98}, samples=800, reward_mean=0.97)
    assert len(easy) == 1 and "filter_solved" in easy[0]
    stale = _advice(groups=100, admitted=10, dropped={"stale": 90}, samples=800, reward_mean=0.4)
    assert stale[0].startswith("raise dataflow.max_staleness (now 4)") and len(stale) == 1
    assert "length_filter" in _advice(groups=10, admitted=0, dropped={"too_long": 10}, samples=80)[0]


class FakeDataLayer:
    """Counters and drops as a test sets them, read as the monitor reads the real one."""

    def __init__(self):
        self.m: dict[str, float] = {}
        self.d: list[Drop] = []

    def metrics(self, timeout=None):
        return dict(self.m)

    def drops(self, timeout=None):
        return list(self.d)

    def roll(self, groups: int, admitted: int, reward: float, unfinished: float = 0.0, served: int = 0):
        k = "data/main/"
        for name, v in (("groups_received", groups), ("groups_admitted", admitted), ("samples_received", 8 * groups),
                        ("reward_sum_received", reward * 8 * groups), ("samples_unfinished", unfinished * 8 * groups),
                        ("groups_served", served)):
            self.m[k + name] = self.m.get(k + name, 0.0) + v
        if groups - admitted:
            old = sum(d.count for d in self.d)
            self.d = [Drop("admission", "zero_variance", "groups", "main", old + groups - admitted)]


class Stream:
    waiting_since: float | None = None


def _monitor(dl, stream=None, greedy=None):
    spec = RunSpec(policies=[PolicySpec()], rollout=RolloutSpec(max_new_tokens=16))
    lines: list[str] = []
    mon = StarvationMonitor(spec, dl, lines.append, streams={"main": stream} if stream else {},
                            greedy=greedy or (lambda pid: None))
    return mon, lines


def test_a_waiting_trainer_with_dropped_groups_is_explained_within_25_seconds_and_counted():
    dl, stream = FakeDataLayer(), Stream()
    mon, _lines = _monitor(dl, stream, greedy=lambda pid: 0.09)
    dl.roll(10, 5, 0.3)
    mon.check(0.0)  # training happily: the baseline
    stream.waiting_since = 1.0
    dl.roll(40, 2, 0.01, unfinished=0.6)
    assert mon.check(10.0) == []  # waiting 9 s: not yet
    [line] = mon.check(25.0)
    assert line.startswith("[starving] policy 'main': trainer waiting 24s for a batch; 40 groups rolled out, 2 with "
                           "signal (5%), 38 dropped (zero_variance 38)")
    assert "mean reward 0.010 sampled vs 0.090 greedy" in line and "60% of samples hit max_new_tokens" in line
    assert "lower rollout.temperature" in line and "raise rollout.max_new_tokens (now 16" in line
    assert mon.check(30.0) == []  # said once a minute while it lasts
    dl.roll(5, 0, 0.0)
    assert len(mon.check(86.0)) == 1
    assert mon.counters() == {"starvation/main/warnings": 2.0}
    stream.waiting_since = None
    assert mon.check(90.0) == []
    stream.waiting_since = 91.0  # a new wait: its own window and its own first warning
    dl.roll(3, 0, 0.0)
    [line] = mon.check(112.0)
    assert "3 groups rolled out, 0 with signal" in line


def test_slow_rollouts_without_drops_are_not_starvation_but_no_rollout_at_all_is_said():
    dl, stream = FakeDataLayer(), Stream()
    mon, _lines = _monitor(dl, stream)
    mon.check(0.0)
    stream.waiting_since = 0.0
    dl.roll(3, 3, 0.5)
    assert mon.check(30.0) == []
    stream.waiting_since = 31.0
    mon.check(31.0)
    assert mon.check(60.0) == []  # 29 s with no rollout: engines may still be loading
    [line] = mon.check(92.0)
    assert "no rollout arrived meanwhile" in line and "waited 61s" in line


def test_a_trainer_in_another_process_is_starving_when_no_batch_is_served():
    dl = FakeDataLayer()
    mon, _lines = _monitor(dl)
    dl.m["data/main/trainer_attached"] = 1.0  # `astratk train fit` attached
    dl.roll(8, 8, 0.5, served=8)
    mon.check(0.0)
    dl.roll(20, 0, 0.0)
    assert mon.check(15.0) == []
    [line] = mon.check(21.0)
    assert "20 groups rolled out, 0 with signal" in line


def test_no_starvation_is_said_for_a_trainer_elsewhere_that_has_not_attached_or_has_ended():
    # a deployment whose trainer finished (`astratk train fit --trainer.max_steps 5` exited): no one waits for a
    # batch, so no "[starving] ... trainer waiting" line; the deployment says once that the trainer ended instead
    dl = FakeDataLayer()
    mon, _lines = _monitor(dl)
    mon.check(0.0)
    dl.roll(20, 0, 0.0)
    assert mon.check(30.0) == [] and mon.check(100.0) == []  # not attached yet
    dl.m["data/main/trainer_attached"] = 1.0
    dl.roll(8, 8, 0.5, served=8)
    mon.check(110.0)
    dl.m.update({"data/main/trainer_attached": 0.0, "data/main/trainer_detached_step": 5.0})
    dl.roll(20, 0, 0.0)
    assert mon.check(140.0) == [] and mon.check(300.0) == []
    dl.m["data/main/trainer_attached"] = 1.0  # another trainer attaches: a wait counts from then
    mon.check(301.0)
    assert mon.check(310.0) == []
    dl.roll(20, 0, 0.0)
    [line] = mon.check(325.0)
    assert "[starving]" in line and "trainer waiting 25s" in line  # counted from the reading before the attach


def test_an_agent_that_never_calls_its_tools_is_said_with_the_episodes_of_the_wait():
    dl, stream = FakeDataLayer(), Stream()
    spec = RunSpec(policies=[PolicySpec()], rollout=RolloutSpec(max_new_tokens=16))
    lines: list[str] = []
    mon = StarvationMonitor(spec, dl, lines.append, streams={"main": stream}, tools={"main": (True, "hermes")})
    k = "data/main/agent/"
    dl.m.update({k + "episodes": 80.0, k + "tool_calls": 50.0, k + "turns": 160.0})  # before the wait: calls made
    dl.roll(10, 5, 0.3)
    mon.check(0.0)
    stream.waiting_since = 1.0
    dl.roll(32, 0, 0.0)
    dl.m.update({k + "episodes": 80.0 + 256, k + "turns": 160.0 + 256, k + "unparsed_calls": 0.0,
                 k + "turn_limit": 0.0, k + "context_limit": 0.0})  # the wait's 256 episodes: no call at all
    [line] = mon.check(25.0)
    assert ("agent: 256 episodes, 0.00 tool calls and 0.00 unparseable per episode, 1.0 turns per episode; 0% ended "
            "at the turn limit, 0% at the context limit; tools in the prompt: yes (hermes)") in line
    assert "the model made no tool call in 256 episodes" in line


def test_no_rollout_while_the_workers_evaluate_is_said_as_such():
    dl, stream = FakeDataLayer(), Stream()
    spec = RunSpec(policies=[PolicySpec()], rollout=RolloutSpec(max_new_tokens=16))
    busy = {"now": "main v0 for 230s on 64 held-out tasks"}
    mon = StarvationMonitor(spec, dl, lambda line: None, streams={"main": stream}, busy=lambda: busy["now"])
    mon.check(0.0)
    stream.waiting_since = 0.0
    [line] = mon.check(61.0)
    assert "the rollout workers are evaluating (main v0 for 230s on 64 held-out tasks)" in line
    assert "fewer eval.max_tasks" in line and "alive?" not in line
    assert "rollout.concurrent_chunks: 2" in line  # the key that runs an evaluation beside a chunk (default 1)
    busy["now"] = None
    [line] = mon.check(122.0)
    assert "are the rollout workers alive?" in line


def test_no_rollout_while_tasks_are_out_says_they_are_still_generating():
    # SmolLM2's tool agent on 2 cores: the first chunk of 4 tasks x 8 episodes takes ~3 minutes, and the line used to
    # ask whether the workers were alive
    dl, stream = FakeDataLayer(), Stream()
    spec = RunSpec(policies=[PolicySpec()], rollout=RolloutSpec(max_new_tokens=96, tasks_per_chunk=4, group_size=8))
    mon = StarvationMonitor(spec, dl, lambda line: None, streams={"main": stream})
    mon.check(0.0)
    stream.waiting_since = 0.0
    dl.m.update({"data/leases_outstanding": 4.0, "data/oldest_lease_s": 75.0})
    [line] = mon.check(61.0)
    assert "4 tasks are out on the rollout workers, the oldest for 75s" in line and "alive?" not in line
    assert "4 tasks x 8 samples, up to 96 tokens per turn" in line and "fewer rollout.tasks_per_chunk" in line
    dl.m.update({"data/leases_outstanding": 0.0})
    del dl.m["data/oldest_lease_s"]
    [line] = mon.check(122.0)
    assert "no task is out on a rollout worker: are the rollout workers alive?" in line


def test_a_run_whose_first_chunks_were_all_too_long_is_ended_once():
    # rollout.tasks_per_chunk 8, one rollout worker: the first 2 chunks = 16 tasks. Until then, or once any task
    # completes normally, or once any group arrives, the run goes on.
    from astratk.runtime.starvation import nothing_to_train

    spec = RunSpec(policies=[PolicySpec()], rollout=RolloutSpec(tasks_per_chunk=8))
    at = lambda too_long, completed, groups=0: {"data/tasks_dropped_prompt_too_long": too_long,
                                                "data/tasks_completed": completed,
                                                "data/main/groups_received": groups}
    assert nothing_to_train(spec, at(15, 15)) is None  # not yet two chunks
    assert nothing_to_train(spec, at(16, 17)) is None  # one task fitted
    assert nothing_to_train(spec, at(40, 40, groups=1)) is None  # a group arrived
    line = nothing_to_train(spec, at(16, 16))
    assert line.startswith("nothing to train: all 16 tasks rolled out so far were dropped before generation")
    spec.cluster.rollout_workers = 3
    assert nothing_to_train(spec, at(16, 16)) is None and nothing_to_train(spec, at(48, 48)) is not None
    # the monitor calls its callback once, with the line, and prints nothing itself
    dl, ended = FakeDataLayer(), []
    mon = StarvationMonitor(RunSpec(policies=[PolicySpec()], rollout=RolloutSpec(tasks_per_chunk=8)), dl,
                            lambda s: None, on_nothing=ended.append)
    dl.m = at(10, 10)
    assert mon.check(0.0) == [] and ended == []
    dl.m = at(20, 20)
    assert mon.check(5.0) == [ended[0]] and ended[0].startswith("nothing to train")
    mon.check(10.0)
    assert len(ended) == 1


def test_a_wait_for_a_batch_ends_when_the_trainer_is_asked_to_stop(tmp_path):
    # `Run.stop()` (and a run with nothing to train) write the trainer's STOP file: a trainer waiting for a batch that
    # will not come sees it within about a second, instead of waiting out trainer.batch_timeout_s
    import threading
    import time

    from astratk.dataflow.client import DataLayerClient
    from astratk.dataflow.datalayer import DataLayer

    client = DataLayerClient(DataLayer(RunSpec().validate()))
    stop = tmp_path / "STOP"
    threading.Timer(0.5, stop.touch).start()
    started = time.monotonic()
    assert client.wait_batch("main", 0, timeout=60, stop=stop.exists) is None
    assert time.monotonic() - started < 5
