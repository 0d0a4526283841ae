"""RewardModel: a sequence-classification reward model as a TRL-style reward function, alone and in FunctionEnv.

A tiny Llama reward model (random weights, one-output head) with the project's byte tokenizer stands in for a real
one: what is checked is that each sequence is scored at its own last token whatever the padding, batching, pad id or
truncation, that chat prompts go through the model's chat template, and that bad models fail at construction."""

from __future__ import annotations

import cloudpickle
import pytest
import torch

from astratk.envs.function import FunctionEnv
from astratk.envs.reward_model import RewardModel, is_reward_model_path
from astratk.models.tokenizer import build_char_tokenizer, save_char_tokenizer
from astratk.spec import StartError

pytestmark = pytest.mark.slow
pytest.importorskip("datasets")


def _save(directory, num_labels=1, causal=False):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tok = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         num_labels=num_labels, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = (LlamaForCausalLM if causal else LlamaForSequenceClassification)(config)
    model.save_pretrained(directory)
    save_char_tokenizer(tok, directory)
    return directory


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("rm") / "tiny-rm")


def truth(directory, texts, max_length=None):
    """Each text alone, scored by the head on the hidden state of its very last token."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    tok = build_char_tokenizer()
    out = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"][-(max_length or 10**9):]
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[:, -1]
            out.append(model.score(hidden)[0, 0].item())
    return out


PROMPTS = ["1+2=", "10+20=", "7+", "a much longer prompt: 123+456="]
COMPLETIONS = ["3", "30 is it", "", "579, which I added digit by digit"]


def test_each_sequence_is_scored_at_its_own_last_token_in_any_batch(rm_dir):
    expected = truth(rm_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    for batch_size in (1, 3, 16):
        got = RewardModel(str(rm_dir), batch_size=batch_size)(PROMPTS, COMPLETIONS)
        assert got == pytest.approx(expected, abs=1e-5), batch_size
    assert len({round(x, 6) for x in expected}) == len(expected)  # the scores tell the texts apart


def test_a_text_ending_in_the_pad_token_is_still_read_at_its_end(rm_dir):
    tok = build_char_tokenizer()
    completions = ["3" + tok.pad_token, "4"]  # the byte tokenizer's pad is its EOS
    expected = truth(rm_dir, [p + c for p, c in zip(PROMPTS[:2], completions)])
    assert RewardModel(str(rm_dir))(PROMPTS[:2], completions) == pytest.approx(expected, abs=1e-5)


def test_a_long_sequence_keeps_its_last_tokens(rm_dir):
    long = "x" * 300 + "=5"
    rm = RewardModel(str(rm_dir), max_length=40)
    assert rm(["q:"], [long]) == pytest.approx(truth(rm_dir, ["q:" + long], max_length=40), abs=1e-5)
    # the model's context (256) bounds the default
    assert RewardModel(str(rm_dir))(["q:"], [long]) == pytest.approx(truth(rm_dir, ["q:" + long], 256), abs=1e-5)


def test_chat_prompts_go_through_the_models_chat_template(rm_dir):
    tok = build_char_tokenizer()
    prompt = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}]
    rm = RewardModel(str(rm_dir))
    completion = [{"role": "assistant", "content": "3"}]
    text = tok.apply_chat_template([*prompt, *completion], tokenize=False)
    assert rm.texts([prompt, prompt], [completion, "3"]) == [text, text]
    assert rm([prompt], [completion]) == pytest.approx(truth(rm_dir, [text]), abs=1e-5)
    assert rm.calls == 1 and rm.sequences == 1 and rm.tokens == len(tok(text, add_special_tokens=False)["input_ids"])


def test_a_loaded_model_scores_as_its_directory_does(rm_dir):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    by_path = RewardModel(str(rm_dir))(PROMPTS, COMPLETIONS)
    assert RewardModel(model, build_char_tokenizer())(PROMPTS, COMPLETIONS) == pytest.approx(by_path, abs=1e-5)
    assert RewardModel(model)(PROMPTS, COMPLETIONS) == pytest.approx(by_path, abs=1e-5)  # its own directory's tok


def test_bad_models_fail_at_construction_with_one_line(tmp_path):
    two = _save(tmp_path / "two-labels", num_labels=2)
    with pytest.raises(StartError, match=r"num_labels=2"):
        RewardModel(str(two))
    lm = _save(tmp_path / "causal", causal=True)
    with pytest.raises(StartError, match=r"no sequence-classification head"):
        RewardModel(str(lm))
    with pytest.raises(StartError):
        RewardModel(str(tmp_path / "missing" / "rm"))
    no_tok = tmp_path / "no-tok"
    _save(no_tok)
    for f in no_tok.glob("*token*"):
        f.unlink()
    (no_tok / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(StartError, match=r"no tokenizer"):
        RewardModel(str(no_tok))
    with pytest.raises(ValueError, match=r"dtype"):
        RewardModel(str(two), dtype="int8")
    with pytest.raises(TypeError, match=r"directory, a Hub id or a loaded"):
        RewardModel(3)


def test_a_chat_prompt_needs_a_chat_template(rm_dir, tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = None
    rm = RewardModel(str(rm_dir), tok)
    with pytest.raises(ValueError, match=r"no chat template"):
        rm([[{"role": "user", "content": "1+2="}]], ["3"])


ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


def exact(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def test_function_env_takes_a_reward_model_beside_functions_as_trl_does(rm_dir):
    assert is_reward_model_path(str(rm_dir)) and is_reward_model_path("org/name")
    assert not is_reward_model_path("tests.unit.test_reward_model.exact")
    env = FunctionEnv(ROWS, [exact, str(rm_dir)], reward_weights=[1.0, 0.5], heldout=10)
    task = next(iter(env.tasks("train")))
    texts = [task.info["columns"]["answer"], "nope"]
    scores = truth(rm_dir, [task.prompt + t for t in texts])
    rewards = env.rewards(task, texts)
    assert [r for r, _ in rewards] == pytest.approx([1.0 + 0.5 * scores[0], 0.5 * scores[1]], abs=1e-5)
    metrics = rewards[1][1]
    assert {k: metrics[k] for k in ("reward/exact", "reward/tiny-rm")} == pytest.approx(
        {"reward/exact": 0.0, "reward/tiny-rm": scores[1]}, abs=1e-5)
    # what the reward model cost, per completion: the tokens it read, its milliseconds
    assert metrics["reward_model/tiny-rm/tokens"] == len(task.prompt + "nope")  # one byte per token
    assert metrics["reward_model/tiny-rm/ms"] > 0 and "reward_model/exact/ms" not in metrics
    assert env.reward_funcs[1] == str(rm_dir)  # the saved config names the directory
    # shipped to a worker as Dask ships it: the model is loaded there, once per process
    shipped = cloudpickle.loads(cloudpickle.dumps(env))
    assert shipped._funcs[1]._model is None
    assert [r for r, _ in shipped.rewards(task, texts)] == pytest.approx([r for r, _ in rewards], abs=1e-5)
    assert len(cloudpickle.dumps(env)) < 200_000  # the weights stay out of the pickle


def test_function_env_takes_a_loaded_model_with_its_processing_class(rm_dir):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    env = FunctionEnv(ROWS, [exact, model], reward_processing_classes=[None, build_char_tokenizer()], heldout=10)
    task = next(iter(env.tasks("train")))
    [(reward, metrics)] = env.rewards(task, ["nope"])
    assert reward == pytest.approx(truth(rm_dir, [task.prompt + "nope"])[0], abs=1e-5)
    assert metrics["reward/tiny-rm"] == pytest.approx(reward)  # named after the directory it was loaded from
    with pytest.raises(ValueError, match=r"reward_processing_classes: give 2"):
        FunctionEnv(ROWS, [exact, model], reward_processing_classes=[None], heldout=10)
