"""DB-Bench-like database tasks (AgentBench's DB kind) on real SQLite, multi-turn with a turn limit.

This module holds the env (splits, the episode loop, the reward); its tasks come from `db_tasks.py`, replies are read
and answers judged by `db_answers.py`, and SQL runs through `sql.py`.

Tasks
-----
Generated (the default): each database is drawn from the seed (`departments`, `employees`, `sales`; 3-6, 8-20 and
15-40 rows) and asked `questions_per_db` questions from templates, each with a gold SQL query: count, sum, rounded
average, filter list (any order), top-3 list (ordered), join lookup, group-by count and group-by argmax (asked only
when the maximum is unique). The gold answer is what the gold query returns on that database. Held-out databases
come from their own seed stream, and the endless train stream skips any (database, question) that is held out.

A user's tasks: `tasks_file`, a JSONL file with one task per line (blank lines skipped):

    {"db_path": "shop.sqlite", "question": "How many orders?", "answer": 42}
    {"schema_sql": "CREATE TABLE t (a INTEGER, b TEXT);", "rows": {"t": [[1, "x"], [2, "y"]]},
     "question": "Which b have a > 0?", "answer": ["x", "y"], "ordered": false, "sql": "SELECT b FROM t WHERE a > 0"}

`db_path` is relative to the JSONL file; `rows` maps a table to positional rows; `answer` is a value or a list of
values; `ordered` (default false) says whether a list's order counts; `sql` (optional) is a gold query, used as the
demonstration. The file is UTF-8; a malformed line (bad bytes included) raises ValueError naming the file and its
1-based line. `n_heldout` lines drawn with the seed are held out, or all of `heldout_file`'s when it is given.

Databases are materialised once per content key (sha256 of schema and rows) as `<cache>/sqlite/db-<key>.sqlite`: a
temporary file renamed into place, so readers never see a partial file and racing writers are harmless. A user's
`db_path` is only ever opened read-only.

Episode
-------
The first user message holds the instructions, the schema (the CREATE statements) and the question. In each
assistant turn the first `<sql>...</sql>` or `<answer>...</answer>` tag counts, or a Hermes/Qwen JSON tool call in
its place: `<tool_call>{"name": "sql", "arguments": {"query": "SELECT ..."}}</tool_call>` runs the query (a
malformed call, or another tool, is answered with what is wrong and counted in `tool_errors`; the prompt teaches the
tags, so a tool-calling setup describes the tool in `system_prompt`). SQL runs read-only: the database is
opened with `mode=ro` and an authorizer allows only reads (SELECT, read-only PRAGMAs such as table_info), so writes,
DDL, ATTACH and transactions fail with an error; a progress handler stops a query after `time_limit_s`; at most
`max_rows` rows are fetched. The result (a header and rows, or the error) comes back as the next message (loss mask
0), from `result_role`: "user" (any chat template) or "tool" (a template with a tool role; Qwen2.5 renders it as a
user turn of `<tool_response>`). An answer ends the episode; otherwise it ends after `max_turns` assistant turns.

Reward
------
1.0 when the last assistant message's first tag is `<answer>` and its content matches the gold answer, else 0.0; a
pure function of the text (`grade`). Values match when both parse as numbers and are equal (a gold value with d
decimals also accepts a longer number that rounds to it; "1,234" reads as 1234) or, otherwise, as case-insensitive
text. A list answer is a JSON list or values separated by commas or newlines; it must have the gold's length and
match element-wise (ordered) or as a multiset (any order).

Example:
    >>> env = DatabaseEnv(n_heldout=4, seed=0)
    >>> task = next(iter(env.tasks("heldout")))
    >>> sorted(task.info) == ['answer', 'db_seed', 'is_list', 'kind', 'ordered', 'schema', 'sql']
    True
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from astratk.contracts import Engine, Env, SamplingParams
from astratk.envs.agentbench.db_answers import answers_match, first_action
from astratk.envs.agentbench.db_tasks import TEMPLATES, generated_tasks, load_tasks_file, random_database
from astratk.envs.agentbench.sql import materialise, run_query
from astratk.envs.multiturn import Budget, Conversation
from astratk.records import Task, Trajectory

INSTRUCTIONS = ("Answer the question using the SQLite database described below. To run a read-only SQL query, reply "
                "with <sql>SELECT ...</sql>; you will see at most {max_rows} result rows. When you know the answer, "
                "reply with <answer>...</answer> (separate several values with commas). One action per turn; you "
                "have {max_turns} turns.")
FORMAT_HINT = "No action found. Reply with <sql>SELECT ...</sql> to run a query or <answer>...</answer> to answer."


class DatabaseEnv(Env):
    """SQL question answering: one role, `policy`, queries a SQLite database and answers. See the module docstring
    for tasks, the action format and the reward."""

    name = "db"
    roles = ("policy",)
    multi_turn = True  # a warm start's held-out check replays every demonstrated turn (`demonstrations`)

    def __init__(self, n_heldout: int = 64, seed: int = 1234, questions_per_db: int = 3, tasks_file: str | None = None,
                 heldout_file: str | None = None, max_turns: int = 5, max_rows: int = 20, time_limit_s: float = 1.0,
                 max_tokens_per_turn: int | None = None, max_context: int = 4096, max_env_tokens: int = 512,
                 result_role: str = "user", cache_dir: str | None = None, system_prompt: str | None = None) -> None:
        if n_heldout < 1 or not 1 <= questions_per_db <= len(TEMPLATES):
            raise ValueError(f"n_heldout must be >= 1 and questions_per_db in [1, {len(TEMPLATES)}]; got "
                             f"{n_heldout} and {questions_per_db}")
        if max_rows < 1 or time_limit_s <= 0:
            raise ValueError(f"max_rows must be >= 1 and time_limit_s > 0, got {max_rows} and {time_limit_s}")
        if heldout_file is not None and tasks_file is None:
            raise ValueError("heldout_file needs tasks_file (the train tasks); give both, or neither to generate")
        if result_role not in ("user", "tool"):
            raise ValueError(f"result_role must be 'user' or 'tool', got {result_role!r}")
        self.n_heldout, self.seed, self.questions_per_db = n_heldout, seed, questions_per_db
        self.tasks_file, self.heldout_file = tasks_file, heldout_file
        self.max_turns, self.max_rows, self.time_limit_s = max_turns, max_rows, time_limit_s
        self.max_tokens_per_turn, self.max_context = max_tokens_per_turn, max_context
        self.max_env_tokens, self.result_role = max_env_tokens, result_role
        self.cache_dir, self.system_prompt = cache_dir, system_prompt
        self._budget = Budget(max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn, max_context=max_context,
                              max_env_tokens=max_env_tokens)
        self._load()  # now: a malformed tasks file fails at construction, not in a worker

    def _load(self) -> None:
        if self.tasks_file is None:
            heldout = generated_tasks(self.name, self.seed, "heldout", self.questions_per_db)
            self._heldout = list(itertools.islice(heldout, self.n_heldout))
            self._user_train: list[Task] = []
        else:
            self._heldout, self._user_train = self._split_user_tasks()
        self._heldout_keys = {self._key(t) for t in self._heldout}

    def __getstate__(self) -> dict[str, Any]:
        """Config only (a user's tasks may hold whole tables): the task lists are rebuilt where they are needed."""
        state = dict(self.__dict__)
        for key in ("_heldout", "_user_train", "_heldout_keys"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._heldout = None  # type: ignore[assignment]

    # --------------------------------------------------------------------------------------------------- tasks
    def _split_user_tasks(self) -> tuple[list[Task], list[Task]]:
        def tasks(records: list[dict[str, Any]], split: str) -> list[Task]:
            return [Task(task_id=f"{self.name}/{split}/{r['id']}", env=self.name, prompt=r["question"], info=r["info"],
                         split=split) for r in records]  # type: ignore[arg-type]

        records = load_tasks_file(self.tasks_file, self.cache_dir)  # type: ignore[arg-type]
        if self.heldout_file is not None:
            heldout = tasks(load_tasks_file(self.heldout_file, self.cache_dir), "heldout")
            keys = {self._key(t) for t in heldout}
            train = [t for t in tasks(records, "train") if self._key(t) not in keys]
            if not train:
                raise ValueError(f"every task in {self.tasks_file} is also in heldout_file {self.heldout_file}")
            return heldout, train
        if self.n_heldout >= len(records):
            raise ValueError(f"tasks_file {self.tasks_file} has {len(records)} tasks and n_heldout={self.n_heldout} "
                             "leaves none to train on; lower n_heldout or give heldout_file")
        order = records[:]
        random.Random(f"{self.seed}/split").shuffle(order)
        return tasks(order[: self.n_heldout], "heldout"), tasks(order[self.n_heldout:], "train")

    @staticmethod
    def _key(task: Task) -> tuple[str, str]:
        """What makes two tasks the same: the database (seed, spec or file) and the question."""
        info = task.info
        db = info.get("db_seed") or info.get("db_path") or json.dumps(info.get("db_spec"), sort_keys=True)
        return db, task.prompt

    def tasks(self, split: str) -> Iterator[Task]:
        if self._heldout is None:  # unpickled: rebuild
            self._load()
        if split == "heldout":
            return iter(self._heldout)
        if split != "train":
            raise ValueError(f"unknown split {split!r}; choose 'train' or 'heldout'")
        return self._train_stream()

    def _train_stream(self) -> Iterator[Task]:
        if not self._user_train:  # generated: an endless stream of new databases
            train = generated_tasks(self.name, self.seed, "train", self.questions_per_db)
            yield from (t for t in train if self._key(t) not in self._heldout_keys)
            return
        for epoch in itertools.count():  # a user's tasks: each once per epoch, in a seeded order
            order = list(self._user_train)
            random.Random(f"{self.seed}/train/epoch{epoch}").shuffle(order)
            yield from order

    def database_file(self, task: Task) -> Path:
        """The task's SQLite file on this machine (materialised into the cache here if needed)."""
        info = task.info
        if "db_path" in info:
            path = Path(info["db_path"])
            if not path.is_file():
                raise FileNotFoundError(f"task {task.task_id}: database {path} is missing on this machine")
            return path
        spec = info["db_spec"] if "db_spec" in info else random_database(random.Random(info["db_seed"]))
        return materialise(spec, self.cache_dir)

    # ------------------------------------------------------------------------------------------------- rollout
    def messages(self, task: Task) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        text = (INSTRUCTIONS.format(max_rows=self.max_rows, max_turns=self.max_turns) + "\n\nSchema:\n"
                + task.info["schema"] + "\n\nQuestion: " + task.prompt)
        return msgs + [{"role": "user", "content": text}]

    def demonstration(self, task: Task) -> str:
        """The gold query: a correct first move for `messages(task)`."""
        if not task.info.get("sql"):
            raise NotImplementedError(f"task {task.task_id} has no gold SQL to demonstrate")
        return f"<sql>{task.info['sql']}</sql>"

    def demonstrations(self, task: Task) -> list[tuple[list[dict[str, str]], str]]:
        """A whole episode to warm-start on: the gold query, then, after its result as the env shows it (the gold
        query run on the task's database), the gold answer. Both moves are taught: a model shown only the query
        learns to query and never to answer."""
        first = self.messages(task)
        query = self.demonstration(task)
        result = run_query(self.database_file(task), task.info["sql"], max_rows=self.max_rows,
                           time_limit_s=self.time_limit_s)
        seen = [*first, {"role": "assistant", "content": query}, {"role": self.result_role, "content": result.text}]
        return [(first, query), (seen, "<answer>" + ", ".join(task.info["answer"]) + "</answer>")]

    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        engine = engines["policy"]
        db_file = await asyncio.to_thread(self.database_file, task)
        conv = Conversation.start(engine.tokenizer, self.messages(task), self._budget)
        counts = {"queries": 0.0, "query_errors": 0.0, "query_timeouts": 0.0, "format_errors": 0.0, "answered": 0.0}
        while conv.can_continue:
            turn = await conv.assistant_turn(engine, sampling)
            action = first_action(turn.text)
            if action is not None and action[0] == "answer":
                counts["answered"] = 1.0
                break
            if not conv.can_continue:
                break  # the last turn's query would have no reader
            if action is None:
                counts["format_errors"] += 1
                conv.add_message("user", FORMAT_HINT)
                continue
            if action[0] == "invalid":  # a malformed tool call: a failed call, answered with what is wrong
                conv.add_message(self.result_role, f"Error: {action[1]}", tool_call=True, tool_error=True)
                continue
            result = await asyncio.to_thread(run_query, db_file, action[1], max_rows=self.max_rows,
                                             time_limit_s=self.time_limit_s)  # a slow query must not block the loop
            counts["queries"] += 1
            counts["query_errors"] += float(result.error)
            counts["query_timeouts"] += float(result.timed_out)
            conv.add_message(self.result_role, result.text, tool_call=True, tool_error=result.error)
        last = conv.texts[-1] if conv.texts else ""
        metrics = {**counts, "correct": self.grade(task, last),
                   "turn_limit_hit": float(not counts["answered"] and conv.turns >= self.max_turns)}
        return [conv.trajectory(task, group_id=group_id, policy_id=policy_ids["policy"], role="policy",
                                metrics=metrics)]

    # --------------------------------------------------------------------------------------------------- score
    def grade(self, task: Task, text: str) -> float:
        """1.0 when the text's first action is an answer matching the gold answer."""
        action = first_action(text)
        if action is None or action[0] != "answer":
            return 0.0
        info = task.info
        return float(answers_match(action[1], info["answer"], is_list=info["is_list"], ordered=info["ordered"]))

    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        return [self.grade(task, t.text) for t in trajectories]
