"""Rollout services and the acquisition loop that keeps them busy (DESIGN §4, steps 1-4)."""

from astratk.rollout.service import LeaseResult, RolloutService, RunContext, get_service

__all__ = ["LeaseResult", "RolloutService", "RunContext", "get_service"]
