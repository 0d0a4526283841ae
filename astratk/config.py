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
import re
import warnings
from pathlib import Path
from typing import Any

import yaml

from astratk.registry import REGISTRY
from astratk.spec import RunSpec

PLUGIN_KINDS = ("loss", "env", "correction", "stage")  # short names must be unique across these kinds


def parser() -> Any:
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    # every field's help is the docstring under it in astratk/spec.py (`astratk run --help` prints them)
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    p = ArgumentParser(prog="astratk run", description="Run a whole local astratk job (see README).",
                       exit_on_error=False)
    p.add_argument("-c", "--config", action=ActionConfigFile,
                   help="a RunSpec YAML file (tutorials/quickstart.yaml); later flags override it")
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


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data, or a ValueError of one line that names the file and the line: text that is not UTF-8,
    a syntax error, or a key given twice in one mapping (plain YAML keeps the last one silently, so a setting
    written twice would be lost without a word). Every run config goes through here: `astratk run`, `deploy`,
    `status --config`, `train fit --run_config`, and a `resume_from` run's config.yaml."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a YAML file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"config file {str(path)!r} {what}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}, line {line}, column {column}: not UTF-8 text (byte 0x{raw[e.start]:02x}); "
                         "save the file as UTF-8") from None
    try:
        loader = yaml.SafeLoader(text)  # checks every character first (ReaderError)
        try:
            node = loader.get_single_node()
            if node is None:  # an empty file
                return None
            _refuse_duplicate_keys(node, path, "", set())
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ValueError(f"{path}, {_yaml_error(e, text)}") from None


def _refuse_duplicate_keys(node: Any, path: Path, where: str, visited: set[int]) -> None:
    """Raise naming the dotted key and both lines when a mapping anywhere in the document gives a key twice, the
    first such key in reading order (a merge key `<<` may override, as YAML intends)."""
    if id(node) in visited:  # an alias shares its anchor's node (and may contain itself)
        return
    visited.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, path, f"{where}[{i}]", visited)
    elif isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            dotted = where
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                dotted = f"{where}.{key.value}" if where else str(key.value)
                line = key.start_mark.line + 1
                if key.value in first:
                    raise ValueError(f"{path}, line {line}: duplicate key {dotted!r} (first given at line "
                                     f"{first[key.value]}); YAML would keep the last one silently: remove one")
                first[key.value] = line
            _refuse_duplicate_keys(value, path, dotted, visited)


def _yaml_error(e: yaml.YAMLError, text: str) -> str:
    """A PyYAML error as one line: where, what, and where the construct it was reading began."""
    if isinstance(e, yaml.reader.ReaderError):
        line = text.count("\n", 0, e.position) + 1
        return f"line {line}: character #x{e.character:04x} is not allowed in YAML ({e.reason})"
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
        what = e.problem or e.context or "syntax error"
        if e.context and e.problem:
            cm = e.context_mark
            what += f" ({e.context}" + (f" at line {cm.line + 1}, column {cm.column + 1})" if cm is not None else ")")
        return f"{where}: YAML syntax error: {what}"
    return f"YAML error: {' '.join(str(e).split())}"


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
            f"{path}: a config must be a mapping of RunSpec fields, got {type(data).__name__}")
    return expand_short_names(data)


# flags whose value is a plug-in: a short name there means what it means as `class_path` in YAML
PLUGIN_FLAGS = ("env", "loss", "corrections", "curators", "filters", "class_path")


def _short(name: str) -> str | None:
    """The dotted path of a registry short name of any plug-in kind, or None."""
    for kind in PLUGIN_KINDS:
        if name in REGISTRY[kind]:
            return REGISTRY[kind][name]
    return None


def expand_flag_value(flag: str, value: str) -> str:
    """A command-line override's value with short names expanded, as YAML's are: `--policies.loss ppo_clip`,
    `--env.class_path math_word`, `--policies.loss '{"class_path": "cispo", "init_args": {...}}'`."""
    if flag.removeprefix("--").split(".")[-1] not in PLUGIN_FLAGS:
        return value
    if "." not in value and (path := _short(value.strip())) is not None:
        return path
    if value.lstrip().startswith(("{", "[")):
        try:
            data = json.loads(value)
        except json.JSONDecodeError:
            return value
        return json.dumps(expand_short_names(data))
    return value


def _expand_flags(args: list[str]) -> list[str]:
    out: list[str] = []
    for i, a in enumerate(args):
        if a.startswith("--") and "=" in a:
            flag, value = a.split("=", 1)
            out.append(f"{flag}={expand_flag_value(flag, value)}")
        elif i > 0 and args[i - 1].startswith("--") and "=" not in args[i - 1] and not a.startswith("--"):
            out.append(expand_flag_value(args[i - 1], a))
        else:
            out.append(a)
    return out


POLICY_ALIASES = ("trainer", "model", "loss", "corrections")  # `--trainer.lr 1e-5` for `--policies.trainer.lr 1e-5`


def _policy_alias(arg: str) -> str | None:
    """The section a one-policy shorthand flag names (`--trainer.max_time_s` -> trainer), or None."""
    if not arg.startswith("--"):
        return None
    head = arg[2:].partition("=")[0].split(".")[0]
    return head if head in POLICY_ALIASES else None


def parse(argv: list[str]) -> RunSpec:
    """Parse CLI-style arguments (`--config FILE` plus dotted overrides) into a validated RunSpec. A one-policy run's
    policy keys may be given without `policies.`: `--trainer.max_time_s 120` is `--policies.trainer.max_time_s 120`
    (as `astratk train fit` takes them); a run of several policies refuses the shorthand."""
    # --config=FILE as --config FILE: every config file is read here (strictly), never by jsonargparse's own loader
    args = [part for a in argv for part in (a.split("=", 1) if a.startswith(("--config=", "-c=")) else [a])]
    aliased = sorted({f"--{h}" for a in args if (h := _policy_alias(a)) is not None})
    args = [f"--policies.{a[2:]}" if _policy_alias(a) is not None else a for a in args]
    args = _expand_flags(args)
    args = ["--config" if a == "-c" else a for a in args]
    for i, a in enumerate(args):
        if a == "--config":
            if i + 1 >= len(args):
                raise ValueError("--config needs a file path")
            args[i + 1] = json.dumps(read_config(args[i + 1]))
    from jsonargparse import ArgumentError

    p = parser()
    try:
        with warnings.catch_warnings():
            # --print_config=skip_default compares with RunSpec's defaults, which are plug-in instances that
            # jsonargparse cannot serialise: it warns about each one, and prints the config all the same
            warnings.filterwarnings("ignore", message=r"\s*Unable to serialize instance")
            cfg = p.parse_args(args)
        init = p.instantiate(cfg) if hasattr(p, "instantiate") else p.instantiate_classes(cfg)
    except ArgumentError as e:
        raise ValueError(f"bad configuration: {_one_line(str(e))}") from None
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    spec = RunSpec(**{k: v for k, v in vars(init).items() if k in fields})
    if aliased and len(spec.policies) > 1:
        raise ValueError(f"{', '.join(aliased)}: the shorthand sets a one-policy run's policy; this run has "
                         f"{len(spec.policies)} policies ({', '.join(p.policy_id for p in spec.policies)}): set each "
                         "one's keys in the YAML file (--policies.<key> sets the last one's)")
    return spec.validate()


def _one_line(message: str) -> str:
    """jsonargparse's nested error (`Parser key "policies": / Problem with given class_path ... / Parser key
    "trainer.lr": / Expected a float...`) as one line: the dotted key, then the innermost problem."""
    marks = list(re.finditer(r'Parser key "([^"]+)":?', message))
    tail = message[marks[-1].end():] if marks else message
    parts = [" ".join(line.split()) for line in tail.splitlines()
             if line.strip() not in ("", "Errors:") and not line.strip().startswith("Problem with given class_path")]
    key = ".".join(m.group(1) for m in marks)
    return (f"{key}: " if key else "") + "; ".join(parts)


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
