"""The OpenAI endpoint under a flood: N concurrent chat-completions requests over real HTTP, spread over S sessions,
half of them streamed, some clients hanging up mid-stream, with a cap of in-flight requests (`max_inflight`) below
or above N. Prints what the server held at once, what it shed (429), latency percentiles of the answered requests,
and checks what training relies on: the server still answers, every answered call is recorded in its own session
and in no other, and each session's calls hold only that session's messages.

The engine is the scripted one with a fixed generation time per call (`--gen-ms`: the endpoint's own cost under load,
the model's cost kept out) or the quickstart's tiny model on TorchEngine (`--engine tiny`, batched as a run batches).
Client and server share this process (the server on its own thread and event loop).

    python bench/endpoint_load.py                               # 500 requests, 50 sessions, cap 1024 then cap 100
    python bench/endpoint_load.py --requests 2000 --gen-ms 200
    python bench/endpoint_load.py --engine tiny --requests 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class TimedEngine:
    """The scripted engine, answering each generate call after `delay` seconds (a stand-in for the model)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.tokenizer, self.max_model_len = inner.tokenizer, inner.max_model_len

    async def generate(self, requests: Any) -> Any:
        await asyncio.sleep(self.delay)
        return await self.inner.generate(requests)


def make_engine(args: argparse.Namespace) -> Any:
    if args.engine == "tiny":
        from astratk.engines.torch_engine import TorchEngine
        from astratk.envs.math import ArithmeticEnv
        from astratk.models.cache import ensure_model
        from astratk.spec import ModelSpec, TinyModelSpec

        path = ensure_model(ModelSpec(tiny=TinyModelSpec(warm_start_steps=20, warm_start_batch=16,
                                                         warm_start_target=None)), ArithmeticEnv(levels=[1]),
                            log=lambda line: None)
        return TorchEngine(str(path), max_batch=256)
    from astratk.engines.scripted import ScriptedEngine
    from astratk.models.chat import stop_token_ids
    from astratk.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    reply = tok("the answer is 42", add_special_tokens=False)["input_ids"] + [stop_token_ids(tok)[0]]
    return TimedEngine(ScriptedEngine(tok, lambda prompt, params: reply), args.gen_ms / 1000)


async def one(http: Any, url: str, session: str, k: int, stream: bool, hang_up: bool) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": f"{session} question {k}"}], "max_tokens": 16,
            "stream": stream}
    t0 = time.perf_counter()
    try:
        async with http.post(f"{url}/chat/completions", json=body) as r:
            if hang_up:  # read the first bytes (or nothing), then drop the connection
                await r.content.read(8)
                r.close()
                return {"status": "hung_up", "latency": time.perf_counter() - t0, "session": session}
            text = await r.text()
            return {"status": r.status, "latency": time.perf_counter() - t0, "session": session, "text": text,
                    "stream": stream}
    except Exception as e:  # noqa: BLE001 - a client-side failure is a result to count
        return {"status": f"client error {type(e).__name__}", "latency": time.perf_counter() - t0,
                "session": session}


async def flood(url: str, n: int, sessions: int, hang_ups: int) -> tuple[list[dict[str, Any]], float]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()
        jobs = [one(http, f"{url}/s/sess{k % sessions}/v1", f"sess{k % sessions}", k, stream=k % 2 == 1,
                    hang_up=k % 2 == 1 and k < 2 * hang_ups) for k in range(n)]
        results = await asyncio.gather(*jobs)
        return list(results), time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def check(endpoint: Any, results: list[dict[str, Any]], sessions: int) -> list[str]:
    """What training relies on; returns the problems found (none expected)."""
    import urllib.request

    problems = []
    with urllib.request.urlopen(f"{endpoint.base_url}/models", timeout=10) as r:  # still up
        if r.status != 200:
            problems.append(f"/v1/models answered {r.status} after the flood")
    answered: dict[str, int] = {}
    for res in results:
        if res["status"] == 200:
            answered[res["session"]] = answered.get(res["session"], 0) + 1
            text = res["text"]
            if res["stream"] and not text.rstrip().endswith("data: [DONE]"):
                problems.append(f"a stream of {res['session']} did not end with [DONE]")
    for s in range(sessions):
        name = f"sess{s}"
        calls = endpoint.calls(name)
        foreign = [c for c in calls if not c.messages[0]["content"].startswith(f"{name} ")]
        if foreign:
            problems.append(f"session {name} holds {len(foreign)} calls of other sessions")
        if len(calls) < answered.get(name, 0):
            problems.append(f"session {name}: {answered.get(name, 0)} answered but {len(calls)} recorded")
    return problems


def run(args: argparse.Namespace, cap: int) -> dict[str, Any]:
    from astratk.rollout.openai_api import OpenAIEndpoint

    engine = make_engine(args)
    with OpenAIEndpoint(engine, model="m", default_max_tokens=16, max_inflight=cap) as ep:
        results, wall = asyncio.run(flood(ep.root, args.requests, args.sessions, args.hang_ups))
        time.sleep(args.gen_ms / 1000 + 1.0)  # the hung-up requests' samples finish and are recorded
        problems = check(ep, results, args.sessions)
        stats = dict(ep.stats)
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    codes: dict[str, int] = {}
    for r in results:
        codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
    ok = [r["latency"] for r in results if r["status"] == 200]
    return {"max_inflight": cap, "requests": args.requests, "sessions": args.sessions, "statuses": codes,
            "held_at_once": stats["max_inflight_seen"], "shed_429": stats["shed"],
            "stream_disconnects": stats["stream_disconnects"], "recorded_calls": sum(
                len(ep.calls(f"sess{s}")) for s in range(args.sessions)),
            "p50_s": round(statistics.median(ok), 4) if ok else None, "p99_s": round(pct(ok, 0.99), 4),
            "max_s": round(max(ok), 4) if ok else None, "wall_s": round(wall, 3),
            "answered_per_s": round(len(ok) / wall, 1), "problems": problems}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--hang-ups", type=int, default=10, help="streaming clients that disconnect after 8 bytes")
    ap.add_argument("--gen-ms", type=float, default=100.0, help="scripted engine: time of one generate call")
    ap.add_argument("--engine", choices=["scripted", "tiny"], default="scripted")
    ap.add_argument("--caps", default="1024,100", help="max_inflight values to run, comma-separated")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = []
    for cap in (int(c) for c in args.caps.split(",")):
        row = run(args, cap)
        rows.append(row)
        print(f"max_inflight {cap}: {args.requests} requests in {row['wall_s']} s over {args.sessions} sessions "
              f"({'tiny model, TorchEngine' if args.engine == 'tiny' else f'scripted, {args.gen_ms:g} ms per generate'}): held at once {row['held_at_once']}, shed (429) "
              f"{row['shed_429']}, statuses {row['statuses']}, latency p50 {row['p50_s']} s p99 {row['p99_s']} s "
              f"max {row['max_s']} s, {row['answered_per_s']} answered/s; recorded calls {row['recorded_calls']}, "
              f"stream hang-ups seen {row['stream_disconnects']}; problems: {row['problems'] or 'none'}")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    rows = main()
    sys.exit(1 if any(r["problems"] for r in rows) else 0)
