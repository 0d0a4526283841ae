"""YAML <-> `RunSpec` through jsonargparse: the one parser behind `astratk run`, notebooks and cluster jobs.

Plug-ins are given as `class_path` / `init_args`; `class_path` may be a registry short name (`drpo`, `arithmetic`),
rewritten here to its dotted path before parsing. Errors name the offending key.

Example:
    >>> spec = load_spec("tutorials/quickstart.yaml", ["--trainer_steps_override_example"])  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import yaml

from astratk.registry import REGISTRY
from astratk.spec import RunSpec

PLUGIN_KINDS = ("loss", "env", "correction", "stage")  # short names must be unique across these kinds


def parser() -> Any:
    from jsonargparse import ActionConfigFile, ArgumentParser

    p = ArgumentParser(prog="astratk run", description="Run a whole local astratk job (see README).",
                       exit_on_error=False)
    p.add_argument("--config", action=ActionConfigFile, help="a RunSpec YAML file (tutorials/quickstart.yaml)")
    p.add_class_arguments(RunSpec, None)
    return p


def expand_short_names(node: Any) -> Any:
    """Rewrite every `class_path: <short name>` to its registry dotted path (recursively)."""
    if isinstance(node, list):
        return [expand_short_names(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: expand_short_names(v) for k, v in node.items()}
    cp = out.get("class_path")
    if isinstance(cp, str) and "." not in cp:
        for kind in PLUGIN_KINDS:
            if cp in REGISTRY[kind]:
                out["class_path"] = REGISTRY[kind][cp]
                break
        else:
            choices = sorted(n for kind in PLUGIN_KINDS for n in REGISTRY[kind])
            raise ValueError(f"unknown class_path {cp!r}; choose one of {choices} or give a dotted path")
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
            f"{path}: a config must be a mapping of RunSpec fields, got {type(data).__name__}")
    return expand_short_names(data)


def parse(argv: list[str]) -> RunSpec:
    """Parse CLI-style arguments (`--config FILE` plus dotted overrides) into a validated RunSpec."""
    args = list(argv)
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise ValueError("--config needs a file path")
        args[i + 1] = json.dumps(read_config(args[i + 1]))
    from jsonargparse import ArgumentError

    p = parser()
    try:
        cfg = p.parse_args(args)
        init = p.instantiate(cfg) if hasattr(p, "instantiate") else p.instantiate_classes(cfg)
    except ArgumentError as e:
        raise ValueError(f"bad configuration: {e}") from None
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    return RunSpec(**{k: v for k, v in vars(init).items() if k in fields}).validate()


def load_spec(path: str | Path, overrides: list[str] | None = None) -> RunSpec:
    return parse(["--config", str(path), *(overrides or [])])


def dump_spec(spec: RunSpec) -> str:
    """The spec as YAML with plug-ins as class_path / init_args (init_args read back from the instance)."""
    return yaml.safe_dump(to_plain(spec), sort_keys=False)


def to_plain(obj: Any) -> Any:
    """Dataclasses as dicts, plug-in instances as {class_path, init_args} (init args read back from attributes)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    cls = type(obj)
    params = inspect.signature(cls).parameters
    init_args = {k: to_plain(getattr(obj, k)) for k in params if hasattr(obj, k)}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}
