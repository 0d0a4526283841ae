"""Two LoRA policies on one base: batches that mix the adapters' rows against one adapter per batch, in one process.

Two policies trained with LoRA on one base (a solver and a verifier) share one TorchEngine in a rollout worker. Their
requests arrive together; with `mix_adapters` (the default) they run as one batch: one base forward for every row,
each adapter's thin matmuls on its own rows (`astratk/engines/torch_lora_mix.py`). Without it, each batch runs one
adapter's rows and the second waits for the first. Two engines on SmolLM2-135M-Instruct, each with two r-16 adapters
(the initial adapters with B moved off zero, so each adapter changes what the model samples), get the same calls
(`--prompts` chat prompts x `--group` samples per adapter, sampled at temperature 1, stop at <|im_end|>), alternating
round by round, on `--threads` torch threads each. Printed: each round's time both ways, the median ratio, tokens/s.

    python bench/mixed_adapters.py --prompts 4 --group 8 --rounds 3 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from _real_model import chat_prompts, smollm2_dir  # bench/ is on the path when run as a script

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines.torch_engine import TorchEngine
from astratk.models import lora as L
from astratk.models.loading import load_tokenizer
from astratk.spec import LoraSpec


def _adapter(model_dir: str, lora: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """The initial adapter with B drawn small and non-zero: a policy some steps into training."""
    state = L.initial_adapter(model_dir, lora)
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) if "lora_B" in k else v for k, v in state.items()}


async def _round(engine: TorchEngine, calls: dict[str, list[GenerationRequest]]) -> list:
    return await asyncio.gather(*(engine.adapter(name).generate(reqs) for name, reqs in calls.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="distinct prompts per adapter and round")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = smollm2_dir()
    tok = load_tokenizer(model_dir)
    lora = LoraSpec(r=16, alpha=32)
    adapters = {name: _adapter(model_dir, lora, seed) for seed, name in enumerate(("solver", "verifier"))}
    engines = {mode: TorchEngine(model_dir, dtype=args.dtype, mix_adapters=mode == "mixed", batch_window_s=0.01)
               for mode in ("mixed", "one adapter per batch")}
    for engine in engines.values():
        for name, state in adapters.items():
            engine.add_adapter(name, lora, state, 0)
    stop = tuple(tok.convert_tokens_to_ids(["<|im_end|>"]))
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    tokens: dict[str, int] = dict.fromkeys(engines, 0)
    rows = 2 * args.prompts * args.group
    print(f"SmolLM2-135M-Instruct, 2 LoRA adapters (r 16), {args.prompts} prompts x {args.group} samples per adapter "
          f"({rows} rows a round), up to {args.new_tokens} new tokens, {args.dtype}, {args.threads} torch thread(s)")
    try:
        for r in range(args.rounds + 1):  # round 0 warms both engines up and is left out
            calls = {name: [GenerationRequest(p, SamplingParams(temperature=1.0, max_tokens=args.new_tokens,
                                                                seed=10_000 * r + 100 * k + i, stop_token_ids=stop))
                            for i, p in enumerate(chat_prompts(tok, args.prompts, args.group, seed=r * 7 + k))]
                     for k, name in enumerate(adapters)}
            line = []
            for mode, engine in (engines.items() if r % 2 else reversed(engines.items())):
                started = time.perf_counter()
                out = asyncio.run(_round(engine, calls))
                seconds = time.perf_counter() - started
                if r:
                    times[mode].append(seconds)
                    tokens[mode] += sum(len(c.token_ids) for call in out for c in call)
                line.append(f"{mode} {seconds:.2f} s")
            print(f"round {r}{' (warm-up)' if not r else ''}: " + ", ".join(line))
        stats = {mode: e.stats for mode, e in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    med = {mode: statistics.median(t) for mode, t in times.items()}
    for mode in engines:
        print(f"{mode}: median {med[mode]:.2f} s a round, {tokens[mode] / sum(times[mode]):.0f} tokens/s, "
              f"{stats[mode]['batches']} batches ({stats[mode]['mixed_batches']} mixed), largest "
              f"{stats[mode]['max_batch_seen']} rows")
    print(f"mixed batches: {med['one adapter per batch'] / med['mixed']:.2f}x one adapter per batch (median rounds)")


if __name__ == "__main__":
    main()
