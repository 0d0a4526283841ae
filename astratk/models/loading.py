"""Loading HF causal LMs, serialised within a process.

Why the lock: transformers 5.19 builds a model under a process-global meta-device context, so two threads loading
at once (a threads-mode cluster: a rollout service's engine and the trainer in one process) fail with "Cannot copy
out of meta tensor; no data!" (seen here). Every astratk load goes through `load_causal_lm`.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_LOAD_LOCK = threading.Lock()


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Any:
    from transformers import AutoModelForCausalLM

    with _LOAD_LOCK:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
