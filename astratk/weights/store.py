"""`WeightStore`: versioned full snapshots and sparse deltas on an fsspec URL (local dir, `memory://`, shared FS,
object store), pulled by what the puller already has (docs/architecture.md, "Weight store").

Layout of `<url>/<policy>/`:
- `v00000010.safetensors`: a full snapshot; `v00000011.delta.safetensors`: the elements whose bits changed since the
  previous published version (`astratk.weights.delta` wire format: gap-coded zlib indices + raw new values);
- `v00000011.json`: the version's ref (`WeightRef`: kind, base_version, nbytes, sha256 checksum), the full snapshot's
  where the version has one; `latest.json`: the newest version's ref;
- `index.json`: the refs of every retained version, full and delta, so a pull plans from one read;
- `adapter_config.json`, for a policy trained with LoRA: its versions hold adapter tensors only (PEFT's names), and
  this file (PEFT's adapter config: r, lora_alpha, target_modules) says how to apply them to the base model
  (`set_adapter_config`; `astratk.models.lora`). Versions, deltas and pulls do not differ.

Publishing (`full_every` = N > 1). Version 0, and every version N or more after the last full snapshot, is a full
snapshot; every other version is a delta against the previous published version, computed from a copy of that
version's published tensors kept in the publishing process (in `publish_dtype`: half the trainer's fp32 weights for
bf16). A version that has a full snapshot gets a delta too, so followers never pay a full; a delta no smaller than the
full state is not written (the version becomes a full snapshot). With `publish_dtype="bfloat16"` the store holds bf16
copies and deltas compare bf16 bits, the weights a bf16 engine loads. `full_every=1` (the default of a bare store)
writes full snapshots only and keeps nothing in memory. One publisher per policy; publishing version v drops any
retained version >= v (a restarted history).

Pulling (`pull(policy_id, have_version, want)`): among the correct ways to reach `want` (default: the newest), the one
with the fewest bytes: the deltas after `have_version`, or a full snapshot at or below `want` plus the deltas after
it (ties: fewer files). Why bytes, and not AstraFlow's "full when more than one version behind": a pull reads its
files concurrently, so it pays the link's latency once whatever it picks, and bytes are what differ; at a few percent
per delta, a receiver 2-9 versions behind pulls a fraction of a full state. A chain comes back merged into one
`SparseDelta` (base = `have_version`), or applied onto the full snapshot (a full state dict). Every file is checked
against its ref's sha256 on every read. A corrupted delta is counted (`stats["corrupt_deltas"]`) and planned around,
through a full snapshot (`stats["full_fallbacks"]`); when no full snapshot reaches `want`, an explicit `want` raises
and a pull of the newest settles for the newest verifiable version (or nothing, until the next full snapshot). A
corrupted full snapshot raises naming the file. A delta is only correct on weights bit-identical to its base as
published: an engine's version 0 comes from the model directory, so version 0 in the store must be those weights
(`astratk.runtime.deploy.publish_initial`), and an engine in another dtype than `publish_dtype` must load full states.

Pruning (`keep_last` = K): versions older than newest - K go, except version 0 and whatever the chain of a retained
version needs (its nearest full snapshot and the deltas after it).

Example:
    >>> import torch
    >>> store = WeightStore("memory://astratk-doc", full_every=10)
    >>> w = torch.zeros(1000)
    >>> ref0 = store.publish("main", 0, {"w": w})
    >>> w[7] = 2.0
    >>> ref1 = store.publish("main", 1, {"w": w})
    >>> ref0.kind, ref1.kind, ref1.base_version, ref1.nbytes < ref0.nbytes
    ('full', 'delta', 0, True)
    >>> delta, ref = store.pull("main", have_version=0)  # what a puller at version 0 gets
    >>> ref.version, delta.changes["w"][0].tolist(), delta.changes["w"][1].tolist()
    (1, [7], [2.0])
    >>> state, ref = store.pull("main", have_version=None)  # a newcomer: full v0 + the delta, applied
    >>> torch.equal(state["w"], w)
    True

Extending: a new transport is an fsspec filesystem (`fs=`; `astratk.weights.link.SimulatedLink` wraps one with
latency and bandwidth); a new encoding belongs in `astratk.weights.delta`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec
import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from astratk.records import WeightRef
from astratk.weights.delta import SparseDelta, apply_delta, delta_from_bytes, delta_to_bytes, make_delta, merge_deltas

if TYPE_CHECKING:
    from astratk.spec import WeightsSpec

PUBLISH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_READERS = 8  # concurrent file reads of one pull


@dataclass(frozen=True)
class _Entry:
    """What the store holds of one version."""

    full: WeightRef | None = None  # its full snapshot
    delta: WeightRef | None = None  # its delta from delta.base_version

    @property
    def primary(self) -> WeightRef:
        return self.full or self.delta  # type: ignore[return-value]  # an entry holds at least one


class WeightStore:
    """`keep_last`: retained versions behind the newest (None keeps all; module docstring). `full_every`: a full
    snapshot every N versions, deltas between (1: full snapshots only). `publish_dtype`: store floating-point tensors
    as this dtype ("bfloat16" for bf16 engines; None keeps the trainer's). `fs`: the filesystem to go through instead
    of `url`'s own (e.g. a `SimulatedLink` around it); paths are still `url`'s."""

    def __init__(self, url: str, keep_last: int | None = None, *, full_every: int = 1,
                 publish_dtype: str | None = None, fs: fsspec.AbstractFileSystem | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (or None to keep every version), got {keep_last}")
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1 (1: full snapshots only; AstraFlow uses 10), got {full_every}")
        if publish_dtype is not None and publish_dtype not in PUBLISH_DTYPES:
            raise ValueError(f"publish_dtype must be one of {sorted(PUBLISH_DTYPES)} or None, got {publish_dtype!r}")
        self.keep_last, self.full_every, self.publish_dtype = keep_last, full_every, publish_dtype
        self.url = url.rstrip("/")
        inner, self.root = fsspec.core.url_to_fs(self.url)
        self.fs = fs if fs is not None else inner
        self.fs.makedirs(self.root, exist_ok=True)
        self._dirs: set[str] = set()  # policies whose directory this object has made
        self._kept: dict[str, tuple[int, str, dict[str, torch.Tensor]]] = {}  # policy -> (version, checksum of its
        #   primary ref, published tensors): the base of the next delta
        self.stats = dict.fromkeys(("published_full", "published_delta", "bytes_published", "pulls", "pulled_full",
                                    "pulled_delta", "bytes_pulled", "corrupt_deltas", "full_fallbacks",
                                    "index_retries"), 0)

    @classmethod
    def from_spec(cls, url: str, spec: WeightsSpec) -> WeightStore:
        """The store a run's `weights:` section describes, behind a `SimulatedLink` when it sets a bandwidth."""
        fs = None
        if spec.link_bandwidth_bps:
            from astratk.weights.link import SimulatedLink

            fs = SimulatedLink(url, spec.link_bandwidth_bps, spec.link_latency_s)
        return cls(url, spec.keep_last, full_every=spec.full_every, publish_dtype=spec.publish_dtype, fs=fs)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # ------------------------------------------------------------------------------------------------ publish
    def publish(self, policy_id: str, version: int, state: Mapping[str, torch.Tensor]) -> WeightRef:
        """Write `version` (a full snapshot or a delta, module docstring) and make it the latest; returns its ref.
        Tensors are copied to CPU (in `publish_dtype`) first, so the caller may go on training at once."""
        tensors = self._copy_out(state)
        if policy_id not in self._dirs:
            self.fs.makedirs(self._path(policy_id), exist_ok=True)
            self._dirs.add(policy_id)
        index = self._read_index(policy_id)
        stale = {v: e for v, e in index.items() if v >= version}
        index = {v: e for v, e in index.items() if v < version}
        base = max(index, default=None)
        last_full = max((v for v, e in index.items() if e.full is not None), default=None)
        full_due = self.full_every == 1 or last_full is None or version - last_full >= self.full_every
        delta_blob = None
        if self.full_every > 1 and base is not None:
            prev = self._previous(policy_id, base, index[base])
            full_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            if prev is not None and _same_layout(prev, tensors):
                delta = make_delta(prev, tensors, base_version=base, version=version)
                delta_blob = delta_to_bytes(delta, {"policy_id": policy_id, "version": str(version)})
            if delta_blob is None or len(delta_blob) >= full_bytes:
                delta_blob, full_due = None, True  # no delta can be made, or it is no smaller than the full state
        now = time.time()
        full_ref = delta_ref = None
        if full_due:
            blob = save_bytes(tensors, metadata={"policy_id": policy_id, "version": str(version)})
            full_ref = self._write_blob(policy_id, version, "full", None, blob, now)
        if delta_blob is not None:
            delta_ref = self._write_blob(policy_id, version, "delta", base, delta_blob, now)
        index[version] = entry = _Entry(full_ref, delta_ref)
        meta = json.dumps(dataclasses.asdict(entry.primary)).encode()
        self._atomic_write(self._path(policy_id, f"v{version:08d}.json"), meta)
        if self.keep_last is not None:
            index, pruned = _pruned(index, version, self.keep_last)
            stale.update(pruned)
        self._write_index(policy_id, index)
        self._atomic_write(self._path(policy_id, "latest.json"), meta)  # last: a reader of latest finds it indexed
        self._remove(policy_id, stale, index)
        if self.full_every > 1:
            self._kept[policy_id] = (version, entry.primary.checksum, tensors)
        return entry.primary

    def rollback(self, policy_id: str, version: int) -> WeightRef:
        """Make `version` the newest again, deleting every later one: a run resumed from the checkpoint of
        `version` must not let rollout services pull weights its crashed predecessor published after it."""
        index = self._read_index(policy_id)
        if version not in index:
            raise KeyError(f"policy {policy_id!r} version {version} is not in {self.url} (versions "
                           f"{_ranges(sorted(index))}); it may have been pruned (weights.keep_last)")
        gone = {v: e for v, e in index.items() if v > version}
        index = {v: e for v, e in index.items() if v <= version}
        primary = index[version].primary
        self._write_index(policy_id, index)
        self._atomic_write(self._path(policy_id, "latest.json"), json.dumps(dataclasses.asdict(primary)).encode())
        self._remove(policy_id, gone, index)
        self._kept.pop(policy_id, None)
        return primary

    def _copy_out(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Contiguous CPU tensors in the publish dtype. Copies are forced when deltas are on: the kept state must
        not alias the live parameters (an in-place optimiser step would change the base of the next delta)."""
        dtype = PUBLISH_DTYPES.get(self.publish_dtype or "")
        out = {}
        for name, t in state.items():
            t = t.detach()
            out[name] = t.to(device="cpu", dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype,
                             copy=self.full_every > 1).contiguous()
        return out

    def _previous(self, policy_id: str, version: int, entry: _Entry) -> dict[str, torch.Tensor] | None:
        """The published tensors of `version`: the kept copy when it is of that very publication, else read back
        (a restarted trainer, or the first publication after another process published version 0)."""
        kept = self._kept.get(policy_id)
        if kept is not None and kept[0] == version and kept[1] == entry.primary.checksum:
            return kept[2]
        try:
            state, _ = self.pull(policy_id, None, version)
        except (KeyError, ValueError, FileNotFoundError):  # unreadable: the new version is published in full
            return None
        return state

    def _write_blob(self, policy_id: str, version: int, kind: str, base: int | None, blob: bytes,
                    now: float) -> WeightRef:
        name = f"v{version:08d}.safetensors" if kind == "full" else f"v{version:08d}.delta.safetensors"
        self._atomic_write(self._path(policy_id, name), blob)
        self.stats[f"published_{kind}"] += 1
        self.stats["bytes_published"] += len(blob)
        return WeightRef(policy_id=policy_id, version=version, uri=f"{self.url}/{policy_id}/{name}", kind=kind,
                         base_version=base, nbytes=len(blob), checksum=hashlib.sha256(blob).hexdigest(),
                         published_at=now)

    def _write_index(self, policy_id: str, index: dict[int, _Entry]) -> None:
        rows = [{"version": v, "full": e.full and dataclasses.asdict(e.full),
                 "delta": e.delta and dataclasses.asdict(e.delta)} for v, e in sorted(index.items())]
        self._atomic_write(self._path(policy_id, "index.json"), json.dumps({"versions": rows}).encode())

    def _remove(self, policy_id: str, gone: dict[int, _Entry], index: dict[int, _Entry]) -> None:
        """Delete the files of `gone` entries that `index` no longer names (a republished version reuses names)."""
        live = {_name(r) for e in index.values() for r in (e.full, e.delta) if r is not None}
        live |= {f"v{v:08d}.json" for v in index}
        doomed = {_name(r) for e in gone.values() for r in (e.full, e.delta) if r is not None}
        doomed |= {f"v{v:08d}.json" for v in gone}
        for name in sorted(doomed - live):
            try:
                self.fs.rm(self._path(policy_id, name))
            except FileNotFoundError:
                pass

    def _atomic_write(self, path: str, data: bytes) -> None:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    # ------------------------------------------------------------------------------------------------ adapters
    def set_adapter_config(self, policy_id: str, config: Mapping[str, Any] | None) -> None:
        """Record that `policy_id`'s versions are LoRA adapters, and how to apply them (module docstring); None:
        they are full models (a record left by an earlier LoRA history is removed)."""
        path = self._path(policy_id, "adapter_config.json")
        if config is None:
            try:
                self.fs.rm(path)
            except FileNotFoundError:
                pass
            return
        self.fs.makedirs(self._path(policy_id), exist_ok=True)
        self._atomic_write(path, json.dumps(dict(config), indent=2).encode())

    def adapter_config(self, policy_id: str) -> dict[str, Any] | None:
        """The adapter config `set_adapter_config` recorded for `policy_id`, or None: its versions are full
        models."""
        try:
            return json.loads(self.fs.cat_file(self._path(policy_id, "adapter_config.json")))
        except FileNotFoundError:
            return None

    # ------------------------------------------------------------------------------------------------ refs
    def latest(self, policy_id: str) -> WeightRef | None:
        """The newest published ref of `policy_id`, or None before the first publication."""
        return self._read_ref(self._path(policy_id, "latest.json"))

    def ref(self, policy_id: str, version: int) -> WeightRef:
        """The ref of `version` (its full snapshot's where it has one)."""
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

    def _read_index(self, policy_id: str) -> dict[int, _Entry]:
        try:
            rows = json.loads(self.fs.cat_file(self._path(policy_id, "index.json")))["versions"]
        except FileNotFoundError:
            return self._legacy_index(policy_id)
        return {r["version"]: _Entry(r["full"] and WeightRef(**r["full"]), r["delta"] and WeightRef(**r["delta"]))
                for r in rows}

    def _legacy_index(self, policy_id: str) -> dict[int, _Entry]:
        """A store written before the index existed holds full snapshots with one `v*.json` each."""
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self._path(policy_id), detail=False)]
        except FileNotFoundError:
            return {}
        refs = [self._read_ref(self._path(policy_id, n)) for n in names
                if n.startswith("v") and n.endswith(".json") and n[1:-5].isdigit()]
        return {r.version: _Entry(full=r) for r in refs if r is not None and r.kind == "full"}

    # ------------------------------------------------------------------------------------------------ pull
    def pull(self, policy_id: str, have_version: int | None = None, want: int | None = None
             ) -> tuple[dict[str, torch.Tensor] | SparseDelta | None, WeightRef]:
        """The cheapest correct payload that takes a puller at `have_version` (None: nothing usable) to `want`
        (None: the newest), and the ref of the version it produces. The payload is a full state dict, one
        `SparseDelta` from `have_version`, or None when there is nothing to load: the puller is there already, or
        (following the newest) ahead, or corrupted deltas cut every newer version off (`stats["corrupt_deltas"]`).
        Apply a delta only to the weights of exactly `have_version`."""
        for attempt in (0, 1):
            index = self._read_index(policy_id)
            if not index:
                raise KeyError(f"policy {policy_id!r} has no published weights in {self.url}")
            try:
                return self._pull(policy_id, index, have_version, want)
            except FileNotFoundError:  # pruned between our index read and the file read: read the index again
                if attempt:
                    raise
                self.stats["index_retries"] += 1
        raise AssertionError("unreachable")

    def fetch(self, ref: WeightRef, have_version: int | None = None) -> dict[str, torch.Tensor] | SparseDelta:
        """`ref`'s version: its full state, or a delta from `have_version` where that is cheaper (see `pull`)."""
        payload, _ = self.pull(ref.policy_id, have_version, ref.version)
        return SparseDelta(ref.version, ref.version, {}, {}) if payload is None else payload

    def _pull(self, policy_id: str, index: dict[int, _Entry], have: int | None, want: int | None
              ) -> tuple[dict[str, torch.Tensor] | SparseDelta | None, WeightRef]:
        newest = max(index)
        if want is not None and want not in index:
            raise KeyError(f"policy {policy_id!r} version {want} is not in {self.url} (retained: "
                           f"{_ranges(sorted(index))}); it was never published or was pruned (weights.keep_last)")
        if have is not None and (have == want or (want is None and have >= newest)):
            return None, index[newest if want is None else want].primary
        # a pull of the newest may settle for an older version when corruption cuts the newest off (docstring)
        targets = [want] if want is not None else [v for v in sorted(index, reverse=True) if have is None or v > have]
        bad: set[str] = set()
        blobs: dict[str, bytes] = {}  # uri -> verified bytes
        for target in targets:
            while (plan := _plan(index, have, target, bad)) is not None:
                self._read_blobs(policy_id, [r for r in plan if r.uri not in blobs], blobs)
                corrupt = [r for r in plan if r.uri not in blobs]
                if not corrupt:
                    if bad and plan[0].kind == "full":
                        self.stats["full_fallbacks"] += 1
                    return self._assemble(plan, blobs), index[target].primary
                bad.update(r.uri for r in corrupt)
        if want is None and have is not None:  # nothing newer is verifiable: stay (counted, warned above)
            return None, index[newest].primary
        raise ValueError(f"policy {policy_id!r}: no verifiable way from version {have} to "
                         f"{'the newest' if want is None else want} in {self.url}: corrupted delta(s) "
                         f"{sorted(_name(r) for e in index.values() for r in (e.delta,) if r and r.uri in bad)} and "
                         f"no intact full snapshot after them; republish, or wait for the next full snapshot")

    def _read_blobs(self, policy_id: str, refs: list[WeightRef], out: dict[str, bytes]) -> None:
        """Read `refs`' files concurrently (one pull pays the latency once) and add the verified ones to `out`.
        A corrupted full snapshot raises; a corrupted delta is counted and left out."""
        if not refs:
            return
        paths = [self._path(policy_id, _name(r)) for r in refs]
        if len(refs) == 1:
            data = [self.fs.cat_file(paths[0])]
        else:
            with concurrent.futures.ThreadPoolExecutor(min(_MAX_READERS, len(refs))) as pool:
                data = list(pool.map(self.fs.cat_file, paths))
        for ref, path, blob in zip(refs, paths, data, strict=True):
            self.stats["bytes_pulled"] += len(blob)
            if hashlib.sha256(blob).hexdigest() == ref.checksum:
                out[ref.uri] = blob
            elif ref.kind == "full":
                raise ValueError(f"checksum mismatch for {path} (policy {ref.policy_id!r} v{ref.version} full "
                                 "snapshot): the file is corrupt or was overwritten, and no other file holds this "
                                 "version's full weights; republish it or pull another version")
            else:
                self.stats["corrupt_deltas"] += 1
                warnings.warn(f"checksum mismatch for {path} (policy {ref.policy_id!r} delta v{ref.base_version} -> "
                              f"v{ref.version}); pulling through a full snapshot instead", stacklevel=3)

    def _assemble(self, plan: list[WeightRef], blobs: dict[str, bytes]
                  ) -> dict[str, torch.Tensor] | SparseDelta:
        self.stats["pulls"] += 1
        deltas = [delta_from_bytes(blobs[r.uri]) for r in plan if r.kind == "delta"]
        if plan[0].kind == "delta":
            self.stats["pulled_delta"] += 1
            return merge_deltas(deltas)
        self.stats["pulled_full"] += 1
        state = load_bytes(blobs[plan[0].uri])
        for delta in deltas:
            apply_delta(state, delta)
        return state

    def __repr__(self) -> str:
        return (f"WeightStore({self.url!r}, full_every={self.full_every}, publish_dtype={self.publish_dtype}, "
                f"keep_last={self.keep_last}{'' if self.fs is fsspec.core.url_to_fs(self.url)[0] else f', fs={self.fs!r}'})")


# ---------------------------------------------------------------------------------------------------- planning
def _plan(index: dict[int, _Entry], have: int | None, target: int, bad: set[str]) -> list[WeightRef] | None:
    """The fewest-bytes list of files (in application order) that produces `target` from `have`, avoiding `bad`.

    Walk down from `target` along delta bases; every intact full snapshot met is an option (it plus the deltas
    walked so far), and so is meeting `have` (the deltas alone). Costs only grow along the walk, so it stops at
    `have` or once the deltas alone cost more than the best option."""
    best: list[WeightRef] | None = None
    chain: list[WeightRef] = []  # deltas from the current version up to target, newest first
    v = target
    while v in index:
        if have is not None and v == have:
            option = chain[::-1]
            return option if best is None or _cost(option) < _cost(best) else best
        entry = index[v]
        if entry.full is not None and entry.full.uri not in bad:
            option = [entry.full, *chain[::-1]]
            if best is None or _cost(option) < _cost(best):
                best = option
        d = entry.delta
        if d is None or d.uri in bad or d.base_version is None or d.base_version >= v:
            break
        chain.append(d)
        if best is not None and _cost(chain) >= _cost(best):
            break
        v = d.base_version
    return best


def _cost(refs: list[WeightRef]) -> tuple[int, int]:
    return sum(r.nbytes for r in refs), len(refs)


def _pruned(index: dict[int, _Entry], newest: int, keep_last: int) -> tuple[dict[int, _Entry], dict[int, _Entry]]:
    """(kept, removed): version 0 and the last `keep_last` + 1 versions whole, plus what their chains need."""
    need: dict[int, set[str]] = {}
    for v in [v for v in index if v == 0 or v >= newest - keep_last]:
        entry = index[v]
        need.setdefault(v, set()).update(k for k in ("full", "delta") if getattr(entry, k) is not None)
        while entry.full is None and entry.delta is not None and entry.delta.base_version in index:
            u = entry.delta.base_version
            entry = index[u]
            need.setdefault(u, set()).add("full" if entry.full is not None else "delta")
    kept = {v: _Entry(index[v].full if "full" in kinds else None, index[v].delta if "delta" in kinds else None)
            for v, kinds in need.items()}
    for v, e in list(kept.items()):  # a delta whose base is gone can never be applied
        if e.delta is not None and e.delta.base_version not in kept:
            kept[v] = _Entry(e.full, None)
    removed = {}
    for v, e in index.items():
        k = kept.get(v, _Entry())
        gone = _Entry(e.full if k.full is None else None, e.delta if k.delta is None else None)
        if gone.full is not None or gone.delta is not None:
            removed[v] = gone
    return dict(sorted(kept.items())), removed


def _same_layout(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)


def _name(ref: WeightRef) -> str:
    return ref.uri.rsplit("/", 1)[-1]


def _ranges(versions: list[int]) -> str:
    """[0, 3, 4, 5] -> '0, 3-5'."""
    out: list[str] = []
    for v in versions:
        if out and v == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)

