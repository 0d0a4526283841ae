"""DRO (the quadratic log-ratio penalty) and VESPO (a gamma-shaped weight of the sequence ratio): golden values with
their derivation, gradients in closed form, gradcheck, anchors, padding garbage, config errors, the registry."""

import math

import pytest
import torch

from astratk.contracts import LossInputs
from astratk.losses.dro import DRO
from astratk.losses.vespo import VESPO
from astratk.registry import resolve_path

DT = torch.float64
T_ = lambda x: torch.tensor(x, dtype=DT)


def _grad(loss, logp, log_mu, adv, mask=None, **kw):
    logp = logp.clone().requires_grad_()
    out = loss(LossInputs(logp, log_mu, adv, torch.ones_like(logp) if mask is None else mask, **kw))
    return torch.autograd.grad(out.token_losses.sum(), logp)[0], out


# ---------------------------------------------------------------------------------------------------------------- DRO
def test_dro_golden_both_anchors():
    # beta 0.5. log pi = (-1, -2), A = (1, -2); mu = (-1.2, -1.5); pi_old = (-0.6, -2.0)
    # behaviour anchor: shift = (0.2, -0.5): value -A log pi + 0.25 shift^2 = (1 + 0.01, -4 + 0.0625)
    #                   gradient -A + 0.5 shift = (-1 + 0.1, 2 - 0.25)
    # proximal anchor:  shift = (-0.4, 0): value (1 + 0.04, -4), gradient (-1 - 0.2, 2)
    lp, mu, old, adv = T_([[-1.0, -2.0]]), T_([[-1.2, -1.5]]), T_([[-0.6, -2.0]]), T_([[1.0, -2.0]])
    g, out = _grad(DRO(beta=0.5, anchor="behavior"), lp, mu, adv)
    torch.testing.assert_close(out.token_losses, T_([[1.01, -3.9375]]))
    torch.testing.assert_close(g, T_([[-0.9, 1.75]]))
    g, out = _grad(DRO(beta=0.5), lp, mu, adv, proximal_logprobs=old)
    torch.testing.assert_close(out.token_losses, T_([[1.04, -4.0]]))
    torch.testing.assert_close(g, T_([[-1.2, 2.0]]))
    assert out.metrics["anchor_shift_abs_max"].item() == pytest.approx(0.4)


def test_dro_at_the_anchor_is_reinforce_and_zero_advantage_tokens_are_pulled_back():
    lp, adv = T_([[-1.0, -0.3, -2.5]]), T_([[0.7, -1.1, 0.0]])
    g, _ = _grad(DRO(beta=3.0), lp, lp - 1.0, adv, proximal_logprobs=lp.clone())
    torch.testing.assert_close(g, -adv)  # pi = pi_old in value: the penalty's gradient is 0
    g, _ = _grad(DRO(beta=3.0, anchor="behavior"), lp, lp - 1.0, adv)
    torch.testing.assert_close(g, -adv + 3.0)  # every token 1 nat above mu: +beta * 1, A = 0 included


def test_dro_needs_proximal_only_for_its_proximal_anchor():
    assert DRO(beta=0.1).needs_proximal and not DRO(beta=0.1, anchor="behavior").needs_proximal
    with pytest.raises(ValueError, match="needs LossInputs.proximal_logprobs"):
        DRO(beta=0.1)(LossInputs(T_([[-0.5]]), T_([[-0.5]]), T_([[1.0]]), T_([[1.0]])))


def test_dro_gradcheck():
    g = torch.Generator().manual_seed(0)
    lp, mu, old = (torch.randn(2, 5, generator=g, dtype=DT) - 2 for _ in range(3))
    adv, mask = torch.randn(2, 5, generator=g, dtype=DT), T_([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    for loss in (DRO(beta=0.3), DRO(beta=0.3, anchor="behavior")):
        f = lambda x, loss=loss: loss(LossInputs(x, mu, adv, mask, proximal_logprobs=old)).token_losses
        assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(),))


@pytest.mark.parametrize("bad", [{"beta": 0.0}, {"beta": -1.0}, {"beta": float("nan")}, {"beta": float("inf")},
                                 {"beta": 0.1, "anchor": "old"}])
def test_dro_config_errors(bad):
    with pytest.raises(ValueError, match="beta|anchor"):
        DRO(**bad)


# -------------------------------------------------------------------------------------------------------------- VESPO
def _phi(log_w, k, lam):
    return math.exp(k * log_w - lam * (math.exp(log_w) - 1.0))


def test_vespo_golden():
    # seq 0, A = +1: log r = (0.1, 0.2) -> log W = 0.3, phi = W^2 e^{3 (1 - W)}; gradient -phi A on both tokens
    # seq 1, A = -2: log r = (-0.5, padding) -> log W = -0.5, phi = W^3 e^{2 (1 - W)}; gradient -phi A = 2 phi
    lp = T_([[-1.0, -2.0], [-1.5, float("nan")]])
    mu = T_([[-1.1, -2.2], [-1.0, float("-inf")]])
    adv, mask = T_([[1.0, 1.0], [-2.0, -2.0]]), T_([[1.0, 1.0], [1.0, 0.0]])
    g, out = _grad(VESPO(), lp, mu, adv, mask)
    p0, p1 = _phi(0.3, 2.0, 3.0), _phi(-0.5, 3.0, 2.0)
    torch.testing.assert_close(g, T_([[-p0, -p0], [2 * p1, 0.0]]))
    torch.testing.assert_close(out.token_losses, T_([[p0, 2 * p0], [-3 * p1, 0.0]]))  # -phi A log pi
    assert out.metrics["phi_max"].item() == pytest.approx(max(p0, p1))
    assert out.metrics["seq_weight_mean"].item() == pytest.approx((math.exp(0.3) + math.exp(-0.5)) / 2)


def test_vespo_weight_shape():
    # phi(1) = 1; phi peaks at W = k / lambda; it vanishes far off-policy on both sides, and stays finite
    lp = torch.zeros(5, 1, dtype=DT)
    log_w = T_([0.0, math.log(2 / 3), math.log(2 / 3) + 0.1, 20.0, -20.0]).unsqueeze(-1)
    g, _ = _grad(VESPO(), lp, lp - log_w, torch.ones(5, 1, dtype=DT))
    phi = -g.squeeze(-1)
    assert phi[0].item() == pytest.approx(1.0)
    assert phi[1] > phi[0] and phi[1] > phi[2]  # the peak at W = k_pos / lambda_pos = 2/3
    assert phi[3].item() == 0.0 and phi[4].item() < 1e-15 and torch.isfinite(g).all()


def test_vespo_closed_form_gradient():
    # phi carries no gradient by design (a weight, as an importance weight is), so gradcheck does not apply: the
    # gradient is -phi_i A_it on each loss token, with phi_i from the sequence's own masked log-ratio sum
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(3, 4, generator=g, dtype=DT) - 1
    mu = lp + 0.2 * torch.randn(3, 4, generator=g, dtype=DT)
    adv = T_([[1.0] * 4, [-0.5] * 4, [2.0] * 4])
    mask = T_([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    grad, _ = _grad(VESPO(k_pos=1.5, lambda_pos=2.5, k_neg=4.0, lambda_neg=1.0), lp, mu, adv, mask)
    for i in range(3):
        log_w = float(((lp[i] - mu[i]) * mask[i]).sum())
        phi = _phi(log_w, 1.5, 2.5) if adv[i, 0] >= 0 else _phi(log_w, 4.0, 1.0)
        torch.testing.assert_close(grad[i], -phi * adv[i] * mask[i])


@pytest.mark.parametrize("bad", [{"k_pos": 0.0}, {"lambda_neg": -1.0}, {"k_neg": float("nan")}])
def test_vespo_config_errors(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        VESPO(**bad)


def test_registry_names():
    assert resolve_path("loss", "dro") == "astratk.losses.dro.DRO"
    assert resolve_path("loss", "vespo") == "astratk.losses.vespo.VESPO"
    assert resolve_path("loss", "luspo") == "astratk.losses.gspo.LUSPO"
