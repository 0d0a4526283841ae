"""The rules between a `RunSpec`'s sections, run by `RunSpec.validate()` after each section has checked its own
fields; each error names the key to change and the fix.

In the order a run needs them: the run's own fields (name, metrics cadence, the env, at least one policy); each
policy (its sections, the env roles it plays, its trainer's names); the rollout engine (known, installed, able to
apply LoRA adapters where a policy has them); the data layer (its advantage and mixing against the env, group sizes
that can train); the cluster (TLS credentials, pools carrying every policy's label); the synchronous mode's needs;
the weights (a lag the store and the staleness bound allow) and the engines' placement and dtype on this machine
(`astratk.gpu`: for a local cluster, a GPU asked for and absent, bf16 on a GPU without it).

Only what the spec says, and this machine's packages and GPUs, are read here. What needs the files a run starts from
(a checkpoint to resume, the model's layers for LoRA, a writable output directory, room on each GPU) is checked as
the run starts (`astratk.runtime.checks`).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from astratk import gpu
from astratk._addons import VLLM_INSTALL_HINT
from astratk.contracts import Env
from astratk.dataflow.advantages import get_advantage, needs_group
from astratk.dataflow.stages.filters import ZeroVariance
from astratk.registry import REGISTRY, resolve, resolve_path
from astratk.spec.cluster import SCORE_LABEL, check_tls
from astratk.spec.trainer import AGGREGATIONS, check_loggers

if TYPE_CHECKING:
    from astratk.spec.cluster import ClusterSpec
    from astratk.spec.dataflow import DataflowSpec
    from astratk.spec.run import PolicySpec, RunSpec
    from astratk.spec.trainer import TrainerSpec


def validate(spec: RunSpec) -> RunSpec:
    """Every check of the spec (its plug-ins are built already); returns it, or raises
    ValueError."""
    check_name(spec.name)
    every = spec.metrics_every_s
    if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float))
                              or not 0 < every < float("inf")):
        raise ValueError(f"metrics_every_s: give seconds > 0 (or null: write metrics.nc at the end only), got "
                         f"{spec.metrics_every_s!r}")
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
    check_frozen(spec, env, seen)
    missing = [r for r in env.roles if r not in seen]
    if missing:
        raise ValueError(f"policies: no policy plays env {env.name!r} role(s) {missing}; add them "
                         "to a policy's roles")
    check_engine(spec.rollout.engine)
    if lora := [i for i, p in enumerate(spec.policies) if p.model.lora is not None]:
        check_engine_adapters(spec.rollout.engine, f"policies[{lora[0]}].model.lora")
    spec.rollout.validate("rollout")
    spec.dataflow.validate("dataflow")
    check_dataflow(spec.dataflow, env)
    check_group_size(spec)
    spec.cluster.validate("cluster")
    check_cluster(spec.cluster, spec.served_ids())
    if spec.dataflow.synchronous:
        check_synchronous(spec)
    spec.eval.validate("eval")
    spec.weights.validate("weights")
    check_weight_lag(spec)
    engine_dtype = check_engine_placement(spec)
    if (spec.weights.publish_dtype is not None and engine_dtype is not None
            and spec.weights.publish_dtype != engine_dtype):
        raise ValueError(f"weights.publish_dtype is {spec.weights.publish_dtype!r} but the engines "
                         f"run {engine_dtype!r} (rollout.engine_args.dtype): every sync would "
                         "fetch a delta the engine refuses and then the full state; publish in the "
                         "engines' dtype")
    return spec


def check_name(name: str) -> None:
    """`name` starts the run directory's name (`<output_dir>/<name>-<time>`): one path component."""
    if not isinstance(name, str) or not name.strip() or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"name: {name!r} must be a non-empty name without '/' or '\\' (it names the run "
                         "directory <output_dir>/<name>-<time>), e.g. quickstart")


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


def check_frozen(spec: RunSpec, env: Env, seen: dict[str, str]) -> None:
    """Each frozen model: its own fields, a name no policy has, roles the env has and no one else plays, an engine
    that is installed; and the env's first role (the one accuracy and curricula read) is a trained policy's."""
    ids = {p.policy_id for p in spec.policies}
    names: set[str] = set()
    for i, f in enumerate(spec.frozen):
        key = f"frozen[{i}]"
        f.validate(key)
        if f.name in ids or f.name in names:
            raise ValueError(f"{key}.name: {f.name!r} is already the name of a "
                             f"{'policy' if f.name in ids else 'frozen model'}; give each model its own name")
        names.add(f.name)
        for role in f.roles:
            if role not in env.roles:
                raise ValueError(f"{key}.roles: env {env.name!r} has no role {role!r}; its roles are "
                                 f"{list(env.roles)}")
            if role in seen:
                raise ValueError(f"{key}.roles: role {role!r} is already played by {seen[role]!r}")
            seen[role] = f.name
        if f.engine is not None:
            check_engine(f.engine, f"{key}.engine")
    if spec.frozen and seen.get(env.roles[0]) in names:
        raise ValueError(f"frozen: env {env.name!r}'s first role {env.roles[0]!r} (the one held-out accuracy and "
                         "curricula read) is played by a frozen model; a trained policy must play it")


def check_trainer_names(t: TrainerSpec, key: str) -> None:
    """`aggregation` and `loggers` name entries of the trainer's tables."""
    if t.aggregation not in AGGREGATIONS:
        raise ValueError(f"{key}.aggregation: unknown {t.aggregation!r}; choose one of "
                         f"{sorted(AGGREGATIONS)}")
    check_loggers(t.loggers, f"{key}.loggers")


def check_engine(name: str, key: str = "rollout.engine") -> None:
    """`rollout.engine` names a known engine whose packages are installed (workers share the
    client's environment)."""
    try:
        path = resolve_path("engine", name)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    if path == REGISTRY["engine"]["vllm"] and importlib.util.find_spec("vllm") is None:
        raise ValueError(f"{key}: {name!r} needs vLLM, which is not installed here: {VLLM_INSTALL_HINT}")


def check_engine_adapters(name: str, lora_key: str, key: str = "rollout.engine") -> None:
    """An engine that serves LoRA policies must apply adapters (`add_adapter`:
    `astratk.engines.adapters`)."""
    cls = resolve("engine", name)
    if not callable(getattr(cls, "add_adapter", None)):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
            f"{key}: {name!r} ({cls.__qualname__}) cannot apply LoRA adapters, and {lora_key} is "
            f"set; use rollout.engine: torch or vllm, or remove {lora_key}")


def check_dataflow(d: DataflowSpec, env: Env, key: str = "dataflow") -> None:
    """The advantage is a known one, and `mixing` gives one ratio per source of the env."""
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


def check_group_size(spec: RunSpec, key: str = "rollout.group_size") -> None:
    """A group of one sample has zero reward variance: the zero-variance filter drops every such group, and a group
    advantage (`astratk.dataflow.advantages.needs_group`) gives it 0, so the trainer would wait for a batch that
    never comes while rollouts spin. Groups of one are allowed only with an advantage that learns from one sample
    and no zero-variance filter."""
    if spec.rollout.group_size >= 2:
        return
    d, n = spec.dataflow, spec.rollout.group_size
    if d.filter_zero_variance or any(isinstance(f, ZeroVariance) for f in d.filters):
        raise ValueError(f"{key} is {n}: every group of one sample has zero reward variance, so the zero-variance "
                         "filter (dataflow.filter_zero_variance / filters) drops every group and the trainer never "
                         "gets a batch; use group_size >= 2 (e.g. 8)")
    if needs_group(get_advantage(d.advantage)):
        raise ValueError(f"{key} is {n}: dataflow.advantage {d.advantage!r} compares each sample with the rest of "
                         "its group, so every group of one sample gets advantage 0 and nothing trains; use "
                         "group_size >= 2 (e.g. 8), or an advantage that learns from one sample")


def check_cluster(c: ClusterSpec, policies: list[str], key: str = "cluster") -> None:
    """TLS credentials (the runtime's check), and local pools that carry every policy's rollout
    label and the score label."""
    if c.tls is not None or (c.scheduler_address or "").startswith("tls://"):
        check_tls(c)  # the one TLS check; connect() runs it too
    if c.pools and c.scheduler_address is None:
        labels = [f"rollout_{p}" for p in policies] + [SCORE_LABEL]
        missing = [r for r in labels
                   if not any(wc.count > 0 and (wc.resources is None or wc.resources.get(r, 0) > 0)
                              for wc in c.pools)]
        if missing:
            raise ValueError(f"{key}.pools: no worker carries {missing}; give a class resources: "
                             "null (every rollout label) or add them, e.g. resources: "
                             f"{{{', '.join(f'{r}: 1' for r in labels)}}}")


def _local(spec: RunSpec) -> bool:
    """Whether the run's rollout workers start on this machine (a local cluster)."""
    return spec.cluster.scheduler_address is None


def check_engine_placement(spec: RunSpec, key: str = "rollout.engine_args") -> str | None:
    """The torch engine's `device`, `dtype` and `gpu_memory_utilization`, resolved on this machine
    when the workers start here (`astratk.gpu`), only their form otherwise (a cluster's workers have
    their own GPUs); and `cluster.rollout_gpus` against the GPUs here. Returns the dtype the
    engines will run (None: not known here: auto on a cluster of your own)."""
    args = spec.rollout.engine_args
    if spec.cluster.rollout_gpus is not None and _local(spec):
        gpu.rollout_gpus(spec.cluster.rollout_gpus)  # they exist here
    gpu.check_fraction(args.get("gpu_memory_utilization"), f"{key}.gpu_memory_utilization")
    if resolve_path("engine", spec.rollout.engine) != REGISTRY["engine"]["torch"]:
        dtype = args.get("dtype", "float32")  # other engines' own default (vLLM's wrapper: float32)
        if dtype not in ("auto", "bfloat16-if-native"):
            return dtype
        import torch  # vLLM's auto: the GPU's native bf16 when it has one, as TorchEngine decides

        return gpu.resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu") if _local(spec) else None
    device, dtype = args.get("device", "auto"), args.get("dtype", "auto")
    if _local(spec):
        if spec.cluster.rollout_gpus is not None and device == "auto":
            device = "cuda:0"  # each worker's own GPU
        resolved = gpu.resolve_device(device, f"{key}.device")
        if spec.cluster.rollout_gpus is not None and resolved.startswith("cuda"):
            seen = len(gpu.rollout_gpus(spec.cluster.rollout_gpus))
            if int(resolved.split(":")[1]) >= seen:
                raise ValueError(f"{key}.device is {device!r} but each rollout worker sees the {seen} GPU(s) "
                                 "of cluster.rollout_gpus, its own as cuda:0; use auto or cuda:0")
        return gpu.resolve_dtype(dtype, resolved, f"{key}.dtype")
    gpu.check_device_form(device, f"{key}.device")
    if dtype not in gpu.ENGINE_DTYPES:
        gpu.resolve_dtype(dtype, "cpu", f"{key}.dtype")  # raises, naming the choices
    return None if dtype in ("auto", "bfloat16-if-native") else dtype  # decided on each worker


def check_synchronous(spec: RunSpec) -> None:
    """What `dataflow.synchronous: true` needs besides itself (max_staleness is then 0 whatever it
    says)."""
    c = spec.cluster
    workers = sum(wc.count for wc in c.pools) if c.pools else c.rollout_workers
    if c.rollout_gpus is not None:  # one worker per GPU (a local cluster only: ClusterSpec.validate)
        workers = len(gpu.rollout_gpus(c.rollout_gpus))
    if workers != 1 or c.autoscale is not None:
        raise ValueError(f"dataflow.synchronous runs one rollout worker (got {workers} in "
                         "cluster.rollout_workers/pools/"
                         f"rollout_gpus{', and cluster.autoscale' if c.autoscale else ''}); set "
                         "cluster.rollout_workers: 1 and remove pools/autoscale, or turn "
                         "synchronous off")
    for i, p in enumerate(spec.policies):
        if p.trainer.publish_every != 1:
            raise ValueError(f"policies[{i}].trainer.publish_every is {p.trainer.publish_every}; "
                             "dataflow.synchronous trains step k on version k's rollouts, so it "
                             "must be 1")


def check_weight_lag(spec: RunSpec) -> None:
    """`rollout.weight_lag` L: the store must still hold version newest - L, every sample is at least L versions
    stale (so the staleness bound must admit it), and the synchronous mode trains version k on version k's
    rollouts, which a lag contradicts."""
    if spec.dataflow.synchronous and spec.rollout.poll_s is not None:
        raise ValueError(f"rollout.weight_updates is {spec.rollout.weight_updates} with weight_poll_s "
                         f"{spec.rollout.poll_s}, but dataflow.synchronous trains step k on version k's rollouts, "
                         "which a weight load during a chunk contradicts; set weight_updates: between_requests and "
                         "weight_poll_s: null, or use the asynchronous mode")
    lag = spec.rollout.weight_lag
    if not lag:
        return
    if spec.dataflow.synchronous:
        raise ValueError(f"rollout.weight_lag is {lag} but dataflow.synchronous trains step k on version k's "
                         "rollouts; use the asynchronous mode for a forced lag, or weight_lag: 0")
    keep = spec.weights.keep_last
    if keep is not None and keep <= lag:
        raise ValueError(f"rollout.weight_lag is {lag} but weights.keep_last is {keep}: the store would have "
                         f"deleted the version the rollouts ask for; set weights.keep_last to at least {lag + 1}")
    for i, p in enumerate(spec.policies):
        bound = spec.dataflow.max_staleness if p.trainer.max_staleness is None else p.trainer.max_staleness
        if bound is not None and bound < lag:
            raise ValueError(f"rollout.weight_lag is {lag} but policies[{i}]'s staleness bound is {bound} "
                             f"(dataflow.max_staleness / trainer.max_staleness): every sample would be dropped "
                             f"as stale; set the bound to at least {lag}, e.g. {lag + 2}")
