"""`SnapshotStore`: the data layer's state (`DataLayer.state_dict()`) on an fsspec URL, for resume
and for recovery from a lost data-layer worker.

Layout under the URL: `snap-<seq>.pkl` (the pickled state) and `index.json` (one row per snapshot:
name, seq, kind, the policies' versions and served steps, sha256, bytes, time). Writes are atomic
(temporary name, then move), the index last, so a reader never sees a snapshot that is not complete.
A snapshot whose bytes do not match its checksum is refused by `read` (and `latest` falls back to
the one before).

Kinds: `checkpoint` (written when a policy publishes the version of a trainer checkpoint step; kept
while the store lives, so every checkpoint has its match), `periodic` (every `every_steps` served
batches, the newest `keep_last` kept), `on_demand` (`DataLayer.snapshot()`, kept like periodic
ones), `final` (when a run stops).

The files are pickles: load snapshots only from a store you trust, as with trainer checkpoints.

Example:
    >>> store = SnapshotStore("memory://astratk-doc/snapshots")
    >>> entry = store.write({"format": 1}, kind="on_demand", versions={"main": 3},
    ...                     served={"main": 3})
    >>> store.read(store.latest())["format"], store.latest().versions
    (1, {'main': 3})
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import time
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec

KINDS = ("checkpoint", "periodic", "on_demand", "final")


@dataclass(frozen=True)
class SnapshotEntry:
    name: str
    seq: int
    kind: str
    # policy -> published version when the snapshot was taken
    versions: dict[str, int]
    # policy -> steps whose batches had been served (the next step to serve)
    served: dict[str, int]
    sha256: str
    nbytes: int
    written_at: float


class SnapshotStore:
    def __init__(self, url: str, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.url = url.rstrip("/")
        self.keep_last = keep_last
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def entries(self) -> list[SnapshotEntry]:
        """Every snapshot in the index, oldest first."""
        try:
            rows = json.loads(self.fs.cat_file(self._path("index.json")))["snapshots"]
        except FileNotFoundError:
            return []
        return [SnapshotEntry(**row) for row in rows]

    def write(self, state: dict[str, Any], *, kind: str, versions: dict[str, int],
              served: dict[str, int]) -> SnapshotEntry:
        if kind not in KINDS:
            raise ValueError(f"snapshot kind must be one of {KINDS}, got {kind!r}")
        blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        entries = self.entries()
        seq = max((e.seq for e in entries), default=-1) + 1
        entry = SnapshotEntry(name=f"snap-{seq:08d}.pkl", seq=seq, kind=kind,
                              versions=dict(versions), served=dict(served),
                              sha256=hashlib.sha256(blob).hexdigest(), nbytes=len(blob),
                              written_at=time.time())
        self._atomic_write(self._path(entry.name), blob)
        kept, gone = self._pruned([*entries, entry])
        self._atomic_write(self._path("index.json"), json.dumps(
            {"snapshots": [dataclasses.asdict(e) for e in kept]}).encode())
        for e in gone:
            try:
                self.fs.rm(self._path(e.name))
            except FileNotFoundError:
                pass
        return entry

    def _pruned(self, entries: list[SnapshotEntry]
                ) -> tuple[list[SnapshotEntry], list[SnapshotEntry]]:
        """Checkpoint snapshots stay; of the others, the newest keep_last."""
        others = [e for e in entries if e.kind != "checkpoint"]
        gone = {e.name for e in others[:-self.keep_last]}
        return [e for e in entries if e.name not in gone], [e for e in entries if e.name in gone]

    def latest(self) -> SnapshotEntry | None:
        """The newest snapshot whose bytes are intact, or None."""
        for entry in reversed(self.entries()):
            if self._intact(entry):
                return entry
        return None

    def at_checkpoint(self, policy_id: str, step: int) -> SnapshotEntry:
        """The checkpoint snapshot taken when `policy_id` published version `step` (the version a
        trainer checkpoint at global step `step` holds)."""
        found = [e for e in self.entries()
                 if e.kind == "checkpoint" and e.versions.get(policy_id) == step]
        if not found:
            have = sorted({e.versions.get(policy_id, -1) for e in self.entries()
                           if e.kind == "checkpoint"})
            raise FileNotFoundError(f"no data-layer snapshot in {self.url} matches policy "
                                    f"{policy_id!r}'s checkpoint at step {step}; checkpoint "
                                    f"snapshots exist for versions {have}")
        return found[-1]

    def read(self, entry: SnapshotEntry) -> dict[str, Any]:
        blob = self.fs.cat_file(self._path(entry.name))
        digest = hashlib.sha256(blob).hexdigest()
        if digest != entry.sha256:
            raise ValueError(f"data-layer snapshot {self.url}/{entry.name} is corrupt (sha256 "
                             f"{digest[:12]}..., expected {entry.sha256[:12]}...); resume from an "
                             "older one")
        return pickle.loads(blob)

    def _intact(self, entry: SnapshotEntry) -> bool:
        try:
            self.read(entry)
        except (ValueError, FileNotFoundError):
            return False
        return True

    def _atomic_write(self, path: str, data: bytes) -> None:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    def __repr__(self) -> str:
        return f"SnapshotStore({self.url!r}, {len(self.entries())} snapshots)"


def same_keys(what: str, saved: dict[str, Any], here: dict[str, Any]) -> None:
    """Refuse a state whose parts (policies, stages) are not the ones this spec configures, naming
    both."""
    if list(saved) != list(here):
        raise ValueError(f"data layer state has {what} {list(saved)}, but this spec configures "
                         f"{list(here)}; restore with the spec the state was taken from")
