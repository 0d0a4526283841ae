"""What the AgentBench-style envs add per episode step, next to the multi-turn machinery alone.

For each env a `ScriptedEngine` plays fixed replies (no model time), so an episode's wall time is the env's cost:
chat encoding, the game or database step, and the thread hops that keep the event loop free. The baseline plays
the same number of turns through a bare `Conversation` with a constant environment message.

    python bench/env_agentbench.py            # household (needs textworld; ALFWorld games need fast_downward) and db
    python bench/env_agentbench.py --episodes 50 --concurrency 8

Figures: game generation (first game in a process, then each), a live game's open/step/close (an ALFWorld .tw-pddl
game: the first open loads a copy of the planner library, later opens reuse it), a read-only query, and ms per turn for sequential episodes and for `--concurrency` episodes gathered on one event loop (as a rollout
service runs a group).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import tempfile
import time

from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.multiturn import Budget, Conversation
from astratk.models import build_char_tokenizer

TOK = build_char_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")
SAMPLING = SamplingParams(max_tokens=200)


def replies_engine(replies: list[str]) -> ScriptedEngine:
    def script(prompt_ids, params):
        k = TOK.decode(list(prompt_ids)).count("<|im_start|>assistant") - 1
        return list(TOK(replies[min(k, len(replies) - 1)], add_special_tokens=False)["input_ids"]) + [END]
    return ScriptedEngine(TOK, script)


async def episodes(env, task, replies, n: int, concurrency: int) -> tuple[float, float]:
    """(ms per turn, turns per episode) over n episodes, `concurrency` at a time."""
    engine = replies_engine(replies)
    turns = []
    start = time.perf_counter()
    for i in range(0, n, concurrency):
        batch = await asyncio.gather(*(env.rollout(task, {"policy": engine}, SAMPLING, policy_ids={"policy": "p"},
                                                   group_id=f"g{i + j}") for j in range(min(concurrency, n - i))))
        turns += [t.metrics["turns"] for [t] in batch]
    return 1e3 * (time.perf_counter() - start) / sum(turns), statistics.mean(turns)


async def baseline(messages, replies, env_text: str, turns: int, n: int) -> float:
    """ms per turn of the multi-turn machinery alone: same prompt, replies and turn count, a constant env message."""
    engine = replies_engine(replies)
    start = time.perf_counter()
    for _ in range(n):
        conv = Conversation.start(TOK, messages, Budget(max_turns=turns, max_context=8192))
        for k in range(turns):
            await conv.assistant_turn(engine, SAMPLING)
            if k < turns - 1:
                conv.add_message("user", env_text)
    return 1e3 * (time.perf_counter() - start) / (n * turns)


def timed(fn, n: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e3 * (time.perf_counter() - start) / n


def household(rows: list[tuple[str, str]], n: int, concurrency: int, cache: str) -> None:
    from astratk.envs.agentbench.household import GameRecipe, HouseholdEnv, LiveGame, ensure_game

    start = time.perf_counter()
    ensure_game(GameRecipe(11, 3, 6, 3), cache)
    rows.append(("household: generate a game (first in process, incl. TextWorld KB load)",
                 f"{time.perf_counter() - start:.2f} s"))
    start = time.perf_counter()
    for seed in (12, 13):
        ensure_game(GameRecipe(seed, 3, 6, 3), cache)
    rows.append(("household: generate a game (3 rooms, 6 objects, quest length 3)",
                 f"{(time.perf_counter() - start) / 2:.2f} s"))
    env = HouseholdEnv(n_train=1, n_heldout=1, seed=0, cache_dir=cache, max_turns=15)
    task = next(iter(env.tasks("heldout")))
    path = env.game_file(task)
    rows.append(("household: cached game lookup", f"{timed(lambda: env.game_file(task), 200):.3f} ms"))
    rows.append(("household: open + reset + close a live game", f"{timed(lambda: LiveGame(path).close(), 20):.1f} ms"))
    game = LiveGame(path)
    rows.append(("household: one game step ('look')", f"{timed(lambda: game.step('look'), 200):.2f} ms"))
    game.close()
    game = LiveGame(path, list_commands=True)
    rows.append(("household: one step, listing commands", f"{timed(lambda: game.step('look'), 50):.2f} ms"))
    game.close()

    look = ["<action>look</action>"]
    per_turn, turns = asyncio.run(episodes(env, task, look, n, 1))
    base = asyncio.run(baseline(env.messages(task), look, task.info["intro"], int(turns), n))
    rows.append((f"household: episode of {turns:.0f} turns, sequential", f"{per_turn:.2f} ms/turn"))
    rows.append(("  multi-turn machinery alone, same turns and text", f"{base:.2f} ms/turn"))
    rows.append(("  => env step overhead", f"{per_turn - base:.2f} ms/turn"))
    per_turn, _ = asyncio.run(episodes(env, task, look, n, concurrency))
    rows.append((f"household: {concurrency} concurrent episodes", f"{per_turn:.2f} ms/turn"))


def alfworld(rows: list[tuple[str, str]], n: int, concurrency: int, cache: str) -> None:
    import json
    from pathlib import Path

    from astratk.envs.agentbench.games import LiveGame, alfworld_example
    from astratk.envs.agentbench.household import HouseholdEnv

    games = Path(cache) / "alfworld"
    games.mkdir()
    for goal in ("cabinet", "sink"):
        (games / f"{goal}.tw-pddl").write_text(json.dumps(alfworld_example(goal)))
    path = games / "sink.tw-pddl"
    rows.append(("alfworld: open + reset + close, first (loads the planner)",
                 f"{timed(lambda: LiveGame(path).close()):.1f} ms"))
    rows.append(("alfworld: open + reset + close, pooled planner", f"{timed(lambda: LiveGame(path).close(), 20):.1f} ms"))
    game = LiveGame(path)
    rows.append(("alfworld: one game step", f"{timed(lambda: game.step('go to table'), 200):.2f} ms"))
    game.close()
    env = HouseholdEnv(games_dir=str(games), n_heldout=1, seed=0, max_turns=15)
    task = next(iter(env.tasks("heldout")))
    look = ["<action>go to table</action>"]
    per_turn, turns = asyncio.run(episodes(env, task, look, n, 1))
    rows.append((f"alfworld: episode of {turns:.0f} turns, sequential", f"{per_turn:.2f} ms/turn"))
    per_turn, _ = asyncio.run(episodes(env, task, look, n, concurrency))
    rows.append((f"alfworld: {concurrency} concurrent episodes (PDDL calls serialised)", f"{per_turn:.2f} ms/turn"))


def database(rows: list[tuple[str, str]], n: int, concurrency: int, cache: str) -> None:
    from astratk.envs.agentbench.db import DatabaseEnv
    from astratk.envs.agentbench.sql import run_query

    env = DatabaseEnv(n_heldout=1, seed=0, cache_dir=cache, max_turns=5)
    stream = env.tasks("train")
    rows.append(("db: generate a task (database + question + gold)", f"{timed(lambda: next(stream), 300):.2f} ms"))
    task = next(iter(env.tasks("heldout")))
    path = env.database_file(task)
    rows.append(("db: cached database lookup", f"{timed(lambda: env.database_file(task), 200):.3f} ms"))
    rows.append(("db: read-only query (open, authorize, run, render)",
                 f"{timed(lambda: run_query(path, task.info['sql']), 300):.2f} ms"))
    replies = ["<sql>SELECT name, salary FROM employees ORDER BY salary DESC</sql>"]
    per_turn, turns = asyncio.run(episodes(env, task, replies, n, 1))
    result = run_query(path, replies[0][5:-6], max_rows=env.max_rows).text
    base = asyncio.run(baseline(env.messages(task), replies, result, int(turns), n))
    rows.append((f"db: episode of {turns:.0f} query turns, sequential", f"{per_turn:.2f} ms/turn"))
    rows.append(("  multi-turn machinery alone, same turns and text", f"{base:.2f} ms/turn"))
    rows.append(("  => env step overhead", f"{per_turn - base:.2f} ms/turn"))
    per_turn, _ = asyncio.run(episodes(env, task, replies, n, concurrency))
    rows.append((f"db: {concurrency} concurrent episodes", f"{per_turn:.2f} ms/turn"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as cache:
        database(rows, args.episodes, args.concurrency, cache)
        if importlib.util.find_spec("textworld"):
            household(rows, args.episodes, args.concurrency, cache)
            if importlib.util.find_spec("fast_downward"):
                alfworld(rows, args.episodes, args.concurrency, cache)
            else:
                rows.append(("alfworld", "skipped: pip install -e '.[agentbench]'"))
        else:
            rows.append(("household", "skipped: pip install textworld==1.7.0"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>14}")


if __name__ == "__main__":
    main()
