"""Every policy loss side by side: forward+backward time and peak memory on identical inputs, as a ratio to PPO-clip,
and each loss's share of a full tiny-model training step at the same token count.

    python bench/losses.py                         # 512 sequences x 2048 tokens, fp32, CPU, 1 thread
    python bench/losses.py --batch 64 --length 512 --no-step   # a quick look
    (run from the repository root)

Time: all losses in one process, repeats alternate between them (drifting load hits all alike), median reported.
Memory: peak tensor memory allocated during one forward+backward (running sum of the torch profiler's allocation
events; on CPU, resident-set peaks are blurred by allocator reuse), and the storage autograd saves between forward
and backward (saved-tensor hooks), i.e. the activation memory the loss holds while the model's backward runs.
The training step: `PolicyModule.training_step` + backward on the quickstart's tiny model, at the same number of
sequences and tokens, in micro-batches of `--micro` sequences (gradient accumulation), loss included.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
from _profile import peak_tensor_mb  # bench/ is on sys.path: the script runs as python bench/<name>.py

# (label, registry short name, constructor kwargs)
VARIANTS: list[tuple[str, str, dict]] = [
    ("ppo_clip", "ppo_clip", {}),
    ("drpo", "drpo", {}),
    ("dppo_tv", "dppo_tv", {}),
    ("dppo_kl", "dppo_kl", {}),
    ("dppo_tv_C", "dppo_tv", {"clip_ratio": 5.0}),
    ("dppo_topk_tv", "dppo_topk_tv", {}),
    ("dppo_topk_kl", "dppo_topk_kl", {}),
    ("pg_is", "pg_is", {}),
    ("cispo", "cispo", {}),
    ("spo", "spo", {}),
    ("gspo", "gspo", {}),
    ("gspo_token", "gspo_token", {}),
    ("sapo", "sapo", {}),
    ("m2po", "m2po", {}),
    ("m2po_clip", "m2po_clip", {}),
]


def available() -> list[tuple[str, str, dict]]:
    from astratk.registry import REGISTRY

    return [v for v in VARIANTS if v[1] in REGISTRY["loss"]]


def make_inputs(b: int, t: int, k: int = 20, seed: int = 0):
    from astratk.contracts import LossInputs

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()  # [B, T]
    mu = -torch.rand(b, t, generator=g) * 3  # log mu in (-3, 0]
    logp = (mu + 0.1 * torch.randn(b, t, generator=g)).clamp(max=0.0).requires_grad_(True)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    top_mu = torch.log_softmax(torch.randn(b, t, k, generator=g), -1).sort(-1, descending=True).values
    top_pi = (top_mu + 0.05 * torch.randn(b, t, k, generator=g)).requires_grad_(True)
    return LossInputs(logprobs=logp, behavior_logprobs=mu, advantages=adv, loss_mask=mask,
                      proximal_logprobs=mu + 0.01, topk_ids=torch.zeros(b, t, k, dtype=torch.long),
                      topk_behavior_logprobs=top_mu, topk_logprobs=top_pi,
                      sampled_ids=torch.ones(b, t, dtype=torch.long))  # a sampled token outside the top-K


def run_loss(loss, inputs) -> None:
    from astratk.training.aggregation import aggregate

    out = loss(inputs)
    mode = loss.required_aggregation or "seq-mean-token-sum-norm"
    aggregate(out.token_losses, out.mask, mode, horizon=inputs.logprobs.shape[1]).backward()
    inputs.logprobs.grad = None
    if inputs.topk_logprobs is not None:
        inputs.topk_logprobs.grad = None


def build(name: str, kwargs: dict):
    from astratk.registry import resolve

    return resolve("loss", name)(**kwargs)


def time_losses(variants, b: int, t: int, repeats: int) -> dict[str, float]:
    inputs = make_inputs(b, t)
    losses = {label: build(name, kw) for label, name, kw in variants}
    for loss in losses.values():
        run_loss(loss, inputs)  # warm-up
    times: dict[str, list[float]] = {label: [] for label in losses}
    for _ in range(repeats):
        for label, loss in losses.items():
            start = time.perf_counter()
            run_loss(loss, inputs)
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(ts) for label, ts in times.items()}


def saved_memory_mb(loss, inputs) -> float:
    """MB of distinct tensor storage autograd keeps from forward to backward (the loss's activation memory), counted
    with saved-tensor hooks: deterministic, unlike resident-set peaks on CPU, which allocator reuse blurs."""
    from astratk.training.aggregation import aggregate

    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = loss(inputs)
        value = aggregate(out.token_losses, out.mask, loss.required_aggregation or "seq-mean-token-sum-norm",
                          horizon=inputs.logprobs.shape[1])
    value.backward()
    inputs.logprobs.grad = None
    return total / 2**20


def training_step_seconds(b: int, t: int, micro: int, model_path: str | None) -> float:
    """One optimiser step of the tiny model over b x t tokens (micro-batches of `micro` sequences)."""
    from astratk.envs.math.arithmetic import ArithmeticEnv
    from astratk.losses.ppo_clip import PPOClip
    from astratk.models import ensure_model
    from astratk.records import TrainBatch
    from astratk.spec import ModelSpec
    from astratk.training.module import PolicyModule

    path = model_path or str(ensure_model(ModelSpec(), ArithmeticEnv()))
    module = PolicyModule(path, PPOClip(), lr=1e-4, horizon=t)
    module.log_dict = lambda *a, **k: None  # no Trainer attached
    vocab = module.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(b // micro):
        ids = torch.randint(0, vocab, (micro, t + 1), generator=g)
        zeros = torch.zeros(micro, t)
        batch = TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones(micro, t),
                           behavior_logprobs=zeros - 5.0, advantages=torch.randn(micro, 1).expand(micro, t),
                           weights=torch.ones(micro, t), versions=torch.zeros(micro, t, dtype=torch.long),
                           rewards=torch.zeros(micro))
        module.training_step(batch, 0).backward()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--micro", type=int, default=16, help="sequences per micro-batch in the training step")
    ap.add_argument("--no-step", action="store_true", help="skip the full training-step measurement")
    ap.add_argument("--model", default=None, help="HF model dir for the training step (default: the tiny model)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    variants = available()
    times = time_losses(variants, args.batch, args.length, args.repeats)
    inputs = make_inputs(args.batch, args.length)
    peaks = {label: peak_tensor_mb(functools.partial(run_loss, build(name, kw), inputs))
             for label, name, kw in variants}
    mems = {label: saved_memory_mb(build(name, kw), inputs) for label, name, kw in variants}
    step = None if args.no_step else training_step_seconds(args.batch, args.length, args.micro, args.model)
    base_t, base_m, base_p = times["ppo_clip"], max(mems["ppo_clip"], 1e-9), max(peaks["ppo_clip"], 1e-9)
    print(f"{args.batch} sequences x {args.length} tokens, fp32, CPU, 1 thread; median of {args.repeats}")
    if step is not None:
        print(f"tiny-model training step at the same token count: {step:.1f} s")
    print(f"{'loss':<16}{'fwd+bwd ms':>12}{'x ppo_clip':>12}{'peak MB':>10}{'x ppo_clip':>12}"
          f"{'saved MB':>10}{'x ppo_clip':>12}"
          + (f"{'share of step':>15}" if step else ""))
    for label, _, _ in variants:
        row = (f"{label:<16}{1000 * times[label]:>12.1f}{times[label] / base_t:>12.2f}{peaks[label]:>10.0f}"
               f"{peaks[label] / base_p:>12.2f}{mems[label]:>10.0f}{mems[label] / base_m:>12.2f}")
        if step:
            row += f"{times[label] / step:>15.2%}"
        print(row)
    print(json.dumps({"times_s": times, "peak_mb": peaks, "saved_mb": mems, "step_s": step}))


if __name__ == "__main__":
    main()
