"""`validate(spec)`: a `RunSpec`'s checks before anything starts; each error names the key to change
and the fix.

`astratk.spec` holds plain dataclasses that check their own fields (`validate(key)`). This module
runs those and adds what one dataclass cannot know:
- rules between fields: every env role played by exactly one policy, `dataflow.mixing` naming the
  env's sources, the synchronous mode's cluster and publish cadence, pool labels for every policy,
  `weights.publish_dtype` against the engines' dtype;
- names that other modules own, asked of their owner: `trainer.aggregation`
  (`astratk.training.aggregation`), `trainer.loggers` (`astratk.training.loggers.check_loggers`),
  `dataflow.advantage` (`astratk.dataflow.advantages.get_advantage`), `rollout.engine`
  (`astratk.registry`, and vLLM's install hint from `astratk.engines`), `cluster.tls`
  (`astratk.runtime.cluster.check_tls`, which `connect` runs too).

The owners are imported inside the checks: some load torch or Dask, and `RunSpec.validate()` imports
this module when it runs, so the spec stays a light leaf and no import cycle runs through it.

Extending: a rule about one dataclass's own fields goes to its `validate` in `astratk.spec`; a rule
between fields, or about a name a module owns, goes here (the owner exposing the check, this module
calling it).
"""

from __future__ import annotations

import importlib.util

from astratk.contracts import Env
from astratk.registry import REGISTRY, resolve_path
from astratk.spec import SCORE_LABEL, ClusterSpec, DataflowSpec, PolicySpec, RunSpec, TrainerSpec


def validate(spec: RunSpec) -> RunSpec:
    """Every check of the spec (its plug-ins are built already); returns it, or raises
    ValueError."""
    env = spec.env
    if not isinstance(env, Env):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
            f"env: expected an astratk.contracts.Env, got {type(env).__name__}")
    if not spec.policies:
        raise ValueError("policies: at least one policy is required")
    # env role -> the policy that plays it
    seen: dict[str, str] = {}
    for i, p in enumerate(spec.policies):
        key = f"policies[{i}]"
        p.validate(key)
        check_roles(p, key, env, seen)
        check_trainer_names(p.trainer, f"{key}.trainer")
    missing = [r for r in env.roles if r not in seen]
    if missing:
        raise ValueError(f"policies: no policy plays env {env.name!r} role(s) {missing}; add them "
                         "to a policy's roles")
    check_engine(spec.rollout.engine)
    spec.rollout.validate("rollout")
    spec.dataflow.validate("dataflow")
    check_dataflow(spec.dataflow, env)
    spec.cluster.validate("cluster")
    check_cluster(spec.cluster, [p.policy_id for p in spec.policies])
    if spec.dataflow.synchronous:
        check_synchronous(spec)
    spec.eval.validate("eval")
    spec.weights.validate("weights")
    engine_dtype = spec.rollout.engine_args.get("dtype", "float32")
    if spec.weights.publish_dtype is not None and spec.weights.publish_dtype != engine_dtype:
        raise ValueError(f"weights.publish_dtype is {spec.weights.publish_dtype!r} but the engines "
                         f"run {engine_dtype!r} (rollout.engine_args.dtype): every sync would "
                         "fetch a delta the engine refuses and then the full state; publish in the "
                         "engines' dtype")
    return spec


def check_roles(p: PolicySpec, key: str, env: Env, seen: dict[str, str]) -> None:
    """The env has every role the policy plays, and no other policy plays it; records them in
    `seen`."""
    for role in p.roles:
        if role not in env.roles:
            raise ValueError(f"{key}.roles: env {env.name!r} has no role {role!r}; its roles are "
                             f"{list(env.roles)}")
        if role in seen:
            raise ValueError(f"{key}.roles: role {role!r} is already played by policy "
                             f"{seen[role]!r}")
        seen[role] = p.policy_id


def check_trainer_names(t: TrainerSpec, key: str) -> None:
    """`aggregation` and `loggers` name entries of the trainer's tables (importing them loads
    torch)."""
    from astratk.training.aggregation import AGGREGATIONS
    from astratk.training.loggers import check_loggers

    if t.aggregation not in AGGREGATIONS:
        raise ValueError(f"{key}.aggregation: unknown {t.aggregation!r}; choose one of "
                         f"{sorted(AGGREGATIONS)}")
    check_loggers(t.loggers, f"{key}.loggers")


def check_engine(name: str, key: str = "rollout.engine") -> None:
    """`rollout.engine` names a known engine whose packages are installed (workers share the
    client's environment)."""
    path = resolve_path("engine", name)
    if path == REGISTRY["engine"]["vllm"] and importlib.util.find_spec("vllm") is None:
        from astratk.engines._vllm_compat import INSTALL_HINT

        raise ValueError(f"{key}: {name!r} needs vLLM, which is not installed here: {INSTALL_HINT}")


def check_dataflow(d: DataflowSpec, env: Env, key: str = "dataflow") -> None:
    """The advantage is a known one, and `mixing` gives one ratio per source of the env."""
    from astratk.dataflow.advantages import get_advantage

    try:
        get_advantage(d.advantage)
    except ValueError as e:
        raise ValueError(f"{key}.advantage: {e}") from None
    if d.mixing is not None:
        # a MixtureEnv names its sources
        sources = list(getattr(env, "source_names", (env.name,)))
        unknown = sorted(set(d.mixing.ratios) - set(sources))
        missing = [s for s in sources if s not in d.mixing.ratios]
        if unknown or missing:
            raise ValueError(f"{key}.mixing.ratios: env {env.name!r} produces tasks of {sources}; "
                             f"ratios name {sorted(d.mixing.ratios)} (unknown {unknown}, missing "
                             f"{missing}); give one ratio per source (mix several envs with env: "
                             "{class_path: mixture})")


def check_cluster(c: ClusterSpec, policies: list[str], key: str = "cluster") -> None:
    """TLS credentials (the runtime's check), and local pools that carry every policy's rollout
    label and the score label."""
    if c.tls is not None or (c.scheduler_address or "").startswith("tls://"):
        # the one TLS check; connect() runs it too
        from astratk.runtime.cluster import check_tls

        check_tls(c)
    if c.pools and c.scheduler_address is None:
        labels = [f"rollout_{p}" for p in policies] + [SCORE_LABEL]
        missing = [r for r in labels
                   if not any(wc.count > 0 and (wc.resources is None or wc.resources.get(r, 0) > 0)
                              for wc in c.pools)]
        if missing:
            raise ValueError(f"{key}.pools: no worker carries {missing}; give a class resources: "
                             "null (every rollout label) or add them, e.g. resources: "
                             f"{{{', '.join(f'{r}: 1' for r in labels)}}}")


def check_synchronous(spec: RunSpec) -> None:
    """What `dataflow.synchronous: true` needs besides itself (max_staleness is then 0 whatever it
    says)."""
    c = spec.cluster
    workers = sum(wc.count for wc in c.pools) if c.pools else c.rollout_workers
    if workers != 1 or c.autoscale is not None:
        raise ValueError(f"dataflow.synchronous runs one rollout worker (got {workers} in "
                         "cluster.rollout_workers/"
                         f"pools{', and cluster.autoscale' if c.autoscale else ''}); set "
                         "cluster.rollout_workers: 1 and remove pools/autoscale, or turn "
                         "synchronous off")
    for i, p in enumerate(spec.policies):
        if p.trainer.publish_every != 1:
            raise ValueError(f"policies[{i}].trainer.publish_every is {p.trainer.publish_every}; "
                             "dataflow.synchronous trains step k on version k's rollouts, so it "
                             "must be 1")
