"""bf16 against float32 on this CPU, side by side in one process on one torch thread: whether the CPU has bf16 units
(AMX tiles or AVX512-BF16: without them torch emulates bf16), a SmolLM2-sized `Linear` at a decode-sized and a
prefill-sized batch, SmolLM2-135M-Instruct's forward over a prompt batch, and (`--games N`) N held-out household
games played greedily by `TorchEngine` with its prefix cache (the engine's stats say where the time went).

    python bench/bf16_cpu.py
    python bench/bf16_cpu.py --games 16 --model ~/.cache/astratk/models/warm-<key>   # a household warm start
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import Callable

import torch

from astratk import cpu

DTYPES = (torch.float32, torch.bfloat16)


def seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def linear_rows() -> None:
    for rows in (16, 1600):
        times = []
        for dtype in DTYPES:
            x, w = torch.randn(rows, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
            times.append(seconds(lambda x=x, w=w: torch.nn.functional.linear(x, w), 10))
        print(f"| F.linear {rows} x 576 x 1536 | {times[0] * 1e3:.2f} ms | {times[1] * 1e3:.2f} ms | "
              f"{times[1] / times[0]:.1f}x |")


def forward_rows(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(100, 20000, (16, 100), generator=torch.Generator().manual_seed(0))
    times = []
    for dtype in DTYPES:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        with torch.inference_mode():
            times.append(seconds(lambda model=model: model(ids), 1))
    print(f"| SmolLM2 forward, 16 prompts x 100 tokens | {times[0]:.2f} s | {times[1]:.2f} s | "
          f"{times[1] / times[0]:.1f}x |")


def household_rows(model_dir: str, games: int) -> None:
    from astratk.contracts import SamplingParams
    from astratk.engines import TorchEngine
    from astratk.envs.agentbench.household import HouseholdEnv

    env = HouseholdEnv(n_train=512, n_heldout=64, nb_rooms=2, nb_objects=4, quest_length=2, max_turns=6,
                       max_context=2048)  # tutorials/household_real_model.yaml's games
    tasks = list(itertools.islice(env.tasks("heldout"), games))
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    cells = []
    for name in ("float32", "bfloat16"):
        engine = TorchEngine(model_dir, dtype=name, prefix_cache_mb=4096)

        async def play(engine: TorchEngine = engine) -> list:
            return await asyncio.gather(*(env.rollout(t, {"policy": engine}, greedy, policy_ids={"policy": "p"},
                                                      group_id="g") for t in tasks))

        t0 = time.perf_counter()
        episodes = asyncio.run(play())
        wall, stats = time.perf_counter() - t0, engine.stats
        won = sum(e[0].metrics["won"] for e in episodes)
        cells.append(f"{wall:.1f} s (prefill {stats['prefill_s']:.1f}, decode {stats['forward_s']:.1f}; won {won:.0f})")
        engine.close()
    print(f"| {games} household games, greedy, TorchEngine | {cells[0]} | {cells[1]} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a SmolLM2 directory (default: the PyPI GGUF, dequantized)")
    parser.add_argument("--games", type=int, default=0, help="also play this many household games (textworld)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"bf16 units (AMX or AVX512-BF16): {cpu.has_bf16_units()}; one torch thread")
    print("| measurement | float32 | bfloat16 | bf16 / fp32 time |\n|---|---:|---:|---:|")
    linear_rows()
    model_dir = args.model
    if model_dir is None:
        from astratk.models.gguf import gguf_directory
        from astratk.models.pypi import SMOLLM2_135M, resolve_pypi

        model_dir = str(gguf_directory(resolve_pypi(SMOLLM2_135M)))
    forward_rows(model_dir)
    if args.games:
        household_rows(model_dir, args.games)


if __name__ == "__main__":
    main()
