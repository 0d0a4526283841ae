"""Test helpers: a model directory in huggingface_hub's cache layout, as a download leaves it, built locally.

Layout (huggingface_hub's `file_download`): `<cache>/models--<org>--<name>/blobs/<sha256>` holds each file's bytes,
`snapshots/<commit>/<file>` links to its blob, `refs/<branch>` names the branch's commit.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def put_in_hub_cache(model_dir: Path, cache: Path, repo_id: str, commit: str | None = None,
                     branch: str = "main", skip: tuple[str, ...] = ()) -> Path:
    """Lay `model_dir`'s files out as a download of `repo_id` at `commit`; returns the snapshot directory."""
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()  # 40 hex characters, like a git commit
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(model_dir.iterdir()):
        if not f.is_file() or f.name in skip:
            continue
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snapshot / f.name
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs" / branch).write_text(commit)
    return snapshot
