"""Several optimiser updates per data-layer batch (`trainer.updates_per_batch`, PPO's mini-batches): k updates in one
Lightning step are the k one-update steps on the batch's row slices (AdamW state, clipping and micro-batches
included), the proximal policy is the batch's starting policy on every slice, and the setting is validated."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses.decoupled_ppo import DecoupledPPO
from astratk.losses.drpo import DRPO
from astratk.spec import TrainerSpec
from astratk.training.collate import select_rows
from astratk.training.logprobs import token_logprobs
from astratk.training.module import PolicyModule
from tests.unit.test_micro_batch import BUDGET, H, make_batch, model_path  # noqa: F401 (model_path: a fixture)


def fit(path, batches, *, loss=None, updates=1, budget=None, clip=0.05, lr=3e-3):
    torch.manual_seed(0)
    module = PolicyModule(path, loss or DRPO(delta=0.5), lr=lr, horizon=H, micro_batch_tokens=budget,
                          updates_per_batch=updates)
    seen = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((trainer.global_step, dict(pl_module.step_metrics)))

    trainer = pl.Trainer(max_steps=len(batches), accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
                         callbacks=[Watch()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None, collate_fn=lambda x: x))
    return module, {n: p.detach().clone() for n, p in module.model.named_parameters()}, seen


def slices(batch, k):
    return [select_rows(batch, rows) for rows in torch.arange(len(batch)).tensor_split(k)]


@pytest.mark.parametrize("k, budget", [(2, None), (3, None), (2, BUDGET)])
def test_k_updates_in_one_step_are_k_one_update_steps(model_path, k, budget):  # noqa: F811
    batch = make_batch(model_path)
    _, together, seen = fit(model_path, [batch], updates=k, budget=budget)
    _, apart, _ = fit(model_path, slices(batch, k), updates=1, budget=budget)
    # AdamW (its state carries over between updates) and clipping at 0.05 (it binds: see below) agree to round-off
    assert max((together[n] - apart[n]).abs().max().item() for n in together) < 1e-6
    (step, metrics), = seen
    assert step == 1 and metrics["train/main/updates"] == float(k)  # one Lightning step, versions count batches
    _, one_update, _ = fit(model_path, [batch], updates=1, budget=budget)
    assert max((together[n] - one_update[n]).abs().max().item() for n in together) > 1e-4  # k updates differ


def test_unclipped_differs_so_the_intermediate_updates_are_clipped(model_path):  # noqa: F811
    batch = make_batch(model_path)
    _, clipped, _ = fit(model_path, [batch], updates=2, clip=0.05)
    _, free, _ = fit(model_path, [batch], updates=2, clip=None)
    _, free_apart, _ = fit(model_path, slices(batch, 2), updates=1, clip=None)
    assert max((clipped[n] - free[n]).abs().max().item() for n in free) > 1e-4
    assert max((free[n] - free_apart[n]).abs().max().item() for n in free) < 1e-6


class Spy(PolicyLoss):
    """DecoupledPPO that keeps what the trainer handed it."""

    needs_proximal = True

    def __init__(self):
        self.inner, self.calls = DecoupledPPO(), []

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        self.calls.append((inputs.logprobs.detach().clone(), inputs.proximal_logprobs.clone()))
        return self.inner(inputs)


def test_the_proximal_policy_is_the_batch_start_on_every_slice(model_path):  # noqa: F811
    batch = make_batch(model_path)
    parts = slices(batch, 2)
    start = PolicyModule(model_path, DRPO(), horizon=H).model
    with torch.no_grad():
        expected = [token_logprobs(start, p.input_ids, p.attention_mask, 1.0) for p in parts]
    spy = Spy()
    _, _, seen = fit(model_path, [batch], loss=spy, updates=2, lr=3e-2)
    (lp0, prox0), (lp1, prox1) = spy.calls
    mask0, mask1 = parts[0].loss_mask.bool(), parts[1].loss_mask.bool()
    torch.testing.assert_close(prox0[mask0], expected[0][mask0])
    torch.testing.assert_close(prox1[mask1], expected[1][mask1])  # not the weights after the first update
    torch.testing.assert_close(lp0[mask0], prox0[mask0])  # first slice: pi = pi_prox
    assert (lp1[mask1] - prox1[mask1]).abs().max().item() > 1e-3  # second slice: the policy moved since
    assert seen[0][1]["train/main/loss/proximal_ratio_max"] > 1.0


def test_updates_per_batch_is_validated(model_path):  # noqa: F811
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="updates_per_batch must be an integer >= 1"):
            PolicyModule(model_path, DRPO(), horizon=H, updates_per_batch=bad)
        # a wrong type fails at construction (astratk.coerce), a wrong value in validate: both name the key and want
        with pytest.raises(ValueError, match=r"trainer\.updates_per_batch(: expected an integer| must be an integer >= 1)"):
            TrainerSpec(updates_per_batch=bad).validate()
    TrainerSpec(updates_per_batch=4).validate()


def test_more_updates_than_rows_uses_one_row_each(model_path):  # noqa: F811
    batch = make_batch(model_path)
    _, _, seen = fit(model_path, [batch], updates=len(batch) + 5)
    assert seen[0][1]["train/main/updates"] == float(len(batch))
