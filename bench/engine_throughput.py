"""TorchEngine vs plain `transformers` `model.generate`: sampled tokens per second, side by side.

Same model weights, same prompts (left-padded, lengths around 24), same sampling (T = 1.0, no top-k / top-p, fp32),
same number of new tokens (no stop tokens, so every row runs its whole budget). One warm-up each, then repeats
alternate between the two so that drifting load on a shared machine hits both alike. Prints a table and the ratio.

    python bench/engine_throughput.py                      # tiny random Qwen2, batch 512 x 64 new tokens
    python bench/engine_throughput.py --model runs/x/model --batch 256 --new-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines.torch_engine import TorchEngine


def tiny_model(vocab: int, seed: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=vocab, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=256, tie_word_embeddings=True,
                         max_position_embeddings=512)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float().eval()


def prompts(batch: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 29, (batch,), generator=g).tolist()  # ~24 tokens, so both sides pad
    return [tuple(torch.randint(1, vocab, (n,), generator=g).tolist()) for n in lengths]


def run_hf(model: torch.nn.Module, batch: list[tuple[int, ...]], new_tokens: int) -> int:
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                             pad_token_id=0)
    return (out.shape[1] - width) * out.shape[0]


def run_engine(engine: TorchEngine, batch: list[tuple[int, ...]], new_tokens: int) -> int:
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens)
    completions = asyncio.run(engine.generate([GenerationRequest(p, params) for p in batch]))
    return sum(len(c.token_ids) for c in completions)


def timed(fn, *args) -> tuple[float, int]:
    start = time.perf_counter()
    n = fn(*args)
    return time.perf_counter() - start, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model directory (default: a tiny random Qwen2)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=100, help="vocabulary of the tiny random model")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2-core machines: 1)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.model:
        hf_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    else:
        hf_model = tiny_model(args.vocab, seed=0)
    hf_model = hf_model.to(args.device)
    vocab = hf_model.get_output_embeddings().weight.shape[0]
    # The engine switches its model's attention to a grouped-K/V variant; HF generate keeps the stock one.
    engine = TorchEngine.from_model(copy.deepcopy(hf_model), None, max_batch=args.batch)
    batch = prompts(args.batch, vocab, seed=1)

    run_hf(hf_model, batch[:8], 4)  # warm-up
    run_engine(engine, batch[:8], 4)
    times: dict[str, list[float]] = {"transformers generate": [], "TorchEngine": []}
    for _ in range(args.repeats):
        for name, fn, target in (("transformers generate", run_hf, hf_model), ("TorchEngine", run_engine, engine)):
            seconds, tokens = timed(fn, target, batch, args.new_tokens)
            times[name].append(tokens / seconds)
    engine.close()

    print(f"batch {args.batch} x {args.new_tokens} new tokens, prompts {min(map(len, batch))}-"
          f"{max(map(len, batch))} tokens, fp32, T=1.0, {torch.get_num_threads()} torch thread(s), {args.device}")
    print(f"{'':24s}{'tok/s (median)':>16s}{'min':>10s}{'max':>10s}")
    for name, rates in times.items():
        print(f"{name:24s}{statistics.median(rates):16.0f}{min(rates):10.0f}{max(rates):10.0f}")
    ratio = statistics.median(times["TorchEngine"]) / statistics.median(times["transformers generate"])
    print(f"{'ratio engine / hf':24s}{ratio:16.2f}")


if __name__ == "__main__":
    main()
