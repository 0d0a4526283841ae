"""Where a trainer step's time goes on this CPU: the quickstart's step cut into its parts, measured side by side.

    python bench/step_profile.py                       # quickstart config, 30 steps per measurement, 1 torch thread
    python bench/step_profile.py --steps 50 --threads 2
    python bench/step_profile.py --model large         # bench/vs_trl.py's 6.4M model (built and cached by it)

One step's batch of real rollouts is made up front by the real path (rollout service, data layer, collate: as
`bench/pipeline.py`'s trainer-alone figure), then, on that batch:
1. the parts of `PolicyModule.training_step` + the optimiser, each timed alone over the same steps: collate, the
   proximal no-grad forward (losses that need it), the policy forward with gradients, the loss terms (corrections,
   loss, regularisers, aggregation), the step's metrics (`_record`), backward, gradient clipping, the AdamW step;
2. the whole step by hand (`training_step` + backward + clip + step), so "Python and glue" = whole - parts;
3. the same step through a Lightning `Trainer` (clipping, logging off, no callbacks), so "Lightning" = that - 2;
4. what publishing costs the trainer: `weights()` (copy out) + `WeightStore.publish` to `memory://`;
5. bf16 autocast on the CPU for forward + backward (AMX / AVX-512 bf16 here), against fp32, same batch;
6. forward + backward with each group's prompt run once (`trainer.share_prompts`, the default) against the padded
   forward that runs it for every sample, in fp32 and bf16.

Prints a table (ms per step, share of the whole Lightning step). Figures go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch


def _timed(fn: Callable[[], Any], steps: int) -> float:
    """Median seconds of `fn()` over `steps` calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def real_batch(spec: Any, model_path: str) -> tuple[Any, Any, int]:
    """(groups, batch, pad id) of one step, rolled out by the real path."""
    from astratk.dataflow.datalayer import DataLayer
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService
    from astratk.runtime.deploy import publish_initial
    from astratk.training.collate import collate
    from astratk.weights.store import WeightStore

    p = spec.policies[0]
    store = WeightStore("memory://bench-step-profile")
    publish_initial(store, p.policy_id, model_path)
    service = RolloutService(RunContext("bench", spec, {p.policy_id: model_path}, store.url))
    datalayer = DataLayer(spec)
    while (groups := datalayer.next_batch(p.policy_id, 0)) is None:
        for res in service.score(service.rollout(datalayer.lease(spec.rollout.tasks_per_chunk))):
            datalayer.admit(res.lease_id, list(res.groups))
    pad = service.engine(p.policy_id).tokenizer.pad_token_id
    return groups, collate(groups, pad), pad


def profile(spec: Any, model_path: str, steps: int) -> dict[str, float]:
    from astratk.training._pl import pl
    from astratk.training.collate import collate
    from astratk.training.module import PolicyModule
    from astratk.weights.store import WeightStore

    p = spec.policies[0]
    groups, batch, pad = real_batch(spec, model_path)

    def module() -> PolicyModule:
        m = PolicyModule(model_path, p.loss, lr=p.trainer.lr, horizon=spec.rollout.max_new_tokens,
                         aggregation=p.trainer.aggregation)
        m.log_dict = lambda *a, **k: None  # no Trainer attached for the hand-made steps
        return m

    m = module()
    opt = m.configure_optimizers()
    params = [q for q in m.parameters() if q.requires_grad]
    out: dict[str, float] = {"sequences": float(batch.input_ids.shape[0]), "width": float(batch.input_ids.shape[1]),
                             "parameters_M": sum(q.numel() for q in params) / 1e6}
    out["collate"] = _timed(lambda: collate(groups, pad), steps)
    if m.needs_proximal:
        out["proximal no-grad forward"] = _timed(lambda: m._no_grad_logprobs(m.model, batch), steps)
    fwd_holder: dict[str, Any] = {}

    def forward() -> None:
        fwd_holder["fwd"] = m._policy_forward(batch)

    out["policy forward"] = _timed(forward, steps)

    def loss_terms() -> None:
        token_losses, mask, metrics = m._loss_terms(batch, fwd_holder["fwd"], None, None)
        fwd_holder["loss"], fwd_holder["metrics"] = m._aggregate(token_losses, mask), metrics

    out["loss terms + aggregation"] = _timed(loss_terms, steps)
    out["step metrics (_record)"] = _timed(lambda: m._record(batch, fwd_holder["loss"].detach(),
                                                             dict(fwd_holder["metrics"])), steps)

    def backward() -> None:
        opt.zero_grad(set_to_none=True)
        fwd = m._policy_forward(batch)
        token_losses, mask, _ = m._loss_terms(batch, fwd, None, None)
        m._aggregate(token_losses, mask).backward()

    out["backward"] = _timed(backward, steps) - out["policy forward"] - out["loss terms + aggregation"]
    out["clip grad norm"] = _timed(lambda: torch.nn.utils.clip_grad_norm_(params, p.trainer.grad_clip), steps)
    out["AdamW step"] = _timed(opt.step, steps)

    def whole() -> None:
        opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.training_step(batch, 0).backward()
        torch.nn.utils.clip_grad_norm_(params, p.trainer.grad_clip)
        opt.step()

    out["whole step by hand"] = _timed(whole, steps)

    lm = module()
    del lm.log_dict  # Lightning's own logging, as in a run
    loader = torch.utils.data.DataLoader([batch] * (steps + 2), batch_size=None, collate_fn=lambda b: b)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps + 2, gradient_clip_val=p.trainer.grad_clip,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1)
    ticks: list[float] = []

    class Tick(pl.Callback):
        def on_train_batch_end(self, *a: Any) -> None:
            ticks.append(time.perf_counter())

    trainer.callbacks.append(Tick())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(lm, loader)
    out["whole step in Lightning"] = statistics.median(b - a for a, b in itertools.pairwise(ticks[2:]))

    store = WeightStore("memory://bench-step-profile-publish")
    version = iter(range(1, 10**6))
    out["publish: weights() copy"] = _timed(m.weights, steps)
    out["publish: store.publish (full, fp32)"] = _timed(
        lambda: store.publish(p.policy_id, next(version), m.weights()), steps) - out["publish: weights() copy"]

    def fwd_bwd(bf16: bool, share: bool = True) -> Callable[[], None]:
        def run() -> None:
            opt.zero_grad(set_to_none=True)
            m.share_prompts = share and None  # None: checked again (and kept) on the next batch
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                fwd = m._policy_forward(batch)
                token_losses, mask, _ = m._loss_terms(batch, fwd, None, None)
                loss = m._aggregate(token_losses, mask)
            loss.backward()
        return run

    out["forward+backward fp32"] = _timed(fwd_bwd(False), steps)
    out["forward+backward bf16 autocast"] = _timed(fwd_bwd(True), steps)
    out["forward+backward fp32, padded"] = _timed(fwd_bwd(False, share=False), steps)
    out["forward+backward bf16 autocast, padded"] = _timed(fwd_bwd(True, share=False), steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tutorials/quickstart.yaml")
    ap.add_argument("--model", choices=("config", "large"), default="config",
                    help="config: the config's model; large: bench/vs_trl.py's --model large on the config's task")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a run's trainer uses cluster.torch_threads)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from astratk.config import load_spec
    from astratk.models import ensure_model

    overrides: list[str] = []
    if args.model == "large":  # the same spec changes as bench/vs_trl.py --model large, so the same cached model
        from vs_trl import LARGE_LEVELS, LARGE_MODEL

        overrides = ["--env.init_args.levels", json.dumps(LARGE_LEVELS)]
    spec = load_spec(args.config, overrides)
    if args.model == "large":
        p = spec.policies[0]
        p.model.tiny = dataclasses.replace(p.model.tiny, **LARGE_MODEL)
        spec = spec.validate()
    path = str(ensure_model(spec.policies[0].model, spec.env, log=lambda s: None))
    r = profile(spec, path, args.steps)
    whole = r["whole step in Lightning"]
    print(f"batch: {r['sequences']:.0f} sequences x {r['width']:.0f} tokens; {r['parameters_M']:.2f} M trained "
          f"parameters; {args.threads} torch thread(s); medians of {args.steps} steps")
    print(f"{'part':42s} {'ms':>8s} {'share':>7s}")
    parts = ["collate", "proximal no-grad forward", "policy forward", "loss terms + aggregation",
             "step metrics (_record)", "backward", "clip grad norm", "AdamW step"]
    summed = 0.0
    for k in parts:
        if k in r:
            summed += r[k]
            print(f"{k:42s} {1e3 * r[k]:8.2f} {r[k] / whole:7.1%}")
    glue = r["whole step by hand"] - sum(r[k] for k in parts[1:] if k in r)
    # medians of parts timed apart do not add up exactly: a small negative value is noise, not a saving
    print(f"{'Python and glue (by hand - parts)':42s} {1e3 * glue:8.2f} {glue / whole:7.1%}")
    light = whole - r["whole step by hand"]
    print(f"{'Lightning (in Lightning - by hand)':42s} {1e3 * light:8.2f} {light / whole:7.1%}")
    print(f"{'= whole step in Lightning':42s} {1e3 * whole:8.2f} {1.0:7.1%}   ({1 / whole:.2f} steps/s)")
    for k in ("publish: weights() copy", "publish: store.publish (full, fp32)"):
        print(f"{k:42s} {1e3 * r[k]:8.2f}")
    f32, b16 = r["forward+backward fp32"], r["forward+backward bf16 autocast"]
    print(f"{'forward+backward fp32':42s} {1e3 * f32:8.2f}")
    print(f"{'forward+backward bf16 autocast':42s} {1e3 * b16:8.2f}   ({f32 / b16:.2f}x fp32)")
    pad32, pad16 = r["forward+backward fp32, padded"], r["forward+backward bf16 autocast, padded"]
    print(f"{'forward+backward fp32, padded (no sharing)':42s} {1e3 * pad32:8.2f}   (shared prompts: "
          f"{pad32 / f32:.2f}x faster)")
    print(f"{'forward+backward bf16, padded (no sharing)':42s} {1e3 * pad16:8.2f}   ({pad32 / pad16:.2f}x fp32 padded)")


if __name__ == "__main__":
    main()
