"""Rollout services and the Dask tasks they run (data path steps 2-4, docs/architecture.md); the acquisition loop
that keeps them busy is `astratk.runtime.acquisition`."""

from astratk.records import LeaseResult, RunContext
from astratk.rollout.service import RolloutService, get_service

__all__ = ["LeaseResult", "RolloutService", "RunContext", "get_service"]
