"""The rows of the GPU suite (`bench/gpu_suite.py` runs them, records them and says what each measures). Each row
takes the suite's `Context` and returns its figures (a flat dict), or raises `Skip` or any error (the row fails)."""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TITLES = {
    "engine_vs_generate": "1. TorchEngine vs transformers generate",
    "trainer_step": "2. DRPO trainer step",
    "publish_full_bf16": "3a. publish -> serving, full bf16",
    "publish_sparse_delta": "3b. publish -> serving, sparse delta",
    "publish_lora": "3c. publish -> serving, LoRA adapter",
    "warm_start": "4a. warm start of the e2e model",
    "e2e_async": "4b. end to end, asynchronous",
    "e2e_sync": "4c. end to end, synchronous",
    "e2e_fsdp": "4d. end to end, FSDP (one device)",
}
# the figures the markdown table shows (the JSON has them all)
HEADLINE = {
    "engine_vs_generate": ("hf_tokens_per_s", "engine_tokens_per_s", "ratio", "engine_gqa_tokens_per_s",
                           "ratio_gqa"),
    "trainer_step": ("tokens_per_s", "mfu_vs_spec", "mfu_vs_measured", "peak_memory_gib", "step_s"),
    "publish_full_bf16": ("publish_s", "serve_s", "latency_s", "payload_mb"),
    "publish_sparse_delta": ("publish_s", "serve_s", "latency_s", "payload_mb", "payload_vs_full"),
    "publish_lora": ("publish_s", "serve_s", "latency_s", "payload_mb", "payload_vs_full"),
    "warm_start": ("parameters_m", "seconds", "steps", "heldout_accuracy"),
    "e2e_async": ("time_to_target_s", "steps_per_s", "steps", "accuracy_before", "accuracy_after"),
    "e2e_sync": ("time_to_target_s", "steps_per_s", "steps", "accuracy_before", "accuracy_after"),
    "e2e_fsdp": ("steps", "steps_per_s", "final_version", "accuracy_after"),
}
# Dense bf16 tensor-core peaks from NVIDIA's spec sheets (TFLOP/s; the sheets print twice these, "with sparsity").
SPEC_PEAKS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 SXM": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.5,
              "A100": 312.0, "L40S": 362.1, "A10": 125.0}


class Skip(Exception):
    """A row that cannot run in this build or on this device; the message says why."""


@dataclasses.dataclass
class Context:
    """What rows share: the sizes, a scratch folder, the random model (built once), the e2e model."""

    sizes: Any
    tmp: Path
    log: Callable[[str], None]
    peaks: tuple[float | None, float] = (None, float("nan"))
    random_dir: str | None = None
    random_params: int = 0
    full_bf16_bytes: int = 0  # a full bf16 publication of the random model (its tied embedding under both names)
    tiny_dir: str | None = None

    @property
    def device(self) -> torch.device:
        from astratk.gpu import resolve_device

        return torch.device(resolve_device("auto"))

    @property
    def dtype(self) -> str:
        """The engines' `dtype: auto` here: bfloat16 on a GPU with it, else float32."""
        from astratk.gpu import resolve_dtype

        return resolve_dtype("auto", str(self.device))

    def release(self) -> None:
        """After a row: free what it left on the GPU, so the next row (and its memory check) starts clean."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def random_model(self) -> str:
        """The randomly initialised Qwen2 model of rows 1-3, built on the device and saved in the engines' dtype."""
        if self.random_dir is None:
            from transformers import Qwen2Config, Qwen2ForCausalLM

            from bench.engine_throughput import RANDOM_MODELS

            config = Qwen2Config(**RANDOM_MODELS[self.sizes.random_model], tie_word_embeddings=True,
                                 max_position_embeddings=4096, rope_theta=1e6, initializer_range=0.02)
            torch.manual_seed(0)
            with torch.device(self.device):  # initialised where it runs: seconds, not a minute on CPU cores
                model = Qwen2ForCausalLM(config).to(getattr(torch, self.dtype))
            self.random_params = sum(p.numel() for p in model.parameters())
            self.full_bf16_bytes = 2 * sum(t.numel() for t in model.state_dict().values())
            self.random_dir = str(self.tmp / "random-model")
            model.save_pretrained(self.random_dir)
            del model
            self.release()
            self.log(f"random Qwen2 model: {self.random_params / 1e9:.3f} B parameters, {self.dtype}")
        return self.random_dir


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def spec_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a known GPU from its spec sheet (None: not in the table, or the CPU)."""
    for name, peak in SPEC_PEAKS.items():
        if name in device_name:
            return peak
    return None


def measured_peak_tflops() -> float:
    """A large matrix product's rate here: bf16 8192^3 on a GPU (mean of 10 after 3 warm-ups), fp32 1024^3 on the
    CPU (the smoke run's denominator)."""
    cuda = torch.cuda.is_available()
    n, dtype, device = (8192, torch.bfloat16, "cuda") if cuda else (1024, torch.float32, "cpu")
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    _sync()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync()
    return 2 * n**3 * 10 / (time.perf_counter() - start) / 1e12


# -------------------------------------------------------------------------------------------- 1. generation


def engine_vs_generate(ctx: Context) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from astratk.engines import TorchEngine
    from astratk.engines.torch_kvcache import _GQA_ATTENTION
    from bench.engine_throughput import prompts, run_engine, run_hf, throughput

    s, path = ctx.sizes, ctx.random_model()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, ctx.dtype)).eval().to(ctx.device)
    engine = TorchEngine(path, max_batch=s.prompts)  # device and dtype: auto, as a run config leaves them
    # grouped-K/V decode attention: the engine's own choice on the CPU (the same as `engine` there); on a GPU the
    # engine keeps HF's sdpa, and this side measures whether it should switch
    gqa = TorchEngine(path, max_batch=s.prompts)
    gqa._model.set_attn_implementation(_GQA_ATTENTION)
    sides = {"hf": (run_hf, hf), "engine": (run_engine, engine), "engine_gqa": (run_engine, gqa)}
    try:
        batch = prompts(s.prompts, hf.config.vocab_size, seed=1)
        rates = throughput(sides, batch, s.new_tokens, s.repeats)
    finally:
        engine.close()
        gqa.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    out = {"parameters_b": round(ctx.random_params / 1e9, 3), "dtype": ctx.dtype, "device": str(engine._device),
           "prompts": s.prompts, "new_tokens": s.new_tokens, "repeats": s.repeats,
           "hf_tokens_per_s": med["hf"], "engine_tokens_per_s": med["engine"], "ratio": med["engine"] / med["hf"],
           "engine_gqa_tokens_per_s": med["engine_gqa"], "ratio_gqa": med["engine_gqa"] / med["hf"]}
    return out


# ----------------------------------------------------------------------------------------------- 2. training


def synthetic_batch(rows: int, tokens: int, vocab: int, seed: int = 0) -> Any:
    """A DRPO step's batch of `rows` full sequences of `tokens` tokens: a quarter prompt, the rest completion with
    behaviour log-probs near uniform (what a random model samples) and +-1 advantages, 8 samples per group."""
    from astratk.records import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, tokens), generator=g)
    mask = torch.zeros(rows, tokens - 1)
    mask[:, tokens // 4:] = 1.0
    behavior = (-torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(rows, tokens - 1, generator=g)) * mask
    advantages = torch.where(torch.rand(rows, 1, generator=g) < 0.5, -1.0, 1.0) * mask
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask, behavior_logprobs=behavior,
                      advantages=advantages, weights=mask.clone(), versions=torch.zeros(rows, tokens - 1,
                                                                                        dtype=torch.long),
                      n_groups=max(1, rows // 8), rewards=(advantages[:, -1] > 0).float(), roles=("policy",) * rows)


def model_flops_per_token(config: Any, params: int, seq: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM's convention (arXiv 2204.02311, App. B): 6 N for the
    weights (N counts the tied embedding once: the LM head's matmul) plus 12 L H Q T for attention, no causal
    discount."""
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6 * params + 12 * layers * heads * head_dim * seq


def step_timer() -> Any:
    """A Lightning callback whose `seconds` holds each optimiser step's wall time, the device synchronised at both
    ends (made here: Lightning is imported by the rows that train)."""
    from astratk.training._pl import pl

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            _sync()
            self._start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            _sync()
            self.seconds.append(time.perf_counter() - self._start)

    return StepTimer()


def trainer_step(ctx: Context) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from astratk.spec import PolicySpec, RunSpec, TrainerSpec
    from astratk.training import build
    from astratk.training._pl import pl
    from astratk.training.module import PolicyModule

    s, path = ctx.sizes, ctx.random_model()
    steps = s.warmup_steps + s.timed_steps
    # precision: auto; no checkpoint (Lightning would write the model and Adam's state into the working directory)
    ts = TrainerSpec(max_steps=steps, micro_batch_tokens=s.micro_batch_tokens, loggers=[], checkpoint_every=0)
    spec = RunSpec(policies=[PolicySpec(trainer=ts)], progress=False)
    module = PolicyModule(path, **build.module_args(spec, "main"))
    config = module.model.config
    batch = synthetic_batch(s.train_rows, s.train_tokens, config.vocab_size)
    timer = step_timer()
    flags = build.trainer_flags(ts)
    trainer = pl.Trainer(**flags, logger=False, callbacks=[timer])
    loader = DataLoader([batch] * steps, batch_size=None, collate_fn=lambda x: x)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, loader)
    step_s = statistics.median(timer.seconds[s.warmup_steps:])
    tokens = s.train_rows * s.train_tokens
    achieved = model_flops_per_token(config, sum(p.numel() for p in module.model.parameters()),
                                     s.train_tokens) * tokens / step_s / 1e12
    spec_peak, measured_peak = ctx.peaks
    return {"precision": flags["precision"], "accelerator": flags["accelerator"], "sequences": s.train_rows,
            "tokens_per_sequence": s.train_tokens, "micro_batch_tokens": s.micro_batch_tokens,
            "step_s": step_s, "tokens_per_s": tokens / step_s, "model_tflops_per_s": achieved,
            "mfu_vs_spec": achieved / spec_peak if spec_peak else None, "peak_spec_tflops": spec_peak,
            "mfu_vs_measured": achieved / measured_peak, "peak_measured_tflops": measured_peak,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "flops_convention": "6N + 12 L H Q T per token (PaLM), N with the tied embedding once"}


# ------------------------------------------------------------------------------------------------ 3. publish


def _to(batch: Any, device: torch.device) -> Any:
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device)
                                         for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


def _one_step(module: Any, ctx: Context, lr: float = 1e-6) -> None:
    """One AdamW step of `module` at `lr` on a synthetic batch, in bf16 autocast on a GPU (Lightning's bf16-mixed)."""
    s = ctx.sizes
    module.to(ctx.device).train()
    module.log_dict = lambda *a, **k: None  # no Trainer attached here
    for group in (opt := module.configure_optimizers()).param_groups:
        group["lr"] = lr
    batch = _to(synthetic_batch(s.publish_rows, s.publish_tokens, module.model.config.vocab_size, seed=1),
                ctx.device)
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.device.type == "cuda"):
        loss = module.training_step(batch, 0)
    loss.backward()
    opt.step()
    _sync()


def _publish_to_serving(ctx: Context, *, full_every: int, lora: Any = None) -> dict[str, Any]:
    """Version 0 published and served (setup), one step at lr 1e-6, then the measured part: the trainer publishes
    version 1 (`WeightStore.publish`: copy out in bf16, delta or full, write) and a rollout service syncs its engine
    to it (`RolloutService.sync`: pull, `load_weights`)."""
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService
    from astratk.runtime.deploy import publish_initial
    from astratk.spec import ModelSpec, PolicySpec, RolloutSpec, RunSpec, WeightsSpec
    from astratk.training import build
    from astratk.training.module import PolicyModule
    from astratk.weights.store import WeightStore

    path = ctx.random_model()
    weights = WeightsSpec(full_every=full_every, publish_dtype="bfloat16", keep_last=None)
    model = ModelSpec(path=path) if lora is None else ModelSpec(path=path, lora=lora)
    # bf16 engines on every device (a CPU too), so that bf16 deltas apply: what a GPU run's dtype auto gives
    spec = RunSpec(policies=[PolicySpec(model=model)], weights=weights, progress=False,
                   rollout=RolloutSpec(engine_args={"dtype": "bfloat16"})).validate()
    url = str(ctx.tmp / f"store-{full_every}-{'lora' if lora else 'full'}")
    store = WeightStore.from_spec(url, weights)
    t = time.perf_counter()
    if lora is None:
        publish_initial(store, "main", path)
    else:
        publish_initial(store, "main", path, lora=lora)
    initial_publish_s = time.perf_counter() - t
    service = RolloutService(RunContext("gpu-suite", spec, {"main": path}, url))
    t = time.perf_counter()
    service.sync("main")  # builds the engine (bf16 on a GPU: dtype auto) and loads version 0
    start_s = time.perf_counter() - t
    try:
        module = PolicyModule(path, **build.module_args(spec, "main"))
        _one_step(module, ctx)
        before = dict(store.stats)
        t = time.perf_counter()
        store.publish("main", 1, module.weights())
        publish_s = time.perf_counter() - t
        t = time.perf_counter()
        assert service.sync("main") == 1
        _sync()
        serve_s = time.perf_counter() - t
        ref = store.ref("main", 1)
    finally:
        for engine in {id(e): e for e in [*service._engines.values(), *getattr(service, "_bases", {}).values()]
                       }.values():
            engine.close()
    payload = store.stats["bytes_published"] - before["bytes_published"]
    return {"kind": ref.kind, "publish_s": publish_s, "serve_s": serve_s, "latency_s": publish_s + serve_s,
            "payload_mb": payload / 1e6, "payload_vs_full": payload / ctx.full_bf16_bytes,
            "pulled": "delta" if service.store.stats["pulled_delta"] else "full",
            "initial_publish_s": initial_publish_s, "engine_start_and_v0_s": start_s}


def publish_full_bf16(ctx: Context) -> dict[str, Any]:
    return _publish_to_serving(ctx, full_every=1)


def publish_sparse_delta(ctx: Context) -> dict[str, Any]:
    out = _publish_to_serving(ctx, full_every=10)
    if (out["kind"], out["pulled"]) != ("delta", "delta"):
        raise RuntimeError(f"version 1 was not published and served as a delta: {json.dumps(out)}")
    return out


def publish_lora(ctx: Context) -> dict[str, Any]:
    import astratk.spec

    lora_spec = getattr(astratk.spec, "LoraSpec", None)
    if lora_spec is None or "lora" not in {f.name for f in dataclasses.fields(astratk.spec.ModelSpec)}:
        raise Skip("not available in this build (astratk.spec.LoraSpec / ModelSpec.lora missing)")
    lora = lora_spec(r=16, alpha=32.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return {**_publish_to_serving(ctx, full_every=1, lora=lora), "lora": dataclasses.asdict(lora)}


# ------------------------------------------------------------------------------------------ 4. end to end


def _env(ctx: Context) -> Any:
    from astratk.envs.math.arithmetic import ArithmeticEnv

    return ArithmeticEnv(levels=[1, 2], n_heldout=ctx.sizes.heldout)


def warm_start(ctx: Context) -> dict[str, Any]:
    """The tiny model of `sizes.tiny`, built and warm-started on the device (`astratk.models.warm_start`), saved as
    the e2e runs' model directory."""
    from astratk.models.tiny import build_tiny_model
    from astratk.models.tokenizer import build_char_tokenizer, save_char_tokenizer
    from astratk.models.warm_start import warm_start as run_warm_start
    from astratk.spec import TinyModelSpec

    spec = TinyModelSpec(**ctx.sizes.tiny)
    tok = build_char_tokenizer()
    t = time.perf_counter()
    model = build_tiny_model(spec, tok).to(ctx.device)
    report = run_warm_start(model, tok, _env(ctx), spec, log=ctx.log)
    seconds = time.perf_counter() - t
    out = ctx.tmp / "e2e-model"
    model.cpu().save_pretrained(str(out))
    tok.model_max_length = spec.max_positions
    save_char_tokenizer(tok, out)
    ctx.tiny_dir = str(out)
    return {"parameters_m": sum(p.numel() for p in model.parameters()) / 1e6, "device": str(ctx.device),
            "seconds": seconds, "steps": report.steps, "heldout_accuracy": report.heldout_accuracy,
            "heldout_n": report.n_heldout, "final_loss": report.final_loss}


def _e2e_spec(ctx: Context, name: str, *, synchronous: bool = False, strategy: str = "auto",
              max_steps: int | None = None) -> Any:
    from astratk import spec as sp
    from astratk.losses.drpo import DRPO

    s = ctx.sizes
    if ctx.tiny_dir is None:
        raise Skip("needs the warm_start row's model (run it first: --rows warm_start,...)")
    trainer = sp.TrainerSpec(max_steps=max_steps or s.e2e_max_steps, max_time_s=None if max_steps else s.e2e_seconds,
                          groups_per_step=s.groups_per_step, lr=1e-4, loggers=[], strategy=strategy,
                          gpu_memory_fraction=0.4)  # colocated: 0.4 + 2 engines x 0.15
    policy = sp.PolicySpec(model=sp.ModelSpec(path=ctx.tiny_dir), loss=DRPO(delta=0.2), trainer=trainer)
    return sp.RunSpec(name=name, output_dir=str(ctx.tmp / "runs"), env=_env(ctx), progress=False, policies=[policy],
                      rollout=sp.RolloutSpec(group_size=s.group_size, max_new_tokens=8,
                                             tasks_per_chunk=s.tasks_per_chunk,
                                             engine_args={"gpu_memory_utilization": 0.15}),
                      dataflow=sp.DataflowSpec(max_staleness=4, synchronous=synchronous,
                                               filter_zero_variance=s.filter_zero_variance),
                      cluster=sp.ClusterSpec(rollout_workers=1, processes=s.processes, dashboard=False),
                      eval=sp.EvalSpec(interval_s=5.0, max_tasks=s.heldout)).validate()


def _astratk_run(ctx: Context, spec: Any) -> dict[str, Any]:
    """A local astratk run as `Run` starts it (the GPU check, the run directory, its config, a `Session`), minus the
    metrics dataset and dashboards it writes at the end; the session's summary."""
    from astratk.config import dump_spec
    from astratk.runtime.checks import check_gpu_memory
    from astratk.runtime.session import Session

    check_gpu_memory(spec)
    run_dir = Path(spec.output_dir) / spec.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_spec(spec))
    with Session(spec, run_dir, ctx.log) as session:
        summary = session.train()
    # The rollout services' own speed while they worked (tokens per busy second, summed over services).
    rows = getattr(session, "service_rows", None) or {}
    summary["rollout_tokens_per_s"] = float(sum(r.get("tokens_per_s", 0.0) for r in rows.values()))
    return summary


def _e2e_figures(summary: dict[str, Any]) -> dict[str, Any]:
    keys = ("accuracy_before", "accuracy_after", "accuracy_best", "accuracy_gain", "time_to_target_s", "steps",
            "train_time_s", "data_wait_fraction", "final_version", "n_heldout")
    out = {k: summary.get(k) for k in keys}
    out["steps_per_s"] = summary["steps"] / max(summary["train_time_s"], 1e-9)
    out["rollout_tokens_per_s"] = summary.get("rollout_tokens_per_s")
    out["target"] = f"+{100 * summary['target_gain']:.0f} points held-out accuracy"
    return out


def e2e_async(ctx: Context) -> dict[str, Any]:
    return _e2e_figures(_astratk_run(ctx, _e2e_spec(ctx, "gpu-suite-async")))


def e2e_sync(ctx: Context) -> dict[str, Any]:
    return _e2e_figures(_astratk_run(ctx, _e2e_spec(ctx, "gpu-suite-sync", synchronous=True)))


def e2e_fsdp(ctx: Context) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise Skip("Lightning's FSDP strategy needs a CUDA accelerator (CPU smoke)")
    summary = _astratk_run(ctx, _e2e_spec(ctx, "gpu-suite-fsdp", strategy="fsdp", max_steps=ctx.sizes.fsdp_steps))
    if summary["final_version"] < 1:
        raise RuntimeError(f"the FSDP run published no version after {summary['steps']} steps")
    return _e2e_figures(summary)
