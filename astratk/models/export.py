"""`export_hf`: a trained policy as a standalone HF model directory that `transformers`, vLLM and a new run load.

A source is one of:
- a **run directory** (`runs/<name>-<time>/`): the weight store is `<run_dir>/weights` (or `weights.url` in its
  `config.yaml`, or for a run resumed from another, `resume_from`, that run's store), the base model directory is
  `summary.json`'s `model_path` (or the policy's `model.path` in `config.yaml`; `base_model=` overrides both, e.g.
  for a run that died before writing its summary);
- a **weight-store URL** (any fsspec URL `WeightStore` reads) together with `base_model=`;
- a **Lightning checkpoint** (`.ckpt`) of a `PolicyModule`: its `model.*` tensors, and `hyper_parameters.model_path`
  as the base model directory unless `base_model=` is given (`<run_dir>/checkpoints/<policy>/step=N.ckpt` when the
  run set `trainer.checkpoint_every`).

The base model directory supplies what the store does not hold: the config, the tokenizer, the generation config and
any other non-weight file (custom code, chat template), copied verbatim. The weights are loaded into the base
architecture and written with `save_pretrained` (safetensors, in the base config's dtype unless `dtype=` says
otherwise), so transformers' own rules decide which of tied tensors is saved; tied tensors must therefore be equal in
the source, which is checked. `astratk_export.json` records where the weights came from (policy, version, source,
the store's checksum of the version) and the sha256 of every weights file written. The directory is built beside
`out_dir` and renamed into place when complete, so a failed export leaves nothing half written.

A run starts from the result like from any HF directory: `ModelSpec(path=out_dir)`.

A policy trained with LoRA (`model.lora`; its store records the adapter config, its checkpoints the adapters and
`hyper_parameters.lora`) exports as a **PEFT adapter directory** (`adapter_config.json`, naming the base model
directory, + `adapter_model.safetensors` + provenance), which `PeftModel.from_pretrained(base, out_dir)` and vLLM's
`LoRARequest` load; with `merge=True` (`--merge`) as a full HF model directory instead, the adapters merged into the
base weights (loadable by `AutoModelForCausalLM.from_pretrained`, like any export above).

Example:
    >>> export_hf("runs/quickstart-20261129-233054-b689", "exports/quickstart")  # doctest: +SKIP
    PosixPath('exports/quickstart')
    >>> AutoModelForCausalLM.from_pretrained("exports/quickstart")  # doctest: +SKIP

Extending: a new kind of source is a function returning a `_Source` (the state dict, the base directory and the
provenance fields), chosen in `_resolve`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from astratk._version import __version__
from astratk.spec import LoraSpec

PROVENANCE = "astratk_export.json"
# Non-weight files of a base directory that are not copied: the config `save_pretrained` writes, and records that
# describe the base, not the export (the tiny model's warm-start record; an earlier export's provenance).
_NOT_COPIED = ("config.json", "warm_start.json", PROVENANCE)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAMPLE = "12+345=357\n  a b\tZ~ é{}"  # spaces, newlines, tabs and a non-ASCII character: what tokenizers drop


@dataclass(frozen=True)
class _Source:
    state: dict[str, torch.Tensor]  # HF state-dict keys -> tensors, tied names included
    base_model: Path  # the HF directory that supplies config, tokenizer and architecture
    provenance: dict[str, Any] = field(default_factory=dict)  # kind, location, version, ... for astratk_export.json
    protected: tuple[Path, ...] = ()  # paths the export must not overwrite (its own inputs)
    lora: LoraSpec | None = None  # set when `state` holds LoRA adapter tensors (saved PEFT names) only


def export_hf(source: str | os.PathLike, out_dir: str | os.PathLike, *, policy_id: str = "main",
              version: int | None = None, base_model: str | os.PathLike | None = None, dtype: str | None = None,
              overwrite: bool = False, merge: bool = False) -> Path:
    """Write policy `policy_id`'s weights at `version` (None: the newest published) from `source` (module
    docstring) as an HF model directory `out_dir`, and return it. A LoRA policy's adapters are written as a PEFT
    adapter directory, or with `merge=True` merged into the base model as a full HF model directory.

    `dtype`: "float32", "bfloat16" or "float16"; None keeps the base config's dtype. A non-empty `out_dir` is
    replaced only with `overwrite=True`, and never when it holds the export's own inputs.
    """
    from astratk.models.cache import _no_progress_bar

    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or None (the base model's), got {dtype!r}")
    out = Path(out_dir).expanduser().resolve()
    _check_out_dir(out, overwrite)
    with _no_progress_bar():
        src = _resolve(source, policy_id, version, base_model)
        _check_not_an_input(out, src)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700: a model directory is for others to read too
        try:
            if src.lora is not None and not merge:
                written_dtype, copied, kind = _write_adapter(src, tmp, dtype), [], "peft_adapter"
            else:
                written_dtype = _write_model(src, tmp, dtype)
                copied = _copy_side_files(src.base_model, tmp)
                _check_tokenizer(src.base_model, tmp)
                kind = "merged_lora" if src.lora is not None else "model"
            record = {"policy_id": policy_id, **src.provenance, "base_model": str(src.base_model),
                      "export_kind": kind, "dtype": written_dtype, "copied_files": copied,
                      "weights_sha256": {p.name: _sha256(p) for p in sorted(tmp.glob("*.safetensors"))},
                      "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "astratk_version": __version__}
            (tmp / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
            if out.exists():  # empty, or overwrite=True (checked above)
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return out


# ---------------------------------------------------------------------------------------------------- sources
def _resolve(source: str | os.PathLike, policy_id: str, version: int | None,
             base_model: str | os.PathLike | None) -> _Source:
    base = None if base_model is None else Path(base_model).expanduser().resolve()
    if "://" in str(source):  # a weight-store URL (memory://, s3://, file://...)
        if base is None:
            raise ValueError(f"exporting from the weight store {str(source)!r} needs base_model= (--base-model): "
                             "the HF directory the run started from, which supplies config and tokenizer")
        return _from_store(str(source), policy_id, version, base, {"source": "store", "store": str(source)}, ())
    path = Path(source).expanduser().resolve()
    if path.is_file():
        return _from_checkpoint(path, policy_id, version, base)
    if _is_run_dir(path):
        return _from_run_dir(path, policy_id, version, base)
    if not path.exists():
        raise FileNotFoundError(f"nothing to export at {str(path)!r}: no run directory, checkpoint or weight store")
    if base is None:
        raise ValueError(f"{str(path)!r} is not a run directory (no config.yaml or summary.json there). Give a run "
                         "directory, a PolicyModule checkpoint (.ckpt), or a weight store together with "
                         "base_model= (--base-model: the HF directory the run started from)")
    return _from_store(str(path), policy_id, version, base, {"source": "store", "store": str(path)}, (path,))


def _is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file() or (path / "summary.json").is_file()


def _from_run_dir(run_dir: Path, policy_id: str, version: int | None, base: Path | None) -> _Source:
    """The store and base model of a run directory, as `Session` laid them out."""
    config = _read_yaml(run_dir / "config.yaml")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    url = _run_store_url(run_dir, config)
    if "://" not in url and not Path(url).is_dir():
        raise FileNotFoundError(f"run {str(run_dir)!r} has no weight store at {url!r}; was it started by astratk "
                                "`Run` (which publishes version 0 there before training)?")
    if base is None:
        base = _run_base_model(run_dir, policy_id, config, summary)
    provenance = {"source": "run", "run_dir": str(run_dir), "store": url}
    # the store (which lies inside the run dir by default): out may be a new folder of the run dir, not the store
    protected = (run_dir,) if "://" in url else (Path(url),)
    return _from_store(url, policy_id, version, base, provenance, protected)


def _umask() -> int:
    mask = os.umask(0o022)  # read it by setting it, then put it back
    os.umask(mask)
    return mask


def _read_yaml(path: Path) -> dict[str, Any]:
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _run_store_url(run_dir: Path, config: dict[str, Any]) -> str:
    """Where `Session` published: `weights.url`; else `<run_dir>/weights`; else, for a run resumed by an astratk that
    published into the resumed run's store (before resumed runs had their own), that run's store."""
    url = (config.get("weights") or {}).get("url")
    if url:
        return url
    if (run_dir / "weights").is_dir() or not config.get("resume_from"):
        return str(run_dir / "weights")
    old = Path(config["resume_from"]).expanduser().resolve()
    if old.is_file():  # a checkpoint: <run dir>/checkpoints/<policy>/step=K.ckpt
        old = old.parents[2]
    return (_read_yaml(old / "config.yaml").get("weights") or {}).get("url") or str(old / "weights")


def _run_base_model(run_dir: Path, policy_id: str, config: dict[str, Any], summary: dict[str, Any]) -> Path:
    """`summary.json`'s model_path for its policy, else the policy's `model.path` in config.yaml."""
    if summary.get("policy_id") == policy_id and summary.get("model_path"):
        path, where = Path(summary["model_path"]), "summary.json model_path"
    else:
        policies = {p.get("policy_id"): p for p in config.get("policies") or []}
        if policies and policy_id not in policies:
            raise KeyError(f"run {str(run_dir)!r} has no policy {policy_id!r} (policies: {sorted(policies)}); "
                           "choose one with policy_id= (--policy)")
        model_path = ((policies.get(policy_id) or {}).get("model") or {}).get("path")
        if not model_path:
            raise FileNotFoundError(
                f"run {str(run_dir)!r} does not say which model directory policy {policy_id!r} started from: "
                "summary.json (written when a run finishes) does not name it and config.yaml builds the tiny model. "
                "Pass base_model= (--base-model): the directory the run printed as \"model for "
                f"'{policy_id}': ...\" (the tiny-model cache, ~/.cache/astratk/models/tiny-<key> by default)")
        path, where = Path(model_path).expanduser(), "config.yaml model.path"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"run {str(run_dir)!r}: the base model directory {str(path)!r} ({where}) is gone "
                                "or has no config.json (a cleared cache?); rebuild it with the run's config, or "
                                "pass base_model= (--base-model) with the same model")
    return path.resolve()


def _from_store(url: str, policy_id: str, version: int | None, base: Path, provenance: dict[str, Any],
                protected: tuple[Path, ...]) -> _Source:
    from astratk.weights.store import WeightStore

    store = WeightStore(url)
    if version is None and store.latest(policy_id) is None:
        raise KeyError(f"policy {policy_id!r} has no published weights in {url} (policies there: "
                       f"{_store_policies(store)}); choose one with policy_id= (--policy)")
    state, ref = store.pull(policy_id, None, version)  # from nothing: always a full state dict; KeyError names
    #   the retained versions when `version` is missing
    provenance = {**provenance, "version": ref.version, "store_checksum": ref.checksum, "store_kind": ref.kind}
    config = store.adapter_config(policy_id)
    lora = None
    if config is not None:
        from astratk.models.lora import lora_from_config

        lora = lora_from_config(config)
    return _Source(state, base, provenance, (*protected, base), lora)


def _store_policies(store: Any) -> list[str]:
    try:
        return sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.root, detail=False)
                      if store.fs.isdir(p))
    except FileNotFoundError:
        return []


def _from_checkpoint(path: Path, policy_id: str, version: int | None, base: Path | None) -> _Source:
    """A Lightning checkpoint of `PolicyModule`: the HF model is its `model` attribute, so its tensors are the
    state dict's `model.*` entries; `save_hyperparameters` recorded the directory it was loaded from, and
    `on_save_checkpoint` the policy and its weight version (`checkpoint["astratk"]`, where present)."""
    try:  # weights_only: tensors and plain containers only (PolicyModule's hyper-parameters are plain values)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a file that is not a checkpoint
        raise ValueError(f"cannot read {str(path)!r} as a Lightning checkpoint: {type(e).__name__}: {e}") from e
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise ValueError(  # noqa: TRY004 - a wrong file is a user error, like the other source errors
            f"{str(path)!r} is not a Lightning checkpoint (no state_dict in it)")
    state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    if not state:
        raise ValueError(f"{str(path)!r} holds no `model.*` tensors: not a PolicyModule checkpoint")
    lora = (ckpt.get("hyper_parameters") or {}).get("lora")
    if lora is not None:  # a LoRA trainer's checkpoint holds its adapters only, under PEFT's live names
        from astratk.models.lora import saved_adapter_names

        lora, state = LoraSpec(**lora), saved_adapter_names(state)
    saved = ckpt.get("astratk") or {}
    if saved.get("policy_id", policy_id) != policy_id:
        raise ValueError(f"checkpoint {str(path)!r} is of policy {saved['policy_id']!r}, not {policy_id!r}; pass "
                         f"policy_id={saved['policy_id']!r} (--policy {saved['policy_id']})")
    if version is not None and version != saved.get("policy_version"):
        raise ValueError(f"checkpoint {str(path)!r} holds one version ({saved.get('policy_version', 'unrecorded')}),"
                         f" not {version}; drop version= (--version) or export from the run's weight store")
    if base is None:
        model_path = (ckpt.get("hyper_parameters") or {}).get("model_path")
        if not model_path:
            raise ValueError(f"{str(path)!r} does not record model_path in its hyper-parameters; pass base_model= "
                             "(--base-model)")
        base = Path(model_path).expanduser().resolve()
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"checkpoint {str(path)!r}: its base model directory {str(base)!r} "
                                    "(hyper_parameters.model_path) is gone or has no config.json; pass "
                                    "base_model= (--base-model)")
    provenance = {"source": "checkpoint", "checkpoint": str(path), "version": saved.get("policy_version"),
                  "global_step": ckpt.get("global_step")}
    return _Source(state, base, provenance, (path, base), lora)


# ---------------------------------------------------------------------------------------------------- writing
def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{str(out)!r} is a file, not a directory; choose another output directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(f"{str(out)!r} is not empty; choose an empty or new directory, or pass "
                              "overwrite=True (--overwrite) to replace it")
    if not ((out / PROVENANCE).is_file() or (out / "config.json").is_file()):  # a mistyped path: never rmtree it
        raise FileExistsError(f"{str(out)!r} is not empty and holds no model ({PROVENANCE} or config.json), so "
                              "overwrite=True will not delete it; remove it yourself or choose another directory")


def _check_not_an_input(out: Path, src: _Source) -> None:
    """`out` may not be, hold or lie inside an input (run dir, store, base model, checkpoint): with overwrite=True
    the export would delete what it reads (e.g. `<run_dir>/weights`)."""
    for p in src.protected:
        p = p.resolve()
        if out == p or out in p.parents or p in out.parents:
            raise ValueError(f"output directory {str(out)!r} overlaps the export's own input {str(p)!r}; choose a "
                             "directory outside it")


def _write_model(src: _Source, out: Path, dtype: str | None) -> str:
    """Load the base architecture, put the source weights in (or merge the source adapters into it),
    `save_pretrained`; returns the dtype written."""
    from astratk.models.loading import load_causal_lm

    dtype = _base_dtype(src, dtype)
    if src.lora is not None:
        from astratk.models.lora import merged_model

        try:
            merged_model(str(src.base_model), src.lora, src.state, _DTYPES[dtype]).save_pretrained(str(out))
        except ValueError as e:
            raise ValueError(f"{_where(src)}: {e}") from e
        return dtype
    model = load_causal_lm(str(src.base_model), _DTYPES[dtype])
    _check_tied(model, src)
    try:
        model.load_state_dict(src.state, strict=True)  # copy_ casts to the model's dtype
    except RuntimeError as e:
        raise ValueError(f"the weights of {_where(src)} do not fit the model in {str(src.base_model)!r} (is it "
                         f"the directory this policy started from?): {e}") from e
    model.save_pretrained(str(out))
    return dtype


def _base_dtype(src: _Source, dtype: str | None) -> str:
    """`dtype`, else the base config's (float32 where it names none)."""
    from transformers import AutoConfig

    if not (src.base_model / "config.json").is_file():
        raise FileNotFoundError(f"base model directory {str(src.base_model)!r} has no config.json")
    if dtype is None:
        config_dtype = getattr(AutoConfig.from_pretrained(str(src.base_model)), "dtype", None)
        dtype = str(config_dtype).removeprefix("torch.") if config_dtype is not None else "float32"
        if dtype not in _DTYPES:
            raise ValueError(f"base model {str(src.base_model)!r} has dtype {dtype!r}; pass dtype= one of "
                             f"{sorted(_DTYPES)}")
    return dtype


def _write_adapter(src: _Source, out: Path, dtype: str | None) -> str:
    """The source adapters as a PEFT adapter directory for the base model; returns the dtype written. The adapters
    must fit the base (checked by attaching them to it, as `PeftModel.from_pretrained` will)."""
    from astratk.models.lora import check_adapter_fits, write_adapter_dir

    dtype = _base_dtype(src, dtype)
    try:
        check_adapter_fits(str(src.base_model), src.lora, src.state)
    except ValueError as e:
        raise ValueError(f"{_where(src)}: {e}") from e
    state = {k: v.to(_DTYPES[dtype]) for k, v in src.state.items()}
    write_adapter_dir(out, src.lora, state, str(src.base_model))
    return dtype


def _check_tied(model: torch.nn.Module, src: _Source) -> None:
    """Tied names (one parameter under several names, e.g. lm_head and embed_tokens) must carry equal tensors:
    loading keeps whichever comes last, and saving writes one of them."""
    by_param: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_param.setdefault(id(tensor), []).append(name)
    for names in by_param.values():
        present = [n for n in names if n in src.state]
        if any(not torch.equal(src.state[present[0]], src.state[n]) for n in present[1:]):
            raise ValueError(f"{_where(src)}: {present} are one tied parameter in {str(src.base_model)!r} "
                             "(tie_word_embeddings) but differ in the source, so no single tensor can represent "
                             "them; was it trained from another model?")


def _where(src: _Source) -> str:
    p = src.provenance
    if p.get("source") == "checkpoint":
        return f"checkpoint {p['checkpoint']!r}"
    return f"version {p.get('version')} in {p.get('store')}"


def _copy_side_files(base: Path, out: Path) -> list[str]:
    """Copy the base directory's non-weight files (tokenizer, chat template, custom code) as they are: re-saving a
    tokenizer through `AutoTokenizer` may change its class. `generation_config.json` is
    copied too, over the one `save_pretrained` derived, so decoding defaults stay the base's."""
    if not any((base / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"base model directory {str(base)!r} has no tokenizer files (any of "
                                f"{list(_TOKENIZER_FILES)}); an exported model needs one to be served")
    copied = []
    for path in sorted(base.iterdir()):
        if not path.is_file() or path.name.endswith(_WEIGHT_SUFFIXES) or path.name.endswith(".index.json"):
            continue
        if path.name in _NOT_COPIED:
            continue
        shutil.copyfile(path, out / path.name)
        copied.append(path.name)
    return copied


def _check_tokenizer(base: Path, out: Path) -> None:
    """The exported tokenizer must tokenize like the base one does (a file the copy missed would show here)."""
    from transformers import AutoTokenizer

    want, got = AutoTokenizer.from_pretrained(str(base)), AutoTokenizer.from_pretrained(str(out))
    problems = []
    if type(got) is not type(want):
        problems.append(f"class {type(got).__name__} instead of {type(want).__name__}")
    if got(_SAMPLE)["input_ids"] != want(_SAMPLE)["input_ids"]:
        problems.append("token ids differ")
    if getattr(got, "chat_template", None) != getattr(want, "chat_template", None):
        problems.append("chat template differs")
    if problems:
        raise RuntimeError(f"the exported tokenizer in {str(out)!r} does not load like the base's in "
                           f"{str(base)!r}: {'; '.join(problems)}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
