"""Lightning loggers by short name (`TrainerSpec.loggers`): the trainer's per-step metrics (`train/<policy>/...`) go
to each of them as well as to the run's metrics dataset (`astratk.metrics`).

| name | writes (root = `<run dir>/<name>`, e.g. `runs/quickstart-…/lightning`) | needs |
|---|---|---|
| `csv` (default) | `root/version_N/metrics.csv` and `hparams.yaml` | — |
| `tensorboard` | `root/tensorboard/version_N/events.out.tfevents.*` | `tensorboard` (a dependency) |
| `wandb` | `root/wandb/`, project `$WANDB_PROJECT` or "astratk" | `pip install wandb` (or the `loggers` extra) |
| `mlflow` | `$MLFLOW_TRACKING_URI`, else `root/mlflow.db` + `root/mlartifacts/` | `pip install mlflow` (or the `loggers` extra) |

W&B and MLflow name the run after the run directory; MLflow's experiment is `$MLFLOW_EXPERIMENT_NAME` or "astratk".
View them with `tensorboard --logdir root/tensorboard` and `mlflow ui --backend-store-uri sqlite:///root/mlflow.db`.
mlflow-skinny works with a tracking server only (it has no SQLite store).

W&B runs **offline** unless `WANDB_MODE` is set (`online`, `offline`, `disabled`): a run must not need a network or
an account to finish, and `wandb sync root/wandb/offline-run-*` uploads it later (Lightning marks offline by setting
WANDB_MODE=dryrun in the process, so later W&B loggers there stay offline too). Each logger keeps to its own folder
(two Lightning loggers sharing one folder would each number their version after the other's).

Example:
    >>> from pathlib import Path
    >>> loggers = make_loggers(["csv", "tensorboard"], Path("runs/demo"), "lightning")  # doctest: +SKIP
    >>> trainer = pl.Trainer(logger=loggers, log_every_n_steps=1)  # doctest: +SKIP

Extending: write `_build_<name>(root, run_name) -> Logger` and add a `LoggerKind` to `LOGGERS`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astratk.registry import check_choice

DEFAULT = "astratk"  # W&B project and MLflow experiment when the environment names none


def _lightning_loggers() -> Any:
    from astratk.training._pl import pl  # lightning.pytorch, imported after astratk's environment check

    return pl.loggers


def _build_csv(root: Path, run_name: str) -> Any:
    return _lightning_loggers().CSVLogger(root.parent, name=root.name)  # root/version_N/, as runs always wrote it


def _build_tensorboard(root: Path, run_name: str) -> Any:
    # default_hp_metric=False: no placeholder `hp_metric = -1` scalar
    return _lightning_loggers().TensorBoardLogger(root, name="tensorboard", default_hp_metric=False)


def _build_wandb(root: Path, run_name: str) -> Any:
    root.mkdir(parents=True, exist_ok=True)  # wandb falls back to a temp dir when `dir` does not exist
    return _lightning_loggers().WandbLogger(name=run_name, save_dir=str(root), offline="WANDB_MODE" not in os.environ,
                                            project=os.environ.get("WANDB_PROJECT", DEFAULT))


def _check_mlflow() -> str | None:
    if os.environ.get("MLFLOW_TRACKING_URI") or importlib.util.find_spec("sqlalchemy"):
        return None
    return ("its local store (a SQLite database: MLflow 3 refuses new file stores) needs the full mlflow package, "
            "not mlflow-skinny: pip install mlflow, or set MLFLOW_TRACKING_URI to your tracking server")


def _build_mlflow(root: Path, run_name: str) -> Any:
    experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT)
    uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI"), None
    if not uri:
        # MLflow 3 refuses a new file store ("maintenance mode"); a SQLite database is its recommended default.
        # Artifacts beside it: MLflow's default is ./mlruns under whatever directory the trainer runs in.
        root = root.resolve()
        root.mkdir(parents=True, exist_ok=True)
        uri, artifacts = f"sqlite:///{root / 'mlflow.db'}", (root / "mlartifacts").as_uri()
    return _lightning_loggers().MLFlowLogger(experiment_name=experiment, run_name=run_name, tracking_uri=uri,
                                             artifact_location=artifacts)


@dataclass(frozen=True)
class LoggerKind:
    build: Callable[[Path, str], Any]  # (root folder, run name) -> a Lightning Logger
    modules: tuple[str, ...] = ()  # importable modules it needs (any one of them); () for none
    install: str = ""  # the command that installs them
    check: Callable[[], str | None] | None = None  # a further requirement: None when met, else what is missing + fix


LOGGERS: dict[str, LoggerKind] = {
    "csv": LoggerKind(_build_csv),
    "tensorboard": LoggerKind(_build_tensorboard, ("tensorboard", "tensorboardX"), "pip install tensorboard"),
    "wandb": LoggerKind(_build_wandb, ("wandb",), "pip install wandb"),
    "mlflow": LoggerKind(_build_mlflow, ("mlflow",), "pip install mlflow", _check_mlflow),
}


def check_loggers(names: Sequence[str], key: str = "trainer.loggers") -> list[str]:
    """`names` as a list, or a ValueError naming the bad entry and the fix: an unknown name (with the choices),
    a repeated one, or one whose package is not installed (with the pip command)."""
    if isinstance(names, str):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
            f"{key}: expected a list of logger names, e.g. [{names!r}]; got the string {names!r}")
    for i, name in enumerate(names):
        check_choice("logger", name, LOGGERS, where=f"{key}[{i}]")
        if name in names[:i]:
            raise ValueError(f"{key}[{i}]: {name!r} is listed twice")
        kind = LOGGERS[name]
        if kind.modules and not any(importlib.util.find_spec(m) for m in kind.modules):
            raise ValueError(f"{key}[{i}]: the {name!r} logger needs {' or '.join(kind.modules)}, which is not "
                             f"installed here: {kind.install} (or drop {name!r} from {key})")
        if kind.check is not None and (problem := kind.check()):
            raise ValueError(f"{key}[{i}]: the {name!r} logger: {problem} (or drop {name!r} from {key})")
    return list(names)


def make_loggers(names: Sequence[str], run_dir: Path, name: str) -> list[Any]:
    """One Lightning logger per name, writing under `run_dir / name` (table in the module docstring); [] for no
    names (Lightning then logs nothing; the run's metrics dataset does not depend on loggers)."""
    run_dir = Path(run_dir)
    return [LOGGERS[n].build(run_dir / name, run_dir.name) for n in check_loggers(names)]
