"""One decode step of SmolLM2-135M-Instruct in float32 and bfloat16, with the engine's attention and with HF's sdpa,
side by side in one process on one torch thread (as a rollout worker runs).

A batch of `--rows` rows has `--context` positions in its KV cache (an agent's third turn is ~480 tokens) and a
padding mask (rows of different lengths). The engine's attention (`astratk.engines.torch_kvcache`) keeps K/V grouped
in decode steps and, in bf16, computes them as two matmuls with an fp32 softmax; HF's sdpa goes to torch's CPU flash
attention. Printed: seconds per decode step for each (dtype, attention), the median of `--steps`.

    python bench/decode_attention.py --rows 32 --context 450
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from astratk.engines.torch_engine import TorchEngine
from astratk.engines.torch_kvcache import _GQA_ATTENTION, new_cache
from astratk.models.gguf import gguf_directory
from astratk.models.kvcache import cache_kwargs
from astratk.models.pypi import SMOLLM2_135M, resolve_pypi


def step_times(model: torch.nn.Module, rows: int, context: int, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (rows, context), generator=g)
    mask = torch.ones(rows, context + steps + 1, dtype=torch.long)
    for i in range(rows):  # left padding: rows of different lengths
        mask[i, :i % 17] = 0
    cache = new_cache(model, context + steps + 1)
    pos = (mask[:, :context].cumsum(1) - 1).clamp(min=0)
    times = []
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask[:, :context], position_ids=pos, use_cache=True, logits_to_keep=1,
              **cache_kwargs(model, cache))
        tok, nxt = ids[:, -1:], pos[:, -1:] + 1
        for s in range(steps):
            t = time.perf_counter()
            model(input_ids=tok, attention_mask=mask[:, :context + s + 1], position_ids=nxt + s, use_cache=True,
                  **cache_kwargs(model, cache))
            times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=450)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = gguf_directory(resolve_pypi(SMOLLM2_135M), log=lambda line: None)
    print(f"SmolLM2-135M-Instruct, {args.rows} rows, {args.context} positions cached, one torch thread")
    results = {}
    for dtype in ("float32", "bfloat16"):
        with TorchEngine(str(model_dir), dtype=dtype, enable_prefix_caching=False) as engine:
            model = engine._model
            for name, impl in (("engine", _GQA_ATTENTION), ("hf sdpa", "sdpa")):
                model.set_attn_implementation(impl)
                results[dtype, name] = statistics.median(step_times(model, args.rows, args.context, args.steps))
                print(f"{dtype:>9} {name:>8}: {results[dtype, name]:.3f} s per decode step")
    base = results["float32", "engine"]
    print(f"bfloat16 with the engine's attention: {base / results['bfloat16', 'engine']:.2f}x the float32 engine; "
          f"with HF's sdpa: {base / results['bfloat16', 'hf sdpa']:.2f}x")


if __name__ == "__main__":
    main()
