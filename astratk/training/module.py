"""`PolicyModule`: the trainer of one policy. It knows a model, a loss and an optimiser; nothing about Dask or envs.

One step: recompute token log-probs at the rollout temperature (μ is the distribution sampled, so
log π comes from logits / T), call the loss, aggregate once (`astratk.training.aggregation`), step. The loss is any
`PolicyLoss` (DRPO by default), chosen by class path in the config.

Optional, all off by default (then the step is exactly the one above):
- **Proximal log-probs** π_old, when the loss (`needs_proximal`) or any correction asks: a no-grad forward at the
  step's weights before the grad forward (micro-batches see the same weights). This is the proximal policy π_old:
  tokens carry per-token weight versions, so π at each token's exact rollout weights would take one forward per
  version and is impractical. With one update per batch π = π_old in value; with `updates_per_batch` > 1 it is the
  policy the batch started from, computed once before the first update.
- **Several updates per batch** (`updates_per_batch`, PPO's mini-batches): the batch's rows are cut into k slices,
  one AdamW update each, inside one `training_step` (`astratk.training.updates`); versions and `global_step` count
  batches.
- **Mismatch corrections** (`corrections`, `astratk.losses.corrections`), in order: weights *= w, loss_mask *= keep.
- **Top-K log-probs** for a loss with `needs_topk`: log π at the engine's top-K ids, from the same logits.
- **KL to a frozen reference** (`kl_coef` > 0; the reference is `reference_path`, default the starting model, loaded
  only then) and an **entropy bonus** (`entropy_coef` > 0): added to the per-token losses under the loss's mask
  before aggregation; reported as `kl_ref_mean`, `entropy_mean`.
- **LoRA** (`lora`, a `LoraSpec`): PEFT adapters on the frozen model (`astratk.models.lora.add_lora`); the optimiser
  sees the adapters only, `weights()` and the publisher hand out the adapter tensors only, checkpoints hold the
  adapters (not the frozen base), and the KL reference is the same model with its adapters switched off (PEFT's
  `disable_adapter()`: no second copy).
- **Batch statistics under DDP**: a loss with `batch_statistics` gets `reduce` = sum over ranks.
- **Micro-batches** (`micro_batch_tokens`): one optimiser step's batch is cut into micro-batches of at most that many
  padded tokens (rows x longest row; `astratk.training.collate.micro_batches`) and their gradients accumulate inside
  one `training_step`, so activation memory scales with the budget, not the batch. The step's loss, gradient and
  metrics are the unsplit step's (to fp32 round-off) for every aggregation mode, corrections, regularisers and
  losses with batch statistics: `astratk.training.micro_steps` says how. The metrics gain `micro_batches`.
  One optimiser step per data-layer step as before, so `trainer.global_step`, the data tickets and publishing count
  the same; Lightning still clips (`Trainer(gradient_clip_val=...)`) and steps, because this stays automatic
  optimisation: Lightning 2.6 rejects `gradient_clip_val` under manual optimisation, and the run builds its Trainer
  with it. The earlier micro-batches are back-propagated inside `training_step`, the last one by Lightning.
  The default, `auto`, sizes the budget at the first step from the model's widths and the memory available
  (`astratk.training.activations`) and runs a batch whole when it fits; None always runs one forward.

Data parallel (DDP): rank r trains on `groups[r::W]` of the step's batch. The step's loss
is L = (Σ_r S_r) / D, S_r = rank r's numerator (its sum of token losses for token-mean, of sequence values for the
seq-mean modes) and D = the count over *all* ranks (tokens or sequences). DDP averages gradients, (1/W) Σ_r ∇ℓ_r, so
each rank back-propagates ℓ_r = W · S_r / D and the average is ∇L. Normalising by the rank's own count D_r instead
(what a single-process step does) would give (1/W) Σ_r S_r / D_r, which is L only when every D_r is equal: not for
token-mean with ragged lengths, nor for an odd number of groups. The counts are all-reduced once per step (`_counts`).

Where the step's pieces are (each a mixin of `PolicyModule`): the forwards in `astratk.training.forwards`, the loss
terms and their aggregation in `astratk.training.loss_terms`, whole and micro-batched steps in
`astratk.training.micro_steps`, several updates per batch in `astratk.training.updates`, the step's metrics in
`astratk.training.step_metrics`. This module holds the model: its set-up, LoRA and FSDP, checkpoints, the optimiser.

Example:
    >>> from astratk.losses.drpo import DRPO
    >>> from astratk.losses.corrections import TIS
    >>> module = PolicyModule("path/to/hf_model", loss=DRPO(delta=0.5), lr=1e-3,
    ...                       corrections=[TIS(cap=2.0)], kl_coef=0.01,
    ...                       micro_batch_tokens=16384)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from astratk.contracts import PolicyLoss, TokenCorrection, check_double_weighting
from astratk.models.loading import load_causal_lm
from astratk.records import TrainBatch
from astratk.spec import LoraSpec, TrainerSpec
from astratk.spec.trainer import check_micro_batch_tokens
from astratk.training._pl import pl
from astratk.training.data import EndOfStream
from astratk.training.forwards import PolicyForwards
from astratk.training.loss_terms import LossTerms
from astratk.training.micro_steps import MicroBatchSteps
from astratk.training.regularizers import check_kl_estimator
from astratk.training.sharding import clip_gradients, decoder_layer_classes, full_state_dict, is_sharded
from astratk.training.step_inputs import check_corrections
from astratk.training.step_metrics import StepMetrics
from astratk.training.updates import BatchUpdates

# The optimiser's and the loss terms' defaults are the run config's (`TrainerSpec`: what users
# configure), defined there once.
_TRAINER = TrainerSpec()


# The step's pieces are mixins, listed before LightningModule so that their hooks (on_before_optimizer_step) override
# its defaults. No class docstring, as before: `astratk train fit --help` (LightningCLI) would show it.
class PolicyModule(BatchUpdates, MicroBatchSteps, PolicyForwards, LossTerms, StepMetrics, pl.LightningModule):
    def __init__(self, model_path: str, loss: PolicyLoss, *, policy_id: str = "main",
                 lr: float = _TRAINER.lr, weight_decay: float = _TRAINER.weight_decay,
                 temperature: float = 1.0, aggregation: str = _TRAINER.aggregation,
                 horizon: int | None = None, corrections: list[TokenCorrection] | None = None,
                 kl_coef: float = _TRAINER.kl_coef, kl_estimator: str = _TRAINER.kl_estimator,
                 reference_path: str | None = None, entropy_coef: float = _TRAINER.entropy_coef,
                 micro_batch_tokens: int | Literal["auto"] | None = "auto",
                 lora: LoraSpec | dict[str, Any] | None = None,
                 share_prompts: bool = _TRAINER.share_prompts,
                 updates_per_batch: int = _TRAINER.updates_per_batch) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["loss", "corrections", "lora"])
        self.lora = LoraSpec(**lora) if isinstance(lora, dict) else lora
        if self.lora is not None:
            self.lora.validate("lora")
        self.hparams["lora"] = None if self.lora is None else dataclasses.asdict(self.lora)  # plain values: a
        #   checkpoint's hyper-parameters load with torch.load(weights_only=True) (the export reads them)
        if not (kl_coef >= 0 and entropy_coef >= 0):
            raise ValueError(f"kl_coef and entropy_coef must be >= 0 (0 turns the term off); got kl_coef={kl_coef}, "
                             f"entropy_coef={entropy_coef}")
        check_micro_batch_tokens(micro_batch_tokens, "micro_batch_tokens")
        self.micro_batch_tokens = micro_batch_tokens
        self._auto_tokens: int | None = None  # micro_batch_tokens auto, resolved at the first step (micro_steps)
        if isinstance(updates_per_batch, bool) or not isinstance(updates_per_batch, int) or updates_per_batch < 1:
            raise ValueError(f"updates_per_batch must be an integer >= 1 (optimiser updates per data-layer batch); "
                             f"got {updates_per_batch!r}")
        self.updates_per_batch = updates_per_batch
        self._updated_earlier = False  # an earlier update of this step's batch changed the weights (see updates)
        # run each group's shared prompt once (`astratk.training.prefix`); None until checked on the first batch
        self.share_prompts: bool | None = None if share_prompts else False
        self.corrections, self.correction_names = check_corrections(corrections)
        check_double_weighting(loss, self.corrections)
        self.kl_coef, self.kl_estimator = float(kl_coef), check_kl_estimator(kl_estimator)
        self.entropy_coef = float(entropy_coef)
        model = load_causal_lm(model_path, torch.float32)
        _disable_dropout(model)  # before the adapters: their dropout is the one `lora` configures
        if self.lora is not None:
            from astratk.models.lora import add_lora

            model = add_lora(model, self.lora, "lora")
            self.strict_loading = False  # checkpoints hold the adapters only (on_save_checkpoint)
        self.model = model
        self.model.train()  # from_pretrained returns eval mode; Lightning warns about eval-mode modules in fit
        reference = None
        if self.kl_coef > 0 and (self.lora is None or reference_path is not None):
            reference = load_causal_lm(reference_path or model_path, torch.float32).eval().requires_grad_(False)
        # Why not a submodule: it would be switched to train mode by fit, counted by Lightning's eval-mode warning,
        # saved in checkpoints and broadcast by DDP; it is frozen and loaded the same on every rank, so it is kept
        # outside the module tree and moved to the batch's device on first use (`_reference_on`).
        object.__setattr__(self, "reference", reference)
        self.loss = loss
        self.needs_proximal = bool(loss.needs_proximal or any(c.needs_proximal for c in self.corrections))
        self.policy_id = policy_id
        self.lr, self.weight_decay = lr, weight_decay
        self.temperature = temperature
        self.aggregation = loss.required_aggregation or aggregation
        self.horizon = horizon
        self.policy_version = 0  # the version of the weights being trained from; set by the publish callback
        self.step_metrics: dict[str, float] = {}  # last step's metrics, read by callbacks (progress, recorder)
        # the divergence guard discarded this step's update (`astratk.training.divergence`): nothing to publish
        self.step_skipped = False

    def weights(self) -> dict[str, torch.Tensor]:
        """The HF model's state (keys as in the saved model directory), detached copies for publication; with LoRA,
        the adapter tensors alone (keys as in a saved PEFT adapter)."""
        root = self._sharded_root()
        state = None
        if root is not None:  # FSDP: every rank joins the gather; rank 0 receives the whole state, the others {}
            state = full_state_dict(root, prefix="model.")
            if not state:
                return {}
        if self.lora is not None:
            from astratk.models.lora import adapter_state

            return adapter_state(self.model, state)
        return state if state is not None else {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _sharded_root(self) -> torch.nn.Module | None:
        """The strategy's wrapped model when the trainer shards it (FSDP), else None."""
        if self._trainer is None:
            return None
        root = self.trainer.strategy.model
        return root if root is not None and is_sharded(root) else None

    def setup(self, stage: str) -> None:
        """Under Lightning's `FSDPStrategy` given by name (`trainer.strategy: fsdp`), wrap each decoder layer as one
        FSDP unit (the model's `_no_split_modules`, e.g. `Qwen2DecoderLayer`) and keep the original parameters (LoRA
        freezes some of them, and FSDP1 flattens only uniformly frozen ones otherwise); a strategy object the user
        configured keeps its own choices."""
        from lightning.pytorch.strategies import FSDPStrategy

        strategy = self.trainer.strategy if self._trainer is not None else None
        if not isinstance(strategy, FSDPStrategy):
            return
        layers = decoder_layer_classes(self.model)
        if layers and strategy.kwargs.get("auto_wrap_policy") is None:
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            strategy.kwargs["auto_wrap_policy"] = ModuleWrapPolicy(layers)
        strategy.kwargs.setdefault("use_orig_params", True)

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Norm clipping over every shard under FSDP (Lightning's FSDP precision plugin refuses it), Lightning's own
        clipping otherwise. The norm before clipping is reported as `train/<policy>/grad_norm` under FSDP."""
        root = self._sharded_root()
        if root is None or not gradient_clip_val:
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                                gradient_clip_algorithm=gradient_clip_algorithm)
            return
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"gradient_clip_algorithm {gradient_clip_algorithm!r} under FSDP: only norm clipping "
                             "is supported (trainer.grad_clip)")
        self.step_metrics[f"train/{self.policy_id}/grad_norm"] = float(clip_gradients(root, float(gradient_clip_val)))

    def training_step(self, batch: TrainBatch, batch_idx: int) -> torch.Tensor:
        if self._trainer is not None:  # see optimizer_zero_grad
            self.zero_grad(set_to_none=True)
        if self.updates_per_batch > 1:
            return self._mini_batch_updates(batch)
        loss, metrics = self._step(batch)
        self._record(batch, self._loss_value(loss), metrics)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """-1 (Lightning: end the epoch, and so the fit, whose `should_stop` is set) when the data stream ended
        instead of giving this step a batch (`astratk.training.data.EndOfStream`)."""
        self.step_skipped = False
        return -1 if isinstance(batch, EndOfStream) else None

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """A no-op: `training_step` zeroes the gradients when it starts. Lightning calls this hook after
        `training_step` and before the backward of the loss it returned, when the gradients already hold the step's
        earlier micro-batches."""

    def on_fit_start(self) -> None:
        if self.trainer.accumulate_grad_batches != 1:
            raise ValueError(f"Trainer(accumulate_grad_batches={self.trainer.accumulate_grad_batches}): a "
                             "PolicyModule takes one data-layer batch per optimiser step; to cut a step's batch into "
                             "pieces that fit in memory set micro_batch_tokens (trainer.micro_batch_tokens in the run "
                             "config)")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["astratk"] = {"policy_id": self.policy_id, "policy_version": self.policy_version}
        if self.lora is not None:  # the frozen base is the model directory's: keep the adapters only
            trained = self._trained_keys()
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trained}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("astratk", {})
        if saved.get("policy_id", self.policy_id) != self.policy_id:
            raise ValueError(f"checkpoint is of policy {saved['policy_id']!r}, not {self.policy_id!r}")
        if self.lora is not None and (missing := sorted(self._trained_keys() - set(checkpoint["state_dict"]))):
            raise ValueError(f"the checkpoint lacks {len(missing)} adapter tensors of this LoRA trainer, e.g. "
                             f"{missing[:2]}: it was written without LoRA or with other model.lora settings")
        self.policy_version = int(saved.get("policy_version", checkpoint.get("global_step", 0)))

    def _trained_keys(self) -> set[str]:
        return {f"model.{name}" for name, p in self.model.named_parameters() if p.requires_grad}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # with LoRA only the adapters require grad; otherwise every parameter does (the same list as before)
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.lr,
                                 weight_decay=self.weight_decay, betas=(0.9, 0.99))


def _disable_dropout(model: torch.nn.Module) -> None:
    """Ratios compare log-probs from separate forwards (engine, proximal, gradient); dropout noise would make r != 1
    on-policy and bias every trust region. HF attention reads its rate from the config at call time."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "dropout"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
