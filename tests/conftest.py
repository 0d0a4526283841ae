"""Shared fixtures. Every test process uses one torch thread (2-core machines oversubscribe otherwise)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

import astratk  # noqa: F401 - before transformers: hides CUDA-built torchvision & co. next to a CPU torch (astratk/_addons.py)

torch.set_num_threads(1)

# Property-based tests (the data layer's model checker): a few hundred examples by default, keeping CI fast;
# `pytest --hypothesis-profile=long` for a long search (see tests/unit/test_datalayer_model.py).
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=200, stateful_step_count=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=5000, stateful_step_count=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
