"""What every spec section shares: `Section` (YAML-shaped values become their types at construction), `StartError`,
and the range helpers the sections' `validate` methods use."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from astratk.coerce import coerce_fields
from astratk.registry import resolve


@dataclass
class Section:
    """Base of every spec section: fields given as YAML gives them (a dict for a section, a short name or
    {class_path, init_args} for a plug-in) become their types at construction (`astratk.coerce`); a field of another
    type fails there, in one line that names it. `SPEC_KEY`: where the section sits in a run's YAML."""

    SPEC_KEY = ""

    def __post_init__(self) -> None:
        coerce_fields(self, self.SPEC_KEY)


class StartError(ValueError):
    """Bad input found as a run starts, before it writes anything (a Hub id that does not resolve, a model
    directory that does not load): the message is one line naming the key; the CLI prints it alone."""


class NothingToTrain(StartError):
    """Found once rollouts began: the run cannot train anything (every task of its first chunks was dropped before
    generation, its prompt longer than the model's context). The run stops at once and leaves no run directory."""



def default_plugin(kind: str, name: str) -> Any:
    """A registry plug-in built with its defaults (a field's default_factory: the default loss, env, ...)."""
    return resolve(kind, name)()


def positive(key: str, **values: float) -> None:
    for name, v in values.items():
        if not v > 0:  # NaN too
            raise ValueError(f"{key}.{name} must be > 0, got {v}")


def finite(key: str, **values: float) -> None:
    """Rates and coefficients: YAML's .nan and .inf parse as floats, and no range check refuses NaN."""
    for name, v in values.items():
        if not -math.inf < v < math.inf:
            raise ValueError(f"{key}.{name} must be a finite number, got {v}")
