"""The CLI's cluster-job commands without a cluster: usage, --print_config, and errors that name what to fix.
(The commands running for real, across processes: tests/integration/test_cli_cluster.py.)"""

from __future__ import annotations

import yaml

from astratk.cli import main


def test_train_fit_help_and_print_config(capsys):
    assert main(["train", "fit", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--run_config" in out and "--deployment" in out and "--trainer.max_steps" in out
    assert main(["train", "fit", "--run_config", "tutorials/quickstart.yaml", "--deployment", "d", "--print_config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["run_config"] == "tutorials/quickstart.yaml" and cfg["deployment"] == "d"  # linked to model/data
    assert main(["train"]) == 0 and "astratk train fit" in capsys.readouterr().out


def test_deploy_needs_a_scheduler_and_status_names_an_unreachable_one(capsys):
    assert main(["deploy", "--config", "tutorials/quickstart.yaml"]) == 2
    assert "cluster.scheduler_address is required" in capsys.readouterr().err
    assert main(["deploy", "--config", "tutorials/quickstart.yaml", "--name"]) == 2
    assert main(["status", "--scheduler", "tcp://127.0.0.1:9", "--timeout", "2"]) == 2
    assert "cannot reach the Dask scheduler at tcp://127.0.0.1:9" in capsys.readouterr().err


def test_trainer_flags_from_the_policy_pass_lightning_cli_validation():
    """The values `astratk train fit` fills in from `trainer:` must be valid Trainer arguments for LightningCLI's
    parser (a float in max_time's dict failed there: dict[str, int]); a fractional max_time_s is kept exactly."""
    import datetime

    import lightning.pytorch as pl
    from jsonargparse import ArgumentParser

    from astratk.runtime.trainer_job import trainer_defaults
    from astratk.spec import TrainerSpec

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(pl.Trainer, "trainer")
    values = {k: v for k, (_, v) in trainer_defaults(TrainerSpec(max_time_s=150.0, checkpoint_every=2)).items()}
    cfg = parser.parse_object({"trainer": values})
    assert cfg.trainer.max_time == {"seconds": 150} and cfg.trainer.max_steps == 200
    values = {k: v for k, (_, v) in trainer_defaults(TrainerSpec(max_time_s=150.25)).items()}
    cfg = parser.parse_object({"trainer": values})
    assert datetime.timedelta(**cfg.trainer.max_time) == datetime.timedelta(seconds=150.25)
    # "unset" is Lightning's own default, so a flag the command line gives is never overwritten
    assert {k: unset for k, (unset, _) in trainer_defaults(TrainerSpec()).items()} == {
        k: parser.get_defaults().trainer[k] for k in values}


def test_one_flag_style_with_the_old_spellings_still_accepted(tmp_path, capsys):
    """Underscored keys in every subcommand (`--policy_id`, `--base_model`, `--deployment`), the earlier spellings
    (`--policy`, `--base-model`, `--name`) still work."""
    assert main(["deploy", "--config", "tutorials/quickstart.yaml", "--deployment"]) == 2
    assert "--deployment needs a value" in capsys.readouterr().err
    for flags in (["--policy_id", "solver"], ["--policy", "solver"]):
        assert main(["export", str(tmp_path / "no-run"), str(tmp_path / "out"), *flags]) == 2
        assert "astratk export:" in capsys.readouterr().err  # parsed; the run directory is what is missing
    assert main(["export", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--policy_id" in out and "--base_model" in out
