"""A user's corpus and QA files (JSON Lines) for the search env.

Passages, one JSON object a line: `{"id": "d1", "text": "..."}` or `{"id": "d1", "title": "...", "text": "..."}`
(ids are strings or integers and unique; extra keys are ignored). Questions: `{"question": "...", "answer": "..."}`
or `{"question": "...", "answers": ["...", "..."]}` (the first answer is canonical, the others aliases; an optional
"id"). Blank lines are skipped. Anything else raises `ValueError("<file>:<line>: <what is wrong>")`, line 1-based.
Paths may be any fsspec URL.

Held-out split: a separate QA file, or `n_heldout` questions drawn with `seed` from the one file. Train questions that
repeat a held-out question (same text after normalisation) are dropped from train and counted (`Corpus.dropped`).

Example:
    >>> corpus = JsonlCorpus(passages="wiki.jsonl", qa="qa.jsonl", n_heldout=100).load()  # doctest: +SKIP
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

from astratk.envs.jsonl import records
from astratk.envs.search.corpus import Corpus, Passage, Question


def _text(obj: dict[str, Any], key: str, where: str, *, required: bool = True) -> str:
    value = obj.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        got = "missing" if key not in obj else f"{type(value).__name__} {value!r}"[:80]
        kind = "a non-empty string" if required else "a string"
        raise ValueError(f"{where}: {key!r} must be {kind}, got {got}")
    return value


def _scalar(value: Any, what: str, where: str) -> str:
    """Ids and answers: strings, or integers written as numbers (years are often given as 1953)."""
    if isinstance(value, bool) or not isinstance(value, str | int) or not str(value).strip():
        raise ValueError(f"{where}: {what} must be a non-empty string or an integer, got {value!r}"[:200])
    return str(value).strip()


def load_passages(path: str) -> list[Passage]:
    """Passages from a JSONL file (module docstring); duplicate ids and an empty file raise."""
    out: list[Passage] = []
    seen: dict[str, int] = {}
    for lineno, obj in records(path):
        where = f"{path}:{lineno}"
        if "id" not in obj:
            raise ValueError(f"{where}: missing 'id' (each line needs {{\"id\", \"text\"}} or "
                             "{\"id\", \"title\", \"text\"})")
        pid = _scalar(obj["id"], "'id'", where)
        if pid in seen:
            raise ValueError(f"{where}: duplicate id {pid!r} (first on line {seen[pid]})")
        seen[pid] = lineno
        out.append(Passage(pid, _text(obj, "text", where).strip(), _text(obj, "title", where, required=False).strip()))
    if not out:
        raise ValueError(f"{path}: no passages (the file is empty)")
    return out


def load_qa(path: str) -> list[Question]:
    """Questions from a JSONL file (module docstring); an empty file raises."""
    out: list[Question] = []
    seen: dict[str, int] = {}
    for lineno, obj in records(path):
        where = f"{path}:{lineno}"
        question = _text(obj, "question", where).strip()
        if ("answer" in obj) == ("answers" in obj):
            raise ValueError(f"{where}: give exactly one of 'answer' (a string) or 'answers' (a list of strings)")
        if "answer" in obj:
            answers = (_scalar(obj["answer"], "'answer'", where),)
        else:
            raw = obj["answers"]
            if not isinstance(raw, list) or not raw:
                raise ValueError(f"{where}: 'answers' must be a non-empty list, got {raw!r}"[:200])
            answers = tuple(_scalar(a, "each of 'answers'", where) for a in raw)
        qid = _scalar(obj["id"], "'id'", where) if "id" in obj else f"line{lineno}"
        if qid in seen:  # ids name tasks: two questions with one id would be one task to the data layer
            raise ValueError(f"{where}: duplicate id {qid!r} (first on line {seen[qid]})")
        seen[qid] = lineno
        out.append(Question(qid, question, answers))
    if not out:
        raise ValueError(f"{path}: no questions (the file is empty)")
    return out


def _question_key(text: str) -> str:
    return " ".join(text.lower().split())


@dataclass(frozen=True)
class JsonlCorpus:
    """A user's passages and questions (module docstring). `heldout_qa`: a held-out QA file; without one,
    `n_heldout` questions of `qa` are drawn with `seed`. `load()` reads the files; envs cache the result per process.
    """

    passages: str
    qa: str
    heldout_qa: str | None = None
    n_heldout: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if self.heldout_qa is None and self.n_heldout < 1:
            raise ValueError(f"n_heldout must be >= 1 without a heldout_qa file, got {self.n_heldout}")

    @property
    def stamp(self) -> tuple[Any, ...]:
        """What a process cache keys on: the config and, for local files, their size and mtime (an edited file is
        read again)."""
        stats = []
        for path in (self.passages, self.qa, self.heldout_qa):
            st = os.stat(path) if path and os.path.exists(path) else None
            stats.append((st.st_size, st.st_mtime_ns) if st else None)
        return (self, *stats)

    def load(self) -> Corpus:
        passages = tuple(load_passages(self.passages))
        questions = load_qa(self.qa)
        if self.heldout_qa is not None:
            heldout = load_qa(self.heldout_qa)
        else:
            if self.n_heldout >= len(questions):
                raise ValueError(f"n_heldout={self.n_heldout} leaves no train question out of {len(questions)} in "
                                 f"{self.qa}; lower n_heldout or give heldout_qa")
            order = list(range(len(questions)))
            random.Random(f"{self.seed}/heldout").shuffle(order)
            chosen = set(order[: self.n_heldout])
            heldout = [q for i, q in enumerate(questions) if i in chosen]
            questions = [q for i, q in enumerate(questions) if i not in chosen]
        held_keys = {_question_key(q.question) for q in heldout}
        train = [q for q in questions if _question_key(q.question) not in held_keys]
        if not train:
            raise ValueError(f"every question of {self.qa} repeats a held-out question; nothing is left to train on")
        return Corpus(passages, tuple(train), tuple(heldout), dropped=len(questions) - len(train))
