"""astratk against TRL's `GRPOTrainer`: held-out accuracy against training time, same model, task, machine and
held-out set, both sides in one run of this script (issue 15: "+25 points of held-out accuracy in <= 1/2 of TRL's
time, with at least TRL's optimizer steps per second", median over >= 3 seeds per side, best lr per side).

Both sides start from the same model directory, built (or reused) by astratk's own `ensure_model`:
- `--model quickstart`: tutorials/quickstart.yaml's tiny Qwen2 (0.82M parameters), arithmetic levels [1, 2];
- `--model large`: a 6.4M-parameter Qwen2 (`LARGE_MODEL`: 8 layers x 256), warm-started on the same levels [1, 2].
Both train on 16 prompts x 8 samples per optimizer step, <= 8 new tokens, temperature 1, fp32, on this machine's CPU:
- astratk: `Run(spec).start()` in this process (the in-process trainer plus one Dask rollout worker, as the quickstart
  runs), the quickstart's DRPO loss, `trainer.max_time_s = --seconds`;
- TRL: `trl.GRPOTrainer` in a subprocess of this script (`--trl-child`), `GRPOConfig(loss_type="dr_grpo", ...)`,
  `--trl-threads` torch threads (default: every core), TRL's defaults otherwise except gradient checkpointing, off
  (`trl_config`; `--trl-set` changes any field). Prompts are the env's chat messages, so TRL renders them with the
  model's chat template: checked to give astratk's prompt token ids, and TRL to stop at astratk's stop tokens (`check`
  of each TRL run in the JSON); rewards are the env's exact-answer grades.

Fair evaluation, identical for both sides and outside both training clocks: neither side evaluates while it trains.
Both keep the policy's weights as of every `--eval-every` seconds of *training time* (the newest weights at or before
each mark: for astratk the newest version in the run's weight store published by then, timed from the session's
training start; for TRL the state after the last optimizer step that ended by then, on a clock that leaves out the
snapshot callback's own time), and the last weights when training stops. After each run, one function
(`astratk.models.warm_start.heldout_accuracy`: greedy decoding of the env's first `--heldout` held-out tasks, graded
by the env) evaluates every snapshot; the shared starting model is evaluated once (the t = 0 point of every curve).

Per run: time to +15 and +25 points (the training time of the first snapshot at or above the start + 0.15 / 0.25),
accuracy at `--seconds`, best accuracy, optimizer steps and steps/s, samples/s (completions generated per second of
training; astratk's include groups the data layer dropped, counted too). The lr sweep runs `--sweep-seeds` seeds per
lr and side; the best lr per side (median time to +25 points, then median accuracy at the end) runs the remaining seeds
up to `--seeds`. Writes `--out/<model>.json` (every run and curve), `.png` and `.html` (accuracy against training time).

    python bench/vs_trl.py                               # quickstart model, 150 s per run (~35 min on 2 CPU cores)
    python bench/vs_trl.py --model large                 # the 6.4M model (~50 min; builds it first: ~12 min)
    python bench/vs_trl.py --seconds 30 --lrs 1e-4 --seeds 1
    python bench/vs_trl.py --quick                       # smoke: both sides, a few seconds each (CI)
    python bench/vs_trl.py --sides astratk --astratk-set policies.0.trainer.precision=bf16-mixed
    python bench/vs_trl.py --trl-set scale_rewards=none  # TRL with Dr. GRPO's unscaled advantages
    python bench/vs_trl.py --model smollm2 --seconds 600 --lrs 1e-5 --seeds 3 --eval-every 60 --heldout 128
    python bench/vs_trl.py --model smollm2 --lora --seconds 600 --lrs 5e-4 --seeds 3 --eval-every 60 --heldout 128

`--model smollm2`: SmolLM2-135M-Instruct, a real pretrained chat model (tutorials/real_model.yaml: one- and two-digit
sums asked in words, the last number graded; 8 prompts x 8 samples, 32 new tokens, temperature 0.7), full fine-tuning
or, with `--lora`, PEFT LoRA adapters on both sides; targets +10 and +20 points; adds rollout tokens/s and peak RSS
(bench/_vs_trl_real.py). The shared evaluation decodes the rollout's token budget (the model answers in sentences).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tutorials" / "quickstart.yaml"
SIDES = ("astratk", "trl")
TITLES = {"astratk": "astratk", "trl": "TRL GRPOTrainer"}
COLORS = {"astratk": "#1f77b4", "trl": "#d62728"}
START_ENV = dict(os.environ)  # the TRL process gets this, not what the parent's environment has become
GAINS = (0.15, 0.25)  # time-to-target rows: + 15 and + 25 points of held-out accuracy
HEADLINE_GAIN = 0.25
# The larger model: 6.4M parameters (`model.params` in the JSON), 8x the quickstart's, on the quickstart's task. Its
# warm start stops at 30% running train exact-match, capped at 1,500 steps: measured, 31% at step 1,145 (30.9%
# held-out, 12 min on one thread). On levels [2, 3, 4] it stayed at 3.5-6.1% held-out after 400-1,000 steps at lr
# 2.5e-4 to 2e-3 (and 4 x 384 did no better), so RL there would start from almost no reward: the harder task needs a
# much longer warm start (--astratk-set policies.0.model.tiny.warm_start_steps=..., env.init_args.levels=[2,3,4]:
# the spec names the cached model, and both sides start from it).
LARGE_MODEL = {"hidden_size": 256, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 768,
               "warm_start_steps": 1500, "warm_start_target": 0.3}
LARGE_LEVELS = [1, 2]
# Per-run keys the bench sets itself (from --lrs, --seeds, --seconds); --astratk-set may not give them.
RESERVED = ("policies.0.trainer.lr", "policies.0.trainer.max_time_s", "policies.0.trainer.max_steps", "seed",
            "output_dir", "name")


# ------------------------------------------------------------------------------------------------- small helpers
def _scalar(raw: str) -> Any:
    """A command-line value: int, float (YAML 1.1 reads `3e-5` as a string), else YAML (null, true, [2, 3], text)."""
    import yaml

    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return yaml.safe_load(raw)


def _pairs(items: list[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} {item!r}: give KEY=VALUE (e.g. {flag} eval.max_tasks=8)")
        out.append((key.strip(), value.strip()))
    return out


def set_path(obj: Any, dotted: str, raw: str) -> None:
    """Set `dotted` (attributes and list indices: `policies.0.trainer.precision`) on a spec object to `raw`."""
    parts = dotted.split(".")
    where = obj
    for i, part in enumerate(parts[:-1]):
        try:
            where = where[int(part)] if isinstance(where, list) else getattr(where, part)
        except (AttributeError, IndexError, ValueError):
            raise SystemExit(f"--astratk-set {dotted}: {'.'.join(parts[:i + 1])!r} is not in the run spec") from None
    last = parts[-1]
    if not hasattr(where, last):
        raise SystemExit(f"--astratk-set {dotted}: {type(where).__name__} has no field {last!r}")
    value, current = _scalar(raw), getattr(where, last)
    if dataclasses.is_dataclass(current) and isinstance(value, dict):
        value = dataclasses.replace(current, **value)
    elif isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    setattr(where, last, value)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on `n` torch threads (an astratk run leaves this process at `cluster.torch_threads`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _median(xs: list[float]) -> float:
    """Median; never-reached times are +inf, so a median among them is inf when half or more never reached."""
    return statistics.median(xs) if xs else math.nan


def _fmt_s(x: float | None) -> str:
    return "never" if x is None or math.isinf(x) else f"{x:.0f} s" if x >= 100 else f"{x:.1f} s"


# -------------------------------------------------------------------------------------------------- the astratk spec
def astratk_spec(args: argparse.Namespace, out_dir: Path, lr: float = 1e-4, seed: int = 0, name: str = "vs-trl"):
    """The quickstart spec (or the large model's), with the bench's settings, --astratk-set, then lr/seed/time."""
    from astratk.config import load_spec

    top, nested = [], []
    for key, value in _pairs(args.astratk_set, "--astratk-set"):
        if key in RESERVED or key.replace("[0]", ".0") in RESERVED:
            raise SystemExit(f"--astratk-set {key}: the bench sets it per run (--lrs, --seeds, --seconds, --out)")
        (nested if "." in key and key.split(".", 1)[0] == "policies" else top).append((key, value))
    # periodic evaluation off (the bench evaluates snapshots itself); the run's own first and last evaluations cost
    # time outside the training clock only, on a few tasks; no progress lines
    overrides = ["--output_dir", str(out_dir), "--name", name, "--eval.interval_s", "1000000000",
                 "--eval.max_tasks", "16", "--progress", "false", "--seed", str(seed)]
    if args.model == "large":
        overrides += ["--env.init_args.levels", json.dumps(LARGE_LEVELS)]
    for key, value in top:
        overrides += [f"--{key}", value]
    if args.model == "smollm2":
        import _vs_trl_real

        spec = load_spec(_vs_trl_real.CONFIG, overrides)
        _vs_trl_real.adjust(spec, args)
    else:
        spec = load_spec(CONFIG, overrides)
    p = spec.policies[0]
    if args.model == "large":
        p.model.tiny = dataclasses.replace(p.model.tiny, **LARGE_MODEL)
    for key, value in nested:
        set_path(spec, key, value)
    p.trainer.lr = lr
    p.trainer.max_time_s = float(args.seconds)
    p.trainer.max_steps = 10_000_000  # the time limit ends training
    return spec.validate()


# ------------------------------------------------------------------------------------------ the shared evaluation
class HeldOut:
    """The one evaluation of every snapshot of both sides: the model directory's architecture with the snapshot's
    weights, `heldout_accuracy` (greedy, the env's grader) on the env's first `n` held-out tasks, on every core."""

    def __init__(self, model_dir: Path, env: Any, n: int, threads: int, max_new_tokens: int | None = None) -> None:
        from astratk.models.loading import load_causal_lm, load_tokenizer

        self.max_new_tokens = max_new_tokens  # None: the longest demonstration + 3 (the tiny models answer tersely)
        self.model = load_causal_lm(str(model_dir))
        self.tok = load_tokenizer(model_dir)
        self.env, self.n, self.threads = env, n, threads
        self.initial_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.seconds = 0.0

    def __call__(self, state: dict[str, Any]) -> float:
        from astratk.models.warm_start import heldout_accuracy

        t = time.perf_counter()
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embeddings
            raise RuntimeError(f"snapshot does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        with torch_threads(self.threads):
            accuracy, _, _ = heldout_accuracy(self.model, self.tok, self.env, max_tasks=self.n,
                                              max_new_tokens=self.max_new_tokens)
        self.seconds += time.perf_counter() - t
        return accuracy


def marks_for(seconds: float, every: float, fine_until: float = 0.0, fine_every: float = 1.0) -> list[float]:
    """Training times at which both sides keep their weights: every `fine_every` s up to `fine_until` (where the
    early targets are crossed, a few seconds in on the quickstart model), every `every` s after, and `seconds`."""
    fine = [float(round(fine_every * k, 6)) for k in range(1, int(min(fine_until, seconds) / fine_every + 1e-9) + 1)]
    coarse = [float(every * k) for k in range(1, int(seconds / every + 1e-9) + 1)]
    marks = sorted({*fine, *(m for m in coarse if not fine or m > fine[-1] + 1e-9)})
    if not marks or marks[-1] < seconds - 1e-9:
        marks.append(float(seconds))
    return marks


class StoreFollower:
    """Follows a live run's weight store from this process's main thread (the run trains in its background thread):
    the version published at or before each mark of training time, pulled once the next version shows it is the
    newest by then. Reads only: refs (small JSON files) every `poll_s`, one pull per mark."""

    def __init__(self, run: Any, policy_id: str, marks: list[float], every: int, lora: bool = False) -> None:
        self.run, self.pid, self.marks, self.every, self.lora = run, policy_id, marks, every, lora
        self.t0: float | None = None
        self.store: Any = None
        self.counters0: dict[str, float] = {}
        self.published: list[tuple[int, float]] = []  # (version, training time of its publication)
        self.seen = 0
        self.next = 0
        self.snapshots: list[dict[str, Any]] = []
        self.states: dict[int, dict[str, Any]] = {}  # version -> weights (version 0: the shared initial model)

    def poll(self, final: bool = False) -> None:
        session = self.run.session
        if self.t0 is None:
            t0 = getattr(getattr(session, "evaluator", None), "train_t0", None)
            if t0 is None:
                return
            from astratk.weights.store import WeightStore

            self.t0 = t0
            self.store = WeightStore(session.deployment.store.url)  # a reader of its own
            if self.store.adapter_config(self.pid) is not None and not self.lora:
                raise SystemExit("the astratk side trains LoRA adapters (model.lora): this bench evaluates full "
                                 "weights only; drop model.lora")
            # what the data layer received before training started (the rollouts acquisition prefetches meanwhile)
            # is left out of the run's samples/s
            try:
                self.counters0 = dict(session.deployment.datalayer.metrics(timeout=30))
            except Exception as e:  # noqa: BLE001 - then samples/s counts them too; said in the record
                self.counters0 = {"error": repr(e)}
        latest = self.store.latest(self.pid)
        if latest is not None and latest.version > self.seen:
            for v in range(self.seen + 1, latest.version + 1):
                try:
                    ref = self.store.ref(self.pid, v)
                except KeyError:  # a step the divergence guard skipped publishes no version
                    continue
                self.published.append((v, ref.published_at - self.t0))
            self.seen = latest.version
        while self.next < len(self.marks):
            mark = self.marks[self.next]
            # decided once a later version exists (versions publish in order), or when the run is over
            if not final and not (self.published and self.published[-1][1] > mark):
                break
            if final and mark > self._train_time() + 1e-6:
                break  # training ended before this mark (an early stop): no weights are "at" it
            before = [(v, t) for v, t in self.published if t <= mark]
            self._take(*(before[-1] if before else (0, 0.0)), mark=mark)
            self.next += 1
        if final and self.published:
            self._take(*self.published[-1], mark=None)

    def _train_time(self) -> float:
        s = self.run.result.summary if self.run.result is not None else {}
        return float(s.get("train_time_s", math.inf))

    def _take(self, version: int, t: float, mark: float | None) -> None:
        for s in self.snapshots:
            if s["version"] == version:
                s["marks"].append(mark)
                return
        if version and version not in self.states:
            state, _ = self.store.pull(self.pid, None, version)
            self.states[version] = state
        self.snapshots.append({"version": version, "step": version * self.every, "time_s": max(t, 0.0),
                               "marks": [mark]})


def run_astratk(args: argparse.Namespace, lr: float, seed: int, marks: list[float], tmp: Path,
                evaluate: HeldOut, initial: float) -> dict[str, Any]:
    from astratk.runtime.run import Run

    lines: list[str] = []
    log = print if args.verbose else lines.append
    spec = astratk_spec(args, tmp, lr, seed, name=f"vs-trl-astratk-lr{lr:g}-s{seed}")
    pid, every = spec.policies[0].policy_id, spec.policies[0].trainer.publish_every
    run = Run(spec, printer=log)
    follower = StoreFollower(run, pid, marks, every, lora=getattr(args, "lora", False))
    wall = time.time()
    from _vs_trl_real import RssSampler

    with RssSampler() as rss:  # this process (the trainer: the evaluator's model left out) and its Dask workers
        run.start(block=False)
        try:
            while run._thread.is_alive():  # the handle's own thread: poll until it ends
                follower.poll()
                time.sleep(args.poll_s)
            result = run.wait()
        except BaseException:
            print("\n".join(lines[-40:]))
            raise
    follower.poll(final=True)
    s = result.summary
    counters = run.session.counters
    key = f"data/{pid}/"
    samples = counters.get(key + "samples_received", math.nan) - follower.counters0.get(key + "samples_received", 0)
    dropped = {k[len(key + "groups_dropped_"):]: int(v) for k, v in counters.items()
               if k.startswith(key + "groups_dropped_") and v}
    for snap in follower.snapshots:  # evaluated after the run: nothing else runs on the machine meanwhile
        snap["accuracy"] = initial if snap["version"] == 0 else evaluate(follower.states.pop(snap["version"]))
    shutil.rmtree(result.run_dir, ignore_errors=True)
    return {"side": "astratk", "lr": lr, "seed": seed, "steps": int(s["steps"]), "train_time_s": s["train_time_s"],
            "samples": samples, "groups_received": int(counters.get(key + "groups_received", 0)),
            "samples_before_training": (None if "error" in follower.counters0 else  # None: counted in `samples`
                                        follower.counters0.get(key + "samples_received", 0.0)),
            "groups_dropped": dropped, "wall_s": time.time() - wall, **rss.figures(),
            "rollout_tokens_per_s": sum(float(r.get("tokens_per_s", 0.0)) for r in run.session.service_rows.values()),
            "summary": {k: v for k, v in s.items() if isinstance(v, (int, float, str, bool)) or v is None},
            "snapshots": follower.snapshots}


# --------------------------------------------------------------------------------------------------- the TRL side
def trl_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """GRPOConfig's arguments: the brief's fixed ones, TRL 1.16's defaults otherwise, then --trl-set."""
    fields = {
        "output_dir": cfg["out"] + "/trl", "loss_type": "dr_grpo", "learning_rate": cfg["lr"], "seed": cfg["seed"],
        # astratk's run shape (`shape`): prompts x samples per optimizer step (generation_batch_size defaults to
        # it), completion length, temperature; the quickstart's: 16 x 8 = 128 completions, 8 tokens, T = 1
        **cfg["shape"], "gradient_accumulation_steps": 1,
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
              "lr_scheduler_type", "warmup_steps", "use_vllm", "logging_steps", "max_steps", "shuffle_dataset")


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
    dataset = Dataset.from_dict({"prompt": [env.messages(t) for t in tasks], "task_index": list(range(len(tasks)))})

    def exact_answer(prompts: list, completions: list, task_index: list[int], **_: Any) -> list[float]:
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
    trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[clock], peft_config=trl_peft_config(cfg))
    # the same prompts as astratk's: TRL's own tokenization of the chat messages against astratk's encode_chat with
    # the tokenizer astratk loads; and generation stops at astratk's stop tokens
    sample = tasks[:32]
    trl_ids = [list(x) for x in trainer._tokenize_prompts([env.messages(t) for t in sample])[0]]
    ours = load_tokenizer(cfg["model_dir"])
    astratk_ids = [encode_chat(ours, env.messages(t)) for t in sample]
    check = {"prompts_compared": len(sample), "prompt_ids_equal": trl_ids == astratk_ids,
             "example_prompt_ids": trl_ids[0], "example_prompt": tok.decode(trl_ids[0]),
             "trl_eos_token_ids": sorted(trainer.eos_token_ids), "astratk_stop_token_ids": sorted(stop_token_ids(ours)),
             "stops_equal": set(trainer.eos_token_ids) == set(stop_token_ids(ours))}
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
           "lora": bool(getattr(args, "lora", False)), "shape": args.trl_shape,
           "rows": args.trl_rows or max(4096, int(args.seconds * 64)),  # ~4x what TRL gets through on 2 cores
           "trl_set": {k: _scalar(v) for k, v in _pairs(args.trl_set, "--trl-set")}}
    (out / "config.json").write_text(json.dumps(cfg))
    wall = time.time()
    # the environment this script started with: nothing an in-process astratk run or library changed since (Dask's
    # nannies once left OMP_NUM_THREADS=1 behind, which halved TRL's speed on 2 threads)
    child_env = {**START_ENV, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--trl-child", str(out / "config.json")],
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
            "rollout_tokens_per_s": res.get("rollout_tokens_per_s"), "peak_rss_process_gb": res.get("peak_rss_process_gb"),
            "peak_rss_sum_gb": res.get("peak_rss_process_gb"),
            "snapshots": res["snapshots"]}


# ------------------------------------------------------------------------------------------------------ the figures
def figures(run: dict[str, Any], initial: float, seconds: float) -> dict[str, Any]:
    """A run's curve (t = 0: the shared starting model) and headline numbers."""
    # a snapshot of step 0 (nothing trained by its mark) is the starting point itself
    curve = [{"time_s": 0.0, "step": 0, "accuracy": initial}] + [
        {k: s[k] for k in ("time_s", "step", "accuracy")} | {"marks": s["marks"]} for s in run["snapshots"]
        if s["step"] > 0]
    curve.sort(key=lambda p: (p["time_s"], p["step"]))
    time_to = {}
    for gain in GAINS:
        hit = next((p["time_s"] for p in curve if p["accuracy"] >= initial + gain - 1e-9), None)
        time_to[f"{round(100 * gain)}"] = hit
    at_end = [p for p in curve if p["time_s"] <= seconds + 1e-9]
    return {"curve": curve, "time_to": time_to, "accuracy_at_end": at_end[-1]["accuracy"],
            "accuracy_final": curve[-1]["accuracy"], "accuracy_best": max(p["accuracy"] for p in curve),
            "steps_per_s": run["steps"] / run["train_time_s"], "samples_per_s": run["samples"] / run["train_time_s"]}


def _t(x: float | None) -> float:
    return math.inf if x is None else x


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and per-seed values of one side's runs at one lr."""
    t = {g: [_t(r["time_to"][g]) for r in runs] for g in runs[0]["time_to"]}
    return {"lr": runs[0]["lr"], "seeds": [r["seed"] for r in runs],
            "time_to": {g: _median(v) for g, v in t.items()}, "time_to_per_seed": t,
            "accuracy_at_end": _median([r["accuracy_at_end"] for r in runs]),
            "accuracy_at_end_per_seed": [r["accuracy_at_end"] for r in runs],
            "accuracy_best": _median([r["accuracy_best"] for r in runs]),
            "accuracy_best_per_seed": [r["accuracy_best"] for r in runs],
            "steps": _median([r["steps"] for r in runs]),
            "steps_per_s": _median([r["steps_per_s"] for r in runs]),
            "steps_per_s_per_seed": [r["steps_per_s"] for r in runs],
            "samples_per_s": _median([r["samples_per_s"] for r in runs]),
            "samples_per_s_per_seed": [r["samples_per_s"] for r in runs],
            **{k: _median([r[k] for r in runs if r.get(k) is not None])  # real-model runs: rollout speed, memory
               for k in ("rollout_tokens_per_s", "peak_rss_process_gb", "peak_rss_sum_gb")
               if any(r.get(k) is not None for r in runs)}}


def time_to_level(curve: list[dict[str, Any]], level: float) -> float | None:
    """Training time of a curve's first point at or above `level` held-out accuracy (None: never)."""
    return next((p["time_s"] for p in curve if p["accuracy"] >= level - 1e-9), None)


def matched(runs: list[dict[str, Any]], best: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Time for each side (its best-lr runs, median over seeds) to reach the accuracy TRL ends at (its median at the
    end of the budget): the comparison that still means something when a model plateaus before +25 points."""
    if "trl" not in best or "astratk" not in best:
        return None
    level = best["trl"]["accuracy_at_end"]
    times = {side: [_t(time_to_level(r["curve"], level)) for r in runs
                    if r["side"] == side and r["lr"] == best[side]["lr"]] for side in ("astratk", "trl")}
    med = {side: _median(ts) for side, ts in times.items()}
    ratio = med["trl"] / med["astratk"] if math.isfinite(med["astratk"]) and med["astratk"] > 0 else math.nan
    return {"level": level, "time_s": med, "time_s_per_seed": times, "trl_over_astratk": ratio}


def rank_key(summary: dict[str, Any]) -> tuple[float, float]:
    """Best lr: the lowest median time to + 25 points, then the highest median accuracy at the end."""
    return (summary["time_to"][f"{round(100 * HEADLINE_GAIN)}"], -summary["accuracy_at_end"])


def table(best: dict[str, dict[str, Any]], sweep: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
          dropped: dict[str, Any]) -> str:
    sides = [s for s in SIDES if s in best]

    def per_seed(xs: list[float], fmt: Callable[[float], str]) -> str:
        return "; " + ", ".join(fmt(x) for x in xs) if len(xs) > 1 else ""

    pct = lambda x: f"{100 * x:.1f}%"
    rate = lambda x: f"{x:.2f}"
    rows = [("lr (best of the sweep)", lambda b: f"{b['lr']:g} ({len(b['seeds'])} seed{'s' * (len(b['seeds']) > 1)})")]
    for gain in GAINS:
        g = f"{round(100 * gain)}"
        rows.append((f"time to +{g} points (median; per seed)",
                     lambda b, g=g: _fmt_s(b["time_to"][g]) + per_seed(b["time_to_per_seed"][g], _fmt_s)))
    rows += [(f"accuracy at {args.seconds:g} s", lambda b: pct(b["accuracy_at_end"])
              + per_seed(b["accuracy_at_end_per_seed"], pct)),
             ("best accuracy", lambda b: pct(b["accuracy_best"]) + per_seed(b["accuracy_best_per_seed"], pct)),
             ("optimizer steps (median)", lambda b: f"{b['steps']:.0f}"),
             ("optimizer steps/s", lambda b: rate(b["steps_per_s"]) + per_seed(b["steps_per_s_per_seed"], rate)),
             ("samples/s", lambda b: f"{b['samples_per_s']:.0f}" + per_seed(b["samples_per_s_per_seed"],
                                                                           lambda x: f"{x:.0f}"))]
    if any("rollout_tokens_per_s" in best[s] for s in sides):
        rows += [("rollout tokens/s (median)", lambda b: f"{b.get('rollout_tokens_per_s', math.nan):.0f}"),
                 ("peak RSS, largest process (GB)", lambda b: f"{b.get('peak_rss_process_gb', math.nan):.2f}"),
                 ("peak RSS, all its processes (GB)", lambda b: f"{b.get('peak_rss_sum_gb', math.nan):.2f}")]
    lines = ["| | " + " | ".join(TITLES[s] for s in sides) + " |", "|---" * (len(sides) + 1) + "|"]
    for title, cell in rows:
        lines.append(f"| {title} | " + " | ".join(cell(best[s]) for s in sides) + " |")
    if "astratk" in best:
        cells = [", ".join(f"{k} {v}" for k, v in dropped.items()) or "none"] + ["-"] * (len(sides) - 1)
        lines.append("| groups dropped (astratk, all seeds) | " + " | ".join(cells) + " |")
    g = f"{round(100 * HEADLINE_GAIN)}"
    for lr in sorted({x["lr"] for side in sides for x in sweep.get(side, [])}):
        cells = []
        for side in sides:
            x = next((x for x in sweep.get(side, []) if x["lr"] == lr), None)
            cells.append("-" if x is None else f"+{g} at {_fmt_s(x['time_to'][g])}, {pct(x['accuracy_at_end'])} at "
                         f"end, {rate(x['steps_per_s'])} steps/s")
        lines.append(f"| sweep: lr {lr:g} ({args.sweep_seeds} seed{'s' * (args.sweep_seeds > 1)}) | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _matched_line(match: dict[str, Any]) -> str:
    a, t = match["time_s"]["astratk"], match["time_s"]["trl"]
    per = "; ".join(f"{side} " + ", ".join(_fmt_s(x) for x in xs) for side, xs in match["time_s_per_seed"].items())
    ratio = f"{match['trl_over_astratk']:.2f}x" if math.isfinite(match["trl_over_astratk"]) else "-"
    return (f"\ntime to TRL's accuracy at the end ({100 * match['level']:.1f}%), medians: astratk {_fmt_s(a)}, TRL "
            f"{_fmt_s(t)}: TRL / astratk {ratio} ({per})")


def report(path: Path) -> None:
    """Re-read a finished (`<model>.json`) or partial (`<model>.runs.json`) result: each side's best lr by the bench's
    rule, and the time-to-TRL's-final-accuracy comparison (`matched`)."""
    data = json.loads(path.read_text())
    runs = data["runs"]
    best = data.get("best")
    if not best:
        best = {}
        for side in SIDES:
            by_lr: dict[float, list[dict[str, Any]]] = {}
            for r in runs:
                if r["side"] == side:
                    by_lr.setdefault(r["lr"], []).append(r)
            if by_lr:
                best[side] = min((summarise(rs) for rs in by_lr.values()), key=rank_key)
    for side, b in best.items():
        print(f"{side}: best lr {b['lr']:g} over {len(b['seeds'])} seed(s), accuracy at the end "
              f"{100 * b['accuracy_at_end']:.1f}%, {b['steps_per_s']:.2f} steps/s")
    match = matched(runs, best)
    if match is not None:
        print(_matched_line(match))


def plot(runs: list[dict[str, Any]], initial: float, stem: Path, title: str) -> dict[str, Path]:
    """Accuracy against training time, one line per run, coloured by side: `<stem>.html` (bokeh) and `.png`
    (matplotlib), each built with its own backend current (as astratk/viz.py saves its dashboards)."""
    import holoviews as hv
    import hvplot.pandas  # noqa: F401 - registers .hvplot
    import pandas as pd

    def build(backend: str) -> Any:
        overlay = None
        for r in runs:
            df = pd.DataFrame(r["curve"])[["time_s", "accuracy"]]
            label = f"{TITLES[r['side']]} lr {r['lr']:g} seed {r['seed']}"
            curve = df.hvplot.line(x="time_s", y="accuracy", label=label, color=COLORS[r["side"]],
                                   xlabel="training time (s)", ylabel="held-out accuracy (greedy)")
            overlay = curve if overlay is None else overlay * curve
        dash = {"line_dash": "dashed"} if backend == "bokeh" else {"linestyle": "dashed"}
        for gain in GAINS:  # the targets: start + 15 and + 25 points
            overlay = overlay * hv.HLine(initial + gain).opts(color="gray", **dash)
        opts = {"title": title}
        if backend == "bokeh":
            opts.update(width=900, height=500, legend_position="bottom_right")
        else:
            opts.update(fig_size=200, legend_position="right")
        return overlay.opts(**opts)

    previous = hv.Store.current_backend if hv.Store.current_backend in hv.Store.renderers else "bokeh"
    hv.extension("bokeh", "matplotlib", logo=False)
    html, png = stem.with_suffix(".html"), stem.with_suffix(".png")
    try:
        hv.save(build("bokeh"), html, backend="bokeh", resources="inline")
        hv.Store.set_current_backend("matplotlib")
        hv.save(build("matplotlib"), png, backend="matplotlib", dpi=90)
    finally:
        hv.Store.set_current_backend(previous)
    return {"html": html, "png": png}


# ------------------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("quickstart", "large", "smollm2"), default="quickstart")
    ap.add_argument("--lora", action="store_true", help="--model smollm2: LoRA adapters on both sides")
    ap.add_argument("--seconds", type=float, default=150.0, help="training time per run")
    ap.add_argument("--lrs", default="3e-5,1e-4,3e-4", help="comma-separated learning rates swept per side")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per side at its best lr")
    ap.add_argument("--sweep-seeds", type=int, default=1, help="seeds per lr in the sweep (the first of --seeds)")
    ap.add_argument("--sides", default="astratk,trl", help="comma-separated: astratk, trl")
    ap.add_argument("--eval-every", type=float, default=5.0, help="seconds of training time between snapshots")
    ap.add_argument("--eval-fine", default="0:1", metavar="UNTIL:EVERY",
                    help="denser snapshots at the start: every EVERY s up to UNTIL s of training (30:1), then "
                         "every --eval-every s")
    ap.add_argument("--heldout", type=int, default=512, help="held-out tasks each snapshot is evaluated on")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vs_trl")
    ap.add_argument("--quick", action="store_true", help="smoke: a few seconds per run, 64 held-out, 1 seed, 1 lr")
    ap.add_argument("--astratk-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a run-spec override: top-level dotted keys go to load_spec (eval.max_tasks=8), "
                         "policies.N.* keys are set on the spec (policies.0.trainer.precision=bf16-mixed)")
    ap.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a GRPOConfig field for the TRL side (scale_rewards=none)")
    ap.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1, help="torch threads of the TRL process")
    ap.add_argument("--trl-rows", type=int, default=0,
                    help="train tasks handed to TRL's dataset (default: max(4096, 64 x --seconds))")
    ap.add_argument("--poll-s", type=float, default=0.2, help="how often the astratk side's store is read")
    ap.add_argument("--child-timeout-s", type=float, default=900.0, help="TRL process: limit beyond --seconds")
    ap.add_argument("--verbose", action="store_true", help="show both sides' own output")
    ap.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--report", type=Path, default=None, metavar="JSON",
                    help="print the comparison of a saved <model>.json or <model>.runs.json and exit")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.eval_every, args.heldout, args.seeds, args.sweep_seeds = 6.0, 2.0, 64, 1, 1
        args.lrs = "1e-4" if args.lrs == ap.get_default("lrs") else args.lrs.split(",")[0]
    try:
        until, every = (float(x) for x in str(args.eval_fine).split(":"))
    except ValueError:
        ap.error(f"--eval-fine: UNTIL:EVERY in seconds, e.g. 30:1; got {args.eval_fine!r}")
    if until < 0 or every <= 0:
        ap.error(f"--eval-fine: UNTIL >= 0 and EVERY > 0; got {args.eval_fine!r}")
    args.fine_until, args.fine_every = until, every
    args.lr_list = [float(x) for x in str(args.lrs).split(",") if x.strip()]
    args.side_list = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in args.side_list if s not in SIDES]
    if bad or not args.side_list:
        ap.error(f"--sides: choose from {', '.join(SIDES)}; got {args.sides!r}")
    if args.sweep_seeds < 1 or args.seeds < args.sweep_seeds:
        ap.error("--sweep-seeds must be >= 1 and <= --seeds")
    if args.seconds <= 0 or args.eval_every <= 0:
        ap.error("--seconds and --eval-every must be > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.trl_child:
        trl_child(args.trl_child)
        return
    if args.report:
        report(args.report)
        return
    if "trl" in args.side_list:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("the TRL side needs trl: pip install -e '.[bench]' (or --sides astratk)") from None
    import torch

    from astratk.models.cache import ensure_model

    threads = os.cpu_count() or 1
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model == "smollm2":  # a real model: +10 and +20 points, the rollout's token budget in the evaluation
        import _vs_trl_real

        global GAINS, HEADLINE_GAIN
        GAINS, HEADLINE_GAIN = _vs_trl_real.GAINS, _vs_trl_real.GAINS[0]
    stem_name = args.model + ("-lora" if args.lora else "")
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp_name:
        tmp = Path(tmp_name)
        spec = astratk_spec(args, tmp)
        env = spec.env
        from _vs_trl_real import trl_shape

        args.trl_shape = trl_shape(spec)
        t = time.perf_counter()
        with torch_threads(1):  # the warm start trains on one thread anyway
            model_dir = ensure_model(spec.policies[0].model, env, log=lambda s: print(f"  {s}"))
        build_s = time.perf_counter() - t
        warm_file = model_dir / "warm_start.json"
        warm = json.loads(warm_file.read_text()) if warm_file.exists() else {}  # a real model has no warm start
        if args.lora:
            evaluate = _vs_trl_real.LoraHeldOut(model_dir, env, args.heldout, threads, spec.rollout.max_new_tokens)
        else:
            evaluate = HeldOut(model_dir, env, args.heldout, threads,
                               spec.rollout.max_new_tokens if args.model == "smollm2" else None)
        params = sum(p.numel() for p in evaluate.model.parameters())
        built = (f"warm start {warm['steps']} steps, {warm['seconds']:.0f} s when built" if warm else
                 "a pretrained model")
        print(f"model {stem_name}: {model_dir} ({params / 1e6:.2f}M parameters; {built}; this call took "
              f"{build_s:.0f} s)")
        initial = evaluate(evaluate.initial_state)
        print(f"initial held-out accuracy {100 * initial:.1f}% on {args.heldout} tasks; targets "
              + ", ".join(f"+{round(100 * g)} points = {100 * (initial + g):.1f}%" for g in GAINS))
        env_file = tmp / "env.pkl"
        env_file.write_bytes(pickle.dumps(env))
        marks = marks_for(args.seconds, args.eval_every, args.fine_until, args.fine_every)

        runs: list[dict[str, Any]] = []

        def one(side: str, lr: float, seed: int, phase: str) -> dict[str, Any]:
            t = time.perf_counter()
            print(f"[{side}] lr {lr:g} seed {seed} ({phase}): training {args.seconds:g} s...", flush=True)
            run = (run_astratk(args, lr, seed, marks, tmp, evaluate, initial) if side == "astratk" else
                   run_trl(args, lr, seed, marks, tmp, model_dir, env_file, evaluate, initial))
            run |= figures(run, initial, args.seconds) | {"phase": phase}
            runs.append(run)
            # every finished run is on disk at once: a crash hours into the protocol keeps what it measured
            partial = args.out / f"{stem_name}.runs.json"
            partial.write_text(json.dumps({"initial_accuracy": initial, "marks_s": marks, "runs": runs},
                                          indent=1, default=float))
            if run.get("summary", {}).get("stopped_early"):
                print(f"[{side}] stopped early: {run['summary']['stop_reason']}")
            print(f"[{side}] lr {lr:g} seed {seed}: {run['steps']} steps in {run['train_time_s']:.1f} s "
                  f"({run['steps_per_s']:.2f}/s, {run['samples_per_s']:.0f} samples/s), accuracy "
                  f"{100 * initial:.1f}% -> {100 * run['accuracy_at_end']:.1f}% (best {100 * run['accuracy_best']:.1f}%)"
                  + "".join(f", +{g} at {_fmt_s(run['time_to'][g])}" for g in run["time_to"]) + "; "
                  f"{time.perf_counter() - t:.0f} s with set-up and evaluation", flush=True)
            return run

        # the sides take turns, run by run, so that a change in the machine's load meanwhile hits both alike
        by_lr: dict[str, dict[float, list[dict[str, Any]]]] = {side: {} for side in args.side_list}
        for lr in args.lr_list:
            for seed in range(args.sweep_seeds):
                for side in args.side_list:
                    by_lr[side].setdefault(lr, []).append(one(side, lr, seed, "sweep"))
        sweep = {side: [summarise(rs) for rs in by_lr[side].values()] for side in args.side_list}
        best_lr = {side: min(sweep[side], key=rank_key)["lr"] for side in args.side_list}
        for seed in range(args.sweep_seeds, args.seeds):
            for side in args.side_list:
                by_lr[side][best_lr[side]].append(one(side, best_lr[side], seed, "seeds"))
        best = {side: summarise(by_lr[side][best_lr[side]]) for side in args.side_list}
        if len(args.lr_list) == 1:
            sweep = {}

    dropped: dict[str, int] = {}
    for r in runs:
        if r["side"] == "astratk" and r["lr"] == best.get("astratk", {}).get("lr"):
            for k, v in r["groups_dropped"].items():
                dropped[k] = dropped.get(k, 0) + v
    text = table(best, sweep, args, dropped)
    g = f"{round(100 * HEADLINE_GAIN)}"
    ratios = {}
    if len(best) == 2:
        a, b = best["astratk"], best["trl"]
        ratios = {f"time_to_{g}_trl_over_astratk": (b["time_to"][g] / a["time_to"][g]
                                                    if math.isfinite(a["time_to"][g]) else math.nan),
                  "steps_per_s_astratk_over_trl": a["steps_per_s"] / b["steps_per_s"]}
    trl_run = next((r for r in runs if r["side"] == "trl"), None)
    print(f"\n{args.model} model ({params / 1e6:.2f}M parameters), {args.seconds:g} s of training per run, "
          f"{args.heldout} held-out tasks, start {100 * initial:.1f}%; {threads} CPU cores "
          f"({platform.processor() or platform.machine()})\n")
    print(text)
    match = matched(runs, best)
    if match is not None:
        ratios["time_to_trl_final_accuracy_trl_over_astratk"] = match["trl_over_astratk"]
        print(_matched_line(match))
    if ratios:
        r25, (ta, tt) = ratios[f"time_to_{g}_trl_over_astratk"], (best[s]["time_to"][g] for s in SIDES)
        said = (f"{r25:.2f}x" if math.isfinite(r25) else "astratk reached it, TRL did not" if math.isfinite(ta)
                else "neither side reached it" if math.isinf(tt) else "TRL reached it, astratk did not")
        print(f"\ntime to +{g} points, TRL / astratk (medians): {said}")
        print(f"optimizer steps/s, astratk / TRL (medians): {ratios['steps_per_s_astratk_over_trl']:.2f}x")
    if trl_run is not None:
        c = trl_run["check"]
        env = ", ".join(f"{k}={v}" for k, v in (trl_run.get("thread_env") or {}).items() if v is not None) or "none"
        print(f"\nTRL {trl_run['trl_version']} ({trl_run['threads']} torch threads; thread variables set: {env}): prompt token ids equal to "
              f"astratk's on {c['prompts_compared']} tasks: {c['prompt_ids_equal']}; stop tokens "
              f"{c['trl_eos_token_ids']} (astratk {c['astratk_stop_token_ids']})")
        print("GRPOConfig: " + ", ".join(f"{k}={v}" for k, v in trl_run["config"].items()))
    payload = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "machine": {"cores": threads, "platform": platform.platform(), "python": platform.python_version(),
                           "torch": torch.__version__},
               "model": {"name": args.model, "dir": str(model_dir), "params": params, "warm_start": warm,
                         "build_or_load_s": build_s, "initial_accuracy": initial, "n_heldout": args.heldout},
               "marks_s": marks, "runs": runs, "sweep": sweep, "best": best, "ratios": ratios, "table": text,
               "matched": match,
               "eval_seconds": evaluate.seconds}
    stem = args.out / stem_name
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=float))
    files = {"json": stem.with_suffix(".json")}
    try:
        files |= plot(runs, initial, stem, f"{args.model} model: held-out accuracy against training time")
    except Exception as e:  # noqa: BLE001 - the numbers are written already
        print(f"plot not written: {type(e).__name__}: {e}")
    print("\n" + "\n".join(f"{k:>5}: {v}" for k, v in files.items()))


if __name__ == "__main__":
    main()
