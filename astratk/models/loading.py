"""Loading HF causal LMs and their tokenizers, serialised within a process, tokenizers checked to round-trip.

Why the lock: transformers 5.19 builds a model under a process-global meta-device context, so two threads loading
at once (a threads-mode cluster: a rollout service's engine and the trainer in one process) fail with "Cannot copy
out of meta tensor; no data!" (seen here). Every astratk load goes through `load_causal_lm`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import warnings
from typing import Any

import torch

log = logging.getLogger(__name__)
_LOAD_LOCK = threading.Lock()


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Any:
    """The HF causal LM in directory `path`. Errors name the directory and what is missing: a path that is not a
    directory (transformers would try it as a Hub repo id), no config.json, or weights transformers cannot load."""
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"no model directory at {path!r} (astratk loads local HF directories only: "
                                "config.json + *.safetensors, e.g. from save_pretrained)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} is not an HF model directory: config.json is missing")
    with _LOAD_LOCK:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError, KeyError) as e:
            raise RuntimeError(f"cannot load the model in {path!r}: {e}") from e
    from astratk.cpu import use_linear_backend

    return use_linear_backend(model.to(device))  # CPU Linear layers through oneDNN where it is faster


# --------------------------------------------------------------------------------------------------- tokenizers
# Files that make a directory hold a tokenizer (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# A chat turn with what tokenizers most often lose: spaces, newlines, a tab, digits, punctuation, non-ASCII.
_CHAT_SAMPLE = [{"role": "user", "content": "What is 37 + 48?\nShow it:\t12 * 3 = 36 (café)."}]
_PLAIN_SAMPLE = "What is 37 + 48?\nShow it:\t12 * 3 = 36 (café).\n\n  done"
_checked: dict[str, bool] = {}  # directories whose tokenizer was checked, per process
_fallbacks: dict[str, str] = {}  # directory -> why AutoTokenizer's tokenizer was replaced


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer of model directory `path`, checked to round-trip text; None when the directory holds none.

    Why: `AutoTokenizer` may rebuild a saved tokenizer as another class. transformers 5 does so for `model_type`
    qwen2 (it rebuilds `Qwen2Tokenizer` from tokenizer.json's vocabulary): a character-level WordLevel tokenizer then
    drops every space and newline, and a model trains on `<|im_start|>userWhatis37+48?` without any error. So every
    astratk load (engines, trainer, export) renders a chat prompt with the model's own template, encodes it and
    decodes it back. When that changes the text, the tokenizer is loaded from tokenizer.json as saved
    (`PreTrainedTokenizerFast`) with a warning; when that fails too, loading fails naming the directory and what
    changed. Spaces next to special tokens and at the ends may differ (SentencePiece tokenizers add a prefix space);
    anything else may not. The sample keeps only characters that tokenizer.json as saved can encode (a digits-only
    vocabulary is not a fault), so a tokenizer that loses spaces it was saved with is caught."""

    path = os.fspath(path)
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    if path in _checked:  # checked once per process; each caller gets its own object (tokenizers hold state)
        return _as_saved(path) if path in _fallbacks else _auto(path)
    tok, saved = _auto(path), _as_saved(path)
    problem = round_trip_problem(tok, alphabet=saved)
    if problem is not None:
        fallback, why = saved, problem
        if fallback is None or (again := round_trip_problem(fallback)) is not None:
            detail = "" if fallback is None else f"; tokenizer.json as saved ({type(fallback).__name__}): {again}"
            raise RuntimeError(f"the tokenizer in {path!r} does not round-trip text: AutoTokenizer "
                               f"({type(tok).__name__}): {why}{detail}. Save the tokenizer with save_pretrained and "
                               "check tok.decode(tok(text).input_ids) == text")
        warnings.warn(f"AutoTokenizer loads the tokenizer in {path!r} as {type(tok).__name__}, which changes text "
                      f"({why}); using tokenizer.json as saved ({type(fallback).__name__}), which round-trips",
                      stacklevel=2)
        _fallbacks[path] = f"{type(tok).__name__}: {why}"
        tok = fallback
    else:  # the common case says nothing, except to a logger asked for detail
        log.debug("the tokenizer in %r round-trips a rendered chat prompt as %s", path, type(tok).__name__)
    _checked[path] = True
    return tok


def tokenizer_fallback(path: str | os.PathLike) -> str | None:
    """Why `load_tokenizer(path)` did not use AutoTokenizer's tokenizer, or None when it did (or was not called).
    Engines that load the tokenizer themselves (vLLM) use `tokenizer_only_dir` then."""
    return _fallbacks.get(os.fspath(path))


def tokenizer_only_dir(path: str | os.PathLike, dest: str | os.PathLike) -> str:
    """Copy the tokenizer files of `path` (everything but config.json and weights) into `dest` and return it.
    `AutoTokenizer` on a directory without config.json follows `tokenizer_config.json`'s class, so a library that
    loads tokenizers itself (vLLM's `tokenizer=` argument) gets the tokenizer as saved."""

    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(path):
        src = os.path.join(path, name)
        if (os.path.isfile(src) and name != "config.json" and not name.endswith((".safetensors", ".bin", ".pt"))
                and not name.endswith(".index.json")):
            shutil.copyfile(src, os.path.join(dest, name))
    return os.fspath(dest)


def round_trip_problem(tok: Any, alphabet: Any = None) -> str | None:
    """None when `tok` encodes and decodes a rendered chat prompt (or, without a chat template, a plain sample) back
    to the same text, up to spaces next to special tokens; else what changed, quoted. The samples keep only the
    characters that `alphabet` (a tokenizer; default `tok`) encodes to known tokens."""
    specials = [t for t in getattr(tok, "all_special_tokens", []) if t]
    texts = [_PLAIN_SAMPLE]
    if getattr(tok, "chat_template", None):
        # a template that needs other roles (a system turn first...) raises: the plain sample still checks
        with contextlib.suppress(Exception):
            texts.insert(0, tok.apply_chat_template(_CHAT_SAMPLE, add_generation_prompt=True, tokenize=False))
    for text in (_known(alphabet or tok, t, specials) for t in texts):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        back = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if _normalised(back, specials) != _normalised(text, specials):
            return f"{text[:60]!r} comes back as {back[:60]!r}"
    return None


def _known(tok: Any, text: str, specials: list[str]) -> str:
    """`text` without the characters `tok` cannot encode (no token, or its unknown token); special tokens kept."""
    unknown = {getattr(tok, "unk_token_id", None)}
    model_unk = getattr(getattr(getattr(tok, "backend_tokenizer", None), "model", None), "unk_token", None)
    if isinstance(model_unk, str):  # a WordLevel/WordPiece model's own unknown token, set or not on the wrapper
        unknown.add(tok.convert_tokens_to_ids(model_unk))
    unknown.discard(None)

    def ok(c: str) -> bool:
        ids = tok(c, add_special_tokens=False)["input_ids"]
        return bool(ids) and not unknown.intersection(ids)

    if not specials:
        return "".join(c for c in text if ok(c))
    pieces = re.split("(" + "|".join(re.escape(s) for s in specials) + ")", text)
    return "".join(p if p in specials else "".join(c for c in p if ok(c)) for p in pieces)


def _normalised(text: str, specials: list[str]) -> str:
    for s in specials:
        text = text.replace(s, f"\0{s}\0")
    text = re.sub(r" *\0 *", "", text)
    return text.strip(" ")


def _auto(path: str) -> Any:
    from transformers import AutoTokenizer

    from astratk.models.tokenizer import upgrade_chat_template

    with _LOAD_LOCK:
        return upgrade_chat_template(AutoTokenizer.from_pretrained(path))


def _as_saved(path: str) -> Any:
    """tokenizer.json loaded as it is, with the special tokens of tokenizer_config.json; None without one."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    from transformers import PreTrainedTokenizerFast

    from astratk.models.tokenizer import upgrade_chat_template

    with _LOAD_LOCK:
        return upgrade_chat_template(PreTrainedTokenizerFast.from_pretrained(path))
