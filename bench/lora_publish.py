"""Bytes a policy publishes per version: full weights vs LoRA adapters (`model.lora`), side by side.

For each model and adapter setting, through the real `WeightStore.publish` (what the trainer's publisher calls):
- full: version 0 of the fully fine-tuned policy (what `publish_initial` publishes without LoRA: every weight);
- adapter v0: version 0 of the LoRA policy (`publish_initial` with LoRA: the adapter tensors alone);
- the seconds of each `WeightStore.publish` call (the trainer blocks that long), on this machine's CPU;
- adapter delta: the next version as a sparse delta (`full_every=10`) after one real `PolicyModule` AdamW step on
  an on-policy batch of random tokens (tiny model only; the step is what a run's first step does: B was 0, so A's
  gradient is 0 and only B moves), in fp32 and bf16 (`publish_dtype`).

Models: the quickstart's tiny Qwen2 (default `TinyModelSpec`, random weights, fp32) and, with `--big`, a randomly
initialised Qwen2 of Qwen2.5-0.5B's shape (494 M parameters, 24 layers x 896, vocabulary 151,936) in bf16, the dtype
a GPU run publishes (`weights.publish_dtype: bfloat16`). Adapters: r=8 on q,k,v,o (`LoraSpec()`'s defaults) and
r=16 on every linear layer of the blocks.

    python bench/lora_publish.py          # tiny model (seconds)
    python bench/lora_publish.py --big    # + the 0.5 B shape (about 4 GB of RAM, a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings

import torch

from astratk.models.loading import load_causal_lm
from astratk.spec import LoraSpec
from astratk.weights.store import WeightStore

SETTINGS = {"r8 q,k,v,o": LoraSpec(r=8, alpha=16.0),
            "r16 all linear": LoraSpec(r=16, alpha=32.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"])}


def tiny_dir(root: str) -> str:
    from astratk.models import build_char_tokenizer, build_tiny_model
    from astratk.models.tokenizer import save_char_tokenizer
    from astratk.spec import TinyModelSpec

    tok = build_char_tokenizer()
    build_tiny_model(TinyModelSpec(), tok).save_pretrained(root)
    save_char_tokenizer(tok, root)
    return root


def big_dir(root: str) -> str:
    """A random Qwen2 of Qwen2.5-0.5B's shape in bf16 (config values from its config.json)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, dtype="bfloat16")
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(root)
    return root


def publish_bytes(model_dir: str, lora: LoraSpec | None, publish_dtype: str | None) -> tuple[int, float]:
    """(bytes, seconds) of version 0 through the real store: `publish_initial`'s state (every weight, or the
    initial adapter), then the timed `WeightStore.publish` (copy out, serialise, checksum, write to `memory://`)."""
    from astratk.models.lora import initial_adapter

    if lora is None:
        state = {k: v.detach().clone() for k, v in load_causal_lm(model_dir).state_dict().items()}
    else:
        state = initial_adapter(model_dir, lora)
    store = WeightStore(f"memory://bench-lora-{time.monotonic_ns()}", publish_dtype=publish_dtype)
    start = time.perf_counter()
    ref = store.publish("main", 0, state)
    return ref.nbytes, time.perf_counter() - start


def delta_bytes(model_dir: str, lora: LoraSpec, publish_dtype: str | None, lr: float) -> tuple[int, int, float]:
    """(v0 bytes, v1 delta bytes, changed fraction of elements) after one AdamW step of a LoRA `PolicyModule`."""
    from astratk.losses.drpo import DRPO
    from astratk.records import TrainBatch
    from astratk.training.logprobs import token_logprobs
    from astratk.training.module import PolicyModule

    module = PolicyModule(model_dir, DRPO(delta=0.5), lora=lora, lr=lr, horizon=16)
    module.log_dict = lambda *a, **k: None  # no Trainer attached here
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 60, (16, 48), generator=g)
    mask = torch.ones_like(ids)
    loss_mask = torch.zeros(16, 47)
    loss_mask[:, 31:] = 1
    with torch.no_grad():
        mu = token_logprobs(module.model, ids, mask, 1.0) * loss_mask
    advantages = torch.randn(16, 1, generator=g).expand(16, 47).contiguous()
    batch = TrainBatch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask, behavior_logprobs=mu,
                       advantages=advantages, weights=loss_mask.clone(), versions=torch.zeros(16, 47, dtype=torch.long),
                       n_groups=4)
    store = WeightStore(f"memory://bench-lora-delta-{time.monotonic_ns()}", full_every=10, publish_dtype=publish_dtype)
    v0 = store.publish("main", 0, module.weights())
    optimizer = module.configure_optimizers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module.training_step(batch, 0).backward()
    optimizer.step()
    v1 = store.publish("main", 1, module.weights())
    delta, _ = store.pull("main", have_version=0)
    total = sum(v.numel() for v in module.weights().values())
    return v0.nbytes, v1.nbytes if v1.kind == "delta" else -1, delta.num_changed() / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big", action="store_true", help="also the Qwen2.5-0.5B-shaped model in bf16")
    ap.add_argument("--lr", type=float, default=1e-4, help="the AdamW step of the delta rows (tiny model)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        models = [("tiny (quickstart shape)", tiny_dir(f"{root}/tiny"), None)]
        if args.big:
            models.append(("Qwen2.5-0.5B shape", big_dir(f"{root}/big"), "bfloat16"))
        for label, path, dtype in models:
            full, full_s = publish_bytes(path, None, dtype)
            for name, lora in SETTINGS.items():
                adapter, adapter_s = publish_bytes(path, lora, dtype)
                rows.append((label, dtype or "float32", name, full, adapter, full_s, adapter_s))
        print("| model | dtype | adapter | full publish | adapter publish (v0) | adapter / full | publish s "
              "full / adapter |")
        print("|---|---|---|---:|---:|---:|---:|")
        for label, dtype, name, full, adapter, full_s, adapter_s in rows:
            print(f"| {label} | {dtype} | {name} | {full / 1e6:,.2f} MB | {adapter / 1e6:,.3f} MB | "
                  f"{adapter / full:.2%} | {full_s:.2f} / {adapter_s:.3f} |")
        print()
        print(f"Sparse delta of the adapter after one AdamW step at lr {args.lr:g} (tiny model, r8 q,k,v,o):")
        print("| publish dtype | adapter v0 | v1 delta | delta / v0 | elements changed |")
        print("|---|---:|---:|---:|---:|")
        for dtype in (None, "bfloat16"):
            v0, v1, changed = delta_bytes(models[0][1], SETTINGS["r8 q,k,v,o"], dtype, args.lr)
            print(f"| {dtype or 'float32'} | {v0 / 1e3:,.1f} kB | {v1 / 1e3:,.1f} kB | {v1 / v0:.1%} | {changed:.1%} |")


if __name__ == "__main__":
    main()
