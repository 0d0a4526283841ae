"""Data-layer stages one by one: published semantics, and a state_dict round trip for each."""

import asyncio
import json
import pickle
import random

import pytest

from astratk.config import PLUGIN_KINDS
from astratk.contracts import Env
from astratk.dataflow.stages import (
    EDF,
    FIFO,
    GRESO,
    AcceptAll,
    FilterSolved,
    FormatFilter,
    LengthFilter,
    Mixing,
    PassRateCurriculum,
    Replay,
    Stage,
    Staleness,
    ZeroVariance,
)
from astratk.envs.mixture import MixtureEnv
from astratk.records import Group, Task, Trajectory
from astratk.registry import REGISTRY, resolve
from astratk.spec import DataflowSpec, RunSpec


def traj(reward, version=0, n=1, text="", finished=True):
    return Trajectory("t", "g", "main", "policy", tuple(range(2 + n)), 2, (1,) * n, (-1.0,) * n, (version,) * n,
                      reward=reward, text=text, finished=finished)


def group(rewards=(1.0, 0.0), version=0, env="e", gid="g", advantages=None, **kw):
    return Group(gid, Task(f"task-{gid}", env, "p"), "main", tuple(traj(r, version, **kw) for r in rewards),
                 advantages=advantages)


def task(task_id="q", **info):
    return Task(task_id, "arithmetic", "1+1=", info=info)


def reloaded(stage, fresh, as_json=True):
    """Load `stage`'s state into `fresh` (an identically configured stage) through JSON (plain data) or pickle."""
    state = stage.state_dict()
    state = json.loads(json.dumps(state)) if as_json else pickle.loads(pickle.dumps(state))
    fresh.load_state_dict(state)
    assert fresh.state_dict() == stage.state_dict()
    assert fresh.metrics() == stage.metrics()
    return fresh


# ---------------------------------------------------------------------------------------------------- curators
def test_accept_all_submits_everything_and_has_no_state():
    c = AcceptAll()
    assert all(c.should_submit(task(str(i)), version=i) for i in range(10))
    reloaded(c, AcceptAll())
    with pytest.raises(ValueError, match="keeps no state"):
        AcceptAll().load_state_dict({"x": 1})


def test_filter_solved_stops_after_29_solved_groups():
    # EWMA from 0 with decay 0.9: after k all-solved groups the rate is 1 - 0.9^k; 0.9^28 = 0.0523, 0.9^29 = 0.0471
    c, q = FilterSolved(), task()
    for _ in range(28):
        c.update(q, [1.0, 1.0], version=0)
    assert c.should_submit(q, version=0)
    c.update(q, [1.0, 1.0], version=0)
    assert not c.should_submit(q, version=0)
    assert c.should_submit(task("other"), version=0)
    assert c.metrics() == {"tasks_tracked": 1.0, "tasks_solved": 1.0}


def test_filter_solved_success_is_the_share_of_positive_rewards():
    c, q = FilterSolved(), task()
    c.update(q, [1.0, 0.0, 0.5, -1.0], version=0)  # 2 of 4 above 0
    assert c.state_dict()["rate"]["q"] == pytest.approx(0.1 * 0.5)
    r = reloaded(c, FilterSolved())
    r.update(q, [1.0], version=0)
    c.update(q, [1.0], version=0)
    assert r.state_dict() == c.state_dict()


def test_greso_submit_probability_streaks_and_floors():
    c = GRESO()
    easy, hard = task("easy"), task("hard")
    assert c.submit_probability(easy) == 1.0  # z = 0: always
    for _ in range(2):
        c.update(easy, [1.0, 1.0], version=0)
    assert c.submit_probability(easy) == pytest.approx(0.25)  # max(0.5^2, 0.10)
    for _ in range(5):
        c.update(easy, [1.0, 1.0], version=0)
    assert c.submit_probability(easy) == pytest.approx(0.10)  # 0.5^7 < floor_easy
    c.update(hard, [0.0, 0.0], version=0)
    assert c.submit_probability(hard) == pytest.approx(0.5)
    c.update(hard, [0.0, 0.0], version=0)
    assert c.submit_probability(hard) == pytest.approx(0.40)  # 0.25 < floor_hard
    c.update(hard, [1.0, 1.0], version=0)  # kind flips to easy: the streak restarts at 1
    assert c.submit_probability(hard) == pytest.approx(0.5) and c.state_dict()["kind"]["hard"] == "easy"
    c.update(hard, [1.0, 0.0], version=0)  # variance: streak reset
    assert c.submit_probability(hard) == 1.0


def test_greso_draws_at_its_probability():
    c, q = GRESO(seed=3), task()
    for _ in range(2):
        c.update(q, [1.0] * 4, version=0)
    accepted = sum(c.should_submit(q, version=0) for _ in range(4000)) / 4000
    assert accepted == pytest.approx(0.25, abs=0.03)


def test_greso_adapts_per_version_toward_targets():
    c = GRESO()
    for i in range(10):  # 1 easy (10% >= 8.3%: p_easy down), 1 hard (10% < 16.7%: p_hard up), 8 with variance
        rewards = [1.0, 1.0] if i == 0 else [0.0, 0.0] if i == 1 else [1.0, 0.0]
        c.update(task(f"q{i}"), rewards, version=0)
    c.on_version(1)
    m = c.metrics()
    assert (m["p_easy"], m["p_hard"]) == (pytest.approx(0.49), pytest.approx(0.51))
    assert (m["observed_easy_ratio"], m["observed_hard_ratio"]) == (pytest.approx(0.1), pytest.approx(0.1))
    c.on_version(2)  # nothing seen since: no change
    assert c.metrics()["p_easy"] == pytest.approx(0.49)


def test_greso_state_round_trip_repeats_the_same_draws():
    c = GRESO(seed=5)
    for i in range(20):
        c.update(task(f"q{i % 4}"), [float(i % 3 == 0)] * 3, version=0)
    c.on_version(1)
    c.should_submit(task("q0"), 1)
    r = reloaded(c, GRESO(seed=99))  # the RNG state travels with the state, not the seed
    qs = [task(f"q{i % 4}") for i in range(50)]
    assert [c.should_submit(q, 1) for q in qs] == [r.should_submit(q, 1) for q in qs]


def test_curriculum_submits_buckets_in_the_zone():
    c = PassRateCurriculum(low=0.2, high=0.8, explore=0.0)
    lv1, lv3, lv5 = task("a", level=1), task("b", level=3), task("c", level=5)
    c.update(lv1, [1.0] * 4, version=0)  # 100%: mastered
    c.update(lv3, [1.0, 0.0, 1.0, 0.0], version=0)  # 50%: learnable
    c.update(lv5, [0.0] * 4, version=0)  # 0%: hopeless for now
    assert [c.should_submit(task(f"n{i}", level=lv), 0) for i, lv in enumerate((1, 3, 5, 7))] == \
        [False, True, False, True]  # level 7 unseen: submitted
    c.update(task("d", level=5), [1.0] * 4, version=1)  # EWMA: 0.9 * 0 + 0.1 * 1
    assert c.metrics()["pass_rate_5"] == pytest.approx(0.1)
    assert PassRateCurriculum(explore=1.0, low=0.2, high=0.8).should_submit(lv1, 0)
    assert c.bucket(Task("t9", "e", "p")) == "t9"  # no level: per task


def test_curriculum_explore_and_round_trip():
    c = PassRateCurriculum(explore=0.3, seed=2)
    c.update(task("a", level=1), [1.0] * 4, version=0)
    rate = sum(c.should_submit(task("a", level=1), 0) for _ in range(3000)) / 3000
    assert rate == pytest.approx(0.3, abs=0.04)
    r = reloaded(c, PassRateCurriculum(explore=0.3, seed=7))
    assert [c.should_submit(task("a", level=1), 0) for _ in range(40)] == \
        [r.should_submit(task("a", level=1), 0) for _ in range(40)]


# ----------------------------------------------------------------------------------------------------- filters
def test_zero_variance_drops_equal_rewards_and_single_samples():
    f = ZeroVariance()
    assert f.check(group((1.0, 1.0, 1.0))) == "zero_variance"
    assert f.check(group((0.0,))) == "zero_variance"  # one sample: no baseline, no signal
    assert f.check(group((0.0, 1.0))) is None
    reloaded(f, ZeroVariance())


def test_length_filter_reasons_and_fraction():
    assert LengthFilter(max_tokens=3).check(group(n=4)) == "too_long"
    assert LengthFilter(max_tokens=4).check(group(n=4)) is None  # the bound itself is kept
    assert LengthFilter(min_tokens=2).check(group(n=1)) == "too_short"
    assert LengthFilter(drop_unfinished=True).check(group(finished=False)) == "unfinished"
    assert LengthFilter().check(group(finished=False)) is None
    mixed = Group("g", Task("t", "e", "p"), "main", (traj(1.0, n=5), traj(0.0, n=2), traj(1.0, n=2), traj(0.0, n=2)))
    assert LengthFilter(max_tokens=4).check(mixed) == "too_long"  # any one (max_fraction 0)
    assert LengthFilter(max_tokens=4, max_fraction=0.25).check(mixed) is None  # 1 of 4 is not more than 25%
    with pytest.raises(ValueError, match="max_tokens"):
        LengthFilter(max_tokens=1, min_tokens=2)
    reloaded(LengthFilter(max_tokens=3), LengthFilter(max_tokens=3))


def test_format_filter():
    f = FormatFilter(pattern=r"^\s*-?\d+\s*$")
    assert f.check(group(text="42")) is None
    g = Group("g", Task("t", "e", "p"), "main", (traj(1.0, text="42"), traj(0.0, text="forty-two")))
    assert f.check(g) == "bad_format"
    assert FormatFilter(pattern=r"\d", max_fraction=0.5).check(g) is None
    with pytest.raises(ValueError, match="not a regular expression"):
        FormatFilter(pattern="(")
    reloaded(f, FormatFilter(pattern=r"^\s*-?\d+\s*$"))


# ----------------------------------------------------------------------------------------------------- serving
def test_staleness_bound_is_kept_and_lag_decays_weight():
    s = Staleness(max_staleness=2, lag_decay=0.5)
    assert not s.is_stale(version=3, current=5) and s.is_stale(version=2, current=5)
    assert [s.weight(v, current=5) for v in (5, 4, 3)] == [1.0, 0.5, 0.25]
    assert Staleness(4).weight(0, current=3) == 1.0
    reloaded(s, Staleness(2, 0.5))


def test_fifo_and_edf_order():
    groups = [group(version=v, gid=f"g{i}") for i, v in enumerate((7, 3, 5, 3))]
    assert [g.group_id for g in FIFO().order(groups)] == ["g0", "g1", "g2", "g3"]
    assert [g.group_id for g in EDF().order(groups)] == ["g1", "g3", "g2", "g0"]  # lowest version first, ties arrival
    reloaded(EDF(), EDF())


def test_replay_share_is_floor_of_batch_times_ratio():
    r = Replay(ratio=0.29, capacity=1000)
    assert r.share(100) == 0  # empty
    r.add([group(gid=str(i)) for i in range(500)])
    assert r.share(100) == 29 and r.share(10) == 2 and r.share(3) == 0
    with pytest.raises(ValueError, match="ratio"):
        Replay(ratio=1.0)
    with pytest.raises(ValueError, match="selector"):
        Replay(selector="best")


def test_replay_selectors():
    groups = [group(gid=str(i), advantages=(a, -a)) for i, a in enumerate((0.1, 0.9, 0.5, 0.9))]
    recent = Replay(ratio=0.5)
    recent.add(groups)
    assert [g.group_id for g in recent.select(4)] == ["3", "2"]  # most recent first
    assert len(recent.state_dict()["buffer"]) == 4  # replay keeps what it re-serves
    high = Replay(ratio=0.5, selector="high_advantage")
    high.add(groups)
    assert [g.group_id for g in high.select(6)] == ["3", "1", "2"]  # |adv| 0.9 (newest first), 0.9, 0.5
    draws = []
    for _ in range(2):
        u = Replay(ratio=0.5, selector="uniform", seed=4)
        u.add(groups)
        draws.append([g.group_id for g in u.select(4) + u.select(4)])
    assert draws[0] == draws[1] and len(set(draws[0][:2])) == 2  # seeded, without replacement


def test_replay_counts_short_and_evictions_and_round_trips():
    r = Replay(ratio=0.5, capacity=3, selector="uniform", seed=1)
    r.add([group(gid="a")])
    assert [g.group_id for g in r.select(4)] == ["a"]  # wanted 2, had 1
    r.add([group(gid=x) for x in "bcd"])
    assert r.metrics() == {"size": 3.0, "replayed": 1.0, "short": 1.0, "evicted": 1.0}
    back = reloaded(r, Replay(ratio=0.5, capacity=3, selector="uniform", seed=1), as_json=False)
    assert [g.group_id for g in back.select(4)] == [g.group_id for g in r.select(4)]


def test_mixing_shares_slots_by_ratio_and_fills_when_short():
    m = Mixing(ratios={"a": 3, "b": 1})
    envs = m.slot_envs(400)
    assert envs.count("a") == 300 and all(abs(envs[:k].count("a") - 0.75 * k) <= 1 for k in range(1, 400))
    m = Mixing(ratios={"a": 1, "b": 1})
    ordered = [group(env=e, gid=f"{e}{i}") for i, e in enumerate("aaab")]  # one b only
    picked = m.pick(ordered, 4)
    assert sorted(g.group_id for g in picked) == ["a0", "a1", "a2", "b3"]
    assert [g.group_id for g in picked[:2]] == ["a0", "b3"]  # each env's first group in serving order
    picked = m.pick([group(env="a", gid=f"x{i}") for i in range(2)], 2)  # no b at all: its slot filled from a
    assert [g.group_id for g in picked] == ["x0", "x1"]
    # slots a b a b -> a0 b3 a1 (b short: a2), then a b -> x0 (b short: x1)
    assert m.metrics() == {"served_a": 3.0, "served_b": 1.0, "short_b": 2.0, "filled_from_a": 2.0}


def test_mixing_round_trip_continues_the_rotation():
    m = Mixing(ratios={"a": 2, "b": 1, "c": 1})
    m.slot_envs(3)
    r = reloaded(m, Mixing(ratios={"a": 2, "b": 1, "c": 1}))
    assert r.slot_envs(9) == m.slot_envs(9)
    with pytest.raises(ValueError, match="state is for envs"):
        Mixing(ratios={"a": 1}).load_state_dict(m.state_dict())


# ---------------------------------------------------------------------------------------------- config, registry
def test_stage_short_names_resolve_and_do_not_collide():
    for name in REGISTRY["stage"]:
        assert issubclass(resolve("stage", name), Stage)
    names = [n for kind in PLUGIN_KINDS for n in REGISTRY[kind]]
    assert len(names) == len(set(names)), "a short name in two kinds would expand to the first kind's class"


def test_dataflow_validation_names_the_key():
    with pytest.raises(ValueError, match=r"dataflow\.lag_decay"):
        RunSpec(dataflow=DataflowSpec(lag_decay=0.0)).validate()
    with pytest.raises(ValueError, match=r"dataflow\.curators\[0\]: expected .*Curator"):
        RunSpec(dataflow=DataflowSpec(curators=[ZeroVariance()])).validate()
    with pytest.raises(ValueError, match=r"dataflow\.mixing\.ratios: .*unknown \['math_word'\]"):
        RunSpec(dataflow=DataflowSpec(mixing=Mixing({"arithmetic": 1, "math_word": 1}))).validate()
    RunSpec(dataflow=DataflowSpec(mixing=Mixing({"arithmetic": 1}), curators=[GRESO()], order=EDF())).validate()


# ------------------------------------------------------------------------------------------------- MixtureEnv
class ListEnv(Env):
    """A tiny finite env: `n` tasks; every sample scores 1.0 for env 'a', 0.0 otherwise."""

    def __init__(self, name, n=100, roles=("policy",)):
        self.name, self.n, self.roles = name, n, roles

    def tasks(self, split):
        return [Task(f"{self.name}/{split}/{i}", self.name, str(i), split=split) for i in range(self.n)]

    async def rollout(self, task, engines, sampling, *, policy_ids, group_id):
        return [traj(None)]

    def score(self, task, trajectories):
        return [float(self.name == "a")] * len(trajectories)

    def grade(self, task, text):
        return float(self.name == "a")


def test_mixture_interleaves_in_proportion_and_routes_by_task_env():
    env = MixtureEnv({"a": ListEnv("a"), "b": ListEnv("b")}, weights={"a": 3, "b": 1})
    tasks = [t for t, _ in zip(env.tasks("train"), range(80))]
    assert [t.env for t in tasks].count("a") == 60
    assert [t.task_id for t in tasks if t.env == "b"][:2] == ["b/train/0", "b/train/1"]  # names kept when key = name
    a, b = next(t for t in tasks if t.env == "a"), next(t for t in tasks if t.env == "b")
    assert (env.score(a, [traj(None)]), env.score(b, [traj(None)])) == ([1.0], [0.0])
    assert (env.grade(a, ""), env.grade(b, "")) == (1.0, 0.0)
    assert asyncio.run(env.rollout(a, {}, None, policy_ids={}, group_id="g"))[0].reward is None
    assert len(env.tasks("heldout")) == 200 and env.source_names == ("a", "b")


def test_mixture_restamps_duplicate_names_and_drains_finite_sources():
    env = MixtureEnv({"x": ListEnv("same", n=2), "y": ListEnv("same", n=5)})
    tasks = list(env.tasks("train"))
    assert len(tasks) == 7 and {t.env for t in tasks} == {"x", "y"}
    assert tasks[0].task_id == "x/same/train/0"
    with pytest.raises(ValueError, match="same roles"):
        MixtureEnv({"a": ListEnv("a"), "s": ListEnv("s", roles=("solver", "verifier"))})
    with pytest.raises(ValueError, match="weights"):
        MixtureEnv({"a": ListEnv("a")}, weights={"b": 1.0})
    with pytest.raises(ValueError, match="not one of its sources"):
        env.score(Task("t", "z", "p"), [])


def test_mixture_stream_is_deterministic():
    make = lambda: MixtureEnv({"a": ListEnv("a"), "b": ListEnv("b"), "c": ListEnv("c")},
                              weights={"a": random.Random(0).random(), "b": 0.3, "c": 0.2})
    first = [t.task_id for t in make().tasks("train")]
    assert first == [t.task_id for t in make().tasks("train")] and len(first) == 300
