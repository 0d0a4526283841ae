"""An agent written with the `openai` client, trained unchanged through `AgentEnv` (issue 18): does its reward rise?

    python bench/agent_env.py                  # ~20 min on 2 CPU cores: warm start (~12 min, cached after the first run) + 300 s
    python bench/agent_env.py --seconds 60 --heldout 32
    python bench/agent_env.py --report bench/results/agent_env/runs/<run>   # table and curve of a finished run

The task is `astratk.envs.price_lookup`: each question asks for the price of an item that only a `lookup` tool knows
(every question has its own random prices), so a right answer takes two calls: the tool call, then the number from the
tool's result. The agent is `astratk.envs.price_lookup.agent` (an `openai`-client tool loop); the model is the tiny
Qwen2 (0.8 M parameters) warm-started on good episodes until 85% of their turns are reproduced exactly, then trained
asynchronously with DRPO. Held-out accuracy is the agent's reward with greedy decoding, evaluated through the same
agent on 128 held-out questions. Prints the accuracy curve and the agent's per-episode metrics, and writes them (JSON)
and the curve (hvplot, PNG) under `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

AGENT_METRICS = ("calls", "tool_calls", "tool_call_errors", "tokens_per_call", "endpoint_latency_s", "reused_turns",
                 "segments_dropped", "agent_error", "agent_timeout", "env_tokens", "policy_tokens")


def spec(args: argparse.Namespace):
    from astratk.envs import price_lookup
    from astratk.envs.agent import AgentEnv
    from astratk.losses.drpo import DRPO
    from astratk.spec import EvalSpec, ModelSpec, PolicySpec, RolloutSpec, RunSpec, TinyModelSpec, TrainerSpec

    env = AgentEnv(price_lookup.rows(4000, seed=0), price_lookup.agent, price_lookup.reward, heldout=args.heldout,
                   demonstrations=price_lookup.demonstrations)
    return RunSpec(
        name="agent-bench", output_dir=str(args.out / "runs"), env=env, seed=args.seed,
        policies=[PolicySpec(
            model=ModelSpec(tiny=TinyModelSpec(warm_start_steps=2500, warm_start_target=0.85)),
            loss=DRPO(delta=0.2), trainer=TrainerSpec(max_time_s=args.seconds, max_steps=100_000, groups_per_step=8,
                                                      lr=args.lr))],
        rollout=RolloutSpec(group_size=8, max_new_tokens=80, tasks_per_chunk=8),
        eval=EvalSpec(interval_s=args.eval_every, max_tasks=args.heldout), progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="training time")
    ap.add_argument("--eval-every", type=float, default=30.0, help="seconds of training between evaluations")
    ap.add_argument("--heldout", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "agent_env")
    ap.add_argument("--report", type=Path, default=None, metavar="RUN_DIR",
                    help="run nothing: print and draw a finished run's metrics.nc (RUN_DIR/metrics.nc)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    if args.report is not None:
        import xarray as xr

        if not (args.report / "metrics.nc").is_file():
            sys.exit(f"--report: no metrics.nc in {args.report} (give the directory a run wrote)")
        ds, run_dir = xr.open_dataset(args.report / "metrics.nc"), args.report
    else:
        import astratk

        result = astratk.Run(spec(args)).start()
        ds, run_dir = result.metrics(), result.run_dir
    ev = ds[["eval_accuracy", "eval_version", "eval_train_time_s"]].sel(policy="main")
    curve, seen = [], set()
    for a, v, t in zip(ev["eval_accuracy"].values, ev["eval_version"].values, ev["eval_train_time_s"].values):
        if math.isnan(a) or v in seen:  # not evaluated, or the final version evaluated again at the end
            continue
        seen.add(v)
        curve.append({"version": int(v), "train_time_s": 0.0 if math.isnan(t) else float(t), "accuracy": float(a)})
    metrics = {}
    for name in AGENT_METRICS:
        key = f"data_traj_policy_{name}_mean"
        if key in ds:
            metrics[name] = float(ds[key].sel(policy="main"))
    steps = int(ds["step"].size) if "step" in ds.dims else None
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "curve": curve, "agent": metrics, "steps": steps,
           "wall_s": None if args.report else time.time() - t0, "run_dir": str(run_dir)}
    (args.out / "agent_env.json").write_text(json.dumps(out, indent=1))
    print("\nheld-out accuracy (version, train time s: accuracy):")
    for point in curve:
        print(f"  v{point['version']:<4} {point['train_time_s']:>7.1f}: {100 * point['accuracy']:.1f}%")
    print(f"optimizer steps: {steps}")
    print("per episode: " + ", ".join(f"{k} {v:.3g}" for k, v in metrics.items()))
    try:
        import holoviews as hv
        import hvplot.pandas  # noqa: F401
        import pandas as pd

        hv.extension("matplotlib", logo=False)
        frame = pd.DataFrame(curve)
        plot = frame.hvplot.line(x="train_time_s", y="accuracy", title="AgentEnv: price lookup, held-out accuracy",
                                 xlabel="training time (s)", ylabel="held-out accuracy", ylim=(0, 1))
        plot = plot * frame.hvplot.scatter(x="train_time_s", y="accuracy")
        hv.save(plot, args.out / "agent_env.png", backend="matplotlib", dpi=90)
        print(f"curve: {args.out / 'agent_env.png'}")
    except Exception as e:  # noqa: BLE001 - the JSON is the result; a plotting failure is reported
        print(f"plot failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
