"""`model.path` as a Hugging Face Hub id: resolved to a local snapshot through `huggingface_hub`.

A policy's `model.path` is a local directory (config.json + safetensors + tokenizer, as `save_pretrained` writes) or
a Hub id `org/name`, with an optional `model.revision` (a branch, a tag or a commit hash; default `main`). A Hub id
goes through `huggingface_hub.snapshot_download`, so its cache (`HF_HOME`, `HF_HUB_CACHE`), its offline mode
(`HF_HUB_OFFLINE=1`: the cache only, no network), its token (`HF_TOKEN`, `hf auth login`) and its revision pinning
apply as they do in transformers. Only what a run loads is fetched: configs, tokenizer files, chat templates and
safetensors weights.

A run resolves its Hub ids once, before it writes anything (`Run`), pins `model.revision` to the commit it got, so
the run's `config.yaml` reproduces it exactly, and records the snapshot directory and commit in `summary.json`
(`models`). Every error is one line that names the key and the id: an id that does not exist, a revision that does
not, a gated repository without a token, no network and no cached copy, or a directory (local or a cached snapshot)
that lacks a file a run needs (config.json, weights) or holds a broken one (JSON that does not parse, a truncated
safetensors file).

Example:
    >>> resolved = resolve("Qwen/Qwen2.5-0.5B-Instruct", key="policies[0].model.path")  # doctest: +SKIP
    >>> resolved.directory, resolved.revision  # doctest: +SKIP
    (PosixPath('~/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/7ae557...'), '7ae557...')
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from astratk.spec import StartError
from astratk.spec.model import is_hub_id

# What a run loads from a model repository: configs, tokenizer files, chat templates, safetensors weights.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]

_resolved: dict[tuple[str, str | None, str | None], ResolvedModel] = {}  # per process: resolve once
_lock = threading.Lock()


@dataclass(frozen=True)
class ResolvedModel:
    """Where a policy's model was found: the Hub id (None for a local directory), the commit, the directory."""

    path: str
    directory: Path
    repo_id: str | None = None
    revision: str | None = None

    def as_record(self) -> dict[str, str | None]:
        return {"path": self.path, "directory": str(self.directory), "repo_id": self.repo_id,
                "revision": self.revision}


def resolve(path: str, revision: str | None = None, *, key: str = "model.path",
            cache_dir: str | None = None) -> ResolvedModel:
    """The local directory of `path` (a directory as given, or a Hub id's snapshot), checked to hold a model.

    Raises `StartError` (a ValueError) with one line naming `key` and the id when it cannot: see the module docstring."""
    if not is_hub_id(path):
        if revision is not None:
            raise StartError(f"{key}: {path!r} is a local directory, and a revision ({revision!r}) applies to Hub "
                             "ids (org/name) only; remove the revision key")
        directory = Path(path).expanduser()
        _check_directory(directory, key, path)
        return ResolvedModel(path, directory)
    cache_key = (path, revision, cache_dir)
    with _lock:
        if cache_key not in _resolved:
            _resolved[cache_key] = _download(path, revision, key, cache_dir)
        return _resolved[cache_key]


def _download(repo_id: str, revision: str | None, key: str, cache_dir: str | None) -> ResolvedModel:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf_errors

    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        snapshot = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=ALLOW_PATTERNS)
    except hf_errors.GatedRepoError as e:
        raise StartError(f"{key}: {where} is a gated Hub repository: accept its licence on the Hub and log in "
                         "(`hf auth login` or HF_TOKEN)") from e
    except hf_errors.RepositoryNotFoundError as e:
        raise StartError(f"{key}: no Hub repository {repo_id!r} (or it is private and no token was given); if you "
                         "meant a local directory, it does not exist") from e
    except hf_errors.RevisionNotFoundError as e:
        raise StartError(f"{key}: Hub repository {repo_id!r} has no revision {revision!r} (a branch, tag or "
                         "commit hash)") from e
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled) as e:
        why = ("HF_HUB_OFFLINE is set and the cache has no copy" if offline
               else "the Hub cannot be reached and the cache has no copy")
        raise StartError(f"{key}: cannot resolve Hub id {where}: {why} (cache: {cache_dir or constants.HF_HUB_CACHE}"
                         "); download it once with network access, or give a local directory; if you meant a local "
                         "directory, it does not exist") from e
    except hf_errors.HFValidationError as e:
        raise StartError(f"{key}: {repo_id!r} is neither a local directory nor a valid Hub id (org/name): "
                         f"{str(e).splitlines()[0]}") from e
    except (hf_errors.HfHubHTTPError, OSError) as e:
        raise StartError(f"{key}: cannot download Hub id {where}: {str(e).splitlines()[0] if str(e) else e!r}") from e
    directory = Path(snapshot)
    _check_directory(directory, key, repo_id)
    return ResolvedModel(repo_id, directory, repo_id=repo_id, revision=directory.name)


def _check_directory(directory: Path, key: str, path: str) -> None:
    """A model directory a run can load: config.json and safetensors weights (a broken symlink in a Hub cache, a
    partial download, counts as missing), its JSON files parse and its safetensors files are whole."""
    if not directory.is_dir():
        raise StartError(f"{key}: no model directory at {str(directory)!r} (give a directory saved with "
                         "save_pretrained, or a Hub id org/name)")
    if not (directory / "config.json").is_file():
        raise StartError(f"{key}: {path!r} is not an HF model directory: config.json is missing in {str(directory)!r}")
    weights = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not weights:
        raise StartError(f"{key}: {path!r} has no safetensors weights in {str(directory)!r} (astratk loads "
                         "*.safetensors; convert .bin weights with save_pretrained)")
    # Cheap (headers only) and before anything is written: a file the loaders would fail on, deep in set-up.
    for file in sorted(directory.glob("*.json")):
        _check_json(file, key, path)
    for file in weights:
        _check_safetensors(file, key, path)


def _check_json(file: Path, key: str, path: str) -> None:
    """config.json and the other JSON files of a model directory (tokenizer, generation config, shard index)
    parse."""
    try:
        json.loads(file.read_bytes())
    except json.JSONDecodeError as e:
        raise StartError(f"{key}: {path!r}: {file.name} is not valid JSON ({e.msg} at line {e.lineno}, column "
                         f"{e.colno}) in {str(file.parent)!r}; save or download the model again") from None
    except (UnicodeDecodeError, OSError) as e:
        raise StartError(f"{key}: {path!r}: cannot read {file.name} in {str(file.parent)!r} ({e}); save or "
                         "download the model again") from None


def _check_safetensors(file: Path, key: str, path: str) -> None:
    """A safetensors file is whole: an 8-byte little-endian header length, that many bytes of JSON header, and
    every tensor's data offsets inside the file (a truncated copy or download fails here, not in set-up)."""
    size = file.stat().st_size

    def broken(why: str) -> StartError:
        return StartError(f"{key}: {path!r}: {file.name} is not a whole safetensors file ({why}) in "
                          f"{str(file.parent)!r}; save or download the model again")

    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise broken(f"{size} bytes, fewer than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise broken(f"its header claims {n} bytes but the file has {size}")
        try:
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise TypeError(type(header).__name__)  # one message for every malformed header, below
            end = max((int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"),
                      default=0)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise broken(f"its header is not safetensors JSON: {e}") from None
    if 8 + n + end > size:
        raise broken(f"truncated: its tensors end at byte {8 + n + end} but the file has {size} bytes")
