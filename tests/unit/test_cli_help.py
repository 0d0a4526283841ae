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


@pytest.mark.parametrize(("flags", "where", "expected"), [
    (["--policies.loss", "ppo_clip"], "loss", "PPOClip"),
    (["--policies.loss.class_path=cispo"], "loss", "CISPO"),
    (["--policies.loss", '{"class_path": "cispo", "init_args": {"ratio_floor": 0.5}}'], "loss", "CISPO"),
    (["--env", "math_word"], "env", "WordProblemEnv"),
    (["--env.class_path", "math_word"], "env", "WordProblemEnv"),
])
def test_short_names_work_on_the_command_line_as_in_yaml(flags, where, expected):
    from astratk.config import load_spec

    spec = load_spec("tutorials/quickstart.yaml", flags)
    obj = spec.policies[0].loss if where == "loss" else spec.env
    assert type(obj).__name__ == expected
    if "ratio_floor" in flags[-1]:
        assert obj.ratio_floor == 0.5


def test_a_flag_value_that_is_not_a_plug_in_is_left_alone():
    from astratk.config import expand_flag_value

    assert expand_flag_value("--name", "drpo") == "drpo"  # a run may be called after a loss
    assert expand_flag_value("--policies.loss", "mypkg.MyLoss") == "mypkg.MyLoss"


def test_print_config_skip_default_prints_no_warnings(capsys):
    import warnings

    with warnings.catch_warnings(record=True) as seen, pytest.raises(SystemExit):
        warnings.simplefilter("always")
        main(["run", "--config", "tutorials/quickstart.yaml", "--print_config=skip_default"])
    out, err = capsys.readouterr()
    assert "name: quickstart" in out and "Unable to serialize" not in err + out
    assert not [w for w in seen if "Unable to serialize" in str(w.message)]


def test_a_policies_flag_sets_the_last_policy_as_the_help_says():
    from astratk.config import load_spec

    spec = load_spec("tutorials/solver_verifier_two_policies.yaml", ["--policies.trainer.max_time_s", "300"])
    first, last = spec.policies[0], spec.policies[-1]
    assert last.trainer.max_time_s == 300.0 and first.trainer.max_time_s != 300.0
