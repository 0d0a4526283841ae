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
not, a gated repository without a token, no network and no cached copy, or a cached snapshot that lacks a file a run
needs (config.json, weights).

Example:
    >>> resolved = resolve("Qwen/Qwen2.5-0.5B-Instruct", key="policies[0].model.path")  # doctest: +SKIP
    >>> resolved.directory, resolved.revision  # doctest: +SKIP
    (PosixPath('~/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/7ae557...'), '7ae557...')
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

from astratk.spec import StartError

# The Hub's repo id rule (`org/name`: letters, digits, '-', '_', '.'; no '--' or '..', no leading/trailing '-'/'.').
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
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


def is_hub_id(path: str) -> bool:
    """Whether `path` reads as a Hub id (`org/name`) and is not an existing local path."""
    p = Path(path).expanduser()
    return (not p.exists() and bool(_HUB_ID.match(path)) and ".." not in path and "--" not in path
            and not path.endswith((".", "-")))


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
    partial download, counts as missing)."""
    if not directory.is_dir():
        raise StartError(f"{key}: no model directory at {str(directory)!r} (give a directory saved with "
                         "save_pretrained, or a Hub id org/name)")
    if not (directory / "config.json").is_file():
        raise StartError(f"{key}: {path!r} is not an HF model directory: config.json is missing in {str(directory)!r}")
    if not any(p.is_file() for p in directory.glob("*.safetensors")):
        raise StartError(f"{key}: {path!r} has no safetensors weights in {str(directory)!r} (astratk loads "
                         "*.safetensors; convert .bin weights with save_pretrained)")
