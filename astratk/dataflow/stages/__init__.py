"""Data-layer stages at AstraFlow's three points (docs/architecture.md, "Data-layer stages").

- before rollout, `Curator.should_submit / update / on_version` (`curators.py`): `accept_all`, `filter_solved`,
  `greso`, `curriculum`; `DataflowSpec.curators`.
- after rollout, `GroupFilter.check -> reason or None` (`filters.py`): `zero_variance`, `length_filter`,
  `format_filter`; `DataflowSpec.filters` (and `filter_zero_variance`).
- at serving (`serving.py`): `Staleness` (`max_staleness`, `lag_decay`), `ServingOrder.order` (`fifo`, `edf`;
  `order`), `Replay` (`replay`), `Mixing` (`mixing`).
Built-ins are registry short names of kind "stage" (`astratk.registry`).

How the data layer uses them (`astratk.dataflow.datalayer`):
- `lease`: each new task is offered to every curator in order; the first refusal skips it, counted as
  `data/tasks_skipped_<curator>`. More than `DataflowSpec.max_curator_skips` refusals in a row raise (the curators
  reject everything the train stream has left). Re-issued leases are not curated again.
- `admit`: for the curated role (the env's first role: the solver in a workflow) every curator's `update` gets the
  group's rewards, whether or not a filter then drops it (GRESO learns from exactly the groups the zero-variance
  filter drops). Advantages are fixed, then filters run in order; a drop is counted as
  `data/<policy>/groups_dropped_<reason>`. Curators' `on_version` runs when the curated role's policy publishes.
- `next_batch`: the serving order of `astratk.dataflow.stages.serving` (staleness, replay, order, mixing, weights).

Stage instances in a `RunSpec` are templates: the data layer deep-copies them, one copy of each serving stage per
policy, so a spec can be reused and policies do not share replay buffers. Metrics: `data/stage/<name>/<metric>` for
curators and filters, `data/<policy>/stage/<name>/<metric>` for serving stages.

YAML:

    dataflow:
      curators:
        - class_path: greso
      filters:
        - class_path: length_filter
          init_args: {max_tokens: 512, drop_unfinished: true}
      lag_decay: 0.9
      order: {class_path: edf}
      replay: {class_path: replay, init_args: {ratio: 0.25, selector: recent, capacity: 1024}}
      mixing: {class_path: mixing, init_args: {ratios: {arithmetic: 0.7, math_word: 0.3}}}

Extending: subclass a contract from `astratk.dataflow.stages.base` and name the class by dotted path in a config.
"""

from astratk.dataflow.stages.base import Curator, GroupFilter, ServingOrder, Stage
from astratk.dataflow.stages.curators import GRESO, AcceptAll, FilterSolved, PassRateCurriculum
from astratk.dataflow.stages.filters import FormatFilter, LengthFilter, ZeroVariance
from astratk.dataflow.stages.serving import EDF, FIFO, Mixing, Replay, Staleness

__all__ = ["EDF", "FIFO", "GRESO", "AcceptAll", "Curator", "FilterSolved", "FormatFilter", "GroupFilter",
           "LengthFilter", "Mixing", "PassRateCurriculum", "Replay", "ServingOrder", "Stage", "Staleness",
           "ZeroVariance"]
