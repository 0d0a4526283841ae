"""GSPO (arXiv 2507.18071): the geometric-mean sequence ratio, the sequence clip spread over tokens,
gradients in closed form (sum-of-token-losses view and through seq-mean-token-mean), the token variant's identity."""

import math

import pytest
import torch

from astratk.contracts import LossInputs
from astratk.losses.gspo import GSPO, GSPOToken
from astratk.training.aggregation import aggregate

DT = torch.float64
NAN = float("nan")


def _inputs(r, adv, mask):
    """mu = 1, so log pi = log r (padding may hold NaN: it is masked)."""
    logp = torch.log(torch.tensor(r, dtype=DT)).requires_grad_()
    return LossInputs(logp, torch.zeros_like(logp), torch.tensor(adv, dtype=DT), torch.tensor(mask, dtype=DT))


def test_golden_values_gradients_and_aggregation():
    # eps_low 3e-4, eps_high 4e-4; s_i = geometric mean of the masked ratios; loss_i on each masked token;
    # gradient of sum_t l_it w.r.t. log pi_it = n_i * d loss_i / d log pi_it = -A_i s_i (0 if clipped)
    # seq0 mask [0,1,1], r (pad, 2, 0.5), A from the first MASKED token = 1 (not the 9): s = 1, l = -1, grad -1
    # seq1 r (1.1, 1.1, 1.1), A 1: s = 1.1 > 1.0004 -> clipped high, l = -1.0004, grad 0
    # seq2 r (0.8, 0.9, 1.0), A 1: s = 0.72^(1/3) = 0.8963, A > 0 moving toward mu: not clipped, l = -s, grad -s
    # seq3 same ratios, A -1: s < 0.9997 -> clipped low, l = 0.9997, grad 0
    # seq4 all masked: 0
    s2 = 0.72 ** (1 / 3)
    inp = _inputs([[NAN, 2.0, 0.5], [1.1, 1.1, 1.1], [0.8, 0.9, 1.0], [0.8, 0.9, 1.0], [NAN, NAN, NAN]],
                  [[9.0, 1.0, 1.0], [1.0] * 3, [1.0] * 3, [-1.0] * 3, [5.0] * 3],
                  [[0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 0]])
    out = GSPO()(inp)
    expected = torch.tensor([[0, -1, -1], [-1.0004] * 3, [-s2] * 3, [0.9997] * 3, [0] * 3], dtype=DT)
    torch.testing.assert_close(out.token_losses, expected)
    (grad,) = torch.autograd.grad(out.token_losses.sum(), inp.logprobs, retain_graph=True)
    torch.testing.assert_close(grad, torch.tensor([[0, -1, -1], [0] * 3, [-s2] * 3, [0] * 3, [0] * 3], dtype=DT))
    # seq-mean-token-mean = mean_i loss_i, the empty sequence counted as 0 (aggregation's documented choice)
    value = aggregate(out.token_losses, out.mask, GSPO.required_aggregation)
    assert value.item() == pytest.approx((-1 - 1.0004 - s2 + 0.9997) / 5)
    m = {k: v.item() for k, v in out.metrics.items()}
    assert m["seq_ratio_mean"] == pytest.approx((1 + 1.1 + 2 * s2) / 4)  # non-empty sequences only
    assert (m["seq_ratio_max"], m["seq_ratio_min"]) == pytest.approx((1.1, s2))
    assert (m["clip_frac"], m["clip_frac_low"], m["clip_frac_high"]) == pytest.approx((6 / 11, 3 / 11, 3 / 11))


def test_sequence_ratio_is_geometric_mean():
    g = torch.Generator().manual_seed(0)
    r = torch.exp(0.3 * torch.randn(6, 9, generator=g, dtype=DT))
    mask = (torch.rand(6, 9, generator=g) < 0.7).to(DT)
    mask[:, 0] = 1
    # clip disabled (huge band): l = -A s with A = -1 gives s itself on every masked token
    out = GSPO(eps_low=0.999, eps_high=1e9)(LossInputs(r.log(), torch.zeros_like(r), -torch.ones_like(r), mask))
    geo = torch.stack([row[m.bool()].prod() ** (1 / m.sum()) for row, m in zip(r, mask)])  # (prod r)^(1/n)
    torch.testing.assert_close(out.token_losses, geo[:, None] * mask)
    assert out.metrics["seq_ratio_max"].item() == pytest.approx(geo.max().item())


def _batch(seed, B=8, T=12, spread=2e-3):
    g = torch.Generator().manual_seed(seed)
    log_mu = torch.log(torch.rand(B, T, generator=g, dtype=DT) * 0.9 + 0.05)
    logp = log_mu + spread * torch.randn(B, T, generator=g, dtype=DT)  # sequence ratios straddle the narrow band
    mask = (torch.rand(B, T, generator=g) < 0.8).to(DT)
    adv = torch.randn(B, 1, generator=g, dtype=DT).expand(B, T).contiguous()
    return logp, log_mu, adv, mask


def test_closed_form_gradient_sequence_variant():
    logp, log_mu, adv, mask = _batch(1)
    lp = logp.clone().requires_grad_()
    out = GSPO()(LossInputs(lp, log_mu, adv, mask))
    (grad,) = torch.autograd.grad(out.token_losses.sum(), lp)
    n = mask.sum(-1, keepdim=True)
    s = torch.exp(((logp - log_mu) * mask).sum(-1, keepdim=True) / n)  # [B, 1]
    a = adv[:, :1]
    clipped = ((a > 0) & (s > 1 + 4e-4)) | ((a < 0) & (s < 1 - 3e-4))
    assert 0 < int(clipped.sum()) < len(s)  # both regimes present
    torch.testing.assert_close(grad, torch.where(clipped, 0.0, -a * s) * mask)
    # through the required aggregation: the paper's (1/N) (1/n_i) s_i A_i grad log pi_it
    (agg_grad,) = torch.autograd.grad(aggregate(GSPO()(LossInputs(lp, log_mu, adv, mask)).token_losses, mask,
                                                "seq-mean-token-mean"), lp)
    torch.testing.assert_close(agg_grad, torch.where(clipped, 0.0, -a * s) * mask / (n * len(s)))


def test_token_variant_equals_sequence_variant_with_sequence_advantages():
    logp, log_mu, adv, mask = _batch(2)
    outs, grads = [], []
    for loss in (GSPO(), GSPOToken(), GSPO(variant="token")):
        lp = logp.clone().requires_grad_()
        out = loss(LossInputs(lp, log_mu, adv, mask))
        outs.append(out)
        grads.append(torch.autograd.grad(aggregate(out.token_losses, mask, loss.required_aggregation), lp)[0])
    for out, grad in zip(outs[1:], grads[1:]):
        torch.testing.assert_close(out.token_losses, outs[0].token_losses)
        torch.testing.assert_close(grad, grads[0])
        assert out.metrics["clip_frac"].item() == pytest.approx(outs[0].metrics["clip_frac"].item())


def test_token_variant_closed_form_with_token_advantages():
    # s_it = sg(s_i) pi / sg(pi): value s_i, gradient s_i d log pi; clip per token with A_it
    logp, log_mu, _, mask = _batch(3)
    adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(9), dtype=DT)
    lp = logp.clone().requires_grad_()
    out = GSPOToken()(LossInputs(lp, log_mu, adv, mask))
    (grad,) = torch.autograd.grad(out.token_losses.sum(), lp)
    s = torch.exp(((logp - log_mu) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))  # [B, 1]
    clipped = ((adv > 0) & (s > 1 + 4e-4)) | ((adv < 0) & (s < 1 - 3e-4))  # [B, T]
    torch.testing.assert_close(grad, torch.where(clipped, 0.0, -adv * s) * mask)
    clipped_value = -adv * s.clamp(1 - 3e-4, 1 + 4e-4)
    torch.testing.assert_close(out.token_losses, torch.where(clipped, clipped_value, -adv * s) * mask)


def test_required_aggregation_and_repr():
    assert GSPO.required_aggregation == GSPOToken.required_aggregation == "seq-mean-token-mean"
    assert repr(GSPO()) == "GSPO(eps_low=0.0003, eps_high=0.0004, variant='sequence')"
    assert GSPOToken().variant == "token" and math.isclose(GSPOToken(1e-3, 2e-3).eps_high, 2e-3)


def test_luspo_length_weighting_through_seq_mean_token_sum():
    # two sequences of 1 and 3 tokens, A = 1, r = 1 (s = 1, inside the clip). Per token, d s_i / d log pi_it = s_i / n_i.
    # seq-mean-token-mean (GSPO): loss = (1/N) sum_i loss_i -> grad -A s_i / (N n_i) = (-1/2; -1/6, -1/6, -1/6)
    # seq-mean-token-sum (LUSPO): loss = (1/N) sum_i n_i loss_i -> grad -A s_i / N = -1/2 on every token: a long
    # answer's tokens are no longer worth less than a short one's
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    grads = {}
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        lp = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
        loss = GSPO(aggregation=agg)
        out = loss(LossInputs(lp, lp.detach(), torch.ones(2, 3, dtype=torch.float64), mask))
        value = aggregate(out.token_losses, out.mask, loss.required_aggregation)
        (grads[agg],) = torch.autograd.grad(value, lp)
        assert value.item() == pytest.approx(-1.0 if agg == "seq-mean-token-mean" else -2.0)
    torch.testing.assert_close(grads["seq-mean-token-mean"],
                               torch.tensor([[-0.5, 0, 0], [-1 / 6, -1 / 6, -1 / 6]], dtype=torch.float64))
    torch.testing.assert_close(grads["seq-mean-token-sum"], -0.5 * mask)
    assert repr(GSPO(aggregation="seq-mean-token-sum")).endswith("aggregation='seq-mean-token-sum')")
    assert GSPOToken(aggregation="token-mean").required_aggregation == "token-mean"
    with pytest.raises(ValueError, match="unknown aggregation 'luspo'"):
        GSPO(aggregation="luspo")
