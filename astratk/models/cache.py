"""`ensure_model`: the HF model directory a policy starts from, built once per recipe and cached.

A user's directory (`ModelSpec.path`) is used as it is. Otherwise the tiny model is built, warm-started on the env and
saved under `<cache>/models/tiny-<key>`, where the key hashes everything that changes the weights: the
`TinyModelSpec`, the env's class path and constructor arguments (read back from the instance, as `astratk.config`
dumps it), and `KIT_VERSION`. A build happens in a temporary
sibling directory that is renamed into place only when complete (`warm_start.json`, written last, marks it), so a
killed build never leaves a half model and two processes racing on one key both end with a whole one.

Extending: bump `KIT_VERSION` whenever the tokenizer, the model builder or the warm-start recipe changes, so caches
built by the old recipe are not reused.

Example:
    >>> from astratk.envs.math.arithmetic import ArithmeticEnv
    >>> path = ensure_model(ModelSpec(), ArithmeticEnv())  # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained(path)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

import astratk.models.warm_start as ws
from astratk.config import to_plain as plain_config  # the class_path / init_args view of a plug-in instance
from astratk.contracts import Env
from astratk.models.build_once import MARKER, build_once
from astratk.models.gguf import gguf_directory, resolve_gguf_file
from astratk.models.hub import resolve
from astratk.models.pretrained_warm import warm_started
from astratk.models.pypi import resolve_pypi
from astratk.models.tiny import build_tiny_model, check_tiny_spec
from astratk.models.tokenizer import IM_END, build_char_tokenizer, save_char_tokenizer
from astratk.spec import ModelSpec, TinyModelSpec
from astratk.spec.model import cache_root, is_pypi_path

KIT_VERSION = 1  # bump when the tokenizer, the model builder or the warm-start recipe changes


def model_key(tiny: TinyModelSpec, env: Env) -> str:
    """16 hex characters of sha256 over a canonical JSON of what determines the weights."""
    content = {"kit_version": KIT_VERSION, "tiny": dataclasses.asdict(tiny), "env": plain_config(env)}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def ensure_model(model_spec: ModelSpec, env: Env, cache_dir: str | os.PathLike | None = None,
                 log: Callable[[str], None] = print, key: str = "model") -> Path:
    """The directory to load the policy from (config.json, model.safetensors, tokenizer), building it if needed.

    `env` is the run's env instance: the warm start trains on its demonstrations. `cache_dir` overrides
    `model_spec.cache_dir` for the tiny model and GGUF files; both default to $ASTRATK_CACHE or ~/.cache/astratk. A
    Hub id in `model_spec.path` resolves through huggingface_hub's own cache (`astratk.models.hub`); a GGUF file is
    dequantized once into the cache (`astratk.models.gguf`). Errors name `key`.
    """
    model_spec.validate(key)  # a user path must hold config.json; the error names the path
    if model_spec.path is not None:
        base = _pretrained(model_spec, key, cache_dir, log)
        if model_spec.warm_start is None:
            return base
        return warm_started(base, model_spec.warm_start, env, cache_dir or model_spec.cache_dir, log)
    tiny = model_spec.tiny
    check_tiny_spec(tiny)
    key = model_key(tiny, env)
    final = cache_root(cache_dir or model_spec.cache_dir) / "models" / f"tiny-{key}"
    if (final / MARKER).is_file():
        acc = json.loads((final / MARKER).read_text()).get("heldout_accuracy", float("nan"))
        log(f"reusing tiny model {final} (held-out accuracy {acc:.1%})")
        return final
    if build_once(final, lambda tmp: _build(tiny, env, key, tmp, log), log):
        record = json.loads((final / MARKER).read_text())
        log(f"saved tiny model {final} (held-out accuracy {record['heldout_accuracy']:.1%}, {record['seconds']} s)")
    return final


def _pretrained(model_spec: ModelSpec, key: str, cache_dir: str | os.PathLike | None,
                log: Callable[[str], None]) -> Path:
    """The directory of `model_spec.path`'s model: a GGUF file dequantized once, a wheel's folder, a Hub id, a local
    directory."""
    if model_spec.is_gguf:
        file = resolve_gguf_file(model_spec.path, model_spec.gguf_file, model_spec.revision, key=key,
                                 cache_dir=cache_dir or model_spec.cache_dir)
        return Path(gguf_directory(file, key=f"{key}.path", cache_dir=cache_dir or model_spec.cache_dir, log=log))
    path = model_spec.path
    if is_pypi_path(path):  # a model directory shipped in a wheel
        path = str(resolve_pypi(path, key=f"{key}.path", cache_dir=cache_dir or model_spec.cache_dir))
    return Path(resolve(path, model_spec.revision, key=f"{key}.path").directory)


def _build(tiny: TinyModelSpec, env: Env, key: str, out: Path, log: Callable[[str], None]) -> None:
    t0 = time.perf_counter()
    log(f"building tiny model tiny-{key} for env {env.name!r}: {tiny.num_layers} layers x {tiny.hidden_size}, "
        f"warm start of batch {tiny.warm_start_batch} at lr {tiny.warm_start_lr} until train exact-match "
        f"{tiny.warm_start_target} or {tiny.warm_start_steps} steps")
    tok = build_char_tokenizer()
    model = build_tiny_model(tiny, tok)
    report = ws.warm_start(model, tok, env, tiny, log)
    stops = [tok.convert_tokens_to_ids(IM_END), tok.eos_token_id]
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=tok.pad_token_id, do_sample=False)
    with _no_progress_bar():
        model.save_pretrained(str(out))  # config.json, model.safetensors, generation_config.json
    tok.model_max_length = tiny.max_positions
    save_char_tokenizer(tok, out)  # verifies the AutoTokenizer round trip
    record = {"key": key, "kit_version": KIT_VERSION, "seed": tiny.seed, "steps": report.steps,
              "max_steps": tiny.warm_start_steps, "target": tiny.warm_start_target,
              "batch": tiny.warm_start_batch, "lr": tiny.warm_start_lr, "env": plain_config(env),
              "heldout_accuracy": report.heldout_accuracy, "n_heldout": report.n_heldout,
              "heldout_finished": report.heldout_finished, "final_loss": report.final_loss,
              "seconds": round(time.perf_counter() - t0, 2)}
    (out / MARKER).write_text(json.dumps(record, indent=2, default=repr) + "\n")  # last: marks completeness


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """Silence transformers' "Writing model shards" bar: `log` already reports progress, one line per stage."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
