"""The astratk side of `bench/vs_trl.py`: the run spec (the quickstart's, the large model's or the real model's, with
the bench's settings and `--astratk-set`), the follower that keeps the weights a live run publishes at each mark of
training time, and one astratk run from start to its evaluated snapshots."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from _vs_trl_eval import HeldOut

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tutorials" / "quickstart.yaml"
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


# ------------------------------------------------------------------ KEY=VALUE overrides (--astratk-set, --trl-set)
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


# -------------------------------------------------------------------------------------------------- the astratk spec
def astratk_spec(args: argparse.Namespace, out_dir: Path, lr: float = 1e-4, seed: int = 0, name: str = "vs-trl"):
    """The quickstart spec (or the large model's), with the bench's settings, --astratk-set, then lr/seed/time."""
    from astratk.config import load_spec

    top, nested = [], []
    for key, value in _pairs(args.astratk_set, "--astratk-set"):
        if key in RESERVED or key.replace("[0]", ".0") in RESERVED:
            raise SystemExit(f"--astratk-set {key}: the bench sets it per run (--lrs, --seeds, --seconds, --out)")
        (nested if "." in key and key.split(".", 1)[0] == "policies" else top).append((key, value))
    # periodic evaluation off (the bench evaluates snapshots itself); the run's own first evaluation runs after its
    # first step, beside training (its rollout worker serves it between chunks), and its last one after training:
    # a few tasks, so that the first holds the rollout worker for little of the training clock; no progress lines
    overrides = ["--output_dir", str(out_dir), "--name", name, "--eval.interval_s", "1000000000",
                 "--eval.max_tasks", "16", "--progress", "false", "--seed", str(seed)]
    if args.model == "large":
        overrides += ["--env.init_args.levels", json.dumps(LARGE_LEVELS)]
    for key, value in top:
        overrides += [f"--{key}", value]
    if getattr(args, "task", "sums") == "tool-agent":  # a spec in Python (tutorial 10's): keys set on it
        import _vs_trl_agent

        spec = _vs_trl_agent.agent_spec({"name": name, "output_dir": str(out_dir), "seed": seed,
                                         "eval_interval_s": 1e9, "eval_max_tasks": 2})  # 16 tool episodes: ~2 min
        nested = top + nested
    elif args.model == "smollm2":
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


# --------------------------------------------------------------------------------------------------- the astratk run
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
                evaluate: HeldOut, initial: float, spec: Any = None) -> dict[str, Any]:
    """One run from start to its evaluated snapshots; `spec`: a spec `astratk_spec` made and the caller changed
    (bench/precision.py's loss and rollout dtype), else the bench's own for `lr` and `seed`."""
    from _run_metrics import mismatch_figures

    from astratk.runtime.run import Run

    lines: list[str] = []
    log = print if args.verbose else lines.append
    spec = spec or astratk_spec(args, tmp, lr, seed, name=f"vs-trl-astratk-lr{lr:g}-s{seed}")
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
    mismatch = mismatch_figures(result.files["metrics"])  # |pi - mu|, skipped steps, the loss's fractions
    shutil.rmtree(result.run_dir, ignore_errors=True)
    return {"side": "astratk", "lr": lr, "seed": seed, "steps": int(s["steps"]), "train_time_s": s["train_time_s"],
            "samples": samples, "groups_received": int(counters.get(key + "groups_received", 0)),
            "samples_before_training": (None if "error" in follower.counters0 else  # None: counted in `samples`
                                        follower.counters0.get(key + "samples_received", 0.0)),
            "groups_dropped": dropped, "wall_s": time.time() - wall, **rss.figures(), **mismatch,
            "rollout_tokens_per_s": sum(float(r.get("tokens_per_s", 0.0)) for r in run.session.service_rows.values()),
            "summary": {k: v for k, v in s.items() if isinstance(v, (int, float, str, bool)) or v is None},
            "snapshots": follower.snapshots}

