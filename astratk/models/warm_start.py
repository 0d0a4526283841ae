"""A short supervised warm start on an env's demonstrations, then held-out greedy accuracy.

Why: RL from a random tiny model never sees a reward; RL from a solved one has nothing to add. The warm start teaches
the answer *format* (a number, then `<|im_end|>`) and part of the skill, so the demo's RL run starts at a partial
accuracy it can visibly raise. Each example is the env's chat prompt (`encode_chat(tok, env.messages(task))`) followed
by `env.demonstration(task)` and `<|im_end|>`; the loss covers the completion tokens only.

When to stop: the skill arrives as a jump (the default arithmetic env goes from a few percent to over half within ~200
steps once the model finds digit alignment), and where the jump happens depends on the seed (measured, 500 steps:
34% with seed 0, 3% with seed 1, 1% with seed 2). So the warm start stops once the running exact-match on *fresh*
train batches (every completion token is the model's greedy choice, measured before the batch's update, so the
examples are unseen; free, from the training forward pass) reaches `spec.warm_start_target`; `warm_start_steps` caps it.
Measured with the defaults (target 30%, cap 1000): seed 0 stops at 515 steps with 35.9% held-out (58 s on one busy
thread), seed 1 at 761 steps with 31.8% (89 s), seed 2 runs to the cap with 26.6% (122 s).

Deterministic on one machine: training runs on one torch thread (a different thread count changes float reduction
order) with a seeded RNG, and the data order is the env's seeded train stream, so one spec gives bit-identical weights
there. Not across machines: another CPU's kernels round differently, and as the jump is chaotic the same spec can land
elsewhere (measured: a 6.4M-parameter spec jumped to 30.9% held-out at step 1,145 on one 2-core VM, and ran its
1,500-step cap at 4.9% on another of the same kind). When the cap ends a warm start short of its target, the log
says so and what to change.

Extending: an env takes part by implementing `demonstration(task)`, `messages(task)` and `grade(task, text)`; a
workflow with several roles overrides `demonstrations(task)` to teach every role's format (held-out accuracy is the
first role's, through `messages`/`grade`).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from astratk.contracts import Env
from astratk.models.chat import encode_chat, stop_token_ids
from astratk.models.tools import prepare_messages, resolve_tool_format
from astratk.records import Task
from astratk.spec import TinyModelSpec

MAX_HELDOUT = 512  # held-out tasks graded after the warm start
LOG_EVERY = 50  # steps between loss lines
LOG_EVERY_S = 30.0  # ... or seconds, whichever comes first
STOP_WINDOW = 20  # steps whose train exact-match is averaged for the stopping rule (20 x 32 = 640 examples)


@dataclass(frozen=True)
class WarmStartReport:
    steps: int  # supervised steps run (fewer than spec.warm_start_steps when the target was reached)
    heldout_accuracy: float  # fraction of held-out tasks answered exactly, greedy decoding
    n_heldout: int
    heldout_finished: float  # fraction of greedy completions that ended with a stop token (format learnt)
    final_loss: float  # mean completion-token cross-entropy over the last LOG_EVERY steps
    seconds: float


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one torch thread (determinism; 2-core machines oversubscribe otherwise), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _require(env: Env, *methods: str) -> None:
    missing = [m for m in methods if not callable(getattr(env, m, None))]
    if missing:
        raise ValueError(f"env {env.name!r} lacks {missing}, which the tiny model's warm start needs; implement them "
                         "or give model.path (an HF model directory) instead of building the tiny model")


def _examples(tok, env: Env, task: Task) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) per demonstration of `task` (`env.demonstrations`: one per role of a workflow);
    each completion is the demonstration then <|im_end|>."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    tool_format = getattr(env, "tool_format", "auto")  # as the env's episodes show tools to the model
    for demo in env.demonstrations(task):  # (messages, text) or (messages, text, tools): an agent's tool definitions
        messages, text, tools = (*demo, None)[:3]
        prompt = encode_chat(tok, messages, tools=tools, tool_format=tool_format)
        if isinstance(text, dict):  # an assistant message (content, tool_calls): the chat template writes its text
            out.append((prompt, rendered_turn(tok, messages, text, tools, prompt, env.name, tool_format)))
        else:
            out.append((prompt, tok(text, add_special_tokens=False)["input_ids"] + [end]))
    return out


def rendered_turn(tok, messages: list[dict[str, Any]], message: dict[str, Any], tools: list[dict[str, Any]] | None,
                  prompt: list[int], env_name: str = "env", tool_format: str = "auto") -> list[int]:
    """The completion ids of assistant `message` (its content and `tool_calls`) as the model's chat template renders
    it after `messages`, through its end-of-turn token: a demonstration of a tool call needs no hand-written
    template text, and is right for whichever template (tiny ChatML, Qwen, ...) renders tool calls, or for the
    `hermes` fallback where the template drops tools (`astratk.models.tools`)."""
    fmt = resolve_tool_format(tok, tool_format)
    chat, tools_for_template = prepare_messages([*messages, message], tools, fmt)
    extra = {"tools": tools_for_template} if tools_for_template else {}
    full = tok(tok.apply_chat_template(chat, tokenize=False, **extra), add_special_tokens=False)["input_ids"]
    stops = set(stop_token_ids(tok))
    ends = [i for i in range(len(prompt), len(full)) if full[i] in stops]
    if full[:len(prompt)] != list(prompt) or not ends:
        raise ValueError(f"env {env_name!r}: the chat template does not render the demonstrated assistant message as "
                         "a continuation of its prompt ending in an end-of-turn token (a template that rewrites "
                         "earlier turns, or renders no tool_calls); give the demonstration as text instead")
    out = full[len(prompt):ends[0] + 1]
    text = tok.decode(out)
    missing = [c["function"]["name"] for c in message.get("tool_calls") or [] if c["function"]["name"] not in text]
    if missing:
        raise ValueError(f"env {env_name!r}: the chat template renders no tool call of {missing} in the demonstrated "
                         "assistant message (this model's template does not write tool_calls); give the "
                         "demonstration as the text the model should produce instead")
    return out


def _collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded input ids, attention mask and completion mask, all [B, T]."""
    width = max(len(p) + len(c) for p, c in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    target = torch.zeros((len(examples), width), dtype=torch.bool)  # True where the token is a completion token
    for i, (p, c) in enumerate(examples):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        attn[i, :n] = 1
        target[i, len(p):n] = True
    return ids, attn, target


def completion_loss(model, ids: torch.Tensor, attn: torch.Tensor,
                    target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the completion tokens, each predicted from the tokens before it, and per example
    whether every completion token is the greedy choice ([B] bool: greedy decoding would reproduce the example)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # [B, T-1, V] predicts ids[:, 1:]
    mask = target[:, 1:]  # [B, T-1]
    nll = torch.nn.functional.cross_entropy(logits[mask], ids[:, 1:][mask])  # mean over completion tokens
    exact = ((logits.detach().argmax(-1) == ids[:, 1:]) | ~mask).all(dim=1)  # [B]
    return nll, exact


def lr_factor(step: int, total: int) -> float:
    """Linear warmup over 20 steps (or 10% of a shorter run), then constant.

    No decay: the model should stop mid-learning, as RL then continues it. Measured on the default arithmetic env:
    accuracy jumps from a few percent to over half within ~200 steps once the model finds digit alignment, and a
    cosine decay delays that jump (480 steps: 3% with decay to 10%, 15% constant).
    """
    warmup = max(1, min(20, total // 10))
    return min(1.0, (step + 1) / warmup)


def supervised_steps(model, tok, env: Env, spec: TinyModelSpec,
                     log: Callable[[str], None] = print) -> tuple[int, float]:
    """AdamW steps of spec.warm_start_batch demonstrations until the target or the cap (module docstring).

    Returns (steps run, mean loss over the last LOG_EVERY steps).
    """
    _require(env, "demonstration", "messages")
    stream = env.tasks("train")
    device = next(model.parameters()).device  # batches go where the model is (a GPU warm start: bench/gpu_suite.py)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.warm_start_lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, spec.warm_start_steps))
    model.train()
    losses: list[float] = []
    exact: list[float] = []  # per step: fraction of the (unseen) batch that greedy decoding would reproduce
    step = 0
    last_log = time.perf_counter()  # a real model's step can take a minute: a line at least every LOG_EVERY_S
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        while step < spec.warm_start_steps:
            step += 1
            batch = list(itertools.islice((ex for t in stream for ex in _examples(tok, env, t)), spec.warm_start_batch))
            loss, hit = completion_loss(model, *(t.to(device) for t in _collate(batch, tok.pad_token_id)))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            exact.append(hit.float().mean().item())
            running = sum(exact[-STOP_WINDOW:]) / len(exact[-STOP_WINDOW:])
            reached = (spec.warm_start_target is not None and len(exact) >= STOP_WINDOW
                       and running >= spec.warm_start_target)
            if (step % LOG_EVERY == 0 or step == spec.warm_start_steps or reached
                    or time.perf_counter() - last_log >= LOG_EVERY_S):
                last_log = time.perf_counter()
                log(f"warm start: step {step}/{spec.warm_start_steps} loss {_mean(losses[-LOG_EVERY:]):.4f} "
                    f"train exact-match {running:.1%}")
            if reached:
                log(f"warm start: train exact-match reached the target {spec.warm_start_target:.0%}; stopping")
                break
    model.eval()
    return step, _mean(losses[-LOG_EVERY:])


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


@torch.no_grad()
def heldout_accuracy(model, tok, env: Env, max_tasks: int = MAX_HELDOUT, batch: int = 512,
                     max_new_tokens: int | None = None) -> tuple[float, float, int]:
    """Greedy accuracy over the first `max_tasks` held-out tasks: (accuracy, finished fraction, n graded).
    `max_new_tokens`: the token budget (None: the longest demonstration + 3, for models that answer tersely; a
    pretrained chat model that answers in sentences needs the run's `rollout.max_new_tokens`)."""
    multi_turn = getattr(env, "multi_turn", False)  # replays demonstrated turns: no single reply to grade
    _require(env, "demonstration", "messages", *(() if multi_turn else ("grade",)))
    tasks = list(itertools.islice(env.tasks("heldout"), max_tasks))
    if not tasks:
        raise ValueError(f"env {env.name!r} has no held-out tasks to measure the warm start on")
    if multi_turn:  # an agent: each turn of its demonstrations, from the turns before it
        return _turns_accuracy(model, tok, env, tasks, batch)
    stops = list(stop_token_ids(tok))
    # Room for the longest reference answer, its <|im_end|>, and a little slack for wrong, longer answers.
    budget = max_new_tokens or max(len(tok(env.demonstration(t), add_special_tokens=False)["input_ids"])
                                   for t in tasks) + 3
    model.eval()
    correct = finished = 0
    for start in range(0, len(tasks), batch):
        chunk = tasks[start:start + batch]
        enc = tok.pad({"input_ids": [encode_chat(tok, env.messages(t)) for t in chunk]},  # type: ignore[attr-defined]
                      padding=True, return_tensors="pt", padding_side="left")
        enc = {k: v.to(next(model.parameters()).device) for k, v in enc.items()}
        out = model.generate(**enc, max_new_tokens=budget, do_sample=False, eos_token_id=stops,
                             pad_token_id=tok.pad_token_id)
        for task, row in zip(chunk, out[:, enc["input_ids"].shape[1]:].tolist(), strict=True):
            finished += any(t in stops for t in row)
            text = tok.decode(row, skip_special_tokens=True)
            correct += env.grade(task, text) == 1.0  # type: ignore[attr-defined]
    return correct / len(tasks), finished / len(tasks), len(tasks)


@torch.no_grad()
def _turns_accuracy(model, tok, env: Env, tasks: list[Task], batch: int) -> tuple[float, float, int]:
    """For multi-turn envs (agents): a held-out task counts when greedy decoding reproduces every assistant turn of its
    demonstrations, each from the demonstration's messages before it (a deterministic tool then gives the agent the
    same episode). Returns (accuracy, finished fraction of the turns, n graded)."""
    stops = list(stop_token_ids(tok))
    turns = [(i, p, c) for i, t in enumerate(tasks) for p, c in _examples(tok, env, t)]  # c ends with <|im_end|>
    right = [True] * len(tasks)
    finished = 0
    device = next(model.parameters()).device
    for start in range(0, len(turns), batch):
        chunk = turns[start:start + batch]
        enc = tok.pad({"input_ids": [p for _, p, _ in chunk]}, padding=True, return_tensors="pt",  # type: ignore[attr-defined]
                      padding_side="left")
        enc = {k: v.to(device) for k, v in enc.items()}
        budget = max(len(c) for _, _, c in chunk) + 3
        out = model.generate(**enc, max_new_tokens=budget, do_sample=False, eos_token_id=stops,
                             pad_token_id=tok.pad_token_id)
        for (i, _, want), row in zip(chunk, out[:, enc["input_ids"].shape[1]:].tolist(), strict=True):
            finished += any(t in stops for t in row)
            right[i] &= row[:len(want)] == list(want)
    return sum(right) / len(tasks), finished / max(1, len(turns)), len(tasks)


def warm_start(model, tok, env: Env, spec: TinyModelSpec, log: Callable[[str], None] = print) -> WarmStartReport:
    """Train in place on the env's demonstrations, then grade greedy completions on its held-out tasks."""
    t0 = time.perf_counter()
    with one_thread():
        steps, loss = supervised_steps(model, tok, env, spec, log)
        accuracy, done, n = heldout_accuracy(model, tok, env)
    report = WarmStartReport(steps, accuracy, n, done, loss, time.perf_counter() - t0)
    log(f"warm start: held-out greedy accuracy {accuracy:.1%} over {n} tasks ({done:.0%} well-formed), "
        f"{report.seconds:.1f} s")
    if spec.warm_start_target is not None and steps >= spec.warm_start_steps:
        log(short_of_target(spec, accuracy))
    return report


def short_of_target(spec: TinyModelSpec, accuracy: float) -> str:
    """What to do when the step cap, not the target, ended the warm start (the skill's jump never came)."""
    return (f"warm start: WARNING: {spec.warm_start_steps} steps ran without reaching train exact-match "
            f"{spec.warm_start_target:.0%} (held-out {accuracy:.1%}); RL from this model sees little reward. Where "
            f"the jump comes depends on the seed and on the machine's float arithmetic, so try another "
            f"model.tiny.seed (now {spec.seed}) or a larger model.tiny.warm_start_steps (the cache keeps this one "
            f"under its own key)")
