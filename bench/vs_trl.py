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
    python bench/vs_trl.py --model smollm2 --lora --task tool-agent --seconds 600 --lrs 5e-4 --eval-every 120 --heldout 64

`--model smollm2`: SmolLM2-135M-Instruct, a real pretrained chat model (tutorials/real_model.yaml: one- and two-digit
sums asked in words, the last number graded; 8 prompts x 8 samples, 32 new tokens, temperature 0.7), full fine-tuning
or, with `--lora`, PEFT LoRA adapters on both sides; targets +10 and +20 points; adds rollout tokens/s and peak RSS
(bench/_vs_trl_real.py). The shared evaluation decodes the rollout's token budget (the model answers in sentences).

`--task tool-agent` (with `--model smollm2 --lora`): tutorial 10's two-tool agent on both sides, TRL through its own
tool loop (`GRPOTrainer(environment_factory=...)`), both from the same warm-started model, evaluated by playing the
held-out questions greedily with the tools (bench/_vs_trl_agent.py).

This script holds the command line and the protocol (the lr sweep, the seeds, the sides taking turns); the parts sit
next to it: bench/_vs_trl_astratk.py (the spec and the astratk run), bench/_vs_trl_trl.py (the TRL run, re-executing
this script with `--trl-child`), bench/_vs_trl_eval.py (the shared held-out evaluation of snapshots) and
bench/_vs_trl_report.py (figures, medians, the table, `--report`, the JSON, HTML and PNG files).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the helpers sit next to this script (its folder is on sys.path); _vs_trl_trl reads the environment as it is now, at
# the script's start, for the TRL process
import _vs_trl_report
from _vs_trl_astratk import LARGE_LEVELS, LARGE_MODEL, ROOT, astratk_spec, run_astratk
from _vs_trl_eval import HeldOut, marks_for, torch_threads
from _vs_trl_report import SIDES, _fmt_s, conclude, figures, rank_key, report, summarise
from _vs_trl_trl import run_trl, trl_child

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# what other bench scripts and the tests import from here (step_profile.py, pass_at_k.py, stability.py)
__all__ = ["LARGE_LEVELS", "LARGE_MODEL", "HeldOut", "astratk_spec", "main", "marks_for", "parse_args",
           "torch_threads"]


# ------------------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("quickstart", "large", "smollm2"), default="quickstart")
    ap.add_argument("--lora", action="store_true", help="--model smollm2: LoRA adapters on both sides")
    ap.add_argument("--task", choices=("sums", "tool-agent"), default="sums",
                    help="tool-agent: tutorial 10's two-tool agent, TRL through its own tool loop (--model smollm2 "
                         "--lora; bench/_vs_trl_agent.py)")
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
    ap.add_argument("--quick", action="store_true", help="smoke: a few seconds per run, 64 held-out (or --heldout), 1 seed, 1 lr")
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
    if args.lora and args.model != "smollm2" and args.trl_child is None:
        ap.error("--lora trains adapters on the pretrained model only: add --model smollm2")
    if args.task == "tool-agent" and not (args.model == "smollm2" and args.lora) and args.trl_child is None:
        ap.error("--task tool-agent trains LoRA adapters on SmolLM2: add --model smollm2 --lora")
    if args.quick:
        heldout = 64 if args.heldout == ap.get_default("heldout") else args.heldout
        args.seconds, args.eval_every, args.heldout, args.seeds, args.sweep_seeds = 6.0, 2.0, heldout, 1, 1
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
    from astratk.models.cache import ensure_model

    threads = os.cpu_count() or 1
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model == "smollm2":  # a real model: +10 and +20 points, the rollout's token budget in the evaluation
        import _vs_trl_real

        # the report's targets, read by every figure, table and ranking of this bench from here on
        _vs_trl_report.GAINS, _vs_trl_report.HEADLINE_GAIN = _vs_trl_real.GAINS, _vs_trl_real.GAINS[0]
    stem_name = args.model + ("-lora" if args.lora else "") + ("-tool-agent" if args.task == "tool-agent" else "")
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp_name:
        tmp = Path(tmp_name)
        spec = astratk_spec(args, tmp)
        env = spec.env
        if args.task == "tool-agent":
            import _vs_trl_agent

            args.trl_shape = _vs_trl_agent.trl_shape(spec)
        else:
            from _vs_trl_real import trl_shape

            args.trl_shape = trl_shape(spec)
        t = time.perf_counter()
        with torch_threads(1):  # the warm start trains on one thread anyway
            model_dir = ensure_model(spec.policies[0].model, env, log=lambda s: print(f"  {s}"))
        build_s = time.perf_counter() - t
        warm_file = model_dir / "warm_start.json"
        warm = json.loads(warm_file.read_text()) if warm_file.exists() else {}  # a real model has no warm start
        if args.task == "tool-agent":
            evaluate = _vs_trl_agent.ToolHeldOut(model_dir, env, args.heldout, threads, spec.rollout.max_new_tokens)
        elif args.lora:
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
              + ", ".join(f"+{round(100 * g)} points = {100 * (initial + g):.1f}%" for g in _vs_trl_report.GAINS))
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
                  f"{100 * initial:.1f}% -> {100 * run['accuracy_at_end']:.1f}% "
                  f"(best {100 * run['accuracy_best']:.1f}%)"
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

    model = {"name": args.model, "dir": str(model_dir), "params": params, "warm_start": warm,
             "build_or_load_s": build_s, "initial_accuracy": initial, "n_heldout": args.heldout}
    conclude(args, runs, best, sweep, model, marks, evaluate.seconds, threads, args.out / stem_name)


if __name__ == "__main__":
    main()
