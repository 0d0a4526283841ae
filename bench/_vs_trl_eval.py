"""The shared held-out evaluation of `bench/vs_trl.py`: one evaluator for every snapshot of both sides, the training
times at which both sides keep their weights, and the torch thread count the evaluation runs on."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on `n` torch threads (an astratk run leaves this process at `cluster.torch_threads`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class HeldOut:
    """The one evaluation of every snapshot of both sides: the model directory's architecture with the snapshot's
    weights, `heldout_accuracy` (greedy, the env's grader) on the env's first `n` held-out tasks, on every core."""

    def __init__(self, model_dir: Path, env: Any, n: int, threads: int, max_new_tokens: int | None = None) -> None:
        from astratk.models.loading import load_causal_lm, load_tokenizer

        self.max_new_tokens = max_new_tokens  # None: the longest demonstration + 3 (the tiny models answer tersely)
        self.model = load_causal_lm(str(model_dir))
        self.tok = load_tokenizer(model_dir)
        self.env, self.n, self.threads = env, n, threads
        self.initial_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.seconds = 0.0

    def __call__(self, state: dict[str, Any]) -> float:
        from astratk.models.warm_start import heldout_accuracy

        t = time.perf_counter()
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embeddings
            raise RuntimeError(f"snapshot does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        with torch_threads(self.threads):
            accuracy, _, _ = heldout_accuracy(self.model, self.tok, self.env, max_tasks=self.n,
                                              max_new_tokens=self.max_new_tokens)
        self.seconds += time.perf_counter() - t
        return accuracy


def marks_for(seconds: float, every: float, fine_until: float = 0.0, fine_every: float = 1.0) -> list[float]:
    """Training times at which both sides keep their weights: every `fine_every` s up to `fine_until` (where the
    early targets are crossed, a few seconds in on the quickstart model), every `every` s after, and `seconds`."""
    fine = [float(round(fine_every * k, 6)) for k in range(1, int(min(fine_until, seconds) / fine_every + 1e-9) + 1)]
    coarse = [float(every * k) for k in range(1, int(seconds / every + 1e-9) + 1)]
    marks = sorted({*fine, *(m for m in coarse if not fine or m > fine[-1] + 1e-9)})
    if not marks or marks[-1] < seconds - 1e-9:
        marks.append(float(seconds))
    return marks

