"""DRPO's precision claim on a real model: bf16 rollouts against an fp32 trainer, under DRPO, DPPO and PPO-clip
(issue 43, item 7).

DRPO exists for the training / inference mismatch: the engine that samples (mu) and the trainer that computes log pi
differ, here because the engine runs in bfloat16 while the trainer stays in float32. bf16 puts far more |pi - mu| into
every ratio than fp32 rollouts do, and a bf16 engine is faster where the CPU has bf16 units (AMX / AVX512-BF16). The
question: do bf16 rollouts reach the same held-out accuracy sooner, and which losses survive them?

Grid: modes (LoRA, full fine-tuning) x losses x rollout dtypes x seeds, each cell one real run of tutorial 09's task
(SmolLM2-135M-Instruct, one- and two-digit sums asked in words; `tutorials/real_model.yaml` as bench/vs_trl.py's
`--model smollm2` builds it: 8 groups of 8 per step, 32 new tokens, T = 0.7; lr 5e-4 with LoRA, 1e-5 full), the
trainer always float32 (`trainer.precision: 32`). The bf16 cells set `rollout.engine_args.dtype: bfloat16` (and
publish full weights in bf16, `weights.publish_dtype`, which the engine would cast to anyway). Every cell keeps its
weights every `--eval-every` s of training time; after the run, one fp32 evaluation shared by every cell (greedy, the
env's first `--heldout` held-out tasks) scores them, outside the training clock (bench/vs_trl.py's protocol).

Per cell: time to +10 and +20 points, accuracy at the end and best, a collapse flag (non-finite steps, more than half
of the best gain lost by the end, or 10 points below the start: bench/_run_metrics.py), |pi - mu| (mean and max over
the run's steps), the loss's mask / clip fractions, steps, rollout tokens/s. Seeds run seed-major and the cells of a
seed take turns, so a change in the machine's load hits every cell alike. Each cell runs in a process of its own (one
run's memory cannot carry into the next) and appends to `--out/cells.jsonl` as it finishes (`--resume` skips those
there); then `--out/precision.json` and the markdown table.

    python bench/precision.py                                    # LoRA and full, 3 losses x 2 dtypes x 3 seeds
    python bench/precision.py --modes lora --seconds 180         # LoRA only
    python bench/precision.py --modes full --seeds 1 --resume    # add full fine-tuning cells to the same folder
    python bench/precision.py --report                           # the table of the cells run so far
    python bench/precision.py --quick                            # smoke: LoRA, DRPO, both dtypes, a few seconds
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _vs_trl_real
import _vs_trl_report
from _run_metrics import collapsed
from _vs_trl_astratk import ROOT, astratk_spec, run_astratk
from _vs_trl_eval import marks_for, torch_threads

MODES = {"lora": 5e-4, "full": 1e-5}  # mode -> lr (tutorial 09's: adapters 5e-4, every weight 1e-5)
LOSSES = {"drpo": "drpo", "dppo": "dppo_tv", "ppo_clip": "ppo_clip"}  # label -> registry name, paper defaults
DTYPES = ("float32", "bfloat16")
GAINS = _vs_trl_real.GAINS  # +10 and +20 points


# ---------------------------------------------------------------------------------------------------------- cells
def grid(args: argparse.Namespace) -> list[tuple[str, int, str, str]]:
    """(mode, seed, loss, dtype), mode by mode, seed-major, the dtypes of a loss next to each other."""
    return [(mode, seed, loss, dtype) for mode in args.mode_list for seed in range(args.seeds)
            for loss in args.loss_list for dtype in args.dtype_list]


def cell_key(mode: str, seed: int, loss: str, dtype: str) -> str:
    return f"{mode}:{loss}:{dtype}:{seed}"


def vs_trl_args(args: argparse.Namespace, mode: str) -> argparse.Namespace:
    """The settings bench/vs_trl.py's astratk side reads (its `--model smollm2`, LoRA or full, this bench's budget)."""
    return argparse.Namespace(model="smollm2", lora=mode == "lora", task="sums", seconds=args.seconds,
                              astratk_set=[], poll_s=0.2, verbose=args.verbose)


def cell_spec(args: argparse.Namespace, mode: str, seed: int, loss: str, dtype: str, tmp: Path) -> Any:
    """Tutorial 09's spec as bench/vs_trl.py runs it, with the cell's loss, rollout dtype, lr and seed."""
    from astratk.registry import resolve

    spec = astratk_spec(vs_trl_args(args, mode), tmp, MODES[mode], seed, name=f"precision-{mode}-{loss}-{dtype}-s{seed}")
    p = spec.policies[0]
    p.loss = resolve("loss", LOSSES[loss])()
    p.trainer.precision = "32-true"  # the trainer computes log pi in float32 in every cell
    spec.rollout.engine_args = {**spec.rollout.engine_args, "dtype": dtype}
    if dtype == "bfloat16" and mode == "full":
        spec.weights.publish_dtype = "bfloat16"  # the engine casts to it anyway: half the bytes to publish
    return spec.validate()


def run_cell(args: argparse.Namespace, mode: str, seed: int, loss: str, dtype: str, evaluate: Any, initial: float,
             tmp: Path) -> dict[str, Any]:
    bench_args = vs_trl_args(args, mode)
    spec = cell_spec(args, mode, seed, loss, dtype, tmp)
    marks = marks_for(args.seconds, args.eval_every)
    run = run_astratk(bench_args, MODES[mode], seed, marks, tmp, evaluate, initial, spec=spec)
    run |= _vs_trl_report.figures(run, initial, args.seconds)
    accuracies = [p["accuracy"] for p in run["curve"][1:]]
    stop = str(run["summary"].get("stop_reason") or "")
    nonfinite = run["skipped_steps"] > 0 or (bool(run["summary"].get("stopped_early")) and "diverg" in stop)
    run.update(mode=mode, loss=loss, dtype=dtype, key=cell_key(mode, seed, loss, dtype), initial=initial,
               seconds=args.seconds,
               collapsed=collapsed(initial, accuracies, nonfinite), nonfinite=nonfinite)
    run.pop("snapshots", None)  # the curve holds what the table needs
    return run


# --------------------------------------------------------------------------------------------------------- report
def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else math.nan


def _t(x: float | None) -> float:
    return math.inf if x is None else float(x)


def summarise(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, loss, dtype): medians over its seeds, per-seed times, collapses."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["mode"], c["loss"], c["dtype"]), []).append(c)
    rows = []
    for (mode, loss, dtype), cs in groups.items():
        cs.sort(key=lambda c: c["seed"])
        times = {g: [_t(c["time_to"].get(g)) for c in cs] for g in (f"{round(100 * x)}" for x in GAINS)}
        rows.append({
            "mode": mode, "loss": loss, "dtype": dtype, "n": len(cs), "seeds": [c["seed"] for c in cs],
            "initial": cs[0]["initial"],
            "time_to": {g: _median(v) for g, v in times.items()}, "time_to_per_seed": times,
            "accuracy_at_end": _median([c["accuracy_at_end"] for c in cs]),
            "accuracy_best": _median([c["accuracy_best"] for c in cs]),
            "collapses": sum(bool(c["collapsed"]) for c in cs),
            "steps": _median([c["steps"] for c in cs]),
            "rollout_tokens_per_s": _median([c.get("rollout_tokens_per_s", math.nan) for c in cs]),
            "pi_mu_abs_mean": _median([c.get("pi_mu_abs_mean", math.nan) for c in cs]),
            "pi_mu_abs_mean_first": _median([c.get("pi_mu_abs_mean_first", math.nan) for c in cs]),
            "pi_mu_abs_max": max((c.get("pi_mu_abs_max", math.nan) for c in cs), default=math.nan),
            "skipped_steps": sum(int(c.get("skipped_steps", 0)) for c in cs),
            "fractions": {k: _median([c.get("fractions", {}).get(k, math.nan) for c in cs])
                          for k in sorted({k for c in cs for k in c.get("fractions", {})})},
        })
    order = {m: i for i, m in enumerate(MODES)} | {loss: i for i, loss in enumerate(LOSSES)} | \
        {d: i for i, d in enumerate(DTYPES)}
    rows.sort(key=lambda r: (order.get(r["mode"], 99), order.get(r["loss"], 99), order.get(r["dtype"], 99)))
    return rows


def decide(rows: list[dict[str, Any]]) -> list[str]:
    """Per mode: does DRPO with bf16 rollouts reach each target sooner than with fp32 rollouts, without a collapse,
    and is the engine faster in bf16? The lines the table ends with (the decision the docs record)."""
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        by = {(r["loss"], r["dtype"]): r for r in rows if r["mode"] == mode}
        fp, bf = by.get(("drpo", "float32")), by.get(("drpo", "bfloat16"))
        if not fp or not bf:
            continue
        speed = bf["rollout_tokens_per_s"] / fp["rollout_tokens_per_s"] if fp["rollout_tokens_per_s"] else math.nan
        parts = []
        sooner = True
        for g in fp["time_to"]:
            a, b = fp["time_to"][g], bf["time_to"][g]
            sooner &= b <= a
            ratio = "" if not (math.isfinite(a) and math.isfinite(b) and b > 0) else f" ({a / b:.2f}x)"
            parts.append(f"+{g} points in {_fmt(b)} against {_fmt(a)}{ratio}")
        no_collapse = bf["collapses"] == 0
        verdict = "bf16 rollouts pay" if sooner and no_collapse and speed > 1 else "fp32 rollouts stay"
        lines.append(f"{mode}, DRPO: bf16 rollouts reach {', '.join(parts)} (medians of {bf['n']} and {fp['n']}); "
                     f"collapses bf16 {bf['collapses']}/{bf['n']}, fp32 {fp['collapses']}/{fp['n']}; engine "
                     f"{speed:.2f}x the tokens/s in bf16 -> {verdict}")
    return lines


def _fmt(x: float) -> str:
    return "never" if not math.isfinite(x) else f"{x:.0f} s"


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:.1f}%"


def _sci(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.2e}"


def table(rows: list[dict[str, Any]], seconds: float) -> str:
    gains = [f"{round(100 * g)}" for g in GAINS]
    head = ("| mode | loss | rollouts | seeds | " + " | ".join(f"time to +{g} (median; per seed)" for g in gains)
            + f" | accuracy at {seconds:.0f} s | best | collapses | steps | rollout tokens/s | mean / max abs(pi - mu) "
            "| first step's mean abs(pi - mu) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        times = [f"{_fmt(r['time_to'][g])}; " + ", ".join(_fmt(t) for t in r["time_to_per_seed"][g]) for g in gains]
        out.append(f"| {r['mode']} | {r['loss']} | {r['dtype']} | {r['n']} | " + " | ".join(times)
                   + f" | {_pct(r['accuracy_at_end'])} (from {_pct(r['initial'])}) | {_pct(r['accuracy_best'])} | "
                   f"{r['collapses']}/{r['n']} | {r['steps']:.0f} | {r['rollout_tokens_per_s']:.0f} | "
                   f"{r['pi_mu_abs_mean']:.2e} / {r['pi_mu_abs_max']:.2f} | {_sci(r['pi_mu_abs_mean_first'])} |")
    return "\n".join(out)


def report(out: Path, seconds: float | None = None) -> dict[str, Any]:
    cells = read_cells(out)
    if not cells:
        raise SystemExit(f"no cells in {out / 'cells.jsonl'} yet: run the grid first")
    seconds = seconds or max(c.get("seconds", c["train_time_s"]) for c in cells)
    rows = summarise(cells)
    text = table(rows, seconds) + "\n\n" + "\n".join(decide(rows))
    print(text)
    (out / "precision.md").write_text(text + "\n")
    payload = {"rows": rows, "decision": decide(rows), "cells": cells}
    (out / "precision.json").write_text(json.dumps(payload, indent=1, default=float))
    return payload


def read_cells(out: Path) -> list[dict[str, Any]]:
    path = out / "cells.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# ----------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="lora,full", help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated: {', '.join(LOSSES)}")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="rollout engine dtypes: float32, bfloat16")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=180.0, help="training time per cell")
    ap.add_argument("--eval-every", type=float, default=30.0, help="seconds of training between kept snapshots")
    ap.add_argument("--heldout", type=int, default=64, help="held-out tasks each snapshot is evaluated on")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "precision")
    ap.add_argument("--resume", action="store_true", help="skip the cells already in --out/cells.jsonl")
    ap.add_argument("--report", action="store_true", help="print the table of --out's cells and exit")
    ap.add_argument("--quick", action="store_true", help="smoke: LoRA, DRPO, both dtypes, 1 seed, a few seconds")
    ap.add_argument("--verbose", action="store_true", help="show each run's own output")
    ap.add_argument("--one-cell", default=None, help=argparse.SUPPRESS)  # mode:loss:dtype:seed, in a child process
    ap.add_argument("--initial", default=None, help=argparse.SUPPRESS)  # the starting accuracy, for --one-cell
    args = ap.parse_args(argv)
    if args.quick:
        args.modes, args.losses, args.seeds, args.seconds, args.eval_every = "lora", "drpo", 1, 45.0, 20.0
        args.heldout = min(args.heldout, 8)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.loss_list = [x.strip() for x in args.losses.split(",") if x.strip()]
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for name, got, allowed in (("--modes", args.mode_list, MODES), ("--losses", args.loss_list, LOSSES),
                               ("--dtypes", args.dtype_list, DTYPES)):
        bad = [x for x in got if x not in allowed]
        if bad or not got:
            ap.error(f"{name}: choose from {', '.join(allowed)}; got {bad or got}")
    if args.seeds < 1 or args.seconds <= 0 or args.eval_every <= 0 or args.heldout < 1:
        ap.error("--seeds, --seconds, --eval-every and --heldout must be positive")
    return args


def evaluator(args: argparse.Namespace, mode: str) -> Any:
    """The fp32 evaluation every snapshot of `mode`'s cells is scored by (the starting model's weights loaded)."""
    import torch

    from astratk.models.cache import ensure_model

    with tempfile.TemporaryDirectory(prefix="precision-") as tmp:
        spec = astratk_spec(vs_trl_args(args, mode), Path(tmp))
    with torch_threads(1):
        model_dir = ensure_model(spec.policies[0].model, spec.env, log=lambda s: print(f"  {s}"))
    threads, new_tokens = torch.get_num_threads(), spec.rollout.max_new_tokens
    return (_vs_trl_real.LoraHeldOut(model_dir, spec.env, args.heldout, threads, new_tokens) if mode == "lora" else
            _vs_trl_real.full_heldout(model_dir, spec.env, args.heldout, threads, new_tokens))


def one_cell(args: argparse.Namespace) -> None:
    """`--one-cell mode:loss:dtype:seed`: run it, append it to --out/cells.jsonl, print its line."""
    mode, loss, dtype, seed = args.one_cell.split(":")
    evaluate, initial = evaluator(args, mode), float(args.initial)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="precision-") as tmp:
        run = run_cell(args, mode, int(seed), loss, dtype, evaluate, initial, Path(tmp))
    with (args.out / "cells.jsonl").open("a") as f:
        f.write(json.dumps(run, default=float) + "\n")
    flag = " COLLAPSED" if run["collapsed"] else ""
    print(f"[{run['key']}] {run['steps']} steps, {100 * initial:.1f}% -> "
          f"{100 * run['accuracy_at_end']:.1f}% (best {100 * run['accuracy_best']:.1f}%)"
          + "".join(f", +{g} at {_fmt(_t(v))}" for g, v in run["time_to"].items())
          + f"; |pi - mu| {run['pi_mu_abs_mean']:.2e} mean, {run['pi_mu_abs_max']:.2f} max, first step "
          f"{_sci(run['pi_mu_abs_mean_first'])}; {run['rollout_tokens_per_s']:.0f} rollout tokens/s{flag}; "
          f"{time.perf_counter() - t:.0f} s with set-up and evaluation", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _vs_trl_report.GAINS = GAINS  # the time-to rows `figures` computes: +10 and +20 points
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        report(args.out)
        return
    if args.one_cell:
        one_cell(args)
        return
    from astratk.cpu import has_bf16_units

    if "bfloat16" in args.dtype_list and not has_bf16_units():
        print("note: this CPU has no bf16 units (AMX / AVX512-BF16): bf16 rollouts run slower than fp32 here, so "
              "the bf16 cells measure the mismatch, not the speed a bf16 machine would give")
    done = {c["key"] for c in read_cells(args.out)} if args.resume else set()
    if not args.resume:
        (args.out / "cells.jsonl").unlink(missing_ok=True)
    for mode in args.mode_list:
        cells = [c for c in grid(args) if c[0] == mode and cell_key(*c) not in done]
        if not cells:
            continue
        evaluate = evaluator(args, mode)
        initial = evaluate(evaluate.initial_state)
        del evaluate
        print(f"{mode}: initial held-out accuracy {100 * initial:.1f}% on {args.heldout} tasks; {len(cells)} "
              f"cells of {args.seconds:g} s", flush=True)
        for cell in cells:
            # each cell in a process of its own: one run's memory cannot carry into the next, and a cell that dies
            # (the kernel's OOM killer) costs that cell only; --resume reruns it
            cmd = [sys.executable, __file__, "--one-cell", cell_key(*cell), "--initial", repr(initial),
                   "--seconds", str(args.seconds), "--eval-every", str(args.eval_every), "--heldout",
                   str(args.heldout), "--out", str(args.out), *(["--verbose"] if args.verbose else [])]
            proc = subprocess.run(cmd, check=False)
            if proc.returncode != 0:
                print(f"[{cell_key(*cell)}] failed (exit {proc.returncode}); --resume runs it again", flush=True)
    report(args.out, args.seconds)


if __name__ == "__main__":
    main()
