"""Token-budget micro-batching (`PolicyModule(micro_batch_tokens=...)`): the plan respects the budget, and a split step
is the unsplit step (loss value, gradient, metrics, to fp32 round-off) for every aggregation mode, with corrections,
regularisers, top-K log-probs and a loss with batch statistics; through a Lightning fit, one optimiser step per batch
with gradient clipping still applied."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk.losses.corrections import MIS, TIS
from astratk.losses.dppo import DPPOTopKTV
from astratk.losses.drpo import DRPO
from astratk.losses.gspo import GSPO
from astratk.losses.m2po import M2PO, M2POClip
from astratk.records import TrainBatch
from astratk.spec import PolicySpec, RunSpec, TrainerSpec
from astratk.training.aggregation import AGGREGATIONS
from astratk.training.collate import micro_batches, place_rows, row_lengths, select_rows
from astratk.training.logprobs import token_logprobs
from astratk.training.module import PolicyModule

H = 12  # horizon for seq-mean-token-sum-norm
LENGTHS = [9, 4, 13, 7, 12, 5, 8, 3]  # ragged on purpose; row 7 has no completion token (an empty sequence)
PROMPT = 3
BUDGET = 30  # padded tokens per micro-batch: the 8 rows (13 wide, 104 padded tokens) split into 3 micro-batches


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=128, num_hidden_layers=2, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_qwen2_micro")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def make_batch(model_path, k=3):
    """Right-padded rows of LENGTHS; completion = everything after PROMPT tokens; mu = the model's own log-probs
    shifted by N(0, s_i^2) per token, s_i = 0.15 (i + 1) for row i (so ratios differ from 1, MIS drops tokens, and
    M2PO's cut binds, at a threshold that differs between micro-batches)."""
    g = torch.Generator().manual_seed(1)
    b, width = len(LENGTHS), max(LENGTHS)
    input_ids = torch.zeros(b, width, dtype=torch.long)
    attention_mask = torch.zeros(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width - 1)
    for i, n in enumerate(LENGTHS):
        input_ids[i, :n] = torch.randint(1, 64, (n,), generator=g)
        attention_mask[i, :n] = 1
        loss_mask[i, PROMPT - 1: n - 1] = 1.0
    with torch.no_grad():
        lp = token_logprobs(Qwen2ForCausalLM.from_pretrained(model_path), input_ids, attention_mask, 1.0)
    spread = 0.15 * torch.arange(1, b + 1).unsqueeze(1)  # [B, 1]
    mu = (lp + spread * torch.randn(b, width - 1, generator=g)).clamp(max=-1e-3) * loss_mask
    advantages = torch.randn(b, 1, generator=g).expand(b, width - 1) * loss_mask
    topk_mu = torch.log_softmax(torch.randn(b, width - 1, k, generator=g), -1).sort(-1, descending=True).values
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, behavior_logprobs=mu,
                      advantages=advantages.contiguous(), weights=loss_mask * 0.5 + 0.5 * loss_mask.flip(0),
                      versions=torch.zeros(b, width - 1, dtype=torch.long), n_groups=4,
                      rewards=torch.rand(b, generator=g), topk_ids=torch.randint(0, 64, (b, width - 1, k), generator=g),
                      topk_behavior_logprobs=topk_mu * loss_mask[..., None], roles=("policy",) * b)


def run_step(module, batch):
    """training_step + backward of what it returns (the earlier micro-batches were back-propagated inside)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer warns; the metrics are in step_metrics
        loss = module.training_step(batch, 0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.model.named_parameters()}
    return loss.detach(), grads, dict(module.step_metrics)


def assert_same_step(whole, split):
    (l1, g1, m1), (l2, g2, m2) = whole, split
    m1, m2 = dict(m1), dict(m2)
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-7)
    worst = max((g2[n] - g1[n]).abs().max().item() for n in g1)
    scale = max(g.abs().max().item() for g in g1.values())
    assert worst <= 1e-5 * scale + 1e-8, f"gradient differs by {worst:.3g} (largest entry {scale:.3g})"
    assert m1.pop("train/main/micro_batches") == 1.0 and m2.pop("train/main/micro_batches") > 1
    assert m1.keys() == m2.keys()
    for key in m1:
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key


def whole_and_split(model_path, batch, loss_factory, **kwargs):
    whole = run_step(PolicyModule(model_path, loss_factory(), horizon=H, **kwargs), batch)
    split = run_step(PolicyModule(model_path, loss_factory(), horizon=H, micro_batch_tokens=BUDGET, **kwargs), batch)
    return whole, split


# ------------------------------------------------------------------------------------------------------ the plan


@pytest.mark.parametrize("budget", [1, 5, 13, 14, 30, 60, 103])
def test_plan_stays_within_budget_and_covers_every_row_once(model_path, budget):
    batch = make_batch(model_path)
    lengths = row_lengths(batch)
    assert lengths.tolist() == LENGTHS
    chunks = micro_batches(batch, budget)
    rows = torch.cat(chunks).sort().values
    assert rows.tolist() == list(range(len(LENGTHS)))
    for c in chunks:
        padded = len(c) * int(lengths[c].max())
        assert padded <= budget or len(c) == 1  # a row longer than the budget is a micro-batch by itself
        assert c.tolist() == sorted(c.tolist())


def test_no_budget_or_a_budget_covering_the_batch_is_one_micro_batch(model_path):
    batch = make_batch(model_path)
    for budget in (None, 8 * 13, 10**6):
        [rows] = micro_batches(batch, budget)
        assert rows.tolist() == list(range(8))
    assert len(micro_batches(batch, 8 * 13 - 1)) > 1
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        micro_batches(batch, 0)


def test_longest_first_packing():
    # lengths 13, 12, 9, 8, 7, 5, 4, 3 under budget 30: [13, 12] (2 x 13 = 26), [9, 8, 7] (27), [5, 4, 3] (15)
    am = torch.zeros(8, 13, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        am[i, :n] = 1
    batch = TrainBatch(am, am, *(torch.zeros(8, 12) for _ in range(4)), torch.zeros(8, 12, dtype=torch.long))
    assert [c.tolist() for c in micro_batches(batch, 30)] == [[2, 4], [0, 3, 6], [1, 5, 7]]


def test_select_rows_trims_padding_and_place_rows_inverts_it(model_path):
    batch = make_batch(model_path)
    rows = torch.tensor([1, 5, 7])  # lengths 4, 5, 3: trimmed to 5 columns, 4 token positions
    part = select_rows(batch, rows)
    assert part.input_ids.shape == (3, 5) and part.loss_mask.shape == (3, 4) and part.topk_ids.shape == (3, 4, 3)
    assert torch.equal(part.input_ids, batch.input_ids[rows, :5]) and part.rewards.tolist() == batch.rewards[
        rows].tolist()
    assert batch.loss_mask[rows, 4:].sum() == 0  # only padding was dropped
    others = torch.tensor([0, 2, 3, 4, 6])
    placed = place_rows([(rows, part.advantages), (others, select_rows(batch, others).advantages)], 8, 12)
    assert torch.equal(placed, batch.advantages)


# ------------------------------------------------------------------------------------- split step == whole step


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_split_step_equals_whole_step_in_every_mode(model_path, mode):
    batch = make_batch(model_path)
    assert len(micro_batches(batch, BUDGET)) == 3
    whole, split = whole_and_split(model_path, batch, lambda: DRPO(delta=0.5), aggregation=mode)
    assert_same_step(whole, split)
    assert split[2]["train/main/micro_batches"] == 3.0


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_batch_statistics_loss_split_equals_whole(model_path, mode):
    # M2PO's cut is a statistic of the whole batch: the two-pass step keeps it whole (mask_frac > 0: it binds)
    batch = make_batch(model_path)
    whole, split = whole_and_split(model_path, batch, lambda: M2PO(tau=0.02), aggregation=mode)
    assert whole[2]["train/main/loss/mask_frac"] > 0.1
    assert_same_step(whole, split)


def test_per_micro_batch_statistics_would_differ(model_path):
    """The reason for the two-pass step: if each micro-batch computed its own M2PO cut (one-pass accumulation), the
    step would differ from the unsplit one. (Guards the test above against a batch where it cannot tell.)"""
    batch = make_batch(model_path)
    whole = run_step(PolicyModule(model_path, M2PO(tau=0.02), horizon=H, aggregation="token-mean"), batch)
    naive_loss = M2PO(tau=0.02)
    naive_loss.batch_statistics = False  # routes the split step through per-micro-batch loss calls
    naive = run_step(PolicyModule(model_path, naive_loss, horizon=H, aggregation="token-mean",
                                  micro_batch_tokens=BUDGET), batch)
    worst = max((naive[1][n] - whole[1][n]).abs().max().item() for n in whole[1])
    assert worst > 1e-3 * max(g.abs().max().item() for g in whole[1].values())


@pytest.mark.parametrize(("mode", "loss_factory", "kwargs"), [
    ("token-mean", lambda: DRPO(delta=0.5), {"corrections": [MIS(low=0.7, high=1.4)]}),  # MIS drops tokens
    ("seq-mean-token-mean", lambda: DRPO(delta=0.5), {"corrections": [TIS(cap=1.2), MIS(level="sequence")]}),
    ("seq-mean-token-sum-norm", lambda: DRPO(delta=0.5), {"kl_coef": 0.1, "entropy_coef": 0.01}),
    ("token-mean", lambda: DPPOTopKTV(delta=0.05, top_k=3), {"entropy_coef": 0.01}),
    ("seq-mean-token-sum", lambda: GSPO(), {}),  # its required seq-mean-token-mean wins
    ("token-mean", lambda: M2POClip(tau=0.02, recompute=True), {"corrections": [MIS(low=0.7, high=1.4)],
                                                                "kl_coef": 0.1}),
])
def test_split_step_with_corrections_regularisers_and_topk(model_path, mode, loss_factory, kwargs):
    batch = make_batch(model_path)
    with torch.no_grad():  # the KL term needs the policy away from the reference: move the policy a little
        torch.manual_seed(3)
        noise = {n: 0.02 * torch.randn_like(p) for n, p in Qwen2ForCausalLM.from_pretrained(model_path)
                 .named_parameters()}
    modules = [PolicyModule(model_path, loss_factory(), horizon=H, aggregation=mode, micro_batch_tokens=budget,
                            **kwargs) for budget in (None, BUDGET)]
    with torch.no_grad():
        for module in modules:
            for n, p in module.model.named_parameters():
                p.add_(noise[n])
    whole, split = (run_step(m, batch) for m in modules)
    assert_same_step(whole, split)
    m = whole[2]
    if "corrections" in kwargs and mode == "token-mean":
        assert m["train/main/correction/mis/dropped_frac"] > 0  # the effective token count differs from the mask's


def test_a_budget_covering_the_batch_is_the_plain_step_bit_for_bit(model_path):
    batch = make_batch(model_path)
    plain = run_step(PolicyModule(model_path, DRPO(delta=0.5), horizon=H), batch)
    covered = run_step(PolicyModule(model_path, DRPO(delta=0.5), horizon=H, micro_batch_tokens=8 * 13), batch)
    assert covered[0].item() == plain[0].item()
    assert all(torch.equal(covered[1][n], plain[1][n]) for n in plain[1])
    assert covered[2] == plain[2]


# ------------------------------------------------------------------------------------------- through Lightning


class SGDModule(PolicyModule):
    """Plain SGD: the update is lr x gradient, so the weights compare gradients (Adam's first step is ~lr x sign)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)


def fit(model_path, batch, clip, budget, steps=2):
    module = SGDModule(model_path, DRPO(delta=0.5), lr=0.5, horizon=H, micro_batch_tokens=budget)
    seen = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((trainer.global_step, pl_module.step_metrics["train/main/micro_batches"]))

    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
                         callbacks=[Watch()])
    trainer.fit(module, train_dataloaders=DataLoader([batch] * steps, batch_size=None, collate_fn=lambda x: x))
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}, seen


def test_fit_counts_optimiser_steps_and_clips_as_unsplit(model_path):
    batch = make_batch(model_path)
    whole, seen_whole = fit(model_path, batch, clip=0.05, budget=None)
    split, seen_split = fit(model_path, batch, clip=0.05, budget=BUDGET)
    assert seen_whole == [(1, 1.0), (2, 1.0)] and seen_split == [(1, 3.0), (2, 3.0)]  # one optimiser step per batch
    assert max((split[n] - whole[n]).abs().max().item() for n in whole) < 1e-6
    unclipped, _ = fit(model_path, batch, clip=None, budget=BUDGET)  # the clip bound: gradient norm >> 0.05
    assert max((unclipped[n] - split[n]).abs().max().item() for n in whole) > 1e-3


def test_accumulate_grad_batches_is_refused_with_the_fix(model_path):
    module = PolicyModule(model_path, DRPO(delta=0.5), horizon=H)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        trainer.fit(module, train_dataloaders=DataLoader([make_batch(model_path)] * 2, batch_size=None,
                                                         collate_fn=lambda x: x))


def test_micro_batch_tokens_is_validated(model_path):
    for bad in (0, -3, "whole", 1.5, True):
        with pytest.raises(ValueError, match="micro_batch_tokens must be an integer >= 1"):
            PolicyModule(model_path, DRPO(), horizon=H, micro_batch_tokens=bad)
    with pytest.raises(ValueError, match=r"policies\[0\].trainer.micro_batch_tokens must be an integer >= 1"):
        RunSpec(policies=[PolicySpec(trainer=TrainerSpec(micro_batch_tokens=0))]).validate()
    for good in (4096, "auto", None):
        RunSpec(policies=[PolicySpec(trainer=TrainerSpec(micro_batch_tokens=good))]).validate()
    assert TrainerSpec().micro_batch_tokens == "auto"


def test_activation_estimate_counts_widths_vocab_and_not_adapter_factors(model_path):
    from astratk.models.lora import add_lora
    from astratk.spec import LoraSpec
    from astratk.training import activations

    model = Qwen2ForCausalLM.from_pretrained(model_path)
    # 2 layers x (q 64+64, k 64+32, v 64+32, o 64+64, gate 64+128, up 64+128, down 128+64) + a 64-token vocabulary
    widths = 2 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    assert activations.bytes_per_token(model) == int(4 * (1.2 * widths + 3 * 64)) + 1
    adapted = add_lora(Qwen2ForCausalLM.from_pretrained(model_path), LoraSpec(r=8, alpha=16), "lora")
    assert activations.bytes_per_token(adapted) == activations.bytes_per_token(model)


def test_auto_budget_runs_a_batch_whole_when_it_fits_and_splits_it_when_not(model_path, monkeypatch, capsys):
    from astratk.training import activations

    batch = make_batch(model_path)
    per_token = activations.bytes_per_token(Qwen2ForCausalLM.from_pretrained(model_path))
    seen = {}
    for room_tokens, expect in ((10_000, 1.0), (BUDGET, 3.0)):  # room for the whole batch / for BUDGET tokens
        monkeypatch.setattr(activations, "memory_available",
                            lambda device, n=room_tokens: int(n * per_token / activations.SHARE) + per_token // 2)
        module = PolicyModule(model_path, DRPO(delta=0.5), horizon=H, share_prompts=False)
        _, metrics = module._step(batch)
        seen[room_tokens] = metrics["micro_batches"]
        assert metrics["micro_batches"] == expect
        assert f"a step runs whole up to ~{room_tokens:,} tokens" in capsys.readouterr().out  # said once, at start
        module._step(batch)
        assert "micro_batch_tokens auto" not in capsys.readouterr().out
    monkeypatch.setattr(activations, "memory_available", lambda device: None)  # unreadable: whole batches, said so
    module = PolicyModule(model_path, DRPO(delta=0.5), horizon=H)
    assert module._step(batch)[1]["micro_batches"] == 1.0
    assert "cannot be read" in capsys.readouterr().out


def test_memory_available_reads_this_machine():
    from astratk.training.activations import memory_available

    room = memory_available(torch.device("cpu"))
    assert room is not None and 0 < room < 1 << 50
    assert memory_available(torch.device("meta")) is None


def test_memory_available_on_a_gpu_keeps_within_the_process_share(monkeypatch):
    """On a GPU: the device's free memory plus what the caching allocator holds unused, capped by this process's
    share (`trainer.gpu_memory_fraction`), measured against what it already allocated. Faked: no GPU here."""
    from astratk import gpu
    from astratk.training import activations

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 14 * gib)
    device = torch.device("cuda", 0)
    monkeypatch.setattr(gpu, "process_share", lambda device: 0.0)
    assert activations.memory_available(device) == 34 * gib  # 30 free + 4 reserved, unused
    monkeypatch.setattr(gpu, "process_share", lambda device: 0.25)
    assert activations.memory_available(device) == 10 * gib  # a quarter of 80 is 20, 10 of it already allocated
