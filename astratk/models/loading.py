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
    """The HF causal LM in directory `path`. Errors name the directory and what is missing: a path that is not a
    directory (transformers would try it as a Hub repo id), no config.json, or weights transformers cannot load."""
    import os

    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"no model directory at {path!r} (astratk loads local HF directories only: "
                                "config.json + *.safetensors, e.g. from save_pretrained)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} is not an HF model directory: config.json is missing")
    with _LOAD_LOCK:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError, KeyError) as e:
            raise RuntimeError(f"cannot load the model in {path!r}: {e}") from e
    return model.to(device)
