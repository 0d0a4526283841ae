"""LoRA adapters through PEFT, one format from the trainer to the engines and the export.

The trainer wraps its causal LM with `add_lora` (PEFT's `get_peft_model`: adapters trainable, the base frozen) and
publishes `adapter_state`: the adapter tensors alone, named as in PEFT's `adapter_model.safetensors`
(`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`; `lora_embedding_A/B` for embeddings). The weight
store treats them like any state dict (full snapshots, sparse deltas between versions). Engines attach them to their
one copy of the base (`inject_adapter`: PEFT's functional `inject_adapter_in_model` under a private slot name, so
several adapters share the base) and switch between them per batch (`activate`). `write_adapter_dir` writes the
same tensors with `adapter_config.json` as a directory `PeftModel.from_pretrained(base, dir)` and vLLM's
`LoRARequest` load.

The adapters of version 0 are `add_lora`'s initialisation with a fixed seed (A random, B = 0, so version 0 behaves
exactly as the base): the trainer and `astratk.runtime.deploy.publish_initial` draw the same tensors.

Extending: another adapter method would get its own spec in `astratk.spec` and its own functions here; the store,
engines and export only see named tensors plus `adapter_config.json`.

Example:
    >>> from astratk.spec import LoraSpec
    >>> peft_model = add_lora(model, LoraSpec(r=8, target_modules=["q_proj", "v_proj"]))  # doctest: +SKIP
    >>> sorted(adapter_state(peft_model))[0]  # doctest: +SKIP
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from astratk.spec import LoraSpec, ModelSpec

PREFIX = "base_model.model."  # PEFT's prefix of adapter tensor names in a saved adapter
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
INIT_SEED = 0  # the adapters' initialisation (module docstring)
_PAIRS = (".lora_A.weight", ".lora_B.weight")  # Linear / Conv layers: saved suffix; live = .lora_A.<slot>.weight
_EMBEDDING = (".lora_embedding_A", ".lora_embedding_B")  # Embedding layers: live = .lora_embedding_A.<slot>


def peft_config(lora: LoraSpec, base_model: str | None = None) -> Any:
    """PEFT's `LoraConfig` for `lora` (bias none, no rsLoRA/DoRA: what every engine applies alike)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), bias="none",
                      base_model_name_or_path=base_model)


def check_target_modules(model: torch.nn.Module, lora: LoraSpec, key: str = "model.lora",
                         where: str = "") -> None:
    """Every entry of `lora.target_modules` names at least one layer of `model` that LoRA can adapt (PEFT's rule:
    the module's name, or its last dotted parts); else one line naming `<key>.target_modules` and the layer names
    that would do. PEFT itself only fails when no entry matches anything."""
    adaptable: set[str] = set()
    # an adapted layer's insides (its base_layer, its lora_A/lora_B dicts) are not layers of the model
    names = [(name, module) for name, module in model.named_modules()
             if name and ".base_layer" not in f".{name}" and ".lora_" not in f".{name}"]
    for name, module in names:
        if _adaptable(module):
            adaptable.add(name.rsplit(".", 1)[-1])
    for target in lora.target_modules:
        matched = [m for name, m in names if name == target or name.endswith(f".{target}")]
        if not matched:
            problem = "names no layer of"
        elif not any(_adaptable(m) for m in matched):
            problem = f"names {type(matched[0]).__name__} layers, which LoRA cannot adapt, in"
        else:
            continue
        raise ValueError(f"{key}.target_modules: {target!r} {problem} the model{where} "
                         f"({type(model).__name__}); its adaptable layers are {sorted(adaptable)}")


def _adaptable(module: torch.nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
             BaseTunerLayer)  # a layer adapted already (an engine's other adapters) takes more
    return isinstance(module, kinds) or type(module).__name__ == "Conv1D"  # transformers' GPT-2 Conv1D


def check_model_spec(model: ModelSpec, key: str, directory: str | os.PathLike | None = None) -> None:
    """`model.lora`'s target modules against the model's architecture, built on the meta device from its config
    alone (no weights are read: cheap for any size). `directory`: the resolved model directory (default:
    `model.path`); the tiny model (`path` None) is checked from its `TinyModelSpec`."""
    if model.lora is None:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    if model.path is None and directory is None:
        from astratk.models.tiny import tiny_config
        from astratk.models.tokenizer import build_char_tokenizer

        config, where = tiny_config(model.tiny, build_char_tokenizer()), " built from model.tiny"
    else:
        path = str(Path(directory or model.path).expanduser())
        config, where = AutoConfig.from_pretrained(path), f" in {path!r}"
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        skeleton = AutoModelForCausalLM.from_config(config)
    check_target_modules(skeleton, model.lora, f"{key}.lora", where)


def add_lora(model: torch.nn.Module, lora: LoraSpec, key: str = "model.lora") -> Any:
    """`model` wrapped by PEFT with freshly initialised adapters (A from a fixed seed, B = 0): trainable adapters,
    frozen base. The target modules are checked first (`check_target_modules`)."""
    from peft import get_peft_model

    check_target_modules(model, lora, key)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on tied embeddings and unused config fields
        torch.manual_seed(INIT_SEED)
        return get_peft_model(model, peft_config(lora, getattr(model.config, "_name_or_path", None)))


def adapter_state(peft_model: Any, state_dict: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter tensors of a PEFT model (its active adapter), named as in a saved adapter: detached copies.
    `state_dict`: the model's full state when it is gathered elsewhere (a sharded trainer), else the model's own."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, state_dict=state_dict, save_embedding_layers=False)
    return {k: v.detach().clone() for k, v in state.items()}


def is_adapter_state(state: Mapping[str, Any]) -> bool:
    """Whether `state` holds adapter tensors (as `adapter_state` names them) rather than a model's weights."""
    return bool(state) and all(k.startswith(PREFIX) and (".lora_" in k) for k in state)


def initial_adapter(model_path: str, lora: LoraSpec, key: str = "model.lora") -> dict[str, torch.Tensor]:
    """Version 0's adapter tensors for the model in `model_path`: what the trainer starts from."""
    from astratk.models.loading import load_causal_lm

    return adapter_state(add_lora(load_causal_lm(model_path), lora, key))


# -------------------------------------------------------------------------------------------------- engines
def inject_adapter(model: torch.nn.Module, lora: LoraSpec, slot: str, dtype: torch.dtype | None = None
                   ) -> dict[str, torch.Tensor]:
    """Attach an adapter named `slot` to a plain HF model in place (PEFT's `inject_adapter_in_model`; the model
    keeps its class and other slots) and return its live tensors by saved name (`adapter_state`'s names): writing
    into them changes what the model computes while `slot` is active (`activate`). `dtype`: the adapter's (default:
    the base's)."""
    from peft.functional import inject_adapter_in_model

    check_target_modules(model, lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Already found a peft_config attribute": several adapters, on purpose
        inject_adapter_in_model(peft_config(lora), model, adapter_name=slot)
    params = dict(model.named_parameters())
    live = {}
    for name, p in params.items():
        saved = _saved_name(name, slot)
        if saved is not None:
            if dtype is not None and p.dtype != dtype:
                p.data = p.data.to(dtype)
            p.requires_grad_(False)
            live[saved] = p
    if not live:
        raise RuntimeError(f"PEFT attached no adapter tensors for target modules {lora.target_modules}")
    return live


def _saved_name(live: str, slot: str, prefix: str = PREFIX) -> str | None:
    """`model.layers.0.q_proj.lora_A.<slot>.weight` -> `base_model.model.model.layers.0.q_proj.lora_A.weight`
    (`prefix`: what the live name lacks of the saved one); None for a tensor that is not `slot`'s."""
    for suffix in _PAIRS:
        slotted = suffix.replace(".weight", f".{slot}.weight")
        if live.endswith(slotted):
            return prefix + live[: -len(slotted)] + suffix
    for suffix in _EMBEDDING:
        if live.endswith(f"{suffix}.{slot}"):
            return prefix + live[: -len(slot) - 1]
    return None


def saved_adapter_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PEFT model's own adapter tensors (`base_model.model....lora_A.default.weight`, as in a trainer's
    checkpoint) under their saved names (`adapter_state`'s)."""
    out = {}
    for name, tensor in state.items():
        saved = _saved_name(name, "default", prefix="")
        if saved is None:
            raise ValueError(f"{name!r} is not a tensor of PEFT's default adapter")
        out[saved] = tensor
    return out


def activate(model: torch.nn.Module, slot: str | None) -> None:
    """Make adapter `slot` the one the model applies (None: the base alone)."""
    from peft.functional import set_adapter

    set_adapter(model, [] if slot is None else slot, inference_mode=True)


def remove_adapter(model: torch.nn.Module, slot: str) -> None:
    """Detach adapter `slot` (the base and other slots stay)."""
    from peft.functional import delete_adapter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        delete_adapter(model, slot, prefix="lora_")


# -------------------------------------------------------------------------------------------------- files
def adapter_config(lora: LoraSpec, base_model: str | None = None) -> dict[str, Any]:
    """The `adapter_config.json` PEFT writes for `lora` (plain JSON values)."""
    config = peft_config(lora, base_model).to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def lora_from_config(config: Mapping[str, Any]) -> LoraSpec:
    """The `LoraSpec` an `adapter_config.json` describes (what astratk's adapters use of it)."""
    if str(config.get("peft_type", "LORA")).upper().removeprefix("PEFTTYPE.") != "LORA":
        raise ValueError(f"not a LoRA adapter config (peft_type {config.get('peft_type')!r})")
    targets = config["target_modules"]
    return LoraSpec(r=int(config["r"]), alpha=float(config["lora_alpha"]),
                    dropout=float(config.get("lora_dropout") or 0.0),
                    target_modules=[targets] if isinstance(targets, str) else sorted(targets))


def write_adapter_dir(out: str | os.PathLike, lora: LoraSpec, state: Mapping[str, torch.Tensor],
                      base_model: str | None = None) -> Path:
    """`adapter_config.json` + `adapter_model.safetensors` in `out`: a PEFT adapter directory
    (`PeftModel.from_pretrained(base, out)`, vLLM's `LoRARequest(name, id, out)`)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not is_adapter_state(state):
        raise ValueError(f"not adapter tensors (names like {sorted(state)[:2]}); expected {PREFIX}...lora_A.weight")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config(lora, base_model), indent=2) + "\n")
    return out


def check_adapter_fits(base_model: str, lora: LoraSpec, state: Mapping[str, torch.Tensor]) -> None:
    """`state` holds exactly the adapter tensors `lora` gives the model in `base_model`, in their shapes (checked on
    a meta-device skeleton built from the config: no weights are read)."""
    from peft import get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_model))
    expected = {k: tuple(v.shape) for k, v in
                get_peft_model_state_dict(add_lora(skeleton, lora), save_embedding_layers=False).items()}
    unknown, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
    wrong = sorted(k for k in set(state) & set(expected) if tuple(state[k].shape) != expected[k])
    if unknown or missing or wrong:
        raise ValueError(f"the adapter does not fit the model in {base_model!r} with r={lora.r} and target modules "
                         f"{lora.target_modules}: unknown tensors {unknown[:2]}, missing {missing[:2]}, other "
                         f"shapes {wrong[:2]}")


def merged_model(base_model: str, lora: LoraSpec, state: Mapping[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32) -> Any:
    """The base model in `base_model` with the adapter `state` merged into its weights: a plain HF model."""
    from peft import set_peft_model_state_dict

    from astratk.models.loading import load_causal_lm

    check_adapter_fits(base_model, lora, state)
    peft_model = add_lora(load_causal_lm(base_model, torch.float32), lora)
    set_peft_model_state_dict(peft_model, {k: v.float() for k, v in state.items()})
    return peft_model.merge_and_unload().to(dtype)
