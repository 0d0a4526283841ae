"""`RunSpec`: the one configuration schema, shared by the notebook, the CLI and cluster jobs.

Plain dataclasses: defaults live here once, YAML only overrides (parsed by jsonargparse in `astratk.config`). Plug-ins
are typed by their contract (`env: Env`, `loss: PolicyLoss`), so YAML gives them as `class_path` / `init_args` (a
registry short name such as `drpo` is sugar for the dotted path) and a notebook passes instances,
`PolicySpec(loss=DRPO(delta=0.5))`, or what YAML writes, `PolicySpec(loss="drpo")`. A constructor is its plug-in's
config, so bad values fail at parse time; envs and losses must be cheap to pickle (they travel to workers and the
data-layer actor with the spec).

One module per section, in the order a run's YAML lists them:

| module | sections |
|---|---|
| `model` | `ModelSpec`, `TinyModelSpec`, `LoraSpec`, `WarmStartSpec`; what a `model.path` string means |
| `trainer` | `TrainerSpec`, `DivergenceSpec`; the aggregation and logger names |
| `rollout` | `RolloutSpec` |
| `dataflow` | `DataflowSpec`, `SnapshotSpec` |
| `cluster` | `ClusterSpec`, `WorkerClass`, `AutoscaleSpec`, `TLSSpec` |
| `weights`, `eval` | `WeightsSpec`, `EvalSpec` |
| `run` | `PolicySpec`, `FrozenSpec`, `RunSpec` |
| `rules` | the checks between sections, in the order a run needs them |

Each section checks its own fields (`validate(key)`, `key` being where it sits in the YAML); `RunSpec.validate()` runs
them all and then `rules`. What only the machine a run starts on can tell (a checkpoint to resume, the model's layers
for LoRA, room on a GPU, a writable output directory) is checked as the run starts (`astratk.runtime.checks`).

Layering: the package loads no torch (the CLI, notebooks and cluster jobs read it cheaply; a test checks it) and
imports only the modules below it (`astratk.contracts`, `astratk.registry`, `astratk.coerce`, `astratk.gpu`, the data
layer's stage types).

Extending: add a field with a default to the section that owns the concept, and its range check to that section's
`validate`; a rule that involves another section goes to `rules`.
"""

from __future__ import annotations

from astratk.spec.base import NothingToTrain, Section, StartError
from astratk.spec.cluster import SCORE_LABEL, AutoscaleSpec, ClusterSpec, TLSSpec, WorkerClass
from astratk.spec.dataflow import DataflowSpec, SnapshotSpec
from astratk.spec.eval import EvalSpec
from astratk.spec.model import LoraSpec, ModelSpec, TinyModelSpec, WarmStartSpec
from astratk.spec.rollout import RolloutSpec
from astratk.spec.run import FrozenSpec, PolicySpec, RunSpec
from astratk.spec.trainer import ACCELERATORS, PRECISIONS, DivergenceSpec, TrainerSpec
from astratk.spec.weights import WeightsSpec

__all__ = ["ACCELERATORS", "PRECISIONS", "SCORE_LABEL", "AutoscaleSpec", "ClusterSpec", "DataflowSpec",
           "DivergenceSpec", "EvalSpec", "FrozenSpec", "LoraSpec", "ModelSpec", "NothingToTrain", "PolicySpec", "RolloutSpec", "RunSpec", "Section",
           "SnapshotSpec", "StartError", "TLSSpec", "TinyModelSpec", "TrainerSpec", "WarmStartSpec", "WeightsSpec",
           "WorkerClass"]
