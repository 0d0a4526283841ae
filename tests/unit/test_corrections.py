"""Mismatch corrections TIS and MIS/IcePop: golden values per level, denominators, composition."""

import math

import pytest
import torch

from astratk.contracts import LossInputs
from astratk.losses.corrections import MIS, TIS, TokenCorrection
from astratk.losses.ppo_clip import PPOClip
from astratk.registry import resolve
from astratk.training.aggregation import aggregate
from astratk.training.step_inputs import apply_corrections, check_corrections

DT = torch.float64
# Two sequences; rho = pi_old / mu per token. Row 0: rho = 1, 3, 0.5 (all in the mask). Row 1: rho = 3, 3, 30 with
# the last token masked (its rho must not count anywhere).
PROX = [[0.5, 0.9, 0.2], [0.9, 0.6, 0.3]]
MU = [[0.5, 0.3, 0.4], [0.3, 0.2, 0.01]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def _inputs(prox=PROX, mu=MU, mask=MASK, adv=None):
    logmu = torch.log(torch.tensor(mu, dtype=DT))
    adv = torch.ones_like(logmu) if adv is None else torch.tensor(adv, dtype=DT)
    return LossInputs(logprobs=logmu.clone().requires_grad_(), behavior_logprobs=logmu, advantages=adv,
                      loss_mask=torch.tensor(mask, dtype=DT), weights=torch.tensor(mask, dtype=DT),
                      proximal_logprobs=torch.log(torch.tensor(prox, dtype=DT)))


def _metrics(out):
    return {k: v.item() for k, v in out.metrics.items()}


def test_tis_token_level_golden():
    # w = min(rho, 2): row 0 -> 1, 2, 0.5; row 1 -> 2, 2, (masked: 1). Over the 5 mask tokens: rho mean
    # (1 + 3 + 0.5 + 3 + 3) / 5 = 2.1, w mean (1 + 2 + 0.5 + 2 + 2) / 5 = 1.5, truncated 3 of 5.
    out = TIS(cap=2.0)(_inputs())
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 2.0, 0.5], [2.0, 2.0, 1.0]], dtype=DT))
    assert torch.equal(out.keep, torch.ones_like(out.keep))
    assert not out.weights.requires_grad
    m = _metrics(out)
    assert m["ratio_mean"] == pytest.approx(2.1)
    assert m["ratio_max"] == pytest.approx(3.0)  # the masked rho = 30 does not count
    assert m["weight_mean"] == pytest.approx(1.5)
    assert m["truncated_frac"] == pytest.approx(3 / 5)


def test_tis_sequence_and_geometric_levels():
    # sequence: rho_0 = 1 * 3 * 0.5 = 1.5 (under the cap), rho_1 = 3 * 3 = 9 (masked 30 excluded) -> capped at 2.
    out = TIS(cap=2.0, level="sequence")(_inputs())
    torch.testing.assert_close(out.weights, torch.tensor([[1.5, 1.5, 1.5], [2.0, 2.0, 1.0]], dtype=DT))
    m = _metrics(out)
    assert m["ratio_mean"] == pytest.approx((1.5 + 9) / 2)  # per sequence, not per token
    assert m["truncated_frac"] == pytest.approx(1 / 2)
    # geometric: rho_0 = 1.5 ** (1/3) = 1.1447, rho_1 = 9 ** (1/2) = 3 -> capped at 2
    g = 1.5 ** (1 / 3)
    out = TIS(cap=2.0, level="geometric")(_inputs())
    torch.testing.assert_close(out.weights, torch.tensor([[g, g, g], [2.0, 2.0, 1.0]], dtype=DT))


def test_tis_sequence_product_does_not_overflow():
    # 200 tokens with rho = e each: log rho_seq = 200, clamped to 20 before exp, then capped: w = C, finite
    n = 200
    inputs = LossInputs(torch.zeros(1, n, dtype=DT), torch.full((1, n), -1.0, dtype=DT), torch.ones(1, n, dtype=DT),
                        torch.ones(1, n, dtype=DT), proximal_logprobs=torch.zeros(1, n, dtype=DT))
    out = TIS(cap=2.0, level="sequence")(inputs)
    torch.testing.assert_close(out.weights, torch.full((1, n), 2.0, dtype=DT))
    assert all(math.isfinite(v) for v in _metrics(out).values())


def test_mis_token_level_band_inclusive():
    # [0.5, 2]: row 0 rho 1, 3, 0.5 -> keep 1, 0, 1 (0.5 is inside: inclusive); row 1 rho 3, 3 -> dropped;
    # the masked position stays keep = 1 (the mask already removes it). IcePop weights kept tokens by rho.
    out = MIS(low=0.5, high=2.0)(_inputs())
    torch.testing.assert_close(out.keep, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], dtype=DT))
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1.0, 0.5], [1.0, 1.0, 1.0]], dtype=DT))
    m = _metrics(out)
    assert m["dropped_frac"] == pytest.approx(3 / 5) and m["dropped_tokens"] == 3
    plain = MIS(low=0.5, high=2.0, weight=False)(_inputs())
    assert torch.equal(plain.keep, out.keep) and torch.equal(plain.weights, torch.ones_like(plain.weights))


def test_mis_sequence_level_keeps_or_drops_whole_sequences():
    # sequence ratios 1.5 (kept, weight 1.5 on every token) and 9 (dropped: all its mask tokens)
    out = MIS(low=0.5, high=2.0, level="sequence")(_inputs())
    torch.testing.assert_close(out.keep, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]], dtype=DT))
    torch.testing.assert_close(out.weights, torch.tensor([[1.5, 1.5, 1.5], [1.0, 1.0, 1.0]], dtype=DT))
    assert _metrics(out)["dropped_frac"] == pytest.approx(1 / 2)  # one sequence of two


def test_mis_dropped_tokens_leave_the_denominator():
    # r = 1 (logprobs = mu), so PPOClip's token loss is -A * weight. A = 1, 2, 3 / 4, 5.
    # Without MIS, token-mean: -(1 + 2 + 3 + 4 + 5) / 5 = -3.
    # With MIS(weight=False), tokens (0, 1), (1, 0), (1, 1) are dropped: -(1 + 3) / 2 = -2 (denominator 2, not 5).
    inputs = _inputs(adv=[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    base = PPOClip()(inputs)
    assert aggregate(base.token_losses, base.mask, "token-mean").item() == pytest.approx(-3.0)
    corrections, names = check_corrections([MIS(weight=False)])
    corrected, metrics = apply_corrections(corrections, names, inputs)
    out = PPOClip()(corrected)
    assert aggregate(out.token_losses, out.mask, "token-mean").item() == pytest.approx(-2.0)
    assert out.mask.sum().item() == 2
    assert metrics["correction/mis/dropped_tokens"].item() == 3
    # seq-mean-token-mean: row 0 -(1 + 3) / 2 = -2, row 1 empty -> 0, counted: (-2 + 0) / 2 = -1
    assert aggregate(out.token_losses, out.mask, "seq-mean-token-mean").item() == pytest.approx(-1.0)


def test_corrections_compose_in_order_with_unique_metric_names():
    # TIS (token, C = 2) then MIS: weights multiply (TIS w * MIS rho on kept tokens), keep multiplies the mask
    corrections, names = check_corrections([TIS(cap=2.0), MIS(), TIS(cap=1.5)])
    assert names == ["tis", "mis", "tis_2"]
    corrected, metrics = apply_corrections(corrections, names, _inputs())
    tis = torch.tensor([[1.0, 2.0, 0.5], [2.0, 2.0, 1.0]], dtype=DT)
    mis = torch.tensor([[1.0, 1.0, 0.5], [1.0, 1.0, 1.0]], dtype=DT)
    tis2 = torch.tensor([[1.0, 1.0, 0.5], [1.0, 1.0, 1.0]], dtype=DT)  # only (0, 0) and (0, 2) left in the mask
    torch.testing.assert_close(corrected.weights, torch.tensor(MASK, dtype=DT) * tis * mis * tis2)
    torch.testing.assert_close(corrected.loss_mask, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=DT))
    # the third correction saw MIS's mask: only tokens (0, 0) and (0, 2) count, rho 1 and 0.5
    assert metrics["correction/tis_2/ratio_mean"].item() == pytest.approx(0.75)
    assert {"correction/tis/weight_mean", "correction/mis/dropped_frac"} <= set(metrics)


def test_needs_proximal_errors_and_registry():
    for c in (TIS(), MIS()):
        assert isinstance(c, TokenCorrection) and c.needs_proximal
        inputs = _inputs()
        inputs.proximal_logprobs = None
        with pytest.raises(ValueError, match="proximal_logprobs"):
            c(inputs)
    assert resolve("correction", "tis") is TIS
    assert resolve("correction", "mis") is MIS and resolve("correction", "icepop") is MIS
    with pytest.raises(ValueError, match="cap"):
        TIS(cap=0.0)
    with pytest.raises(ValueError, match="low < 1 < high"):
        MIS(low=1.5, high=2.0)
    with pytest.raises(ValueError, match="level"):
        TIS(level="seq")
    with pytest.raises(TypeError, match="TokenCorrection"):
        check_corrections([PPOClip()])
