"""Tokenizers that `AutoTokenizer` loads wrongly: detected at load, replaced by the file as saved, or refused.

The case from the field: a character-level `tokenizers` WordLevel tokenizer saved as `PreTrainedTokenizerFast` beside
a Qwen2 config. transformers 5's `AutoTokenizer` rebuilds it as `Qwen2Tokenizer`, which drops spaces and newlines.
"""

from __future__ import annotations

import asyncio
import string
import warnings

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from astratk.models.loading import load_tokenizer, round_trip_problem, tokenizer_fallback, tokenizer_only_dir

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def wordlevel_model(directory, alphabet: str = string.printable + "é", fuse: bool = True) -> None:
    """A user's own model: one token per character (WordLevel), ChatML, a Qwen2 config beside it. `fuse=False`
    leaves out the decoder that joins characters (decoding then puts spaces between them)."""
    vocab = {t: i for i, t in enumerate(SPECIALS + list(dict.fromkeys(alphabet)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    if fuse:
        core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=SPECIALS[0], pad_token=SPECIALS[0],
                                  extra_special_tokens=SPECIALS[1:])
    tok.chat_template = CHATML
    tok.save_pretrained(str(directory))
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128)
    Qwen2ForCausalLM(cfg).save_pretrained(str(directory))


def test_autotokenizer_really_breaks_this_tokenizer(tmp_path):
    """The premise, so the other tests cannot pass vacuously on a transformers that loads it right."""
    wordlevel_model(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert round_trip_problem(tok, alphabet=PreTrainedTokenizerFast.from_pretrained(str(tmp_path))) is not None
    assert tok.decode(tok("What is 37+48?")["input_ids"]) == "Whatis37+48?"


def test_falls_back_to_the_file_as_saved_with_a_warning(tmp_path):
    wordlevel_model(tmp_path)
    with pytest.warns(UserWarning, match=r"AutoTokenizer loads .* which changes text .*using tokenizer.json as saved"):
        tok = load_tokenizer(tmp_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 37+48?"}], add_generation_prompt=True,
                                     tokenize=False)
    assert tok.decode(tok(prompt)["input_ids"]) == "<|im_start|>user\nWhat is 37+48?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer_fallback(tmp_path) is not None
    again = load_tokenizer(tmp_path)  # decided once per process, a fresh object each time
    assert again is not tok and round_trip_problem(again) is None


def test_engines_and_trainer_get_the_working_tokenizer(tmp_path):
    from astratk.contracts import GenerationRequest, SamplingParams
    from astratk.engines.torch_engine import TorchEngine
    from astratk.models.chat import encode_chat

    wordlevel_model(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = TorchEngine(tmp_path, max_batch=4)
    try:
        ids = encode_chat(engine.tokenizer, [{"role": "user", "content": "1 + 2"}])
        assert engine.tokenizer.decode(ids).startswith("<|im_start|>user\n1 + 2<|im_end|>\n")
        [c] = asyncio.run(engine.generate([GenerationRequest(tuple(ids), SamplingParams(max_tokens=3, seed=0))]))
        assert len(c.token_ids) == 3
    finally:
        engine.close()


def test_vllm_gets_a_tokenizer_directory_autotokenizer_loads_as_saved(tmp_path):
    wordlevel_model(tmp_path / "model")
    only = tokenizer_only_dir(tmp_path / "model", tmp_path / "tok")
    assert round_trip_problem(AutoTokenizer.from_pretrained(only)) is None


def test_nothing_round_trips_is_a_clear_error(tmp_path):
    wordlevel_model(tmp_path, fuse=False)  # decodes "What" as "W h a t", whichever class loads it
    with pytest.raises(RuntimeError, match=r"does not round-trip text: AutoTokenizer \(Qwen2Tokenizer\).*as saved"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("alphabet", ["0123456789+= \n", "0123456789+="])
def test_a_small_alphabet_is_not_a_fault(tmp_path, alphabet):
    """Characters the saved tokenizer has no token for are left out of the check; spaces it has must survive."""
    wordlevel_model(tmp_path, alphabet=alphabet)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = load_tokenizer(tmp_path)
    assert tok.decode(tok("12+3=15")["input_ids"]) == "12+3=15"
    fell_back = any("as saved" in str(w.message) for w in caught)
    assert fell_back == (" " in alphabet)  # with a space in the vocabulary, Qwen2Tokenizer's loss is caught


def test_the_built_in_character_tokenizer_passes_without_warning(tmp_path):
    from astratk.models.tokenizer import build_char_tokenizer, save_char_tokenizer

    save_char_tokenizer(build_char_tokenizer(), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok = load_tokenizer(tmp_path)
    assert tokenizer_fallback(tmp_path) is None and tok.decode(tok("a b\n")["input_ids"]) == "a b\n"


def test_no_tokenizer_files_gives_none(tmp_path):
    assert load_tokenizer(tmp_path) is None
