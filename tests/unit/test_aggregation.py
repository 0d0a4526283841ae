"""The one aggregation place: hand-computed values per mode, empty sequences, DDP denominators."""

import pytest
import torch

from astratk.training.aggregation import AGGREGATIONS, aggregate, check_aggregation

# seq 0: losses 1, 2, 3 on 3 tokens (sum 6, n 3); seq 1: loss 4 on 1 token (sum 4, n 1); seq 2: empty (sum 0, n 0)
LOSSES = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])

GOLDEN = {
    "token-mean": (6 + 4) / 4,  # 2.5: 10 over 4 tokens
    "seq-mean-token-mean": (6 / 3 + 4 / 1 + 0) / 3,  # 2.0; the empty sequence counts (verl's exclusion would give 3.0)
    "seq-mean-token-sum": (6 + 4 + 0) / 3,  # 3.3333
    "seq-mean-token-sum-norm": (6 / 4 + 4 / 4 + 0) / 3,  # 0.8333 with H = 4
    "token-sum": 6 + 4,  # 10: no normaliser at all
}


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_hand_computed_values_with_empty_sequence(mode):
    value = aggregate(LOSSES, MASK, mode, horizon=4)
    assert value.dim() == 0 and value.item() == pytest.approx(GOLDEN[mode])


def test_horizon_is_the_configured_length_not_the_batch_width():
    # H = 8 (max completion length) while the batch is padded to 4: (6/8 + 4/8 + 0) / 3
    assert aggregate(LOSSES, MASK, "seq-mean-token-sum-norm", horizon=8).item() == pytest.approx(10 / 24)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_all_zero_mask_gives_zero_not_nan(mode):
    value = aggregate(torch.zeros(2, 3), torch.zeros(2, 3), mode, horizon=3)
    assert value.item() == 0.0


def test_global_denominators():
    assert aggregate(LOSSES, MASK, "token-mean", global_tokens=8).item() == pytest.approx(10 / 8)
    assert aggregate(LOSSES, MASK, "seq-mean-token-sum", global_seqs=torch.tensor(6)).item() == pytest.approx(10 / 6)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_ddp_split_with_global_counts_reproduces_full_batch(mode):
    # two "ranks" of 2 and 1 sequences (uneven on purpose); each passes the all-reduced counts and scales by world
    # size 2; DDP averages gradients, so the full-batch value is the mean over ranks of world_size * rank value.
    losses, mask = torch.cat([LOSSES, LOSSES[:1]]), torch.cat([MASK, MASK[:1]])  # 4 sequences, 7 tokens
    full = aggregate(losses, mask, mode, horizon=4)
    parts = [(losses[:2], mask[:2]), (losses[2:], mask[2:])]
    world, tokens, seqs = 2, mask.sum(), losses.shape[0]
    ranks = [world * aggregate(l, m, mode, horizon=4, global_tokens=tokens, global_seqs=seqs) for l, m in parts]
    assert (sum(ranks) / world).item() == pytest.approx(full.item())


def test_token_sum_gradient_is_one_per_token_and_grows_with_the_batch():
    raw = LOSSES.clone().requires_grad_()
    aggregate(raw * MASK, MASK, "token-sum").backward()
    torch.testing.assert_close(raw.grad, MASK)  # every loss token weighs 1, whatever its sequence's length
    doubled = aggregate(torch.cat([LOSSES, LOSSES]), torch.cat([MASK, MASK]), "token-sum")
    assert doubled.item() == 2 * GOLDEN["token-sum"]  # unlike every mean mode


def test_gradient_flows_with_mode_weights():
    raw = torch.full_like(LOSSES, 5.0).requires_grad_()  # a loss's per-token values, then masked (LossOutputs contract)
    aggregate(raw * MASK, MASK, "seq-mean-token-mean").backward()
    # d/dl_it = m_it / (n_i * N): seq 0 tokens 1/9, seq 1 token 1/3, padding and the empty sequence 0
    expected = torch.tensor([[1 / 9, 1 / 9, 1 / 9, 0.0], [1 / 3, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(raw.grad, expected)


@pytest.mark.parametrize("horizon", [None, 0])
def test_norm_mode_needs_horizon(horizon):
    with pytest.raises(ValueError, match="needs horizon"):
        aggregate(LOSSES, MASK, "seq-mean-token-sum-norm", horizon=horizon)


def test_unknown_mode_lists_choices():
    with pytest.raises(ValueError, match="unknown aggregation 'token_sum'") as info:
        check_aggregation("token_sum")
    assert all(mode in str(info.value) for mode in AGGREGATIONS)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate(LOSSES, MASK[:, :3], "token-mean")
