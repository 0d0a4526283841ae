"""DPPO (arXiv 2602.04879): golden divergences and masks, zero/full gradients, every variant's gradient
against a closed form with an independent (id-based) divergence, the App. B lower bound, gradcheck, errors."""

import doctest
import math

import pytest
import torch

from astratk.config import to_plain
from astratk.contracts import LossInputs, PolicyLoss
from astratk.losses import dppo
from astratk.losses.dppo import DPPO, DPPOBinaryKL, DPPOTopKKL, DPPOTopKTV, binary_divergence, topk_divergence
from astratk.registry import resolve

DT = torch.float64
T_ = lambda x: torch.tensor(x, dtype=DT)


def _inputs(pi, mu, adv, mask=None, **kw):
    return LossInputs(logprobs=torch.log(T_([pi])).requires_grad_(), behavior_logprobs=torch.log(T_([mu])),
                      advantages=T_([adv]), loss_mask=torch.ones(1, len(pi), dtype=DT) if mask is None else T_([mask]),
                      **kw)


def _grad(out, inp):
    return torch.autograd.grad(out.token_losses.sum(), inp.logprobs)[0]


# t0 mu .5 -> pi .7,  A +1: away from mu; TV .2 > .15, KL .5 ln(.5/.7) + .5 ln(.5/.3) = .0871767 > .05 -> masked, grad 0
# t1 mu .5 -> pi .6,  A +1: away; TV .1, KL .5 ln(.5/.6) + .5 ln(.5/.4) = .0204110 -> kept: r 1.2, grad -1.2,
#    loss -1 * 1.2 * ln .6 = 0.6129907 (not the surrogate value -1.2)
# t2 mu .5 -> pi .3,  A +1: TV .2 but A > 0 raises pi back toward mu -> never masked: r .6, grad -.6, loss -.6 ln .3
# t3 mu .5 -> pi .3,  A -1: away; TV .2, KL .0871767 -> masked
# t4 mu .5 -> pi .7,  A -2: toward mu -> kept: r 1.4, grad 2.8, loss 2 * 1.4 * ln .7 = -0.9986898
# t5 mu .99 -> pi .8, A -1: TV .19, KL .99 ln(.99/.8) + .01 ln(.01/.2) = .1810050 -> masked (PPO: r .81, not clipped)
# t6 mu 1e-4 -> pi 1e-2, A +1: TV .0099, KL 1e-4 ln(1e-2) + .9999 ln(.9999/.99) = .0094888 -> kept although r = 100
#    (PPO would clip it: DPPO's long-tail example); grad -100, loss -100 ln .01 = 460.517
# t7 padding: NaN log pi, -inf log mu, mask 0 -> 0 everywhere, no NaN
PI = [0.7, 0.6, 0.3, 0.3, 0.7, 0.8, 1e-2, float("nan")]
MU = [0.5, 0.5, 0.5, 0.5, 0.5, 0.99, 1e-4, 0.0]
ADV = [1.0, 1.0, 1.0, -1.0, -2.0, -1.0, 1.0, 3.0]
MASK = [1, 1, 1, 1, 1, 1, 1, 0]
TV = [0.2, 0.1, 0.2, 0.2, 0.2, 0.19, 0.0099, 0.0]
KL = [0.0871767, 0.0204110, 0.0871767, 0.0871767, 0.0871767, 0.1810050, 0.0094888, 0.0]


def test_binary_divergence_golden_values():
    lp, lmu = torch.log(T_(PI[:7])), torch.log(T_(MU[:7]))
    torch.testing.assert_close(binary_divergence("tv", lp, lmu), T_(TV[:7]))
    torch.testing.assert_close(binary_divergence("kl", lp, lmu), T_(KL[:7]), atol=1e-7, rtol=0)


@pytest.mark.parametrize("loss", [DPPO(), DPPO("binary_kl")], ids=["tv", "kl"])
def test_golden_mask_values_and_gradients(loss):
    inp = _inputs(PI, MU, ADV, MASK)
    out = loss(inp)
    ln = math.log
    expected = [0.0, -1.2 * ln(0.6), -0.6 * ln(0.3), 0.0, 2.8 * ln(0.7), 0.0, -100 * ln(0.01), 0.0]
    torch.testing.assert_close(out.token_losses[0], T_(expected))
    torch.testing.assert_close(out.mask[0], T_(MASK))  # DPPO-masked tokens stay in the denominator
    torch.testing.assert_close(_grad(out, inp)[0], T_([0.0, -1.2, -0.6, 0.0, 2.8, 0.0, -100.0, 0.0]))

    m = {k: v.item() for k, v in out.metrics.items()}
    assert m["masked_frac"] == pytest.approx(3 / 7)  # t0, t3, t5
    assert m["masked_frac_pos"] == pytest.approx(1 / 4)  # A > 0: t0 of t0, t1, t2, t6
    assert m["masked_frac_neg"] == pytest.approx(2 / 3)  # A < 0: t3, t5 of t3, t4, t5
    div = TV if loss.divergence == "binary_tv" else KL
    assert m["divergence_mean"] == pytest.approx(sum(div[:7]) / 7, abs=1e-7)
    assert m["divergence_max"] == pytest.approx(max(div), abs=1e-7)
    r = [0.7 / 0.5, 1.2, 0.6, 0.6, 1.4, 0.8 / 0.99, 100.0]
    assert (m["ratio_mean"], m["ratio_max"]) == pytest.approx((sum(r) / 7, 100.0))
    assert m["kl_k3"] == pytest.approx(sum(x - 1 - ln(x) for x in r) / 7)
    assert m["tv_mean"] == pytest.approx(sum(TV[:7]) / 7)
    assert "truncated_frac" not in m and all(not v.requires_grad for v in out.metrics.values())


def test_clip_ratio_truncates_the_coefficient():
    # C = 5: t6's coefficient min(100, 5) = 5 -> grad -5, loss -5 ln .01; t4's r 1.4 < 5 unchanged
    inp = _inputs(PI, MU, ADV, MASK)
    out = DPPO(clip_ratio=5.0)(inp)
    torch.testing.assert_close(_grad(out, inp)[0], T_([0.0, -1.2, -0.6, 0.0, 2.8, 0.0, -5.0, 0.0]))
    assert out.token_losses[0, 6].item() == pytest.approx(-5 * math.log(0.01))
    assert out.metrics["truncated_frac"].item() == pytest.approx(1 / 7)


def test_weights_scale_token_losses_not_mask():
    inp = _inputs([0.6, 0.3], [0.5, 0.5], [1.0, 1.0], weights=T_([[0.5, 2.0]]))
    out = DPPO()(inp)
    torch.testing.assert_close(out.token_losses, T_([[-0.6 * math.log(0.6), -1.2 * math.log(0.3)]]))
    torch.testing.assert_close(out.mask, torch.ones(1, 2, dtype=DT))


# ---------------------------------------------------------------------------------------------------- top-K, K = 3
# vocabulary of 5: mu = [.4, .3, .2, .06, .04], pi = [.3, .4, .2, .05, .05]; top-3 of mu = ids 0, 1, 2
# sampled id 3 (not in the top-K): cells {0}, {1}, {2}, {3}, rest {4}: TV = 1/2 (.1 + .1 + 0 + .01 + .01) = .11,
#   KL = .4 ln(4/3) + .3 ln(3/4) + 0 + .06 ln(6/5) + .04 ln(4/5) = .1150728 - .0863046 + .0109393 - .0089257 = .0307818
#   Binary on the same token: TV |.05 - .06| = .01, KL .06 ln(6/5) + .94 ln(.94/.95) = .0009921
# sampled id 1 (in the top-K, its engine log mu 1e-7 off the top-K entry's, as two kernels give): entry 1 is dropped
#   (matched by id, so the 1e-7 does not matter),
#   cells {0}, {2}, {1}, rest {3, 4} (mu .1, pi .1): TV = 1/2 (.1 + 0 + .1 + 0) = .1, KL = .4 ln(4/3) + .3 ln(3/4)
#   = .0287682. Counting the sampled token twice would give TV 1/2 (.1 + .1 + 0 + .1) + 0 (rest clamped) = .15.
MU5, PI5 = [0.4, 0.3, 0.2, 0.06, 0.04], [0.3, 0.4, 0.2, 0.05, 0.05]


def _topk_inputs(adv, nudge=1e-7):
    top_mu, top_pi = torch.log(T_([[MU5[:3]] * 2])), torch.log(T_([[PI5[:3]] * 2]))  # [1, 2, 3]
    inp = _inputs([PI5[3], PI5[1]], [MU5[3], MU5[1]], adv, topk_ids=torch.tensor([[[0, 1, 2]] * 2]),
                  topk_behavior_logprobs=top_mu, topk_logprobs=top_pi, sampled_ids=torch.tensor([[3, 1]]))
    inp.behavior_logprobs[0, 1] += nudge
    return inp


def test_topk_golden_values_and_dedupe():
    inp = _topk_inputs([1.0, 1.0])
    args = (inp.logprobs, inp.behavior_logprobs, inp.topk_logprobs, inp.topk_behavior_logprobs, inp.topk_ids,
            inp.sampled_ids)
    torch.testing.assert_close(topk_divergence("tv", *args), T_([[0.11, 0.1]]))
    torch.testing.assert_close(topk_divergence("kl", *args), T_([[0.0307818, 0.0287682]]), atol=1e-7, rtol=0)
    torch.testing.assert_close(binary_divergence("tv", *args[:2]), T_([[0.01, 0.1]]))
    assert binary_divergence("kl", *args[:2])[0, 0].item() == pytest.approx(0.0009921, abs=1e-7)


def test_topk_masks_where_binary_does_not():
    # delta .105, token 0 has A < 0 and pi .05 < mu .06 (away): Top-K TV .11 > .105 masks it, Binary-TV .01 does not;
    # token 1 has A > 0 and pi .4 > mu .3 (away) but Top-K TV .1 <= .105: kept, grad -A r = -4/3
    inp = _topk_inputs([-1.0, 1.0])
    out = DPPO("topk_tv", delta=0.105, top_k=3)(inp)
    torch.testing.assert_close(_grad(out, inp)[0], T_([0.0, -4 / 3]), rtol=1e-6, atol=0)
    inp = _topk_inputs([-1.0, 1.0])
    torch.testing.assert_close(_grad(DPPO(delta=0.105)(inp), inp)[0, 0], T_(0.05 / 0.06))


# ------------------------------------------------------------ top-K: the sampled token is matched by id, not by log mu
# bf16 logits often give two top-K entries the same log mu; the sampled token must still be matched by its id.
# top-K ids (5, 7, 9); "t" = a top-K entry, "s" = the sampled cell, "rest" = 1 - the others (clamped at 1e-12).
# tie_a: mu_top (.4, .3, .3), pi_top (.6, .1, .3), sampled id 9 (3rd) with mu = pi = .3 (ties with id 7's mu .3).
#   Cells t5 .4/.6, t7 .3/.1, s9 .3/.3 (t9 dropped), rest 0/0 (both clamped to 1e-12, contributes 0):
#   TV = 1/2 (.2 + .2 + 0) = .2;  KL = .4 ln(.4/.6) + .3 ln(.3/.1) = -.1621860 + .3295837 = .1673976.
#   Matching the nearest log mu drops t7 (the first tie) and counts token 9 twice: TV 1/2 (.2 + 0 + 0) = .1 and
#   KL .4 ln(.4/.6) = -.1621860 < 0. pi = mu: never masked, grad -A r = -(-1)(1) = 1.
# tie_b: as tie_a with pi_top (.6, .11, .29), the sampled id 9 at pi .29 < mu .3 and A = -1 (moving away from mu):
#   TV = 1/2 (.2 + .19 + .01) = .2 > .15;  KL = .4 ln(.4/.6) + .3 ln(.3/.11) + .3 ln(.3/.29) = .1489751 > .05
#   -> masked by both defaults: grad 0, loss 0. (Nearest log mu: TV 1/2 (.2 + .01 + .01) = .11 <= .15 and
#   KL .4 ln(.4/.6) + 2 * .3 ln(.3/.29) = -.1418451: kept with grad -A r = .29/.3 = .9667.)
# tie_c: mu_top (.3, .2, .2), pi_top (.3, .1, .2), sampled id 2 (not in the top-K) with mu = pi = .2 (ties with ids 7
#   and 9), rest mu .1, pi .2. Cells t5 .3/.3, t7 .2/.1, t9 .2/.2, s2 .2/.2, rest .1/.2 (the extra cell of the
#   definition): TV = 1/2 (.1 + .1) = .1;  KL = .2 ln 2 + .1 ln(1/2) = .1 ln 2 = .0693147. (Nearest log mu drops t7
#   into the rest, .3/.3: TV 0, KL 0.) pi = mu: never masked, grad -A r = -1.
TIES = {  # name: (mu_top, pi_top, sampled id, mu, pi, A, TV, KL, grad under either default delta)
    "tie_a": ((0.4, 0.3, 0.3), (0.6, 0.1, 0.3), 9, 0.3, 0.3, -1.0, 0.2, 0.1673976, 1.0),
    "tie_b": ((0.4, 0.3, 0.3), (0.6, 0.11, 0.29), 9, 0.3, 0.29, -1.0, 0.2, 0.1489751, 0.0),
    "tie_c": ((0.3, 0.2, 0.2), (0.3, 0.1, 0.2), 2, 0.2, 0.2, 1.0, 0.1, 0.0693147, -1.0),
}


def _tie_inputs(name):
    mu_top, pi_top, sid, mu, pi, adv = TIES[name][:6]
    # log mu of the sampled token and of its tied entries are the same float64, as tied bf16 logits give
    return _inputs([pi], [mu], [adv], topk_ids=torch.tensor([[[5, 7, 9]]]), sampled_ids=torch.tensor([[sid]]),
                   topk_behavior_logprobs=torch.log(T_([[mu_top]])), topk_logprobs=torch.log(T_([[pi_top]])))


@pytest.mark.parametrize("name", sorted(TIES))
def test_topk_tied_log_mu_golden_divergences(name):
    inp = _tie_inputs(name)
    args = (inp.logprobs, inp.behavior_logprobs, inp.topk_logprobs, inp.topk_behavior_logprobs, inp.topk_ids,
            inp.sampled_ids)
    tv, kl = TIES[name][6:8]
    torch.testing.assert_close(topk_divergence("tv", *args), T_([[tv]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(topk_divergence("kl", *args), T_([[kl]]), rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", sorted(TIES))
@pytest.mark.parametrize("loss", [DPPOTopKTV(top_k=3), DPPOTopKKL(top_k=3)], ids=["tv", "kl"])
def test_topk_tied_log_mu_mask_and_gradient(loss, name):
    # Through the loss (default deltas .15 TV, .05 KL): the divergence it reports and the gradient the mask leaves
    inp = _tie_inputs(name)
    out = loss(inp)
    grad = TIES[name][8]
    torch.testing.assert_close(_grad(out, inp), T_([[grad]]), rtol=1e-12, atol=0)
    div = TIES[name][6] if loss.divergence == "topk_tv" else TIES[name][7]
    assert out.metrics["divergence_mean"].item() == pytest.approx(div, abs=1e-7)
    assert out.metrics["masked_frac"].item() == (1.0 if grad == 0.0 else 0.0)
    assert out.mask.tolist() == [[1.0]]  # masked or not, the token stays in the denominator


# ------------------------------------------------------------- every variant vs a closed form, independent divergence
def _random_batch(seed, b=3, t=8, v=8, k=3):
    g = torch.Generator().manual_seed(seed)
    mu_logits = 1.5 * torch.randn(b, t, v, generator=g, dtype=DT)
    mu = mu_logits.softmax(-1)  # [B, T, V]
    pi = (mu_logits + 0.6 * torch.randn(b, t, v, generator=g, dtype=DT)).softmax(-1)
    old = (mu_logits + 0.6 * torch.randn(b, t, v, generator=g, dtype=DT)).softmax(-1)  # a proximal policy
    s = torch.multinomial(mu.reshape(-1, v), 1, generator=g).reshape(b, t)  # sampled ids [B, T]
    top = mu.topk(k, -1).indices  # [B, T, K]
    adv = torch.randn(b, t, generator=g, dtype=DT)
    return mu, pi, old, s, top, adv


def _ref_divergence(kind, mu, pi, s, top, binary):
    """Partition by token ids (not by float matching): cells = top-K of mu, the sampled id, the rest."""
    ids = [] if binary else [i for i in top if i != s]
    cells = [[i] for i in ids] + [[s], [i for i in range(len(mu)) if i not in set(ids) | {s}]]
    pm, pp = ([sum(p[i] for i in c) for c in cells] for p in (mu, pi))
    if kind == "tv":
        return 0.5 * sum(abs(a - b) for a, b in zip(pm, pp))
    return sum(a * math.log(a / b) for a, b in zip(pm, pp) if a > 0)


VARIANTS = [("binary_tv", 0.05, "behavior"), ("binary_kl", 0.01, "behavior"), ("topk_tv", 0.1, "behavior"),
            ("topk_kl", 0.03, "behavior"), ("binary_tv", 0.05, "recompute"), ("binary_kl", 0.01, "recompute"),
            ("binary_tv", (0.02, 0.1), "behavior"), ("topk_kl", (0.05, 0.01), "behavior"),
            ("binary_tv", (0.1, 0.03), "recompute")]  # (delta_low, delta_high): asymmetric thresholds


@pytest.mark.parametrize("divergence, delta, anchor", VARIANTS)  # recompute + top-K is rejected (test_bad_config)
@pytest.mark.parametrize("clip_ratio", [None, 1.3])
def test_autograd_matches_closed_form(divergence, delta, clip_ratio, anchor):
    mu, pi, old, s, top, adv = _random_batch(seed=3)
    gather = lambda p, ids: p.gather(-1, ids).log()
    anc = old if anchor == "recompute" else mu  # the distribution D and the direction test are measured against
    low, high = delta if isinstance(delta, tuple) else (delta, delta)
    logprobs = gather(pi, s[..., None])[..., 0].requires_grad_()
    inp = LossInputs(logprobs, gather(mu, s[..., None])[..., 0], adv, torch.ones_like(adv),
                     proximal_logprobs=gather(old, s[..., None])[..., 0] if anchor == "recompute" else None,
                     topk_ids=top, topk_behavior_logprobs=gather(mu, top), topk_logprobs=gather(pi, top),
                     sampled_ids=s)
    out = DPPO(divergence, delta=0.5, delta_low=low, delta_high=high, clip_ratio=clip_ratio, anchor=anchor,
               top_k=3)(inp)
    (grad,) = torch.autograd.grad(out.token_losses.sum(), logprobs)

    kind, binary = divergence.split("_")[1], divergence.startswith("binary")
    expected, n_masked, n_trunc = torch.zeros_like(adv), 0, 0
    for i, j in torch.cartesian_prod(torch.arange(adv.shape[0]), torch.arange(adv.shape[1])).tolist():
        a_, p_, m_ = anc[i, j].tolist(), pi[i, j].tolist(), mu[i, j].tolist()
        sid, A = s[i, j].item(), adv[i, j].item()
        d = _ref_divergence(kind, a_, p_, sid, top[i, j].tolist(), binary)
        up, down = A > 0 and p_[sid] > a_[sid], A < 0 and p_[sid] < a_[sid]
        m = 0.0 if (up and d > high) or (down and d > low) else 1.0
        r = p_[sid] / m_[sid]  # the ratio stays anchored on the engine's mu under either anchor
        c = r if clip_ratio is None else min(r, clip_ratio)  # dl/dlog pi = -A sg(min(r, C)) M
        expected[i, j] = -A * c * m
        n_masked, n_trunc = n_masked + (m == 0), n_trunc + (clip_ratio is not None and r > clip_ratio)
    torch.testing.assert_close(grad, expected)
    assert 0 < n_masked < adv.numel()  # the example exercises both sides of the mask
    assert out.metrics["masked_frac"].item() == pytest.approx(n_masked / adv.numel())
    if clip_ratio is not None:
        assert n_trunc > 0 and out.metrics["truncated_frac"].item() == pytest.approx(n_trunc / adv.numel())


@pytest.mark.parametrize("k", [1, 3, 20])
def test_binary_lower_bounds_topk_lower_bounds_full(k):
    # App. B: coarser partitions give smaller TV and KL (data processing), so Binary <= Top-K <= full vocabulary
    mu, pi, _, s, top, _ = _random_batch(seed=k, b=20, t=25, v=50, k=k)
    lp, lmu = pi.gather(-1, s[..., None])[..., 0].log(), mu.gather(-1, s[..., None])[..., 0].log()
    tlp, tlmu = pi.gather(-1, top).log(), mu.gather(-1, top).log()
    assert bool((s[..., None] == top).any(-1).any()) and not bool((s[..., None] == top).any(-1).all())
    full = {"tv": 0.5 * (mu - pi).abs().sum(-1), "kl": (mu * (mu / pi).log()).sum(-1)}
    for kind in ("tv", "kl"):
        binary, topk = binary_divergence(kind, lp, lmu), topk_divergence(kind, lp, lmu, tlp, tlmu, top, s)
        assert bool((topk >= binary - 1e-7).all()) and bool((topk <= full[kind] + 1e-12).all())
        assert bool((topk > binary + 1e-3).any())  # and the bound is not trivially tight


def test_topk_covering_the_vocabulary_is_the_full_divergence():
    # K = V = 4: the rest cell is empty, 1 - sum rounds to ~ +-1e-16 and is clamped at 1e-12 (never negative, no NaN)
    mu, pi, _, s, top, _ = _random_batch(seed=7, b=10, t=30, v=4, k=4)
    args = (pi.gather(-1, s[..., None])[..., 0].log(), mu.gather(-1, s[..., None])[..., 0].log(),
            pi.gather(-1, top).log(), mu.gather(-1, top).log(), top, s)
    torch.testing.assert_close(topk_divergence("tv", *args), 0.5 * (mu - pi).abs().sum(-1))
    torch.testing.assert_close(topk_divergence("kl", *args), (mu * (mu / pi).log()).sum(-1))


@pytest.mark.parametrize("loss", [DPPO(), DPPO("binary_kl", clip_ratio=1.5), DPPO("topk_tv", top_k=3),
                                  DPPO("topk_kl", top_k=3), DPPO(anchor="recompute", clip_ratio=1.5)])
def test_gradcheck_float64(loss):
    # The anchor is built from lp.detach() - c inside the function, so finite differences keep r = e^c and the mask
    # fixed, exactly what sg() means; a forgotten detach on r or D would make autograd disagree with them.
    mu, pi, _, s, top, adv = _random_batch(seed=5, b=2, t=5)
    c = torch.tensor([[0.5, -0.4, 0.3, -0.2, 0.6], [-0.5, 0.4, -0.3, 0.2, 0.1]], dtype=DT)  # log r
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=DT)
    logprobs = pi.gather(-1, s[..., None])[..., 0].log().requires_grad_()
    topk = {"topk_behavior_logprobs": mu.gather(-1, top).log(), "topk_logprobs": pi.gather(-1, top).log(),
            "topk_ids": top, "sampled_ids": s}

    def f(lp):
        anchor = lp.detach() - c  # [B, T]; with anchor="recompute" it is pi_old, and mu another shift of lp
        if loss.anchor == "recompute":
            return loss(LossInputs(lp, lp.detach() + 0.5 * c.flip(-1), adv, mask,
                                   proximal_logprobs=anchor)).token_losses
        return loss(LossInputs(lp, anchor, adv, mask, **topk)).token_losses
    assert torch.autograd.gradcheck(f, (logprobs,))


def test_masked_positions_never_leak_nan():
    inp = _topk_inputs([1.0, -1.0])
    inp.loss_mask = T_([[1.0, 0.0]])
    inp.topk_behavior_logprobs[0, 1] = float("nan")
    inp.logprobs.data[0, 1] = float("nan")
    for loss in (DPPO("topk_kl", top_k=3), DPPO("topk_tv", top_k=3), DPPO("binary_kl")):
        out = loss(inp)
        assert bool(torch.isfinite(_grad(out, inp)).all()) and out.token_losses[0, 1].item() == 0.0
        assert all(bool(torch.isfinite(v)) for v in out.metrics.values())


def test_all_zero_mask_is_finite():
    out = DPPO(clip_ratio=2.0)(_inputs([0.6, 0.2], [0.5, 0.5], [1.0, -1.0], mask=[0, 0]))
    assert torch.equal(out.token_losses, torch.zeros(1, 2, dtype=DT))
    assert all(v.item() == 0.0 for v in out.metrics.values())


# -------------------------------------------------------------------------------------- config, declarations, errors
def test_defaults_declarations_and_registry():
    assert (DPPO().delta, DPPO("binary_kl").delta, DPPO("topk_tv").delta, DPPO("topk_kl").delta) == (
        0.15, 0.05, 0.15, 0.05)
    assert DPPO().needs_topk == 0 and DPPO("topk_kl", top_k=7).needs_topk == 7 and PolicyLoss.needs_topk == 0
    assert DPPO(anchor="recompute").needs_proximal and not DPPO().needs_proximal and not PolicyLoss.needs_proximal
    names = {"dppo_tv": "binary_tv", "dppo_kl": "binary_kl", "dppo_topk_tv": "topk_tv", "dppo_topk_kl": "topk_kl"}
    for name, divergence in names.items():
        assert resolve("loss", name)().divergence == divergence
    plain = to_plain(DPPOTopKKL(top_k=5))
    assert plain == {"class_path": "astratk.losses.dppo.DPPOTopKKL",
                     "init_args": {"delta": 0.05, "clip_ratio": None, "top_k": 5, "delta_low": 0.05,
                                   "delta_high": 0.05}}
    assert repr(DPPOTopKKL(**plain["init_args"])) == repr(DPPO("topk_kl", top_k=5)).replace("DPPO(", "DPPOTopKKL(")
    assert DPPOBinaryKL(clip_ratio=5).clip_ratio == 5.0 and DPPOTopKTV(top_k=4).needs_topk == 4


def test_docstring_example_runs():
    assert doctest.testmod(dppo).failed == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"divergence": "tv"}, r"choose one of \['binary_kl', 'binary_tv', 'topk_kl', 'topk_tv'\]"),
    ({"delta": 0.0}, "delta must be > 0"),
    ({"delta": -0.1}, "delta must be > 0"),
    ({"delta": float("nan")}, "delta must be > 0"),
    ({"clip_ratio": 0.5}, "clip_ratio must be >= 1"),
    ({"anchor": "old"}, "unknown DPPO anchor"),
    ({"divergence": "topk_tv", "top_k": 21}, r"top_k must be an int in \[1, 20\]"),
    ({"divergence": "topk_tv", "top_k": 0}, r"top_k must be an int in \[1, 20\]"),
    ({"divergence": "topk_kl", "anchor": "recompute"}, "not supported"),
])
def test_bad_config_raises_with_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPPO(**kwargs)


def test_missing_inputs_raise():
    with pytest.raises(ValueError, match="needs LossInputs.proximal_logprobs"):
        DPPO(anchor="recompute")(_inputs([0.6], [0.5], [1.0]))
    with pytest.raises(ValueError, match="needs LossInputs.topk_ids, topk_behavior_logprobs and topk_logprobs"):
        DPPO("topk_tv", top_k=3)(_inputs([0.6], [0.5], [1.0]))
    no_ids = _topk_inputs([1.0, 1.0])
    no_ids.sampled_ids = None
    with pytest.raises(ValueError, match=r"sampled_ids \[B, T\].*input_ids\[:, 1:\]"):
        DPPO("topk_tv", top_k=3)(no_ids)
    bad = _topk_inputs([1.0, 1.0])
    bad.topk_logprobs = bad.topk_logprobs[..., :2]
    with pytest.raises(ValueError, match=r"must all be \[B, T, K\]"):
        DPPO("topk_tv", top_k=3)(bad)
    bad = _topk_inputs([1.0, 1.0])
    bad.topk_ids = bad.topk_ids[..., :2]
    with pytest.raises(ValueError, match=r"must all be \[B, T, K\].*topk_ids \[1, 2, 2\]"):
        DPPO("topk_tv", top_k=3)(bad)
    bad = _topk_inputs([1.0, 1.0])
    bad.sampled_ids = bad.sampled_ids[:, :1]
    with pytest.raises(ValueError, match=r"sampled_ids must be \[B, T\] = \[1, 2\]"):
        DPPO("topk_tv", top_k=3)(bad)


def test_asymmetric_thresholds_golden():
    # Binary-TV, delta_low 0.25 (falling tokens), delta_high 0.15 (rising tokens):
    # t0 mu .5 -> pi .7, A +1: rising, TV .2 > .15 -> masked, grad 0
    # t1 mu .5 -> pi .3, A -1: falling, TV .2 <= .25 -> kept, grad -A r = .6
    # t2 mu .5 -> pi .2, A -1: falling, TV .3 > .25 -> masked
    # t3 mu .5 -> pi .62, A +1: rising, TV .12 <= .15 -> kept, grad -1.24
    loss = DPPO(delta_low=0.25, delta_high=0.15)
    inp = _inputs([0.7, 0.3, 0.2, 0.62], [0.5] * 4, [1.0, -1.0, -1.0, 1.0])
    out = loss(inp)
    torch.testing.assert_close(_grad(out, inp)[0], T_([0.0, 0.6, 0.0, -1.24]))
    assert out.metrics["masked_frac"].item() == 0.5
    assert (out.metrics["masked_frac_pos"].item(), out.metrics["masked_frac_neg"].item()) == (0.5, 0.5)
    assert "delta_low=0.25, delta_high=0.15" in repr(loss) and "delta_low" not in repr(DPPO())
    assert DPPO(delta=0.3).delta_low == DPPO(delta=0.3).delta_high == 0.3  # each defaults to delta
    with pytest.raises(ValueError, match="delta_low must be > 0"):
        DPPO(delta_low=0.0)
    with pytest.raises(ValueError, match="delta_high must be > 0"):
        DPPO(delta_high=float("nan"))


def test_recompute_centres_the_region_on_pi_old_but_keeps_the_ratio_on_mu():
    # mu .5, pi_old .6, pi .7, A +1. Against mu: TV .2 > .15 -> masked. Against pi_old: TV .1 -> kept, and the
    # gradient is -A pi / mu = -1.4 (the importance weight of the distribution that sampled), not -pi / pi_old.
    inp = _inputs([0.7], [0.5], [1.0], proximal_logprobs=torch.log(T_([[0.6]])))
    assert _grad(DPPO()(inp), inp).item() == 0.0
    out = DPPO(anchor="recompute")(inp)
    assert _grad(out, inp).item() == pytest.approx(-1.4)
    assert out.metrics["anchor_tv_mean"].item() == pytest.approx(0.1)
    assert out.metrics["tv_mean"].item() == pytest.approx(0.2)  # drift is always against the engine's mu
