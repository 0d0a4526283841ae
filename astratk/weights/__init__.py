"""Versioned, pull-based weight store, sparse weight deltas, and a simulated remote link."""

from astratk.weights.delta import SparseDelta, apply_delta, delta_from_bytes, delta_to_bytes, make_delta, merge_deltas
from astratk.weights.link import SimulatedLink
from astratk.weights.store import WeightStore

__all__ = ["SimulatedLink", "SparseDelta", "WeightStore", "apply_delta", "delta_from_bytes", "delta_to_bytes",
           "make_delta", "merge_deltas"]
