"""Where a resumed run continues (`resume_from`): `find_resume_point` finds the newest checkpoint of a policy and the
data-layer snapshot written with it, `copy_version` starts the new run's weight store from the checkpoint's weights.
Everything here only reads the resumed run, so the start-up checks (`astratk.runtime.checks`) run it before a run
writes anything; a new kind of resume source adds its lookup here and keeps that promise.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from astratk.config import read_yaml
from astratk.spec import RunSpec


def copy_version(source: Any, target: Any, policy_id: str, version: int) -> None:
    """Publish `source`'s `version` of `policy_id` (and its adapter config) to `target`: a resumed run starts its own
    weight store from its checkpoint's weights, leaving the run it resumes (and the versions that run published
    after the checkpoint) untouched."""
    try:
        state, _ = source.pull(policy_id, None, version)
    except KeyError as e:
        raise ValueError(f"resume_from: the checkpoint's weights (policy {policy_id!r} v{version}) are not in "
                         f"{source.url}: {e.args[0] if e.args else e}") from None
    if (config := source.adapter_config(policy_id)) is not None:
        target.set_adapter_config(policy_id, config)
    target.publish(policy_id, version, state)


def checkpoint_time_used(path: str | Path) -> float:
    """Seconds of training a Lightning checkpoint has used of its `max_time` (its Timer's state; 0 without one).
    Memory-mapped: the weights are not read."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    timer = (state.get("callbacks") or {}).get("Timer") or {}
    return float((timer.get("time_elapsed") or {}).get("train", 0.0))


def same_store(a: str, b: str) -> bool:
    """Whether two weight-store URLs name one place (local paths compared resolved)."""
    import fsspec

    fa, pa = fsspec.core.url_to_fs(a)
    fb, pb = fsspec.core.url_to_fs(b)
    if fa.protocol != fb.protocol:
        return False
    if "file" in (fa.protocol if isinstance(fa.protocol, tuple) else (fa.protocol,)):
        return Path(pa).resolve() == Path(pb).resolve()
    return pa.rstrip("/") == pb.rstrip("/")


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: a trainer checkpoint, the weight store it published to, and
    the data-layer snapshot written when the checkpoint's version was published."""

    checkpoint: Path
    step: int
    store_url: str
    snapshot_url: str
    snapshot_name: str


def find_resume_point(spec: RunSpec, policy_id: str) -> ResumePoint:
    """The newest checkpoint of `policy_id` under `spec.resume_from` (a run directory) and its
    matching snapshot; errors name what is missing. Reads only, so validation runs it before a run
    writes anything."""

    import fsspec

    from astratk.dataflow.snapshots import SnapshotStore

    given = Path(spec.resume_from).expanduser().resolve()
    checkpoint = re.compile(r"step=(\d+)\.ckpt")
    if not given.exists():
        raise FileNotFoundError(f"resume_from: {str(given)!r} does not exist; give a run directory "
                                "(runs/<name>-<time>) or one of its checkpoints "
                                f"(<run dir>/checkpoints/{policy_id}/step=K.ckpt)")
    if given.is_file():  # a checkpoint: <run dir>/checkpoints/<policy>/step=K.ckpt
        if (not checkpoint.fullmatch(given.name) or given.parent.name != policy_id
                or given.parent.parent.name != "checkpoints"):
            raise ValueError(f"resume_from: {given} is not a checkpoint of policy {policy_id!r} "
                             "written by a run (expected "
                             f"<run dir>/checkpoints/{policy_id}/step=K.ckpt)")
        ckpts, old = [given], given.parents[2]
    else:
        old = given
        ckpts = sorted((p for p in (old / "checkpoints" / policy_id).glob("step=*.ckpt")
                        if checkpoint.fullmatch(p.name)), key=lambda p: int(p.stem.split("=")[1]))
    if not ckpts:
        raise FileNotFoundError(f"resume_from: no checkpoints in {old / 'checkpoints' / policy_id};"
                                " the run must set policies[*].trainer.checkpoint_every")
    if not zipfile.is_zipfile(ckpts[-1]):  # torch.save's format: a truncated or foreign file is not
        raise ValueError(f"resume_from: {ckpts[-1]} is not a trainer checkpoint torch can load "
                         "(truncated, or another kind of file); resume from an earlier one")
    step = int(ckpts[-1].stem.split("=")[1])
    config = old / "config.yaml"
    saved = read_yaml(config) if config.exists() else {}
    if not isinstance(saved, dict):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
            f"resume_from: {config} is not a run's config (a mapping of RunSpec fields), it holds "
            f"a {type(saved).__name__}")
    store_url = (saved.get("weights") or {}).get("url") or str(old / "weights")
    snapshot = (saved.get("dataflow") or {}).get("snapshot") or {}
    snapshot_url = snapshot.get("url") or str(old / "datalayer")
    fs, root = fsspec.core.url_to_fs(snapshot_url)
    if not fs.exists(f"{root}/index.json"):  # SnapshotStore would make the directory: look first
        raise FileNotFoundError(f"resume_from: no data-layer snapshots at {snapshot_url} (no "
                                "index.json); a checkpoint resumes with the snapshot its run wrote")
    entry = SnapshotStore(snapshot_url).at_checkpoint(policy_id, step)
    return ResumePoint(ckpts[-1], step, store_url, snapshot_url, entry.name)
