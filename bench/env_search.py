"""The search env's own cost: step overhead per turn (model and retrieval excluded) and BM25 latency per query.

    python bench/env_search.py                     # ~10k passages, 300 scripted episodes
    python bench/env_search.py --episodes 50       # a quick look
    (run from the repository root)

Step overhead: scripted episodes (search per hop, then answer; `SearchEnv.solution_turns`) through the real
`SearchEnv.rollout` with a `ScriptedEngine` and the built-in character tokenizer. Wall time per episode minus the
engine's time (a timing proxy around `generate`) minus retrieval (the env's `retrieval_seconds`), divided by the
episode's turns: everything else the env does per turn, i.e. parsing the action, formatting passages, encoding and
appending the env message, and the per-episode start (prompt rendering) amortised over the turns. Target: < 1 ms.
Scoring is timed separately. The character tokenizer is the heavy case for encoding (one token per byte).

Retrieval: every hop query of the synthetic questions against the ~10k-passage index, one at a time: median, mean and
99th percentile; the index build once. With rank_bm25 installed, the same queries through `rank_bm25.BM25Okapi` for
comparison (the choice of bm25s in `astratk.envs.search.index`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.multiturn import Budget
from astratk.envs.search import BM25Index, SearchEnv, SyntheticCorpus
from astratk.envs.search.index import tokenize
from astratk.models import build_char_tokenizer

# ~10k passages: 2 facts + 1 distractor per person, 3 + 1 per company, 1 + 1 per city, 1 per country
CORPUS_10K = SyntheticCorpus(seed=0, n_people=1800, n_cities=200, n_countries=30, n_companies=1050, n_heldout=500)


class TimedEngine:
    """Forwards to an engine and adds up the time spent inside `generate` (the model's share, excluded)."""

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine, self.seconds = engine, 0.0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, requests):
        start = time.perf_counter()
        out = await self.engine.generate(requests)
        self.seconds += time.perf_counter() - start
        return out

    def load_weights(self, state, version):
        self.engine.load_weights(state, version)


def bench_steps(env: SearchEnv, episodes: int) -> dict[str, float]:
    tok = build_char_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    tasks = list(env.tasks("heldout"))[:episodes]
    scripts = [[tok(t, add_special_tokens=False)["input_ids"] + [end] for t in env.solution_turns(task)]
               for task in tasks]
    sampling = SamplingParams(max_tokens=256)
    env.index.build()
    per_turn, scoring, turns_total, rewards = [], [], 0, []

    async def episodes() -> None:  # one event loop for all, as a rollout service runs a task's episodes
        nonlocal turns_total
        await env.rollout(tasks[0], {"policy": ScriptedEngine(tok, scripts[0])}, sampling,
                          policy_ids={"policy": "p"}, group_id="warm")  # template caches, first encodes
        for task, script in zip(tasks, scripts):
            engine = TimedEngine(ScriptedEngine(tok, script))
            start = time.perf_counter()
            [traj] = await env.rollout(task, {"policy": engine}, sampling, policy_ids={"policy": "p"}, group_id="g")
            wall = time.perf_counter() - start
            turns = traj.metrics["turns"]
            per_turn.append((wall - engine.seconds - traj.metrics["retrieval_seconds"]) / turns)
            start = time.perf_counter()
            rewards.extend(env.score(task, [traj]))
            scoring.append(time.perf_counter() - start)
            turns_total += turns

    asyncio.run(episodes())
    ms = [1e3 * x for x in per_turn]
    return {"episodes": len(tasks), "turns_per_episode": turns_total / len(tasks),
            "overhead_ms_per_turn_median": statistics.median(ms), "overhead_ms_per_turn_mean": statistics.fmean(ms),
            "overhead_ms_per_turn_p99": sorted(ms)[int(0.99 * (len(ms) - 1))],
            "score_ms_per_trajectory": 1e3 * statistics.fmean(scoring), "mean_reward": statistics.fmean(rewards)}


def bench_retrieval(env: SearchEnv, max_queries: int) -> dict[str, float]:
    corpus = env.data
    queries = [q for question in corpus.train + corpus.heldout for q in question.queries][:max_queries]
    texts = [p.display for p in corpus.passages]
    start = time.perf_counter()
    index = BM25Index(texts).build()
    build = time.perf_counter() - start
    index.search(queries[0], 3)
    times = []
    for q in queries:
        start = time.perf_counter()
        index.search(q, env.top_k)
        times.append(1e3 * (time.perf_counter() - start))
    out = {"passages": len(texts), "queries": len(queries), "build_s": build,
           "query_ms_median": statistics.median(times), "query_ms_mean": statistics.fmean(times),
           "query_ms_p99": sorted(times)[int(0.99 * (len(times) - 1))]}
    try:
        import numpy as np
        import rank_bm25
    except ImportError:
        return out
    start = time.perf_counter()
    okapi = rank_bm25.BM25Okapi([tokenize(t) for t in texts])
    out["rank_bm25_build_s"] = time.perf_counter() - start
    sample = queries[:200]
    start = time.perf_counter()
    for q in sample:
        np.argsort(-okapi.get_scores(tokenize(q)), kind="stable")[: env.top_k]
    out["rank_bm25_query_ms_mean"] = 1e3 * (time.perf_counter() - start) / len(sample)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=300)
    p.add_argument("--queries", type=int, default=5000)
    args = p.parse_args()
    env = SearchEnv(CORPUS_10K, top_k=3, budget=Budget(max_turns=8, max_context=8192, max_env_tokens=512))
    report = {"retrieval": bench_retrieval(env, args.queries), "steps": bench_steps(env, args.episodes)}
    print(json.dumps(report, indent=2))
    steps = report["steps"]
    print(f"env step overhead: {steps['overhead_ms_per_turn_median']:.3f} ms/turn median "
          f"(target < 1 ms, {steps['overhead_ms_per_turn_median']:.2f}x of it); retrieval at "
          f"{report['retrieval']['passages']} passages: {report['retrieval']['query_ms_median']:.3f} ms/query median")


if __name__ == "__main__":
    main()
