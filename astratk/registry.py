"""Short names for plug-ins: explicit dicts of short name -> dotted path.

A config may name a plug-in by short name (`drpo`) or by any dotted path (`mypkg.losses.MyLoss`). Adding a built-in
is one line here; user code never needs to register anything, it just uses its dotted path.

A fixed set of modes that is not a plug-in (an aggregation, a KL estimator, a logger kind with its install hint) is
checked with `check_choice`, so every unknown name, plug-in or not, fails the same way: with the sorted choices.

Example:
    >>> resolve_path("loss", "drpo")
    'astratk.losses.drpo.DRPO'
    >>> check_choice("KL estimator", "k2", ("k1", "k3"))
    Traceback (most recent call last):
    ...
    ValueError: unknown KL estimator 'k2'; choose one of ['k1', 'k3']
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

REGISTRY: dict[str, dict[str, str]] = {
    "loss": {
        "drpo": "astratk.losses.drpo.DRPO",
        "ppo_clip": "astratk.losses.ppo_clip.PPOClip",
        "grpo": "astratk.losses.ppo_clip.PPOClip",
        "pg_is": "astratk.losses.pg_is.PGIS",
        "cispo": "astratk.losses.cispo.CISPO",
        "spo": "astratk.losses.spo.SPO",
        "gspo": "astratk.losses.gspo.GSPO",
        "gspo_token": "astratk.losses.gspo.GSPOToken",
        "luspo": "astratk.losses.gspo.LUSPO",
        "sapo": "astratk.losses.sapo.SAPO",
        "m2po": "astratk.losses.m2po.M2PO",
        "m2po_clip": "astratk.losses.m2po.M2POClip",
        "dppo_tv": "astratk.losses.dppo.DPPO",
        "dppo_kl": "astratk.losses.dppo.DPPOBinaryKL",
        "dppo_topk_tv": "astratk.losses.dppo.DPPOTopKTV",
        "dppo_topk_kl": "astratk.losses.dppo.DPPOTopKKL",
        "decoupled_ppo": "astratk.losses.decoupled_ppo.DecoupledPPO",
        "gpg": "astratk.losses.gpg.GPG",
        "gmpo": "astratk.losses.gmpo.GMPO",
        "clip_cov": "astratk.losses.cov.ClipCov",
        "kl_cov": "astratk.losses.cov.KLCov",
        "dro": "astratk.losses.dro.DRO",
        "vespo": "astratk.losses.vespo.VESPO",
    },
    "env": {
        "arithmetic": "astratk.envs.math.arithmetic.ArithmeticEnv",
        "math_word": "astratk.envs.math.word.WordProblemEnv",
        "math_jsonl": "astratk.envs.math.jsonl.MathJsonlEnv",
        "solver_verifier": "astratk.envs.workflows.solver_verifier.SolverVerifierEnv",
        "solver_testgen": "astratk.envs.workflows.solver_testgen.SolverTestGenEnv",
        "judged": "astratk.envs.workflows.judged.JudgedEnv",
        "simulated_user": "astratk.envs.simulated_user.SimulatedUserEnv",
        "search": "astratk.envs.search.env.SearchEnv",
        "code": "astratk.envs.code.env.CodeEnv",
        "household": "astratk.envs.agentbench.household.HouseholdEnv",
        "db": "astratk.envs.agentbench.db.DatabaseEnv",
        "mixture": "astratk.envs.mixture.MixtureEnv",
        "function": "astratk.envs.function.FunctionEnv",
        "agent": "astratk.envs.agent.AgentEnv",
    },
    "correction": {
        "tis": "astratk.losses.corrections.TIS",
        "mis": "astratk.losses.corrections.MIS",
        "icepop": "astratk.losses.corrections.MIS",
    },
    "stage": {  # data-layer stages (astratk.dataflow.stages): curators, filters, serving order, replay, mixing
        "accept_all": "astratk.dataflow.stages.curators.AcceptAll",
        "filter_solved": "astratk.dataflow.stages.curators.FilterSolved",
        "greso": "astratk.dataflow.stages.curators.GRESO",
        "curriculum": "astratk.dataflow.stages.curators.PassRateCurriculum",
        "zero_variance": "astratk.dataflow.stages.filters.ZeroVariance",
        "length_filter": "astratk.dataflow.stages.filters.LengthFilter",
        "format_filter": "astratk.dataflow.stages.filters.FormatFilter",
        "fifo": "astratk.dataflow.stages.serving.FIFO",
        "edf": "astratk.dataflow.stages.serving.EDF",
        "replay": "astratk.dataflow.stages.serving.Replay",
        "mixing": "astratk.dataflow.stages.serving.Mixing",
    },
    "engine": {
        "torch": "astratk.engines.torch_engine.TorchEngine",
        "scripted": "astratk.engines.scripted.ScriptedEngine",
        "vllm": "astratk.engines.vllm_engine.VLLMEngine",
    },
    "advantage": {  # group advantages (astratk.dataflow.advantages): functions rewards -> advantages
        "dr_grpo": "astratk.dataflow.advantages.dr_grpo",
        "grpo": "astratk.dataflow.advantages.grpo",
        "rloo": "astratk.dataflow.advantages.rloo",
    },
}


def check_choice(what: str, name: str, choices: Iterable[str], hint: str = "", *, where: str = "") -> str:
    """`name` when it is one of `choices`, else a ValueError "<where>: unknown <what> <name>; choose one of <sorted
    choices>" followed by `hint` (e.g. " (k3 is the default)"); `where` names the source (a config key), if any."""
    options = sorted(choices)
    if name not in options:
        raise ValueError(f"{where + ': ' if where else ''}unknown {what} {name!r}; choose one of {options}{hint}")
    return name


def resolve_path(kind: str, name: str) -> str:
    """Short name -> dotted path; a dotted path passes through; anything else raises with the choices."""
    table = REGISTRY[check_choice("plug-in kind", kind, REGISTRY)]
    if name in table:
        return table[name]
    if "." in name:
        return name
    return check_choice(kind, name, table, " or give a dotted path 'pkg.module.Name'")  # not in it: raises


def import_object(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not a dotted path 'pkg.module.Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} for {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None


def resolve(kind: str, name: str) -> Any:
    return import_object(resolve_path(kind, name))
