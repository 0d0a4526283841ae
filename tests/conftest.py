"""Shared fixtures. Every test process uses one torch thread (2-core machines oversubscribe otherwise)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

import astratk  # noqa: F401 - before transformers: hides CUDA-built torchvision & co. next to a CPU torch (astratk/_addons.py)

torch.set_num_threads(1)
