"""How rollouts are generated (`RolloutSpec`): engine, group size, sampling, timeouts, weight updates."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from astratk.spec.base import Section, positive


@dataclass
class RolloutSpec(Section):
    SPEC_KEY = "rollout"

    engine: str = "torch"
    """inference engine of the rollout workers: torch (built in) or vllm"""
    group_size: int = 8
    """samples per task; one group"""
    temperature: float = 1.0
    """sampling temperature of training rollouts (> 0); the trainer computes log-probs at the same temperature"""
    max_new_tokens: int = 8
    """most tokens the policy generates per turn"""
    tasks_per_chunk: int = 8
    """tasks per rollout Dask task (their episodes share engine batches)"""
    max_inflight_chunks: int = 2
    """acquisition keeps this many chunks in flight per rollout worker (at least concurrent_chunks + 1)"""
    concurrent_chunks: int = 1
    """chunks a local rollout worker runs at once; their episodes share the engine's batches, so a small chunk
    (tasks_per_chunk x group_size rows) does not cap the batch, and a held-out evaluation can run beside a chunk
    instead of holding the worker. A worker of your own cluster takes as many as its `--resources rollout_<policy>=N`
    and `--nthreads` allow"""
    max_batch: int = 512
    """most sequences the engine decodes together"""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """extra keyword arguments for the engine's constructor, e.g. {gpu_memory_utilization: 0.4} (this engine's share of
    its GPU, torch and vllm); torch also takes device (auto, cpu, cuda, cuda:N) and dtype (auto: bfloat16 on a GPU
    with bf16, else float32)"""
    episode_timeout_s: float | None = 600.0
    """Seconds one episode (every turn and env step of one sample) may take. An episode that overruns fails its task's
    attempt, which the data layer re-issues (up to dataflow.max_task_attempts, then drops it, counted). null:
    unbounded."""
    score_timeout_s: float | None = 120.0
    """Seconds one task's scoring (env.score over its group: reward functions, graders) may take. null: unbounded."""
    score_timeout_reward: float | None = None
    """The reward of every sample of a group whose scoring overran; null: the attempt fails and is re-issued as a failed
    rollout is (counted either way)."""
    weight_lag: int = 0
    """Roll out with weights this many versions behind the newest published (0: the newest). A stress test of off-policy
    learning (the stability benchmark's "forced staleness" regime): every sample is at least this stale, so set
    dataflow.max_staleness above it. Needs weights.keep_last > it."""
    weight_updates: str = "between_requests"
    """When a rollout worker's engine takes a newly published version. between_requests: between engine batches (a
    batch in flight finishes on the weights it started with; a multi-turn episode's later turns may use newer
    weights). inflight: also between two decode steps of running sequences, their KV cache kept (PipelineRL's
    in-flight updates; engine torch only). inflight_recompute: the same switch, but running sequences are interrupted
    and their prefix (prompt + tokens so far) is prefilled again under the new weights, as if aborted and resubmitted
    (a partial rollout: exact new-weight log-probs from there on, at the cost of one prefill per load; the next load
    waits until the engine has decoded for as long as the last prefill took, so fast publishing cannot stall it).
    Each token records the version that produced it, and staleness counts from a sample's oldest token."""
    eval_engine: str = "auto"
    """Where held-out evaluations run on a rollout worker. separate: an engine of their own per policy (a second copy of
    the weights and KV cache), which holds the evaluated version while rollouts go on with theirs. shared: the rollout
    engine, which holds the evaluated version while an evaluation runs (rollouts meanwhile sample from it, each token
    recording its version, and move on to the newest once it is done). auto: shared for vllm (each vLLM engine
    allocates its own KV cache: two per worker grew one to 9.7 GiB for a 136M model), separate for torch. Policies
    trained with LoRA share always (their adapters sit on one engine). shared needs weight_updates between_requests
    and weight_lag 0"""
    weight_poll_s: float | None = None
    """While a rollout chunk runs, look for a newer published version every this many seconds and load it (null: only
    when a chunk starts; inflight polls every 0.25 s unless set). Loads go through the same weight_lag rule."""

    def validate(self, key: str = "rollout") -> None:
        """Ranges; whether `engine` is known and installed is checked in `astratk.spec.rules`."""
        positive(key, group_size=self.group_size, max_new_tokens=self.max_new_tokens,
                  tasks_per_chunk=self.tasks_per_chunk,
                  max_inflight_chunks=self.max_inflight_chunks, max_batch=self.max_batch,
                  concurrent_chunks=self.concurrent_chunks)
        if not 0 < self.temperature < float("inf"):
            raise ValueError(f"{key}.temperature: training rollouts sample, so it must be > 0 (got "
                             f"{self.temperature}); greedy decoding is for evaluation")
        for name in ("episode_timeout_s", "score_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{key}.{name} must be > 0 seconds or null (unbounded), got {value}")
        lag = self.weight_lag
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise ValueError(f"{key}.weight_lag must be an integer >= 0 (versions behind the newest that "
                             f"rollouts use; 0: the newest), got {lag!r}")
        if self.weight_updates not in ("between_requests", "inflight", "inflight_recompute"):
            raise ValueError(f"{key}.weight_updates must be between_requests, inflight or inflight_recompute, got "
                             f"{self.weight_updates!r}")
        if self.weight_updates != "between_requests" and self.engine not in ("torch", "astratk.engines.TorchEngine",
                                                                     "astratk.engines.torch_engine.TorchEngine"):
            raise ValueError(f"{key}.weight_updates: {self.weight_updates} needs engine torch (it switches weights "
                             f"between decode steps); engine {self.engine!r} takes new weights between requests only")
        if self.eval_engine not in ("auto", "shared", "separate"):
            raise ValueError(f"{key}.eval_engine must be auto, shared or separate, got {self.eval_engine!r}")
        if self.eval_engine == "shared" and (self.weight_updates != "between_requests" or self.weight_lag):
            raise ValueError(f"{key}.eval_engine: shared needs weight_updates between_requests and weight_lag 0 (an "
                             "evaluation moves the shared engine to the version it evaluates, which would switch "
                             "running sequences' weights or undo the lag); use separate")
        if self.weight_poll_s is not None and not 0 < self.weight_poll_s < math.inf:
            raise ValueError(f"{key}.weight_poll_s must be a finite number of seconds > 0, or null (weights load when "
                             f"a chunk starts only), got {self.weight_poll_s}")

    @property
    def shares_eval_engine(self) -> bool:
        """Whether evaluations run on the rollout engine (`eval_engine`, auto resolved)."""
        if self.eval_engine == "auto":
            return ("vllm" in self.engine.lower() and self.weight_updates == "between_requests"
                    and not self.weight_lag)
        return self.eval_engine == "shared"

    @property
    def poll_s(self) -> float | None:
        """Seconds between weight checks while a chunk runs (None: at chunk starts only)."""
        if self.weight_poll_s is not None:
            return self.weight_poll_s
        return 0.25 if self.weight_updates != "between_requests" else None

