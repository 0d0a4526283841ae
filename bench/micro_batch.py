"""Token-budget micro-batching (`trainer.micro_batch_tokens`): peak memory and step time of one training step with the
whole batch in one forward vs two budgets, side by side, on the tiny model; plus how far the gradient moved.

    python bench/micro_batch.py                                  # 64 sequences of 64-256 tokens, budgets 4096, 1024
    python bench/micro_batch.py --min-length 256                 # equal lengths: no padding to remove
    python bench/micro_batch.py --batch 32 --budgets 2048 512 --repeats 3 --loss drpo   # a quick look
    (run from the repository root)

One step = `PolicyModule.training_step` + backward of the loss it returns (the earlier micro-batches are
back-propagated inside), fp32, CPU, one torch thread; no optimiser step (it is the same for every budget). Losses:
`drpo` (no batch statistics: one forward per micro-batch, shares of the step's loss) and `m2po` (batch statistics:
the two-pass step, one extra no-grad forward per micro-batch). Every (loss, budget) runs in a fresh process, so no
measurement inherits another's allocator state:
- peak tensor MB: the most tensor memory allocated during one step above what was live before it (running sum of the
  torch profiler's allocation events; exact for torch's own CPU allocations);
- peak RSS MB: the process's resident-set peak during its first step minus its resident set before it (Linux:
  VmHWM is reset through /proc/self/clear_refs); allocator caching blurs it, hence the column above;
- fwd tokens: padded tokens the forwards compute (rows x width, summed over micro-batches): packing rows by length
  removes most padding, which is why a split step can be faster than the whole one;
- step s: median of `--repeats` steps after the measured ones;
- grad diff: max |gradient - unsplit gradient| / max |unsplit gradient| (the update is the same up to fp32 rounding).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import statistics
import time
from pathlib import Path

from _profile import peak_tensor_mb  # bench/ is on sys.path: the script runs as python bench/<name>.py


def make_batch(b: int, max_len: int, vocab: int, min_len: int = 64, seed: int = 0):
    """b right-padded sequences of min_len..max_len tokens, 16-token prompts, behaviour log-probs near uniform."""
    import torch

    from astratk.records import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (b,), generator=g)
    input_ids = torch.zeros(b, max_len, dtype=torch.long)
    attention_mask = torch.zeros(b, max_len, dtype=torch.long)
    loss_mask = torch.zeros(b, max_len - 1)
    for i, n in enumerate(lengths.tolist()):
        input_ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        attention_mask[i, :n] = 1
        loss_mask[i, 15: n - 1] = 1.0
    mu = (-5.5 + torch.rand(b, max_len - 1, generator=g)) * loss_mask
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, behavior_logprobs=mu,
                      advantages=torch.randn(b, 1, generator=g).expand(b, max_len - 1) * loss_mask,
                      weights=loss_mask.clone(), versions=torch.zeros(b, max_len - 1, dtype=torch.long), n_groups=b // 8,
                      rewards=torch.rand(b, generator=g), roles=("policy",) * b)


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(model_path: str, loss_name: str, budget: int | None, b: int, min_len: int, max_len: int,
            repeats: int) -> dict:
    """Runs in a fresh process: one (loss, budget) configuration."""
    import torch

    torch.set_num_threads(1)
    from astratk.registry import resolve
    from astratk.training.collate import micro_batches, row_lengths
    from astratk.training.module import PolicyModule

    loss = resolve("loss", loss_name)(**({"delta": 0.2} if loss_name == "drpo" else {}))
    module = PolicyModule(model_path, loss, horizon=max_len, micro_batch_tokens=budget)
    module.log_dict = lambda *a, **k: None  # no Trainer attached; the metrics are in step_metrics
    batch = make_batch(b, max_len, module.model.config.vocab_size, min_len)

    def step() -> None:
        module.zero_grad(set_to_none=True)
        module.training_step(batch, 0).backward()

    rss_reset = True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    except OSError:
        rss_reset = False
    before = _rss_kb("VmRSS")
    step()
    rss_peak_mb = (_rss_kb("VmHWM") - before) / 1024
    grads = {n: p.grad.clone() for n, p in module.model.named_parameters()}
    tensor_peak_mb = peak_tensor_mb(step)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    plan, lengths = micro_batches(batch, budget), row_lengths(batch)
    forward_tokens = sum(len(rows) * int(lengths[rows].max()) for rows in plan) if len(plan) > 1 else b * max_len
    return {"loss": loss_name, "budget": budget, "micro_batches": len(plan), "forward_tokens": forward_tokens,
            "real_tokens": int(lengths.sum()), "tensor_peak_mb": tensor_peak_mb, "rss_peak_mb": rss_peak_mb,
            "rss_reset": rss_reset, "step_s": statistics.median(times), "grads": grads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--length", type=int, default=256, help="longest sequence (the tiny model serves <= 256)")
    ap.add_argument("--min-length", type=int, default=64, help="shortest sequence (= --length: no padding)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4096, 1024], help="micro_batch_tokens to compare")
    ap.add_argument("--loss", nargs="+", default=["drpo", "m2po"], choices=["drpo", "m2po"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default=None, help="HF model dir (default: the tiny model, built if not cached)")
    args = ap.parse_args()
    if args.model is None:
        from astratk.envs.math.arithmetic import ArithmeticEnv
        from astratk.models import ensure_model
        from astratk.spec import ModelSpec, TinyModelSpec

        args.model = str(ensure_model(ModelSpec(tiny=TinyModelSpec()), ArithmeticEnv()))
    spawn = multiprocessing.get_context("spawn")
    rows = []
    for loss in args.loss:
        for budget in [None, *args.budgets]:
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:  # a fresh process each
                rows.append(pool.submit(measure, args.model, loss, budget, args.batch, args.min_length, args.length,
                                        args.repeats).result())
    print(f"{args.batch} sequences of {args.min_length}-{args.length} tokens ({rows[0]['real_tokens']} real, "
          f"{args.batch * args.length} padded), tiny model, fp32, CPU, 1 thread; step time median of {args.repeats}")
    print(f"{'loss':<6}{'budget':>8}{'micro':>7}{'fwd tokens':>12}{'peak tensor MB':>16}{'x none':>8}{'peak RSS MB':>13}{'x none':>8}"
          f"{'step s':>8}{'x none':>8}{'grad diff':>11}")
    for row in rows:
        base = next(r for r in rows if r["loss"] == row["loss"] and r["budget"] is None)
        scale = max(g.abs().max().item() for g in base["grads"].values())
        row["grad_diff"] = max((row["grads"][n] - g).abs().max().item() for n, g in base["grads"].items()) / scale
        print(f"{row['loss']:<6}{row['budget'] or 'none'!s:>8}{row['micro_batches']:>7}{row['forward_tokens']:>12}"
              f"{row['tensor_peak_mb']:>16.0f}{row['tensor_peak_mb'] / base['tensor_peak_mb']:>8.2f}"
              f"{row['rss_peak_mb']:>13.0f}{row['rss_peak_mb'] / max(base['rss_peak_mb'], 1e-9):>8.2f}"
              f"{row['step_s']:>8.2f}{row['step_s'] / base['step_s']:>8.2f}{row['grad_diff']:>11.1e}")
    if not all(r["rss_reset"] for r in rows):
        print("note: /proc/self/clear_refs was not writable; peak RSS is the process peak since start")
    print(json.dumps([{k: v for k, v in r.items() if k != "grads"} for r in rows]))


if __name__ == "__main__":
    main()
