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
  one AdamW update each, inside one `training_step` (`_mini_batch_updates`); versions and `global_step` count
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
  losses with batch statistics: `_accumulated_step` and `_two_pass_step` say how. The metrics gain `micro_batches`.
  One optimiser step per data-layer step as before, so `trainer.global_step`, the data tickets and publishing count
  the same; Lightning still clips (`Trainer(gradient_clip_val=...)`) and steps, because this stays automatic
  optimisation: Lightning 2.6 rejects `gradient_clip_val` under manual optimisation, and the run builds its Trainer
  with it. The earlier micro-batches are back-propagated inside `training_step`, the last one by Lightning.

Data parallel (DDP): rank r trains on `groups[r::W]` of the step's batch. The step's loss
is L = (Σ_r S_r) / D, S_r = rank r's numerator (its sum of token losses for token-mean, of sequence values for the
seq-mean modes) and D = the count over *all* ranks (tokens or sequences). DDP averages gradients, (1/W) Σ_r ∇ℓ_r, so
each rank back-propagates ℓ_r = W · S_r / D and the average is ∇L. Normalising by the rank's own count D_r instead
(what a single-process step does) would give (1/W) Σ_r S_r / D_r, which is L only when every D_r is equal: not for
token-mean with ragged lengths, nor for an odd number of groups. The counts are all-reduced once per step (`_counts`).

Example:
    >>> from astratk.losses.drpo import DRPO
    >>> from astratk.losses.corrections import TIS
    >>> module = PolicyModule("path/to/hf_model", loss=DRPO(delta=0.5), lr=1e-3,
    ...                       corrections=[TIS(cap=2.0)], kl_coef=0.01,
    ...                       micro_batch_tokens=16384)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch

from astratk.contracts import LossInputs, PolicyLoss, TokenCorrection
from astratk.models.loading import load_causal_lm
from astratk.records import TrainBatch
from astratk.spec import LoraSpec, TrainerSpec
from astratk.training._pl import pl
from astratk.training.aggregation import aggregate
from astratk.training.collate import micro_batches, place_rows, select_rows
from astratk.training.data import EndOfStream
from astratk.training.logprobs import PolicyForward, policy_forward, token_logprobs
from astratk.training.prefix import PrefixPlan
from astratk.training.prefix import plan as prefix_plan
from astratk.training.regularizers import check_kl_estimator
from astratk.training.sharding import (
    clip_gradients,
    decoder_layer_classes,
    even_micro_batches,
    full_state_dict,
    is_sharded,
    max_over_ranks,
)
from astratk.training.step_inputs import (
    add_regularizers,
    apply_corrections,
    check_corrections,
    sum_over_ranks,
    topk_fields,
)

# The optimiser's and the loss terms' defaults are the run config's (`TrainerSpec`: what users
# configure), defined there once.
_TRAINER = TrainerSpec()


class PolicyModule(pl.LightningModule):
    def __init__(self, model_path: str, loss: PolicyLoss, *, policy_id: str = "main",
                 lr: float = _TRAINER.lr, weight_decay: float = _TRAINER.weight_decay,
                 temperature: float = 1.0, aggregation: str = _TRAINER.aggregation,
                 horizon: int | None = None, corrections: list[TokenCorrection] | None = None,
                 kl_coef: float = _TRAINER.kl_coef, kl_estimator: str = _TRAINER.kl_estimator,
                 reference_path: str | None = None, entropy_coef: float = _TRAINER.entropy_coef,
                 micro_batch_tokens: int | None = _TRAINER.micro_batch_tokens,
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
        if micro_batch_tokens is not None and not micro_batch_tokens >= 1:
            raise ValueError(f"micro_batch_tokens must be >= 1 (padded tokens per micro-batch) or None (the whole "
                             f"step's batch in one forward); got {micro_batch_tokens}")
        self.micro_batch_tokens = micro_batch_tokens
        if isinstance(updates_per_batch, bool) or not isinstance(updates_per_batch, int) or updates_per_batch < 1:
            raise ValueError(f"updates_per_batch must be an integer >= 1 (optimiser updates per data-layer batch); "
                             f"got {updates_per_batch!r}")
        self.updates_per_batch = updates_per_batch
        self._updated_earlier = False  # an earlier update of this step's batch changed the weights (see updates)
        # run each group's shared prompt once (`astratk.training.prefix`); None until checked on the first batch
        self.share_prompts: bool | None = None if share_prompts else False
        self.corrections, self.correction_names = check_corrections(corrections)
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

    def _step(self, batch: TrainBatch, proximal: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """One update's loss (to back-propagate) and metrics on `batch`, whole or in micro-batches. `proximal`
        [B, T]: the proximal log-probs when the caller computed them before earlier updates (mini-batches)."""
        chunks = micro_batches(batch, self.micro_batch_tokens)
        dummy = [False] * len(chunks)
        if self._sharded_root() is not None:  # FSDP: every rank runs the same number of forwards and backwards
            chunks, dummy = even_micro_batches(chunks, max_over_ranks(len(chunks), self.trainer.strategy))
        if len(chunks) == 1:
            loss, metrics = self._whole_step(batch, proximal)
        elif self.loss.batch_statistics:
            loss, metrics = self._two_pass_step(batch, chunks, dummy, proximal)
        else:
            loss, metrics = self._accumulated_step(batch, chunks, dummy, proximal)
        metrics["micro_batches"] = float(len(chunks))
        return loss, metrics

    def _mini_batch_updates(self, batch: TrainBatch) -> torch.Tensor:
        """`updates_per_batch` = k > 1 optimiser updates on one data-layer batch (PPO's mini-batches).

        The rows are cut into k contiguous slices (advantages are per sample, already computed by the data layer, so
        a group may straddle two slices). The proximal log-probs, when the loss or a correction needs them, come from
        one no-grad forward of every slice *before* the first update: pi_prox is the policy the batch started from,
        and pi / pi_prox drifts from 1 on the later slices, where a trust region on it binds. Slices 1..k-1 are
        updated here: backward, gradients averaged over ranks under DDP, the callbacks' `on_before_optimizer_step`
        (the divergence guard may skip one), clipping as Lightning clips, the optimiser step. The last slice's loss
        is returned, so Lightning updates it like any step's. The recorded metrics are the mean over the k updates.
        """
        k = min(self.updates_per_batch, len(batch))
        if self._distributed():  # every rank makes the same number of updates (each one all-reduces gradients)
            k = -max_over_ranks(-k, self.trainer.strategy)
        if self._sharded_root() is not None:
            raise ValueError("trainer.updates_per_batch > 1 is not supported under FSDP (each update would need its "
                             "own sharded optimiser step inside one Lightning step); use strategy ddp or one update")
        if self._trainer is not None and getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError("trainer.updates_per_batch > 1 is not supported with fp16 loss scaling (precision "
                             "16-mixed); use bf16-mixed or 32-true")
        slices = [select_rows(batch, rows) for rows in torch.arange(len(batch)).tensor_split(k)]
        proximal: list[torch.Tensor | None] = [None] * k
        if self.needs_proximal:
            proximal = [self._no_grad_logprobs(self.model, part) for part in slices]  # [b, t] each, at the start
        self._updated_earlier = False
        records: list[tuple[torch.Tensor, dict[str, Any]]] = []
        for part, prox in zip(slices[:-1], proximal[:-1]):
            loss, metrics = self._step(part, prox)
            self._backward(loss)
            self._update()
            records.append((self._loss_value(loss), metrics))
        loss, metrics = self._step(slices[-1], proximal[-1])
        records.append((self._loss_value(loss), metrics))
        mean = {key: sum(float(m[key]) for _, m in records if key in m) / sum(key in m for _, m in records)
                for key in dict.fromkeys(key for _, m in records for key in m)}
        mean["updates"] = float(k)
        self._record(batch, torch.stack([v.detach().float() for v, _ in records]).mean(), mean)
        return loss

    def _update(self) -> None:
        """One optimiser update inside `training_step` (mini-batches), with what Lightning does around its own:
        the gradients averaged over ranks (DDP; inside the step's forward the reducer does not), the callbacks'
        `on_before_optimizer_step` (the divergence guard), clipping, the step, zeroed gradients."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self._trainer is None:
            raise RuntimeError("updates_per_batch > 1 needs the module attached to a Lightning Trainer")
        trainer = self.trainer
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(trainer.world_size)
        optimizer = self.optimizers()
        raw = getattr(optimizer, "optimizer", optimizer)
        self.step_skipped = False
        for cb in trainer.callbacks:
            cb.on_before_optimizer_step(trainer, self, raw)
        skipped, self.step_skipped = self.step_skipped, False
        if not skipped:
            self.configure_gradient_clipping(raw, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
            raw.step()
            self._updated_earlier = True
        raw.zero_grad(set_to_none=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Mini-batches: the weights already changed in this step when an earlier update went through, so the step
        is published even if the guard skips its last update."""
        if self._updated_earlier:
            self.step_skipped = False
            self._updated_earlier = False

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
            raise ValueError(f"Trainer(accumulate_grad_batches={self.trainer.accumulate_grad_batches}): a PolicyModule "
                             "takes one data-layer batch per optimiser step; to cut a step's batch into pieces that fit "
                             "in memory set micro_batch_tokens (trainer.micro_batch_tokens in the run config)")

    # -------------------------------------------------------------------------------------------- step variants

    def _whole_step(self, batch: TrainBatch, proximal: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The step in one forward: the loss to back-propagate, and the step's metrics."""
        if proximal is None and self.needs_proximal:  # [B, T], before the grad forward: the proximal policy
            proximal = self._no_grad_logprobs(self.model, batch)  # (module docstring)
        fwd = self._policy_forward(batch)
        token_losses, mask, metrics = self._loss_terms(batch, fwd, proximal, self._reference_logprobs(batch))
        return self._aggregate(token_losses, mask), metrics

    def _accumulated_step(self, batch: TrainBatch, chunks: list[torch.Tensor], dummy: list[bool] | None = None,
                          given_proximal: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """Gradient accumulation for losses without batch statistics.

        A token's loss depends on its own sequence only (a loss that couples sequences declares `batch_statistics`),
        so each micro-batch's share of the step's loss is its part of the numerator over the *whole* batch's
        denominator, and the shares add up to the step's loss: the batch's sequence count for the seq-mean modes;
        for token-mean its count of effective-mask tokens, which is known only once the loss has seen every
        micro-batch (MIS, or a loss's own masking, can drop tokens). So the shares divide by the loss mask's token
        count, and after the last micro-batch the accumulated gradient and the last share are scaled by (loss-mask
        tokens / effective tokens), 1 unless a token left the denominator. The step's loss value and metrics come from
        one no-grad pass of the corrections, the loss and the regularisers over the whole batch's (detached) forward
        outputs, so they are the unsplit step's. A `dummy` micro-batch (FSDP: `even_micro_batches`) runs the same
        forwards and contributes zero.
        """
        counts = self._counts(batch.loss_mask)  # (tokens, sequences), over all ranks under DDP
        saved: list[tuple[torch.Tensor, PolicyForward, torch.Tensor | None, torch.Tensor | None]] = []

        def share(rows: torch.Tensor, part: TrainBatch, dummy: bool) -> torch.Tensor:
            if given_proximal is not None:  # [b, t] the rows of the proximal forward made before this step
                proximal = given_proximal[rows, : part.loss_mask.shape[1]]
            else:
                proximal = self._no_grad_logprobs(self.model, part) if self.needs_proximal else None  # [b, t]
            fwd, ref = self._policy_forward(part), self._reference_logprobs(part)
            token_losses, mask, _ = self._loss_terms(part, fwd, proximal, ref)
            if dummy:
                return self._aggregate(token_losses, mask, counts) * 0.0
            saved.append((rows, _detached(fwd), ref, proximal))
            return self._aggregate(token_losses, mask, counts)

        last = self._run_micro_batches(batch, chunks, share, dummy)
        with torch.no_grad():  # the whole batch's loss and metrics, from the outputs the micro-batches computed
            fwd, ref, proximal = self._assemble(batch, saved)
            token_losses, mask, metrics = self._loss_terms(batch, fwd, proximal, ref)
            effective = self._counts(mask)
            loss = self._aggregate(token_losses, mask, effective)
        if self.aggregation == "token-mean" and not torch.equal(counts[0], effective[0]):
            ratio = (counts[0].clamp_min(1.0) / effective[0].clamp_min(1.0)).to(last.dtype)  # [] loss-mask tokens /
            #   effective tokens
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(ratio.to(p.grad.dtype))
            last = last * ratio
        return last + (loss - last.detach()), metrics  # the last share's gradient, the step's loss value

    def _two_pass_step(self, batch: TrainBatch, chunks: list[torch.Tensor], dummy: list[bool] | None = None,
                       given_proximal: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batches for a loss with batch statistics (M2PO's second-moment cut): those need every token of the
        step in one loss call, so a micro-batch cannot compute its own share.

        1. A no-grad forward of each micro-batch gives log π (and entropy, top-K log π) for every row.
        2. The corrections, the loss and the regularisers run once on the whole batch with those outputs as leaf
           tensors: the step's loss L, its metrics, and dL/d(outputs) [B, T] by autograd.
        3. Each micro-batch's grad forward back-propagates Σ outputs · dL/d(outputs) over its rows: by the chain
           rule the gradients add up to dL/dθ, since L depends on θ only through the outputs and the weights do not
           change within the step.
        The price is one more no-grad forward per micro-batch; it is also the proximal forward (π_old is π at the
        step's weights), so a loss that needs π_old pays nothing extra.
        """
        saved = []
        dummy = dummy or [False] * len(chunks)
        with torch.no_grad():
            for rows, fake in zip(chunks, dummy):
                part = select_rows(batch, rows)
                outputs = (rows, self._policy_forward(part), self._reference_logprobs(part), None)
                if not fake:  # a dummy runs the forwards (FSDP's collectives) and is not kept
                    saved.append(outputs)
        fwd, ref, _ = self._assemble(batch, saved)
        proximal = given_proximal if given_proximal is not None else (  # [B, T] no-grad π at the step's weights
            fwd.logprobs.clone() if self.needs_proximal else None)
        leaves = [t.requires_grad_() for t in _outputs(fwd)]
        token_losses, mask, metrics = self._loss_terms(batch, fwd, proximal, ref)
        loss = self._aggregate(token_losses, mask)
        grads = [torch.zeros_like(t) if g is None else g  # [B, T] or [B, T, K] each
                 for t, g in zip(leaves, torch.autograd.grad(loss, leaves, allow_unused=True))]

        def surrogate(rows: torch.Tensor, part: TrainBatch, dummy: bool) -> torch.Tensor:
            outputs = _outputs(self._policy_forward(part))
            total = sum((out * g[rows, : out.shape[1]]).sum() for out, g in zip(outputs, grads))
            return total * 0.0 if dummy else total

        last = self._run_micro_batches(batch, chunks, surrogate, dummy)
        return last + (loss.detach() - last.detach()), metrics

    def _run_micro_batches(self, batch: TrainBatch, chunks: list[torch.Tensor],
                           contribution: Callable[[torch.Tensor, TrainBatch, bool], torch.Tensor],
                           dummy: list[bool] | None = None) -> torch.Tensor:
        """Back-propagate each micro-batch's contribution to the step's loss in turn, except the last one, which is
        returned for Lightning to back-propagate (with clipping and the optimiser step after it, as for any loss).
        `dummy[i]`: micro-batch i only keeps the ranks' collectives in step (FSDP) and contributes zero."""
        dummy = dummy or [False] * len(chunks)
        for rows, fake in zip(chunks[:-1], dummy[:-1]):
            self._backward(contribution(rows, select_rows(batch, rows), fake))
        return contribution(chunks[-1], select_rows(batch, chunks[-1]), dummy[-1])

    def _backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward inside `training_step`, through the strategy as `manual_backward` does, so a
        precision plugin scales it as it scales the returned loss. Under DDP this runs inside the DDP-wrapped
        forward, before the reducer expects gradients, so they accumulate locally; the one all-reduce happens in the
        backward of the returned loss and reads the accumulated `.grad`. Every rank thus issues the same collectives
        whatever its number of micro-batches."""
        if self._trainer is None:
            loss.backward()
        else:
            self.trainer.strategy.backward(loss, None)

    # ------------------------------------------------------------------------------------------- step pieces

    def _policy_forward(self, batch: TrainBatch) -> PolicyForward:
        topk_ids, _ = topk_fields(batch, self.loss)  # [B, T, K], or None
        return policy_forward(self.model, batch.input_ids, batch.attention_mask, self.temperature,
                              entropy=self.entropy_coef > 0, topk_ids=topk_ids, prefixes=self._prefixes(batch))

    def _prefixes(self, batch: TrainBatch) -> PrefixPlan | None:
        """The shared-prompt plan for `batch`, or None for the plain padded forward: sharing is off, the batch has
        nothing worth sharing, the model is sharded (FSDP gathers per forward), or the first check failed.

        The first batch that shares checks it once: log π of a few rows by both forwards, no grad. A model whose
        cache cannot be split per row (or that computes a prompt differently when continued from a cache) falls back
        to the padded forward for the rest of the run, with a warning that names the difference."""
        if self.share_prompts is False or self._sharded_root() is not None:
            return None
        plan = prefix_plan(batch.input_ids, batch.attention_mask, batch.loss_mask)
        if plan is not None and self.share_prompts is None:
            self.share_prompts = self._check_prefixes(batch, plan)
        return plan if self.share_prompts else None

    def _check_prefixes(self, batch: TrainBatch, plan: PrefixPlan) -> bool:
        rows = torch.nonzero(plan.owner == plan.owner[0]).flatten()[:3]  # one prompt's rows: they share it
        part = select_rows(batch, rows)
        small = prefix_plan(part.input_ids, part.attention_mask, part.loss_mask, min_saving=0.0)
        if small is None:
            return True  # nothing to compare on this batch: the next batch's plan is checked instead
        try:
            with torch.no_grad():
                plain = token_logprobs(self.model, part.input_ids, part.attention_mask, self.temperature)
                shared = token_logprobs(self.model, part.input_ids, part.attention_mask, self.temperature, small)
            trained = part.loss_mask > 0
            diff = float((plain - shared)[trained].abs().max())
        except Exception as e:  # noqa: BLE001 - any model whose cache cannot be split this way
            warnings.warn(f"trainer.share_prompts: {type(self.model).__name__} cannot continue a forward from a "
                          f"per-row prompt cache ({e!r}); using the padded forward", stacklevel=2)
            return False
        low = next(self.model.parameters()).dtype != torch.float32 or torch.is_autocast_enabled(part.input_ids.device.type)
        tolerance = 5e-2 if low else 1e-3  # bf16 arithmetic rounds the two orders of summation apart
        if not diff <= tolerance:
            warnings.warn(f"trainer.share_prompts: log-probs with the shared-prompt forward differ from the padded "
                          f"forward by {diff:.2e} (> {tolerance:g}) for {type(self.model).__name__}; using the padded "
                          "forward", stacklevel=2)
            return False
        return True

    def _loss_terms(self, batch: TrainBatch, fwd: PolicyForward, proximal: torch.Tensor | None,
                    ref: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Corrections, the loss and the regularisers: (token losses [B, T], effective mask [B, T], metrics)."""
        topk_ids, topk_mu = topk_fields(batch, self.loss)  # [B, T, K] each, or None
        inputs = LossInputs(logprobs=fwd.logprobs, behavior_logprobs=batch.behavior_logprobs,
                            advantages=batch.advantages, loss_mask=batch.loss_mask, weights=batch.weights,
                            proximal_logprobs=proximal, topk_ids=topk_ids, topk_behavior_logprobs=topk_mu,
                            topk_logprobs=fwd.topk_logprobs,
                            sampled_ids=None if topk_ids is None else batch.input_ids[:, 1:], reduce=self._reduce())
        inputs, metrics = apply_corrections(self.corrections, self.correction_names, inputs)
        out = self.loss(inputs)
        token_losses, term_metrics = add_regularizers(out.token_losses, out.mask, fwd.logprobs, ref_logprobs=ref,
                                                      kl_coef=self.kl_coef, kl_estimator=self.kl_estimator,
                                                      entropy=fwd.entropy, entropy_coef=self.entropy_coef)
        metrics.update({f"loss/{k}": v for k, v in out.metrics.items()})
        metrics.update(term_metrics)
        metrics.update(_pi_mu(fwd.logprobs, batch.behavior_logprobs, batch.loss_mask))
        return token_losses, out.mask, metrics

    def _aggregate(self, token_losses: torch.Tensor, mask: torch.Tensor,
                   counts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The loss this process back-propagates for these token losses (module docstring, "Data parallel").

        `counts` (tokens, sequences) are the denominators; None: this batch's, summed over ranks under DDP. In a
        single process without `counts` this is `aggregate` itself, bit for bit."""
        if counts is None and not self._distributed():
            return aggregate(token_losses, mask, self.aggregation, horizon=self.horizon)
        tokens, seqs = counts if counts is not None else self._counts(mask)
        world = self.trainer.world_size if self._distributed() else 1
        return world * aggregate(token_losses, mask, self.aggregation, horizon=self.horizon, global_tokens=tokens,
                                 global_seqs=seqs)

    def _counts(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask tokens, sequences) of this batch, summed over ranks under DDP: the aggregation denominators."""
        local = torch.stack([mask.detach().sum(dtype=torch.float64), torch.tensor(float(mask.shape[0]),
                                                                                  dtype=torch.float64,
                                                                                  device=mask.device)])
        total = sum_over_ranks(self.all_gather)(local) if self._distributed() else local
        return total[0], total[1]

    def _loss_value(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss for the metrics: the global batch's under DDP (each rank returns world x its share)."""
        if not self._distributed():
            return loss.detach()
        return sum_over_ranks(self.all_gather)(loss.detach() / self.trainer.world_size)

    def _assemble(self, batch: TrainBatch, saved: list) -> tuple[PolicyForward, torch.Tensor | None,
                                                                 torch.Tensor | None]:
        """Whole-batch [B, T] outputs from the micro-batches' (rows, forward, reference, proximal), detached."""
        n, t = batch.loss_mask.shape

        def whole(get: Callable[[Any], torch.Tensor | None]) -> torch.Tensor | None:
            if get(saved[0]) is None:
                return None
            return place_rows([(item[0], get(item).detach()) for item in saved], n, t)

        fwd = PolicyForward(logprobs=whole(lambda s: s[1].logprobs), entropy=whole(lambda s: s[1].entropy),
                            topk_logprobs=whole(lambda s: s[1].topk_logprobs))
        return fwd, whole(lambda s: s[2]), whole(lambda s: s[3])

    def _no_grad_logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        with torch.no_grad():
            return token_logprobs(model, batch.input_ids, batch.attention_mask, self.temperature,
                                  self._prefixes(batch))  # [B, T]

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """log π_ref [B, T] (no grad) when the KL term is on, else None. With LoRA and no `reference_path`, the
        reference is the base model: this model with its adapters switched off."""
        if self.reference is None and self.kl_coef > 0 and self.lora is not None:
            with self.model.disable_adapter():
                return self._no_grad_logprobs(self.model, batch)
        if self.reference is None:
            return None
        return self._no_grad_logprobs(self._reference_on(batch.input_ids.device), batch)

    def _reference_on(self, device: torch.device) -> torch.nn.Module:
        if next(self.reference.parameters()).device != device:
            self.reference.to(device)
        return self.reference

    def _distributed(self) -> bool:
        return self._trainer is not None and self.trainer.world_size > 1

    def _reduce(self) -> Any:
        """Sum over data-parallel ranks for losses with batch-wide statistics; None in a single process."""
        if not self.loss.batch_statistics or not self._distributed():
            return None
        return sum_over_ranks(self.all_gather)

    def _record(self, batch: TrainBatch, loss: torch.Tensor, extra_metrics: dict[str, Any]) -> None:
        mask = batch.loss_mask
        n_tokens = mask.sum().clamp_min(1)
        staleness = ((self.policy_version - batch.versions).clamp_min(0) * mask).sum() / n_tokens
        prefix = f"train/{self.policy_id}/"
        metrics = {
            "loss": loss.detach(),
            "reward_mean": batch.rewards.mean() if batch.rewards is not None else torch.tensor(float("nan")),
            "sequences": torch.tensor(float(len(batch))),
            "groups": torch.tensor(float(batch.n_groups)),
            "completion_tokens_mean": mask.sum(1).mean(),
            "staleness_mean": staleness,
            "staleness_max": ((self.policy_version - batch.versions) * mask).max().clamp_min(0),
            "policy_version": torch.tensor(float(self.policy_version)),
            "behavior_version_min": batch.versions.masked_fill(mask == 0, 2**62).min().float(),
            "behavior_version_max": batch.versions.masked_fill(mask == 0, -1).max().float(),
        }
        roles = sorted(set(batch.roles))
        if batch.rewards is not None and roles != ["policy"]:  # workflows: one reward curve per role
            for role in roles:
                rows = torch.tensor([r == role for r in batch.roles])
                metrics[f"reward_mean_{role}"] = batch.rewards[rows].mean()
        metrics.update({k: v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                        for k, v in extra_metrics.items()})
        self.step_metrics = {prefix + k: float(v) for k, v in metrics.items()}
        self.log_dict({prefix + k: v for k, v in metrics.items()}, batch_size=len(batch), on_step=True,
                      on_epoch=False, prog_bar=False)

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


def _detached(fwd: PolicyForward) -> PolicyForward:
    return PolicyForward(*(None if t is None else t.detach() for t in (fwd.logprobs, fwd.entropy, fwd.topk_logprobs)))


def _outputs(fwd: PolicyForward) -> list[torch.Tensor]:
    """The forward's outputs the loss can depend on (log π, entropy, top-K log π), in a fixed order."""
    return [t for t in (fwd.logprobs, fwd.entropy, fwd.topk_logprobs) if t is not None]


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


def _pi_mu(logprobs: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """|pi - mu| of the sampled tokens (probabilities at the rollout temperature; mean and max over the completion
    tokens), whatever the loss: the training-inference mismatch plus the policy's drift since each token's behaviour
    version (the mismatch alone at staleness 0)."""
    with torch.no_grad():
        on = mask > 0
        if not on.any():
            return {}
        diff = (logprobs.detach().exp() - behavior.exp()).abs()[on]
        return {"pi_mu_abs_mean": diff.mean(), "pi_mu_abs_max": diff.max()}
