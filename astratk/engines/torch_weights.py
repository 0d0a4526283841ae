"""Weight loads into a running `TorchEngine`, and when a new version takes effect.

A running batch holds `WeightLoads.lock`, and a load waits for it: by default (`between_requests`) a batch finishes on
the weights it started with. The in-flight modes let waiting loads run between two decode steps (`yield_to_waiting`):
`inflight` keeps the batch's KV cache, `inflight_recompute` prefills each running prefix again, paced by
`InflightPacing`. A new mode goes into `WEIGHT_UPDATES`, `InflightPacing` and the decode loop (`torch_decode`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from astratk.weights.delta import SparseDelta, apply_delta

WEIGHT_UPDATES = ("between_requests", "inflight", "inflight_recompute")


def check_state(state: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
    """Reject a full state `params` (the model's, or an adapter's) cannot take before waiting for the lock
    (deltas: `apply_delta` checks)."""
    if unknown := sorted(set(state) - set(params)):
        raise KeyError(f"load_weights: {len(unknown)} names the model lacks, e.g. {unknown[:3]}; expected names "
                       f"like {sorted(params)[:3]}")
    if bad := [(k, tuple(v.shape)) for k, v in state.items() if v.shape != params[k].shape]:
        raise ValueError(f"load_weights: shape mismatch for {bad[:3]}; the model's are "
                         f"{[tuple(params[k].shape) for k, _ in bad[:3]]}")


def check_load(state: Mapping[str, torch.Tensor] | SparseDelta, version: int,
               params: Mapping[str, torch.Tensor]) -> None:
    """What can be checked of a load before it waits for the lock: a delta's version, a full state's names and
    shapes."""
    if isinstance(state, SparseDelta):
        if state.version != version:
            raise ValueError(f"load_weights: the delta produces version {state.version}, not {version}")
    else:
        check_state(state, params)


class WeightLoads:
    """The weights lock, the loads waiting for it, and the error of a full load that failed half-way (`broken`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held by a running batch and by a load
        self.waiting = 0  # the worker lets a waiting load go before its next batch
        self.done = 0  # loads finished (or failed): the worker lets go the ones waiting when it yields, no more
        self.broken: RuntimeError | None = None  # a full load that failed after writing part of the weights
        self._counts = threading.Lock()  # guards `waiting` and `done`

    @contextmanager
    def turn(self) -> Iterator[None]:
        """A load's turn: counted as waiting until it has taken the lock, then run under it (gradients off)."""
        with self._counts:
            self.waiting += 1
        try:
            with self.lock, torch.no_grad():
                yield
        finally:
            with self._counts:
                self.waiting -= 1
                self.done += 1

    def write(self, params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor] | SparseDelta,
              version: int, current: int) -> None:
        """During a `turn`: write `state` (tensors by name, or a `SparseDelta` made from `current`) into `params`."""
        if isinstance(state, SparseDelta):
            if state.base_version != current:  # checked under the lock: a load in between moves it
                raise ValueError(f"load_weights: the engine is at version {current} and the delta needs "
                                 f"base version {state.base_version}; fetch a full state instead")
            apply_delta(params, state)  # checks every name, shape and dtype before writing any
            return
        written = 0
        try:
            for name, tensor in state.items():
                params[name].copy_(tensor)
                written += 1
        except Exception as e:
            if written:  # neither version now: refuse work until the service rebuilds the engine
                self.broken = RuntimeError(
                    f"TorchEngine is broken: the load of version {version} failed after writing {written} "
                    f"of {len(state)} tensors ({type(e).__name__}: {e}); its weights are neither version "
                    f"{current} nor {version}. The rollout service rebuilds it at its next sync")
                self.broken.__cause__ = e
            raise

    def let_go(self) -> None:
        """Wait until the loads waiting now have run (not the ones that arrive meanwhile: a stream of loads cannot
        starve generation)."""
        with self._counts:
            target = self.done + self.waiting
        while self.waiting and self.done < target:
            time.sleep(1e-4)

    def yield_to_waiting(self) -> bool:
        """Between two decode steps, with the lock held: let the waiting loads run (the batch keeps its KV cache),
        then take the lock back. Returns whether any was waiting."""
        if not self.waiting:
            return False
        self.lock.release()
        try:
            self.let_go()  # each waiting load takes the lock in turn
        finally:
            self.lock.acquire()
        if self.broken is not None:  # the batch must not go on with half-written weights
            raise self.broken
        return True


class InflightPacing:
    """One batch's choice, before each decode step, of whether to take waiting loads (`weight_updates`).

    Why paced: a recompute prefills every running prefix again. Versions published faster than that would make each
    token pay a whole prefill (decoding stalls: measured 26x slower at a version every 0.3 s), so the next in-flight
    load is taken only after decoding for as long as the last recompute took, and for one decode step at least (on a
    loaded machine sampling the recompute's token alone could outlast it, and the version then served one token):
    recomputing takes at most about half the engine's time, and a waiting load waits at most that long (or for the
    batch's end)."""

    def __init__(self, weight_updates: str) -> None:
        self.inflight = weight_updates != "between_requests"
        self.recompute = weight_updates == "inflight_recompute"
        self.decoding_since, self.recompute_cost = time.perf_counter(), 0.0
        self.stepped = True  # a decode step ran since the last recompute

    def due(self) -> bool:
        """Whether the decode loop lets waiting loads run before its next step."""
        if not self.recompute:
            return self.inflight
        return self.stepped and time.perf_counter() - self.decoding_since >= self.recompute_cost

    def forwarded(self) -> None:
        """A decode step ran."""
        self.stepped = True

    def recomputed(self, started: float) -> float:
        """A recompute that began at `started` has ended: decoding resumes now. Returns its seconds."""
        self.decoding_since = time.perf_counter()
        self.recompute_cost = self.decoding_since - started
        self.stepped = False
        return self.recompute_cost
