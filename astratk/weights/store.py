"""`WeightStore`: versioned full snapshots on an fsspec URL (local dir, `memory://`, shared FS, object store).

Publishing writes `<root>/<policy>/v<version>.safetensors` to a temporary name and moves it into place, then
atomically replaces `<root>/<policy>/latest.json` (the `WeightRef`). Pullers read `latest.json` and fetch the tensors
they lack; a checksum per ref catches torn or corrupted files. Sparse deltas and periodic full snapshots come in
issue 6 behind the same `publish` / `fetch`.

Example:
    >>> import torch
    >>> store = WeightStore("memory://astratk-doc")
    >>> ref = store.publish("main", 1, {"w": torch.ones(2)})
    >>> store.latest("main").version, store.fetch(ref)["w"].tolist()
    (1, [1.0, 1.0])
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Mapping

import fsspec
import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from astratk.records import WeightRef


class WeightStore:
    """`keep_last`: after each publication, delete snapshots more than this many versions older (None keeps all).
    Version 0 (the starting weights) is always kept. Pullers only ever need recent versions; a run publishing every
    step would otherwise fill the disk (220 versions of a 3.3 MB model: 724 MB)."""

    def __init__(self, url: str, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (or None to keep every version), got {keep_last}")
        self.keep_last = keep_last
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def publish(self, policy_id: str, version: int, state: Mapping[str, torch.Tensor]) -> WeightRef:
        """Write a full snapshot and make it the latest. Tensors are copied to contiguous CPU memory first."""
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        blob = save_bytes(tensors, metadata={"policy_id": policy_id, "version": str(version)})
        name = f"v{version:08d}.safetensors"
        self.fs.makedirs(self._path(policy_id), exist_ok=True)
        self._atomic_write(self._path(policy_id, name), blob)
        ref = WeightRef(policy_id=policy_id, version=version, uri=f"{self.url}/{policy_id}/{name}", kind="full",
                        nbytes=len(blob), checksum=hashlib.sha256(blob).hexdigest(), published_at=time.time())
        meta = json.dumps(ref.__dict__).encode()
        self._atomic_write(self._path(policy_id, f"v{version:08d}.json"), meta)
        self._atomic_write(self._path(policy_id, "latest.json"), meta)
        if self.keep_last is not None:
            self._prune(policy_id, version - self.keep_last)
        return ref

    def _prune(self, policy_id: str, below: int) -> None:
        for path in self.fs.ls(self._path(policy_id), detail=False):
            name = path.rsplit("/", 1)[-1]
            if name.startswith("v") and name.split(".")[0][1:].isdigit():
                v = int(name.split(".")[0][1:])
                if 0 < v < below:
                    self.fs.rm(path)

    def _atomic_write(self, path: str, data: bytes) -> None:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    def latest(self, policy_id: str) -> WeightRef | None:
        """The newest published ref of `policy_id`, or None before the first publication."""
        return self._read_ref(self._path(policy_id, "latest.json"))

    def ref(self, policy_id: str, version: int) -> WeightRef:
        ref = self._read_ref(self._path(policy_id, f"v{version:08d}.json"))
        if ref is None:
            latest = self.latest(policy_id)
            raise KeyError(f"policy {policy_id!r} version {version} was never published to {self.url} (latest: "
                           f"{None if latest is None else latest.version})")
        return ref

    def _read_ref(self, path: str) -> WeightRef | None:
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return WeightRef(**json.loads(raw))

    def fetch(self, ref: WeightRef) -> dict[str, torch.Tensor]:
        fs, path = fsspec.core.url_to_fs(ref.uri)
        try:
            blob = fs.cat_file(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"weights for policy {ref.policy_id!r} version {ref.version} are gone from "
                                    f"{ref.uri}; was the store cleaned while the run was live?") from None
        if ref.checksum and hashlib.sha256(blob).hexdigest() != ref.checksum:
            raise ValueError(f"checksum mismatch for {ref.uri} (policy {ref.policy_id!r} v{ref.version}): the file "
                             "is corrupt or was overwritten")
        return load_bytes(blob)
