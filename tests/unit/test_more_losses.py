"""Decoupled PPO, GPG, GMPO, Clip-Cov, KL-Cov and CISPO's lower clip: golden values with their derivation, gradients in
closed form, the papers' properties (decoupled = PPO when pi_prox = mu; GMPO's geometric mean tames an outlier token;
the covariance picks), gradcheck where the loss has no stop-gradient by design, padding, config errors, registry."""

import doctest
import importlib
import math
import pickle

import pytest
import torch

from astratk.contracts import LossInputs, PolicyLoss
from astratk.losses.cispo import CISPO
from astratk.losses.cov import ClipCov, KLCov, centred_covariance
from astratk.losses.decoupled_ppo import DecoupledPPO
from astratk.losses.dro import DRO
from astratk.losses.gmpo import GMPO
from astratk.losses.gpg import GPG
from astratk.losses.ppo_clip import PPOClip
from astratk.losses.vespo import VESPO
from astratk.registry import resolve
from astratk.training.aggregation import aggregate

DT = torch.float64
T_ = lambda x: torch.tensor(x, dtype=DT)


def _random(seed, shape=(4, 12), spread=0.5):
    g = torch.Generator().manual_seed(seed)
    log_mu = torch.log(torch.rand(*shape, generator=g, dtype=DT) * 0.9 + 0.05)
    logp = log_mu + spread * torch.randn(*shape, generator=g, dtype=DT)
    prox = log_mu + spread * torch.randn(*shape, generator=g, dtype=DT)
    return logp.clamp(max=-1e-3), log_mu, prox.clamp(max=-1e-3), torch.randn(*shape, generator=g, dtype=DT)


def _grad(loss, logp, log_mu, adv, mask=None, **kw):
    logp = logp.clone().requires_grad_()
    out = loss(LossInputs(logp, log_mu, adv, torch.ones_like(logp) if mask is None else mask, **kw))
    return torch.autograd.grad(out.token_losses.sum(), logp)[0], out


# ------------------------------------------------------------------------------------------------------ decoupled PPO
def test_decoupled_golden():
    # eps 0.2. t0: mu .25, prox .5, pi .7, A +1: u 1.4 > 1.2 clipped -> value -w 1.2 = -2.4 (w = 2), grad 0
    # t1: mu .5, prox .5, pi .55, A +1: u 1.1 inside -> value -1.1, grad -A w u = -1.1
    # t2: mu .8, prox .4, pi .3, A -1: u .75 < .8 clipped (A < 0) -> value w .8 = .4, grad 0
    # t3: mu .2, prox .4, pi .36, A -2: u .9 inside -> value 2 * 2 * .9 = 3.6, grad -A w u = 3.6
    lp = torch.log(T_([[0.7, 0.55, 0.3, 0.36]])).requires_grad_()
    out = DecoupledPPO()(LossInputs(lp, torch.log(T_([[0.25, 0.5, 0.8, 0.2]])), T_([[1.0, 1.0, -1.0, -2.0]]),
                                    torch.ones(1, 4, dtype=DT), proximal_logprobs=torch.log(T_([[0.5, 0.5, 0.4, 0.4]]))))
    torch.testing.assert_close(out.token_losses[0], T_([-2.4, -1.1, 0.4, 3.6]))
    (g,) = torch.autograd.grad(out.token_losses.sum(), lp)
    torch.testing.assert_close(g[0], T_([0.0, -1.1, 0.0, 3.6]))
    m = {k: v.item() for k, v in out.metrics.items()}
    assert (m["clip_frac"], m["clip_frac_high"], m["clip_frac_low"]) == pytest.approx((0.5, 0.25, 0.25))
    assert m["behavior_weight_max"] == pytest.approx(2.0) and m["behavior_weight_mean"] == pytest.approx(1.375)


def test_decoupled_closed_form_gradient_is_the_true_importance_weight_inside_the_clip():
    logp, log_mu, prox, adv = _random(0)
    g, _ = _grad(DecoupledPPO(), logp, log_mu, adv, proximal_logprobs=prox)
    u = (logp - prox).exp()
    clipped = ((adv > 0) & (u > 1.2)) | ((adv < 0) & (u < 0.8))
    assert bool(clipped.any()) and bool((~clipped).any())
    torch.testing.assert_close(g, torch.where(clipped, 0.0, -adv * (logp - log_mu).exp()))


def test_decoupled_is_ppo_when_the_proximal_policy_is_the_behaviour_policy():
    logp, log_mu, _, adv = _random(1)
    for eps in ({"eps_low": 0.2}, {"eps_low": 0.1, "eps_high": 0.28}):
        g1, o1 = _grad(DecoupledPPO(**eps), logp, log_mu, adv, proximal_logprobs=log_mu)
        g2, o2 = _grad(PPOClip(**eps), logp, log_mu, adv)
        torch.testing.assert_close(o1.token_losses, o2.token_losses)
        torch.testing.assert_close(g1, g2)


def test_decoupled_clip_is_centred_on_the_proximal_policy_not_mu():
    # a stale token (mu far below prox) with pi = prox: naive PPO on mu clips it (r = 4), decoupled keeps it (u = 1)
    logp, log_mu, adv = torch.log(T_([[0.4]])), torch.log(T_([[0.1]])), T_([[1.0]])
    assert _grad(PPOClip(), logp, log_mu, adv)[0].item() == 0.0
    assert _grad(DecoupledPPO(), logp, log_mu, adv, proximal_logprobs=logp.clone())[0].item() == pytest.approx(-4.0)


def test_decoupled_weight_cap_drops_gradient_keeps_denominator():
    logp, log_mu, adv = torch.log(T_([[0.5, 0.5]])), torch.log(T_([[0.05, 0.4]])), T_([[1.0, 1.0]])
    g, out = _grad(DecoupledPPO(behavior_weight_cap=5.0), logp, log_mu, adv, proximal_logprobs=logp.clone())
    assert g[0, 0].item() == 0.0 and g[0, 1].item() == pytest.approx(-1.25)  # w = 10 > 5 dropped; w = 1.25 kept
    assert out.mask.tolist() == [[1.0, 1.0]] and out.metrics["weight_capped_frac"].item() == 0.5


def test_decoupled_gradcheck():
    logp, log_mu, prox, adv = _random(2, shape=(2, 5), spread=0.1)  # ratios near 1: away from the clip's kinks
    mask = T_([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    loss = DecoupledPPO(eps_low=0.5)
    f = lambda lp: loss(LossInputs(lp, log_mu, adv, mask, proximal_logprobs=prox)).token_losses
    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(),))


def test_decoupled_needs_proximal():
    assert DecoupledPPO.needs_proximal and DecoupledPPO().needs_proximal
    with pytest.raises(ValueError, match="needs LossInputs.proximal_logprobs"):
        DecoupledPPO()(LossInputs(T_([[-0.5]]), T_([[-0.5]]), T_([[1.0]]), T_([[1.0]])))


# ---------------------------------------------------------------------------------------------------------------- GPG
def test_gpg_golden_and_rescale():
    # rows: A = +1 (tokens log .5, log .25), A = 0 (a group that all scored alike), A = -2; alpha = 3 / 2
    lp = torch.log(T_([[0.5, 0.25], [0.5, 0.5], [0.2, 0.2]]))
    adv = T_([[1.0, 1.0], [0.0, 0.0], [-2.0, -2.0]])
    mask = T_([[1, 1], [1, 1], [1, 0]])
    g, out = _grad(GPG(), lp, torch.zeros_like(lp), adv, mask)
    torch.testing.assert_close(g, T_([[-1.5, -1.5], [0.0, 0.0], [3.0, 0.0]]))
    assert out.metrics["alpha"].item() == 1.5
    expected = -1.5 * adv * lp * mask
    torch.testing.assert_close(out.token_losses, expected)
    g1, out1 = _grad(GPG(rescale=False), lp, torch.zeros_like(lp), adv, mask)
    torch.testing.assert_close(g1, -adv * mask)
    assert out1.metrics["alpha"].item() == 1.0


def test_gpg_ignores_mu_and_reduces_over_ranks():
    lp, log_mu, _, adv = _random(3)
    g1, _ = _grad(GPG(), lp, log_mu, adv)
    g2, _ = _grad(GPG(), lp, log_mu - 3.0, adv)
    torch.testing.assert_close(g1, g2)  # no importance ratio at all
    adv[0] = 0.0
    _, out = _grad(GPG(), lp, log_mu, adv, reduce=lambda x: 2 * x)  # two identical ranks: the same alpha
    assert out.metrics["alpha"].item() == pytest.approx(4 / 3) and GPG().batch_statistics
    assert not GPG(rescale=False).batch_statistics


def test_gpg_all_zero_advantages_give_zero_not_nan():
    g, out = _grad(GPG(), T_([[-0.5, -1.0]]), T_([[-0.5, -1.0]]), T_([[0.0, 0.0]]))
    assert bool((g == 0).all()) and out.metrics["alpha"].item() == 1.0


# --------------------------------------------------------------------------------------------------------------- GMPO
def test_gmpo_golden():
    # seq 0, A = +1: log r = (0.2, 1.0, -0.9) -> clipped to (0.2, 0.4, -0.9) on the A > 0 side only where it lowers
    #   the objective: min(0.2, 0.2) = 0.2, min(1.0, 0.4) = 0.4, min(-0.9, -0.4) = -0.9 -> s = exp(-0.3 / 3)
    # seq 1, A = -1: sgn -1: g = -min(-log r, -clip): log r = (-1.0, 0.5) -> g = (-0.4, 0.5) -> s = exp(0.1 / 2)
    lp = T_([[0.2, 1.0, -0.9], [-1.0, 0.5, 0.0]])
    adv, mask = T_([[1.0] * 3, [-1.0] * 3]), T_([[1, 1, 1], [1, 1, 0]])
    g, out = _grad(GMPO(), lp, torch.zeros_like(lp), adv, mask)
    s0, s1 = math.exp(-0.1), math.exp(0.05)
    torch.testing.assert_close(out.token_losses, T_([[-s0] * 3, [s1, s1, 0.0]]))
    # gradient of sum of token losses = n_i * d loss_i: -A s (token inside) or 0 (clipped)
    torch.testing.assert_close(g, T_([[-s0, 0.0, -s0], [0.0, s1, 0.0]]))
    value = aggregate(out.token_losses, out.mask, GMPO.required_aggregation)
    assert value.item() == pytest.approx((-s0 + s1) / 2)  # the mean of the sequence losses
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 5)


def test_gmpo_geometric_mean_tames_an_outlier_token():
    # one token with r = 50 among ratios of 1: GRPO's arithmetic view sees a mean ratio of ~13; GMPO's sequence ratio
    # with eps 0.4 is exp(0.4 / 4) ~ 1.105, and unclipped (huge eps) the geometric mean 50^(1/4) ~ 2.66
    lp = torch.log(T_([[50.0, 1.0, 1.0, 1.0]]))
    out = GMPO()(LossInputs(lp, torch.zeros_like(lp), torch.ones_like(lp), torch.ones_like(lp)))
    assert out.metrics["seq_ratio_mean"].item() == pytest.approx(math.exp(0.1))
    wide = GMPO(eps_low=100.0)(LossInputs(lp, torch.zeros_like(lp), torch.ones_like(lp), torch.ones_like(lp)))
    assert wide.metrics["seq_ratio_mean"].item() == pytest.approx(50 ** 0.25)


def test_gmpo_gradcheck():
    lp, log_mu, _, adv = _random(4, shape=(2, 5), spread=0.1)
    mask = T_([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    adv = adv[:, :1].expand(2, 5).contiguous()
    f = lambda x: GMPO()(LossInputs(x, log_mu, adv, mask)).token_losses
    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(),))


# ------------------------------------------------------------------------------------------------- Clip-Cov, KL-Cov
def test_centred_covariance_golden_and_reduce():
    lp, adv = T_([[-0.1, -3.0, -2.0, -2.5]]), T_([[2.0, -0.5, 0.5, -0.5]])
    valid = torch.tensor([[True, True, True, True]])
    torch.testing.assert_close(centred_covariance(adv, lp, valid), T_([[2.925, 0.9625, -0.0125, 0.525]]))
    # a padded token changes nothing
    lp2, adv2 = T_([[-0.1, -3.0, -2.0, -2.5, 9.0]]), T_([[2.0, -0.5, 0.5, -0.5, 9.0]])
    valid2 = torch.tensor([[True, True, True, True, False]])
    torch.testing.assert_close(centred_covariance(adv2, lp2, valid2)[:, :4], T_([[2.925, 0.9625, -0.0125, 0.525]]))
    torch.testing.assert_close(centred_covariance(adv, lp, valid, reduce=lambda x: 3 * x),
                               centred_covariance(adv, lp, valid))  # identical ranks: the same means


def test_clip_cov_picks_only_candidates_and_keeps_ppo_elsewhere():
    lp, log_mu, _, adv = _random(5, shape=(8, 32), spread=0.3)
    loss = ClipCov(clip_ratio=0.05, cov_low=0.2, cov_high=3.0)
    g, out = _grad(loss, lp, log_mu, adv)
    g_ppo, ppo = _grad(PPOClip(), lp, log_mu, adv)
    cov = centred_covariance(adv, lp, torch.ones_like(adv, dtype=torch.bool))
    candidates = (cov > 0.2) & (cov < 3.0)
    picked = (out.token_losses == 0) & (ppo.token_losses != 0)  # a clipped token's value is not 0, a picked one's is
    assert int(picked.sum()) == int(0.05 * adv.numel())  # floor(ratio * tokens) tokens lose their gradient
    assert bool(candidates[picked].all())
    torch.testing.assert_close(g[~picked], g_ppo[~picked])
    assert out.metrics["cov_clip_frac"].item() == pytest.approx(int(0.05 * adv.numel()) / adv.numel())


def test_clip_cov_is_reproducible_and_pickles_its_generator():
    lp, log_mu, _, adv = _random(6, shape=(8, 32), spread=0.3)
    a, b = ClipCov(clip_ratio=0.05, cov_low=0.1, seed=3), ClipCov(clip_ratio=0.05, cov_low=0.1, seed=3)
    first = _grad(a, lp, log_mu, adv)[0]
    torch.testing.assert_close(first, _grad(b, lp, log_mu, adv)[0])
    c = pickle.loads(pickle.dumps(a))  # a trainer process receives the loss pickled: the stream continues
    torch.testing.assert_close(_grad(c, lp, log_mu, adv)[0], _grad(a, lp, log_mu, adv)[0])
    assert not torch.equal(_grad(ClipCov(clip_ratio=0.05, cov_low=0.1, seed=4), lp, log_mu, adv)[0], first)


def _clip_cov_case():
    # 10 tokens. A = 2 on tokens 0-7, -8 on 8-9 (mean A = 0); log pi = -0.5 on 0-7, -5.5 on 8-9 (mean -1.5), so
    # cov = 2 * 1 = 2 on tokens 0-7 (all in the band (1, 5)) and -8 * -4 = 32 on 8-9 (above it). Tokens 0-3 have
    # r = e^0.5 = 1.65 > 1 + 0.2 with A > 0: PPO's clip already zeroes their gradient. Tokens 4-9 have r = 1.
    lp = T_([[-0.5] * 8 + [-5.5] * 2])
    adv = T_([[2.0] * 8 + [-8.0] * 2])
    log_mu = lp - T_([[0.5] * 4 + [0.0] * 6])
    return lp, log_mu, adv


@pytest.mark.parametrize("seed", range(8))
def test_clip_cov_draws_only_among_tokens_the_ppo_clip_left_alone(seed):
    lp, log_mu, adv = _clip_cov_case()
    # clip_ratio 0.4: max(1, floor(0.4 * 10)) = 4 picks; of the 8 band tokens only 4-7 are unclipped, so they are the
    # picks whatever the draw (drawing among all 8 would spend some picks on 0-3, whose gradient is already 0)
    g, out = _grad(ClipCov(clip_ratio=0.4, seed=seed), lp, log_mu, adv)
    torch.testing.assert_close(out.token_losses, T_([[-2.4] * 4 + [0.0] * 4 + [8.0] * 2]))  # -A * 1.2; 0; -A * 1
    torch.testing.assert_close(g, T_([[0.0] * 8 + [8.0] * 2]))  # clipped: 0; picked: 0; tokens 8-9: -A r = 8
    assert out.metrics["cov_clip_frac"].item() == pytest.approx(0.4)
    assert out.metrics["cov_candidates_frac"].item() == pytest.approx(0.8)
    # one pick (clip_ratio 0.1: max(1, floor(1)) = 1): always one of tokens 4-7
    _, one = _grad(ClipCov(clip_ratio=0.1, seed=seed), lp, log_mu, adv)
    picked = torch.nonzero(one.token_losses[0] == 0).flatten().tolist()
    assert len(picked) == 1 and picked[0] in (4, 5, 6, 7)
    # a tiny share still picks max(1, floor(2e-4 * 10)) = 1 token
    _, tiny = _grad(ClipCov(seed=seed), lp, log_mu, adv)
    assert tiny.metrics["cov_clip_frac"].item() == pytest.approx(0.1)


def test_clip_cov_whose_candidates_are_all_clipped_is_ppo():
    lp, log_mu, adv = _clip_cov_case()
    log_mu = lp - T_([[0.5] * 8 + [0.0] * 2])  # every band token clipped: nothing left to draw from
    g, out = _grad(ClipCov(clip_ratio=0.4), lp, log_mu, adv)
    torch.testing.assert_close(g, _grad(PPOClip(), lp, log_mu, adv)[0])
    assert out.metrics["cov_clip_frac"].item() == 0.0


def test_clip_cov_without_candidates_is_ppo():
    lp, log_mu, _, adv = _random(7, spread=0.3)
    g, out = _grad(ClipCov(cov_low=100.0, cov_high=200.0), lp, log_mu, adv)
    torch.testing.assert_close(g, _grad(PPOClip(), lp, log_mu, adv)[0])
    assert out.metrics["cov_clip_frac"].item() == 0.0


def test_kl_cov_golden():
    # cov = (2.925, 0.9625, -0.0125, 0.525) as above; kl_ratio 0.5 of 4 tokens -> the top 2: tokens 0 and 1
    # loss = -A r + 1 * |log r| on those; log r = 0.1 everywhere (mu = pi e^-0.1); gradient -A r + sign(log r)
    lp = T_([[-0.1, -3.0, -2.0, -2.5]])
    adv = T_([[2.0, -0.5, 0.5, -0.5]])
    g, out = _grad(KLCov(kl_ratio=0.5), lp, lp - 0.1, adv)
    r = math.exp(0.1)
    torch.testing.assert_close(out.token_losses[0], T_([-2 * r + 0.1, 0.5 * r + 0.1, -0.5 * r, 0.5 * r]))
    torch.testing.assert_close(g[0], T_([-2 * r + 1.0, 0.5 * r + 1.0, -0.5 * r, 0.5 * r]))
    assert out.metrics["kl_cov_frac"].item() == 0.5


def test_kl_cov_penalises_at_least_one_token_as_the_reference_does():
    # 36 tokens, kl_ratio 2e-4: floor(2e-4 * 36) = 0, but the reference implementation penalises max(1, 0) = 1 token:
    # the one of largest covariance. A = 0 and log pi = -1 everywhere except token 5 (A = 3.6, log pi = -0.1):
    # mean A = 0.1, mean log pi = -1 + 0.9 / 36 = -0.975, cov_5 = 3.5 * 0.875 = 3.0625; every other token has
    # cov = (-0.1)(-0.025) = 0.0025. log r = 0.2 everywhere, so token 5's gradient gains +1 (d|log r| / d log pi).
    lp, adv = torch.full((1, 36), -1.0, dtype=DT), torch.zeros(1, 36, dtype=DT)
    lp[0, 5], adv[0, 5] = -0.1, 3.6
    g, out = _grad(KLCov(kl_ratio=2e-4), lp, lp - 0.2, adv)
    r = math.exp(0.2)
    expected = torch.zeros(1, 36, dtype=DT)
    expected[0, 5] = -3.6 * r + 1.0
    torch.testing.assert_close(g, expected)
    assert out.metrics["kl_cov_frac"].item() == pytest.approx(1 / 36)
    torch.testing.assert_close(out.token_losses[0, 5], T_(-3.6 * r + 0.2))
    # no loss token at all: nothing is penalised, and nothing fails
    _, empty = _grad(KLCov(), lp, lp - 0.2, adv, mask=torch.zeros(1, 36, dtype=DT))
    assert empty.metrics["kl_cov_frac"].item() == 0.0 and (empty.token_losses == 0).all()


def test_kl_cov_gradcheck():
    lp, log_mu, _, adv = _random(9, shape=(2, 5), spread=0.3)
    mask = T_([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    f = lambda x: KLCov(kl_ratio=0.3)(LossInputs(x, log_mu, adv, mask)).token_losses
    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(),))


# ------------------------------------------------------------------------------------------------ CISPO's lower clip
def test_cispo_lower_clip():
    # C = 2, floor 0.5: r = (3, 0.2, 0.8) -> weights (2, 0.5, 0.8); gradient -A c
    lp = torch.log(T_([[3.0, 0.2, 0.8]]))
    adv = T_([[1.0, -1.0, 2.0]])
    g, out = _grad(CISPO(ratio_cap=2.0, ratio_floor=0.5), lp, torch.zeros_like(lp), adv)
    torch.testing.assert_close(g[0], T_([-2.0, 0.5, -1.6]))
    assert out.metrics["floored_frac"].item() == pytest.approx(1 / 3)
    g0, out0 = _grad(CISPO(ratio_cap=2.0), lp, torch.zeros_like(lp), adv)
    assert g0[0, 1].item() == pytest.approx(0.2) and "floored_frac" not in out0.metrics
    assert "ratio_floor=0.5" in repr(CISPO(ratio_floor=0.5)) and "floor" not in repr(CISPO())


# ------------------------------------------------------------------------------------------------------ shared checks
NEW = [DecoupledPPO(), DecoupledPPO(behavior_weight_cap=3.0),
       DecoupledPPO(behavior_weight_cap=3.0, cap_mode="truncate", weight_level="sequence", dual_clip=3.0),
       DecoupledPPO(weight_level="geometric"), DRO(beta=0.2), DRO(beta=0.2, anchor="behavior"), VESPO(), GPG(), GMPO(), ClipCov(clip_ratio=0.5, cov_low=-1.0),
       KLCov(kl_ratio=0.5), CISPO(ratio_floor=0.5)]


@pytest.mark.parametrize("loss", NEW, ids=repr)
def test_padding_garbage_and_empty_masks_stay_finite(loss):
    logp = torch.tensor([[-0.5, float("nan")], [float("nan"), float("nan")]], dtype=DT, requires_grad=True)
    log_mu = torch.tensor([[-0.7, float("-inf")], [float("-inf"), float("-inf")]], dtype=DT)
    prox = torch.tensor([[-0.6, float("nan")], [float("nan"), float("nan")]], dtype=DT)
    mask = T_([[1.0, 0.0], [0.0, 0.0]])
    out = loss(LossInputs(logp, log_mu, torch.ones(2, 2, dtype=DT), mask, proximal_logprobs=prox))
    (grad,) = torch.autograd.grad(out.token_losses.sum(), logp)
    assert torch.isfinite(out.token_losses).all() and torch.isfinite(grad).all()
    assert out.token_losses[0, 1] == 0 and (out.token_losses[1] == 0).all() and (grad[1] == 0).all()
    assert all(torch.isfinite(v) and not v.requires_grad for v in out.metrics.values())


@pytest.mark.parametrize("loss", NEW, ids=repr)
def test_weights_scale_token_losses_not_mask(loss):
    logp, log_mu, prox, adv = _random(10, shape=(2, 4), spread=0.05)
    kw = {"proximal_logprobs": prox}
    if isinstance(loss, ClipCov):  # the random pick must be the same in both calls
        loss, other = ClipCov(clip_ratio=0.5, cov_low=-1.0, seed=1), ClipCov(clip_ratio=0.5, cov_low=-1.0, seed=1)
    else:
        other = loss
    plain = loss(LossInputs(logp, log_mu, adv, torch.ones_like(adv), **kw))
    weighted = other(LossInputs(logp, log_mu, adv, torch.ones_like(adv), weights=torch.full_like(adv, 3.0), **kw))
    torch.testing.assert_close(weighted.token_losses, 3.0 * plain.token_losses)
    torch.testing.assert_close(weighted.mask, plain.mask)


@pytest.mark.parametrize("name, cls", [("decoupled_ppo", DecoupledPPO), ("gpg", GPG), ("gmpo", GMPO),
                                       ("clip_cov", ClipCov), ("kl_cov", KLCov)])
def test_registry_short_names(name, cls):
    assert resolve("loss", name) is cls and issubclass(cls, PolicyLoss)


@pytest.mark.parametrize("module", ["decoupled_ppo", "gpg", "gmpo", "cov", "cispo"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(f"astratk.losses.{module}"))
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("factory, match", [
    (lambda: DecoupledPPO(eps_low=0), "eps_low must be in"),
    (lambda: DecoupledPPO(eps_high=-1), "eps_high must be > 0"),
    (lambda: DecoupledPPO(behavior_weight_cap=1.0), "behavior_weight_cap must be > 1"),
    (lambda: GPG(rescale="yes"), "rescale must be true or false"),
    (lambda: GMPO(eps_low=0), "eps_low must be > 0"),
    (lambda: GMPO(eps_high=float("nan")), "eps_high must be > 0"),
    (lambda: ClipCov(clip_ratio=0), "clip_ratio must be in"),
    (lambda: ClipCov(cov_low=5, cov_high=1), "cov_low must be < cov_high"),
    (lambda: KLCov(kl_ratio=2.0), "kl_ratio must be in"),
    (lambda: KLCov(kl_coef=-1), "kl_coef must be >= 0"),
    (lambda: CISPO(ratio_floor=1.5), "ratio_floor must be in"),
    (lambda: CISPO(ratio_floor=float("nan")), "ratio_floor must be in"),
])
def test_bad_config_raises_with_fix(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


# ------------------------------------------------------------------------------------ decoupled PPO: the peers' options
def test_decoupled_truncated_weight_keeps_a_capped_gradient():
    # w = prox / mu = (10, 1.25), cap 5, pi = prox (u = 1), A = 1: mask mode drops token 0 (AReaL's default);
    # truncate mode keeps it with w = min(10, 5) = 5, so its gradient is -A w u = -5
    logp, log_mu, adv = torch.log(T_([[0.5, 0.5]])), torch.log(T_([[0.05, 0.4]])), T_([[1.0, 1.0]])
    g, out = _grad(DecoupledPPO(behavior_weight_cap=5.0, cap_mode="truncate"), logp, log_mu, adv,
                   proximal_logprobs=logp.clone())
    torch.testing.assert_close(g[0], T_([-5.0, -1.25]))
    torch.testing.assert_close(out.token_losses[0], T_([-5.0, -1.25]))
    assert out.metrics["weight_capped_frac"].item() == 0.5
    assert out.metrics["behavior_weight_max"].item() == pytest.approx(10.0)
    assert "cap_mode='truncate'" in repr(DecoupledPPO(behavior_weight_cap=5.0, cap_mode="truncate"))


def test_decoupled_sequence_level_weights():
    # one sequence of two tokens: prox / mu = (2, 0.5) per token -> product 1, geometric mean 1; a second sequence
    # (4, 1): product 4, geometric mean 2. pi = prox (u = 1), A = 1: the gradient on each token is -w_sequence.
    prox = torch.log(T_([[0.4, 0.2], [0.4, 0.3]]))
    log_mu = torch.log(T_([[0.2, 0.4], [0.1, 0.3]]))
    adv = torch.ones(2, 2, dtype=DT)
    g, _ = _grad(DecoupledPPO(weight_level="sequence"), prox, log_mu, adv, proximal_logprobs=prox)
    torch.testing.assert_close(g, T_([[-1.0, -1.0], [-4.0, -4.0]]))
    g, _ = _grad(DecoupledPPO(weight_level="geometric"), prox, log_mu, adv, proximal_logprobs=prox)
    torch.testing.assert_close(g, T_([[-1.0, -1.0], [-2.0, -2.0]]))
    # a sequence weight over the cap masks the whole sequence (mask mode) or truncates it (truncate mode)
    g, out = _grad(DecoupledPPO(weight_level="sequence", behavior_weight_cap=3.0), prox, log_mu, adv,
                   proximal_logprobs=prox)
    torch.testing.assert_close(g, T_([[-1.0, -1.0], [0.0, 0.0]]))
    assert out.metrics["weight_capped_frac"].item() == 0.5
    g, _ = _grad(DecoupledPPO(weight_level="sequence", behavior_weight_cap=3.0, cap_mode="truncate"), prox, log_mu,
                 adv, proximal_logprobs=prox)
    torch.testing.assert_close(g, T_([[-1.0, -1.0], [-3.0, -3.0]]))
    # padding does not enter a sequence's weight
    mask = T_([[1.0, 1.0], [1.0, 0.0]])
    g, _ = _grad(DecoupledPPO(weight_level="sequence"), prox, log_mu, adv, mask=mask, proximal_logprobs=prox)
    torch.testing.assert_close(g, T_([[-1.0, -1.0], [-4.0, 0.0]]))


def test_decoupled_dual_clip_caps_negative_advantage_tokens():
    # A = -1, mu = prox = 0.1, pi = 0.5: u = 5 > c = 3, so the loss is capped at -c A = 3 and the gradient is 0;
    # without the dual clip the loss is -A u = 5 with gradient 5. A positive-advantage token is untouched.
    logp, prox, adv = torch.log(T_([[0.5, 0.11]])), torch.log(T_([[0.1, 0.1]])), T_([[-1.0, 1.0]])
    g, out = _grad(DecoupledPPO(dual_clip=3.0), logp, prox, adv, proximal_logprobs=prox)
    torch.testing.assert_close(out.token_losses[0], T_([3.0, -1.1]))
    torch.testing.assert_close(g[0], T_([0.0, -1.1]))
    assert out.metrics["dual_clip_frac"].item() == 0.5
    g, out = _grad(DecoupledPPO(), logp, prox, adv, proximal_logprobs=prox)
    torch.testing.assert_close(g[0], T_([5.0, -1.1]))
    # with mu != prox the capped loss is still scaled by w (here 2): 2 * 3
    _, out = _grad(DecoupledPPO(dual_clip=3.0), logp, prox - math.log(2.0), adv, proximal_logprobs=prox)
    torch.testing.assert_close(out.token_losses[0, 0], T_(6.0))


@pytest.mark.parametrize("bad", [{"cap_mode": "clip"}, {"weight_level": "seq"}, {"dual_clip": 1.0}])
def test_decoupled_refuses_unknown_options(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        DecoupledPPO(**bad)


def test_decoupled_with_a_reweighting_correction_is_refused_in_one_line():
    from astratk.losses.corrections import MIS, TIS
    from astratk.spec import PolicySpec

    for corr in (TIS(), MIS()):
        with pytest.raises(ValueError, match="applied twice") as e:
            PolicySpec(loss=DecoupledPPO(), corrections=[corr]).validate()
        assert "\n" not in str(e.value) and "MIS(weight=False)" in str(e.value)
    PolicySpec(loss=DecoupledPPO(), corrections=[MIS(weight=False)]).validate()  # a mask only: fine
    PolicySpec(loss=PPOClip(), corrections=[TIS(), MIS()]).validate()  # a loss anchored on mu: fine
