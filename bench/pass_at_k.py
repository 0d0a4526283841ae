"""How much of the held-out set a starting model can ever be rewarded on: pass@k at the rollout's settings.

Group-relative RL (astratk's DRPO, TRL's GRPO) learns only from groups whose samples disagree: a prompt on which
none of its 8 samples (temperature 1, the rollout's token budget) is ever right gives no learning signal, and
astratk's data layer drops such groups (counted as `groups_dropped_zero_variance`). The fraction of held-out
problems the starting model solves in k samples bounds what a short run can reach, and explains a plateau:

    python bench/pass_at_k.py --model large              # bench/vs_trl.py's 6.4M model (cached by it)
    python bench/pass_at_k.py --model quickstart --samples 64
    python bench/pass_at_k.py --model large --astratk-set policies.0.model.tiny.warm_start_target=0.15

Prints greedy accuracy and the unbiased pass@k estimate (1 - C(n-c, k) / C(n, k), from n samples per problem with c
right) for k = 1, 8, and n, over the env's first `--heldout` held-out problems.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are right (Chen et al.'s estimator)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("quickstart", "large"), default="large")
    ap.add_argument("--samples", type=int, default=32, help="samples per problem (n); pass@k for k <= n")
    ap.add_argument("--heldout", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--astratk-set", action="append", default=[], metavar="KEY=VALUE",
                    help="the same spec overrides as bench/vs_trl.py's, so the same cached model "
                         "(policies.0.model.tiny.warm_start_target=0.15)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import vs_trl

    from astratk.models.cache import ensure_model
    from astratk.models.chat import encode_chat, stop_token_ids
    from astratk.models.loading import load_causal_lm, load_tokenizer
    from astratk.models.warm_start import heldout_accuracy

    # vs_trl's own spec for --model and --astratk-set: the model directory both of its sides start from
    bench_args = vs_trl.parse_args(["--model", args.model, *itertools.chain(*(["--astratk-set", kv]
                                                                            for kv in args.astratk_set))])
    with tempfile.TemporaryDirectory(prefix="pass-at-k-") as tmp:
        spec = vs_trl.astratk_spec(bench_args, Path(tmp))
    p = spec.policies[0]
    model_dir = ensure_model(p.model, spec.env, log=lambda s: print(f"  {s}"))
    model, tok, env = load_causal_lm(str(model_dir)), load_tokenizer(model_dir), spec.env
    greedy, _, _ = heldout_accuracy(model, tok, env, max_tasks=args.heldout)
    tasks = list(itertools.islice(env.tasks("heldout"), args.heldout))
    stops, budget = list(stop_token_ids(tok)), spec.rollout.max_new_tokens
    right = [0] * len(tasks)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.no_grad():
        for start in range(0, len(tasks), 64):
            chunk = tasks[start:start + 64]
            enc = tok.pad({"input_ids": [encode_chat(tok, env.messages(t)) for t in chunk]}, padding=True,
                          return_tensors="pt", padding_side="left")
            out = model.generate(**enc, max_new_tokens=budget, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 num_return_sequences=args.samples, eos_token_id=stops, pad_token_id=tok.pad_token_id)
            rows = out[:, enc["input_ids"].shape[1]:].tolist()
            for i, row in enumerate(rows):
                right[start + i // args.samples] += env.grade(chunk[i // args.samples],
                                                              tok.decode(row, skip_special_tokens=True)) == 1.0
    ks = sorted({1, 8, args.samples} & set(range(1, args.samples + 1)))
    result = {"model": args.model, "model_dir": str(model_dir), "heldout": len(tasks), "samples": args.samples,
              "max_new_tokens": budget, "greedy": greedy,
              **{f"pass@{k}": sum(pass_at_k(args.samples, c, k) for c in right) / len(tasks) for k in ks},
              "never_right": sum(c == 0 for c in right) / len(tasks),
              "always_right": sum(c == args.samples for c in right) / len(tasks),
              "sampling_s": time.perf_counter() - t0}
    print(f"{args.model}: {len(tasks)} held-out problems, {args.samples} samples each at T=1, <= {budget} tokens")
    for k, v in result.items():
        if isinstance(v, float):
            print(f"  {k:14s} {v:.1%}" if k != "sampling_s" else f"  {k:14s} {v:.1f} s")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
