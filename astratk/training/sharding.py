"""What a sharded trainer (FSDP) needs from `PolicyModule`: full weights to publish, clipping over all shards, and the
same number of micro-batches on every rank.

Why each:
- **Publishing.** Under FSDP each rank holds a shard of every parameter (FSDP1 flattens them into `FlatParameter`s,
  FSDP2 makes them `DTensor`s), so `model.state_dict()` is not the weights a rollout engine loads. `full_state_dict`
  gathers them with `torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True,
  cpu_offload=True)`, which works for FSDP1, FSDP2, DDP and plain modules alike and returns the model's own names
  (no wrapper prefixes). It is a collective: every rank calls it; only rank 0 receives the tensors (the others get an
  empty dict) and writes them.
- **Clipping.** The gradient norm must be taken over every shard. Lightning 2.6's FSDP precision plugin refuses
  norm clipping outright; FSDP1's root module has `clip_grad_norm_`, which all-reduces the shards' norms; FSDP2's
  `DTensor` gradients make `torch.nn.utils.clip_grad_norm_` reduce across ranks by itself.
- **Micro-batches.** FSDP all-gathers parameters in every forward and reduce-scatters gradients in every backward: a
  rank that runs fewer micro-batches than another leaves it waiting in a collective forever. `even_micro_batches`
  takes the largest count over ranks and cuts every rank's rows into that many (splitting its largest micro-batches
  first); a rank with fewer rows than that repeats a row with zero weight, so its gradient is unchanged.

The gather was checked on this CPU with FSDP2 over gloo (2 processes): rank 0 gets every tensor equal to the unsharded
model's, rank 1 an empty dict (tests/unit/test_sharding.py). Lightning's `FSDPStrategy` itself refuses a CPU
accelerator and FSDP1 needs one, so the Lightning path is exercised on a GPU only (tests/gpu/, bench/gpu_suite.py).
"""

from __future__ import annotations

from typing import Any

import torch


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` (or a module inside it) is FSDP-wrapped: FSDP1 modules, or FSDP2's DTensor parameters."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without distributed
        return False
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's whole state with its own parameter names, as detached copies: gathered from every rank onto rank
    0's CPU when sharded (a collective: call it on every rank; ranks other than 0 get {}), else `state_dict()`
    copied. With `prefix` (e.g. "model." for the HF model inside a LightningModule), only the keys under it, with the
    prefix removed."""
    if not is_sharded(model):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        state = {_hf_name(k): v.detach() for k, v in state.items()}
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def decoder_layer_classes(model: torch.nn.Module) -> set[type[torch.nn.Module]]:
    """The classes of `model`'s repeated blocks, the natural FSDP units: transformers names them in
    `_no_split_modules` (e.g. `Qwen2DecoderLayer`); a PEFT model is looked through."""
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def _hf_name(key: str) -> str:
    """Strip wrapper prefixes that a wrapped submodule can leave in a name (activation checkpointing, FSDP1)."""
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        key = key.replace(prefix, "")
    return key


def clip_gradients(root: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients of `root` (the strategy's wrapped model) to total norm `max_norm` over every shard; returns
    the norm before clipping, equal on every rank."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        FullyShardedDataParallel = ()  # type: ignore[assignment,misc]
    if isinstance(root, FullyShardedDataParallel):
        return root.clip_grad_norm_(max_norm)
    norm = torch.nn.utils.clip_grad_norm_([p for p in root.parameters() if p.grad is not None], max_norm)
    full = getattr(norm, "full_tensor", None)  # FSDP2: a replicated DTensor
    return full() if callable(full) else norm


def even_micro_batches(chunks: list[torch.Tensor], count: int) -> tuple[list[torch.Tensor], list[bool]]:
    """`chunks` (row indices per micro-batch) cut into exactly `count` >= len(chunks) micro-batches, and for each
    whether it is a zero-weight repeat (a rank with fewer rows than `count` repeats its first row, contributing
    nothing). The largest micro-batch is split in halves first, so the cut stays close to the token budget."""
    if count < len(chunks):
        raise ValueError(f"cannot cut {len(chunks)} micro-batches into fewer ({count})")
    out = [c for c in chunks if len(c)]
    while len(out) < count and any(len(c) > 1 for c in out):
        i = max(range(len(out)), key=lambda j: len(out[j]))
        big = out.pop(i)
        half = (len(big) + 1) // 2
        out[i:i] = [big[:half], big[half:]]
    dummy = [False] * len(out)
    if len(out) < count:  # fewer rows than micro-batches: repeat one row with zero weight
        if not out:
            raise ValueError("a rank has no rows in this step's batch; give groups_per_step >= the number of ranks")
        filler = out[0][:1]
        dummy += [True] * (count - len(out))
        out += [filler] * (count - len(out))
    return out, dummy


def max_over_ranks(value: int, strategy: Any) -> int:
    """The largest `value` over the data-parallel ranks of a Lightning `strategy` (itself in one process)."""
    if strategy is None or getattr(strategy, "world_size", 1) <= 1:
        return value
    t = torch.tensor(float(value), device=strategy.root_device)
    return int(strategy.reduce(t, reduce_op="max").item())
