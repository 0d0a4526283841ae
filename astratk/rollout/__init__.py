"""Rollout services and the Dask tasks they run (data path steps 2-4, docs/architecture.md); the acquisition loop
that keeps them busy is `astratk.runtime.acquisition`."""

from astratk._lazy import lazy_names
from astratk.records import LeaseResult, RunContext

# the service (engines, transformers) loads on first use: a worker that imports astratk.rollout.hardware at start-up
# (every worker of a run's cluster) must not pay seconds of imports for it
__getattr__ = lazy_names("astratk.rollout", {"RolloutService": "astratk.rollout.service",
                                             "get_service": "astratk.rollout.service"})

__all__ = ["LeaseResult", "RolloutService", "RunContext", "get_service"]
