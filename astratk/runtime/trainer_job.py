"""`astratk train fit`: a LightningCLI trainer job for one policy, attached to a running deployment.

    astratk deploy --config run.yaml --name sv                  # data layer + acquisition on Dask
    astratk train fit --run_config run.yaml --policy_id solver --deployment sv \\
        --scheduler tcp://host:8786
    astratk train fit ... --trainer.max_steps 50 --print_config  # any Lightning Trainer flag

The run config (the same RunSpec YAML as `astratk run`) says everything about the policy: its loss,
learning rate, aggregation, corrections, regularisers, steps and checkpoints; the deployment gives
the model directory of version 0 and the data layer. So the model (`DeployedPolicy`) and the data
(`DeploymentData`) take only those four names, and Trainer flags default to the policy's `trainer:`
section (a flag given on the command line wins). Every job publishes weights every `publish_every`
steps, records per-step metrics (written to `<default_root_dir>/steps.json` when the fit ends),
prints a progress line, and writes checkpoints when `checkpoint_every` is set. A multi-policy
`astratk run` starts one such process per policy.

The module's arguments, the stream, the callbacks, the checkpoint settings, the loggers and the
Trainer flags come from `astratk.training.build`, as for a policy trained inside `astratk run`; this
module adds what attaching to a deployment takes (a Dask client, the deployment's registry entry)
and the LightningCLI plumbing.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import torch

from astratk import idle_cores
from astratk.config import load_spec
from astratk.runtime import registry
from astratk.runtime.cluster import open_client, security
from astratk.runtime.trainers import TRAINER_LEND_ENV, TRAINER_THREADS_ENV
from astratk.spec import StartError
from astratk.spec.cluster import dask_config_has_tls
from astratk.training import build
from astratk.training._pl import pl
from astratk.training.data import GroupStream, RolloutDataModule
from astratk.training.loggers import log_config
from astratk.training.module import PolicyModule

_CLIENTS: dict[str | None, Any] = {}


def _client(scheduler: str | None, spec: Any, timeout_s: float | None = None) -> Any:
    """One Dask client per scheduler in this process (None: the run config's
    `cluster.scheduler_address`, else the current default client), with the run config's
    `cluster.tls` certificates, waiting at most `timeout_s` (None: `cluster.startup_timeout_s`).
    A scheduler it cannot reach is a `StartError` naming the address (one line from the CLI)."""
    from distributed import default_client

    timeout_s = spec.cluster.startup_timeout_s if timeout_s is None else timeout_s
    scheduler = scheduler or spec.cluster.scheduler_address
    if scheduler is None:
        try:
            return default_client()
        except ValueError:
            raise StartError("--scheduler: give the Dask scheduler's address (tcp://host:8786), or "
                             "cluster.scheduler_address in the run config") from None
    if scheduler not in _CLIENTS:
        sec = security(spec)
        if scheduler.startswith("tls://") and sec is None and not dask_config_has_tls():
            raise StartError(f"--scheduler {scheduler} is a TLS scheduler but the run config has no "
                             "cluster.tls certificates (nor Dask's TLS config); set cluster.tls: "
                             "{ca_file, cert, key} in the run config (docs/cluster.md)")
        try:
            # The default client: actors fetched from a dataset find their client through it.
            _CLIENTS[scheduler] = open_client(scheduler, timeout_s, sec, set_as_default=True)
        except OSError as e:  # refused, timed out, TLS handshake: distributed raises OSErrors
            reason = " ".join(str(e).split()) or type(e).__name__
            if isinstance(e, ConnectionRefusedError):  # said in seconds by check_listening
                raise StartError(f"--scheduler: {reason}; is the Dask scheduler running there, and reachable from "
                                 "here?") from None
            raise StartError(f"--scheduler: cannot reach the Dask scheduler at {scheduler} within "
                             f"{timeout_s:.0f}s (cluster.startup_timeout_s): {reason}; is it running, "
                             "and reachable from here?") from None
    return _CLIENTS[scheduler]


def _policy_spec(run_config: str, policy_id: str) -> Any:
    """The run config, checked, and holding `policy_id`; a `StartError` naming the file or key
    otherwise."""

    try:
        spec = load_spec(run_config, [])
    except (ValueError, FileNotFoundError) as e:
        raise StartError(f"--run_config {run_config}: {e}") from None
    if policy_id not in [p.policy_id for p in spec.policies]:
        raise StartError(f"--policy_id: {run_config} has no policy {policy_id!r}; its policies are "
                         f"{[p.policy_id for p in spec.policies]}")
    return spec


def check_job(flags: dict[str, str]) -> None:
    """`astratk train fit`'s front door, before Lightning starts: the `--run_config` given parses
    and holds `--policy_id`, and the scheduler (`--scheduler`, else the config's) answers within
    `cluster.startup_timeout_s` (the client is kept for the job). A `StartError` otherwise; flags
    not on the command line (in a `--config` file) are checked as the job builds its classes."""
    if "--run_config" not in flags:
        return
    spec = _policy_spec(flags["--run_config"], flags.get("--policy_id", "main"))
    if flags.get("--scheduler") or spec.cluster.scheduler_address:
        _client(flags.get("--scheduler"), spec)


def _fetch(client: Any, deployment: str, timeout_s: float, attach: bool = False) -> Any:
    """The deployment's registry entry (`attach`: and a data-layer handle); one that does not
    appear is a `StartError` naming it."""

    try:
        return (registry.attach if attach else registry.fetch)(client, deployment, timeout_s)
    except TimeoutError as e:
        raise StartError(f"--deployment: {e}") from None


class DeployedPolicy(PolicyModule):
    """`PolicyModule` built from a run config's policy and the deployment's model directory."""

    def __init__(self, run_config: str, policy_id: str = "main", deployment: str = "run",
                 scheduler: str | None = None, attach_timeout_s: float | None = None) -> None:
        spec = _policy_spec(run_config, policy_id)
        # None: the run config's cluster.startup_timeout_s, for the scheduler and the deployment
        attach_timeout_s = spec.cluster.startup_timeout_s if attach_timeout_s is None else attach_timeout_s
        from astratk import cpu

        planned = os.environ.get(TRAINER_THREADS_ENV, "")  # started by a run: the threads its plan gave trainers
        torch.set_num_threads(int(planned) if planned.isdigit() else cpu.run_threads(spec).trainer)
        cpu.set_linear_backend(spec.cluster.cpu_linear)
        client = _client(scheduler, spec, attach_timeout_s)
        info = _fetch(client, deployment, attach_timeout_s)
        super().__init__(info.ctx.model_paths[policy_id], **build.module_args(spec, policy_id))
        self.spec = spec


class DeploymentData(RolloutDataModule):
    """The policy's step batches from the deployment's data layer (rank-sharded under DDP)."""

    def __init__(self, run_config: str, policy_id: str = "main", deployment: str = "run",
                 scheduler: str | None = None, attach_timeout_s: float | None = None) -> None:
        pl.LightningDataModule.__init__(self)
        self.run_config, self.policy_id, self.deployment = run_config, policy_id, deployment
        self.spec = _policy_spec(run_config, policy_id)
        self.scheduler = scheduler
        self.attach_timeout_s = (self.spec.cluster.startup_timeout_s if attach_timeout_s is None
                                 else attach_timeout_s)
        self.stream: GroupStream | None = None  # type: ignore[assignment]
        self.info: Any = None
        self._start_step = 0

    def setup(self, stage: str) -> None:
        if self.stream is not None:
            return
        client = _client(self.scheduler, self.spec, self.attach_timeout_s)
        self.info, handle = _fetch(client, self.deployment, self.attach_timeout_s, attach=True)
        trainer = self.trainer
        if trainer is None or trainer.is_global_zero:
            handle.trainer_attached(self.policy_id)  # the deployment stops saying it waits for a trainer
        # --trainer.max_steps on the command line wins over the policy's trainer.max_steps.
        max_steps = trainer.max_steps if trainer is not None and trainer.max_steps > 0 else None
        self.stream = build.group_stream(
            self.spec, self.policy_id, handle, self.info.ctx.model_paths[self.policy_id],
            start_step=self._start_step, max_steps=max_steps,
            rank=trainer.global_rank if trainer is not None else 0,
            world_size=trainer.world_size if trainer is not None else 1)
        lend = os.environ.get(TRAINER_LEND_ENV, "")  # started by a run on this host: lend while waiting
        if lend.isdigit() and int(lend) > 0:
            self.stream.idle_marker = idle_cores.IdleMarker(idle_cores.run_dir_for(self.info.ctx.run_id), int(lend))

    def state_dict(self) -> dict[str, Any]:
        if self.stream is None:
            return {"next_step": self._start_step}
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start_step = int(state["next_step"])
        if self.stream is not None:
            self.stream.start_step = self._start_step


class DeploymentCallbacks(pl.Callback):
    """The policy's callbacks (`build.callbacks`) and its steps.json file, built once the data
    module has attached (they need its stream and the deployment's weight store). steps.json is
    written however the fit ends: with its `stop_reason` when it ended early, an exception's too."""

    def __init__(self, printer: Any = print) -> None:
        self.printer = printer
        self.inner: list[pl.Callback] = []
        self.recorder: Any = None
        self.result: dict[str, Any] | None = None  # what steps.json holds, once written

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.inner:
            return
        from astratk.weights.store import WeightStore

        data = trainer.datamodule
        if not isinstance(data, DeploymentData):
            raise TypeError("DeploymentCallbacks needs the DeploymentData data module")
        spec = data.spec
        store = WeightStore.from_spec(data.info.ctx.store_url, spec.weights)
        store.keep_last = spec.weights.keep_last  # each policy's trainer prunes its own versions
        self.inner, self.recorder = build.callbacks(
            spec, data.policy_id, stream=data.stream, store=store,
            stop_file=Path(trainer.default_root_dir) / "STOP", progress=trainer.is_global_zero,
            printer=self.printer)
        for cb in self.inner:
            cb.setup(trainer, pl_module, stage)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for cb in self.inner:
            cb.teardown(trainer, pl_module, stage)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for cb in self.inner:
            cb.on_train_start(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for cb in self.inner:
            cb.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        for cb in self.inner:
            cb.on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for cb in self.inner:
            cb.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for cb in self.inner:
            cb.on_train_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        for cb in self.inner:
            cb.on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write_steps(trainer)

    def state_dict(self) -> dict[str, Any]:
        """The inner callbacks' checkpoint state (the divergence guard's), by class name. Lightning restores it
        after `setup`, once they exist."""
        return {type(cb).__qualname__: state for cb in self.inner if (state := cb.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for cb in self.inner:
            if type(cb).__qualname__ in state_dict:
                cb.load_state_dict(state_dict[type(cb).__qualname__])

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        for cb in self.inner:
            cb.on_exception(trainer, pl_module, exception)
        self._write_steps(trainer, exception)

    def _write_steps(self, trainer: pl.Trainer, error: BaseException | None = None) -> None:
        if trainer.is_global_zero and self.recorder is not None:
            out = Path(trainer.default_root_dir) / "steps.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            self.result = build.fit_result(self.recorder, error)
            out.write_text(json.dumps(self.result))
        data = trainer.datamodule
        if trainer.is_global_zero and isinstance(data, DeploymentData) and data.stream is not None:
            try:  # the deployment says, once, that this trainer left (and at which step) instead of "starving"
                data.stream.datalayer.trainer_detached(data.policy_id, trainer.global_step)
            except Exception as e:  # noqa: BLE001 - a deployment already gone: nothing to tell
                self.printer(f"could not tell the deployment that this trainer ended ({type(e).__name__}: {e})")


def job_summary(cli: Any) -> dict[str, Any]:
    """`stopped_early` and `stop_reason` (`build.fit_result`) of the fit a `train_cli` ran (the CLI
    exits non-zero, naming the reason, when it ended early)."""
    callbacks = getattr(getattr(cli, "trainer", None), "callbacks", [])
    reason = next((cb.result.get("stop_reason") for cb in callbacks
                   if isinstance(cb, DeploymentCallbacks) and cb.result is not None), None)
    return {"stopped_early": reason is not None, "stop_reason": reason}


def trainer_defaults(ts: Any) -> dict[str, tuple[Any, Any]]:
    """Trainer flag -> (Lightning's default, the policy's value from `build.trainer_flags`); the
    job sets the flags the command line left at Lightning's default."""
    lightning = inspect.signature(pl.Trainer.__init__).parameters
    return {k: (lightning[k].default, v) for k, v in build.trainer_flags(ts).items()}


def train_cli(args: list[str] | None = None, run: bool = True) -> Any:
    """`astratk train fit ...` (LightningCLI; see the module docstring)."""
    from lightning.pytorch.cli import LightningCLI

    class TrainCLI(LightningCLI):
        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument("--run_config", required=True,
                                help="the run's RunSpec YAML (as for astratk run)")
            parser.add_argument("--policy_id", default="main", help="the policy this job trains")
            parser.add_argument("--deployment", required=True,
                                help="the deployment's name (astratk deploy --name)")
            parser.add_argument("--scheduler", default=None, help="the Dask scheduler's address")
            for target in ("model", "data"):
                for arg in ("run_config", "policy_id", "deployment", "scheduler"):
                    parser.link_arguments(arg, f"{target}.{arg}")

        def before_instantiate_classes(self) -> None:
            cfg = self.config[self.subcommand] if self.subcommand else self.config
            ts = _policy_spec(cfg.run_config, cfg.policy_id).policy(cfg.policy_id).trainer
            t = cfg.trainer
            for key, (unset, value) in trainer_defaults(ts).items():
                if t.get(key) == unset:
                    t[key] = value
            root = Path(t.get("default_root_dir") or os.getcwd())
            ckpt = build.checkpoint_args(ts, root / "checkpoints" / cfg.policy_id)
            # In the config rather than added at instantiation, so that --trainer.callbacks on the
            # command line replaces it.
            if ckpt is not None and not t.get("callbacks"):
                from jsonargparse import Namespace

                checkpoint = "lightning.pytorch.callbacks.ModelCheckpoint"
                t["callbacks"] = [Namespace(class_path=checkpoint, init_args=Namespace(**ckpt))]

        def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
            extra = kwargs.setdefault("callbacks", [])
            extra.append(DeploymentCallbacks())
            cfg = self.config[self.subcommand] if self.subcommand else self.config
            # No --trainer.logger given: the policy's `trainer.loggers`.
            if cfg.trainer.get("logger") in (None, True):
                spec = _policy_spec(cfg.run_config, cfg.policy_id)
                root = Path(cfg.trainer.get("default_root_dir") or os.getcwd())
                kwargs["logger"] = build.loggers(spec.policy(cfg.policy_id).trainer, root)
                log_config(kwargs["logger"], spec)
            return super().instantiate_trainer(**kwargs)

    return TrainCLI(DeployedPolicy, DeploymentData, args=args, run=run,
                    save_config_kwargs={"overwrite": True}, parser_kwargs={"prog": "astratk train"})
