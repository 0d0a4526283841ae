"""M2PO, both forms (arXiv 2510.01161; AstraFlow's clip form): the greedy largest-m2 cut on hand
examples, bisection == sort on random inputs, the same answer split over simulated DDP ranks, tau' and the caps."""

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from astratk.contracts import LossInputs
from astratk.losses.m2po import M2PO, M2POClip, second_moment_cut

DT = torch.float64


def _inputs(log_r, adv, mask=None, proximal=None):
    logp = torch.tensor([log_r], dtype=DT).requires_grad_()  # mu = 1: log pi = log r
    mask = torch.ones_like(logp) if mask is None else torch.tensor([mask], dtype=DT)
    return LossInputs(logp, torch.zeros_like(logp), torch.tensor([adv], dtype=DT), mask, proximal_logprobs=proximal)


def _grad(out, inp):
    return torch.autograd.grad(out.token_losses.sum(), inp.logprobs)[0][0]


def sort_cut(m2, select, tau):
    """The definition: sort descending, drop from the top until the rest's mean is <= tau. (keep, smallest dropped)."""
    vals = m2.float().double()
    desc = sorted(vals[select].tolist(), reverse=True)
    k = 0
    while k < len(desc) and sum(desc[k:]) > tau * (len(desc) - k):
        k += 1
    cut = desc[k - 1] if k else math.inf  # the smallest dropped value
    return select & (vals < cut), cut


# ------------------------------------------------------------------------------------------------------- paper form


def test_m2po_masks_exactly_the_largest_m2_tokens():
    # tau 0.05; log r = (0, 0.1, -0.5, 1, 0.3, pad) -> m2 = (0, 0.01, 0.25, 1, 0.09)
    # mean 1.35/5 = 0.27 > 0.05; drop 1 -> 0.35/4 = 0.0875 > 0.05; drop 0.25 -> 0.10/3 = 0.0333 <= 0.05: stop
    inp = _inputs([0.0, 0.1, -0.5, 1.0, 0.3, float("nan")], [1.0, -1.0, 2.0, 1.0, -2.0, 1.0], [1, 1, 1, 1, 1, 0])
    out = M2PO(tau=0.05)(inp)
    kept = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=DT)
    torch.testing.assert_close(out.mask[0], kept)  # the masked tokens leave the returned mask
    r = torch.exp(torch.tensor([0.0, 0.1, -0.5, 1.0, 0.3, 0.0], dtype=DT))
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0, -2.0, 1.0], dtype=DT)
    torch.testing.assert_close(out.token_losses[0], -adv * r * kept)  # PG-IS on the rest
    torch.testing.assert_close(_grad(out, inp), -adv * r * kept)  # c = r M
    m = {k: v.item() for k, v in out.metrics.items()}
    assert (m["m2_mean"], m["m2_mean_kept"], m["mask_frac"]) == pytest.approx((0.27, 0.1 / 3, 0.4), rel=1e-6)


def test_m2po_keeps_everything_within_budget():
    inp = _inputs([0.05, -0.08, 0.1], [1.0, -1.0, 1.0])  # mean m2 = 0.0189/3 = 0.0063 <= 0.01
    out = M2PO()(inp)
    assert torch.equal(out.mask, torch.ones(1, 3, dtype=DT)) and out.metrics["mask_frac"].item() == 0.0


@pytest.mark.parametrize("seed", range(6))
def test_bisection_equals_sort(seed):
    g = torch.Generator().manual_seed(seed)
    n = [1, 7, 64, 300, 1000, 50][seed]
    m2 = torch.randn(2, n, generator=g, dtype=DT).pow(2) * [0.001, 0.01, 0.1, 1.0, 5.0, 100.0][seed]
    select = torch.rand(2, n, generator=g) < 0.8
    m2[0, 0] = 0.0  # exact zeros are fine
    for tau in (1e-4, 0.004, 0.01, 0.1, 10.0):
        keep, cut = second_moment_cut(m2, select, tau)
        ref_keep, ref_cut = sort_cut(m2, select, tau)
        assert torch.equal(keep, ref_keep), (seed, tau)
        assert cut.item() == pytest.approx(ref_cut, rel=1e-6) if math.isfinite(ref_cut) else math.isinf(cut.item())


def test_cut_edge_cases():
    none = torch.zeros(1, 3, dtype=torch.bool)
    keep, cut = second_moment_cut(torch.ones(1, 3), none, 0.01)
    assert not keep.any() and math.isinf(cut.item())
    keep, cut = second_moment_cut(torch.tensor([[0.5, 0.7]]), torch.ones(1, 2, dtype=torch.bool), 0.01)
    assert not keep.any() and cut.item() == pytest.approx(0.5)  # every token dropped; the smallest was 0.5


class _FakeAllReduce:
    """`reduce` for `world` threads standing in for DDP ranks: each call returns the sum of every rank's tensor."""

    def __init__(self, world):
        self.barrier, self.slots = threading.Barrier(world, timeout=30), [None] * world

    def for_rank(self, rank):
        def reduce(x):
            self.slots[rank] = x.clone()
            self.barrier.wait()
            total = sum(self.slots)
            self.barrier.wait()
            return total
        return reduce


@pytest.mark.parametrize("loss", [M2PO(tau=0.02), M2POClip(tau=0.02)], ids=repr)
def test_split_over_ranks_gives_the_single_process_answer(loss):
    g = torch.Generator().manual_seed(11)
    log_mu = torch.log(torch.rand(6, 10, generator=g, dtype=DT) * 0.9 + 0.05)
    logp = log_mu + 0.3 * torch.randn(6, 10, generator=g, dtype=DT)
    adv = torch.randn(6, 10, generator=g, dtype=DT)
    mask = (torch.rand(6, 10, generator=g) < 0.8).to(DT)
    whole = loss(LossInputs(logp, log_mu, adv, mask))
    fake = _FakeAllReduce(3)

    def rank(i):
        rows = slice(2 * i, 2 * i + 2)
        return loss(LossInputs(logp[rows], log_mu[rows], adv[rows], mask[rows], reduce=fake.for_rank(i)))

    with ThreadPoolExecutor(3) as pool:
        parts = list(pool.map(rank, range(3)))
    torch.testing.assert_close(torch.cat([p.token_losses for p in parts]), whole.token_losses)
    torch.testing.assert_close(torch.cat([p.mask for p in parts]), whole.mask)
    if isinstance(loss, M2PO):
        assert whole.mask.sum() < mask.sum()  # the cut binds in this sample
    else:
        assert whole.metrics["clip_active"].item() == 1.0
    for key in ("m2_mean", "mask_frac", "m2_away_mean", "tau_prime"):  # batch-wide metrics agree on every rank
        if key in whole.metrics:
            assert all(p.metrics[key].item() == pytest.approx(whole.metrics[key].item()) for p in parts)


def test_m2po_closed_form_gradient_random():
    g = torch.Generator().manual_seed(3)
    log_mu = torch.log(torch.rand(4, 20, generator=g, dtype=DT) * 0.9 + 0.05)
    logp = (log_mu + 0.2 * torch.randn(4, 20, generator=g, dtype=DT)).requires_grad_()
    adv = torch.randn(4, 20, generator=g, dtype=DT)
    out = M2PO(tau=0.01)(LossInputs(logp, log_mu, adv, torch.ones_like(adv)))
    (grad,) = torch.autograd.grad(out.token_losses.sum(), logp)
    log_r = (logp - log_mu).detach()
    keep, _ = sort_cut(log_r ** 2, torch.ones_like(adv, dtype=torch.bool), 0.01)
    assert 0 < int((~keep).sum()) < keep.numel()
    torch.testing.assert_close(grad, -adv * log_r.exp() * keep)


# -------------------------------------------------------------------------------------------------------- clip form


def test_m2po_clip_tau_prime_hand_example():
    # tau 0.05; log r = (.1, .2, 1, -.3, -.5, -.6, .7), A = (1, 1, 1, 1, -1, -1, -1)
    # moving away: t0 t1 t2 (A > 0, r > 1) and t4 t5 (A < 0, r < 1); t3, t6 move back toward mu
    # their m2 = (.01, .04, 1, .25, .36): mean .332; drop 1 -> .165; drop .36 -> .10; drop .25 -> .025 <= .05
    # m2_c = .25, tau' = .5: clip r to [e^-.5, e^.5] = [0.6065, 1.6487] (caps .95 and 20 do not bind)
    # t2 (r = e > 1.6487, A > 0) and t5 (r = e^-.6 < 0.6065, A < 0) lose their gradient; t4 sits exactly on the
    # lower bound (r = e^-.5, exact in floating point here) and keeps it; t6 moves back, never clipped
    log_r = [0.1, 0.2, 1.0, -0.3, -0.5, -0.6, 0.7]
    adv = [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
    inp = _inputs(log_r, adv)
    out = M2POClip(tau=0.05)(inp)
    m = {k: v.item() for k, v in out.metrics.items()}
    assert (m["tau_prime"], m["clip_active"], m["m2_away_mean"]) == pytest.approx((0.5, 1.0, 0.332))
    assert (m["clip_frac"], m["clip_frac_low"], m["clip_frac_high"]) == pytest.approx((2 / 7, 1 / 7, 1 / 7))
    r = torch.exp(torch.tensor(log_r, dtype=DT))
    a = torch.tensor(adv, dtype=DT)
    expected = -a * r
    expected[2], expected[5] = -math.exp(0.5), math.exp(-0.5)  # -A * bound
    torch.testing.assert_close(out.token_losses[0], expected)
    clipped = torch.tensor([0, 0, 1, 0, 0, 1, 0], dtype=torch.bool)
    torch.testing.assert_close(_grad(out, inp), torch.where(clipped, 0.0, -a * r))
    assert out.mask.sum().item() == 7  # clipping keeps tokens in the token-mean denominator


def test_m2po_clip_caps_and_no_clip():
    # log r = (.05, 4, -3.5, -3.2), A = (1, 1, -1, -1), all moving away; tau .01: m2 = (.0025, 16, 12.25, 10.24);
    # drop 16, 12.25, 10.24 (means 7.5, 5.12 > .01), rest .0025: m2_c = 10.24, tau' = 3.2
    # e^-3.2 = .041 -> offset .959 capped at .95: lower .05; e^3.2 - 1 = 23.5 capped at 20: upper 21
    inp = _inputs([0.05, 4.0, -3.5, -3.2], [1.0, 1.0, -1.0, -1.0])
    out = M2POClip(tau=0.01)(inp)
    assert out.metrics["tau_prime"].item() == pytest.approx(3.2, rel=1e-6)
    torch.testing.assert_close(out.token_losses[0], torch.tensor([-math.exp(0.05), -21.0, 0.05, 0.05], dtype=DT))
    torch.testing.assert_close(_grad(out, inp), torch.tensor([-math.exp(0.05), 0.0, 0.0, 0.0], dtype=DT))
    # within budget: no clip at all, so the loss is PG-IS even for a far-off token that moves back toward mu
    inp = _inputs([0.05, -0.05, 5.0], [1.0, -1.0, -1.0])
    out = M2POClip(tau=0.01)(inp)
    assert (out.metrics["clip_active"].item(), out.metrics["tau_prime"].item()) == (0.0, 0.0)
    r = torch.exp(torch.tensor([0.05, -0.05, 5.0], dtype=DT))
    torch.testing.assert_close(_grad(out, inp), -torch.tensor([1.0, -1.0, -1.0], dtype=DT) * r)


def test_m2po_clip_closed_form_gradient_random():
    g = torch.Generator().manual_seed(4)
    log_mu = torch.log(torch.rand(4, 25, generator=g, dtype=DT) * 0.9 + 0.05)
    logp = (log_mu + 0.3 * torch.randn(4, 25, generator=g, dtype=DT)).requires_grad_()
    adv = torch.randn(4, 25, generator=g, dtype=DT)
    out = M2POClip(tau=0.01)(LossInputs(logp, log_mu, adv, torch.ones_like(adv)))
    (grad,) = torch.autograd.grad(out.token_losses.sum(), logp)
    log_r = (logp - log_mu).detach()
    r = log_r.exp()
    away = ((adv > 0) & (r > 1)) | ((adv < 0) & (r < 1))
    _, m2_c = sort_cut(log_r ** 2, away, 0.01)
    tp = math.sqrt(m2_c)
    lower, upper = 1 - min(1 - math.exp(-tp), 0.95), 1 + min(math.exp(tp) - 1, 20.0)
    assert out.metrics["tau_prime"].item() == pytest.approx(tp, rel=1e-6)
    clipped = ((adv > 0) & (r > upper)) | ((adv < 0) & (r < lower))
    boundary = (log_r.float() ** 2).double() == m2_c  # the smallest dropped token: on the bound up to rounding
    assert int(clipped.sum()) > 0 and int(boundary.sum()) == 1
    expected = torch.where(clipped, 0.0, -adv * r)
    torch.testing.assert_close(grad[~boundary], expected[~boundary])


def test_m2po_clip_recompute_anchors_on_proximal():
    g = torch.Generator().manual_seed(5)
    prox = torch.log(torch.rand(3, 8, generator=g, dtype=DT) * 0.9 + 0.05)
    logp = prox + 0.3 * torch.randn(3, 8, generator=g, dtype=DT)
    adv, ones = torch.randn(3, 8, generator=g, dtype=DT), torch.ones(3, 8, dtype=DT)
    garbage_mu = prox - 5.0  # would clip everything if it were the anchor
    loss = M2POClip(recompute=True)
    assert loss.needs_proximal and not M2POClip().needs_proximal and loss.batch_statistics
    a = loss(LossInputs(logp, garbage_mu, adv, ones, proximal_logprobs=prox))
    b = M2POClip()(LossInputs(logp, prox, adv, ones))
    torch.testing.assert_close(a.token_losses, b.token_losses)
    with pytest.raises(ValueError, match="needs LossInputs.proximal_logprobs"):
        loss(LossInputs(logp, garbage_mu, adv, ones))


@pytest.mark.parametrize("log_r, adv, active", [
    ([[0.05, -0.04, 0.3, 0.2], [-0.1, 0.07, -0.6, 0.0]], [[1.0, -1.0, -1.0, 1.0], [1.0, 1.0, 1.0, -1.0]], 0.0),
    ([[0.05, 4.0, -3.5, -3.3], [0.5, -0.6, 2.0, -2.0]], [[1.0, 1.0, -1.0, -1.0], [-1.0, 1.0, -1.0, 1.0]], 1.0),
])
def test_m2po_clip_gradcheck_float64(log_r, adv, active):
    # tau' is a detached batch statistic; gradcheck is exact where the bounds do not move with log pi: no clip
    # active, or tau' beyond both caps (bounds fixed at 0.05 and 21); the closed-form test covers the rest
    logp = torch.tensor(log_r, dtype=DT).requires_grad_()
    adv, mu = torch.tensor(adv, dtype=DT), torch.zeros(2, 4, dtype=DT)
    loss = M2POClip(tau=0.1)
    out = loss(LossInputs(logp, mu, adv, torch.ones_like(mu)))
    assert out.metrics["clip_active"].item() == active and out.metrics["tau_prime"].item() in (0.0, pytest.approx(3.3))
    assert torch.autograd.gradcheck(lambda lp: loss(LossInputs(lp, mu, adv, torch.ones_like(mu))).token_losses,
                                    (logp,))
