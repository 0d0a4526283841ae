"""Group advantages: pure functions of one group's rewards (ALGORITHMS §4 "Advantages").

Selected by name in `DataflowSpec.advantage`; add one by writing a function here and an entry in `ADVANTAGES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def dr_grpo(rewards: Sequence[float]) -> list[float]:
    """Dr.GRPO (arXiv 2503.20783): R_i - mean(R), no std division (the DRPO recipe's choice)."""
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean()).tolist()


def grpo(rewards: Sequence[float]) -> list[float]:
    """GRPO: (R_i - mean(R)) / (std(R) + 1e-6), population std."""
    r = np.asarray(rewards, dtype=np.float64)
    return ((r - r.mean()) / (r.std() + 1e-6)).tolist()


def rloo(rewards: Sequence[float]) -> list[float]:
    """RLOO: R_i minus the mean of the other samples' rewards (0 for a single sample)."""
    r = np.asarray(rewards, dtype=np.float64)
    n = len(r)
    if n < 2:
        return [0.0] * n
    return (r - (r.sum() - r) / (n - 1)).tolist()


ADVANTAGES: dict[str, Callable[[Sequence[float]], list[float]]] = {"dr_grpo": dr_grpo, "grpo": grpo, "rloo": rloo}


def get_advantage(name: str) -> Callable[[Sequence[float]], list[float]]:
    try:
        return ADVANTAGES[name]
    except KeyError:
        raise ValueError(f"unknown advantage {name!r}; choose one of {sorted(ADVANTAGES)}") from None
