"""Math solver + verifier (AstraFlow's headline multi-policy workflow).

One episode: the solver answers; the verifier sees the problem and the answer and replies ACCEPT or REJECT
(`verdict_words`: other words, such as yes and no, which a small chat model says more readily); on REJECT
the solver retries once with the verifier's reply in its context (a second turn of the solver's conversation: the
reply is appended with loss mask 0). Rewards: solver 1 if its final answer is correct, else 0;
verifier 1 if its verdict matches the truth of the answer it judged (a reply with neither word is wrong).

Class balance (`verifier_reward: balanced`): while the solver is weak most answers are wrong, so a verifier that
says "no" to everything is right most of the time, and plain verdict accuracy rewards exactly that. Balanced, a
right verdict on an answer of class c (right or wrong) earns n / (K n_c) in a group of n judged answers, n_c of class
c, K classes present: the group's verifier rewards then average to its balanced accuracy (the mean over the classes
of the share judged right), so "no" to everything averages 1/2 wherever both classes occur, and a right "yes" on the
rarer right answer weighs what the many right "no"s weigh together. A group of one class, or one episode, is scored
1/0 as before. The held-out evaluation reports `balanced_accuracy_verifier` (and `verdict_accept_rate`) beside the
plain accuracy either way.

Roles are `solver` and `verifier`; which policy plays each is configuration (`PolicySpec.roles`), so one shared policy
or two separate ones run the same code. The judged answer's truth is graded during the rollout (the base env's
`grade`, in a thread off the event loop: a math-verify grading can take up to its timeout) and carried in the verifier
trajectory's metrics, so `score` needs nothing but the trajectories.

Example:
    >>> env = SolverVerifierEnv(base=ArithmeticEnv(levels=[1, 2]))  # doctest: +SKIP
    >>> solver, verifier = await env.rollout(task, {"solver": e, "verifier": e}, sampling,  # doctest: +SKIP
    ...                                      policy_ids={"solver": "main", "verifier": "main"}, group_id="g/0")
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence

from astratk.contracts import Engine, Env, SamplingParams
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.multiturn import Budget, Conversation
from astratk.records import Task, Trajectory

VERDICTS = ("ACCEPT", "REJECT")  # the verifier's words for "the answer is right" and "it is wrong"


def parse_verdict(text: str, words: Sequence[str] = VERDICTS) -> str | None:
    """"accept" / "reject" from the first of the two verdict `words` (accept's, reject's) in `text`, as a whole word
    in any case; None when neither appears."""
    m = re.search(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b", text, re.IGNORECASE)
    if m is None:
        return None
    return "accept" if m.group(1).lower() == words[0].lower() else "reject"


class SolverVerifierEnv(Env):
    """Solver + verifier over any base env with `messages`, `grade` and `demonstration` (math envs)."""

    name = "solver_verifier"
    roles = ("solver", "verifier")

    def __init__(self, base: Env | None = None, retry: bool = True, verifier_prompt: str = "Check: {problem} "
                 "Answer: {answer} Reply ACCEPT or REJECT.", retry_prompt: str = "{verdict} Try again.",
                 max_context: int = 256, verdict_words: Sequence[str] = VERDICTS,
                 verifier_reward: str = "accuracy") -> None:
        self.base = base if base is not None else ArithmeticEnv()
        for method in ("messages", "grade"):
            if not callable(getattr(self.base, method, None)):
                raise TypeError(f"base env {self.base.name!r} lacks {method}(); the solver + verifier workflow needs it")
        if "{problem}" not in verifier_prompt or "{answer}" not in verifier_prompt:
            raise ValueError("verifier_prompt must contain {problem} and {answer}")
        words = tuple(verdict_words)
        if len(words) != 2 or not all(isinstance(w, str) and w.strip() for w in words) or \
                words[0].lower() == words[1].lower():
            raise ValueError(f"verdict_words must be two different words (accept's, reject's), e.g. "
                             f"['yes', 'no'], got {verdict_words!r}")
        self.verdict_words = tuple(w.strip() for w in words)
        if verifier_reward not in ("accuracy", "balanced"):
            raise ValueError(f"verifier_reward must be 'accuracy' (1 for a right verdict) or 'balanced' (right verdicts "
                             f"weighted so each class of answer counts alike), got {verifier_reward!r}")
        self.verifier_reward = verifier_reward
        self.retry, self.verifier_prompt, self.retry_prompt = retry, verifier_prompt, retry_prompt
        self.budget = Budget(max_turns=2 if retry else 1, max_context=max_context)

    # ------------------------------------------------------------------------------------------------ tasks
    def tasks(self, split: str) -> Iterable[Task]:
        return self.base.tasks(split)

    def messages(self, task: Task) -> list[dict[str, str]]:
        return self.base.messages(task)

    def demonstration(self, task: Task) -> str:
        return self.base.demonstration(task)

    def grade(self, task: Task, text: str) -> float:
        return self.base.grade(task, text)

    def verifier_messages(self, task: Task, answer: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.verifier_prompt.format(problem=task.prompt, answer=answer.strip())}]

    def demonstrations(self, task: Task) -> list[tuple[list[dict[str, str]], str]]:
        """Every role's format for a warm start: the solver's answer; the verifier judging either the right answer
        or a wrong one (half each, by task id); and, when retries are on, the solver's retry after a rejected wrong
        answer (the conversation a rollout builds: answer, the verifier's reply, the answer again)."""
        right = self.base.demonstration(task)
        wrong = _perturb(right, task.task_id)
        shown = right if int(hashlib.sha256(task.task_id.encode()).hexdigest(), 16) % 2 == 0 else wrong
        yes, no = self.verdict_words
        verdict = yes if self.base.grade(task, shown) == 1.0 else no
        out = [(self.messages(task), right), (self.verifier_messages(task, shown), verdict)]
        if self.retry:
            retry = [*self.messages(task), {"role": "assistant", "content": wrong},
                     {"role": "user", "content": self.retry_prompt.format(verdict=no)}]
            out.append((retry, right))
        return out

    # ------------------------------------------------------------------------------------------------ rollout
    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        solver_engine, verifier_engine = engines["solver"], engines["verifier"]
        solver = Conversation.start(solver_engine.tokenizer, self.messages(task), self.budget)
        first = await solver.assistant_turn(solver_engine, sampling)
        # graded in a thread: a math-verify grading may take up to its timeout, which must not stall the episodes
        # sharing this event loop
        judged_correct = await asyncio.to_thread(self.base.grade, task, first.text)

        verifier = Conversation.start(verifier_engine.tokenizer, self.verifier_messages(task, first.text),
                                      Budget(max_turns=1, max_context=self.budget.max_context))
        reply = await verifier.assistant_turn(verifier_engine, _reseeded(sampling, 104729))
        verdict = parse_verdict(reply.text, self.verdict_words)

        retried = self.retry and verdict == "reject" and solver.can_continue
        if retried:
            solver.add_message("user", self.retry_prompt.format(verdict=reply.text.strip()))
            if solver.can_continue:
                await solver.assistant_turn(solver_engine, sampling)
        verdict_code = {"accept": 1.0, "reject": 0.0}.get(verdict or "", -1.0)
        return [
            solver.trajectory(task, group_id=group_id, policy_id=policy_ids["solver"], role="solver",
                              metrics={"retried": float(retried), "first_correct": judged_correct,
                                       "verdict": verdict_code}),
            verifier.trajectory(task, group_id=group_id, policy_id=policy_ids["verifier"], role="verifier",
                                metrics={"judged_correct": judged_correct, "verdict": verdict_code}),
        ]

    # ------------------------------------------------------------------------------------------------ score
    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        """Solver: its final answer graded by the base env. Verifier: 1 when its accept word (ACCEPT) met a correct
        answer or its reject word (REJECT) a wrong one (`judged_correct`, graded during the rollout), 0 otherwise,
        including replies with no verdict; `balanced` weighs the 1s by class (module docstring)."""
        out: list[float | None] = []
        weights = self._class_weights(trajectories)
        for t in trajectories:
            if t.role == "solver":
                out.append(self.base.grade(task, t.text))
            elif t.role == "verifier":
                verdict, truth = t.metrics.get("verdict", -1.0), t.metrics.get("judged_correct")
                out.append(None if truth is None else
                           float(verdict >= 0 and verdict == truth) * weights.get(float(truth), 1.0))
            else:
                raise ValueError(f"{self.name}: unknown role {t.role!r} in trajectory {t.group_id}")
        return out

    def _class_weights(self, trajectories: Sequence[Trajectory]) -> dict[float, float]:
        """`balanced`: truth (1.0 right, 0.0 wrong) -> n / (K n_c) over the verifier trajectories judged (module
        docstring); {} (weight 1) for `accuracy` or a group of one class."""
        if self.verifier_reward != "balanced":
            return {}
        truths = [float(t.metrics["judged_correct"]) for t in trajectories
                  if t.role == "verifier" and t.metrics.get("judged_correct") is not None]
        classes = {c: truths.count(c) for c in set(truths)}
        if len(classes) < 2:
            return {}
        return {c: len(truths) / (len(classes) * n) for c, n in classes.items()}

    def heldout_metrics(self, episodes: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        """The verifier's balanced accuracy over the held-out episodes (the mean, over right and wrong answers, of
        the share it judged right: 0.5 for "no" to everything, whatever the solver's accuracy) and the share of its
        verdicts that accepted."""
        judged = [(t.metrics.get("verdict", -1.0), t.metrics["judged_correct"]) for ep in episodes for t in ep
                  if t.role == "verifier" and t.metrics.get("judged_correct") is not None]
        if not judged:
            return {}
        recalls = [sum(v == c for v, _ in mine) / len(mine)
                   for c in (0.0, 1.0) if (mine := [(v, tr) for v, tr in judged if tr == c])]
        return {"balanced_accuracy_verifier": sum(recalls) / len(recalls),
                "verdict_accept_rate": sum(v == 1.0 for v, _ in judged) / len(judged)}


def _reseeded(sampling: SamplingParams, salt: int) -> SamplingParams:
    """The same sampling with a seed derived for another role (None stays None)."""
    if sampling.seed is None:
        return sampling
    return SamplingParams(temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                          stop_token_ids=sampling.stop_token_ids, seed=sampling.seed + salt,
                          top_k_logprobs=sampling.top_k_logprobs, stop=sampling.stop)


def _perturb(answer: str, key: str) -> str:
    """A plausible wrong answer: the number moved by 1-9 (deterministic per key), or the text with a digit appended."""
    offset = 1 + int(hashlib.sha256(key.encode()).hexdigest(), 16) % 9
    try:
        return str(int(answer.strip()) + offset)
    except ValueError:
        return answer.strip() + str(offset)
