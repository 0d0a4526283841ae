"""`AgentEnv`: train an agent written against the OpenAI chat API, unchanged.

The agent is a plain Python callable, sync or async, that talks to an OpenAI-compatible server (the `openai` client,
LangGraph, smolagents, raw HTTP...). For each sample of a group, `AgentEnv` gives it a fresh session of the rollout
worker's `OpenAIEndpoint` (`astratk.rollout.openai_api`): a `base_url` served by the worker's own engine for this
episode, and an `api_key`. Every call the agent makes is captured in token space, so the trajectory is exactly what
was sampled: the first call's prompt, then each completion as generated (loss mask 1, its log-probs and weight
versions) and what the agent put between two calls (tool results, its own messages) as environment tokens (loss mask
0). The endpoint reuses an earlier turn's tokens when the agent sends the conversation back, so no re-tokenisation
drift creeps in; a call whose prompt does not continue the previous one (the agent rewrote its history) starts a new
segment, and only the last segment is trained on: the others are counted (`segments_dropped`, `tokens_dropped`).

The agent is called with the keyword arguments it names among:
- `task`: the dataset row (a dict: `prompt` and the other columns), `prompt`: its prompt;
- `base_url`, `api_key`, `model`: where the first role's policy is served and under which model name;
- `base_urls`, `models`: the same per role, for agents with several roles (e.g. a solver and a critic trained as
  different policies): `roles=("solver", "critic")` and `policy.routes` map them to policies;
- `session`: the episode's id.
What it returns goes to `reward`, called with the keyword arguments it names among `task`, `prompt`, `output` (the
agent's return value), `calls` (the episode's captured calls per role) and `role`, which returns a float (every role
gets it), a dict role -> float, or None (not scorable: dropped, counted).

Each episode's agent runs on a thread of its own (an async agent on that thread's own event loop), so an agent that
blocks, sleeps or exits cannot stall the worker or the other episodes.
Bounded: an agent that raises (`sys.exit()` included) or runs past `agent_timeout_s` ends its episode (a TimeoutError
the agent raises itself is an error, not a timeout); the trajectory keeps what it generated
and gets `error_reward` (default 0.0: a policy whose output breaks the agent learns not to; None drops it, counted),
with `agent_error` or `agent_timeout` set in its metrics. A reward that raises or runs past `reward_timeout_s` leaves
the episode unscored (`reward_error`, `reward_timeout`). An episode in which the agent made no call for a role yields
that role's opening prompt with no completion and no reward, so the data layer counts it as dropped.

Per-trajectory metrics (in `metrics.nc` as `data/<policy>/traj/<role>/<name>_mean`): `calls`, `tool_calls`,
`tool_call_errors` (calls the parser cannot read: malformed JSON, no name, a tag never closed), `tokens_per_call`, `endpoint_latency_s`, `policy_tokens`, `env_tokens`,
`reused_turns` (prompts that reused an earlier turn's tokens), `segments_dropped`, `tokens_dropped`, `agent_seconds`, `agent_error`, `agent_timeout`, `reward_error`,
`reward_timeout`, `temperature_overridden` (calls that asked for another temperature than the run's: the run's wins,
so the log-probs the trainer sees are those of the distribution it assumes).

Example (the tutorial `tutorials/08_agent.py` trains one):
    >>> from openai import OpenAI  # doctest: +SKIP
    >>> def agent(task, base_url, api_key, model):  # doctest: +SKIP
    ...     client = OpenAI(base_url=base_url, api_key=api_key)
    ...     reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": task["prompt"]}])
    ...     return reply.choices[0].message.content
    >>> env = AgentEnv(rows, agent, lambda task, output: float(output == task["answer"]))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from astratk.contracts import Engine, SamplingParams
from astratk.envs.dataset import DatasetEnv
from astratk.models.chat import encode_chat, parse_tool_calls
from astratk.models.tools import check_tool_format
from astratk.records import Task, Trajectory
from astratk.registry import import_object
from astratk.rollout.bounded import _abandon
from astratk.rollout.openai_api import OpenAIEndpoint

ARGS_AGENT = ("task", "prompt", "base_url", "api_key", "model", "base_urls", "models", "session")
ARGS_REWARD = ("task", "prompt", "output", "calls", "role")


def _import(path: str, what: str) -> Callable[..., Any]:
    obj = import_object(path.replace(":", "."))
    if not callable(obj):
        raise TypeError(f"{what} {path!r} is not callable")
    return obj


def _qualified(f: Any) -> str:
    return f"{getattr(f, '__module__', None) or type(f).__module__}.{getattr(f, '__qualname__', type(f).__qualname__)}"


def _select(f: Callable[..., Any], offered: Mapping[str, Any], allowed: Sequence[str], what: str) -> dict[str, Any]:
    """The keyword arguments `f` takes among `offered` (all of them if it takes **kwargs); a clear error for a
    required parameter that is not offered."""
    try:
        params = inspect.signature(f).parameters
    except (TypeError, ValueError):
        return dict(offered)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in offered
               and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if missing:
        raise TypeError(f"the {what} needs {missing}; it is called with keyword arguments among {list(allowed)}")
    return {k: v for k, v in offered.items() if k in params}


class Overran(Exception):
    """A user's agent or reward ran past its time bound (not a TimeoutError the callable raised itself)."""


class Exited(Exception):
    """A user's agent or reward raised SystemExit (or another BaseException that is not an error of the run)."""


async def _call_bounded(f: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float | None) -> Any:
    """`f(**kwargs)` on a daemon thread of its own, an async `f` on that thread's own event loop, at most `timeout_s`
    seconds (`Overran`). The episode's event loop keeps serving the engine whatever the agent does (an async agent
    that blocks, sleeps or swallows cancellation cannot stall it), and a group's episodes all run at once, so their
    calls share the engine's batches. A call past its time is abandoned, not killed (counted in
    `abandoned_threads`): its later requests to its closed session are refused, so it ends at its next call.
    `SystemExit` and other non-error exits of `f` come back as `Exited`."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            out = f(**kwargs)
            future.set_result(asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out)
        except Exception as e:  # noqa: BLE001 - handed to the episode
            future.set_exception(e)
        except BaseException as e:  # noqa: BLE001 - sys.exit() in user code ends its episode, not the worker
            future.set_exception(Exited(f"{type(e).__name__}: {e}"))

    threading.Thread(target=target, name="astratk-agent", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
    except asyncio.TimeoutError:
        if not future.done():
            _abandon()
            raise Overran(f"{_qualified(f)} ran past {timeout_s:g} s") from None
        return future.result()  # finished at the deadline: its own result or error


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class AgentEnv(DatasetEnv):
    """An OpenAI-API agent as an env (module docstring). A tiny model's warm start checks it turn by turn
    (`multi_turn`: greedy decoding must reproduce every turn of a held-out task's demonstrations).

    Args:
        dataset: the tasks (rows with a `prompt` and any other columns; as for `FunctionEnv`).
        agent: the agent callable, or its import path ("mypkg.agents.solve" or "mypkg.agents:solve").
        reward: the reward callable, or its import path.
        roles: the roles the agent plays, one endpoint session (and base URL) each; `policy.routes` maps them to
            policies. The first role's URL is also `base_url`.
        eval_dataset, heldout, system_prompt, seed, name: as for `FunctionEnv`.
        demonstrations: for a tiny model's supervised warm start: a callable task row -> list of (messages,
            completion, tools or None), one per assistant turn of a good episode; or a column holding that list. A
            completion is text, or an assistant message (`content`, `tool_calls`) that the chat template renders.
        agent_timeout_s: the longest an episode's agent may run.
        reward_timeout_s: the longest one reward call may run.
        error_reward: the reward of an episode whose agent raised or timed out (None: unscored, dropped, counted).
        model_name: the model name the endpoint serves (what the agent passes as `model`).
        host: the address the endpoint binds (127.0.0.1: this machine only; every request carries a random key).
        tool_format: how the tools the agent sends reach the model (`astratk.models.tools`): "auto" (the model's
            chat template where it renders tools, else the "hermes" fallback: tools in the system message,
            `<tool_call>{json}</tool_call>` replies), "template" or "hermes" to force one. A run says at start which
            one each policy's model gets.
    """

    multi_turn = True

    def __init__(self, dataset: Any, agent: Callable[..., Any] | str, reward: Callable[..., Any] | str, *,
                 roles: Sequence[str] = ("policy",), eval_dataset: Any = None, heldout: float = 0.1,
                 system_prompt: str | None = None, demonstrations: Callable[..., Any] | str | None = None,
                 agent_timeout_s: float = 120.0, reward_timeout_s: float = 30.0, error_reward: float | None = 0.0,
                 model_name: str = "policy", host: str = "127.0.0.1", tool_format: str = "auto", seed: int = 0,
                 name: str = "agent") -> None:
        self._agent = _import(agent, "agent") if isinstance(agent, str) else agent
        self._reward = _import(reward, "reward") if isinstance(reward, str) else reward
        for what, f in (("agent", self._agent), ("reward", self._reward)):
            if not callable(f):
                raise TypeError(f"{what} must be callable (or an import path), got {f!r}")
        _select(self._agent, dict.fromkeys(ARGS_AGENT), ARGS_AGENT, "agent")  # fails now, not in a worker
        _select(self._reward, dict.fromkeys(ARGS_REWARD), ARGS_REWARD, "reward")
        # the saved config's view (config.yaml, the model cache key): names, not objects
        self.agent = agent if isinstance(agent, str) else _qualified(agent)
        self.reward = reward if isinstance(reward, str) else _qualified(reward)
        roles = tuple(roles)
        if not roles or len(set(roles)) != len(roles) or not all(isinstance(r, str) and r for r in roles):
            raise ValueError(f"roles: give distinct, non-empty names, got {roles!r}")
        self.roles = roles
        for key, value in (("agent_timeout_s", agent_timeout_s), ("reward_timeout_s", reward_timeout_s)):
            if not (isinstance(value, numbers.Real) and value > 0):
                raise ValueError(f"{key} must be a positive number of seconds, got {value!r}")
        if error_reward is not None and not math.isfinite(float(error_reward)):
            raise ValueError(f"error_reward must be a finite number or None, got {error_reward!r}")
        self.agent_timeout_s, self.reward_timeout_s = float(agent_timeout_s), float(reward_timeout_s)
        self.error_reward = None if error_reward is None else float(error_reward)
        self.model_name, self.host = model_name, host
        self.tool_format = check_tool_format(tool_format, "AgentEnv(tool_format=...)")
        self._demos = (_import(demonstrations, "demonstrations") if isinstance(demonstrations, str)
                       and "." in demonstrations else demonstrations)
        self.demonstrations_spec = demonstrations if demonstrations is None or isinstance(demonstrations, str) else (
            _qualified(demonstrations))
        self._init_dataset(dataset, eval_dataset, heldout, system_prompt, None, seed, name)
        self._endpoint: Any = None
        self._endpoint_lock = threading.Lock()

    # the endpoint is this process's (a thread serving HTTP): it is never pickled with the env
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_endpoint"], state["_endpoint_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._endpoint_lock = threading.Lock()

    def endpoint(self) -> Any:
        """This process's endpoint, started on first use (a random API key; bound to `host`)."""
        with self._endpoint_lock:
            if self._endpoint is None or not self._endpoint.running:
                self._endpoint = OpenAIEndpoint(None, self.model_name, host=self.host,
                                                api_key=secrets.token_urlsafe(24)).start()
            return self._endpoint

    # ------------------------------------------------------------------------------------------------ rows
    def row(self, task: Task) -> dict[str, Any]:
        """The dataset row of `task` as the agent and the reward get it."""
        prompt = task.info["messages"] if task.info["chat"] else task.prompt
        return {"prompt": prompt, **task.info["columns"]}

    def demonstrations(self, task: Task) -> list[tuple[Any, ...]]:
        if self._demos is None:
            raise NotImplementedError(f"env {self.name!r} has no demonstrations: give AgentEnv(demonstrations=...) "
                                      "(a function of the row, or a column) or model.path instead of a tiny model")
        demos = (task.info["columns"][self._demos] if isinstance(self._demos, str) else self._demos(self.row(task)))
        return [tuple(d) for d in demos]

    def demonstration(self, task: Task) -> str:
        """The last turn's completion of the demonstrations (the final answer)."""
        return self.demonstrations(task)[-1][1]

    # ------------------------------------------------------------------------------------------------ episodes
    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        endpoint = self.endpoint()
        loop = asyncio.get_running_loop()
        episode = f"{group_id.replace('/', '_')}-{uuid.uuid4().hex[:12]}"
        sessions = {role: f"{episode}-{i}" for i, role in enumerate(self.roles)}
        urls = {role: endpoint.open_session(sessions[role], engines[role], loop=loop, temperature=sampling.temperature,
                                            seed=sampling.seed, max_tokens=sampling.max_tokens,
                                            top_k_logprobs=sampling.top_k_logprobs, tool_format=self.tool_format)
                for role in self.roles}
        row = self.row(task)
        first = self.roles[0]
        offered = {"task": row, "prompt": row["prompt"], "base_url": urls[first], "api_key": endpoint.api_key,
                   "model": self.model_name, "base_urls": urls, "models": dict.fromkeys(self.roles, self.model_name),
                   "session": episode}
        status: dict[str, float] = {"agent_error": 0.0, "agent_timeout": 0.0, "reward_error": 0.0,
                                    "reward_timeout": 0.0}
        output, failed = None, False
        t0 = time.perf_counter()
        try:
            output = await _call_bounded(self._agent, _select(self._agent, offered, ARGS_AGENT, "agent"),
                                         self.agent_timeout_s)
        except Overran:
            status["agent_timeout"], failed = 1.0, True
        except Exception:  # noqa: BLE001 - an agent that raises ends its episode, counted
            status["agent_error"], failed = 1.0, True
        finally:
            status["agent_seconds"] = time.perf_counter() - t0
            overridden = {role: endpoint.session_stats(sessions[role]) for role in self.roles}
            calls = {role: endpoint.close_session(sessions[role]) for role in self.roles}
        rewards: dict[str, float | None] = dict.fromkeys(self.roles, None)
        if failed:
            rewards = dict.fromkeys(self.roles, self.error_reward)
        else:
            rewards = await self._rewards(row, output, calls, status)
        out = []
        for role in self.roles:
            metrics = {**status, "temperature_overridden": float(overridden[role].get("temperature", 0))}
            reward = rewards.get(role)
            if reward is not None:
                metrics["agent_reward"] = reward
            out.append(self._trajectory(task, calls[role], engines[role], group_id=group_id,
                                        policy_id=policy_ids[role], role=role, metrics=metrics))
        return out

    async def _rewards(self, row: dict[str, Any], output: Any, calls: dict[str, list[Any]],
                       status: dict[str, float]) -> dict[str, float | None]:
        offered = {"task": row, "prompt": row["prompt"], "output": output, "calls": calls,
                   "role": self.roles[0]}
        try:
            value = await _call_bounded(self._reward, _select(self._reward, offered, ARGS_REWARD, "reward"),
                                        self.reward_timeout_s)
        except Overran:
            status["reward_timeout"] = 1.0
            return dict.fromkeys(self.roles, None)
        except Exception:  # noqa: BLE001 - an unscorable episode is dropped, counted
            status["reward_error"] = 1.0
            return dict.fromkeys(self.roles, None)
        per_role = value if isinstance(value, Mapping) else dict.fromkeys(self.roles, value)
        out: dict[str, float | None] = {}
        for role in self.roles:
            v = per_role.get(role)
            if v is None or isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
                if v is not None:
                    status["reward_error"] = 1.0  # not a finite number: unscored, counted
                out[role] = None
            else:
                out[role] = float(v)
        return out

    def _trajectory(self, task: Task, calls: Sequence[Any], engine: Engine, *, group_id: str, policy_id: str,
                    role: str, metrics: dict[str, float]) -> Trajectory:
        if not calls:  # the agent never called this role: its opening prompt, nothing to train on, no reward
            prompt = encode_chat(engine.tokenizer, self.messages(task))
            return Trajectory(task_id=task.task_id, group_id=group_id, policy_id=policy_id, role=role,
                              tokens=tuple(prompt), n_prompt=len(prompt), loss_mask=(), behavior_logprobs=(),
                              behavior_versions=(), finished=False,
                              metrics={**{k: v for k, v in metrics.items() if k != "agent_reward"}, "calls": 0.0,
                                       "no_calls": 1.0})
        return trajectory_from_calls(calls, engine.tokenizer, task=task, group_id=group_id, policy_id=policy_id,
                                     role=role, metrics=metrics)

    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        return [t.metrics.get("agent_reward") for t in trajectories]

    def grade(self, task: Task, text: str) -> float:
        """The reward of an agent whose output is `text` (the warm start's held-out check reads the final answer)."""
        offered = {"task": self.row(task), "prompt": self.row(task)["prompt"], "output": text, "calls": {},
                   "role": self.roles[0]}
        try:
            value = self._reward(**_select(self._reward, offered, ARGS_REWARD, "reward"))
        except Exception:  # noqa: BLE001 - a reward that needs the calls cannot grade a bare text
            return 0.0
        value = value.get(self.roles[0]) if isinstance(value, Mapping) else value
        return float(value) if isinstance(value, numbers.Real) and math.isfinite(float(value)) else 0.0


def trajectory_from_calls(calls: Sequence[Any], tokenizer: Any, *, task: Task, group_id: str, policy_id: str,
                          role: str, metrics: Mapping[str, float] | None = None) -> Trajectory:
    """One role's episode from its captured calls (`CapturedCall`s, in order): the longest chain of calls whose
    prompts continue the previous prompt + completion token for token. A call that breaks the chain starts a new
    segment; the last segment is the trajectory and earlier ones are counted as dropped. With several choices per
    call (`n` > 1), the one the next call continues is kept (the first, for the last call)."""
    if not calls:
        raise ValueError(f"task {task.task_id!r}, role {role!r}: no captured calls to build a trajectory from (an "
                         "episode without calls has no completion to train on)")
    segments: list[dict[str, Any]] = []
    picks: list[int] = []
    for k, call in enumerate(calls):
        nxt = calls[k + 1] if k + 1 < len(calls) else None
        pick = 0
        if nxt is not None and len(call.completions) > 1:  # the sample the agent went on with
            for i, c in enumerate(call.completions):
                head = tuple(call.prompt_ids) + tuple(c.token_ids)
                if tuple(nxt.prompt_ids[:len(head)]) == head:
                    pick = i
                    break
        picks.append(pick)
        c = call.completions[pick]
        seg = segments[-1] if segments else None
        prompt = tuple(call.prompt_ids)
        if seg is not None and len(prompt) >= len(seg["tokens"]) and prompt[:len(seg["tokens"])] == tuple(seg["tokens"]):
            env = prompt[len(seg["tokens"]):]
            seg["tokens"] += env
            seg["mask"] += [0] * len(env)
            seg["logprobs"] += [0.0] * len(env)
            seg["versions"] += [-1] * len(env)
            seg["topk_ids"] += [()] * len(env)
            seg["topk_logprobs"] += [()] * len(env)
            seg["env_tokens"] += len(env)
        else:
            seg = {"tokens": list(prompt), "n_prompt": len(prompt), "mask": [], "logprobs": [], "versions": [],
                   "topk_ids": [], "topk_logprobs": [], "env_tokens": 0, "calls": 0, "policy_tokens": 0,
                   "finished": True}
            segments.append(seg)
        seg["tokens"] += c.token_ids
        seg["mask"] += [1] * len(c.token_ids)
        seg["logprobs"] += c.logprobs
        seg["versions"] += c.versions
        seg["topk_ids"] += list(c.topk_ids) if c.topk_ids else [()] * len(c.token_ids)
        seg["topk_logprobs"] += list(c.topk_logprobs) if c.topk_logprobs else [()] * len(c.token_ids)
        seg["calls"] += 1
        seg["policy_tokens"] += len(c.token_ids)
        seg["finished"] = c.finish_reason == "stop"
        seg["text"] = tokenizer.decode(list(c.token_ids), skip_special_tokens=True)
    last = segments[-1]
    dropped = segments[:-1]
    n_calls = len(calls)
    parsed = [tc for call, i in zip(calls, picks, strict=True) for tc in parse_tool_calls(
        tokenizer.decode(list(call.completions[i].token_ids), skip_special_tokens=True))]
    stats = {"calls": float(n_calls), "tool_calls": float(sum(not tc.error for tc in parsed)),
             "tool_call_errors": float(sum(bool(tc.error) for tc in parsed)),
             "tokens_per_call": sum(len(call.completions[i].token_ids)
                                    for call, i in zip(calls, picks, strict=True)) / n_calls,
             "endpoint_latency_s": sum(call.latency_s for call in calls) / n_calls,
             "policy_tokens": float(last["policy_tokens"]), "env_tokens": float(last["env_tokens"]),
             "completion_tokens": float(last["policy_tokens"]),
             "reused_turns": float(sum(call.extends is not None for call in calls)),
             "segments_dropped": float(len(dropped)),
             "tokens_dropped": float(sum(s["policy_tokens"] for s in dropped))}
    widths = {len(row) for row, m in zip(last["topk_ids"], last["mask"], strict=True) if m}
    k = min(widths) if widths else 0  # calls that recorded different widths: the width every generated token has
    topk_ids = tuple(tuple(row[:k]) for row in last["topk_ids"]) if k else ()
    topk_logprobs = tuple(tuple(row[:k]) for row in last["topk_logprobs"]) if k else ()
    return Trajectory(task_id=task.task_id, group_id=group_id, policy_id=policy_id, role=role,
                      tokens=tuple(last["tokens"]), n_prompt=last["n_prompt"], loss_mask=tuple(last["mask"]),
                      behavior_logprobs=tuple(last["logprobs"]), behavior_versions=tuple(last["versions"]),
                      finished=last["finished"], text=last.get("text", ""), metrics={**stats, **(metrics or {})},
                      behavior_topk_ids=topk_ids, behavior_topk_logprobs=topk_logprobs)
