"""Lock-step engine batches (synchronous mode): batch composition depends on the episodes, never on timing."""

from __future__ import annotations

import asyncio
import random

from astratk.contracts import Completion, GenerationRequest, SamplingParams
from astratk.rollout.lockstep import Lockstep


class RecordingEngine:
    """Completes each request with one token = its first prompt token; records every batch it was called with."""

    tokenizer = None
    version = 0

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, ...]]] = []

    async def generate(self, requests):
        self.calls.append([r.prompt_ids for r in requests])
        await asyncio.sleep(0)
        return [Completion((r.prompt_ids[0],), (0.0,), (0,), "length") for r in requests]


def request(*ids: int) -> GenerationRequest:
    return GenerationRequest(ids, SamplingParams(max_tokens=1))


def run_chunk(seed: int, stall_s: float = 5.0) -> tuple[list, list, Lockstep]:
    """Six episodes; episode i takes 1 + i % 3 turns, and sleeps a random time before each turn (tokenising)."""
    rng = random.Random(seed)
    engine = RecordingEngine()
    lock = Lockstep(stall_s=stall_s)
    wrapped = lock.engine(engine)

    async def episode(i: int) -> list[int]:
        out = []
        for turn in range(1 + i % 3):
            await asyncio.sleep(rng.random() * 0.01)
            [c] = await wrapped.generate([request(100 * i + turn)])
            out.append(c.token_ids[0])
        return out

    async def main():
        keys = [("L1", i) for i in range(6)]
        lock.expect(keys)
        return await asyncio.gather(*(lock.run(k, episode(k[1])) for k in reversed(keys)))

    return asyncio.run(main()), engine.calls, lock


def test_batches_are_the_same_whatever_the_timing():
    results, calls, lock = run_chunk(seed=0)
    assert results == [[500, 501, 502], [400, 401], [300], [200, 201, 202], [100, 101], [0]]  # reversed order
    assert calls == [[(0,), (100,), (200,), (300,), (400,), (500,)],  # every episode's first turn, by key
                     [(101,), (201,), (401,), (501,)],
                     [(202,), (502,)]]
    for seed in range(1, 6):
        assert run_chunk(seed)[1] == calls
    assert lock.stalls == 0


def test_an_episode_that_never_calls_the_engine_stalls_the_chunk_only_for_stall_s():
    engine = RecordingEngine()
    lock = Lockstep(stall_s=0.05)
    wrapped = lock.engine(engine)

    async def caller():
        return await wrapped.generate([request(1)])

    async def sleeper():
        await asyncio.sleep(0.3)  # awaits something other than an engine
        return []

    async def main():
        lock.expect([("a",), ("b",)])
        return await asyncio.gather(lock.run(("a",), caller()), lock.run(("b",), sleeper()))

    [c], _ = asyncio.run(main())
    assert c.token_ids == (1,) and lock.stalls == 1


def test_engine_errors_reach_every_caller_of_the_batch():
    class Broken(RecordingEngine):
        async def generate(self, requests):
            raise RuntimeError("engine died")

    lock = Lockstep()
    wrapped = lock.engine(Broken())

    async def one():
        try:
            await wrapped.generate([request(1)])
        except RuntimeError as e:
            return str(e)
        return "no error"

    async def main():
        lock.expect([(0,), (1,)])
        return await asyncio.gather(lock.run((0,), one()), lock.run((1,), one()))

    assert asyncio.run(main()) == ["engine died", "engine died"]


def test_n_samples_reach_their_own_episode():
    """A request with `params.n = k` gets k completions back (`expand_samples`): the batch is split by samples, not
    by requests, so the episode after it gets its own."""
    from astratk.engines import ScriptedEngine

    engine = ScriptedEngine(None, lambda prompt, params: [prompt[0] * 10 + (params.seed or 0)])
    lock = Lockstep()
    wrapped = lock.engine(engine)

    async def episode(i: int, n: int):
        return await wrapped.generate([GenerationRequest((i,), SamplingParams(max_tokens=1, n=n, seed=1))])

    async def main():
        keys = [("L1", 0), ("L1", 1)]
        lock.expect(keys)
        return await asyncio.gather(lock.run(keys[0], episode(1, 3)), lock.run(keys[1], episode(2, 1)))

    first, second = asyncio.run(main())
    assert [c.token_ids for c in first] == [(11,), (12,), (13,)] and [c.token_ids for c in second] == [(21,)]
