"""Tasks from a dataset of prompts: the loading, validation and split logic shared by `FunctionEnv` and `AgentEnv`.

The dataset is a `datasets.Dataset` (or a `DatasetDict` with `train` and `test` splits), a list of dicts, or a path:
a `.jsonl` / `.json` / `.csv` / `.parquet` file, or a folder written by `Dataset.save_to_disk`. Every row has a `prompt`,
either a string (sent as the user message) or a list of chat messages (`{"role": ..., "content": ...}`), and any
other columns (they travel with the task in `task.info["columns"]`).

Held-out tasks (the run's evaluation) come from `eval_dataset`, else the `DatasetDict`'s `test` split, else a seeded
`heldout` share of the rows (a fraction, or a count). Train rows whose prompt is also a held-out prompt are left out
of training; `stats` counts them. The train stream is endless: the train rows in a new seeded order every epoch.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import numbers
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from astratk.contracts import Env, split_tasks
from astratk.records import Task

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_rows(data: Any, what: str = "dataset") -> list[dict[str, Any]]:
    """Rows of a `datasets.Dataset`, a list of dicts or a path (module docstring), as a list of dicts."""
    if isinstance(data, (str, os.PathLike)):
        data = _load_path(os.fspath(data), what)
    if hasattr(data, "to_list") and hasattr(data, "column_names"):  # a datasets.Dataset
        rows = data.to_list()
    elif isinstance(data, Mapping):
        raise TypeError(f"{what}: got a mapping with keys {sorted(data)[:8]}; give a Dataset, a list of dicts or a "
                        "path (for a DatasetDict, FunctionEnv takes its 'train' and 'test' splits itself)")
    else:
        try:
            rows = list(data)
        except TypeError:
            raise TypeError(f"{what}: expected a datasets.Dataset, a list of dicts or a path, got "
                            f"{type(data).__name__}") from None
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"{what} row {i}: expected a dict with a 'prompt', got {type(row).__name__}")
    return [dict(r) for r in rows]


def _load_path(path: str, what: str) -> Any:
    try:
        import datasets
    except ImportError:
        datasets = None
    ext = os.path.splitext(path)[1].lower()
    if os.path.isdir(path):
        if datasets is None:
            raise ImportError(f"{what}: reading the saved dataset folder {path} needs the datasets library: "
                              "pip install datasets")
        return datasets.load_from_disk(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what}: no file or folder {path!r} (give a .jsonl/.json/.csv/.parquet file, a "
                                "folder from Dataset.save_to_disk, a Dataset or a list of dicts)")
    if ext == ".jsonl" and datasets is None:  # the one format readable without the datasets library
        from astratk.envs.jsonl import records
        return [row for _, row in records(path)]
    if ext not in FILE_FORMATS:
        raise ValueError(f"{what}: cannot read {path!r}: the file type {ext or '(none)'} is not one of "
                         f"{sorted(FILE_FORMATS)}")
    if datasets is None:
        raise ImportError(f"{what}: reading {path} needs the datasets library: pip install datasets")
    return datasets.load_dataset(FILE_FORMATS[ext], data_files=path, split="train")


def _splits(dataset: Any) -> tuple[Any, Any | None]:
    """(train, test) of a DatasetDict-like mapping of splits; (dataset, None) otherwise."""
    if isinstance(dataset, Mapping) and "train" in dataset and all(hasattr(v, "column_names")
                                                                   for v in dataset.values()):
        return dataset["train"], dataset.get("test")
    return dataset, None


def _check_prompt(prompt: Any, where: str) -> None:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: 'prompt' is empty")
        return
    if isinstance(prompt, Sequence) and prompt and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return
    raise ValueError(f"{where}: 'prompt' must be a non-empty string or a list of chat messages "
                     f"{{'role': ..., 'content': ...}}, got {type(prompt).__name__}: {str(prompt)[:80]!r}")


def _fingerprint(rows: list[dict[str, Any]]) -> str:
    return hashlib.sha1(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


class DatasetEnv(Env):
    """An env whose tasks are the rows of a dataset (module docstring). Subclasses add `rollout` and `score`.

    Args:
        dataset: the train rows (or all rows, when the held-out share comes out of them).
        eval_dataset: held-out rows; default: the DatasetDict's `test` split, else `heldout` of the rows.
        heldout: the share of rows held out when no eval dataset is given: a fraction in (0, 1) or a count.
        system_prompt: a system message put before string prompts (chat prompts keep their own messages).
        demonstration_column: a column holding a reference completion, for the supervised warm start of a tiny
            model (`model.tiny`); without one, give `model.path`.
        seed: the order of the held-out split and of each epoch's train stream.
        name: the env's name in task ids and metrics.
    """

    def _init_dataset(self, dataset: Any, eval_dataset: Any = None, heldout: float = 0.1,
                      system_prompt: str | None = None, demonstration_column: str | None = None, seed: int = 0,
                      name: str = "dataset") -> None:
        self.name = name
        self.system_prompt = system_prompt
        self.demonstration_column = demonstration_column
        self.seed = seed
        self.heldout = heldout
        self.dataset = os.fspath(dataset) if isinstance(dataset, (str, os.PathLike)) else None
        self.eval_dataset = os.fspath(eval_dataset) if isinstance(eval_dataset, (str, os.PathLike)) else None
        if isinstance(dataset, (str, os.PathLike)):
            dataset = _load_path(os.fspath(dataset), "dataset")
        train_data, test_data = _splits(dataset)
        rows = load_rows(train_data, "dataset")
        if not rows:
            raise ValueError("dataset: no rows")
        held_rows = load_rows(eval_dataset if eval_dataset is not None else test_data, "eval_dataset") if (
            eval_dataset is not None or test_data is not None) else None
        for split_name, part in (("dataset", rows), ("eval_dataset", held_rows or [])):
            for i, row in enumerate(part):
                if "prompt" not in row:
                    raise ValueError(f"{split_name} row {i}: no 'prompt' column (columns: {sorted(row)})")
                _check_prompt(row["prompt"], f"{split_name} row {i}")
                if demonstration_column is not None and not isinstance(row.get(demonstration_column), str):
                    raise ValueError(f"{split_name} row {i}: demonstration_column {demonstration_column!r} must hold "
                                     f"a string, got {type(row.get(demonstration_column)).__name__}")
        n_rows = len(rows)
        if held_rows is None:
            order = list(range(len(rows)))
            random.Random(f"{seed}/heldout").shuffle(order)
            n = self._heldout_count(heldout, len(rows))
            picked = set(order[:n])
            held_rows = [rows[i] for i in sorted(picked)]
            rows = [r for i, r in enumerate(rows) if i not in picked]
        if not held_rows:
            raise ValueError("eval_dataset: no rows")
        self._heldout = [self._task(r, "heldout", i) for i, r in enumerate(held_rows)]
        keys = {t.prompt for t in self._heldout}
        train = [self._task(r, "train", i) for i, r in enumerate(rows)]
        self._train = [t for t in train if t.prompt not in keys]
        self.stats = {"rows": n_rows, "train": len(self._train), "heldout": len(self._heldout),
                      "train_overlap_removed": len(train) - len(self._train)}
        if not self._train:
            raise ValueError("every train prompt is also a held-out prompt: no train tasks remain")
        if self.dataset is None:  # in memory: described by its content, so the warm-start cache tells datasets apart
            self.dataset = f"in-memory dataset: {n_rows} rows, sha1 {_fingerprint(rows + held_rows)}"
        if self.eval_dataset is None and eval_dataset is not None:
            self.eval_dataset = f"in-memory dataset: {len(held_rows)} rows"

    @staticmethod
    def _heldout_count(heldout: float, n: int) -> int:
        if isinstance(heldout, bool) or not isinstance(heldout, numbers.Real) or not heldout > 0:
            raise ValueError(f"heldout: give a fraction in (0, 1) or a count >= 1, got {heldout!r}")
        count = max(1, round(heldout * n)) if heldout < 1 else int(heldout)
        if count != heldout and heldout >= 1:
            raise ValueError(f"heldout: a count must be a whole number, got {heldout!r}")
        if count >= n:
            raise ValueError(f"heldout: {count} held-out rows would leave none of the {n} rows to train on; give "
                             "a smaller share or an eval_dataset")
        return count

    def _task(self, row: dict[str, Any], split: str, index: int) -> Task:
        prompt = row["prompt"]
        text = prompt if isinstance(prompt, str) else json.dumps(list(prompt), sort_keys=True)
        columns = {k: v for k, v in row.items() if k != "prompt"}
        return Task(task_id=f"{self.name}/{split}/{index}", env=self.name, prompt=text,
                    info={"chat": not isinstance(prompt, str), "messages": None if isinstance(prompt, str) else
                          [dict(m) for m in prompt], "columns": columns},
                    split=split)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------------------ tasks
    def tasks(self, split: str) -> Iterator[Task]:
        return split_tasks(split, self._heldout, self._train_stream)

    def _train_stream(self) -> Iterator[Task]:
        for epoch in itertools.count():
            order = list(self._train)
            random.Random(f"{self.seed}/epoch{epoch}").shuffle(order)
            yield from order

    def messages(self, task: Task) -> list[dict[str, str]]:
        if task.info["chat"]:
            return [dict(m) for m in task.info["messages"]]
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": task.prompt}]

    def demonstration(self, task: Task) -> str:
        if self.demonstration_column is None:
            raise NotImplementedError(f"env {self.name!r} has no demonstrations: give FunctionEnv("
                                      "demonstration_column=...) naming a column with reference completions, or "
                                      "model.path instead of a tiny warm-started model")
        return task.info["columns"][self.demonstration_column]
