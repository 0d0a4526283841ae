"""A model directory built once into the cache: in a temporary sibling renamed into place only when complete (a marker
file, written last, says so), so a killed build never leaves a half model and two processes racing on one directory
both end with a whole one. The tiny model (`astratk.models.cache`), a pretrained model's warm start
(`astratk.models.pretrained_warm`) and a dequantized GGUF file (`astratk.models.gguf`) are built this way."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

MARKER = "warm_start.json"  # written last by a build: its presence means the directory is a complete model


def build_once(final: Path, build: Callable[[Path], None], log: Callable[[str], None], marker: str = MARKER) -> bool:
    """Run `build(tmp)` (which writes `marker` last) and rename `tmp` to `final`, unless `final` is complete already.
    Returns whether this call built it (False: it was there, or another process finished first)."""
    if (final / marker).is_file():
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    mask = os.umask(0o022)  # mkdtemp makes 0700: a cached model is for others (and other users' runs) to read
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)
    try:
        build(tmp)
        for f in tmp.iterdir():  # safetensors writes 0600: a cached model is for every run to read
            os.chmod(f, 0o666 & ~mask)
        if final.exists() and not (final / marker).is_file():
            shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover (not ours to keep)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / marker).is_file():
                raise
            log(f"another process built {final} first; using it")
            return False
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
