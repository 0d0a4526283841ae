"""`bench/vs_trl.py --model smollm2`: the side-by-side on a real pretrained chat model, full fine-tuning or LoRA.

SmolLM2-135M-Instruct (from the PyPI wheel's GGUF, dequantized once) on tutorials/real_model.yaml's task (one- and
two-digit sums asked in words, the last number of the answer graded); both sides take the spec's prompts, reward,
group size, completion length, temperature and learning rate; `--lora` trains PEFT adapters on both (r 16, alpha 32
on q/k/v/o: astratk's `model.lora`, TRL's `peft_config`). What this module adds to vs_trl.py: the spec, LoRA-aware
snapshots and evaluation, rollout tokens/s on both sides, and peak memory (RSS) sampled from /proc.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tutorials" / "real_model.yaml"
GAINS = (0.10, 0.20)
LORA = {"r": 16, "alpha": 32.0}


def spec_overrides(args: Any) -> list[str]:
    """load_spec overrides of the real-model config for the bench: full fine-tuning unless --lora."""
    return [] if args.lora else ["--policies", '[{"model": {"path": "%s", "lora": null}}]']


def adjust(spec: Any, args: Any) -> None:
    """The bench's model settings on the parsed spec: LoRA or not (the YAML's path is kept), and an fp32 engine, as
    TRL generates in fp32 here (the recipe's `bfloat16-if-native` would give astratk bf16 rollouts on a CPU with bf16
    units); `--astratk-set rollout.engine_args...` still sets it."""
    p = spec.policies[0]
    p.model.lora = None if not args.lora else p.model.lora
    if not any(item.startswith("rollout.engine_args") for item in getattr(args, "astratk_set", [])):
        spec.rollout.engine_args = {**spec.rollout.engine_args, "dtype": "float32"}


def trl_shape(spec: Any) -> dict[str, Any]:
    """GRPOConfig fields that must equal astratk's run: prompts x samples per step, completion length, temperature."""
    p, r = spec.policies[0], spec.rollout
    return {"per_device_train_batch_size": p.trainer.groups_per_step * r.group_size, "num_generations": r.group_size,
            "max_completion_length": r.max_new_tokens, "temperature": r.temperature}


# ------------------------------------------------------------------------------------------------------- evaluation
class LoraHeldOut:
    """The shared evaluation of LoRA snapshots: the base model with PEFT adapters, each snapshot's adapter tensors
    (PEFT's saved names: astratk's store and TRL's `get_peft_model_state_dict` both use them) loaded in turn."""

    def __init__(self, model_dir: Path, env: Any, n: int, threads: int, max_new_tokens: int) -> None:
        from astratk.models.loading import load_causal_lm, load_tokenizer
        from astratk.models.lora import adapter_state, add_lora
        from astratk.spec import LoraSpec

        self.model = add_lora(load_causal_lm(str(model_dir)), LoraSpec(**LORA), "lora")
        self.tok = load_tokenizer(model_dir)
        self.env, self.n, self.threads, self.max_new_tokens = env, n, threads, max_new_tokens
        self.initial_state = adapter_state(self.model)
        self.seconds = 0.0

    def __call__(self, state: dict[str, Any]) -> float:
        from _vs_trl_eval import torch_threads
        from peft import set_peft_model_state_dict

        t = time.perf_counter()
        result = set_peft_model_state_dict(self.model, state)
        if getattr(result, "unexpected_keys", None):
            raise RuntimeError(f"snapshot does not fit the adapters: unexpected {result.unexpected_keys[:3]}")
        with torch_threads(self.threads):
            accuracy = self.accuracy()
        self.seconds += time.perf_counter() - t
        return accuracy

    def accuracy(self) -> float:
        """The held-out accuracy of the adapters loaded now: greedy answers to the env's first `n` held-out tasks."""
        from astratk.models.warm_start import heldout_accuracy

        accuracy, _, _ = heldout_accuracy(self.model, self.tok, self.env, max_tasks=self.n,
                                          max_new_tokens=self.max_new_tokens)
        return accuracy


def full_heldout(model_dir: Path, env: Any, n: int, threads: int, max_new_tokens: int) -> Any:
    """The shared `HeldOut` with the real model's token budget (it answers in sentences)."""
    from _vs_trl_eval import HeldOut

    evaluate = HeldOut(model_dir, env, n, threads)
    evaluate.max_new_tokens = max_new_tokens
    return evaluate


# --------------------------------------------------------------------------------------------------------- memory
def _rss_tree(root: int) -> dict[int, int]:
    """RSS in bytes of `root` and of each of its descendants, by pid, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ppid, pages = int(fields[1]), int(fields[21])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
        rss[int(entry)] = pages * os.sysconf("SC_PAGE_SIZE")
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(children.get(pid, []))
    return {pid: rss.get(pid, 0) for pid in seen}


class RssSampler:
    """Peak RSS of a process tree (the largest process and the sum), sampled every `every_s` on a thread. Sampling its
    own process (root None), the root's RSS at start (`base`: this bench's own evaluator model, and what earlier runs
    left) is taken off the root's own figure, and so off both the largest process and the sum."""

    def __init__(self, root: int | None = None, every_s: float = 0.5) -> None:
        self.root, self.every_s = root or os.getpid(), every_s
        self.base = _rss_tree(self.root).get(self.root, 0) if root is None else 0
        self.peak_process = self.peak_sum = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RssSampler:  # noqa: PYI034 - typing.Self needs Python 3.11
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            sizes = _rss_tree(self.root)
            # the root's memory beyond what it held at start, so that the largest process is not the evaluator's model
            sizes[self.root] = sizes.get(self.root, 0) - self.base
            largest, total = max(sizes.values(), default=0), sum(sizes.values())
            self.peak_process, self.peak_sum = max(self.peak_process, largest), max(self.peak_sum, total)
            self._stop.wait(self.every_s)

    def figures(self) -> dict[str, float]:
        return {"peak_rss_process_gb": self.peak_process / 2**30, "peak_rss_sum_gb": self.peak_sum / 2**30,
                "rss_excluded_gb": self.base / 2**30}


# ------------------------------------------------------------------------------------------------------ TRL child
def trl_peft_config(cfg: dict[str, Any]) -> Any:
    """TRL's LoRA: the same adapters as astratk's `model.lora` (PEFT's LoraConfig from astratk's own LoraSpec)."""
    if not cfg.get("lora"):
        return None
    from astratk.models.lora import peft_config
    from astratk.spec import LoraSpec

    return peft_config(LoraSpec(**LORA))


def time_generation(model: Any, pad_id: int) -> dict[str, float]:
    """Wrap `model.generate` (TRL's rollouts) to count the completion tokens it makes and the time it takes."""
    stats = {"tokens": 0.0, "seconds": 0.0}
    inner = model.generate

    def generate(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = inner(*a, **kw)
        stats["seconds"] += time.perf_counter() - t
        prompt = kw.get("input_ids", a[0] if a else None)
        width = prompt.shape[1] if prompt is not None else 0
        stats["tokens"] += float((out[:, width:] != pad_id).sum())
        return out

    model.generate = generate
    return stats
