"""Math envs: env overhead per turn (task generation, a single-turn rollout with a ScriptedEngine, no model, no
grading) and `MathGrader` latency and throughput, in the calling thread (fast path) and through the child process.

    python bench/env_math.py                # ~30 s
    python bench/env_math.py --n 500        # a quick look
    (run from the repository root)

Rollout overhead is the whole `env.rollout` coroutine (chat template, tokenisation, the engine call, decoding,
building the Trajectory) driven by `asyncio.run` per episode, with a ScriptedEngine that answers instantly; so it is
an upper bound on what the env adds per turn. The ArithmeticEnv row is the reference. Grading rows are the median
per-call latency over `--n` calls (after warm-up) and its inverse; the child path runs with `fast_path=False`, so even
plain numbers go through the child. Child start is the time to start one (imports sympy and math-verify).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.math import ArithmeticEnv, MathGrader, MathJsonlEnv, WordProblemEnv, final_answer
from astratk.models import build_char_tokenizer


def numeric(i: int) -> tuple[str, str]:
    """A fresh numeric (gold, completion) pair per call: math-verify caches parses of repeated strings."""
    return [(str(i), str(i)), (f"{i * 1000}", f"The total is {i * 1000:,}"),
            (f"{i}/{i + 1}", f"\\frac{{{i}}}{{{i + 1}}}"), (str(i), str(i + 1))][i % 4]


def latex(i: int) -> tuple[str, str]:
    """A fresh LaTeX pair per call (surds, symbols, sets, constants)."""
    return [(f"\\frac{{\\sqrt{{{i}}}}}{{2}}", f"so \\boxed{{\\frac{{\\sqrt{{{i}}}}}{{2}}}}"),
            (f"x+{i}", f"\\boxed{{{i}+x}}"), (f"\\{{1,{i}\\}}", f"\\boxed{{\\{{{i},1\\}}}}"),
            (f"{i}\\pi", f"\\boxed{{{i} \\pi}}")][i % 4]


def per_call(fn, n: int, warmup: int = 20) -> float:
    """Median seconds per call of fn() over n calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rollout_overhead(env, tok, n: int) -> tuple[float, float]:
    """(median s per rollout, mean s per train task drawn)."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(tok, lambda prompt, params: list(tok("42", add_special_tokens=False)["input_ids"]) + [end])
    tasks = itertools.cycle(list(itertools.islice(env.tasks("train"), 64)))
    sampling = SamplingParams(max_tokens=16)

    def one():
        asyncio.run(env.rollout(next(tasks), {"policy": engine}, sampling, policy_ids={"policy": "p"},
                                group_id="g"))

    stream = env.tasks("train")
    t = time.perf_counter()
    for _ in itertools.islice(stream, n):
        pass
    per_task = (time.perf_counter() - t) / n
    return per_call(one, n), per_task


def grading(n: int) -> list[tuple[str, float]]:
    rows = []
    count = itertools.count(2)
    fast = MathGrader(timeout_s=10.0)
    text = "Let me think step by step. " * 7 + "So the answer is \\boxed{\\frac{1}{2}}."
    rows.append(("final_answer() extraction, 200-char text", per_call(lambda: final_answer(text), n)))
    rows.append(("fast path (in-thread), numeric answers", per_call(lambda: fast.grade(*numeric(next(count))), n)))
    slow = MathGrader(timeout_s=10.0, fast_path=False)
    t = time.perf_counter()
    slow.start()
    rows.append(("child start (once per process / after a timeout)", time.perf_counter() - t))
    rows.append(("child path, numeric answers", per_call(lambda: slow.grade(*numeric(next(count))), n)))
    rows.append(("child path, LaTeX answers", per_call(lambda: slow.grade(*latex(next(count))), n)))
    out: list[float] = []
    th = threading.Thread(target=lambda: out.append(per_call(lambda: fast.grade(*numeric(next(count))), n)))
    th.start()
    th.join()
    rows.append(("fast path from a non-main thread, numeric", out[0]))
    assert [fast.grade(*numeric(i)) for i in range(4)] == [1.0, 1.0, 1.0, 0.0]
    assert [slow.grade(*latex(i)) for i in range(4)] == [1.0] * 4
    assert fast.counts["timeouts"] == slow.counts["timeouts"] == 0
    fast.close()
    slow.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="calls per measure")
    args = ap.parse_args()
    tok = build_char_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        rows = [{"question": f"Tom has {i} apples and buys {i + 1}. How many?", "answer": f"#### {2 * i + 1}"}
                for i in range(200)]
        train, test = Path(d, "train.jsonl"), Path(d, "test.jsonl")
        train.write_text("".join(json.dumps(r) + "\n" for r in rows[20:]))
        test.write_text("".join(json.dumps(r) + "\n" for r in rows[:20]))
        envs = [("arithmetic (reference)", ArithmeticEnv(n_heldout=64)),
                ("math_word, levels 1-5", WordProblemEnv(levels=[1, 2, 3, 4, 5], n_heldout=64)),
                ("math_jsonl (gsm8k rows)", MathJsonlEnv(str(train), str(test)))]
        print(f"{'env overhead per turn (no model, no grading)':<52}{'rollout us':>12}{'task us':>12}")
        for label, env in envs:
            roll, task = rollout_overhead(env, tok, args.n)
            print(f"{label:<52}{roll * 1e6:>12.1f}{task * 1e6:>12.2f}")
            if hasattr(env, "grader"):
                env.grader.close()
    print()
    print(f"{'MathGrader':<52}{'ms/call':>12}{'calls/s':>12}")
    for label, s in grading(max(50, args.n // 10)):
        rate = "-" if label.startswith("child start") else f"{1 / s:.0f}"
        print(f"{label:<52}{s * 1e3:>12.3f}{rate:>12}")


if __name__ == "__main__":
    main()
