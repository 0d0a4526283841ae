"""Shared by the benchmarks: peak tensor memory of one call, from torch's profiler."""

from __future__ import annotations

from collections.abc import Callable


def peak_tensor_mb(step: Callable[[], object]) -> float:
    """Peak MB of tensor memory allocated during `step()` above what was live before it: the running sum of the
    profiler's allocation/free events (torch's own CPU allocations, exact, unlike resident-set peaks)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20
