"""In-flight weight updates (KV kept, or prefix recomputed) against between-requests switching, side by side (issue 18).

    python bench/inflight.py                      # quickstart-sized model, 3 rounds per mode, ~4 min on 2 cores
    python bench/inflight.py --tokens 256 --publish-every 0.2

A TorchEngine decodes batches of long generations (no stop token: every row runs `--tokens` tokens, as a long agent
turn does) while the trainer publishes a new version every `--publish-every` seconds on its own clock, and a watcher
thread (the rollout worker's) loads the newest version as a full state when it appears (`--poll`). All modes see the
same requests and the same publishing schedule, the order of the modes rotating per round. Reported per mode:
- tokens/s of the engine;
- load latency: from a version's publication to its weights serving (between requests: the load waits for the batch
  in flight to end; in flight: for the current decode step, plus the prefix's prefill in the recompute mode);
- staleness of the finished samples: for each completion, the newest version published when it finished minus the
  version of its oldest token (what the data layer's staleness bound sees), and minus each token's version on
  average;
- the share of samples whose tokens span more than one version.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines import TorchEngine


def model(layers: int, hidden: int, vocab: int = 260, positions: int = 1024) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def one_round(mode: str, args: argparse.Namespace) -> dict[str, float]:
    m = model(args.layers, args.hidden)
    states = [{k: v + 1e-3 * (i + 1) for k, v in m.state_dict().items()} for i in range(2)]
    engine = TorchEngine.from_model(m, version=0, weight_updates=mode)
    latencies: list[float] = []
    stop = threading.Event()
    start = time.perf_counter()

    def published() -> int:  # the trainer publishes on its own clock, whatever the engine is doing
        return int((time.perf_counter() - start) / args.publish_every)

    def watcher() -> None:  # the rollout worker's weight watcher: loads the newest version when it appears
        while not stop.wait(args.poll):
            v = published()
            if v > engine.version:
                engine.load_weights(states[v % 2], v)
                latencies.append(time.perf_counter() - start - v * args.publish_every)

    requests = [GenerationRequest(tuple(range(4, 4 + args.prompt)), SamplingParams(
        temperature=1.0, max_tokens=args.tokens, seed=1000 * r + i, stop_token_ids=()))
        for r in range(args.batches) for i in range(args.batch)]
    thread = threading.Thread(target=watcher, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    oldest, mean_lag, mixed, tokens = [], [], 0, 0
    for b in range(args.batches):
        done = engine.submit(requests[b * args.batch:(b + 1) * args.batch]).result(600)
        newest = published()
        for c in done:
            oldest.append(newest - min(c.versions))
            mean_lag.append(newest - sum(c.versions) / len(c.versions))
            mixed += len(set(c.versions)) > 1
            tokens += len(c.token_ids)
    elapsed = time.perf_counter() - t0
    stop.set()
    thread.join(60)
    engine.close()
    return {"tokens_per_s": tokens / elapsed, "load_latency_ms_median": 1e3 * statistics.median(latencies or [0]),
            "load_latency_ms_max": 1e3 * max(latencies or [0]), "loads": len(latencies),
            "staleness_oldest_token": statistics.mean(oldest), "staleness_mean_token": statistics.mean(mean_lag),
            "mixed_version_share": mixed / len(oldest), "inflight_loads": engine.stats["inflight_loads"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64, help="sequences per engine batch")
    ap.add_argument("--batches", type=int, default=4, help="batches per round")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=192, help="new tokens per sequence (no stop token)")
    ap.add_argument("--publish-every", type=float, default=0.3, help="seconds between published versions")
    ap.add_argument("--poll", type=float, default=0.02, help="seconds between the watcher's checks")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode, the order rotating")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a rollout worker's default is 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = ("between_requests", "inflight", "inflight_recompute")
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes[r % 3:] + modes[:r % 3]:  # each mode first once in three rounds
            results[mode].append(one_round(mode, args))
            print(f"round {r + 1} {mode}: " + ", ".join(f"{k} {v:.3g}" for k, v in results[mode][-1].items()),
                  flush=True)
    keys = list(results["inflight"][0])
    print(f"\nmedians over {args.rounds} rounds per mode; {args.batch} x {args.tokens} tokens per batch, "
          f"{args.layers} layers x {args.hidden}, a version every {args.publish_every:g} s, {args.threads} thread(s)\n")
    print("| | between_requests | inflight | inflight_recompute | inflight / between | recompute / between |\n"
          "|---|---:|---:|---:|---:|---:|")
    for k in keys:
        a, b, c = (statistics.median(x[k] for x in results[m]) for m in modes)
        rb, rc = (f"{v / a:.2f}x" if a else "-" for v in (b, c))
        print(f"| {k} | {a:.3g} | {b:.3g} | {c:.3g} | {rb} | {rc} |")

if __name__ == "__main__":
    main()
