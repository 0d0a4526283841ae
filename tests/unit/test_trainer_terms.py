"""PolicyModule's optional step terms on a tiny random Qwen2: proximal log-probs, corrections, KL to a reference,
entropy bonus, top-K log-probs, `reduce`; and that with all of them off the step is unchanged."""

import warnings

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses.corrections import TIS
from astratk.losses.drpo import DRPO
from astratk.records import TrainBatch
from astratk.training.aggregation import aggregate
from astratk.training.logprobs import policy_forward, token_logprobs
from astratk.training.module import PolicyModule
from astratk.training.step_inputs import sum_over_ranks

H = 4  # horizon for seq-mean-token-sum-norm


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    # head_dim 32 (hidden 64 / 2 heads), one layer, vocab 64: builds and runs in milliseconds
    config = Qwen2Config(vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=128, num_hidden_layers=1, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def _batch(model_path, mu_shift=0.0):
    """Two rows of 7 tokens (row 1 right-padded by 2); completion = the last 4 real targets of each row.
    behavior_logprobs = the model's own log-probs (on-policy) + mu_shift on the completion."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 64, (2, 7), generator=g)
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[1, 5:] = 0
    input_ids[1, 5:] = 0
    loss_mask = torch.zeros(2, 6)
    loss_mask[0, 2:6] = 1
    loss_mask[1, 1:4] = 1
    model = Qwen2ForCausalLM.from_pretrained(model_path)
    with torch.no_grad():
        lp = token_logprobs(model, input_ids, attention_mask, 1.0)
    shift = torch.tensor([[0.0, 0.0, 0.3, -0.2, 0.9, 0.0], [0.0, -0.5, 0.1, 1.2, 0.0, 0.0]]) * mu_shift
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                      behavior_logprobs=(lp + shift) * loss_mask, advantages=torch.tensor([[1.0] * 6, [-1.0] * 6]),
                      weights=loss_mask.clone(), versions=torch.zeros(2, 6, dtype=torch.long), n_groups=1)


def _step(module, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer warns; the step's metrics are in step_metrics
        return module.training_step(batch, 0)


def _manual_drpo(module, batch, weights=None, mask=None):
    lp = token_logprobs(module.model, batch.input_ids, batch.attention_mask, 1.0)
    out = DRPO(delta=0.5)(LossInputs(lp, batch.behavior_logprobs, batch.advantages,
                                     batch.loss_mask if mask is None else mask,
                                     weights=batch.weights if weights is None else weights))
    return out, aggregate(out.token_losses, out.mask, "seq-mean-token-sum-norm", horizon=H)


def test_all_off_is_the_plain_step(model_path):
    batch = _batch(model_path, mu_shift=1.0)
    module = PolicyModule(model_path, DRPO(delta=0.5), horizon=H)
    assert module.reference is None and not module.needs_proximal  # nothing extra loaded or computed
    loss = _step(module, batch)
    _, expected = _manual_drpo(module, batch)
    assert loss.item() == expected.item()  # bit-identical: the same forward and arithmetic as before
    assert not any(k.split("/")[2] in ("correction", "kl_ref_mean", "entropy_mean") for k in module.step_metrics)


def test_policy_forward_matches_token_logprobs_entropy_and_topk(model_path):
    batch = _batch(model_path)
    model = Qwen2ForCausalLM.from_pretrained(model_path)
    ids, am = batch.input_ids, batch.attention_mask
    topk = torch.randint(0, 64, (2, 6, 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fwd = policy_forward(model, ids, am, 0.7, entropy=True, topk_ids=topk)
        ref = token_logprobs(model, ids, am, 0.7)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=am).logits[:, :-1] / 0.7, -1)  # [B, T, V]
    torch.testing.assert_close(fwd.logprobs, ref, rtol=0, atol=1e-6)
    pad = am[:, 1:] == 0
    torch.testing.assert_close(fwd.topk_logprobs, logp.gather(-1, topk).masked_fill(pad[..., None], 0.0))
    torch.testing.assert_close(fwd.entropy, (-(logp.exp() * logp).sum(-1)).masked_fill(pad, 0.0))


def test_kl_to_reference_is_zero_at_step_zero(model_path):
    # policy == reference at step 0: k3 = 0 per token and its gradient 1 - pi_ref / pi = 0, so the loss is DRPO's
    batch = _batch(model_path, mu_shift=1.0)
    module = PolicyModule(model_path, DRPO(delta=0.5), horizon=H, kl_coef=0.1)
    assert module.reference is not None and not any(p.requires_grad for p in module.reference.parameters())
    module.train()  # the frozen reference is outside the module tree: fit's train() leaves it in eval mode
    assert module.model.training and not module.reference.training
    assert not any(k.startswith("reference.") for k in module.state_dict())
    loss = _step(module, batch)
    assert abs(module.step_metrics["train/main/kl_ref_mean"]) < 1e-6
    _, expected = _manual_drpo(module, batch)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    # k1 after the policy moved: the term adds kl_coef * sum(k1 * m) / (N * H), k1 = log pi - log pi_ref
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    module.kl_estimator = "k1"
    loss = _step(module, batch)
    out, base = _manual_drpo(module, batch)
    with torch.no_grad():
        k1 = (token_logprobs(module.model, batch.input_ids, batch.attention_mask, 1.0)
              - token_logprobs(module.reference, batch.input_ids, batch.attention_mask, 1.0))
    expected = base + 0.1 * (k1 * out.mask).sum() / (2 * H)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert module.step_metrics["train/main/kl_ref_mean"] == pytest.approx(((k1 * out.mask).sum() / 7).item(),
                                                                          rel=1e-5)


def test_entropy_bonus_is_subtracted_under_the_mask(model_path):
    batch = _batch(model_path, mu_shift=1.0)
    module = PolicyModule(model_path, DRPO(delta=0.5), horizon=H, entropy_coef=0.01)
    loss = _step(module, batch)
    out, base = _manual_drpo(module, batch)
    with torch.no_grad():
        ent = policy_forward(module.model, batch.input_ids, batch.attention_mask, 1.0, entropy=True).entropy
    assert loss.item() == pytest.approx((base - 0.01 * (ent * out.mask).sum() / (2 * H)).item(), rel=1e-5)
    assert module.step_metrics["train/main/entropy_mean"] == pytest.approx(((ent * out.mask).sum() / 7).item(),
                                                                           rel=1e-5)


def test_tis_correction_runs_with_proximal_logprobs(model_path):
    # pi_old = the model itself, mu shifted: rho = exp(-shift) on the 7 completion tokens = e^-0.3, e^0.2, e^-0.9, 1,
    # e^0.5 = 1.65, e^-0.1, e^-1.2; TIS(cap=1.5) weights min(rho, 1.5) into the loss and truncates one token
    batch = _batch(model_path, mu_shift=1.0)
    module = PolicyModule(model_path, DRPO(delta=0.5), horizon=H, corrections=[TIS(cap=1.5)])
    assert module.needs_proximal
    loss = _step(module, batch)
    loss.backward()
    assert all(p.grad is not None for p in module.model.parameters() if p.requires_grad)
    with torch.no_grad():
        prox = token_logprobs(module.model, batch.input_ids, batch.attention_mask, 1.0)
    w = torch.exp(prox - batch.behavior_logprobs).clamp(max=1.5) * batch.loss_mask
    _, expected = _manual_drpo(module, batch, weights=batch.weights * w)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    m = module.step_metrics
    assert m["train/main/correction/tis/truncated_frac"] == pytest.approx(1 / 7)
    assert "train/main/loss/ratio_mean" in m


class _Probe(PolicyLoss):
    """Records its inputs; loss = -A log pi."""

    def __init__(self, needs_proximal=False, needs_topk=0, batch_statistics=False):
        self.needs_proximal, self.needs_topk, self.batch_statistics = needs_proximal, needs_topk, batch_statistics
        self.seen = None

    def __call__(self, inputs):
        self.seen = inputs
        mask = inputs.loss_mask
        return LossOutputs(token_losses=-inputs.advantages * inputs.logprobs * mask, mask=mask)


def test_loss_declarations_fill_inputs(model_path):
    batch = _batch(model_path)
    probe = _Probe(needs_proximal=True, batch_statistics=True)
    module = PolicyModule(model_path, probe, horizon=H)
    _step(module, batch)
    s = probe.seen
    torch.testing.assert_close(s.proximal_logprobs, s.logprobs.detach())  # same weights, no grad
    assert not s.proximal_logprobs.requires_grad and s.topk_logprobs is None and s.sampled_ids is None
    assert s.reduce is None  # single process: identity
    # under DDP the reduce sums a statistic over ranks: here a fake gather that stacks two ranks' values
    reduce = sum_over_ranks(lambda x: torch.stack([x, 2 * x]))
    assert reduce(torch.tensor(1.5, requires_grad=True)).item() == 4.5

    topk = _Probe(needs_topk=2)
    module = PolicyModule(model_path, topk, horizon=H)
    with pytest.raises(ValueError, match="top_k_logprobs=2"):
        _step(module, batch)
    ids = torch.randint(0, 64, (2, 6, 3), generator=torch.Generator().manual_seed(3))
    batch.topk_ids, batch.topk_behavior_logprobs = ids, torch.zeros(2, 6, 3)
    _step(module, batch)
    s = topk.seen
    assert s.topk_ids.shape == s.topk_logprobs.shape == (2, 6, 2) and s.topk_logprobs.requires_grad
    assert torch.equal(s.sampled_ids, batch.input_ids[:, 1:])  # the targets, matched against topk_ids by id
    with torch.no_grad():
        fwd = policy_forward(module.model, batch.input_ids, batch.attention_mask, 1.0, topk_ids=ids[..., :2])
    torch.testing.assert_close(s.topk_logprobs.detach(), fwd.topk_logprobs)


def test_constructor_validates(model_path):
    with pytest.raises(ValueError, match="kl_coef"):
        PolicyModule(model_path, DRPO(), horizon=H, kl_coef=-1.0)
    with pytest.raises(ValueError, match="k3"):
        PolicyModule(model_path, DRPO(), horizon=H, kl_estimator="k2")
