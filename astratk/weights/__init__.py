"""Versioned, pull-based weight store (DESIGN §3 "Weight store")."""

from astratk.weights.store import WeightStore

__all__ = ["WeightStore"]
