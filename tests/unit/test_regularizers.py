"""KL to a reference (k1, k3) and entropy: values, gradients, chunking."""

import math

import pytest
import torch

from astratk.training.regularizers import entropy_from_logits, kl_to_reference

DT = torch.float64


def test_kl_golden_values():
    # pi = 0.5, pi_ref = 0.25: k1 = log 2 = 0.693147; d = log(0.25 / 0.5) = -log 2, k3 = e^d - d - 1 = 0.5 + log 2 - 1
    lp, ref = torch.log(torch.tensor([[0.5]], dtype=DT)), torch.log(torch.tensor([[0.25]], dtype=DT))
    assert kl_to_reference(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_to_reference(lp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    # pi = 0.25, pi_ref = 0.5: k1 = -log 2 (k1 can be negative), k3 = 2 - log 2 - 1 >= 0
    assert kl_to_reference(ref, lp, "k1").item() == pytest.approx(-math.log(2))
    assert kl_to_reference(ref, lp, "k3").item() == pytest.approx(1 - math.log(2))
    # equal policies: both 0 exactly
    assert kl_to_reference(lp, lp, "k3").item() == 0.0 and kl_to_reference(lp, lp, "k1").item() == 0.0
    with pytest.raises(ValueError, match="k1"):
        kl_to_reference(lp, ref, "k2")


def test_kl_gradients_match_closed_form():
    # d k1 / d log pi = 1; d k3 / d log pi = 1 - pi_ref / pi; nothing flows to the reference
    pi = torch.tensor([[0.5, 0.1, 0.9]], dtype=DT)
    pi_ref = torch.tensor([[0.25, 0.3, 0.9]], dtype=DT)
    lp = torch.log(pi).requires_grad_()
    ref = torch.log(pi_ref).requires_grad_()
    (g1,) = torch.autograd.grad(kl_to_reference(lp, ref, "k1").sum(), lp)
    torch.testing.assert_close(g1, torch.ones_like(g1))
    (g3,) = torch.autograd.grad(kl_to_reference(lp, ref, "k3").sum(), lp)
    torch.testing.assert_close(g3, 1 - pi_ref / pi)  # [0.5, -2, 0]
    assert torch.autograd.gradcheck(lambda x: kl_to_reference(x, ref, "k3"), (lp,))
    assert kl_to_reference(lp, ref).grad_fn is not None and ref.grad is None


def _direct_entropy(logits, temperature):
    logp = torch.log_softmax(logits.double() / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def test_entropy_matches_direct_computation_and_gradient():
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 17)).requires_grad_()
    # chunk_size 3 over 10 positions: four chunks, the last partial; checkpointed because logits require grad
    h = entropy_from_logits(logits, temperature=0.7, chunk_size=3)
    assert h.shape == (2, 5) and h.dtype == torch.float32
    direct = _direct_entropy(logits, 0.7)
    torch.testing.assert_close(h.double(), direct, rtol=1e-5, atol=1e-5)
    w = torch.randn(2, 5)
    (g,) = torch.autograd.grad((h * w).sum(), logits)
    (g_direct,) = torch.autograd.grad((direct * w.double()).sum(), logits)
    torch.testing.assert_close(g, g_direct, rtol=1e-4, atol=1e-5)  # both grads w.r.t. the fp32 logits
    with torch.no_grad():
        torch.testing.assert_close(entropy_from_logits(logits, 0.7), h.detach())


def test_entropy_bounds():
    # uniform over V: log V (the maximum); one-hot-ish: ~0; temperature 0 counts as 1
    assert entropy_from_logits(torch.zeros(3, 8)).tolist() == pytest.approx([math.log(8)] * 3)
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
    x = torch.randn(4, 6)
    torch.testing.assert_close(entropy_from_logits(x, temperature=0.0), entropy_from_logits(x))
