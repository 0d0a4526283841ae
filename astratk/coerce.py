"""The Python API takes what YAML takes: spec fields given as dicts, short names or dotted paths become their types.

`RunSpec` and its sections are plain dataclasses. A YAML file reaches them through jsonargparse, which builds every
nested section and plug-in; a notebook builds them by hand, and writes what the docs show for YAML:
`ModelSpec(lora={"r": 16, "alpha": 32})`, `PolicySpec(loss="drpo")`,
`PolicySpec(loss={"class_path": "drpo", "init_args": {"delta": 0.5}})`, `RunSpec(env="arithmetic")`. Each
section's `__post_init__` calls `coerce_fields`, which converts such values to the declared type (a section from a
dict of its fields, a plug-in from a short name, dotted path or class_path/init_args mapping, a path-like to str, an
int to float) and refuses anything else with one line that names the field and the type it wants. Range checks stay
in each section's `validate`.

Example:
    >>> from astratk.spec import ModelSpec
    >>> ModelSpec(lora={"r": 16, "alpha": 32}).lora.r
    16
    >>> ModelSpec(lora={"rank": 16})
    Traceback (most recent call last):
    ...
    astratk.coerce.SpecTypeError: model.lora: unknown key 'rank'; LoraSpec takes alpha, dropout, r, target_modules
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any

from astratk.registry import resolve

# Plug-in base classes (by name, so this module imports none of them) -> their registry kind.
_PLUGIN_KINDS = {"Env": "env", "PolicyLoss": "loss", "TokenCorrection": "correction", "Curator": "stage",
                 "GroupFilter": "stage", "ServingOrder": "stage", "Replay": "stage", "Mixing": "stage"}
_hints: dict[type, dict[str, Any]] = {}


class SpecTypeError(ValueError):
    """A spec field of the wrong type: the message names the field (as YAML spells it) and the type it wants."""


def coerce_fields(obj: Any, key: str) -> None:
    """Convert every field of dataclass `obj` to its declared type in place (module docstring); `key` is where the
    section sits in a run's YAML, for error messages."""
    hints = _type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        converted = coerce(value, hints[f.name], _join(key, f.name))
        if converted is not value:
            object.__setattr__(obj, f.name, converted)


def coerce(value: Any, hint: Any, key: str) -> Any:
    """`value` as type `hint`, or `SpecTypeError` naming `key`."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        real = [o for o in options if o is not type(None)]
        if len(real) == 1:  # Optional[X]: X's own message (a dict's unknown key, a list item's type)
            if value is None:
                raise SpecTypeError(f"{key}: expected {_describe(real[0])}, got None")
            return coerce(value, real[0], key)
        errors = {}
        for option in real:
            try:
                return coerce(value, option, key)
            except SpecTypeError as e:
                errors[option] = e
        for option, error in errors.items():  # the option the value is shaped like says what is wrong inside it
            shaped = (dataclasses.is_dataclass(option) or typing.get_origin(option) is dict
                      if isinstance(value, Mapping) else typing.get_origin(option) is list
                      if isinstance(value, (list, tuple)) else False)
            if shaped:
                raise error
        wanted = " or ".join(_describe(o) for o in options)
        raise SpecTypeError(f"{key}: expected {wanted}, got {_show(value)}")
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
            raise SpecTypeError(f"{key}: expected a list of {_describe(item, plural=True)}, got {_show(value)}")
        out = [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return value if isinstance(value, list) and all(a is b for a, b in zip(out, value, strict=True)) else out
    if origin is dict:
        if not isinstance(value, Mapping):
            raise SpecTypeError(f"{key}: expected a mapping (dict), got {_show(value)}")
        return value if isinstance(value, dict) else dict(value)
    if dataclasses.is_dataclass(hint):
        return _section(value, hint, key)
    if isinstance(hint, type) and hint.__name__ in _PLUGIN_KINDS:
        return _plugin(value, hint, key)
    return _scalar(value, hint, key)


def _section(value: Any, cls: type, key: str) -> Any:
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise SpecTypeError(f"{key}: expected {_a(cls.__name__)} or a dict of its fields "
                            f"({', '.join(sorted(f.name for f in dataclasses.fields(cls)))}), got {_show(value)}")
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    for k in value:
        if k not in names:
            raise SpecTypeError(f"{key}: unknown key {k!r}; {cls.__name__} takes {', '.join(sorted(names))}")
    try:
        return cls(**value)
    except SpecTypeError as e:  # the section's own field error: re-rooted at this key
        raise SpecTypeError(_reroot(str(e), cls, key)) from None
    except TypeError as e:  # a required field missing
        raise SpecTypeError(f"{key}: {e}") from None


def _plugin(value: Any, base: type, key: str) -> Any:
    """A plug-in instance from itself, a short name / dotted path (constructed with its defaults) or a
    {class_path, init_args} mapping, checked to be a `base`."""

    kind = _PLUGIN_KINDS[base.__name__]
    if isinstance(value, str):
        path, init = value, {}
    elif isinstance(value, Mapping) and "class_path" in value:
        if extra := sorted(set(value) - {"class_path", "init_args"}):
            raise SpecTypeError(f"{key}: unknown key {extra[0]!r} next to class_path; give the constructor's "
                                "arguments under init_args")
        path, init = value["class_path"], value.get("init_args") or {}
        if not isinstance(init, Mapping):
            raise SpecTypeError(f"{key}.init_args: expected a mapping of constructor arguments, got {_show(init)}")
    elif isinstance(value, base):
        return value
    else:
        raise SpecTypeError(f"{key}: expected {_a(base.__name__)} (an instance, a short name such as "
                            f"{_example(kind)!r}, a dotted path, or {{class_path, init_args}}), got {_show(value)}")
    if not isinstance(path, str):
        raise SpecTypeError(f"{key}.class_path: expected a short name or dotted path, got {_show(path)}")
    try:
        cls = resolve(kind, path)
    except (ValueError, ImportError, AttributeError) as e:
        raise SpecTypeError(f"{key}: {str(e).splitlines()[0]}") from None
    try:
        instance = cls(**init)
    except TypeError as e:
        raise SpecTypeError(f"{key}: {path} does not take these arguments: {e}") from None
    if not isinstance(instance, base):
        raise SpecTypeError(f"{key}: {path} is {_a(type(instance).__name__)}, not {_a(base.__name__)}")
    return instance


def _scalar(value: Any, hint: Any, key: str) -> Any:
    if hint is bool:
        if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy's bool too
            return bool(value)
        raise SpecTypeError(f"{key}: expected true or false, got {_show(value)}")
    if hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return value if type(value) is int else int(value)
        raise SpecTypeError(f"{key}: expected an integer, got {_show(value)}")
    if hint is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return value if type(value) is float else float(value)
        raise SpecTypeError(f"{key}: expected a number, got {_show(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise SpecTypeError(f"{key}: expected a string, got {_show(value)}")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise SpecTypeError(f"{key}: expected {_describe(hint)}, got {_show(value)}")
    return value


def _type_hints(cls: type) -> dict[str, Any]:
    if cls not in _hints:
        _hints[cls] = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    return _hints[cls]


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _reroot(message: str, cls: type, key: str) -> str:
    """A nested section's error names its field from the section's default key (`model.lora.r`); inside a parent the
    section sits at `key` (`policies[1].model.lora`)."""
    default = getattr(cls, "SPEC_KEY", "")
    if default and message.startswith(default):
        return key + message[len(default):]
    return f"{key}: {message}"


def _describe(hint: Any, plural: bool = False) -> str:
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return f"{hint.__name__}{'s' if plural else ''}" if plural else _a(hint.__name__)
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}
    if plural:
        names = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}
    if hint in names:
        return names[hint]
    origin = typing.get_origin(hint)
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0], plural=True)}"
    if origin is dict:
        return "a mapping"
    return getattr(hint, "__name__", str(hint))


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _a(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _example(kind: str) -> str:
    return {"env": "arithmetic", "loss": "drpo", "correction": "tis", "stage": "zero_variance"}[kind]
