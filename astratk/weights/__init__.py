"""Versioned, pull-based weight store (DESIGN §3 "Weight store") and sparse weight deltas."""

from astratk.weights.delta import SparseDelta, apply_delta, make_delta
from astratk.weights.store import WeightStore

__all__ = ["SparseDelta", "WeightStore", "apply_delta", "make_delta"]
