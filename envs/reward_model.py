"""`RewardModel`: a sequence-classification reward model used as a reward function, as TRL's `GRPOTrainer` uses one.

A reward model reads a prompt and a completion and gives one number (a model saved from
`AutoModelForSequenceClassification` with `num_labels=1`: Skywork, ArmoRM-style and most RLHF reward models).
`FunctionEnv` takes one in `reward_funcs` beside plain functions, given as TRL gives it: a local directory, a Hub id
(`org/name`, fetched through huggingface_hub's cache), or a loaded model (then its tokenizer in
`reward_processing_classes`, or it is loaded from the model's own directory). It scores where the run scores, on
the rollout worker that generated the group: all completions of a group in one padded forward (`batch_size` rows at
most), with the model loaded once per worker process (by the first call there, whose time counts against
`rollout.score_timeout_s`: raise it for a reward model that takes minutes to load). Its mean shows in metrics as `reward/<name>`, and what it cost per
completion as `reward_model/<name>/tokens` (tokens read) and `reward_model/<name>/ms` (its share of the call's time).

What it reads is what it was trained to read: a chat prompt is rendered with the reward model's own chat template
(the prompt's messages plus the completion as the assistant's turn); a string prompt is the prompt text followed by
the completion. A sequence longer than `max_length` keeps its last `max_length` tokens (the completion's end, where
the model's score is read). Bad input fails at construction with one line: a path that holds no model, a model
without a classification head (a causal LM's directory would get a randomly initialised head), a head with more than
one output, a chat prompt with a tokenizer that has no chat template.

Example:
    >>> from astratk.envs.function import FunctionEnv
    >>> env = FunctionEnv("prompts.jsonl", ["Skywork/Skywork-Reward-V2-Qwen3-0.6B", exact],  # doctest: +SKIP
    ...                   reward_weights=[0.5, 1.0])
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from astratk.models.hub import resolve
from astratk.spec import StartError

DTYPES = ("float32", "bfloat16", "float16")
_loaded: dict[tuple[str, str, str], tuple[Any, Any]] = {}  # (directory, dtype, device) -> (model, tokenizer), per process
_load_lock = threading.Lock()


def is_reward_model_path(value: str) -> bool:
    """Whether a `reward_funcs` string names a model (a directory, or a Hub id `org/name`) rather than a function
    to import (`pkg.module.func` or `pkg.module:func`, which never holds a `/`)."""
    return "/" in value or os.sep in value or Path(value).expanduser().is_dir()


def _head_size(config: dict[str, Any] | Any) -> tuple[int, list[str]]:
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    labels = get("id2label") or {}
    n = get("num_labels") or (len(labels) if labels else 2)  # transformers' default head is 2 labels
    return int(n), list(get("architectures") or [])


def _check_head(n: int, architectures: list[str], where: str) -> None:
    if architectures and not any(a.endswith(("ForSequenceClassification", "RewardModel")) for a in architectures):
        raise StartError(f"reward model {where}: its architecture {architectures} has no sequence-classification head "
                         "(loading it as a reward model would score with a randomly initialised head); a reward model "
                         "is saved from AutoModelForSequenceClassification with num_labels=1")
    if n != 1:
        raise StartError(f"reward model {where}: its head gives {n} scores per sequence (num_labels={n}); a reward "
                         "model gives one (num_labels=1). For a classifier, wrap it in a reward function that maps "
                         "its outputs to one number")


class RewardModel:
    """A sequence-classification reward model with TRL's reward-function signature (module docstring).

    Args:
        model: a model directory, a Hub id, or a loaded `PreTrainedModel` with a one-output classification head.
        tokenizer: the model's tokenizer (default: loaded from the model's directory).
        batch_size: rows per forward.
        max_length: tokens kept per sequence (the last ones); default: the model's context.
        dtype: "float32", "bfloat16" or "float16" (for a path; a loaded model keeps its own).
        device: where a path's model is loaded ("cpu", "cuda", "cuda:1").
        revision: a Hub id's branch, tag or commit.
        name: the metric name (`reward/<name>`); default: the directory's name.
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, batch_size: int = 16, max_length: int | None = None,
                 dtype: str = "float32", device: str = "cpu", revision: str | None = None,
                 name: str | None = None) -> None:
        if batch_size < 1 or (max_length is not None and max_length < 2):
            raise ValueError(f"RewardModel: batch_size >= 1 and max_length >= 2 (or None); got {batch_size}, "
                             f"{max_length}")
        if dtype not in DTYPES:
            raise ValueError(f"RewardModel: dtype is one of {DTYPES}; got {dtype!r}")
        self.batch_size, self.max_length, self.dtype, self.device = batch_size, max_length, dtype, device
        self._model, self._tok, self._user_tok = None, tokenizer, tokenizer is not None
        self.path: str | None = None
        self.directory: str | None = None  # a path's model: where it was found
        if isinstance(model, str | os.PathLike):
            resolved = resolve(str(model), revision, key="reward model")
            self.path, self.directory = str(model), str(resolved.directory)
            config = json.loads((Path(self.directory) / "config.json").read_text())
            _check_head(*_head_size(config), repr(self.path))
            if tokenizer is None and not any((Path(self.directory) / f).exists()
                                             for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                                       "tokenizer.model")):
                raise StartError(f"reward model {self.path!r}: no tokenizer in {self.directory}; pass tokenizer= "
                                 "(TRL: reward_processing_classes)")
            default_name = Path(self.path.rstrip("/")).name
        elif hasattr(model, "config") and callable(model):
            _check_head(*_head_size(model.config), type(model).__name__)
            self._model = model
            source = getattr(model.config, "_name_or_path", "") or ""
            if tokenizer is None:
                if not source or not os.path.isdir(source):
                    raise StartError(f"reward model {type(model).__name__}: give its tokenizer (tokenizer=, or TRL's "
                                     "reward_processing_classes): the model does not name a directory to load it from")
                from astratk.models.loading import load_tokenizer

                self._tok = load_tokenizer(source)
            default_name = Path(source.rstrip("/")).name if source else type(model).__name__
        else:
            raise TypeError(f"RewardModel: model is a directory, a Hub id or a loaded sequence-classification model; "
                            f"got {type(model).__name__}")
        self.__name__ = name or default_name or "reward_model"
        self.calls = self.sequences = self.tokens = 0
        self.seconds = 0.0

    def __repr__(self) -> str:
        return f"RewardModel({self.path or self.__name__!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.path is not None:  # a path's model is loaded where it scores, once per process
            state["_model"] = None
            state["_tok"] = self._tok if self._user_tok else None
        return state

    def _key(self) -> tuple[str, str, str]:
        return (str(self.directory), self.dtype, self.device)

    def _load(self) -> tuple[Any, Any]:
        if self._model is not None:
            return self._model, self._tok
        assert self.directory is not None  # a loaded model is never unset; a path's has its directory
        with _load_lock:
            if self._key() not in _loaded:
                import torch
                from transformers import AutoModelForSequenceClassification

                from astratk.models.loading import load_tokenizer  # checked to round-trip text (it may fall back)

                model = AutoModelForSequenceClassification.from_pretrained(
                    self.directory, dtype=getattr(torch, self.dtype)).to(self.device).eval()
                _loaded[self._key()] = (model, load_tokenizer(self.directory))
            model, tok = _loaded[self._key()]
        self._model, self._tok = model, (self._tok or tok)
        return self._model, self._tok

    def texts(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        """What the model reads for each (prompt, completion) pair (module docstring)."""
        _, tok = self._load()
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, list):  # chat messages
                reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
                if not getattr(tok, "chat_template", None):
                    raise ValueError(f"reward model {self.__name__!r}: the prompts are chat messages and its tokenizer "
                                     "has no chat template; give string prompts or a tokenizer with a template")
                out.append(tok.apply_chat_template([*prompt, *reply], tokenize=False))
            else:
                text = completion if isinstance(completion, str) else completion[-1]["content"]
                out.append(str(prompt) + text)
        return out

    def __call__(self, prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        return self.scored(prompts, completions)[0]

    def scored(self, prompts: list[Any], completions: list[Any], **_: Any
               ) -> tuple[list[float], list[dict[str, float]]]:
        """The score of each pair, and per completion what it cost (`reward_model/<name>/tokens`: tokens read, and
        `.../ms`: its share of the call's time): what `FunctionEnv` calls to put both in the run's metrics."""
        import torch

        model, tok = self._load()
        start = time.perf_counter()
        texts = self.texts(prompts, completions)
        limit = self.max_length or getattr(model.config, "max_position_embeddings", None) or 4096
        rows = [tok(t, add_special_tokens=False)["input_ids"][-limit:] for t in texts]
        scores: list[float] = []
        device = next(model.parameters()).device
        for at in range(0, len(rows), self.batch_size):
            batch = rows[at:at + self.batch_size]
            width = max(len(r) for r in batch)
            # right padding; the head reads each row's last token that is not the pad id, so the pad id must differ
            # from every row's last token (a pad id equal to EOS would move the read one token back)
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            last = {r[-1] for r in batch}
            if pad is None or pad in last:
                pad = next(i for i in range(len(last) + 1) if i not in last)
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in batch], device=device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in batch], device=device)
            before = model.config.pad_token_id
            with _load_lock:  # one forward at a time on a shared model (its config's pad id is set per batch)
                model.config.pad_token_id = pad
                try:
                    with torch.no_grad():
                        logits = model(input_ids=ids, attention_mask=mask).logits
                finally:
                    model.config.pad_token_id = before
            if logits.shape[-1] != 1:
                raise ValueError(f"reward model {self.__name__!r} gave {logits.shape[-1]} scores per sequence; "
                                 "a reward model gives one")
            scores += logits[:, 0].float().tolist()
            self.tokens += sum(len(r) for r in batch)
        seconds = time.perf_counter() - start
        self.calls += 1
        self.sequences += len(rows)
        self.seconds += seconds
        ms = 1e3 * seconds / max(1, len(rows))
        return scores, [{f"reward_model/{self.__name__}/tokens": float(len(r)),
                         f"reward_model/{self.__name__}/ms": ms} for r in rows]
