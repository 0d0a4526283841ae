"""The KV-cache argument of an HF model's forward, by the name its transformers release uses.

transformers renamed the forward argument `past_key_values` to `cache` (and the output field with it); releases
after the rename still take the old name but warn on every call ("past_key_values is deprecated and will be removed
in version 5.40.0"), and a model written for an older release (remote code, a PEFT wrapper around one) takes only
the old name. astratk supports both ranges, so every forward that passes a cache goes through `cache_kwargs`, which
names the argument the model's own forward declares, and reads the cache back with `returned_cache`.

Example:
    >>> out = model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))  # doctest: +SKIP
    >>> cache = returned_cache(out)  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
from typing import Any

_names: dict[type, str] = {}  # model class -> the name its forward takes


def cache_name(model: Any) -> str:
    """'cache' when the model's forward declares it (transformers after the rename), else 'past_key_values'."""
    base = model
    for attr in ("get_base_model",):  # a PEFT wrapper forwards **kwargs: ask the model inside
        if hasattr(base, attr):
            base = getattr(base, attr)()
    cls = type(base)
    if cls not in _names:
        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):
            params = {}
        _names[cls] = "cache" if "cache" in params else "past_key_values"
    return _names[cls]


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """`{name: cache}` for `model(...)`, with the name the model's forward takes."""
    return {cache_name(model): cache}


def returned_cache(output: Any) -> Any:
    """The cache a forward with `use_cache=True` returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
