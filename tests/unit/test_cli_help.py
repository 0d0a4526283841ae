"""`astratk run --help` documents every configuration key: each field of every spec dataclass has a docstring that
jsonargparse reads (the attribute docstrings in astratk/spec.py), and the CLI's -c / --version work."""

import dataclasses
import inspect

import pytest

import astratk.spec as spec_module
from astratk.cli import main
from astratk.config import parse, parser

SPECS = [cls for _, cls in inspect.getmembers(spec_module, inspect.isclass)
         if dataclasses.is_dataclass(cls) and cls.__module__ == spec_module.__name__]


def _field_help(cls) -> dict[str, str]:
    from jsonargparse import ArgumentParser

    parser()  # turns attribute docstrings on
    p = ArgumentParser(exit_on_error=False)
    p.add_class_arguments(cls, "x")
    return {a.dest[2:]: (a.help or "") for a in p._actions if a.dest.startswith("x.")}


@pytest.mark.parametrize("cls", SPECS, ids=lambda c: c.__name__)
def test_every_field_has_help(cls):
    helps = _field_help(cls)
    undocumented = [f.name for f in dataclasses.fields(cls)
                    if not any(k == f.name or k.startswith(f.name + ".") for k, h in helps.items()
                               if h.strip() and not h.startswith(("Path to a configuration file", "(type")))]
    assert not undocumented, f"{cls.__name__}: add a docstring under {undocumented} in astratk/spec.py"


def test_run_help_shows_the_docstrings(capsys):
    assert main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("Roll out with weights this many versions behind the newest", "seed of the run",
                 "-c CONFIG, --config CONFIG", "held-out tasks evaluated each time"):
        assert text in out, text


def test_short_config_flag_and_version(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("name: short\nrollout: {group_size: 4}\n")
    assert parse(["-c", str(cfg)]).rollout.group_size == 4
    assert parse([f"-c={cfg}", "--rollout.group_size", "2"]).rollout.group_size == 2
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("astratk ")
