"""`astratk train fit`: a LightningCLI trainer job for one policy that attaches to a running deployment.

    astratk deploy --config run.yaml --name sv                      # data layer + acquisition on a Dask cluster
    astratk train fit --run_config run.yaml --policy_id solver --deployment sv --scheduler tcp://host:8786
    astratk train fit ... --trainer.max_steps 50 --print_config     # any Lightning Trainer flag

The run config (the same RunSpec YAML as `astratk run`) says everything about the policy: its loss, learning rate,
aggregation, corrections, regularisers, steps and checkpoints; the deployment gives the model directory of version 0
and the data layer. So the model (`DeployedPolicy`) and data (`DeploymentData`) take only those four names, and
Trainer flags default to the policy's `trainer:` section (a flag given on the command line wins). Callbacks added to
every job: publish weights every `publish_every` steps, record per-step metrics (written to
`<default_root_dir>/steps.json` when the fit ends), a progress line, and checkpoints when `checkpoint_every` is set.
A multi-policy `astratk run` starts one such process per policy.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from astratk.training._pl import pl
from astratk.training.data import GroupStream, RolloutDataModule
from astratk.training.module import PolicyModule

_CLIENTS: dict[str | None, Any] = {}


def _client(scheduler: str | None, spec: Any, timeout_s: float = 60.0) -> Any:
    """One Dask client per scheduler in this process (None: the run config's `cluster.scheduler_address`, else the
    current default client), with the run config's `cluster.tls` certificates."""
    from distributed import Client, default_client

    from astratk.runtime.cluster import security

    scheduler = scheduler or spec.cluster.scheduler_address
    if scheduler is None:
        return default_client()
    if scheduler not in _CLIENTS:
        _CLIENTS[scheduler] = Client(scheduler, timeout=timeout_s, security=security(spec))  # default: actors
        #   fetched from a dataset find their client through it
    return _CLIENTS[scheduler]


def _policy_spec(run_config: str, policy_id: str) -> Any:
    from astratk.config import load_spec

    spec = load_spec(run_config, [])
    spec.policy(policy_id)  # KeyError naming the policies when it is not one of them
    return spec


class DeployedPolicy(PolicyModule):
    """`PolicyModule` built from a run config's policy and the deployment's model directory."""

    def __init__(self, run_config: str, policy_id: str = "main", deployment: str = "run", scheduler: str | None = None,
                 attach_timeout_s: float = 120.0) -> None:
        from astratk.runtime import registry

        spec = _policy_spec(run_config, policy_id)
        torch.set_num_threads(spec.cluster.torch_threads)
        info = registry.fetch(_client(scheduler, spec, attach_timeout_s), deployment, attach_timeout_s)
        p, ts = spec.policy(policy_id), spec.policy(policy_id).trainer
        super().__init__(info.ctx.model_paths[policy_id], p.loss, policy_id=policy_id, lr=ts.lr,
                         weight_decay=ts.weight_decay, temperature=spec.rollout.temperature,
                         aggregation=ts.aggregation, horizon=ts.horizon or spec.rollout.max_new_tokens,
                         corrections=p.corrections, kl_coef=ts.kl_coef, kl_estimator=ts.kl_estimator,
                         entropy_coef=ts.entropy_coef, micro_batch_tokens=ts.micro_batch_tokens)
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
        from transformers import AutoTokenizer

        from astratk.runtime import registry

        self.info, handle = registry.attach(_client(self.scheduler, self.spec, self.attach_timeout_s),
                                            self.deployment, self.attach_timeout_s)
        tokenizer = AutoTokenizer.from_pretrained(self.info.ctx.model_paths[self.policy_id])
        ts = self.spec.policy(self.policy_id).trainer
        trainer = self.trainer
        self.stream = GroupStream(handle, self.policy_id, tokenizer.pad_token_id, start_step=self._start_step,
                                  max_steps=trainer.max_steps if trainer is not None and trainer.max_steps > 0
                                  else ts.max_steps, timeout_s=ts.batch_timeout_s,
                                  rank=trainer.global_rank if trainer is not None else 0,
                                  world_size=trainer.world_size if trainer is not None else 1)

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() if self.stream is not None else {"next_step": self._start_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start_step = int(state["next_step"])
        if self.stream is not None:
            self.stream.start_step = self._start_step


class DeploymentCallbacks(pl.Callback):
    """Publishing, step records, progress and the steps.json file, built once the data module has attached."""

    def __init__(self, printer: Any = print) -> None:
        self.printer = printer
        self.inner: list[pl.Callback] = []
        self.recorder: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.inner:
            return
        from astratk.training.publish import WeightPublisher
        from astratk.training.recorder import ProgressPrinter, StepRecorder, StopFile
        from astratk.weights.store import WeightStore

        data = trainer.datamodule
        if not isinstance(data, DeploymentData):
            raise TypeError("DeploymentCallbacks needs the DeploymentData data module")
        spec = data.spec
        ts = spec.policy(data.policy_id).trainer
        store = WeightStore.from_spec(data.info.ctx.store_url, spec.weights)
        store.keep_last = spec.weights.keep_last  # each policy's trainer prunes its own versions
        self.recorder = StepRecorder(data.stream)
        self.inner = [WeightPublisher(store, data.stream.datalayer, data.policy_id, ts.publish_every), self.recorder,
                      StopFile(Path(trainer.default_root_dir) / "STOP")]
        if spec.progress and trainer.is_global_zero:
            self.inner.append(ProgressPrinter(self.recorder, printer=self.printer))
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
            stream = self.recorder.stream
            out.write_text(json.dumps({"rows": self.recorder.rows, "data_wait_s": stream.total_wait_s,
                                       "group_ids": stream.group_ids}))


def trainer_defaults(ts: Any) -> dict[str, tuple[Any, Any]]:
    """Trainer flag -> (Lightning's default, the value from the policy's `trainer:` section), applied to flags the
    command line left at Lightning's default."""
    return {"max_steps": (-1, ts.max_steps), "gradient_clip_val": (None, ts.grad_clip or None),
            "max_time": (None, {"seconds": math.ceil(ts.max_time_s)} if ts.max_time_s else None),  # ints only
            "num_sanity_val_steps": (None, 0), "log_every_n_steps": (None, 1),
            "enable_progress_bar": (None, False), "enable_model_summary": (None, False),
            "enable_checkpointing": (None, bool(ts.checkpoint_every))}


def train_cli(args: list[str] | None = None, run: bool = True) -> Any:
    """`astratk train fit ...` (LightningCLI; see the module docstring)."""
    from lightning.pytorch.cli import LightningCLI

    class TrainCLI(LightningCLI):
        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument("--run_config", required=True, help="the run's RunSpec YAML (as for astratk run)")
            parser.add_argument("--policy_id", default="main", help="the policy this job trains")
            parser.add_argument("--deployment", required=True, help="the deployment's name (astratk deploy --name)")
            parser.add_argument("--scheduler", default=None, help="the Dask scheduler's address")
            for target in ("model", "data"):
                for arg in ("run_config", "policy_id", "deployment", "scheduler"):
                    parser.link_arguments(arg, f"{target}.{arg}")

        def before_instantiate_classes(self) -> None:
            cfg = self.config[self.subcommand] if self.subcommand else self.config
            spec = _policy_spec(cfg.run_config, cfg.policy_id)
            ts = spec.policy(cfg.policy_id).trainer
            t = cfg.trainer
            for key, (unset, value) in trainer_defaults(ts).items():
                if t.get(key) == unset:
                    t[key] = value
            if ts.checkpoint_every and not t.get("callbacks"):
                from jsonargparse import Namespace

                t["callbacks"] = [Namespace(class_path="lightning.pytorch.callbacks.ModelCheckpoint", init_args=Namespace(
                    dirpath=str(Path(t.get("default_root_dir") or os.getcwd()) / "checkpoints" / cfg.policy_id),
                    filename="{step}", every_n_train_steps=ts.checkpoint_every, save_top_k=-1,
                    enable_version_counter=False))]

        def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
            from astratk.training.loggers import make_loggers

            extra = kwargs.setdefault("callbacks", [])
            extra.append(DeploymentCallbacks())
            cfg = self.config[self.subcommand] if self.subcommand else self.config
            if cfg.trainer.get("logger") in (None, True):  # not given: the policy's `trainer.loggers`
                ts = _policy_spec(cfg.run_config, cfg.policy_id).policy(cfg.policy_id).trainer
                root = Path(cfg.trainer.get("default_root_dir") or os.getcwd())
                kwargs["logger"] = make_loggers(ts.loggers, root, "lightning") or False
            return super().instantiate_trainer(**kwargs)

    return TrainCLI(DeployedPolicy, DeploymentData, args=args, run=run, save_config_kwargs={"overwrite": True},
                    parser_kwargs={"prog": "astratk train"})
