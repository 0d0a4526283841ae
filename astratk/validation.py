"""`validate(spec)`: a `RunSpec`'s checks before anything starts; each error names the key to change
and the fix.

`astratk.spec` holds plain dataclasses that check their own fields (`validate(key)`). This module
runs those and adds what one dataclass cannot know:
- rules between fields: every env role played by exactly one policy, `dataflow.mixing` naming the
  env's sources, the synchronous mode's cluster and publish cadence, pool labels for every policy,
  `rollout.group_size` >= 2 where groups of one cannot train (zero-variance filter, group advantages),
  `weights.publish_dtype` against the engines' dtype;
- what the machine has, for a local cluster (`astratk.gpu`): `rollout.engine_args.device` / `.dtype` (a GPU asked
  for and absent, bf16 on a GPU without it), `cluster.rollout_gpus`; and, once a run starts (`check_gpu_memory`),
  whether the memory fractions of everything that shares a GPU fit;
- what the files say: `resume_from` (a checkpoint torch can read, its run's config, the snapshot paired with it:
  `check_resume`, reading only), and, once a run starts, `output_dir` (`check_output_dir`);
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
        check_lora(p, key)
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
    check_cluster(spec.cluster, [p.policy_id for p in spec.policies])
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
    if spec.resume_from:
        check_resume(spec)
    return spec


def check_name(name: str) -> None:
    """`name` starts the run directory's name (`<output_dir>/<name>-<time>`): one path component."""
    if not isinstance(name, str) or not name.strip() or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"name: {name!r} must be a non-empty name without '/' or '\\' (it names the run "
                         "directory <output_dir>/<name>-<time>), e.g. quickstart")


def check_resume(spec: RunSpec) -> None:
    """`resume_from` names a checkpoint, its run's config and the data-layer snapshot paired with it
    (`astratk.runtime.session.find_resume_point`, which only reads), so that a run that cannot resume fails before
    it writes anything."""
    if len(spec.policies) > 1:
        raise ValueError("resume_from: resuming a multi-policy run is not supported yet; resume each policy's "
                         "trainer with `astratk train fit --ckpt_path ...` against a deployment restored from its "
                         "snapshot")
    from astratk.runtime.session import find_resume_point

    try:
        point = find_resume_point(spec, spec.policies[0].policy_id)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a garbage index or config too
        message = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
        raise ValueError(message if message.startswith("resume_from") else
                         f"resume_from: {spec.resume_from!r} cannot be resumed: {message}") from None
    from astratk.runtime.session import checkpoint_time_used, same_store

    ts, key = spec.policies[0].trainer, "policies[0].trainer"
    if point.step >= ts.max_steps:
        raise ValueError(f"resume_from: the checkpoint is at step {point.step}, and {key}.max_steps is "
                         f"{ts.max_steps}: nothing is left to train; raise {key}.max_steps (it counts the steps "
                         "before the checkpoint too)")
    if ts.max_time_s is not None and (used := checkpoint_time_used(point.checkpoint)) >= ts.max_time_s:
        raise ValueError(f"resume_from: the checkpoint has already trained for {used:.0f} s, and {key}.max_time_s "
                         f"is {ts.max_time_s:g}: nothing is left to train; raise {key}.max_time_s (it counts the "
                         "training time before the checkpoint too) or set it to null to train to max_steps")

    if spec.weights.url and same_store(spec.weights.url, point.store_url):
        raise ValueError(f"weights.url: {spec.weights.url!r} is the weight store of the run being resumed; the "
                         "resumed run writes its own (leave weights.url unset for <run dir>/weights, or give a new "
                         "location), so that the run it continues keeps every version it published")


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


def check_lora(p: PolicySpec, key: str) -> None:
    """`model.lora.target_modules` against the model's layers (`astratk.models.lora`), from its
    config alone, for the tiny model and local directories; a Hub id is checked once the run has
    resolved it (`astratk.runtime.run`), and every model again when its adapters are made."""
    if p.model.lora is None:
        return
    from astratk.models.hub import is_hub_id

    if p.model.path is not None and (p.model.is_gguf or is_hub_id(p.model.path)):
        return  # checked once the run has resolved (downloaded, dequantized) it
    from astratk.models.lora import check_model_spec

    check_model_spec(p.model, f"{key}.model")


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


def check_engine_adapters(name: str, lora_key: str, key: str = "rollout.engine") -> None:
    """An engine that serves LoRA policies must apply adapters (`add_adapter`:
    `astratk.engines.adapters`)."""
    from astratk.registry import resolve

    cls = resolve("engine", name)
    if not callable(getattr(cls, "add_adapter", None)):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
            f"{key}: {name!r} ({cls.__qualname__}) cannot apply LoRA adapters, and {lora_key} is "
            f"set; use rollout.engine: torch or vllm, or remove {lora_key}")


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


def check_group_size(spec: RunSpec, key: str = "rollout.group_size") -> None:
    """A group of one sample has zero reward variance: the zero-variance filter drops every such group, and a group
    advantage (`astratk.dataflow.advantages.needs_group`) gives it 0, so the trainer would wait for a batch that
    never comes while rollouts spin. Groups of one are allowed only with an advantage that learns from one sample
    and no zero-variance filter."""
    if spec.rollout.group_size >= 2:
        return
    from astratk.dataflow.advantages import get_advantage, needs_group
    from astratk.dataflow.stages.filters import ZeroVariance

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


def _local(spec: RunSpec) -> bool:
    """Whether the run's rollout workers start on this machine (a local cluster)."""
    return spec.cluster.scheduler_address is None


def check_engine_placement(spec: RunSpec, key: str = "rollout.engine_args") -> str | None:
    """The torch engine's `device`, `dtype` and `gpu_memory_utilization`, resolved on this machine
    when the workers start here (`astratk.gpu`), only their form otherwise (a cluster's workers have
    their own GPUs); and `cluster.rollout_gpus` against the GPUs here. Returns the dtype the
    engines will run (None: not known here: auto on a cluster of your own)."""
    from astratk import gpu

    args = spec.rollout.engine_args
    if spec.cluster.rollout_gpus is not None and _local(spec):
        gpu.rollout_gpus(spec.cluster.rollout_gpus)  # they exist here
    gpu.check_fraction(args.get("gpu_memory_utilization"), f"{key}.gpu_memory_utilization")
    if resolve_path("engine", spec.rollout.engine) != REGISTRY["engine"]["torch"]:
        dtype = args.get("dtype", "float32")  # other engines' own default (vLLM's wrapper: float32)
        if dtype != "auto":
            return dtype
        import torch  # vLLM's auto: the GPU's native bf16 when it has one, as TorchEngine decides

        return gpu.resolve_dtype("auto", "cuda" if torch.cuda.is_available() else "cpu") if _local(spec) else None
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
    return None if dtype == "auto" else dtype


def check_synchronous(spec: RunSpec) -> None:
    """What `dataflow.synchronous: true` needs besides itself (max_staleness is then 0 whatever it
    says)."""
    c = spec.cluster
    workers = sum(wc.count for wc in c.pools) if c.pools else c.rollout_workers
    if c.rollout_gpus is not None:  # one worker per GPU (a local cluster only: ClusterSpec.validate)
        from astratk.gpu import rollout_gpus

        workers = len(rollout_gpus(c.rollout_gpus))
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


# ------------------------------------------------------------------------------------- at a run's start


def check_output_dir(spec: RunSpec) -> None:
    """Before a run writes anything: `output_dir` can take a new run directory. Every part of it that exists is a
    directory, and the deepest existing one accepts a new entry (tried with a directory made and removed at once:
    permission bits do not tell for root, read-only mounts or ACLs). Not in `validate`: a trainer job or
    `astratk status` reads the same spec on a machine that writes nothing there."""
    import os
    import tempfile
    from pathlib import Path

    from astratk.spec import StartError

    target = Path(spec.output_dir).expanduser().resolve()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == target else f" (a part of {str(target)!r})"
        raise StartError(f"output_dir: {str(existing)!r}{where} is a file, not a directory; give the directory "
                         "that should hold the run directories (default: runs)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".astratk-write-check-", dir=existing))
    except OSError as e:
        raise StartError(f"output_dir: cannot create a run directory in {str(existing)!r} ({e.strerror or e}); "
                         "give a directory you can write to") from None


def check_gpu_memory(spec: RunSpec, trainers_here: bool = True) -> None:
    """Before a local run writes anything: its trainers can be placed here (a GPU asked for and
    absent, bf16 on a GPU without it: `astratk.training.build.placement`), and on each GPU of this
    machine the memory fractions of everything the run places there fit (`astratk.gpu.check_fit`:
    sum <= 1, and within what is free now). Counted: each policy's `trainer.gpu_memory_fraction` on its trainer's GPUs (when the
    trainers run here: not for `astratk deploy`), and `rollout.engine_args.gpu_memory_utilization`
    for every engine of every local rollout worker on its engine's GPU: one rollout and one
    evaluation engine per policy (vLLM's default 0.9 when unset, as vLLM takes it). Fractions left
    unset are not capped, and not counted. Not at start time in `validate`: a trainer job checks
    its spec after the rollout workers took their memory."""
    import torch

    from astratk.gpu import check_fit
    from astratk.spec import StartError

    shares: dict[int, list[tuple[str, float]]] = {}
    try:  # one line at start, before anything is written (the CLI prints a StartError alone)
        if trainers_here:
            for index, what, fraction in _trainer_shares(spec):
                shares.setdefault(index, []).append((what, fraction))
        if not torch.cuda.is_available():
            return
        if _local(spec):
            for index, what, fraction in _engine_shares(spec):
                shares.setdefault(index, []).append((what, fraction))
        for index in sorted(shares):
            check_fit(index, shares[index])
    except ValueError as e:
        raise StartError(str(e)) from None


def _trainer_shares(spec: RunSpec) -> list[tuple[int, str, float]]:
    """(GPU index, key, fraction) of each policy's trainer that runs on a GPU with a fraction set:
    Lightning's first `devices` GPUs. Every trainer's placement is resolved here
    (`astratk.training.build.placement`), so that its errors come before anything is written."""
    from astratk.training.build import placement

    out = []
    for i, p in enumerate(spec.policies):
        key = f"policies[{i}].trainer"
        flags = placement(p.trainer, key)
        if p.trainer.gpu_memory_fraction is not None and flags["accelerator"] == "gpu":
            out += [(g, f"{key}.gpu_memory_fraction", p.trainer.gpu_memory_fraction)
                    for g in range(flags["devices"])]
    return out


def _engine_shares(spec: RunSpec) -> list[tuple[int, str, float]]:
    """(GPU index here, what, fraction) of the engines of the local cluster's rollout workers."""
    from astratk.gpu import cuda_visible_devices, gpu_index, resolve_device, rollout_gpus, visible_gpus

    args, engine = spec.rollout.engine_args, resolve_path("engine", spec.rollout.engine)
    fraction = args.get("gpu_memory_utilization")
    if engine == REGISTRY["engine"]["vllm"]:
        device, label = "cuda:0", "rollout.engine_args.gpu_memory_utilization"
        if fraction is None:
            fraction, label = 0.9, "vLLM's default gpu_memory_utilization"
    elif engine == REGISTRY["engine"]["torch"] and fraction is not None:
        device, label = args.get("device", "auto"), "rollout.engine_args.gpu_memory_utilization"
        device = resolve_device("cuda:0" if spec.cluster.rollout_gpus and device == "auto" else device)
    else:
        return []
    if not device.startswith("cuda"):
        return []
    engines = 2 * len(spec.policies)  # a rollout and an evaluation engine per policy, per worker
    what = f"{engines} engines x {label}"
    k, here = gpu_index(device), visible_gpus()
    if spec.cluster.rollout_gpus is not None:  # worker i sees the list rotated; its cuda:k is ...
        gpus = rollout_gpus(spec.cluster.rollout_gpus)
        return [(here.index(cuda_visible_devices(i, gpus).split(",")[k]), f"rollout-{i}: {what}",
                 engines * fraction) for i in range(len(gpus))]
    workers = sum(wc.count for wc in spec.cluster.pools  # the classes that serve rollouts
                  if wc.resources is None or any(r.startswith("rollout_") for r in wc.resources))
    workers = workers if spec.cluster.pools else spec.cluster.rollout_workers
    return [(k, f"{workers} rollout worker(s) x {what}", workers * engines * fraction)]
