"""The checks a run makes as it starts, before it writes anything, of what only this machine and the run's files can
tell: a checkpoint to resume (`check_resume`), the model's layers that LoRA adapts (`check_lora`), an output
directory that takes a new run directory (`check_output_dir`), room on each GPU for everything placed there
(`check_gpu_memory`), and a frozen model's directory as resolved (`check_frozen_model`: nothing else ever loads it on
this machine before a rollout worker does). `Run(spec)` runs the first two after `spec.validate()`; `Run.start()` the last two. Each error
is one line naming the key to change.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from astratk.gpu import check_fit, cuda_visible_devices, gpu_index, resolve_device, rollout_gpus, visible_gpus
from astratk.registry import REGISTRY, resolve_path
from astratk.runtime.resume import checkpoint_time_used, find_resume_point, same_store
from astratk.spec import ModelSpec, RunSpec, StartError
from astratk.spec.model import is_hub_id, is_pypi_path
from astratk.training.placement import placement


def check_resume(spec: RunSpec) -> None:
    """`resume_from` names a checkpoint, its run's config and the data-layer snapshot paired with it
    (`astratk.runtime.resume.find_resume_point`, which only reads), so that a run that cannot resume fails before
    it writes anything."""
    if len(spec.policies) > 1:
        raise StartError("resume_from: resuming a multi-policy run is not supported yet; resume each policy's "
                         "trainer with `astratk train fit --ckpt_path ...` against a deployment restored from its "
                         "snapshot")
    try:
        point = find_resume_point(spec, spec.policies[0].policy_id)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a garbage index or config too
        message = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
        raise StartError(message if message.startswith("resume_from") else
                         f"resume_from: {spec.resume_from!r} cannot be resumed: {message}") from None
    ts, key = spec.policies[0].trainer, "policies[0].trainer"
    if point.step >= ts.max_steps:
        raise StartError(f"resume_from: the checkpoint is at step {point.step}, and {key}.max_steps is "
                         f"{ts.max_steps}: nothing is left to train; raise {key}.max_steps (it counts the steps "
                         "before the checkpoint too)")
    if ts.max_time_s is not None and (used := checkpoint_time_used(point.checkpoint)) >= ts.max_time_s:
        raise StartError(f"resume_from: the checkpoint has already trained for {used:.0f} s, and {key}.max_time_s "
                         f"is {ts.max_time_s:g}: nothing is left to train; raise {key}.max_time_s (it counts the "
                         "training time before the checkpoint too) or set it to null to train to max_steps")

    if spec.weights.url and same_store(spec.weights.url, point.store_url):
        raise StartError(f"weights.url: {spec.weights.url!r} is the weight store of the run being resumed; the "
                         "resumed run writes its own (leave weights.url unset for <run dir>/weights, or give a new "
                         "location), so that the run it continues keeps every version it published")


def check_lora(spec: RunSpec) -> None:
    """Each policy's `model.lora.target_modules` against its model's layers, for the tiny model and local
    directories; a Hub id, a GGUF file or a wheel is checked once the run has resolved it (`check_lora_at`), and
    every model again when its adapters are made."""
    for i, p in enumerate(spec.policies):
        m = p.model
        if m.path is None or not (m.is_gguf or is_hub_id(m.path) or is_pypi_path(m.path)):
            check_lora_at(m, f"policies[{i}].model")


def check_lora_at(model: ModelSpec, key: str, directory: str | Path | None = None) -> None:
    """One model's LoRA target modules against its layers (`astratk.models.lora`), from its config alone;
    `directory`: where it was resolved to (default: `model.path`). A `StartError`: one line at start."""
    if model.lora is None:
        return
    from astratk.models.lora import check_model_spec

    try:
        check_model_spec(model, key, directory)
    except ValueError as e:
        raise StartError(str(e)) from None


def check_frozen_model(directory: str | Path, key: str) -> None:
    """A frozen model's resolved directory holds what its engine loads: a config transformers reads, weights, and a
    tokenizer (an env talks to it in text). A policy's model is loaded here as the run publishes its version 0; a
    frozen model is not, so without this check a broken one would fail only in the workers' rollouts, chunk after
    chunk. A `StartError`: one line at start, naming `key`."""
    from transformers import AutoConfig

    from astratk.models.loading import load_tokenizer

    d = Path(directory)
    try:
        AutoConfig.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, the run cannot serve this model
        raise StartError(f"{key}: {d} cannot be loaded as a model: {type(e).__name__}: {str(e).splitlines()[0]}; "
                         "give a directory saved with save_pretrained, a Hub id or a GGUF file") from None
    if not any(d.glob("*.safetensors")):
        raise StartError(f"{key}: {d} holds no weights (*.safetensors, which astratk loads); a frozen model is "
                         "served as saved, so save it with save_pretrained")
    try:
        tokenizer = load_tokenizer(d)
    except Exception as e:  # noqa: BLE001 - a tokenizer that fails its round trip, or does not load at all
        raise StartError(f"{key}: the tokenizer in {d} cannot be used: {type(e).__name__}: "
                         f"{str(e).splitlines()[0]}") from None
    if tokenizer is None:
        raise StartError(f"{key}: {d} holds no tokenizer; the env talks to a frozen model in text, so save its "
                         "tokenizer beside it (tokenizer.save_pretrained)")


def check_output_dir(spec: RunSpec) -> None:
    """Before a run writes anything: `output_dir` can take a new run directory. Every part of it that exists is a
    directory, and the deepest existing one accepts a new entry (tried with a directory made and removed at once:
    permission bits do not tell for root, read-only mounts or ACLs). Not in `validate`: a trainer job or
    `astratk status` reads the same spec on a machine that writes nothing there."""
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
        where = "" if existing == target else f" (its nearest existing part is {str(existing)!r})"
        raise StartError(f"output_dir: cannot create a run directory in {str(target)!r}{where}: "
                         f"{e.strerror or e}; give a directory you can write to") from None


def check_gpu_memory(spec: RunSpec, trainers_here: bool = True) -> None:
    """Before a local run writes anything: its trainers can be placed here (a GPU asked for and
    absent, bf16 on a GPU without it: `astratk.training.placement.placement`), and on each GPU of this
    machine the memory fractions of everything the run places there fit (`astratk.gpu.check_fit`:
    sum <= 1, and within what is free now). Counted: each policy's `trainer.gpu_memory_fraction` on its trainer's GPUs (when the
    trainers run here: not for `astratk deploy`), and `rollout.engine_args.gpu_memory_utilization`
    for every engine of every local rollout worker on its engine's GPU: one rollout and one
    evaluation engine per policy (vLLM's default 0.9 when unset, as vLLM takes it). Fractions left
    unset are not capped, and not counted. Not at start time in `validate`: a trainer job checks
    its spec after the rollout workers took their memory."""
    import torch

    shares: dict[int, list[tuple[str, float]]] = {}
    try:  # one line at start, before anything is written (the CLI prints a StartError alone)
        if trainers_here:
            for index, what, fraction in _trainer_shares(spec):
                shares.setdefault(index, []).append((what, fraction))
        if not torch.cuda.is_available():
            return
        if spec.cluster.scheduler_address is None:  # a local cluster's workers
            for index, what, fraction in _engine_shares(spec):
                shares.setdefault(index, []).append((what, fraction))
        for index in sorted(shares):
            check_fit(index, shares[index])
    except ValueError as e:
        raise StartError(str(e)) from None


def _trainer_shares(spec: RunSpec) -> list[tuple[int, str, float]]:
    """(GPU index, key, fraction) of each policy's trainer that runs on a GPU with a fraction set:
    Lightning's first `devices` GPUs. Every trainer's placement is resolved here
    (`astratk.training.placement.placement`), so that its errors come before anything is written."""
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
