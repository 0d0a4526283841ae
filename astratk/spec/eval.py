"""Held-out evaluation during training (`EvalSpec`)."""

from __future__ import annotations

from dataclasses import dataclass

from astratk.spec.base import Section, positive


@dataclass
class EvalSpec(Section):
    SPEC_KEY = "eval"

    interval_s: float = 15.0
    """wall-clock interval between held-out evaluations during training"""
    max_tasks: int = 512
    """held-out tasks evaluated each time (greedy decoding)"""
    timeout_s: float = 300.0
    """the longest one evaluation may run on its rollout worker, counted from when it starts there (time queued behind
    a rollout chunk does not count; the whole wait is at most timeout_s + rollout.episode_timeout_s)"""
    every_versions: int | None = None
    """also evaluate whenever the policy has published this many versions more"""
    pass_k: int = 0
    """> 0: also report pass@k and mean@k (`sampled_accuracy`: the mean score of k samples per task at the rollout
    temperature, which still moves where the greedy accuracy is near 1)"""

    def validate(self, key: str = "eval") -> None:
        positive(key, interval_s=self.interval_s, max_tasks=self.max_tasks,
                  timeout_s=self.timeout_s)
        if self.pass_k < 0 or (self.every_versions is not None and self.every_versions < 1):
            raise ValueError(f"{key}: pass_k must be >= 0 (0 = off) and every_versions >= 1 or "
                             f"null, got {self.pass_k}, {self.every_versions}")

