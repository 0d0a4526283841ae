"""Rollout services and the Dask tasks they run (data path steps 2-4, docs/architecture.md); the acquisition loop
that keeps them busy is `astratk.runtime.acquisition`.

The package's names load on first use: a worker process that imports one of its light modules (the hardware plugin,
the service record) does not load the engines, torch and transformers with it."""

from __future__ import annotations

from astratk._lazy import lazy_names

__getattr__ = lazy_names("astratk.rollout", {"LeaseResult": "astratk.records", "RunContext": "astratk.records",
                                             "RolloutService": "astratk.rollout.service",
                                             "get_service": "astratk.rollout.service"})

__all__ = ["LeaseResult", "RolloutService", "RunContext", "get_service"]
