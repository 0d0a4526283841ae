"""`SearchEnv`: a multi-turn retrieval agent over a local corpus, scored by answer F1 or exact match.

An episode (one role, `policy`): the policy reads the question and writes either `<search>query</search>` (the env
returns the top-k BM25 passages as `<information>[1] ... [k] ...</information>` in a new message, loss mask 0) or
`<answer>...</answer>` (the episode ends). A turn with neither, or with empty tags, gets a short correction message
(counted in `invalid_actions`). A turn that holds an answer ends the episode even if it also searched, so the reward
is a function of the last assistant message alone; a turn with several searches runs the first. The episode also ends
at the turn or context budget (`Budget`; AstraFlow's search agent allows up to 32 turns: `Budget(max_turns=32,
max_context=...)`). A search on the last turn is not run (no turn would read it).

Stop strings: the env asks for `stop=("</search>", "</answer>")` so that an engine ends a turn at its first action,
as Search-R1 does. This takes effect where `Conversation.assistant_turn` passes `sampling.stop` on to the engine.

Reward (`reward="f1"` or `"em"`): SQuAD's answer normalisation (lower case, no punctuation, no articles, single
spaces), then token-level F1 or exact match, the best over the gold answer and its aliases; 0 without an answer.

Corpora: `SyntheticCorpus` (invented facts, single- and multi-hop questions) or `JsonlCorpus` (a user's files). Each
process builds the corpus and the BM25 index once, lazily, and keeps them in a process-wide cache keyed by the corpus
config (`_shared`), so every env copy that Dask unpickles in a worker (the run spec travels with each task) shares one
index; the env pickles as its config only.

Per-trajectory metrics: searches, invalid_actions, answered, turn_limit (ended unanswered because the turns ran out),
retrieval_seconds, plus the conversation's turns, truncated_turns, env_truncations, context_exhausted, ...

Example (a scripted policy that follows the reference solution):
    >>> import asyncio
    >>> from astratk.engines import ScriptedEngine
    >>> from astratk.models import build_char_tokenizer
    >>> env = SearchEnv(SyntheticCorpus(n_people=20, n_cities=8, n_countries=3, n_companies=10, n_heldout=10))
    >>> task = next(iter(env.tasks("heldout")))
    >>> tok = build_char_tokenizer()
    >>> turns = [tok(t)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")] for t in env.solution_turns(task)]
    >>> [traj] = asyncio.run(env.rollout(task, {"policy": ScriptedEngine(tok, turns)}, SamplingParams(max_tokens=99),
    ...                                  policy_ids={"policy": "p"}, group_id="g"))
    >>> env.score(task, [traj]), traj.metrics["searches"] == task.info["hops"]
    ([1.0], True)

Extending: another retriever replaces `index` (anything with `search(query, k) -> [(position, score)]` over
`data.passages`); another answer format overrides `parse_action`.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import string
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from astratk.contracts import Engine, Env, SamplingParams
from astratk.envs.multiturn import Budget, Conversation, parse_tags
from astratk.envs.search.corpus import Corpus, Passage, SyntheticCorpus
from astratk.envs.search.index import BM25Index
from astratk.envs.search.jsonl import JsonlCorpus
from astratk.records import Task, Trajectory
from astratk.registry import check_choice

INSTRUCTIONS = ("Answer the question. To look something up, write <search>query</search>; the results come back in "
                "<information>...</information>. Search as often as you need, then write <answer>the answer</answer>.")
CORRECTION = "Invalid action. Write <search>query</search> to search or <answer>answer</answer> to answer."
STOP = ("</search>", "</answer>")
DEFAULT_CORPUS = SyntheticCorpus()
DEFAULT_BUDGET = Budget(max_turns=8, max_context=4096, max_env_tokens=512)

# ---------------------------------------------------------------------------------------------------- answer scores

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD v1.1's normalisation: lower case, remove punctuation, remove articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))


def f1_score(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD's token-level F1 (bag of normalised words), the best over the gold answers. When either side normalises
    to nothing (a gold answer "The"), F1 is their exact match, as in SQuAD v2."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        if not pred or not gold:
            best = max(best, float(pred == gold))
            continue
        same = sum((Counter(pred) & Counter(gold)).values())
        if same:
            precision, recall = same / len(pred), same / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


REWARDS: dict[str, Callable[[str, Sequence[str]], float]] = {"f1": f1_score, "em": exact_match}


def parse_action(text: str) -> tuple[Literal["answer", "search"], str] | None:
    """The action of one assistant turn: its first non-empty answer if any, else its first non-empty search, else
    None (invalid)."""
    tags = [(name, content) for name, content in parse_tags(text, ("search", "answer")) if content]
    for wanted in ("answer", "search"):
        for name, content in tags:
            if name == wanted:
                return wanted, content  # type: ignore[return-value]
    return None


# ------------------------------------------------------------------------------------------------ per-process cache

_SHARED: dict[Any, Any] = {}
_SHARED_LOCK = threading.Lock()
_SHARED_MAX = 8  # corpora + indexes kept per process; a run uses one of each, tests a few


def _shared(key: Any, build: Callable[[], Any]) -> Any:
    """One object per key per process (built once even when several threads ask at the same time)."""
    with _SHARED_LOCK:
        if key not in _SHARED:
            if len(_SHARED) >= _SHARED_MAX:
                _SHARED.pop(next(iter(_SHARED)))  # oldest first: dicts keep insertion order
            _SHARED[key] = build()
        return _SHARED[key]


# ------------------------------------------------------------------------------------------------------------ env


class SearchEnv(Env):
    """Multi-turn search-and-answer over a corpus (module docstring). The constructor is the config:

    - `corpus`: `SyntheticCorpus(...)` or `JsonlCorpus(passages=..., qa=...)`;
    - `top_k`: passages returned per search; `budget`: turns, tokens per turn, context, longest env message;
    - `reward`: "f1" or "em"; `env_role`: the chat role of retrieval results ("user" renders in every template;
      "tool" where the template has one); `instructions`: the text before the question; `k1`, `b`: BM25.
    """

    name = "search"
    roles = ("policy",)
    multi_turn = True  # a warm start's held-out check replays every demonstrated turn (`demonstrations`)

    def __init__(self, corpus: SyntheticCorpus | JsonlCorpus = DEFAULT_CORPUS, top_k: int = 3,
                 budget: Budget = DEFAULT_BUDGET,
                 reward: Literal["f1", "em"] = "f1", env_role: str = "user", instructions: str = INSTRUCTIONS,
                 k1: float = 1.5, b: float = 0.75) -> None:
        if not isinstance(corpus, SyntheticCorpus | JsonlCorpus):
            raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
                f"corpus must be a SyntheticCorpus or a JsonlCorpus, got {type(corpus).__name__}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        check_choice("reward", reward, REWARDS)
        if not env_role:
            raise ValueError("env_role must name a chat role, e.g. 'user' or 'tool'")
        self.corpus = corpus
        self.top_k = top_k
        self.budget = budget
        self.reward = reward
        self.env_role = env_role
        self.instructions = instructions
        self.k1, self.b = k1, b
        self._reset_caches()
        _ = self.data  # read/generate now: a malformed file fails at construction, not in a worker

    def _reset_caches(self) -> None:
        self._data: Corpus | None = None
        self._index: BM25Index | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Config only: the corpus and index are rebuilt (once per process) where the env is unpickled."""
        state = dict(self.__dict__)
        for key in ("_data", "_index"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_caches()

    def __repr__(self) -> str:
        return (f"SearchEnv({self.corpus!r}, top_k={self.top_k}, reward={self.reward!r}, "
                f"max_turns={self.budget.max_turns})")

    # ----------------------------------------------------------------------------------------- corpus and index
    @property
    def _key(self) -> Any:
        return getattr(self.corpus, "stamp", self.corpus)

    @property
    def data(self) -> Corpus:
        """The loaded corpus (passages and question splits), built on first use in each process."""
        if self._data is None:
            self._data = _shared(("corpus", self._key), self.corpus.load)
        return self._data

    @property
    def index(self) -> BM25Index:
        """The BM25 index over `data.passages`, built on first use in each process."""
        if self._index is None:
            texts = [p.display for p in self.data.passages]
            self._index = _shared(("bm25", self._key, self.k1, self.b),
                                  lambda: BM25Index(texts, k1=self.k1, b=self.b).build())
        return self._index

    def retrieve(self, query: str) -> list[Passage]:
        passages = self.data.passages
        return [passages[i] for i, _ in self.index.search(query, self.top_k)]

    @staticmethod
    def format_passages(passages: Sequence[Passage]) -> str:
        if not passages:
            return "<information>\nNo results.\n</information>"
        body = "\n".join(f"[{n}] {p.display}" for n, p in enumerate(passages, 1))
        return f"<information>\n{body}\n</information>"

    # --------------------------------------------------------------------------------------------------- tasks
    def _task(self, q: Any, split: Literal["train", "heldout"]) -> Task:
        info = {"answers": list(q.answers), "hops": q.hops, "kind": q.kind, "gold_ids": list(q.gold_ids),
                "queries": list(q.queries)}
        return Task(task_id=f"{self.name}/{split}/{q.qid}", env=self.name, prompt=q.question, info=info, split=split)

    def tasks(self, split: str) -> Iterator[Task]:
        if split == "heldout":
            return iter([self._task(q, "heldout") for q in self.data.heldout])
        if split != "train":
            raise ValueError(f"unknown split {split!r}; choose 'train' or 'heldout'")
        return self._train_stream()

    def _train_stream(self) -> Iterator[Task]:
        """Endless: each epoch is every train question once, in an order drawn from the corpus seed and the epoch."""
        questions = list(self.data.train)
        for epoch in itertools.count():
            order = list(range(len(questions)))
            random.Random(f"{self.corpus.seed}/train/{epoch}").shuffle(order)
            for i in order:
                yield self._task(questions[i], "train")

    def messages(self, task: Task) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self.instructions}\nQuestion: {task.prompt}"}]

    def solution_turns(self, task: Task) -> list[str]:
        """A scripted episode's assistant turns: one search per hop (the synthetic corpus knows the bridge entities;
        a user's question is searched as asked), then the canonical answer."""
        queries = task.info.get("queries") or [task.prompt]
        return [f"<search>{q}</search>" for q in queries] + [f"<answer>{task.info['answers'][0]}</answer>"]

    def demonstration(self, task: Task) -> str:
        """The scripted episode's turns as one text (search ... then answer): it grades 1.0, but as one turn it
        answers without reading the results; warm starts train on `demonstrations`, turn by turn."""
        return "\n".join(self.solution_turns(task))

    def demonstrations(self, task: Task) -> list[tuple[list[dict[str, str]], str]]:
        """The scripted episode as a multi-turn warm start: each assistant turn after the turns and retrieved
        passages before it, exactly as an episode shows them (the search runs here), so the model learns to read
        what it searched before it answers."""
        messages, out = self.messages(task), []
        for turn in self.solution_turns(task):
            out.append((messages, turn))
            action = parse_action(turn)
            if action is not None and action[0] == "search":
                messages = [*messages, {"role": "assistant", "content": turn},
                            {"role": self.env_role, "content": self.format_passages(self.retrieve(action[1]))}]
        return out

    # ------------------------------------------------------------------------------------------------- rollout
    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        engine = engines["policy"]
        tok = engine.tokenizer
        conv = Conversation.start(tok, self.messages(task), self.budget)
        _ = self.index  # built once per process, here, so that retrieval_seconds times searches only
        sampling = dataclasses.replace(sampling, stop=tuple(dict.fromkeys(sampling.stop + STOP)))
        m = {"searches": 0.0, "invalid_actions": 0.0, "answered": 0.0, "turn_limit": 0.0, "retrieval_seconds": 0.0}
        while conv.can_continue:
            turn = await conv.assistant_turn(engine, sampling)
            action = parse_action(turn.text)
            if action is not None and action[0] == "answer":
                m["answered"] = 1.0
                break
            if not conv.can_continue:  # nothing would read a reply
                break
            if action is None:
                m["invalid_actions"] += 1
                conv.add_message(self.env_role, CORRECTION, tool_error=True)
                continue
            start = time.perf_counter()
            passages = self.retrieve(action[1])
            m["retrieval_seconds"] += time.perf_counter() - start
            m["searches"] += 1
            conv.add_message(self.env_role, self.format_passages(passages), tool_call=True)
        m["turn_limit"] = float(not m["answered"] and conv.turns >= self.budget.max_turns)
        return [conv.trajectory(task, group_id=group_id, policy_id=policy_ids["policy"], role="policy", metrics=m)]

    # --------------------------------------------------------------------------------------------------- score
    def grade(self, task: Task, text: str) -> float:
        """Reward of an assistant message: F1/EM of its answer against the gold answers; 0 without an answer."""
        action = parse_action(text)
        if action is None or action[0] != "answer":
            return 0.0
        return REWARDS[self.reward](action[1], task.info["answers"])

    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        """Pure in the trajectory's text (its last assistant message): an episode that answered ended on it."""
        return [self.grade(task, t.text) for t in trajectories]
