"""AgentBench-style envs: household text games (TextWorld's, generated, and ALFWorld's .tw-pddl) and SQLite questions.
Tasks are deterministic per seed and the splits disjoint; a scripted winning play scores 1 and a bad one 0; game and
database output is masked; executed commands and queries count as tool calls (JSON tool calls too); the turn limit
binds and is counted; SQL never writes and slow queries stop; loaders name the file (and line) of a bad entry."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.util
import json
import multiprocessing
import pickle
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.agentbench.db import DatabaseEnv
from astratk.envs.agentbench.db_answers import answers_match
from astratk.envs.agentbench.sql import run_query
from astratk.models import build_char_tokenizer

TOK = build_char_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")
SAMPLING = SamplingParams(max_tokens=200)
needs_textworld = pytest.mark.skipif(importlib.util.find_spec("textworld") is None,
                                     reason="HouseholdEnv needs textworld (pip install textworld==1.7.0)")
needs_pddl = pytest.mark.skipif(importlib.util.find_spec("textworld") is None or importlib.util.find_spec(
    "fast_downward") is None, reason="ALFWorld .tw-pddl games need textworld and fast_downward (astratk[agentbench])")


def player(replies):
    """A scripted policy whose k-th assistant turn says replies[k] (the last one repeated), read off the prompt."""
    def script(prompt_ids, params):
        k = TOK.decode(list(prompt_ids)).count("<|im_start|>assistant") - 1
        return list(TOK(replies[min(k, len(replies) - 1)], add_special_tokens=False)["input_ids"]) + [END]
    return script


def play(env, task, replies):
    engine = ScriptedEngine(TOK, player(replies))
    [traj] = asyncio.run(env.rollout(task, {"policy": engine}, SAMPLING, policy_ids={"policy": "p"}, group_id="g"))
    [reward] = env.score(task, [traj])
    return traj, reward, engine


def segments(traj):
    """The completion as (mask, text) runs: what the policy wrote (1) and what the env appended (0)."""
    out, completion = [], traj.tokens[traj.n_prompt:]
    for i, (tok, m) in enumerate(zip(completion, traj.loss_mask)):
        if i == 0 or m != traj.loss_mask[i - 1]:
            out.append((m, []))
        out[-1][1].append(tok)
    return [(m, TOK.decode(ids)) for m, ids in out]


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------------ household


@pytest.fixture(scope="session")
def household(tmp_path_factory):
    """One held-out and one train game, generated once for the session (about 4 s)."""
    from astratk.envs.agentbench.household import HouseholdEnv
    cache = tmp_path_factory.mktemp("textworld-cache")
    env = HouseholdEnv(n_train=1, n_heldout=1, seed=3, nb_rooms=2, nb_objects=2, quest_length=2, max_turns=4,
                       cache_dir=str(cache))
    heldout = list(env.tasks("heldout"))
    stream = env.tasks("train")
    train = [next(stream) for _ in range(3)]
    return env, heldout, train, cache


def _build_in_child(recipe, cache, queue):
    from astratk.envs.agentbench.household import ensure_game
    queue.put(str(ensure_game(recipe, cache)))


@needs_textworld
def test_household_games_are_deterministic_disjoint_and_cached_atomically(household, tmp_path):
    from astratk.envs.agentbench.household import GameRecipe, HouseholdEnv
    env, heldout, train, cache = household
    assert len(heldout) == 1 and len({t.task_id for t in train}) == 1  # the one train game, cycled
    assert {t.task_id.split("/")[-1] for t in heldout}.isdisjoint(t.task_id.split("/")[-1] for t in train)
    again = HouseholdEnv(**{k: getattr(env, k) for k in ("n_train", "n_heldout", "seed", "nb_rooms", "nb_objects",
                                                         "quest_length", "max_turns", "cache_dir")})
    assert list(again.tasks("heldout")) == heldout  # same seed, same tasks (read back from the cache)
    assert list(pickle.loads(pickle.dumps(env)).tasks("heldout")) == heldout  # workers get the env pickled
    assert len(list((cache / "textworld").glob("game-*"))) == 2 and not list((cache / "textworld").glob(".*"))

    # Two processes racing on one recipe in a fresh cache both end with one whole game, byte-identical to ours.
    recipe = GameRecipe(**heldout[0].info["recipe"])
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    queue = ctx.Queue()
    children = [ctx.Process(target=_build_in_child, args=(recipe, tmp_path, queue)) for _ in range(2)]
    for c in children:
        c.start()
    paths = {queue.get(timeout=120) for _ in children}
    for c in children:
        c.join(timeout=60)
        assert c.exitcode == 0
    [built] = paths
    assert [p.name for p in (tmp_path / "textworld").iterdir()] == [Path(built).parent.name]  # no leftovers
    ours = env.game_file(heldout[0])
    assert sha(built) == sha(ours) and sha(Path(built).with_suffix(".json")) == sha(ours.with_suffix(".json"))


@needs_textworld
def test_household_winning_play_scores_one_and_masks_the_game(household):
    env, heldout, _, _ = household
    task = heldout[0]
    walkthrough = task.info["walkthrough"]
    assert len(walkthrough) == 2 and env.demonstration(task) == f"<action>{walkthrough[0]}</action>"
    traj, reward, engine = play(env, task, [f"<action>{c}</action>" for c in walkthrough])
    assert reward == 1.0 and traj.metrics["won"] == 1 and traj.metrics["turns"] == 2 == len(engine.requests)
    assert traj.metrics["turn_limit_hit"] == 0 and traj.finished
    assert traj.metrics["tool_calls"] == 2 == traj.metrics["game_steps"]  # the winning command, never answered, too
    runs = segments(traj)
    assert [m for m, _ in runs] == [1, 0, 1]  # action, the game's feedback, action; nothing after the win
    assert runs[0][1] == f"<action>{walkthrough[0]}</action><|im_end|>"
    assert "<action>" not in runs[1][1] and runs[1][1].startswith("\n<|im_start|>user\n")
    assert env.messages(task)[0]["content"] in TOK.decode(list(traj.tokens[:traj.n_prompt]))
    assert env.score(task, [dataclasses.replace(traj, metrics={})]) == [None]  # the outcome lives in metrics


@needs_textworld
def test_household_demonstrations_are_the_episode_the_env_plays(household):
    """A warm start's household demonstration is the walkthrough played as an episode: each command from the
    conversation before it (the game's feedback, token for token as the env shows it), and it wins."""
    from astratk.envs.agentbench.household import HouseholdEnv
    from astratk.models.chat import encode_chat

    env, heldout, train, _ = household
    for task in [heldout[0], train[0]]:
        demos = env.demonstrations(task)
        walkthrough = task.info["walkthrough"]
        assert [reply for _, reply in demos] == [f"<action>{c}</action>" for c in walkthrough]
        assert demos[0][0] == env.messages(task) and demos[0][1] == env.demonstration(task)
        _, reward, engine = play(env, task, [reply for _, reply in demos])
        assert reward == 1.0 and len(engine.requests) == len(demos)
        assert [list(r.prompt_ids) for r in engine.requests] == [encode_chat(TOK, m) for m, _ in demos]
    short = HouseholdEnv(n_train=1, n_heldout=1, seed=3, nb_rooms=2, nb_objects=2, quest_length=2, max_turns=1,
                         cache_dir=env.cache_dir)
    assert len(short.demonstrations(heldout[0])) == 1  # no more commands than the episode has turns
    bare = dataclasses.replace(heldout[0], info={**heldout[0].info, "walkthrough": []})
    with pytest.raises(NotImplementedError, match="no walkthrough"):
        env.demonstrations(bare)


@needs_textworld
def test_household_games_played_at_once_from_threads_all_win(household):
    """A rollout worker plays a chunk's episodes at once, each game in its own thread. TextWorld's parser is shared
    module state: unguarded, in a fresh process, 12 threads opening 2 games all failed to load ("pop from empty
    list", RecursionError); astratk serialises TextWorld's calls. A fresh process, because a game loaded once before
    no longer races."""
    env, heldout, train, _ = household
    files = [str(env.game_file(t)) for t in (heldout[0], train[0])]
    walkthroughs = [t.info["walkthrough"] for t in (heldout[0], train[0])]
    script = f"""
import threading
from astratk.envs.agentbench.games import LiveGame
errors = []
def play(path, commands):
    try:
        game = LiveGame(path)
        for command in commands:
            game.step(command)
        assert game.won, path
        game.close()
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=play, args=a) for a in {list(zip(files, walkthroughs, strict=True))!r} * 6]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=120)
print(len(threads), "games,", len(errors), "errors:", errors[:2])
"""
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "12 games, 0 errors" in out.stdout, (out.stdout, out.stderr[-2000:])


@needs_textworld
def test_household_turn_limit_binds_and_bad_play_scores_zero(household):
    from astratk.envs.agentbench.household import HouseholdEnv
    env, heldout, _, _ = household
    task = heldout[0]
    traj, reward, engine = play(env, task, ["<action>look</action>"])
    assert reward == 0.0 and traj.metrics["turns"] == 4 == env.max_turns == len(engine.requests)
    assert traj.metrics["turn_limit_hit"] == 1 and traj.metrics["won"] == 0 and traj.metrics["game_steps"] == 4
    assert [m for m, _ in segments(traj)] == [1, 0, 1, 0, 1, 0, 1]
    # A bare first line is a command; meta commands and empty replies are refused but use their turn.
    traj, reward, _ = play(env, task, [f"{task.info['walkthrough'][0]}\nbecause", "<action>quit</action>", "  "])
    m = traj.metrics
    assert reward == 0.0 and m["game_steps"] == 1 and m["refused_commands"] == 1 and m["no_action_turns"] == 2
    assert m["tool_calls"] == 1  # only the command the game executed
    strict = HouseholdEnv(n_train=1, n_heldout=1, seed=3, nb_rooms=2, nb_objects=2, quest_length=2, max_turns=4,
                          require_tag=True, cache_dir=env.cache_dir)
    traj, _, _ = play(strict, task, [task.info["walkthrough"][0]])  # untagged: refused
    assert traj.metrics["no_action_turns"] == 4 and traj.metrics["game_steps"] == 0


@needs_textworld
def test_household_partial_score_reward(household):
    from astratk.envs.agentbench.household import HouseholdEnv
    env, heldout, _, _ = household
    partial = HouseholdEnv(n_train=1, n_heldout=1, seed=3, reward="score", cache_dir=env.cache_dir)
    traj, _, _ = play(env, heldout[0], ["<action>look</action>"])
    half = dataclasses.replace(traj, metrics={**traj.metrics, "score": 1.0, "max_score": 2.0})
    assert partial.score(heldout[0], [half]) == [0.5] and env.score(heldout[0], [half]) == [0.0]


@needs_textworld
def test_household_plays_a_users_games_and_rejects_bad_directories(household, tmp_path):
    from astratk.envs.agentbench.household import HouseholdEnv
    env, heldout, train, _ = household
    games = tmp_path / "games"
    games.mkdir()
    for name, task in (("a", heldout[0]), ("b", train[0])):
        src = env.game_file(task)
        shutil.copy(src, games / f"{name}.z8")
        shutil.copy(src.with_suffix(".json"), games / f"{name}.json")
    user = HouseholdEnv(games_dir=str(games), n_heldout=1, seed=0, max_turns=4)
    [h], t = list(user.tasks("heldout")), next(user.tasks("train"))
    assert h.info["game_file"] != t.info["game_file"] and {Path(h.info["game_file"]).name,
                                                           Path(t.info["game_file"]).name} == {"a.z8", "b.z8"}
    _, reward, _ = play(user, h, [f"<action>{c}</action>" for c in h.info["walkthrough"]])
    assert reward == 1.0
    with pytest.raises(ValueError, match="leaves none to train on"):
        HouseholdEnv(games_dir=str(games), n_heldout=2)
    (games / "c.z8").write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(str(games / "c.z8")) + ".*c.json"):
        HouseholdEnv(games_dir=str(games), n_heldout=1)
    (games / "c.z8").unlink()
    (games / "d.ulx").write_bytes(b"")
    with pytest.raises(ValueError, match="d.ulx.*Glulx"):
        HouseholdEnv(games_dir=str(games), n_heldout=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no games under"):
        HouseholdEnv(games_dir=str(tmp_path / "empty"), n_heldout=1)


@needs_textworld
def test_household_corrupt_games_raise_naming_the_file(household, tmp_path):
    from astratk.envs.agentbench.games import LiveGame
    from astratk.envs.agentbench.household import HouseholdEnv
    env, heldout, _, _ = household
    src = env.game_file(heldout[0])
    story, meta = src.read_bytes(), src.with_suffix(".json").read_text()
    games, bad = tmp_path / "games", tmp_path / "bad"
    games.mkdir()
    bad.mkdir()
    for name in ("a", "b"):
        (games / f"{name}.z8").write_bytes(story)
        (games / f"{name}.json").write_text(meta)
    # Jericho would exit the whole process on these ("Fatal error: Story file read error"): refused at construction.
    for name, data, message in (("cut", story[:1000], "truncated story file"),
                                ("junk", b"\0" * 100, "not a Z-machine version 8 story file")):
        (bad / f"{name}.z8").write_bytes(data)
        (bad / f"{name}.json").write_text(meta)
        with pytest.raises(ValueError, match=re.escape(str(bad / f"{name}.z8")) + f": {message}"):
            HouseholdEnv(games_dir=str(games), heldout_dir=str(bad))
        (bad / f"{name}.z8").unlink()
    # A story whose .json is not its metadata: TextWorld's bare KeyError 'KB', now named when the game is opened.
    (bad / "c.z8").write_bytes(story)
    (bad / "c.json").write_text("{}")
    user = HouseholdEnv(games_dir=str(games), heldout_dir=str(bad))
    with pytest.raises(ValueError, match=re.escape(str(bad / "c.z8")) + r": TextWorld cannot load .*c\.json.*'KB'"):
        list(user.tasks("heldout"))
    with pytest.raises(ValueError, match=re.escape(str(bad / "c.z8"))):
        LiveGame(bad / "c.z8")


def _alfred_game(path: Path, goal: str, **override) -> Path:
    from astratk.envs.agentbench.games import alfworld_example
    path.write_text(json.dumps({**alfworld_example(goal), **override}))
    return path


def _downward_copies() -> int:
    """fast-downward library copies mapped into this process (each PddlEnv loads its own from a temporary file that it
    deletes at once, so the copies differ by their (device, inode))."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return len({tuple(line.split()[3:5]) for line in maps if "libdownward" in line})


@needs_pddl
def test_household_plays_alfworld_pddl_games_to_a_win(tmp_path, monkeypatch):
    from astratk.envs.agentbench.household import HouseholdEnv
    argv, stdout = ["astratk", "fit"], sys.stdout
    monkeypatch.setattr(sys, "argv", list(argv))
    games = tmp_path / "alfworld"
    games.mkdir()
    for goal in ("cabinet", "sink"):
        _alfred_game(games / f"{goal}.tw-pddl", goal)
    env = HouseholdEnv(games_dir=str(games), n_heldout=1, seed=0, max_turns=6)
    task = next(iter(env.tasks("heldout")))
    goal = Path(task.info["game_file"]).stem
    assert task.info["walkthrough"] == ["go to table", "take mug from table", f"go to {goal}", f"put mug in/on {goal}"]
    assert task.prompt.endswith(f"Your task is to: put a mug in the {goal}.")  # the goal is in the opening text
    win = [f"<action>{c}</action>" for c in task.info["walkthrough"]]
    traj, reward, _ = play(env, task, win)
    assert reward == 1.0 and traj.metrics["won"] == 1 and traj.metrics["turns"] == 4 == traj.metrics["tool_calls"]
    assert [m for m, _ in segments(traj)] == [1, 0, 1, 0, 1, 0, 1]
    assert "You arrive at the table. On it, you see a mug." in segments(traj)[1][1]
    assert "You pick up the mug from the table." in segments(traj)[3][1]
    lost, reward, _ = play(env, task, ["<action>go to sink</action>", "<action>take mug</action>"])
    assert reward == 0.0 and lost.metrics["turn_limit_hit"] == 1 and "Nothing happens." in TOK.decode(lost.tokens)

    async def group():  # episodes of a group open their games concurrently in worker threads
        engines = [ScriptedEngine(TOK, player(win)) for _ in range(3)]
        return await asyncio.gather(*(env.rollout(task, {"policy": e}, SAMPLING, policy_ids={"policy": "p"},
                                                  group_id="g") for e in engines))
    copies = _downward_copies() if sys.platform == "linux" else 0
    for _ in range(2):
        assert [env.score(task, t) for t in asyncio.run(group())] == [[1.0]] * 3
    # fast-downward's translator overwrites sys.argv and swaps sys.stdout while it runs: both are as they were.
    assert sys.argv == argv and sys.stdout is stdout
    if sys.platform == "linux":  # planner libraries are reused: at most one per game open at once, not one per episode
        assert _downward_copies() <= max(copies, 3)


@needs_pddl
@pytest.mark.parametrize("override, message", [
    ({"pddl_problem": "(define (problem p) (:domain alfred) (:objects x - object) (:init (nosuch x)) "
                      "(:goal (nosuch x)))"}, "SystemExit: Undeclared predicate: nosuch"),  # the translator exits
    ({"grammar": "action GotoLocation {"}, "FailedToken"),
    ({"pddl_domain": "(define (domain alfred) (:action"}, "ParseError"),
    (None, "JSONDecodeError"),
])
def test_household_corrupt_pddl_games_raise_naming_the_file(tmp_path, override, message):
    from astratk.envs.agentbench.games import LiveGame
    path = _alfred_game(tmp_path / "bad.tw-pddl", "sink", **(override or {}))
    if override is None:
        path.write_text(path.read_text()[:200])  # cut short
    with pytest.raises(ValueError, match=re.escape(f"{path}: TextWorld cannot load this game: ") + f".*{message}"):
        LiveGame(path, walkthrough=True)
    good = LiveGame(_alfred_game(tmp_path / "good.tw-pddl", "sink"))  # the pooled planner is still usable
    assert good.step("go to table").startswith("You arrive at the table.")
    good.close()


def test_household_pddl_games_without_fast_downward_are_refused_at_construction(tmp_path, monkeypatch):
    from astratk.envs.agentbench.household import HouseholdEnv
    monkeypatch.setitem(sys.modules, "fast_downward", None)  # as if not installed: importing it raises ImportError
    for goal in ("cabinet", "sink"):
        (tmp_path / f"{goal}.tw-pddl").write_text("{}")
    with pytest.raises(ImportError, match=re.escape(str(tmp_path / "cabinet.tw-pddl")) + ".*need fast_downward: pip "
                                          r"install 'astratk\[agentbench\]'"):
        HouseholdEnv(games_dir=str(tmp_path), n_heldout=1)


# ------------------------------------------------------------------------------------------------------- database


@pytest.fixture(scope="module")
def db_env(tmp_path_factory):
    return DatabaseEnv(n_heldout=12, seed=7, max_turns=3, max_rows=5, cache_dir=str(tmp_path_factory.mktemp("db")))


def test_db_tasks_are_deterministic_disjoint_and_gold_comes_from_gold_sql(db_env):
    heldout = list(db_env.tasks("heldout"))
    assert heldout == list(DatabaseEnv(n_heldout=12, seed=7).tasks("heldout"))
    assert [t.prompt for t in heldout] != [t.prompt for t in DatabaseEnv(n_heldout=12, seed=8).tasks("heldout")]
    stream = db_env.tasks("train")
    train = [next(stream) for _ in range(60)]
    key = DatabaseEnv._key
    blob = pickle.dumps(db_env)  # config only: workers rebuild the task lists
    assert len(blob) < 2000 and list(pickle.loads(blob).tasks("heldout")) == heldout
    assert {key(t) for t in heldout}.isdisjoint(key(t) for t in train)
    assert {t.info["kind"] for t in train} == {"count_dept", "sum_year", "avg_salary", "filter_list", "top3",
                                               "city_of", "depts_over", "top_dept_sales"}
    for task in heldout:  # the gold answer is what the gold query returns on the task's own database file
        rows = run_query(db_env.database_file(task), task.info["sql"], max_rows=50).text.splitlines()[1:]
        assert answers_match(", ".join(rows), task.info["answer"], is_list=True, ordered=True), task


@pytest.mark.parametrize("given, gold, is_list, ordered, expected", [
    ("42", ["42"], False, False, True),
    ("42.0", ["42"], False, False, True),  # numbers compare numerically
    ("1,234", ["1234"], False, False, True),  # a thousands separator in a single number
    ("65433.333", ["65433.33"], False, False, True),  # gold rounded to 2 decimals accepts what rounds to it
    ("65433.3", ["65433.33"], False, False, False),
    (" oslo ", ["Oslo"], False, False, True),  # text: case and surrounding space ignored
    ("Ada Fox, Ben Gray", ["Ben Gray", "Ada Fox"], True, False, True),  # any order when the question allows
    ("Ada Fox, Ben Gray", ["Ben Gray", "Ada Fox"], True, True, False),  # order counts when it asks for one
    ('["Ben Gray", "Ada Fox"]', ["Ben Gray", "Ada Fox"], True, True, True),  # a JSON list
    ("Ada Fox", ["Ben Gray", "Ada Fox"], True, False, False),  # missing an element
    ("Ada Fox, Ada Fox", ["Ben Gray", "Ada Fox"], True, False, False),  # a multiset, not a set
    ("[[3], [1]]", ["1", "3"], True, False, True),  # rows as lists
])
def test_db_answer_normalisation(given, gold, is_list, ordered, expected):
    assert answers_match(given, gold, is_list=is_list, ordered=ordered) is expected


def test_db_winning_play_scores_one_and_masks_query_results(db_env):
    task = next(t for t in db_env.tasks("heldout") if t.info["is_list"])
    gold = ", ".join(task.info["answer"])
    traj, reward, _ = play(db_env, task, [db_env.demonstration(task), f"<answer>{gold}</answer>"])
    assert reward == 1.0 and traj.metrics["correct"] == 1 and traj.metrics["queries"] == 1
    assert traj.metrics["answered"] == 1 and traj.metrics["turns"] == 2 and traj.metrics["tool_calls"] == 1
    runs = segments(traj)
    assert [m for m, _ in runs] == [1, 0, 1]
    assert all(name in runs[1][1] for name in task.info["answer"]) and "<sql>" not in runs[1][1]
    assert runs[2][1] == f"<answer>{gold}</answer><|im_end|>"
    _, wrong, _ = play(db_env, task, ["<answer>nobody</answer>"])
    assert wrong == 0.0


def test_db_demonstrations_are_the_episode_the_env_plays(db_env):
    """The warm start's two moves are a winning episode: the gold query, then (after the result exactly as the env
    shows it, token for token) the gold answer."""
    from astratk.models.chat import encode_chat

    for task in list(db_env.tasks("heldout"))[:6]:
        (first, query), (seen, answer) = db_env.demonstrations(task)
        assert first == db_env.messages(task) and query == db_env.demonstration(task)
        assert answer.startswith("<answer>") and db_env.grade(task, answer) == 1.0
        traj, reward, engine = play(db_env, task, [query, answer])
        assert reward == 1.0 and traj.metrics["queries"] == 1 and traj.metrics["query_errors"] == 0
        assert list(engine.requests[1].prompt_ids) == encode_chat(TOK, seen)


def test_db_turn_limit_binds_and_is_counted(db_env):
    task = next(iter(db_env.tasks("heldout")))
    traj, reward, engine = play(db_env, task, ["thinking...", "<sql>SELECT 1</sql>"])
    m = traj.metrics
    assert reward == 0.0 and m["turns"] == 3 == len(engine.requests) and m["turn_limit_hit"] == 1
    assert m["format_errors"] == 1 and m["queries"] == 1 and m["answered"] == 0  # the last turn's query is not run
    assert [mask for mask, _ in segments(traj)] == [1, 0, 1, 0, 1]


def test_db_writes_are_refused_and_the_database_is_unchanged(db_env):
    task = next(iter(db_env.tasks("heldout")))
    path = db_env.database_file(task)
    before = sha(path)
    for sql in ["DELETE FROM employees", "UPDATE employees SET salary = 0", "DROP TABLE sales",
                "CREATE TABLE x (a)", "INSERT INTO departments VALUES (99, 'X', 'Y')", "PRAGMA journal_mode = WAL",
                f"ATTACH '{path.parent / 'other.sqlite'}' AS other", f"VACUUM INTO '{path.parent / 'copy.sqlite'}'",
                "BEGIN IMMEDIATE"]:
        result = run_query(path, sql)
        assert result.error and "read-only" in result.text, sql
    assert sha(path) == before and not (path.parent / "other.sqlite").exists()
    assert not (path.parent / "copy.sqlite").exists()
    assert not run_query(path, "PRAGMA table_info(sales)").error  # reading the schema is allowed
    traj, _, _ = play(db_env, task, ["<sql>DELETE FROM employees</sql>", "<sql>SELECT COUNT(*) FROM employees</sql>",
                                     "<answer>0</answer>"])
    n = sqlite3.connect(path).execute("SELECT COUNT(*) FROM employees").fetchone()[0]
    assert n > 0 and f"COUNT(*)\n{n}" in TOK.decode(list(traj.tokens)) and traj.metrics["query_errors"] == 1
    assert sha(path) == before


def test_db_slow_queries_are_interrupted(db_env):
    task = next(iter(db_env.tasks("heldout")))
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    start = time.perf_counter()
    result = run_query(db_env.database_file(task), endless, time_limit_s=0.2)
    assert result.timed_out and result.error and time.perf_counter() - start < 10  # liveness, not speed
    fast = DatabaseEnv(n_heldout=1, seed=7, max_turns=2, time_limit_s=0.2, cache_dir=db_env.cache_dir)
    traj, _, _ = play(fast, next(iter(fast.tasks("heldout"))), [f"<sql>{endless}</sql>", "<answer>1</answer>"])
    assert traj.metrics["query_timeouts"] == 1 and "was stopped" in TOK.decode(list(traj.tokens))
    many = run_query(db_env.database_file(task), "SELECT * FROM sales", max_rows=5)
    assert many.truncated and len(many.text.splitlines()) == 1 + 5 + 1


def _jsonl(path: Path, lines) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


INLINE = {"schema_sql": "CREATE TABLE t (a INTEGER, b TEXT);", "rows": {"t": [[1, "x"], [2, "y"], [3, "z"]]}}


def test_db_user_tasks_from_jsonl(tmp_path):
    shop = tmp_path / "shop.sqlite"
    with sqlite3.connect(shop) as conn:
        conn.executescript("CREATE TABLE orders (id INTEGER, total REAL); INSERT INTO orders VALUES (1, 2.5), (2, 4);")
    conn.close()
    # Gold values by hand: sum(a) = 1 + 2 + 3 = 6; b where a >= 2 = {y, z}; sum(total) = 2.5 + 4 = 6.5.
    tasks = _jsonl(tmp_path / "tasks.jsonl", [
        {**INLINE, "question": "What is the sum of a?", "answer": 6, "sql": "SELECT SUM(a) FROM t"},
        "",
        {**INLINE, "question": "Which b have a >= 2?", "answer": ["z", "y"]},
        {"db_path": "shop.sqlite", "question": "What is the total of all orders?", "answer": 6.5, "id": "shop-1"}])
    env = DatabaseEnv(tasks_file=str(tasks), n_heldout=1, seed=0, cache_dir=str(tmp_path / "cache"))
    heldout, stream = list(env.tasks("heldout")), env.tasks("train")
    train = [next(stream) for _ in range(4)]
    assert len(heldout) == 1 and len({t.task_id for t in train}) == 2
    assert {t.task_id for t in heldout}.isdisjoint(t.task_id for t in train)
    by_q = {t.prompt: t for t in heldout + train}
    assert "CREATE TABLE orders" in by_q["What is the total of all orders?"].info["schema"]
    answers = {"What is the sum of a?": "6.0", "Which b have a >= 2?": "y, z",
               "What is the total of all orders?": "6.5"}
    for question, answer in answers.items():
        _, reward, _ = play(env, by_q[question], ["<sql>SELECT 1</sql>", f"<answer>{answer}</answer>"])
        assert reward == 1.0, question
    assert sha(shop) == sha(shop)  # opened read-only throughout
    split = DatabaseEnv(tasks_file=str(tasks), heldout_file=str(_jsonl(tmp_path / "h.jsonl", [
        {**INLINE, "question": "What is the sum of a?", "answer": 6}])), cache_dir=str(tmp_path / "cache"))
    assert [t.prompt for t in split.tasks("heldout")] == ["What is the sum of a?"]
    assert {next(split.tasks("train")).prompt} <= {"Which b have a >= 2?", "What is the total of all orders?"}


@pytest.mark.parametrize("bad, message", [
    ('{"question": "q", "answer": 1, ', "invalid JSON"),
    ('["not", "an", "object"]', "expected a JSON object"),
    ({**INLINE, "answer": 1}, "question"),
    ({**INLINE, "question": "q"}, "answer"),
    ({**INLINE, "question": "q", "answer": []}, "answer"),
    ({**INLINE, "db_path": "x.sqlite", "question": "q", "answer": 1}, "exactly one of"),
    ({"db_path": "missing.sqlite", "question": "q", "answer": 1}, "does not exist"),
    ({"db_path": "notes.txt", "question": "q", "answer": 1}, "not a database"),
    ({"schema_sql": "CREATE TABLE t (a)", "rows": {"t": [1, 2]}, "question": "q", "answer": 1}, "rows"),
    ({"schema_sql": "CREATE TABLEE t (a)", "question": "q", "answer": 1}, "syntax error"),
    ({"schema_sql": "CREATE TABLE t (a)", "rows": {"t": [[1, 2]]}, "question": "q", "answer": 1}, "values"),
    ({**INLINE, "question": "q", "answer": 1, "ordered": "yes"}, "ordered"),
])
def test_db_loader_rejects_malformed_lines_naming_file_and_line(tmp_path, bad, message):
    (tmp_path / "notes.txt").write_text("not SQLite at all, " * 100)
    path = _jsonl(tmp_path / "tasks.jsonl", [{**INLINE, "question": "q", "answer": 6}, "", bad])
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + f".*{message}"):
        DatabaseEnv(tasks_file=str(path), n_heldout=1, cache_dir=str(tmp_path / "cache"))


def test_db_loader_names_the_line_of_undecodable_bytes(tmp_path):
    path = tmp_path / "tasks.jsonl"
    good = json.dumps({**INLINE, "question": "q", "answer": 6}).encode()
    path.write_bytes(good + b"\n\n" + b'{"question": "caf\xff"}\n' + good + b"\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: not UTF-8 text")):
        DatabaseEnv(tasks_file=str(path), n_heldout=1, cache_dir=str(tmp_path / "cache"))


def test_db_accepts_json_tool_calls(db_env):
    tool = DatabaseEnv(n_heldout=12, seed=7, max_turns=3, max_rows=5, result_role="tool", cache_dir=db_env.cache_dir)
    task = next(t for t in tool.tasks("heldout") if t.info["is_list"])
    call = json.dumps({"name": "sql", "arguments": {"query": task.info["sql"]}})
    gold = ", ".join(task.info["answer"])
    traj, reward, _ = play(tool, task, [f"<tool_call>{call}</tool_call>", f"<answer>{gold}</answer>"])
    assert reward == 1.0 and traj.metrics["queries"] == 1 == traj.metrics["tool_calls"]
    runs = segments(traj)
    assert [m for m, _ in runs] == [1, 0, 1] and runs[1][1].startswith("\n<|im_start|>tool\n")  # result_role
    assert all(name in runs[1][1] for name in task.info["answer"])
    # Malformed calls and other tools are answered (as failed tool calls), and use their turns.
    traj, reward, _ = play(tool, task, ['<tool_call>{"name": "sql", "arguments": {"query": </tool_call>',
                                        '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>',
                                        "<answer>0</answer>"])
    errors = [text for m, text in segments(traj) if m == 0]
    assert reward == 0.0 and traj.metrics["tool_errors"] == 2 == traj.metrics["tool_calls"]
    assert traj.metrics["queries"] == 0 and "invalid JSON" in errors[0] and "the one tool is sql" in errors[1]
    with pytest.raises(ValueError, match="result_role"):
        DatabaseEnv(n_heldout=1, result_role="system")
