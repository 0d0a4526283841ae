"""The TRL side of `bench/vs_trl.py`: `GRPOConfig`'s arguments, the TRL run itself (`--trl-child`: GRPOTrainer in a
process of its own, which keeps its training clock and snapshots) and the parent's runner that starts it and evaluates
what it kept."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _vs_trl_astratk import _pairs, _scalar
from _vs_trl_eval import HeldOut

START_ENV = dict(os.environ)  # the TRL process gets this, not what the parent's environment has become
SCRIPT = Path(__file__).resolve().parent / "vs_trl.py"  # the TRL process re-runs the bench's command line


def trl_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """GRPOConfig's arguments: the brief's fixed ones, TRL 1.16's defaults otherwise, then --trl-set."""
    fields = {
        "output_dir": cfg["out"] + "/trl", "loss_type": "dr_grpo", "learning_rate": cfg["lr"], "seed": cfg["seed"],
        # astratk's run shape (`shape`): prompts x samples per optimizer step (generation_batch_size defaults to
        # it), completion length, temperature; the quickstart's: 16 x 8 = 128 completions, 8 tokens, T = 1 (a shape
        # may split a step into micro-batches: per_device_train_batch_size x gradient_accumulation_steps)
        "gradient_accumulation_steps": 1, **cfg["shape"],
        "use_cpu": True, "bf16": False, "report_to": "none",
        "save_strategy": "no", "logging_steps": 10, "disable_tqdm": True,
        # the callback stops training at --seconds; a linear decay over 10^7 steps is constant in practice
        "max_steps": 10_000_000,
        # TRL's GRPOConfig turns gradient checkpointing on by default (a memory saving that recomputes activations
        # in the backward pass); a model this small never needs it, and off it only makes TRL faster
        "gradient_checkpointing": False,
    }
    fields.update(cfg["trl_set"])
    return fields


TRL_FIELDS = ("loss_type", "learning_rate", "seed", "per_device_train_batch_size", "num_generations",
              "generation_batch_size", "steps_per_generation", "gradient_accumulation_steps", "max_completion_length",
              "temperature", "top_p", "top_k", "beta", "epsilon", "epsilon_high", "num_iterations", "scale_rewards",
              "mask_truncated_completions", "importance_sampling_level", "gradient_checkpointing", "bf16", "use_cpu",
              "optim", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm",
              "lr_scheduler_type", "warmup_steps", "use_vllm", "logging_steps", "max_steps", "shuffle_dataset",
              "max_tool_calling_iterations", "generation_kwargs")


def trl_child(cfg_path: str) -> None:
    """The TRL run (`--trl-child`, in its own process): GRPOTrainer from the model directory, a callback keeping the
    training clock and the snapshots, results and snapshots written to cfg["out"]."""
    import itertools

    cfg = json.loads(Path(cfg_path).read_text())
    import torch

    torch.set_num_threads(cfg["threads"])
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from astratk.models.chat import encode_chat, stop_token_ids
    from astratk.models.loading import load_tokenizer

    out = Path(cfg["out"])
    env = pickle.loads(Path(cfg["env"]).read_bytes())
    tok = AutoTokenizer.from_pretrained(cfg["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model_dir"], dtype=torch.float32)
    # train tasks from the env's train stream (never a held-out one); more rows than the run can use
    tasks = list(itertools.islice(env.tasks("train"), cfg["rows"]))
    agent = cfg.get("task") == "tool-agent"
    environment_factory = None
    if agent:  # tutorial 10's tool agent through TRL's own tool loop (bench/_vs_trl_agent.py)
        import _vs_trl_agent
        from trl.chat_template_utils import qwen3_template

        from astratk.envs import price_total

        rows = [_vs_trl_agent.row_of(t) for t in tasks]
        _vs_trl_agent.PriceTools.rows = rows
        environment_factory = _vs_trl_agent.PriceTools
        tok.chat_template = _vs_trl_agent.trl_template(tok.chat_template)  # what astratk renders, tools included
        tok.response_template = qwen3_template  # TRL's Hermes/Qwen parser: <tool_call>{json}</tool_call>
        dataset = Dataset.from_dict({
            "prompt": [[{"role": "system", "content": price_total.SYSTEM}, {"role": "user", "content": r["prompt"]}]
                       for r in rows], "task_index": list(range(len(rows)))})
        reward = _vs_trl_agent.trl_reward(rows)
    else:
        dataset = Dataset.from_dict({"prompt": [env.messages(t) for t in tasks], "task_index": list(range(len(tasks)))})

        def reward(prompts: list, completions: list, task_index: list[int], **_: Any) -> list[float]:
            """The env's grade of each completion (1.0 exact answer, else 0.0), as astratk's reward."""
            return [env.grade(tasks[i], c[0]["content"] if isinstance(c, list) else c)
                    for i, c in zip(task_index, completions)]

    marks, seconds = cfg["marks"], cfg["seconds"]
    snapshots: list[dict[str, Any]] = []

    class Clock(TrainerCallback):
        """Training time = wall time since train begin minus the time spent in here; at each mark, the weights after
        the last optimizer step that ended by then (copied at every step end: the step after a mark shows which)."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0, self.excluded, self.next = time.perf_counter(), 0.0, 0
            self.prev: tuple[float, int, dict | None] = (0.0, 0, None)  # None: the initial model

        def _save(self, t: float, step: int, weights: dict | None, mark: float | None) -> None:
            if snapshots and snapshots[-1]["step"] == step:
                snapshots[-1]["marks"].append(mark)
                return
            path = None
            if weights is not None:
                path = str(out / f"step{step}.pt")
                torch.save(weights, path)
            snapshots.append({"step": step, "time_s": t, "marks": [mark], "path": path})

        def on_step_end(self, args, state, control, model=None, **kwargs):
            enter = time.perf_counter()
            t = enter - self.t0 - self.excluded
            while self.next < len(marks) and marks[self.next] < t:
                self._save(*self.prev, mark=marks[self.next])
                self.next += 1
            if cfg.get("lora"):  # the adapters only, by PEFT's saved names (as astratk's store holds them)
                from peft import get_peft_model_state_dict

                weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
            else:
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.prev = (t, state.global_step, weights)
            if t >= seconds:
                control.should_training_stop = True
                for mark in marks[self.next:]:  # a mark at exactly t
                    self._save(t, state.global_step, weights, mark)
                self._save(t, state.global_step, weights, None)
                self.train_time, self.steps = t, state.global_step
            self.excluded += time.perf_counter() - enter

        def on_train_end(self, args, state, control, model=None, **kwargs):
            if not hasattr(self, "train_time"):  # ended before --seconds (it should not: max_steps is huge)
                t, step, weights = self.prev
                self._save(t, step, weights, None)
                self.train_time, self.steps = t, step

    clock = Clock()
    config = GRPOConfig(**trl_config(cfg))
    from _vs_trl_real import time_generation, trl_peft_config

    generation = time_generation(model, tok.pad_token_id)  # TRL's rollouts: tokens and seconds
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[clock], peft_config=trl_peft_config(cfg),
                          environment_factory=environment_factory)
    # the same prompts as astratk's: TRL's own tokenization of the chat messages against astratk's encode_chat with
    # the tokenizer astratk loads; and generation stops at astratk's stop tokens
    ours = load_tokenizer(cfg["model_dir"])
    stops = {"trl_eos_token_ids": sorted(trainer.eos_token_ids), "astratk_stop_token_ids": sorted(stop_token_ids(ours)),
             "stops_equal": set(trainer.eos_token_ids) == set(stop_token_ids(ours))}
    if agent:  # prompts and whole episodes (calls and results) with the tools, token for token
        check = {**_vs_trl_agent.check_renders(tok, ours, rows[:16], trainer.tools), **stops}
        check["prompt_ids_equal"] = check["prompt_ids_equal"] and check.pop("episode_ids_equal")
    else:
        sample = tasks[:32]
        trl_ids = [list(x) for x in trainer._tokenize_prompts([env.messages(t) for t in sample])[0]]
        astratk_ids = [encode_chat(ours, env.messages(t)) for t in sample]
        check = {"prompts_compared": len(sample), "prompt_ids_equal": trl_ids == astratk_ids,
                 "example_prompt_ids": trl_ids[0], "example_prompt": tok.decode(trl_ids[0]), **stops}
    if not (check["prompt_ids_equal"] and check["stops_equal"]):
        raise SystemExit(f"TRL would not see astratk's prompts or stop tokens: {check}")
    trainer.train()
    import resource

    (out / "result.json").write_text(json.dumps({
        "rollout_tokens_per_s": generation["tokens"] / generation["seconds"] if generation["seconds"] else None,
        "peak_rss_process_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "steps": clock.steps, "train_time_s": clock.train_time, "samples": clock.steps * config.generation_batch_size,
        "snapshots": snapshots, "check": check, "threads": torch.get_num_threads(), "trl_version": trl.__version__,
        "thread_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
        "config": {k: getattr(config, k, None) for k in TRL_FIELDS}}, default=str))


def run_trl(args: argparse.Namespace, lr: float, seed: int, marks: list[float], tmp: Path, model_dir: Path,
            env_file: Path, evaluate: HeldOut, initial: float) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"trl-lr{lr:g}-s{seed}-", dir=tmp))
    cfg = {"out": str(out), "lr": lr, "seed": seed, "marks": marks, "seconds": float(args.seconds),
           "model_dir": str(model_dir), "env": str(env_file), "threads": args.trl_threads,
           "lora": bool(getattr(args, "lora", False)), "shape": args.trl_shape, "task": getattr(args, "task", "sums"),
           "rows": args.trl_rows or max(4096, int(args.seconds * 64)),  # ~4x what TRL gets through on 2 cores
           "trl_set": {k: _scalar(v) for k, v in _pairs(args.trl_set, "--trl-set")}}
    (out / "config.json").write_text(json.dumps(cfg))
    wall = time.time()
    # the environment this script started with: nothing an in-process astratk run or library changed since (Dask's
    # nannies once left OMP_NUM_THREADS=1 behind, which halved TRL's speed on 2 threads)
    child_env = {**START_ENV, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--trl-child", str(out / "config.json")],
                          capture_output=not args.verbose, text=True, env=child_env,
                          timeout=args.seconds + args.child_timeout_s, check=False)
    if proc.returncode != 0 or not (out / "result.json").exists():
        tail = ((proc.stdout or "") + (proc.stderr or ""))[-4000:]
        raise RuntimeError(f"the TRL run (lr {lr:g}, seed {seed}) failed with exit code {proc.returncode}:\n{tail}")
    import torch

    res = json.loads((out / "result.json").read_text())
    for snap in res["snapshots"]:
        path = snap.pop("path")
        snap["accuracy"] = initial if path is None else evaluate(torch.load(path, weights_only=True))
    shutil.rmtree(out, ignore_errors=True)
    return {"side": "trl", "lr": lr, "seed": seed, "steps": res["steps"], "train_time_s": res["train_time_s"],
            "samples": res["samples"], "wall_s": time.time() - wall, "threads": res["threads"],
            "thread_env": res.get("thread_env"),
            "trl_version": res["trl_version"], "config": res["config"], "check": res["check"],
            "rollout_tokens_per_s": res.get("rollout_tokens_per_s"),
            "peak_rss_process_gb": res.get("peak_rss_process_gb"), "peak_rss_sum_gb": res.get("peak_rss_process_gb"),
            "snapshots": res["snapshots"]}

