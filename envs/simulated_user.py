"""`SimulatedUserEnv`: an agent serves a simulated customer over several turns (a tau-bench-like episode).

Roles: `agent` (the policy being trained) and `user` (a simulated customer). The user is usually a frozen model
(served on the rollout pool, never trained), but either role may be routed to any policy, so one trained policy
playing both roles, or two trained policies, run the same code.

Tasks
-----
Each task gives the user hidden instructions (only the user's model sees them) and a goal value that the agent must
find out from the user and submit as `<submit>VALUE</submit>`. Built in (no data needed): seeded customer-service
requests, in four kinds (`KINDS`): an order to track (the order number, e.g. `#W4821937`), a parcel to send to
another city (the city), a delivery to move (a date, e.g. `May 17`) and a refund (the card's last four digits).
The train stream is endless; `n_heldout` tasks from their own seed stream are held out, and the train stream skips
any task equal to a held-out one.

A user's tasks: `rows`, a list of dicts or a data file (a `.jsonl` file is read line by line, and an error names its
line; `.json`, `.csv`, `.parquet` and saved dataset folders need the `datasets` library), with the columns:

- `instructions` (required): the user's hidden instructions; they must give the user the goal value;
- `goal` (required): the value the agent must submit (a string or a number);
- `opening` (optional): the user's first message; without it the user's model writes it, answering `greeting`
  (warm starts then have no fixed opening to train on);
- `target` (optional): what the agent is told to find out (default "the information the customer's request
  needs"); `answer` (optional): the user's reply that gives the goal in demonstrations (default "It is GOAL.");
- `id` (optional): the task id's last part (default: the row's position).

Held out: all of `heldout_rows` when given, else `n_heldout` rows drawn with the seed; train rows equal to a held-out
row (same instructions and goal) are left out of training. The train stream is every train row once per epoch, in a
seeded order.

Episode
-------
The agent's conversation opens with its instructions (`agent_prompt`, a system message naming the target) and the
user's opening message. Each agent turn is generated on `engines["agent"]`; a turn with a non-empty
`<submit>...</submit>` ends the episode (the env asks engines to stop at `</submit>`). Otherwise the user replies:
the user's conversation has its own system message (`user_prompt` with the hidden instructions and the stop word),
then `greeting` as a "user" message and the opening as its own "assistant" turn; every agent message comes to it as a
"user" message, and its model's outputs, generated on `engines["user"]`, are its "assistant" turns (`user_temperature`,
default 0: greedy; None: the run's temperature; at most `user_max_tokens` tokens). The reply is appended to the
agent's conversation as a user message with loss mask 0. A reply holding `stop_word` ends the episode (the agent
never sees it). The episode also ends after `max_turns` agent turns and when either conversation runs out of context
(`max_context`; messages longer than `max_env_tokens` are cut, as `Budget` does).

Trajectories and reward
-----------------------
`rollout` returns the agent's trajectory (its turns trainable, the user's text as context with loss mask 0), then the
user's (the user model's own conversation: trainable when the role goes to a trained policy; the rollout service drops
it when the role goes to a frozen model). Agent reward: 1.0 when its submitted value equals the goal after
normalisation (lower case, punctuation removed, whitespace collapsed), else 0.0 (no submission, a user who stopped,
a turn or context limit). The user's reward is the agent's (a cooperative user: it is rewarded for helping the agent
succeed), recorded during the rollout as the `correct` metric so that it scores without the agent's trajectory.
A role that produced no token in an episode (the agent when a written opening already held the stop word, the user
when the agent submitted at once) gets no reward (None): nothing of it can be trained.

Metrics on the agent's trajectory: `submitted`, `user_stopped`, `turn_limit`, `context_limit` (exactly one of these
four is 1: how the episode ended), `correct`, `user_turns`, `user_tokens` (tokens the user's model generated),
`user_gave_goal` (a reply the user's model wrote held the goal value: `signal_advice` names a user that keeps it
back), plus
the conversation's own (`turns`, `env_tokens`, `env_truncations`, `truncated_turns`, `context_exhausted`, ...). The
user's trajectory carries `correct` and its own conversation's metrics.

Example:
    >>> env = SimulatedUserEnv(n_heldout=4, seed=0)
    >>> task = next(iter(env.tasks("heldout")))
    >>> env.grade(task, f"<submit>{task.info['goal'].lower()}</submit>")
    1.0
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from astratk.contracts import Engine, Env, PromptTooLong, SamplingParams, split_tasks
from astratk.envs.multiturn import Budget, Conversation, encode_chat
from astratk.envs.simulated_user_tasks import (
    KINDS,
    generated_row,
    normalize_value,
    read_rows,
    row_key,
    submitted_value,
)
from astratk.records import Task, Trajectory
from astratk.registry import check_choice

AGENT_PROMPT = ("You are a customer service agent for an online shop. Find out {target} from the customer by asking "
                "them, one short question at a time. As soon as you know it, reply with <submit>VALUE</submit>, the "
                "value exactly as the customer gave it; this ends the conversation.")
USER_PROMPT = ("You are playing a customer who is chatting with a shop's support agent. Stay in character and never "
               "say that you are an AI.\n\nYour situation:\n{instructions}\n\nHow to behave:\n"
               "- Write one short message at a time, as a customer would.\n"
               "- Give a detail only when the agent asks for it or needs it; do not tell everything at once.\n"
               "- Never invent details that your situation does not give you.\n"
               "- Once the agent has what it needs, or the chat is going nowhere, reply with {stop} alone.")
GREETING = "Hello, thanks for contacting us. How can I help you today?"
STOP_WORD = "###STOP###"
DEFAULT_TARGET = "the information the customer's request needs"
QUESTION = "Could you please tell me {target}?"  # the agent's demonstrated question
ANSWER = "It is {goal}."  # the user's demonstrated reply, for rows without an `answer`
SUBMIT_STOP = "</submit>"
USER_SEED_SALT = 104729  # the user's sampling seed: the episode's seed plus this (a stream apart from the agent's)
# ---------------------------------------------------------------------------------------------------------- env


class SimulatedUserEnv(Env):
    """An agent finds out a simulated user's goal value and submits it (module docstring). Roles: `agent`, `user`.

    The constructor is the config: `rows`/`heldout_rows` (a user's tasks; None: the built-in family over `kinds`),
    `n_heldout`, `seed`; the agent's budget `max_turns`, `max_tokens_per_turn`, `max_context`, `max_env_tokens`; the
    user's sampling `user_temperature` (None: the run's), `user_max_tokens`; `stop_word`; the texts `agent_prompt`
    ({target}), `user_prompt` ({instructions}, {stop}) and `greeting`; `demonstrate_user` adds the user's reply to
    the warm-start demonstrations (for a policy that plays both roles).
    """

    name = "simulated_user"
    roles = ("agent", "user")
    multi_turn = True  # a warm start's held-out check replays every demonstrated turn (`demonstrations`)

    def __init__(self, rows: str | list[dict[str, Any]] | None = None,
                 heldout_rows: str | list[dict[str, Any]] | None = None, n_heldout: int = 64, seed: int = 0,
                 kinds: Sequence[str] = tuple(KINDS), max_turns: int = 6, max_tokens_per_turn: int | None = None,
                 max_context: int = 2048, max_env_tokens: int = 256, user_temperature: float | None = 0.0,
                 user_max_tokens: int = 64, stop_word: str = STOP_WORD, agent_prompt: str = AGENT_PROMPT,
                 user_prompt: str = USER_PROMPT, greeting: str = GREETING, demonstrate_user: bool = False) -> None:
        self.rows = os.fspath(rows) if isinstance(rows, os.PathLike) else rows
        self.heldout_rows = os.fspath(heldout_rows) if isinstance(heldout_rows, os.PathLike) else heldout_rows
        self.n_heldout, self.seed, self.kinds = n_heldout, seed, tuple(kinds)
        self.max_turns, self.max_tokens_per_turn = max_turns, max_tokens_per_turn
        self.max_context, self.max_env_tokens = max_context, max_env_tokens
        self.user_temperature, self.user_max_tokens, self.stop_word = user_temperature, user_max_tokens, stop_word
        self.agent_prompt, self.user_prompt, self.greeting = agent_prompt, user_prompt, greeting
        self.demonstrate_user = demonstrate_user
        self._check_config()
        self.budget = Budget(max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn, max_context=max_context,
                             max_env_tokens=max_env_tokens)
        # the user replies after every agent turn but the last, plus its opening when its model writes it
        self.user_budget = Budget(max_turns=max_turns + 1, max_tokens_per_turn=user_max_tokens,
                                  max_context=max_context, max_env_tokens=max_env_tokens)
        self._load()  # now: a malformed row fails at construction, not in a worker

    def _check_config(self) -> None:
        """Refuse a config that could not run an episode, naming the key and what to give instead."""
        if self.heldout_rows is not None and self.rows is None:
            raise ValueError("heldout_rows needs rows (the train tasks); give both, or neither for the built-in tasks")
        if isinstance(self.n_heldout, bool) or not isinstance(self.n_heldout, int) or self.n_heldout < 1:
            raise ValueError(f"n_heldout must be a whole number >= 1, got {self.n_heldout!r}")
        if not self.kinds:
            raise ValueError(f"kinds: give at least one of {sorted(KINDS)}")
        for kind in self.kinds:
            check_choice("task kind", kind, KINDS, where="kinds")
        if self.max_turns < 2:
            raise ValueError(f"max_turns must be >= 2, got {self.max_turns}: the agent needs a turn to ask the user "
                             "and one to submit")
        for key in ("max_context", "max_env_tokens", "user_max_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1:
            raise ValueError(f"max_tokens_per_turn must be >= 1 or None (the run's max_new_tokens), got "
                             f"{self.max_tokens_per_turn}")
        if self.max_context <= self.user_max_tokens:
            raise ValueError(f"max_context ({self.max_context}) must be larger than user_max_tokens "
                             f"({self.user_max_tokens}): no user reply would fit; raise max_context")
        if self.user_temperature is not None and self.user_temperature < 0:
            raise ValueError(f"user_temperature must be >= 0 (0: greedy) or None (the run's), got "
                             f"{self.user_temperature}")
        if not isinstance(self.stop_word, str) or not self.stop_word.strip():
            raise ValueError(f"stop_word must be a non-empty string (the user's word for ending the chat), got "
                             f"{self.stop_word!r}")
        _check_template("agent_prompt", self.agent_prompt, ("target",), required=())
        _check_template("user_prompt", self.user_prompt, ("instructions", "stop"), required=("instructions",))

    def _load(self) -> None:
        """The held-out tasks (and a user's train rows); the built-in train stream is drawn lazily."""
        if self.rows is None:
            self._heldout = self._generated("heldout", self.n_heldout)
            self._train_rows: list[dict[str, Any]] = []
        else:
            heldout, train = self._split_rows()
            self._heldout = [self._task(r, "heldout", i) for i, r in enumerate(heldout)]
            self._train_rows = train
        self._heldout_keys = {row_key(t.info) for t in self._heldout}

    def _split_rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        rows = read_rows(self.rows, "rows")
        if self.heldout_rows is not None:
            heldout = read_rows(self.heldout_rows, "heldout_rows")
            if not heldout:
                raise ValueError("heldout_rows: no rows")
        else:
            if self.n_heldout >= len(rows):
                raise ValueError(f"rows: {len(rows)} rows and n_heldout={self.n_heldout} leave none to train on; "
                                 "lower n_heldout or give heldout_rows")
            order = list(range(len(rows)))
            random.Random(f"{self.seed}/heldout").shuffle(order)
            picked = set(order[: self.n_heldout])
            heldout = [rows[i] for i in sorted(picked)]
            rows = [r for i, r in enumerate(rows) if i not in picked]
        keys = {row_key(r) for r in heldout}
        train = [r for r in rows if row_key(r) not in keys]
        if not train:
            raise ValueError("rows: every train row is also a held-out row (same instructions and goal); no train "
                             "tasks remain")
        return heldout, [{**r, "index": i} for i, r in enumerate(train)]

    def __repr__(self) -> str:
        source = "built-in" if self.rows is None else (self.rows if isinstance(self.rows, str) else
                                                       f"{len(self.rows)} rows")
        return f"SimulatedUserEnv({source}, n_heldout={self.n_heldout}, max_turns={self.max_turns})"

    # --------------------------------------------------------------------------------------------------- tasks
    def _task(self, row: Mapping[str, Any], split: str, index: int) -> Task:
        info = {"instructions": row["instructions"], "goal": row["goal"], "opening": row.get("opening"),
                "target": row.get("target") or DEFAULT_TARGET,
                "answer": row.get("answer") or ANSWER.format(goal=row["goal"]), "kind": row.get("kind", "rows")}
        suffix = row.get("id") or index
        return Task(task_id=f"{self.name}/{split}/{suffix}", env=self.name, prompt=row["instructions"], info=info,
                    split=split)  # type: ignore[arg-type]

    def _generated(self, split: str, n: int) -> list[Task]:
        """The first `n` distinct built-in tasks of `split`'s seed stream."""
        out, seen = [], set()
        for i in range(1000 * n):  # far more draws than a reachable n needs (thousands of distinct tasks per kind)
            row = generated_row(random.Random(f"{self.seed}/{split}/{i}"), self.kinds)
            if row_key(row) not in seen:
                seen.add(row_key(row))
                out.append(self._task(row, split, i))
                if len(out) == n:
                    return out
        raise ValueError(f"n_heldout={n}: the kinds {list(self.kinds)} have fewer distinct tasks; lower n_heldout")

    def tasks(self, split: str) -> Iterator[Task]:
        return split_tasks(split, self._heldout, self._train_stream)

    def _train_stream(self) -> Iterator[Task]:
        """Built-in: an endless stream of new tasks (held-out ones skipped). A user's rows: each once per epoch,
        in a seeded order."""
        if not self._train_rows:
            for i in itertools.count():
                row = generated_row(random.Random(f"{self.seed}/train/{i}"), self.kinds)
                if row_key(row) not in self._heldout_keys:
                    yield self._task(row, "train", i)
        for epoch in itertools.count():
            order = list(self._train_rows)
            random.Random(f"{self.seed}/train/epoch{epoch}").shuffle(order)
            yield from (self._task(r, "train", r["index"]) for r in order)

    # ------------------------------------------------------------------------------------------------ messages
    def agent_system(self, task: Task) -> dict[str, str]:
        return {"role": "system", "content": self.agent_prompt.format(target=task.info["target"])}

    def user_start(self, task: Task) -> list[dict[str, str]]:
        """The user's conversation before its first reply: its hidden instructions, then the agent's greeting."""
        system = self.user_prompt.format(instructions=task.info["instructions"], stop=self.stop_word)
        return [{"role": "system", "content": system}, {"role": "user", "content": self.greeting}]

    def user_messages(self, task: Task, agent_text: str) -> list[dict[str, str]]:
        """What the user's model reads before replying to the agent's first message, after a written opening."""
        return [*self.user_start(task), {"role": "assistant", "content": self._opening(task)},
                {"role": "user", "content": agent_text}]

    def messages(self, task: Task) -> list[dict[str, str]]:
        """The agent's opening messages: its instructions and the user's written opening."""
        return [self.agent_system(task), {"role": "user", "content": self._opening(task)}]

    def _opening(self, task: Task) -> str:
        opening = task.info.get("opening")
        if not opening:
            raise NotImplementedError(f"task {task.task_id}: no 'opening' column, so the user's model writes the "
                                      "opening during the episode and there is no fixed first message to show; give "
                                      "rows an 'opening' for warm starts")
        return opening

    def demonstration(self, task: Task) -> str:
        """The agent's first move: ask for the target."""
        return QUESTION.format(target=task.info["target"])

    def demonstrations(self, task: Task) -> list[tuple[list[dict[str, str]], str]]:
        """A whole episode to warm-start the agent on: it asks for the target, the user answers with the goal (the
        row's `answer`), the agent submits the goal; with `demonstrate_user`, also the user's answer to the
        question, from the user's side of the chat."""
        first, ask, answer = self.messages(task), self.demonstration(task), task.info["answer"]
        seen = [*first, {"role": "assistant", "content": ask}, {"role": "user", "content": answer}]
        out = [(first, ask), (seen, f"<submit>{task.info['goal']}</submit>")]
        if self.demonstrate_user:
            out.append((self.user_messages(task, ask), answer))
        return out

    # ------------------------------------------------------------------------------------------------- rollout
    def user_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """The user's sampling: `user_temperature` (None: the run's), `user_max_tokens`, a seed of its own, and a
        stop at the stop word (the rest of such a reply is never read)."""
        temperature = sampling.temperature if self.user_temperature is None else self.user_temperature
        seed = None if sampling.seed is None else sampling.seed + USER_SEED_SALT
        return SamplingParams(temperature=temperature, max_tokens=self.user_max_tokens, seed=seed,
                              top_k_logprobs=sampling.top_k_logprobs, stop=(self.stop_word,))

    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        episode = _Episode(self, task, engines["agent"], engines["user"], sampling)
        await episode.run()
        return episode.trajectories(group_id, policy_ids)

    # --------------------------------------------------------------------------------------------------- score
    def signal_advice(self, means: Mapping[str, float]) -> list[str]:
        """What a run or probe with little signal should change, from the agent's trajectories: a user model that
        keeps the value back (a small chat model answers as an assistant would, and refuses), or an agent that hears
        it and does not submit it."""
        gave, replies = means.get("agent/user_gave_goal"), means.get("agent/user_turns", 0.0)
        if gave is None or not replies:
            return []
        correct = means.get("agent/correct", 0.0)
        if gave < 0.2:
            return [(f"the user gave the value in {gave:.0%} of episodes ({replies:.1f} replies each): a user model "
                    "that keeps it back leaves the agent nothing to submit; sample it (the frozen model's "
                    "temperature: 1.0), a stronger user model (frozen[].model.path), or a user_prompt that tells it "
                    "what to give")]
        if correct < 0.5 * gave:
            return [(f"the user gave the value in {gave:.0%} of episodes, the agent submitted it right in "
                    f"{correct:.0%}: a warm start on demonstrated episodes (model.warm_start) teaches the agent to "
                    "submit what it heard")]
        return []

    def grade(self, task: Task, text: str) -> float:
        """1.0 when the text's first `<submit>` value matches the goal after `normalize_value`, else 0.0."""
        value = submitted_value(text)
        return float(value is not None and normalize_value(value) == normalize_value(task.info["goal"]))

    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        """Agent: `grade` of its last message (a submission ends the episode). User: the agent's reward, from its
        `correct` metric. None for a role that produced no token."""
        out: list[float | None] = []
        for t in trajectories:
            if t.role not in self.roles:
                raise ValueError(f"{self.name}: unknown role {t.role!r} in trajectory {t.group_id}; the roles are "
                                 f"{list(self.roles)}")
            if not any(t.loss_mask):
                out.append(None)
            elif t.role == "agent":
                out.append(self.grade(task, t.text))
            else:
                out.append(t.metrics.get("correct"))
        return out


def _check_template(key: str, template: str, fields: Sequence[str], required: Sequence[str]) -> None:
    """A prompt template that formats with `fields` and names every `required` one."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{key} must be a non-empty string")
    missing = [f for f in required if "{" + f + "}" not in template]
    if missing:
        raise ValueError(f"{key} must contain {{{missing[0]}}} (where the text goes)")
    try:
        template.format(**{f: "x" for f in fields})
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{key}: cannot fill the template ({e!r}); it may use {['{' + f + '}' for f in fields]}, "
                         "and literal braces are written {{ and }}") from None


# ------------------------------------------------------------------------------------------------------ episode


class _Episode:
    """One episode's state: both conversations, the turn loop and how it ended (`SimulatedUserEnv.rollout`)."""

    def __init__(self, env: SimulatedUserEnv, task: Task, agent_engine: Engine, user_engine: Engine,
                 sampling: SamplingParams) -> None:
        self.env, self.task = env, task
        self.agent_engine, self.user_engine = agent_engine, user_engine
        self.agent_sampling = dataclasses.replace(sampling, stop=tuple(dict.fromkeys((*sampling.stop, SUBMIT_STOP))))
        self.user_sampling = env.user_sampling(sampling)
        self.agent: Conversation | None = None
        self.user: Conversation | None = None
        self.ended = ""  # submitted, user_stopped, turn_limit or context_limit
        self.gave_goal = False  # whether a reply the user's model wrote held the goal value

    async def run(self) -> None:
        """Agent turn, user reply, ... until a submission, the user's stop word, or a limit."""
        opening = self.task.info.get("opening")
        if not opening:  # the user's model writes its first message, answering the greeting
            opening = await self._user_reply(None) or ""
        tok = self.agent_engine.tokenizer
        self.agent = Conversation.start(tok, [self.env.agent_system(self.task), {"role": "user", "content": opening}],
                                        self.env.budget)
        if self.ended:
            return
        while True:
            turn = await self.agent.assistant_turn(self.agent_engine, self.agent_sampling)
            if submitted_value(turn.text) is not None:
                self.ended = "submitted"
                return
            if self.agent.turns >= self.env.max_turns:  # no agent turn would read a reply
                self.ended = "turn_limit"
                return
            if self.agent.room <= 0:
                self.ended = "context_limit"
                return
            reply = await self._user_reply(turn.text.strip())
            if self.ended:
                return
            self.agent.add_message("user", reply or "")
            if not self.agent.can_continue:
                self.ended = "context_limit"
                return

    async def _user_reply(self, agent_text: str | None) -> str | None:
        """The user's reply to `agent_text` (None: its opening), or None with `ended` set when the episode ends here
        (the stop word, or no room in the user's context). A prompt too long for the user's opening drops the task
        (`PromptTooLong`, counted by the rollout service); later, it only ends the episode."""
        try:
            if self.user is None:
                messages = self.env.user_start(self.task) if agent_text is None else self.env.user_messages(
                    self.task, agent_text)
                tok = self.user_engine.tokenizer
                self.user = Conversation.start(tok, messages, self.env.user_budget)
            else:
                self.user.add_message("user", agent_text or "")
            if not self.user.can_continue:
                self.ended = "context_limit"
                return None
            turn = await self.user.assistant_turn(self.user_engine, self.user_sampling)
        except PromptTooLong:
            if agent_text is None:
                raise
            self.ended = "context_limit"
            return None
        goal = normalize_value(str(self.task.info["goal"]))
        self.gave_goal = self.gave_goal or bool(goal) and goal in normalize_value(turn.text)
        if self.env.stop_word in turn.text:
            self.ended = "user_stopped"
            return None
        return turn.text.strip()

    def metrics(self) -> dict[str, float]:
        """The agent trajectory's episode metrics (module docstring)."""
        assert self.agent is not None
        last = self.agent.texts[-1] if self.agent.texts else ""
        user = self.user.metrics if self.user is not None else {"turns": 0.0, "policy_tokens": 0.0}
        ends = {name: float(self.ended == name) for name in ("submitted", "user_stopped", "turn_limit",
                                                                "context_limit")}
        return {**ends, "correct": self.env.grade(self.task, last) if self.ended == "submitted" else 0.0,
                "user_turns": user["turns"], "user_tokens": user["policy_tokens"],
                "user_gave_goal": float(self.gave_goal)}

    def trajectories(self, group_id: str, policy_ids: Mapping[str, str]) -> list[Trajectory]:
        """The agent's trajectory, then the user's (its prompt alone when its model never spoke)."""
        assert self.agent is not None
        m = self.metrics()
        agent = self.agent.trajectory(self.task, group_id=group_id, policy_id=policy_ids["agent"], role="agent",
                                      metrics=m)
        if self.user is not None:
            user = self.user.trajectory(self.task, group_id=group_id, policy_id=policy_ids["user"], role="user",
                                        metrics={"correct": m["correct"]})
        else:
            prompt = tuple(encode_chat(self.user_engine.tokenizer, self.env.user_start(self.task)))
            user = Trajectory(task_id=self.task.task_id, group_id=group_id, policy_id=policy_ids["user"], role="user",
                              tokens=prompt, n_prompt=len(prompt), loss_mask=(), behavior_logprobs=(),
                              behavior_versions=(), finished=False, metrics={"correct": m["correct"], "turns": 0.0})
        return [agent, user]
