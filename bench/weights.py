"""Weight store: sparse-delta sizes after a real RL step, and pull time full vs delta over a simulated remote link.

1. Delta size (issue 6 target: at lr 1e-6, delta bytes <= 5% of full bytes). The quickstart's tiny model
   (`ensure_model` on `--config`) as fp32 master weights; one step's batch of real rollouts made by the real path
   (rollout service with a TorchEngine, in-process data layer, collate), the config's loss (DRPO) and `PolicyModule`'s
   AdamW. From the same starting weights, one optimiser step at each learning rate, then version 0 and version 1 are
   published through a `WeightStore(full_every=10, publish_dtype=...)`: bf16 (the target) and fp32 for contrast.
   Reported: the share of elements whose bits changed, the delta file's bytes over the full file's, and what the
   same delta would cost with other index encodings (int64, int32, narrowest-width gaps without zlib).
2. Pull time over a `SimulatedLink` (default 4 Gbit/s, 300 ms per request): a synthetic `--gb` GB bf16 state,
   version 1 changing a random `--frac` of its elements (one bf16 ulp each). A fresh puller pulls version 0 in full
   (have None) and a puller at version 0 pulls version 1 (a delta), through the real `WeightStore.pull` with the
   link's sleeps; beside the wall time, the link model's seconds (index read + file read) and the rest (sha256,
   decoding, which the model leaves out).

    python bench/weights.py                      # both parts; 1 GB state for part 2 (about 6 GB of RAM)
    python bench/weights.py --gb 0.1 --skip-rl   # part 2 only, scaled down
"""

from __future__ import annotations

import argparse
import tempfile
import time
import zlib

import numpy as np
import torch

from astratk.cpu import run_threads
from astratk.weights import SimulatedLink, SparseDelta, WeightStore, delta_to_bytes, make_delta


def rl_batch(spec, model_path: str):
    """One training step's batch of real rollouts (the config's groups per step), as `bench/pipeline.py` makes it."""
    from astratk.dataflow.datalayer import DataLayer
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService
    from astratk.runtime.deploy import publish_initial
    from astratk.training.collate import collate

    p = spec.policies[0]
    store = WeightStore("memory://bench-weights-rollout")
    publish_initial(store, p.policy_id, model_path)
    service = RolloutService(RunContext("bench-weights", spec, {p.policy_id: model_path}, store.url))
    datalayer = DataLayer(spec)
    while (groups := datalayer.next_batch(p.policy_id, 0)) is None:
        for res in service.score(service.rollout(datalayer.lease(spec.rollout.tasks_per_chunk))):
            datalayer.admit(res.lease_id, list(res.groups))
    return collate(groups, service.engine(p.policy_id).tokenizer.pad_token_id)


def one_step(spec, model_path: str, batch, lr: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights before, weights after) one AdamW step at `lr` on `batch`, fp32."""
    from astratk.training.module import PolicyModule

    p = spec.policies[0]
    module = PolicyModule(model_path, p.loss, lr=lr, weight_decay=p.trainer.weight_decay,
                          temperature=spec.rollout.temperature, horizon=spec.rollout.max_new_tokens)
    module.log_dict = lambda *a, **k: None  # no Trainer attached here
    opt = module.configure_optimizers()
    before = module.weights()
    loss = module.training_step(batch, 0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return before, module.weights()


def index_costs(delta: SparseDelta) -> dict[str, int]:
    """Bytes of the delta's indices under each encoding considered (values cost the same in all)."""
    out = {"int64": 0, "int32": 0, "narrow gaps": 0, "zlib gaps (used)": 0}
    for idx, _ in delta.changes.values():
        gaps = np.diff(idx.numpy(), prepend=-1) - 1
        width = next(w for w in (1, 2, 4, 8) if int(gaps.max()) < 256 ** w)
        planes = gaps.astype(f"<u{width}").view(np.uint8).reshape(-1, width).T
        out["int64"] += 8 * idx.numel()
        out["int32"] += 4 * idx.numel()
        out["narrow gaps"] += width * idx.numel()
        out["zlib gaps (used)"] += len(zlib.compress(planes.tobytes(), 1))
    return out


def delta_sizes(config: str, model: str | None, lrs: list[float]) -> None:
    from astratk.config import load_spec
    from astratk.models import ensure_model

    spec = load_spec(config)
    torch.set_num_threads(run_threads(spec).trainer)
    model_path = model or str(ensure_model(spec.policies[0].model, spec.env))
    batch = rl_batch(spec, model_path)
    print(f"\n1. delta after one optimiser step: {model_path}; batch of {len(batch)} sequences "
          f"({int(batch.loss_mask.sum())} completion tokens), loss {type(spec.policies[0].loss).__name__}, AdamW "
          f"betas (0.9, 0.99), weight decay {spec.policies[0].trainer.weight_decay}")
    head = (f"{'lr':>8} {'publish':>9} {'elements':>10} {'changed':>9} {'full B':>10} {'delta B':>10} "
            f"{'delta/full':>10} {'publish s':>9}   delta/full with indices as: int64 | int32 | narrow gaps")
    print(head)
    for lr in lrs:
        before, after = one_step(spec, model_path, batch, lr)
        for dtype in ("bfloat16", "float32"):
            store = WeightStore(f"memory://bench-weights-{lr}-{dtype}", full_every=10, publish_dtype=dtype)
            full = store.publish("main", 0, before)
            start = time.perf_counter()
            ref = store.publish("main", 1, after)
            seconds = time.perf_counter() - start
            cast = getattr(torch, dtype)
            delta = make_delta({k: v.to(cast) for k, v in before.items()}, {k: v.to(cast) for k, v in after.items()},
                               base_version=0, version=1)
            nbytes = ref.nbytes if ref.kind == "delta" else len(delta_to_bytes(delta))
            n = sum(t.numel() for t in before.values())
            costs = index_costs(delta)
            values = delta.nbytes() - costs["int64"]
            alt = " | ".join(f"{(values + costs[k]) / full.nbytes:.2%}" for k in ("int64", "int32", "narrow gaps"))
            note = "" if ref.kind == "delta" else "  (published in full: the delta is no smaller)"
            print(f"{lr:>8.0e} {dtype:>9} {n:>10,} {delta.num_changed() / n:>9.2%} {full.nbytes:>10,} "
                  f"{nbytes:>10,} {nbytes / full.nbytes:>10.2%} {seconds:>9.3f}   {alt}{note}")


def synthetic(gb: float, frac: float, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A bf16 state of `gb` GB in [rows, 8192] tensors of ~128 MB, and a copy with a random `frac` of its elements
    moved by one bf16 ulp (every one a bit change, values as after a small step)."""
    g = torch.Generator().manual_seed(seed)
    total, cols = int(gb * 1e9 / 2), 8192
    rows_per = max(1, min(64 * 2**20 // cols, total // cols))
    old, new, left, i = {}, {}, total // cols, 0
    while left > 0:
        rows = min(rows_per, left)
        w = torch.empty(rows, cols, dtype=torch.bfloat16)
        w.normal_(0, 0.02, generator=g)
        changed = w.clone()
        mask = torch.rand(rows, cols, generator=g) < frac
        changed.view(torch.int16)[mask] += 1  # the next representable value
        old[f"layers.{i}.weight"], new[f"layers.{i}.weight"] = w, changed
        left, i = left - rows, i + 1
    return old, new


def pull_times(gb: float, frac: float, bandwidth_bps: float, latency_s: float, url: str) -> None:
    print(f"\n2. pull over a SimulatedLink at {bandwidth_bps / 1e9:g} Gbit/s, {latency_s * 1e3:g} ms per request: "
          f"a {gb:g} GB bf16 state, version 1 changes {frac:.0%} of the elements; store {url}")
    t = time.perf_counter()
    old, new = synthetic(gb, frac)
    print(f"   (synthetic state built in {time.perf_counter() - t:.1f} s)")
    publisher = WeightStore(url, full_every=10)
    t = time.perf_counter()
    full_ref = publisher.publish("main", 0, old)
    full_publish = time.perf_counter() - t
    t = time.perf_counter()
    delta_ref = publisher.publish("main", 1, new)
    delta_publish = time.perf_counter() - t
    del old, new
    rows = []
    for label, have, want, ref in (("full (fresh puller, v0)", None, 0, full_ref),
                                   ("delta (puller at v0, v1)", 0, 1, delta_ref)):
        link = SimulatedLink(url, bandwidth_bps, latency_s)
        puller = WeightStore(url, fs=link)
        link.stats.update(requests=0, bytes=0, modelled_s=0.0)  # the constructor's makedirs is not a pull
        t = time.perf_counter()
        payload, got = puller.pull("main", have, want)
        wall = time.perf_counter() - t
        assert got.version == want and isinstance(payload, dict if have is None else SparseDelta)
        model = link.transfer_time(link.stats["bytes"], link.stats["requests"], concurrent=False)
        rows.append((label, ref.nbytes, link.stats["requests"], model, wall))
        del payload
    print(f"   {'pull':<26}{'file bytes':>15}{'requests':>9}{'link model s':>13}{'wall s':>9}{'wall - model':>13}")
    for label, nbytes, requests, model, wall in rows:
        print(f"   {label:<26}{nbytes:>15,}{requests:>9}{model:>13.3f}{wall:>9.3f}{wall - model:>13.3f}")
    (_, fb, _, fm, fw), (_, db, _, dm, dw) = rows
    print(f"   delta / full: bytes {db / fb:.2%}, link model time {dm / fm:.2%}, wall time {dw / fw:.2%} "
          f"(speed-up {fw / dw:.2f}x)")
    print(f"   publisher (trainer blocked): full snapshot {full_publish:.2f} s, delta {delta_publish:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tutorials/quickstart.yaml")
    ap.add_argument("--model", default=None, help="an HF model directory instead of the config's tiny model")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-4])
    ap.add_argument("--gb", type=float, default=1.0, help="size of the synthetic state for the pull timing")
    ap.add_argument("--frac", type=float, default=0.03, help="share of its elements that change")
    ap.add_argument("--bandwidth", type=float, default=4e9, help="link bandwidth, bits/s")
    ap.add_argument("--latency", type=float, default=0.3, help="link latency per request, s")
    ap.add_argument("--store", default=None, help="fsspec URL for part 2's store (default: a temporary local dir; "
                    "memory:// copies every file on move and read, which slows publishing)")
    ap.add_argument("--skip-rl", action="store_true", help="skip part 1")
    ap.add_argument("--skip-link", action="store_true", help="skip part 2")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads")
    if not args.skip_rl:
        delta_sizes(args.config, args.model, args.lrs)
    if not args.skip_link:
        with tempfile.TemporaryDirectory(prefix="astratk-bench-weights-") as tmp:
            pull_times(args.gb, args.frac, args.bandwidth, args.latency, args.store or tmp)


if __name__ == "__main__":
    main()
