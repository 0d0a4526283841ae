"""`FunctionEnv`: a dataset of prompts plus reward functions, the few-line way to train on your own task.

The dataset is a `datasets.Dataset` (or a `DatasetDict` with `train` and `test` splits), a list of dicts, or a path:
a `.jsonl` / `.json` / `.csv` / `.parquet` file, or a folder written by `Dataset.save_to_disk`. Every row has a `prompt`,
either a string (sent as the user message) or a list of chat messages (`{"role": ..., "content": ...}`), and any
other columns the rewards need.

Reward functions use TRL's calling convention, so functions written for `GRPOTrainer` work unchanged:
`f(prompts, completions, completion_ids, **columns) -> list[float | None]`, one value per completion, where every
dataset column arrives as a keyword argument holding one value per completion. Completions are strings for string
prompts and `[{"role": "assistant", "content": text}]` for chat prompts. As in TRL, a reward model can stand
beside the functions: a directory or Hub id string, or a loaded `AutoModelForSequenceClassification` (one score per
sequence), run on the rollout worker in batches (`astratk.envs.reward_model`); so can an LLM judge asked over an
OpenAI-compatible endpoint (`astratk.envs.judge.Judge`). A function without `**kwargs` gets only the
arguments it names. `None` means "this function does not apply to this completion": the reward is the weighted sum of
the values that are not None (`reward_weights`, default 1 each), and a completion no function scores gets no reward
(dropped and counted by the data layer). Each function's mean shows in the run's metrics as `reward/<name>`.

Held-out tasks (the run's evaluation) come from `eval_dataset`, else the `DatasetDict`'s `test` split, else a seeded
`heldout` share of the rows (a fraction, or a count). Train rows whose prompt is also a held-out prompt are left out
of training; `stats` counts them. The train stream is endless: the train rows in a new seeded order every epoch.

Example:
    >>> def exact(completions, answer, **kwargs):
    ...     return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]
    >>> rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    >>> env = FunctionEnv(rows, exact, heldout=20)
    >>> env.stats
    {'rows': 100, 'train': 80, 'heldout': 20, 'train_overlap_removed': 0}
    >>> task = next(iter(env.tasks("heldout")))
    >>> env.grade(task, task.info["columns"]["answer"])
    1.0
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from astratk.contracts import Engine, SamplingParams
from astratk.envs.chat import single_turn
from astratk.envs.dataset import FILE_FORMATS, DatasetEnv, load_rows  # noqa: F401 - load_rows, FILE_FORMATS: re-exported
from astratk.envs.reward_model import RewardModel, is_reward_model_path
from astratk.records import Task, Trajectory
from astratk.registry import import_object

RewardFunc = Callable[..., Sequence[float | None]]


def _import(path: str) -> RewardFunc:
    obj = import_object(path.replace(":", "."))
    if not callable(obj):
        raise TypeError(f"reward function {path!r} is not callable")
    return obj


def _reward_func(f: Any, tokenizer: Any) -> RewardFunc:
    """A `reward_funcs` entry as a callable: a reward model for a model path, a Hub id or a loaded
    sequence-classification model (with `tokenizer`, TRL's processing class, where given); a function otherwise."""
    if isinstance(f, str):
        return RewardModel(f, tokenizer) if is_reward_model_path(f) else _import(f)
    if isinstance(f, os.PathLike):
        return RewardModel(f, tokenizer)
    if hasattr(f, "config") and hasattr(f, "forward") and not isinstance(f, RewardModel):  # a loaded HF model
        return RewardModel(f, tokenizer)
    return f


def _qualified(f: Any) -> str:
    if isinstance(f, RewardModel) and f.path is not None:  # the saved config rebuilds it from its path
        return f.path
    return f"{getattr(f, '__module__', None) or type(f).__module__}.{getattr(f, '__qualname__', type(f).__qualname__)}"


def _func_name(f: Any, i: int) -> str:
    return getattr(f, "__name__", None) or type(f).__name__ or f"reward_{i}"


class FunctionEnv(DatasetEnv):
    """Single-turn prompts from a dataset, scored by TRL-style reward functions (module docstring).

    Args:
        dataset: the train rows (or all rows, when the held-out share comes out of them).
        reward_funcs: one function, or a list; a string is imported ("mypkg.rewards.exact" or "mypkg.rewards:exact"),
            or, when it holds a "/" (a directory, a Hub id `org/name`), loaded as a reward model; a loaded
            sequence-classification model is a reward model too (`astratk.envs.reward_model.RewardModel`).
        reward_weights: one weight per function (default 1.0 each).
        eval_dataset: held-out rows; default: the DatasetDict's `test` split, else `heldout` of the rows.
        heldout: the share of rows held out when no eval dataset is given: a fraction in (0, 1) or a count.
        system_prompt: a system message put before string prompts (chat prompts keep their own messages).
        demonstration_column: a column holding a reference completion, for the supervised warm start of a tiny
            model (`model.tiny`); without one, give `model.path`.
        seed: the order of the held-out split and of each epoch's train stream.
        name: the env's name in task ids and metrics.
        reward_processing_classes: TRL's argument: the tokenizer of each reward model (one per reward function, None
            for a function or to load the model's own), or one tokenizer for all.

    Scoring runs bounded by `rollout.score_timeout_s`: a group whose reward functions take longer gets no rewards
    (counted, like every unscored completion).
    """

    roles = ("policy",)

    def __init__(self, dataset: Any, reward_funcs: RewardFunc | str | Sequence[RewardFunc | str],
                 reward_weights: Sequence[float] | None = None, eval_dataset: Any = None, heldout: float = 0.1,
                 system_prompt: str | None = None, demonstration_column: str | None = None, seed: int = 0,
                 name: str = "function", reward_processing_classes: Any = None) -> None:
        funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
        if not funcs:
            raise ValueError("reward_funcs: give at least one reward function")
        tokenizers = (list(reward_processing_classes) if isinstance(reward_processing_classes, list | tuple)
                      else [reward_processing_classes] * len(funcs))
        if len(tokenizers) != len(funcs):
            raise ValueError(f"reward_processing_classes: give {len(funcs)} (one per reward function, None for a "
                             f"function), got {len(tokenizers)}")
        self._funcs = [_reward_func(f, t) for f, t in zip(funcs, tokenizers, strict=True)]
        for i, f in enumerate(self._funcs):
            if not callable(f):
                raise TypeError(f"reward_funcs[{i}] is not callable: {f!r}")
        self.reward_names = [_func_name(f, i) for i, f in enumerate(self._funcs)]
        # the saved config's view (config.yaml, the model cache key): names and descriptions, not objects
        self.reward_funcs = [f if isinstance(f, str) else _qualified(g)
                             for f, g in zip(funcs, self._funcs, strict=True)]
        weights = [1.0] * len(funcs) if reward_weights is None else [float(w) for w in reward_weights]
        if len(weights) != len(funcs) or not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward_weights: give {len(funcs)} finite numbers (one per reward function), got "
                             f"{reward_weights!r}")
        self.reward_weights = weights
        self._init_dataset(dataset, eval_dataset, heldout, system_prompt, demonstration_column, seed, name)

    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        return [await single_turn(engines["policy"], self.messages(task), sampling, task=task, group_id=group_id,
                                  policy_id=policy_ids["policy"])]

    # ------------------------------------------------------------------------------------------------ rewards
    def _call(self, i: int, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
              columns: dict[str, list[Any]]) -> tuple[list[float | None], list[dict[str, float]]]:
        """Function `i`'s values for the completions, and per completion what it cost (a reward model or a judge,
        through its `scored` method: `reward_model/<name>/...`, `judge/<name>/...`; plain functions: nothing)."""
        f, name = self._funcs[i], self.reward_names[i]
        costs: list[dict[str, float]] = [{} for _ in completions]
        kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns,
                  "trainer_state": None}
        try:
            params = inspect.signature(f).parameters
        except (TypeError, ValueError):  # a builtin or C callable: TRL's full convention
            params = None
        if params is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            missing = [p for p, v in params.items() if v.default is inspect.Parameter.empty and p not in kwargs
                       and v.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
            if missing:
                raise TypeError(f"reward function {name!r} needs {missing}, which is neither a dataset column "
                                f"({sorted(columns)}) nor one of prompts/completions/completion_ids")
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        scored = getattr(f, "scored", None)
        if callable(scored):  # a reward model or a judge: values and what each one cost
            out, costs = scored(**kwargs)
        else:
            out = f(**kwargs)
        if inspect.isawaitable(out):
            out = _run_coroutine(out)
        values = list(out) if out is not None else []
        if len(values) != len(completions):
            raise ValueError(f"reward function {name!r} returned {len(values)} values for {len(completions)} "
                             "completions")
        clean: list[float | None] = []
        for v in values:
            if v is None:
                clean.append(None)
            elif isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"reward function {name!r} returned {v!r}; expected a float or None")
            else:
                clean.append(float(v) if math.isfinite(float(v)) else None)
        return clean, costs

    def rewards(self, task: Task, texts: Sequence[str], completion_ids: Sequence[Sequence[int]] | None = None
                ) -> list[tuple[float | None, dict[str, float]]]:
        """(reward, per-function metrics) of each completion text of `task`."""
        n = len(texts)
        prompt: Any = task.info["messages"] if task.info["chat"] else task.prompt
        completions: list[Any] = ([[{"role": "assistant", "content": t}] for t in texts] if task.info["chat"]
                                  else list(texts))
        ids = [list(c) for c in completion_ids] if completion_ids is not None else [[] for _ in texts]
        columns = {k: [v] * n for k, v in task.info["columns"].items()}
        called = [self._call(i, [prompt] * n, completions, ids, columns) for i in range(len(self._funcs))]
        per_func = [values for values, _ in called]
        out: list[tuple[float | None, dict[str, float]]] = []
        for j in range(n):
            values = [(w, v) for w, vals in zip(self.reward_weights, per_func, strict=True)
                      if (v := vals[j]) is not None]
            reward = float(sum(w * v for w, v in values)) if values else None
            metrics = {f"reward/{name}": v for name, vals in zip(self.reward_names, per_func, strict=True)
                       if (v := vals[j]) is not None}
            for _, costs in called:
                metrics.update(costs[j])
            out.append((reward, metrics))
        return out

    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        return [r for r, _ in self.score_with_metrics(task, trajectories)]

    def score_with_metrics(self, task: Task, trajectories: Sequence[Trajectory]
                           ) -> list[tuple[float | None, dict[str, float]]]:
        return self.rewards(task, [t.text for t in trajectories], [t.tokens[t.n_prompt:] for t in trajectories])

    def grade(self, task: Task, text: str) -> float:
        reward, _ = self.rewards(task, [text])[0]
        return 0.0 if reward is None else reward


def _run_coroutine(coro: Any) -> Any:
    """Await an async reward function's result from synchronous scoring (in a fresh loop, or on a helper thread
    when this thread already runs one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
