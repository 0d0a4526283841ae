"""Policy losses: pure tensor code, one loss per file (installed as `astratk.losses`).

A loss maps per-token `LossInputs` (current log-probs, the engine's behaviour log-probs, advantages, loss mask,
optional per-token weights; all `[B, T]`) to `LossOutputs`: per-token losses already multiplied by the effective mask,
that mask, and detached scalar metrics. It never reduces over tokens: aggregation happens once, in the trainer
(`astratk.training.aggregation`), so every loss is compared under the same normalisation.

Adding a loss:

1. Write `losses/my_loss.py` with `class MyLoss(PolicyLoss)` (`astratk.contracts.PolicyLoss`). The constructor is the
   config: typed keyword arguments with the paper's defaults, validated there with the fix in the error message.
2. Implement `__call__(self, inputs: LossInputs) -> LossOutputs`. Anchor the ratio on the rollout engine's log-probs
   and clamp log r to [-20, 20] (docs/architecture.md, "Loss notation"); `_common` holds the few lines of ratio
   math losses share.
   Set `required_aggregation` only if the loss is meaningless under other modes (GSPO).
3. Add a short name in `astratk/registry.py` (`REGISTRY["loss"]`), e.g. `"my_loss": "astratk.losses.my_loss.MyLoss"`.
   User code does not need this: a config may name any loss by dotted path.
4. Test golden values with the derivation beside them, the paper's properties, and `torch.autograd.gradcheck`
   (`tests/unit/test_drpo.py` is the model).

Built-ins (docs/losses.md gives formula, source, defaults and YAML for each): `drpo.DRPO` (the default),
`dppo.DPPO` and its Binary-KL / Top-K TV / Top-K KL subclasses, `ppo_clip.PPOClip`, `pg_is.PGIS`, `cispo.CISPO`,
`spo.SPO`, `gspo.GSPO` / `GSPOToken` / `LUSPO`, `sapo.SAPO`, `m2po.M2PO` / `M2POClip`, `decoupled_ppo.DecoupledPPO`, `gpg.GPG`,
`gmpo.GMPO`, `cov.ClipCov` / `KLCov`, `dro.DRO`, `vespo.VESPO`. Mismatch corrections (`corrections.TIS`,
`corrections.MIS`) are `astratk.contracts.TokenCorrection`s the trainer applies before the loss.
"""
