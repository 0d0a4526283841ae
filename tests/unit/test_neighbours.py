"""The neighbour losses PG-IS, CISPO, SPO, SAPO (GSPO and M2PO have their own files), plus properties every
neighbour shares: golden values with derivations, gradient = -A c_t in closed form, gradcheck, config errors."""

import doctest
import importlib
import math

import pytest
import torch

from astratk.contracts import LossInputs
from astratk.losses.cispo import CISPO
from astratk.losses.drpo import DRPO
from astratk.losses.gspo import GSPO, GSPOToken
from astratk.losses.m2po import M2PO, M2POClip
from astratk.losses.pg_is import PGIS
from astratk.losses.ppo_clip import PPOClip
from astratk.losses.sapo import SAPO
from astratk.losses.spo import SPO
from astratk.registry import resolve

DT = torch.float64
ALL = [PGIS(), CISPO(), SPO(), SAPO(), GSPO(), GSPOToken(), M2PO(), M2POClip()]


def _run(loss, r, adv, mask=None, weights=None):
    """mu = 1 (log mu = 0), so log pi = log r and r is exactly the given ratio; returns (outputs, d sum l / d log pi)."""
    logprobs = torch.log(torch.tensor([r], dtype=DT)).requires_grad_()
    mask = torch.ones(1, len(r), dtype=DT) if mask is None else torch.tensor([mask], dtype=DT)
    out = loss(LossInputs(logprobs, torch.zeros(1, len(r), dtype=DT), torch.tensor([adv], dtype=DT), mask,
                          weights=weights))
    (grad,) = torch.autograd.grad(out.token_losses.sum(), logprobs)
    return out, grad[0]


def _metrics(out):
    return {k: v.item() for k, v in out.metrics.items()}


def _random(seed, shape=(4, 16), spread=0.5):
    g = torch.Generator().manual_seed(seed)
    log_mu = torch.log(torch.rand(*shape, generator=g, dtype=DT) * 0.9 + 0.05)
    log_r = spread * torch.randn(*shape, generator=g, dtype=DT)
    return log_mu + log_r, log_mu, torch.randn(*shape, generator=g, dtype=DT)


def _grad(loss, logp, log_mu, adv, mask=None):
    logp = logp.clone().requires_grad_()
    out = loss(LossInputs(logp, log_mu, adv, torch.ones_like(logp) if mask is None else mask))
    return torch.autograd.grad(out.token_losses.sum(), logp)[0], (logp - log_mu).exp().detach()


# ------------------------------------------------------------------------------------------------------------ PG-IS


def test_pg_is_golden():
    # l = -A r, d l / d log pi = -A r (c = r). t0: -1 * 1.5; t1: 2 * 0.5 = 1; t2 masked (r 2 ignored everywhere)
    out, grad = _run(PGIS(), [1.5, 0.5, 2.0], [1.0, -2.0, 3.0], [1, 1, 0])
    torch.testing.assert_close(out.token_losses[0], torch.tensor([-1.5, 1.0, 0.0], dtype=DT))
    torch.testing.assert_close(grad, torch.tensor([-1.5, 1.0, 0.0], dtype=DT))
    m = _metrics(out)
    assert (m["ratio_mean"], m["ratio_max"]) == pytest.approx((1.0, 1.5))
    assert m["kl_k3"] == pytest.approx((0.5 - math.log(1.5) - 0.5 + math.log(2.0)) / 2)  # (r - 1) - log r


def test_pg_is_closed_form_gradient():
    logp, log_mu, adv = _random(0)
    grad, r = _grad(PGIS(), logp, log_mu, adv)
    torch.testing.assert_close(grad, -adv * r)


# ------------------------------------------------------------------------------------------------------------ CISPO


def test_cispo_golden():
    # C = 2; value -A min(r, C) log pi (not the surrogate's value); gradient -A min(r, C)
    # t0 A 1, r 3 -> truncated to 2: value -2 ln 3, grad -2; t1 A -1, r 0.5: value 0.5 ln 0.5, grad 0.5
    # t2 A 2, r 1.5: value -3 ln 1.5, grad -3
    out, grad = _run(CISPO(ratio_cap=2.0), [3.0, 0.5, 1.5], [1.0, -1.0, 2.0])
    expected = [-2 * math.log(3.0), 0.5 * math.log(0.5), -3 * math.log(1.5)]
    torch.testing.assert_close(out.token_losses[0], torch.tensor(expected, dtype=DT))
    torch.testing.assert_close(grad, torch.tensor([-2.0, 0.5, -3.0], dtype=DT))
    m = _metrics(out)
    assert (m["truncated_frac"], m["ratio_max"]) == pytest.approx((1 / 3, 3.0))


def test_cispo_closed_form_gradient_every_token_keeps_one():
    # No gradcheck: sg() makes the value's derivative differ from the gradient by design. Check c = min(r, C) instead.
    logp, log_mu, adv = _random(1, spread=1.5)
    grad, r = _grad(CISPO(), logp, log_mu, adv)
    assert bool((r > 5).any())  # the cap binds somewhere in this sample
    torch.testing.assert_close(grad, -adv * torch.clamp(r, max=5.0))
    assert bool((grad != 0).all())  # unlike PPO's clip, no token loses its gradient


# -------------------------------------------------------------------------------------------------------------- SPO


def test_spo_golden():
    # eps 0.5; l = -A r + |A| (r - 1)^2 / (2 eps); grad = r dl/dr = r (-A + |A| (r - 1) / eps) = -A r w,
    # w = 1 - sign(A (r - 1)) |r - 1| / eps
    # t0 A  1, r 1.5: -1.5 + 0.25 = -1.25; w = 1 - 0.5/0.5 = 0 -> grad 0 (radius reached)
    # t1 A -2, r 0.5:  1.0 + 2 * 0.25 = 1.5; w = 0 -> grad 0
    # t2 A  1, r 0.8: -0.8 + 0.04 = -0.76; back toward mu, w = 1.4 -> grad -0.8 * 1.4 = -1.12
    # t3 A -1, r 1.2:  1.2 + 0.04 = 1.24; w = 1.4 -> grad 1.2 * 1.4 = 1.68
    # t4 A  1, r 2.0: -2 + 1 = -1; beyond the radius, w = 1 - 1/0.5 = -1 -> grad +2 (pushed back toward mu)
    out, grad = _run(SPO(eps=0.5), [1.5, 0.5, 0.8, 1.2, 2.0], [1.0, -2.0, 1.0, -1.0, 1.0])
    torch.testing.assert_close(out.token_losses[0], torch.tensor([-1.25, 1.5, -0.76, 1.24, -1.0], dtype=DT))
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -1.12, 1.68, 2.0], dtype=DT))
    m = _metrics(out)
    assert (m["w_mean"], m["w_min"], m["w_max"]) == pytest.approx((0.36, -1.0, 1.4))
    assert m["penalty_mean"] == pytest.approx((0.25 + 0.5 + 0.04 + 0.04 + 1.0) / 5)
    assert m["beyond_radius_frac"] == pytest.approx(0.2)


def test_spo_closed_form_gradient():
    logp, log_mu, adv = _random(2)
    for eps in (0.3, 12.5):
        grad, r = _grad(SPO(eps), logp, log_mu, adv)
        w = 1 - torch.sign(adv * (r - 1)) * (r - 1).abs() / eps
        torch.testing.assert_close(grad, -adv * r * w)


def test_spo_is_drpo_with_eps_times_mu_and_unbounded_for_rare_tokens():
    # DRPO substitutes eps_t = delta / mu_t into SPO (`astratk.losses.drpo`): with one mu everywhere they coincide
    logp, _, adv = _random(3)
    log_mu = torch.full_like(logp, math.log(0.4))
    torch.testing.assert_close(_grad(SPO(eps=2.0), logp, log_mu, adv)[0], _grad(DRPO(delta=0.8), logp, log_mu, adv)[0])
    # mu 1e-4 -> pi 1e-2 (r = 100, A > 0): SPO's w = 1 - 99 / 12.5 = -6.92, coefficient r w = -692; DRPO's stays ~1
    lp, lm, a = torch.tensor([[math.log(1e-2)]], dtype=DT), torch.tensor([[math.log(1e-4)]], dtype=DT), torch.ones(1, 1)
    assert _grad(SPO(), lp, lm, a.to(DT))[0].item() == pytest.approx(692.0)
    assert _grad(DRPO(delta=12.5), lp, lm, a.to(DT))[0].item() == pytest.approx(-100 * (1 - 0.0099 / 12.5))
    assert DRPO().delta == 1.0  # astratk's default (its stability grid), not the paper's 12.5


# ------------------------------------------------------------------------------------------------------------- SAPO


def test_sapo_golden():
    # l = -(4/tau) sigmoid(tau (r - 1)) A; grad = -A r g, g = 4 s (1 - s), s = sigmoid(tau (r - 1))
    # t0 A  1 (tau 1),    r 1.5: s = sigmoid(0.5) = 0.6224593;   l = -4 s = -2.4898373; g = 0.9400148, grad = -1.4100223
    # t1 A -1 (tau 1.05), r 0.5: s = sigmoid(-0.525) = 0.3716838; l = 4/1.05 s = 1.4159383; grad = 0.5 g = 0.4670699
    out, grad = _run(SAPO(), [1.5, 0.5], [1.0, -1.0])
    torch.testing.assert_close(out.token_losses[0], torch.tensor([-2.4898373248, 1.4159383303], dtype=DT))
    torch.testing.assert_close(grad, torch.tensor([-1.4100222732, 0.4670699116], dtype=DT))
    assert out.metrics["gate_min"].item() == pytest.approx(0.4670699116 / 0.5)


def test_sapo_tau_has_the_inputs_dtype():
    # float64 inputs must see tau_neg = 1.05 and tau_pos = 0.3 as float64, not rounded through float32
    # (1.0499999523, 0.3000000119: the on-policy loss 2 * 2 / 1.05 would move by 1.7e-7). By hand, in Python floats:
    # t0 A  1, tau .3,   r 1.5: s = sigmoid(.15) = .53742985; l = -(4/.3) s = -7.16573127; grad -A r 4 s (1 - s) = -1.49159404
    # t1 A -1, tau 1.05, r .5:  s = sigmoid(-.525) = .37168381; l = (4/1.05) s = 1.41593833; grad = .46706991
    # t2 A -2, tau 1.05, r 1:   s = .5; l = 2 * 2/1.05 = 3.80952381; grad = 2 (plain PG on-policy)
    r, adv = [1.5, 0.5, 1.0], [1.0, -1.0, -2.0]
    out, grad = _run(SAPO(tau_pos=0.3, tau_neg=1.05), r, adv)
    loss, g = [], []
    for r_, a in zip(r, adv):
        tau = 0.3 if a > 0 else 1.05
        s = 1.0 / (1.0 + math.exp(-tau * (r_ - 1.0)))
        loss.append(-(4.0 / tau) * s * a)
        g.append(-a * r_ * 4.0 * s * (1.0 - s))
    torch.testing.assert_close(out.token_losses[0], torch.tensor(loss, dtype=DT), rtol=1e-15, atol=0)
    torch.testing.assert_close(grad, torch.tensor(g, dtype=DT), rtol=1e-15, atol=0)
    assert out.token_losses[0, 2].item() == 2 * 2 / 1.05
    # float32 inputs keep float32 throughout
    lp = torch.zeros(1, 2, requires_grad=True)
    out32 = SAPO()(LossInputs(lp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)))
    assert out32.token_losses.dtype == torch.float32


def test_sapo_gate_and_closed_form_gradient():
    logp, log_mu, adv = _random(4, spread=1.0)
    grad, r = _grad(SAPO(tau_pos=1.0, tau_neg=2.0), logp, log_mu, adv)
    tau = torch.where(adv > 0, 1.0, 2.0).to(DT)
    s = 1 / (1 + torch.exp(-tau * (r - 1)))
    torch.testing.assert_close(grad, -adv * r * 4 * s * (1 - s))
    # the gate is 1 on-policy, symmetric in tau (r - 1), smaller for tau_neg > tau_pos at the same |r - 1|
    _, on = _run(SAPO(), [1.0, 1.0], [1.0, -1.0])
    torch.testing.assert_close(on, torch.tensor([-1.0, 1.0], dtype=DT))
    _, g = _run(SAPO(tau_pos=1.0, tau_neg=1.05), [1.6, 0.4, 1.6], [1.0, 1.0, -1.0])
    assert g[0].item() / -1.6 == pytest.approx(g[1].item() / -0.4) and g[2].item() / 1.6 < g[0].item() / -1.6
    # tau -> 0: the gate opens fully and SAPO's gradient becomes PG-IS's
    tiny, _ = _grad(SAPO(tau_pos=1e-6, tau_neg=1e-6), logp, log_mu, adv)
    torch.testing.assert_close(tiny, -adv * r)


# ------------------------------------------------------------------------------------------------------ PPO vs DAPO


def test_ppo_clip_equals_dapo_at_equal_eps():
    logp, log_mu, adv = _random(5)
    for e in (0.1, 0.2):
        a, b = PPOClip(eps_low=e, eps_high=e), PPOClip(eps_low=e)
        la = a(LossInputs(logp, log_mu, adv, torch.ones_like(adv))).token_losses
        lb = b(LossInputs(logp, log_mu, adv, torch.ones_like(adv))).token_losses
        assert torch.equal(la, lb)
        assert torch.equal(_grad(a, logp, log_mu, adv)[0], _grad(b, logp, log_mu, adv)[0])


# ------------------------------------------------------------------------------------------------- shared properties


@pytest.mark.parametrize("loss", [PGIS(), SPO(eps=0.5), SAPO(), GSPO(eps_low=0.2, eps_high=0.2), M2PO(tau=0.05)],
                         ids=repr)
def test_gradcheck_float64(loss):
    # CISPO, GSPOToken: stop-gradient by design (value derivative != gradient); see their closed-form tests.
    # M2POClip: tests/unit/test_m2po.py (its bounds are detached batch statistics)
    logp, log_mu, adv = _random(6, shape=(2, 5), spread=0.3)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=DT)
    adv = adv[:, :1].expand(2, 5).contiguous()  # one advantage per sequence (GSPO's input)
    logp = logp.requires_grad_()
    assert torch.autograd.gradcheck(lambda lp: loss(LossInputs(lp, log_mu, adv, mask)).token_losses, (logp,))


@pytest.mark.parametrize("loss", ALL, ids=repr)
def test_padding_garbage_and_empty_masks_stay_finite(loss):
    # masked positions hold NaN log pi and -inf log mu (padding): nothing leaks into losses, gradients or metrics
    logp = torch.tensor([[-0.5, float("nan")], [float("nan"), float("nan")]], dtype=DT, requires_grad=True)
    log_mu = torch.tensor([[-0.7, float("-inf")], [float("-inf"), float("-inf")]], dtype=DT)
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=DT)
    out = loss(LossInputs(logp, log_mu, torch.ones(2, 2, dtype=DT), mask))
    (grad,) = torch.autograd.grad(out.token_losses.sum(), logp)
    assert torch.isfinite(out.token_losses).all() and torch.isfinite(grad).all()
    assert out.token_losses[0, 1] == 0 and (out.token_losses[1] == 0).all() and (grad[1] == 0).all()
    assert all(torch.isfinite(v) and not v.requires_grad for v in out.metrics.values())


@pytest.mark.parametrize("loss", ALL, ids=repr)
def test_weights_scale_token_losses_not_mask(loss):
    logp, log_mu, adv = _random(7, shape=(2, 4), spread=0.05)
    plain = loss(LossInputs(logp, log_mu, adv, torch.ones_like(adv)))
    w = torch.full_like(adv, 3.0)
    weighted = loss(LossInputs(logp, log_mu, adv, torch.ones_like(adv), weights=w))
    torch.testing.assert_close(weighted.token_losses, 3.0 * plain.token_losses)
    torch.testing.assert_close(weighted.mask, plain.mask)


@pytest.mark.parametrize("name, cls", [("pg_is", PGIS), ("cispo", CISPO), ("spo", SPO), ("gspo", GSPO),
                                       ("gspo_token", GSPOToken), ("sapo", SAPO), ("m2po", M2PO),
                                       ("m2po_clip", M2POClip)])
def test_registry_short_names(name, cls):
    assert resolve("loss", name) is cls


@pytest.mark.parametrize("module", ["pg_is", "cispo", "spo", "sapo", "gspo", "m2po"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(f"astratk.losses.{module}"))
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("factory, match", [
    (lambda: CISPO(ratio_cap=0.5), "ratio_cap must be >= 1"),
    (lambda: CISPO(ratio_cap=float("nan")), "ratio_cap must be >= 1"),
    (lambda: SPO(eps=0), "eps must be > 0"),
    (lambda: SAPO(tau_pos=0), "tau_pos must be > 0"),
    (lambda: SAPO(tau_neg=-1), "tau_neg must be > 0"),
    (lambda: GSPO(eps_low=1.0), "eps_low must be in"),
    (lambda: GSPO(eps_high=0), "eps_high must be > 0"),
    (lambda: GSPO(variant="seq"), r"choose one of \['sequence', 'token'\]"),
    (lambda: M2PO(tau=0), "tau must be > 0"),
    (lambda: M2POClip(tau=float("nan")), "tau must be > 0"),
    (lambda: M2POClip(eps_low_cap=1.0), "eps_low_cap must be in"),
    (lambda: M2POClip(eps_high_cap=0), "eps_high_cap must be > 0"),
])
def test_bad_config_raises_with_fix(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()
