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

W&B runs **online when you are logged in** (`wandb login`, which stores a key in `~/.netrc`, or `WANDB_API_KEY` set)
and **offline otherwise**, so a run never needs a network or an account to finish; `WANDB_MODE` (`online`,
`offline`, `disabled`) overrides both, and `wandb sync root/wandb/offline-run-*` uploads an offline run later
(Lightning marks offline by setting WANDB_MODE=dryrun in the process, so later W&B loggers there stay offline too).
Each logger keeps to its own folder (two Lightning loggers sharing one folder would each number their version after
the other's).

What they receive: the trainer's per-step metrics (`train/<policy>/...`, `loss/...`), the run's whole resolved
configuration as hyperparameters (`log_config`: the loss's class and arguments included, as dotted keys), and from the
run itself (`log_run_metrics`, single-policy runs whose trainer runs in the run's process) every held-out evaluation
(`eval/<policy>/accuracy`, per role, pass@k, at the evaluated version's step) and, every `metrics_every_s` and at
the end, the data layer's throughput and drop counters (`data/...`). Multi-policy runs' trainer jobs log their own
training metrics and configuration; their evaluations are in the run's `metrics.nc`.

Example:
    >>> from pathlib import Path
    >>> loggers = make_loggers(["csv", "tensorboard"], Path("runs/demo"), "lightning")  # doctest: +SKIP
    >>> trainer = pl.Trainer(logger=loggers, log_every_n_steps=1)  # doctest: +SKIP

Extending: write `_build_<name>(root, run_name) -> Logger`, add it to `BUILDERS`, and what it needs installed to
`astratk.spec.trainer.LOGGERS`.
"""

from __future__ import annotations

import math
import netrc
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from astratk.config import to_plain
from astratk.spec.trainer import LOGGERS, check_loggers  # noqa: F401 - LOGGERS: re-exported

DEFAULT = "astratk"  # W&B project and MLflow experiment when the environment names none


def _lightning_loggers() -> Any:
    from astratk.training._pl import pl  # lightning.pytorch, imported after astratk's environment check

    return pl.loggers


def _build_csv(root: Path, run_name: str) -> Any:
    return _lightning_loggers().CSVLogger(root.parent, name=root.name)  # root/version_N/, as runs always wrote it


def _build_tensorboard(root: Path, run_name: str) -> Any:
    # default_hp_metric=False: no placeholder `hp_metric = -1` scalar
    return _lightning_loggers().TensorBoardLogger(root, name="tensorboard", default_hp_metric=False)


def wandb_logged_in() -> bool:
    """True when W&B has credentials here: `WANDB_API_KEY`, or the `~/.netrc` entry `wandb login` writes (for
    `WANDB_BASE_URL`'s host, default api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY"):
        return True

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def _build_wandb(root: Path, run_name: str) -> Any:
    root.mkdir(parents=True, exist_ok=True)  # wandb falls back to a temp dir when `dir` does not exist
    offline = "WANDB_MODE" not in os.environ and not wandb_logged_in()
    return _lightning_loggers().WandbLogger(name=run_name, save_dir=str(root), offline=offline,
                                            project=os.environ.get("WANDB_PROJECT", DEFAULT))


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


# name -> (root folder, run name) -> a Lightning Logger; the names and what each needs installed are the spec's
# (`astratk.spec.trainer.LOGGERS`, checked by `check_loggers`).
BUILDERS: dict[str, Callable[[Path, str], Any]] = {
    "csv": _build_csv,
    "tensorboard": _build_tensorboard,
    "wandb": _build_wandb,
    "mlflow": _build_mlflow,
}


def flat_config(spec: Any) -> dict[str, Any]:
    """The resolved run spec as dotted keys with plain values (`policies.0.loss.class_path`,
    `policies.0.loss.init_args.delta`, ...): what loggers accept as hyperparameters."""

    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[prefix] = value
        else:
            out[prefix] = str(value)

    walk("", to_plain(spec))
    return {k: ("null" if v is None else v) for k, v in out.items()}


def log_config(loggers: Any, spec: Any) -> None:
    """Send the run's resolved configuration (`flat_config`) to each logger as hyperparameters."""
    if not loggers:
        return
    params = flat_config(spec)
    for logger in loggers if isinstance(loggers, (list, tuple)) else [loggers]:
        logger.log_hyperparams(params)


def log_run_metrics(loggers: Sequence[Any], metrics: dict[str, float], step: int, flush: bool = False) -> None:
    """Send metrics the run measures outside the trainer (evaluations, throughput, drops) to the trainer's loggers at
    `step`; `flush` writes them out at once (after the trainer has finished, nothing else would)."""
    clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    if not clean:
        return
    for logger in loggers:
        logger.log_metrics(clean, step=step)
        if flush:
            logger.save()


def make_loggers(names: Sequence[str], run_dir: Path, name: str) -> list[Any]:
    """One Lightning logger per name, writing under `run_dir / name` (table in the module docstring); [] for no
    names (Lightning then logs nothing; the run's metrics dataset does not depend on loggers)."""
    run_dir = Path(run_dir)
    return [BUILDERS[n](run_dir / name, run_dir.name) for n in check_loggers(names)]
