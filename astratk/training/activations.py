"""`trainer.micro_batch_tokens: auto`: how many tokens one forward and backward may hold, from the model's shape and
the memory this process may use.

Why: a step's activations grow with its tokens, and a real model's are large. SmolLM2-135M keeps about 1.7 MB per
token for the backward (30 layers of 576-wide activations and 1,536-wide MLPs, plus fp32 logits over a 49,152-token
vocabulary, measured with `bench/micro_batch.py`); a batch of 64 code samples of ~450 tokens (share_prompts: ~10,000
tokens through the model) needed ~21 GB and a 24 GB machine killed the run. A tiny char-level model keeps a few KB
per token, so one rule that counts the model's own widths serves both.

The estimate, in bytes per token of a forward kept for backward:
    4 x (1.2 x sum over the decoder's Linear layers of (in + out features) + 3 x vocabulary)
the first term covers each layer's inputs and outputs (plus norms and residuals: the 1.2), the second the fp32
logits, their softmax for the backward, and a scaled copy at the rollout temperature. It is fp32 whatever the
precision (bf16-mixed keeps fp32 logits and some fp32 activations), so it errs on the side of smaller micro-batches:
1.96 MB per token for SmolLM2 against 1.70 MB measured (tensor peak) and 1.92 MB (resident-set peak).

The budget: half of what the process may still use at the first step (CPU: the smaller of /proc/meminfo's
MemAvailable and the cgroup's memory.max minus memory.current; GPU: torch's free device memory plus what its caching
allocator holds unused, within `gpu_memory_fraction` when one is set). Half, because the rollout workers' K/V caches
and the next batch grow beside the trainer during the run.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from astratk import gpu

__all__ = ["BYTES_PER_FLOAT", "auto_token_budget", "bytes_per_token", "memory_available"]

BYTES_PER_FLOAT = 4
SHARE = 0.5  # of the memory available at the first step
# PEFT's r-wide adapter factors: they read the wrapped layer's input (counted once, with it) and add r-wide outputs
_LORA_FACTOR = re.compile(r"(^|\.)lora_(A|B|embedding_A|embedding_B)(\.|$)")


def bytes_per_token(model: torch.nn.Module) -> int:
    """Estimated activation bytes one token of a training forward keeps for its backward (module docstring)."""
    head = _output_layer(model)
    vocab = int(getattr(head, "out_features", 0) or _config_int(model, "vocab_size"))
    widths = sum(m.in_features + m.out_features for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and m is not head and not _LORA_FACTOR.search(name))
    return int(BYTES_PER_FLOAT * (1.2 * widths + 3 * vocab)) + 1


def memory_available(device: torch.device) -> int | None:
    """Bytes this process may still allocate on `device`; None when it cannot be read."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        room = free + max(torch.cuda.memory_reserved(device) - allocated, 0)
        share = gpu.process_share(device)  # trainer.gpu_memory_fraction and engines beside it: the allocator's cap
        return int(min(room, share * total - allocated) if share else room)
    if device.type != "cpu":
        return None
    figures = [v for v in (_meminfo_available(), _cgroup_room()) if v is not None]
    return min(figures) if figures else None


def auto_token_budget(model: torch.nn.Module, device: torch.device) -> tuple[int | None, str]:
    """(tokens a forward may hold, a one-line account of the choice). None tokens: no limit could be worked out."""
    per_token = bytes_per_token(model)
    room = memory_available(device)
    if room is None:
        return None, f"micro_batch_tokens auto: the memory available on {device} cannot be read; whole batches"
    tokens = max(1, int(SHARE * room) // per_token)
    return tokens, (f"micro_batch_tokens auto: ~{per_token / 2**20:.2f} MB of activations per token for this model; "
                    f"a step runs whole up to ~{tokens:,} tokens through the model ({SHARE:.0%} of the "
                    f"{room / 2**30:.1f} GiB available on {device.type}) and in micro-batches above")


def _output_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    try:
        head = getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        head = None
    base = getattr(head, "base_layer", None)  # a LoRA-wrapped head: its frozen Linear
    return base if isinstance(base, torch.nn.Linear) else head


def _config_int(model: torch.nn.Module, name: str) -> int:
    value = getattr(getattr(model, "config", None), name, 0)
    return int(value) if isinstance(value, int) else 0


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), None when unlimited or unreadable."""
    try:
        rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text().strip()))
    except (OSError, StopIteration, ValueError):
        return None
