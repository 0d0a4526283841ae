"""The weight store (`WeightsSpec`): where versions are published, how many are kept, deltas, dtype."""

from __future__ import annotations

from dataclasses import dataclass

from astratk.spec.base import Section


@dataclass
class WeightsSpec(Section):
    SPEC_KEY = "weights"

    url: str | None = None
    """fsspec URL of the weight store; None: <run dir>/weights"""
    keep_last: int | None = 8
    """versions kept behind the newest (version 0, and the chains of kept versions' deltas, are always kept); None keeps
    all. Keep more than dataflow.max_staleness and rollout.weight_lag"""
    full_every: int = 1
    """a full snapshot every N versions, sparse deltas between (AstraFlow: 10). Deltas pay off with bf16 copies
    (`publish_dtype: bfloat16`, ~5% of full at lr 1e-6; fp32 weights change in every element), so 1 (full only) is
    the default; set both together, with a bf16 engine (`rollout.engine_args: {dtype: bfloat16}`)."""
    publish_dtype: str | None = None
    """bfloat16: publish bf16 copies (deltas compare bf16 bits, what a bf16 engine loads); None: the trainer's
    dtype"""
    link_bandwidth_bps: float | None = None
    """simulate a remote link to the store (bits/s, e.g. 4e9); None: no link"""
    link_latency_s: float = 0.0
    """the simulated link's latency per request (e.g. 0.3)"""

    def validate(self, key: str = "weights") -> None:
        """Its own fields; `publish_dtype` against the engines' dtype is checked in
        `astratk.spec.rules`."""
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"{key}.keep_last must be >= 1 or null (keep all), got "
                             f"{self.keep_last}")
        if self.full_every < 1:
            raise ValueError(f"{key}.full_every must be >= 1 (1: full snapshots only; AstraFlow "
                             f"uses 10), got {self.full_every}")
        dtypes = ("bfloat16", "float16", "float32")
        if self.publish_dtype is not None and self.publish_dtype not in dtypes:
            raise ValueError(f"{key}.publish_dtype must be one of {list(dtypes)} or null (the "
                             f"trainer's dtype), got {self.publish_dtype!r}")
        if self.link_bandwidth_bps is not None and not self.link_bandwidth_bps > 0:
            raise ValueError(f"{key}.link_bandwidth_bps must be > 0 bits/s (e.g. 4.0e9) or null "
                             f"(no simulated link), got {self.link_bandwidth_bps}")
        if not 0 <= self.link_latency_s < float("inf"):
            raise ValueError(f"{key}.link_latency_s must be >= 0 seconds, got "
                             f"{self.link_latency_s}")

