"""`model.path` as a Hub id: resolved offline (HF_HUB_OFFLINE) from a cache in huggingface_hub's layout built here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk.models.hub import is_hub_id, resolve
from astratk.models.tokenizer import build_char_tokenizer, save_char_tokenizer
from astratk.spec import ModelSpec
from tests.hubcache import put_in_hub_cache


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out))
    save_char_tokenizer(tok, out)
    return out


@pytest.fixture
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    from astratk.models import hub

    monkeypatch.setattr(hub, "_resolved", {})


def test_hub_ids_are_told_from_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("acme/tiny.v2")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # an existing relative directory wins
    for path in ("./models/x", "/abs/dir", "a/b/c", "gpt2", "a--b/c", "org/..", "-org/name"):
        assert not is_hub_id(path), path


def test_resolves_from_the_cache_offline_and_pins_the_commit(model_dir, tmp_path, offline):
    snapshot = put_in_hub_cache(model_dir, tmp_path / "hub", "acme/tiny-chat", commit="a" * 40)
    r = resolve("acme/tiny-chat", cache_dir=str(tmp_path / "hub"))
    assert r.directory == snapshot and r.revision == "a" * 40 and r.repo_id == "acme/tiny-chat"
    # a branch and the commit itself resolve to the same snapshot
    assert resolve("acme/tiny-chat", "main", cache_dir=str(tmp_path / "hub")).directory == snapshot
    assert resolve("acme/tiny-chat", "a" * 40, cache_dir=str(tmp_path / "hub")).directory == snapshot
    from astratk.models.loading import load_causal_lm, load_tokenizer

    assert load_causal_lm(str(r.directory)).config.vocab_size == 260
    assert load_tokenizer(r.directory).decode(load_tokenizer(r.directory)("1 + 2\n")["input_ids"]) == "1 + 2\n"


@pytest.mark.parametrize(("path", "revision", "words"), [
    ("acme/missing", None, ["acme/missing", "HF_HUB_OFFLINE", "policies[0].model.path"]),
    ("acme/tiny-chat", "v9", ["acme/tiny-chat", "'v9'", "policies[0].model.path"]),
])
def test_offline_misses_are_one_line_errors_naming_the_id(model_dir, tmp_path, offline, path, revision, words):
    put_in_hub_cache(model_dir, tmp_path / "hub", "acme/tiny-chat")
    with pytest.raises(ValueError) as e:
        resolve(path, revision, key="policies[0].model.path", cache_dir=str(tmp_path / "hub"))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(("skip", "missing"), [(("model.safetensors",), "safetensors"),
                                               (("config.json",), "config.json")])
def test_a_snapshot_missing_a_file_names_the_id_and_the_file(model_dir, tmp_path, offline, skip, missing):
    put_in_hub_cache(model_dir, tmp_path / "hub", "acme/partial", skip=skip)
    with pytest.raises(ValueError, match=rf"policies\[0\].model.path: 'acme/partial'.*{missing}"):
        resolve("acme/partial", key="policies[0].model.path", cache_dir=str(tmp_path / "hub"))


def test_revision_on_a_local_directory_is_refused(model_dir):
    with pytest.raises(ValueError, match=r"model.revision.*local directory"):
        ModelSpec(path=str(model_dir), revision="main").validate("model")
    with pytest.raises(ValueError, match=r"model.path.*does not exist"):
        ModelSpec(path="./no/such/dir").validate("model")
    ModelSpec(path="acme/not-checked-until-the-run").validate("model")  # cheap: resolution happens at start


def test_hf_hub_offline_from_the_environment(model_dir, tmp_path):
    """What a user does: HF_HUB_OFFLINE=1 and HF_HUB_CACHE in the environment, read when huggingface_hub loads."""
    put_in_hub_cache(model_dir, tmp_path / "hub", "acme/tiny-chat", commit="b" * 40)
    code = textwrap.dedent("""
        from astratk.models.hub import resolve
        r = resolve("acme/tiny-chat")
        print(r.revision, r.directory.name)
        try:
            resolve("acme/other", key="policies[1].model.path")
        except ValueError as e:
            print("ERR", e)
    """)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout.splitlines()
    assert out[0] == f"{'b' * 40} {'b' * 40}"
    assert out[1].startswith("ERR policies[1].model.path: cannot resolve Hub id 'acme/other': HF_HUB_OFFLINE")
