"""Group advantages: pure functions of one group's rewards.

Selected by name in `DataflowSpec.advantage`: a short name from
`astratk.registry.REGISTRY["advantage"]`, or the dotted path of any function `rewards -> advantages`
(`mypkg.advantages.centred`). Add a built-in by writing a function here and a line in the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from astratk.registry import resolve


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


def needs_group(fn: Callable[[Sequence[float]], Sequence[float]]) -> bool:
    """Whether advantage `fn` compares a sample with the rest of its group, so that a group of one sample always
    gets advantage 0 and trains nothing (every built-in: dr_grpo, grpo, rloo). Probed on one-sample groups of a few
    rewards; a function that fails on one sample needs a group too.

    >>> needs_group(dr_grpo), needs_group(lambda rewards: list(rewards))
    (True, False)
    """
    try:
        return all(all(float(a) == 0.0 for a in fn([r])) for r in (0.0, 1.0, -1.5))
    except Exception:  # noqa: BLE001 - a function that cannot take one sample cannot train on groups of one
        return True


def get_advantage(name: str) -> Callable[[Sequence[float]], list[float]]:
    """The advantage function `name` (short name or dotted path), or a ValueError with the choices.

    Example:
        >>> get_advantage("rloo")([1.0, 0.0])
        [1.0, -1.0]
    """
    fn = resolve("advantage", name)
    if not callable(fn):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
            f"advantage {name!r} is a {type(fn).__name__}, not a function rewards -> advantages")
    return fn
