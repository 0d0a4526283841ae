"""The tiny model kit: tokenizer round trip through AutoTokenizer, seeded builds, the content-keyed cache."""

from __future__ import annotations

import itertools
import json
import string
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2Tokenizer

import astratk.models.warm_start as ws
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.models import build_char_tokenizer, build_tiny_model, ensure_model
from astratk.models.cache import MARKER, model_key
from astratk.models.chat import encode_chat, stop_token_ids
from astratk.models.tokenizer import save_char_tokenizer
from astratk.spec import ModelSpec, TinyModelSpec

# head_dim 32 (the least vLLM's CPU attention runs), one layer, a few steps: builds in about a second.
TINY = TinyModelSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128,
                     warm_start_steps=5, warm_start_batch=8, warm_start_lr=1e-3, seed=3)
ENV = ArithmeticEnv(n_heldout=32)
TEXT = string.printable + "  double  spaces\n\nblank line\t tab 0123456789"


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return ensure_model(ModelSpec(tiny=TINY), ENV, cache_dir=tmp_path_factory.mktemp("cache"), log=lambda s: None)


def test_tokenizer_survives_autotokenizer_beside_a_qwen2_config(tmp_path):
    tok = build_char_tokenizer()
    Qwen2Config(vocab_size=len(tok)).save_pretrained(tmp_path)
    save_char_tokenizer(tok, tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tmp_path / "tokenizer.json").is_file()
    # transformers 5.19 rebuilds model_type qwen2 as Qwen2Tokenizer whatever tokenizer_class says: the tokenizer is
    # built so that every class that may load it tokenizes identically (a word-level vocabulary lost its spaces).
    for loaded in (AutoTokenizer.from_pretrained(tmp_path), Qwen2Tokenizer.from_pretrained(tmp_path),
                   PreTrainedTokenizerFast.from_pretrained(tmp_path)):
        ids = loaded(TEXT, add_special_tokens=False)["input_ids"]
        assert ids == tok(TEXT, add_special_tokens=False)["input_ids"], type(loaded)
        assert len(ids) == len(TEXT)  # one token per ASCII character: spaces and newlines kept
        assert loaded.decode(ids) == TEXT
        chat = loaded.apply_chat_template([{"role": "user", "content": "12 + 3=\n"}], add_generation_prompt=True,
                                          tokenize=False)
        assert chat == "<|im_start|>user\n12 + 3=\n<|im_end|>\n<|im_start|>assistant\n"
        assert stop_token_ids(loaded) == (2, 0)  # <|im_end|>, <|endoftext|>
        assert (loaded.eos_token_id, loaded.pad_token_id) == (0, 0)


def test_tokenizer_encodes_specials_atomically_and_any_text_round_trips():
    tok = build_char_tokenizer()
    ids = encode_chat(tok, [{"role": "user", "content": "7+8="}])
    assert tok.decode(ids) == "<|im_start|>user\n7+8=<|im_end|>\n<|im_start|>assistant\n"
    assert ids.count(1) == 2 and ids.count(2) == 1  # <|im_start|> x2, <|im_end|> x1, each one id
    assert tok.decode(tok("héllo ✓")["input_ids"]) == "héllo ✓"  # non-ASCII: several byte tokens, no unk


def test_built_model_loads_with_auto_classes_and_records_its_warm_start(built):
    model = AutoModelForCausalLM.from_pretrained(built)
    tok = AutoTokenizer.from_pretrained(built)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.config.head_dim == 32 and model.config.vocab_size == len(tok) == 260
    assert model.dtype == torch.float32
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", MARKER):
        assert (built / name).is_file(), name
    record = json.loads((built / MARKER).read_text())
    assert record["key"] == built.name.removeprefix("tiny-") and record["steps"] == 5 and record["n_heldout"] == 32
    assert 0.0 <= record["heldout_accuracy"] <= 1.0
    prompt = torch.tensor([encode_chat(tok, [{"role": "user", "content": "1+2="}])])
    out = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= prompt.shape[1] + 3


def test_same_spec_builds_bit_identical_weights(built, tmp_path):
    again = ensure_model(ModelSpec(tiny=TINY), ENV, cache_dir=tmp_path, log=lambda s: None)
    assert again != built and again.name == built.name
    a, b = load_file(built / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fresh = build_tiny_model(TINY, build_char_tokenizer()).state_dict()
    assert not torch.equal(fresh["model.embed_tokens.weight"], a["model.embed_tokens.weight"])  # it did train


def test_second_call_reuses_without_training(built, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the warm start ran again")

    monkeypatch.setattr(ws, "warm_start", boom)
    lines: list[str] = []
    assert ensure_model(ModelSpec(tiny=TINY), ENV, cache_dir=built.parent.parent, log=lines.append) == built
    assert any("reusing" in line for line in lines)


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise KeyboardInterrupt  # as if the build were killed mid-way

    monkeypatch.setattr(ws, "warm_start", boom)
    with pytest.raises(KeyboardInterrupt):
        ensure_model(ModelSpec(tiny=TINY), ENV, cache_dir=tmp_path, log=lambda s: None)
    assert list((tmp_path / "models").iterdir()) == []


def test_key_follows_what_changes_the_weights():
    base = model_key(TINY, ENV)
    assert len(base) == 16 and base == model_key(TinyModelSpec(**vars(TINY)), ArithmeticEnv(n_heldout=32))
    assert base == model_key(TINY, ArithmeticEnv(levels=[1, 2], n_heldout=32))  # tuple or list: same arguments
    assert base != model_key(TinyModelSpec(**{**vars(TINY), "seed": 4}), ENV)
    assert base != model_key(TINY, ArithmeticEnv(n_heldout=32, levels=[1]))


def test_user_path_is_returned_unchanged_or_rejected_by_name(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        ensure_model(ModelSpec(path=str(tmp_path)), ENV)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no safetensors weights"):  # a run would fail later, loading it
        ensure_model(ModelSpec(path=str(tmp_path)), ENV)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not a whole safetensors file"):  # likewise
        ensure_model(ModelSpec(path=str(tmp_path)), ENV)
    (tmp_path / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # whole, if without tensors
    assert ensure_model(ModelSpec(path=str(tmp_path)), ENV) == tmp_path


def test_head_dim_below_32_is_rejected(tmp_path):
    narrow = TinyModelSpec(hidden_size=64, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="hidden_size / num_heads"):
        build_tiny_model(narrow, build_char_tokenizer())
    with pytest.raises(ValueError, match="hidden_size / num_heads"):
        ensure_model(ModelSpec(tiny=narrow), ENV, cache_dir=tmp_path)
    assert not (tmp_path / "models").exists()


def test_warm_start_target_must_be_a_fraction():
    with pytest.raises(ValueError, match="warm_start_target"):
        build_tiny_model(TinyModelSpec(warm_start_target=30), build_char_tokenizer())


def test_loss_covers_exactly_the_demonstration_and_end_of_turn():
    tok, env = build_char_tokenizer(), ArithmeticEnv(n_heldout=4)
    task = next(iter(env.tasks("train")))
    ids, attn, target = ws._collate([ws._examples(tok, env, task)[0], ws._examples(tok, env, task)[0]], tok.pad_token_id)
    assert tok.decode(ids[0][target[0]]) == task.info["answer"] + "<|im_end|>"
    assert attn.sum() == 2 * len(ids[0])  # equal lengths: no padding


def test_exact_match_means_every_completion_token_is_the_greedy_choice():
    tok, env = build_char_tokenizer(), ArithmeticEnv(n_heldout=4)
    tasks = list(itertools.islice(env.tasks("train"), 2))
    ids, attn, target = ws._collate([ws._examples(tok, env, t)[0] for t in tasks], tok.pad_token_id)

    class Oracle(torch.nn.Module):  # predicts the true next token, except one completion token of example 1
        def forward(self, input_ids, attention_mask):
            nxt = torch.roll(input_ids, -1, dims=1)
            nxt[1, int(target[1].nonzero()[0]) - 1] += 1  # wrong first answer digit for example 1
            return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, len(tok)).float())

    _loss, exact = ws.completion_loss(Oracle(), ids, attn, target)
    assert exact.tolist() == [True, False]


def test_warm_start_stops_once_train_exact_match_reaches_the_target():
    tok, env = build_char_tokenizer(), ArithmeticEnv(n_heldout=8)
    spec = TinyModelSpec(**{**vars(TINY), "warm_start_steps": ws.STOP_WINDOW + 10, "warm_start_target": 0.0})
    lines: list[str] = []
    report = ws.warm_start(build_tiny_model(spec, tok), tok, env, spec, log=lines.append)
    assert report.steps == ws.STOP_WINDOW  # the first step with a full window; any rate reaches 0%
    assert any("stopping" in line for line in lines)
    never = TinyModelSpec(**{**vars(TINY), "warm_start_target": None})
    assert ws.warm_start(build_tiny_model(never, tok), tok, env, never, log=lines.append).steps == 5


def test_a_warm_start_ended_by_its_cap_short_of_the_target_says_what_to_change():
    tok, env = build_char_tokenizer(), ArithmeticEnv(n_heldout=8)
    unreachable = TinyModelSpec(**{**vars(TINY), "warm_start_target": 1.0})  # 5 steps never reach 100%
    lines: list[str] = []
    assert ws.warm_start(build_tiny_model(unreachable, tok), tok, env, unreachable, log=lines.append).steps == 5
    warning = [line for line in lines if "WARNING" in line]
    assert len(warning) == 1 and "model.tiny.seed (now 3)" in warning[0] and "warm_start_steps" in warning[0]
    for quiet in (TinyModelSpec(**{**vars(TINY), "warm_start_target": None}),  # no target: the cap is the plan
                  TinyModelSpec(**{**vars(TINY), "warm_start_steps": ws.STOP_WINDOW + 10, "warm_start_target": 0.0})):
        lines.clear()
        ws.warm_start(build_tiny_model(quiet, tok), tok, env, quiet, log=lines.append)
        assert not [line for line in lines if "WARNING" in line]


def test_encode_chat_renders_each_conversation_once_per_tokenizer_and_template():
    """A group's samples share their messages: the template is rendered once, copies are handed out, and a changed
    template or another tokenizer renders again."""
    tok = build_char_tokenizer()
    calls = []
    render = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **k: calls.append(1) or render(*a, **k)
    messages = [{"role": "user", "content": "12+30="}]
    first = encode_chat(tok, messages)
    first.append(-1)  # the caller's copy: the cache keeps its own
    again = encode_chat(tok, [dict(m) for m in messages])
    assert again == first[:-1] and len(calls) == 1
    assert tok.decode(again).startswith("<|im_start|>user\n12+30=")
    assert encode_chat(tok, [{"role": "user", "content": "12+31="}]) != again and len(calls) == 2
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert encode_chat(tok, messages) != again and len(calls) == 3
    other = build_char_tokenizer()
    assert encode_chat(other, messages) == again


def test_a_slow_warm_start_says_where_it_is_at_least_every_log_every_s(monkeypatch):
    """A real model's warm-start step can take a minute: a line comes every LOG_EVERY_S seconds, not only every
    LOG_EVERY steps (5 steps here, all below LOG_EVERY)."""
    tok, env = build_char_tokenizer(), ArithmeticEnv(n_heldout=8)
    spec = TinyModelSpec(**{**vars(TINY), "warm_start_target": None})
    lines: list[str] = []
    monkeypatch.setattr(ws, "LOG_EVERY_S", 0.0)
    ws.supervised_steps(build_tiny_model(spec, tok), tok, env, spec, log=lines.append)
    assert [line.split()[3] for line in lines if line.startswith("warm start: step")] == [f"{k}/5" for k in range(1, 6)]
    lines.clear()
    monkeypatch.setattr(ws, "LOG_EVERY_S", 3600.0)
    ws.supervised_steps(build_tiny_model(spec, tok), tok, env, spec, log=lines.append)
    assert [line.split()[3] for line in lines if line.startswith("warm start: step")] == ["5/5"]
