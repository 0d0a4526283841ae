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

from astratk.training import build
from astratk.training._pl import pl
from astratk.training.data import GroupStream, RolloutDataModule
from astratk.training.module import PolicyModule

_CLIENTS: dict[str | None, Any] = {}


def _client(scheduler: str | None, spec: Any, timeout_s: float = 60.0) -> Any:
    """One Dask client per scheduler in this process (None: the run config's
    `cluster.scheduler_address`, else the current default client), with the run config's
    `cluster.tls` certificates."""
    from distributed import Client, default_client

    from astratk.runtime.cluster import security

    scheduler = scheduler or spec.cluster.scheduler_address
    if scheduler is None:
        return default_client()
    if scheduler not in _CLIENTS:
        # The default client: actors fetched from a dataset find their client through it.
        _CLIENTS[scheduler] = Client(scheduler, timeout=timeout_s, security=security(spec))
    return _CLIENTS[scheduler]


def _policy_spec(run_config: str, policy_id: str) -> Any:
    from astratk.config import load_spec

    spec = load_spec(run_config, [])
    spec.policy(policy_id)  # KeyError naming the policies when it is not one of them
    return spec


class DeployedPolicy(PolicyModule):
    """`PolicyModule` built from a run config's policy and the deployment's model directory."""

    def __init__(self, run_config: str, policy_id: str = "main", deployment: str = "run",
                 scheduler: str | None = None, attach_timeout_s: float = 120.0) -> None:
        from astratk.runtime import registry

        spec = _policy_spec(run_config, policy_id)
        torch.set_num_threads(spec.cluster.torch_threads)
        client = _client(scheduler, spec, attach_timeout_s)
        info = registry.fetch(client, deployment, attach_timeout_s)
        super().__init__(info.ctx.model_paths[policy_id], **build.module_args(spec, policy_id))
        self.spec = spec


class DeploymentData(RolloutDataModule):
    """The policy's step batches from the deployment's data layer (rank-sharded under DDP)."""

    def __init__(self, run_config: str, policy_id: str = "main", deployment: str = "run",
                 scheduler: str | None = None, attach_timeout_s: float = 120.0) -> None:
        pl.LightningDataModule.__init__(self)
        self.run_config, self.policy_id, self.deployment = run_config, policy_id, deployment
        self.scheduler, self.attach_timeout_s = scheduler, attach_timeout_s
        self.spec = _policy_spec(run_config, policy_id)
        self.stream: GroupStream | None = None  # type: ignore[assignment]
        self.info: Any = None
        self._start_step = 0

    def setup(self, stage: str) -> None:
        if self.stream is not None:
            return
        from astratk.runtime import registry

        client = _client(self.scheduler, self.spec, self.attach_timeout_s)
        self.info, handle = registry.attach(client, self.deployment, self.attach_timeout_s)
        trainer = self.trainer
        # --trainer.max_steps on the command line wins over the policy's trainer.max_steps.
        max_steps = trainer.max_steps if trainer is not None and trainer.max_steps > 0 else None
        self.stream = build.group_stream(
            self.spec, self.policy_id, handle, self.info.ctx.model_paths[self.policy_id],
            start_step=self._start_step, max_steps=max_steps,
            rank=trainer.global_rank if trainer is not None else 0,
            world_size=trainer.world_size if trainer is not None else 1)

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
    module has attached (they need its stream and the deployment's weight store)."""

    def __init__(self, printer: Any = print) -> None:
        self.printer = printer
        self.inner: list[pl.Callback] = []
        self.recorder: Any = None

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

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for cb in self.inner:
            cb.on_train_start(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for cb in self.inner:
            cb.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for cb in self.inner:
            cb.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.recorder is not None:
            out = Path(trainer.default_root_dir) / "steps.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(build.fit_result(self.recorder)))


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
                ts = _policy_spec(cfg.run_config, cfg.policy_id).policy(cfg.policy_id).trainer
                root = Path(cfg.trainer.get("default_root_dir") or os.getcwd())
                kwargs["logger"] = build.loggers(ts, root)
            return super().instantiate_trainer(**kwargs)

    return TrainCLI(DeployedPolicy, DeploymentData, args=args, run=run,
                    save_config_kwargs={"overwrite": True}, parser_kwargs={"prog": "astratk train"})
