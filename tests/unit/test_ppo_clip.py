"""PPO / GRPO clip, rollout-anchored: values, gradient per clip region, clip-higher, dual clip."""

import pytest
import torch

from astratk.contracts import LossInputs
from astratk.losses.ppo_clip import PPOClip

DT = torch.float64


def _run(loss, r, adv, mask=None):
    """mu = 1 (log mu = 0), so log pi = log r and r is exactly the given ratio."""
    logprobs = torch.log(torch.tensor([r], dtype=DT)).requires_grad_()
    mask = torch.ones(1, len(r), dtype=DT) if mask is None else torch.tensor([mask], dtype=DT)
    out = loss(LossInputs(logprobs, torch.zeros(1, len(r), dtype=DT), torch.tensor([adv], dtype=DT), mask))
    (grad,) = torch.autograd.grad(out.token_losses.sum(), logprobs)
    return out, grad[0]


def test_values_and_gradient_per_region():
    # eps 0.2; l = max(-A r, -A clip(r, 0.8, 1.2)); d l / d log pi = -A r where unclipped, 0 where clipped
    # t0 A  1, r 1.5: max(-1.5, -1.2) = -1.2   clipped high, grad 0
    # t1 A  1, r 0.5: max(-0.5, -0.8) = -0.5   toward mu, grad -0.5
    # t2 A -1, r 0.5: max( 0.5,  0.8) =  0.8   clipped low, grad 0
    # t3 A -1, r 1.5: max( 1.5,  1.2) =  1.5   toward mu, grad 1.5
    # t4 A  2, r 1.1: inside, -2.2, grad -2.2
    # t5 masked: 0
    out, grad = _run(PPOClip(), [1.5, 0.5, 0.5, 1.5, 1.1, 3.0], [1.0, 1.0, -1.0, -1.0, 2.0, 5.0], [1, 1, 1, 1, 1, 0])
    torch.testing.assert_close(out.token_losses[0], torch.tensor([-1.2, -0.5, 0.8, 1.5, -2.2, 0.0], dtype=DT))
    torch.testing.assert_close(grad, torch.tensor([0.0, -0.5, 0.0, 1.5, -2.2, 0.0], dtype=DT))
    m = {k: v.item() for k, v in out.metrics.items()}
    assert (m["clip_frac"], m["clip_frac_low"], m["clip_frac_high"]) == pytest.approx((2 / 5, 1 / 5, 1 / 5))
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5 + 1.5 + 1.1) / 5)
    assert m["ratio_max"] == pytest.approx(1.5)  # the masked r = 3 does not count
    assert "dual_clip_frac" not in m


def test_clip_higher_is_asymmetric():
    # DAPO: eps_low 0.2, eps_high 0.28. A > 0, r 1.25 is clipped under symmetric 0.2 but not under 0.28;
    # A < 0, r 0.75 is below 1 - 0.2 in both, so still clipped.
    r, adv = [1.25, 0.75], [1.0, -1.0]
    _, sym = _run(PPOClip(0.2), r, adv)
    out, dapo = _run(PPOClip(0.2, eps_high=0.28), r, adv)
    torch.testing.assert_close(sym, torch.tensor([0.0, 0.0], dtype=DT))
    torch.testing.assert_close(dapo, torch.tensor([-1.25, 0.0], dtype=DT))
    assert out.metrics["clip_frac_high"].item() == 0.0 and out.metrics["clip_frac_low"].item() == 0.5
    # above 1 + eps_high the gradient is zero again: r 1.3 > 1.28
    _, g = _run(PPOClip(0.2, eps_high=0.28), [1.3], [1.0])
    assert g.item() == 0.0


def test_dual_clip_caps_negative_advantage_loss():
    # c = 3: A -1, r 4: max(4, 1.2) = 4 -> min(4, 3) = 3, grad 0; r 2: 2 < 3 unchanged, grad 2; A 1, r 4: -1.2 as before
    r, adv = [4.0, 2.0, 4.0], [-1.0, -1.0, 1.0]
    out, grad = _run(PPOClip(dual_clip=3.0), r, adv)
    torch.testing.assert_close(out.token_losses[0], torch.tensor([3.0, 2.0, -1.2], dtype=DT))
    torch.testing.assert_close(grad, torch.tensor([0.0, 2.0, 0.0], dtype=DT))
    assert out.metrics["dual_clip_frac"].item() == pytest.approx(1 / 3)
    plain, plain_grad = _run(PPOClip(), r, adv)
    torch.testing.assert_close(plain.token_losses[0], torch.tensor([4.0, 2.0, -1.2], dtype=DT))
    torch.testing.assert_close(plain_grad, torch.tensor([4.0, 2.0, 0.0], dtype=DT))


def test_unclipped_gradient_is_minus_adv_r_over_random_tokens():
    g = torch.Generator().manual_seed(0)
    r = torch.exp(0.5 * torch.randn(200, generator=g, dtype=DT))
    adv = torch.randn(200, generator=g, dtype=DT)
    out, grad = _run(PPOClip(0.2, eps_high=0.28), r.tolist(), adv.tolist())
    clipped = ((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8))
    torch.testing.assert_close(grad, torch.where(clipped, torch.zeros_like(r), -adv * r))
    assert out.metrics["clip_frac"].item() == pytest.approx(clipped.double().mean().item())
    assert out.metrics["kl_k3"].item() == pytest.approx(((r - 1) - r.log()).mean().item())


def test_gradcheck_float64():
    # ratios kept away from the kinks at 0.8, 1.2 and c = 3 (gradcheck's finite differences would straddle them)
    r = torch.tensor([[0.5, 0.9, 1.1, 1.5, 4.0], [0.7, 1.0, 1.3, 2.0, 0.95]], dtype=DT)
    adv = torch.tensor([[1.0, -1.0, 2.0, -0.5, -1.0], [-1.0, 0.5, 1.0, 1.0, -2.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 1]], dtype=DT)
    loss = PPOClip(dual_clip=3.0)
    logprobs = r.log().requires_grad_()
    behavior = torch.zeros_like(r)
    assert torch.autograd.gradcheck(lambda lp: loss(LossInputs(lp, behavior, adv, mask)).token_losses, (logprobs,))


def test_all_zero_mask_is_finite():
    out, grad = _run(PPOClip(dual_clip=3.0), [1.5, float("nan")], [1.0, -1.0], [0, 0])
    assert torch.equal(out.token_losses, torch.zeros(1, 2, dtype=DT)) and torch.equal(grad, torch.zeros(2, dtype=DT))
    assert all(v.item() == 0.0 for v in out.metrics.values())


@pytest.mark.parametrize("kwargs, match", [
    ({"eps_low": -0.1}, "eps_low must be in"),
    ({"eps_low": 1.0}, "eps_low must be in"),
    ({"eps_high": 0.0}, "eps_high must be > 0"),
    ({"dual_clip": 1.0}, "dual_clip must be > 1"),
])
def test_bad_config_raises_with_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOClip(**kwargs)


def test_eps_high_defaults_to_eps_low():
    assert PPOClip(0.1).eps_high == 0.1 and PPOClip(0.2, 0.28).eps_high == 0.28
