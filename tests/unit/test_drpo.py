"""DRPO (arXiv 2606.09821, Eq. 8/9): golden values, the paper's weight properties, gradients."""

import math

import pytest
import torch

from astratk.contracts import LossInputs
from astratk.losses.drpo import DRPO, drpo_gradient_weight

DT = torch.float64


def _inputs(pi, mu, adv, mask=None, weights=None):
    logprobs = torch.log(torch.tensor([pi], dtype=DT)).requires_grad_()
    return LossInputs(logprobs=logprobs, behavior_logprobs=torch.log(torch.tensor([mu], dtype=DT)),
                      advantages=torch.tensor([adv], dtype=DT),
                      loss_mask=torch.ones(1, len(pi), dtype=DT) if mask is None else torch.tensor([mask], dtype=DT),
                      weights=weights)


def test_golden_values_and_gradients():
    # delta = 0.5; l = -A r + |A| mu (r - 1)^2 / (2 delta); d l / d log pi = r dl/dr = r (-A + |A| mu (r - 1) / delta)
    # t0: mu 0.5, pi 0.6,  A  1: r 1.2, penalty 1*0.5*0.04/1 = 0.02, l = -1.2 + 0.02 = -1.18
    #     dl/dr = -1 + 0.5*0.2/0.5 = -0.8, grad = 1.2 * -0.8 = -0.96; w = 1 - 0.1/0.5 = 0.8 (= -A r w = -1.2*0.8)
    # t1: mu 0.5, pi 0.25, A -2: r 0.5, -A r = 1.0, penalty 2*0.5*0.25/1 = 0.25, l = 1.25
    #     dl/dr = 2 + 2*0.5*(-0.5)/0.5 = 1, grad = 0.5 * 1 = 0.5; w = 1 - 0.25/0.5 = 0.5 (= -(-2)*0.5*0.5)
    # t2: mu 0.2, pi 0.2,  A  3: r 1, penalty 0, l = -3, grad = -3, w = 1
    # t3: masked padding (NaN log pi, -inf log mu): contributes nothing, grad 0, no NaN anywhere
    inp = _inputs([0.6, 0.25, 0.2, float("nan")], [0.5, 0.5, 0.2, 0.0], [1.0, -2.0, 3.0, 7.0], mask=[1, 1, 1, 0])
    out = DRPO(delta=0.5)(inp)
    torch.testing.assert_close(out.token_losses, torch.tensor([[-1.18, 1.25, -3.0, 0.0]], dtype=DT))
    torch.testing.assert_close(out.mask, torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=DT))
    out.token_losses.sum().backward()
    torch.testing.assert_close(inp.logprobs.grad, torch.tensor([[-0.96, 0.5, -3.0, 0.0]], dtype=DT))

    m = {k: v.item() for k, v in out.metrics.items()}
    assert m["ratio_mean"] == pytest.approx((1.2 + 0.5 + 1.0) / 3)
    assert m["ratio_max"] == pytest.approx(1.2)
    # k3 = (r - 1) - log r: 0.2 - ln 1.2 = 0.0176784, -0.5 + ln 2 = 0.1931472, 0
    assert m["kl_k3"] == pytest.approx((0.2 - math.log(1.2) - 0.5 + math.log(2.0)) / 3)
    assert m["penalty_mean"] == pytest.approx((0.02 + 0.25) / 3)
    assert m["tv_mean"] == pytest.approx((0.1 + 0.25) / 3)
    assert m["tv_max"] == pytest.approx(0.25)
    assert m["beyond_boundary_frac"] == 0.0
    assert (m["w_mean"], m["w_min"], m["w_max"]) == pytest.approx(((0.8 + 0.5 + 1.0) / 3, 0.5, 1.0))
    assert all(not v.requires_grad for v in out.metrics.values())


def test_weights_scale_token_losses_not_mask():
    w = torch.tensor([[0.5, 2.0]], dtype=DT)
    out = DRPO(delta=0.5)(_inputs([0.6, 0.25], [0.5, 0.5], [1.0, -2.0], weights=w))
    torch.testing.assert_close(out.token_losses, torch.tensor([[-0.59, 2.5]], dtype=DT))  # [-1.18*0.5, 1.25*2]
    torch.testing.assert_close(out.mask, torch.ones(1, 2, dtype=DT))


def test_beyond_boundary_metrics():
    # delta 0.5; mu 0.3 -> pi 0.9 with A > 0: |pi - mu| = 0.6 > 0.5, w = 1 - 0.6/0.5 = -0.2
    out = DRPO(delta=0.5)(_inputs([0.9, 0.3], [0.3, 0.3], [1.0, 1.0]))
    assert out.metrics["beyond_boundary_frac"].item() == pytest.approx(0.5)
    assert out.metrics["w_min"].item() == pytest.approx(-0.2)
    assert out.metrics["tv_max"].item() == pytest.approx(0.6)


def test_all_zero_mask_is_finite():
    out = DRPO(delta=0.5)(_inputs([0.6, 0.2], [0.5, 0.5], [1.0, -1.0], mask=[0, 0]))
    assert torch.equal(out.token_losses, torch.zeros(1, 2, dtype=DT))
    assert all(torch.isfinite(v) and v.item() == 0.0 for v in out.metrics.values())


def _w(pi, mu, adv, delta):
    return drpo_gradient_weight(torch.log(torch.as_tensor(pi, dtype=DT)), torch.log(torch.as_tensor(mu, dtype=DT)),
                                torch.as_tensor(adv, dtype=DT), delta)


def test_weight_on_policy_is_one():
    assert torch.equal(_w([0.01, 0.5, 0.99], [0.01, 0.5, 0.99], [1.0, -1.0, 0.3], 0.5), torch.ones(3, dtype=DT))


def test_weight_inside_region_while_diverging():
    # delta 0.5, mu 0.3, A > 0 pushes pi up: |pi - mu| < 0.5 <=> pi < 0.8; A < 0 pushes pi down from mu 0.7
    up = _w(torch.linspace(0.3001, 0.7999, 50), 0.3, 1.0, 0.5)
    down = _w(torch.linspace(0.2001, 0.6999, 50), 0.7, -1.0, 0.5)
    for w in (up, down):
        assert bool(((w > 0) & (w <= 1)).all())
    assert up[0].item() == pytest.approx(1.0, abs=1e-3) and up[-1].item() == pytest.approx(0.0, abs=1e-3)


def test_weight_is_zero_at_boundary_and_negative_beyond():
    # exactly |pi - mu| = delta = 0.5 while diverging, both signs of A: w = 1 - 0.5/0.5 = 0
    torch.testing.assert_close(_w([0.8, 0.2], [0.3, 0.7], [1.0, -1.0], 0.5), torch.zeros(2, dtype=DT))
    # beyond: pi 0.9 from mu 0.3 with A > 0 -> w = 1 - 0.6/0.5 = -0.2; pi 0.05 from mu 0.7, A < 0 -> 1 - 0.65/0.5 = -0.3
    torch.testing.assert_close(_w([0.9, 0.05], [0.3, 0.7], [2.0, -0.5], 0.5), torch.tensor([-0.2, -0.3], dtype=DT))


def test_weight_above_one_moving_back_toward_mu():
    # A > 0 with pi below mu (the update raises pi back toward mu): w = 1 + 0.3/0.5 = 1.6; mirrored for A < 0
    torch.testing.assert_close(_w([0.3, 0.9], [0.6, 0.6], [1.0, -1.0], 0.5), torch.tensor([1.6, 1.6], dtype=DT))


@pytest.mark.parametrize("delta", [0.1, 0.5, 0.9, 2.5, 12.5])
def test_weight_bounded_over_random_sweep(delta):
    g = torch.Generator().manual_seed(0)
    pi, mu = torch.rand(20000, generator=g, dtype=DT), torch.rand(20000, generator=g, dtype=DT)
    adv = torch.randn(20000, generator=g, dtype=DT)
    pi[:100], mu[100:200] = 1e-12, 1e-12  # rare tokens: SPO's weight would explode here, DRPO's may not
    w = _w(pi, mu, adv, delta)
    assert w.min().item() >= 1 - 1 / delta - 1e-12 and w.max().item() <= 1 + 1 / delta + 1e-12
    if delta == 12.5:
        assert (w - 1).abs().max().item() <= 0.08 + 1e-12  # the paper default never reaches the boundary


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_weight_is_continuous_in_pi(adv):
    # w is linear in pi with slope -sign(A)/delta, including across pi = mu: adjacent grid steps differ by step/delta
    pi = torch.linspace(1e-6, 1 - 1e-6, 10001, dtype=DT)
    w = _w(pi, 0.4, adv, 0.5)
    step = (pi[1] - pi[0]).item()
    assert (w.diff().abs().max().item()) <= step / 0.5 * (1 + 1e-6)


def test_autograd_matches_eq9_coefficient():
    # dl/dlog pi = -A r w with w = 1 - sign(A (r - 1)) |pi - mu| / delta, written here independently of the module
    g = torch.Generator().manual_seed(1)
    pi = torch.rand(4, 16, generator=g, dtype=DT) * 0.98 + 0.01
    mu = torch.rand(4, 16, generator=g, dtype=DT) * 0.98 + 0.01
    adv = torch.randn(4, 16, generator=g, dtype=DT)
    for delta in (0.3, 12.5):
        logprobs = pi.log().requires_grad_()
        out = DRPO(delta)(LossInputs(logprobs, mu.log(), adv, torch.ones_like(pi)))
        (grad,) = torch.autograd.grad(out.token_losses.sum(), logprobs)
        r = pi / mu
        w = 1 - torch.sign(adv * (r - 1)) * (pi - mu).abs() / delta
        torch.testing.assert_close(grad, -adv * r * w)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    mu_log = torch.log(torch.rand(2, 5, generator=g, dtype=DT) * 0.9 + 0.05)
    adv = torch.randn(2, 5, generator=g, dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=DT)
    loss = DRPO(delta=0.5)
    logprobs = (mu_log + 0.3 * torch.randn(2, 5, generator=g, dtype=DT)).requires_grad_()
    assert torch.autograd.gradcheck(lambda lp: loss(LossInputs(lp, mu_log, adv, mask)).token_losses, (logprobs,))


@pytest.mark.parametrize("delta", [-1, 0, float("nan")])
def test_bad_delta_raises_with_fix(delta):
    with pytest.raises(ValueError, match="delta must be > 0"):
        DRPO(delta=delta)
