"""How one update of a `PolicyModule` computes its loss: the whole batch in one forward, or cut into micro-batches
(`micro_batch_tokens`) whose gradients accumulate inside `training_step`, either as shares of the loss or, for a loss
with batch statistics, in two passes. Each way gives the unsplit step's loss, gradient and metrics; a new way of
splitting a step joins `_step` here and keeps that promise. Mixed into `PolicyModule` (`astratk.training.module`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from astratk.records import TrainBatch
from astratk.training.activations import auto_token_budget
from astratk.training.collate import micro_batches, place_rows, select_rows
from astratk.training.logprobs import PolicyForward
from astratk.training.prefix import micro_batches as shared_micro_batches
from astratk.training.prefix import plan as prefix_plan
from astratk.training.sharding import even_micro_batches, max_over_ranks


class MicroBatchSteps:
    """`PolicyModule`'s step variants; the forwards, loss terms and aggregation they call are its other mixins'."""

    micro_batch_tokens: int | str | None  # set by PolicyModule.__init__, as the next four
    _auto_tokens: int | None
    model: torch.nn.Module
    policy_id: str
    share_prompts: bool | None

    def _step(self, batch: TrainBatch, proximal: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """One update's loss (to back-propagate) and metrics on `batch`, whole or in micro-batches. `proximal`
        [B, T]: the proximal log-probs when the caller computed them before earlier updates (mini-batches)."""
        chunks = self._micro_batches(batch)
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

    def _micro_batches(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The step's micro-batches (row indices). An integer budget packs rows by padded tokens (`collate`). `auto`
        is worked out once, at the first step, from the model and the memory available
        (`astratk.training.activations`) and said in one line; a batch whose forward fits it runs whole, a larger one
        is cut into micro-batches of whole prompt groups by the tokens their shared-prompt passes run
        (`astratk.training.prefix.micro_batches`), so each still runs its prompts once."""
        if not isinstance(self.micro_batch_tokens, str):  # an integer, or None: one forward
            return micro_batches(batch, self.micro_batch_tokens)
        if self._auto_tokens is None:
            tokens, line = auto_token_budget(self.model, batch.input_ids.device)
            self._auto_tokens = tokens or 0
            lightning = getattr(self, "_trainer", None)  # None: a step run by hand (tests, benches)
            if lightning is None or lightning.is_global_zero:
                print(f"trainer {self.policy_id!r}: {line}", flush=True)
        rows, width = batch.input_ids.shape
        if not self._auto_tokens or rows * width <= self._auto_tokens:  # fits even padded: no plan to work out
            return [torch.arange(rows)]
        plan = None
        if self.share_prompts is not False:
            plan = prefix_plan(batch.input_ids, batch.attention_mask, batch.loss_mask)
        if plan is not None and round((1.0 - plan.saving) * rows * width) <= self._auto_tokens:
            return [torch.arange(rows)]
        return micro_batches(batch, self._auto_tokens) if plan is None else shared_micro_batches(plan,
                                                                                                 self._auto_tokens)

    def _whole_step(self, batch: TrainBatch, proximal: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The step in one forward: the loss to back-propagate, and the step's metrics."""
        if proximal is None and self.needs_proximal:  # [B, T], before the grad forward: the proximal policy
            proximal = self._no_grad_logprobs(self.model, batch)  # (`astratk.training.module`)
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
            for rows, fake in zip(chunks, dummy, strict=True):
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
                 for t, g in zip(leaves, torch.autograd.grad(loss, leaves, allow_unused=True), strict=True)]

        def surrogate(rows: torch.Tensor, part: TrainBatch, dummy: bool) -> torch.Tensor:
            outputs = _outputs(self._policy_forward(part))
            total = sum((out * g[rows, : out.shape[1]]).sum() for out, g in zip(outputs, grads, strict=True))
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
        for rows, fake in zip(chunks[:-1], dummy[:-1], strict=True):
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



def _detached(fwd: PolicyForward) -> PolicyForward:
    return PolicyForward(*(None if t is None else t.detach() for t in (fwd.logprobs, fwd.entropy, fwd.topk_logprobs)))


def _outputs(fwd: PolicyForward) -> list[torch.Tensor]:
    """The forward's outputs the loss can depend on (log π, entropy, top-K log π), in a fixed order."""
    return [t for t in (fwd.logprobs, fwd.entropy, fwd.topk_logprobs) if t is not None]
