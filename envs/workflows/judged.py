"""`JudgedEnv`: a policy trained on an LLM judge's verdicts, measured on held-out tasks by a ground truth the judge
never sees.

Many tasks have no checkable answer, so their reward comes from another model that reads the answer and grades it
against a rubric. Training on a judge invites gaming it (an answer that reads well to the judge and is wrong), so this
workflow keeps two scores apart:

- **train tasks** are rewarded by the judge's verdict only;
- **held-out tasks** are scored by the base env's own grader (`base.grade`: the ground truth), which the judge never
  sees, so the held-out curve says whether what the judge rewards is what is right.

Roles: `policy` answers the base env's prompt (one turn); `judge` reads `template` filled with the question
(`{prompt}`), the answer (`{completion}`) and any of the task's `info` fields (e.g. `{answer}` for a reference, when
the judge may see one) and replies in words; its verdict is read as `envs.judge.read_verdict` reads a remote judge's
(`parse`: "verdict" with `verdicts`, "score" on `scale`, or a function). The judge is meant to be a frozen model
(`RunSpec.frozen`: served beside the policy, never trained); routed to a trained policy, it is rewarded 1 when its
verdict agrees with the ground truth.

Every trajectory of an episode carries, in its metrics: `judge_verdict` (the read reward, -1 when unreadable),
`judge_unparseable` (1 when unreadable), `ground_truth` (the base grader's score of the answer, computed for every
task: the run's curve of `data_traj_policy_ground_truth_mean` beside the reward shows gaming as it happens) and
`judge_agrees` (1 when the verdict, thresholded at 0.5, matches the ground truth). A train answer whose verdict
cannot be read gets no reward (None): it is dropped and counted, never guessed.

Example:
    >>> from astratk.envs.math.arithmetic import ArithmeticEnv
    >>> env = JudgedEnv(ArithmeticEnv(levels=[1]), parse="verdict")
    >>> env.roles
    ('policy', 'judge')
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import Callable, Iterable, Mapping, Sequence

from astratk.contracts import Engine, Env, SamplingParams
from astratk.envs.judge import read_verdict
from astratk.envs.multiturn import Budget, Conversation
from astratk.records import Task, Trajectory

TEMPLATE = ("Question:\n{prompt}\n\nProposed answer:\n{completion}\n\nIs the proposed answer correct? Reply with "
            "yes or no.")
JUDGE_SEED_SALT = 7919  # the judge's sampling seed: the episode's plus this (a stream apart from the policy's)


class JudgedEnv(Env):
    """A base env's tasks, answered by `policy` and judged by `judge` (module docstring).

    Args:
        base: an env with `messages` and `grade` (math, code-free QA, any single-turn env with a grader).
        template: the judge's user message; `{prompt}`, `{completion}` and `task.info` fields.
        system: a system message for the judge (None: none).
        parse, scale, verdicts: how the verdict is read (`envs.judge.read_verdict`).
        judge_max_tokens: the longest verdict; judge_temperature: its sampling (0: greedy; a frozen model's own
            `temperature` wins).
        max_context: each conversation's context budget.
    """

    name = "judged"
    roles = ("policy", "judge")

    def __init__(self, base: Env, template: str = TEMPLATE, system: str | None = None,
                 parse: str | Callable[[str], float | None] = "verdict", scale: tuple[float, float] = (0.0, 10.0),
                 verdicts: dict[str, float] | None = None, judge_max_tokens: int = 16,
                 judge_temperature: float = 0.0, max_context: int = 1024) -> None:
        for method in ("messages", "grade"):
            if not callable(getattr(base, method, None)):
                raise TypeError(f"JudgedEnv: base env {getattr(base, 'name', base)!r} lacks {method}(); the judged "
                                "workflow needs its prompt and its grader (the held-out ground truth)")
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(template) if f}
        except ValueError as e:
            raise ValueError(f"JudgedEnv: template does not parse as a format string ({e}); write literal braces "
                             "as {{ and }}") from e
        if "completion" not in fields:
            raise ValueError("JudgedEnv: template must name {completion}: the judge would not see the answer")
        if parse not in ("score", "verdict") and not callable(parse):
            raise ValueError(f"JudgedEnv: parse is 'score', 'verdict' or a function of the reply; got {parse!r}")
        if judge_max_tokens < 1 or judge_temperature < 0:
            raise ValueError("JudgedEnv: judge_max_tokens >= 1 and judge_temperature >= 0")
        self.base, self.template, self.system = base, template, system
        self.fields = fields - {"prompt", "completion"}
        self.parse, self.scale, self.verdicts = parse, (float(scale[0]), float(scale[1])), verdicts
        self.judge_max_tokens, self.judge_temperature = judge_max_tokens, judge_temperature
        self.budget = Budget(max_turns=1, max_context=max_context)

    # ------------------------------------------------------------------------------------------------ tasks
    def tasks(self, split: str) -> Iterable[Task]:
        return self.base.tasks(split)

    def messages(self, task: Task) -> list[dict[str, str]]:
        return self.base.messages(task)

    def demonstration(self, task: Task) -> str:
        return self.base.demonstration(task)

    def demonstrations(self, task: Task) -> list[tuple[list[dict[str, str]], str]]:
        return [(self.messages(task), self.demonstration(task))]  # the policy's role: the judge is not taught

    def grade(self, task: Task, text: str) -> float:
        return self.base.grade(task, text)

    def judge_messages(self, task: Task, answer: str) -> list[dict[str, str]]:
        """The judge's request about one answer."""
        missing = [f for f in self.fields if f not in task.info]
        if missing:
            raise ValueError(f"JudgedEnv: the template names {missing}, which task {task.task_id!r} of env "
                             f"{task.env!r} does not have in its info (it has {sorted(task.info)})")
        prompt = self.base.messages(task)[-1]["content"]
        text = self.template.format(prompt=prompt, completion=answer.strip(),
                                    **{f: task.info[f] for f in self.fields})
        return ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": text}]

    # ------------------------------------------------------------------------------------------------ rollout
    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        policy_engine, judge_engine = engines["policy"], engines["judge"]
        policy = Conversation.start(policy_engine.tokenizer, self.messages(task), self.budget)
        answer = (await policy.assistant_turn(policy_engine, sampling)).text
        # the ground truth, in a thread: a grader may be slow, and the episodes share this event loop
        truth = float(await asyncio.to_thread(self.base.grade, task, answer))
        judge = Conversation.start(judge_engine.tokenizer, self.judge_messages(task, answer), self.budget)
        judge_sampling = SamplingParams(temperature=self.judge_temperature, max_tokens=self.judge_max_tokens,
                                        seed=None if sampling.seed is None else sampling.seed + JUDGE_SEED_SALT)
        reply = (await judge.assistant_turn(judge_engine, judge_sampling)).text
        verdict = read_verdict(reply, self.parse, self.scale, self.verdicts)
        metrics = {"judge_verdict": -1.0 if verdict is None else float(verdict),
                   "judge_unparseable": float(verdict is None), "ground_truth": truth,
                   "judge_agrees": 0.0 if verdict is None else float((verdict >= 0.5) == (truth >= 0.5))}
        return [policy.trajectory(task, group_id=group_id, policy_id=policy_ids["policy"], role="policy",
                                  metrics=dict(metrics)),
                judge.trajectory(task, group_id=group_id, policy_id=policy_ids["judge"], role="judge",
                                 metrics=dict(metrics))]

    # ------------------------------------------------------------------------------------------------ advice
    def signal_advice(self, means: Mapping[str, float]) -> list[str]:
        """What a run or probe with little signal should change about the judge, from the policy's trajectories:
        replies it cannot read, a judge that gives one verdict to nearly every answer (no signal), or verdicts that
        disagree with the ground truth (the policy learns the judge, not the task)."""
        unread = means.get("policy/judge_unparseable")
        if unread is None:
            return []
        parse = self.parse if isinstance(self.parse, str) else "a function"
        if unread >= 0.5:
            return [(f"{unread:.0%} of the judge's replies could not be read as a verdict (parse: {parse}): a template "
                    "that asks for the verdict's words, more judge_max_tokens, or a stronger judge model "
                    "(frozen[].model.path)")]
        read = 1.0 - unread
        verdict = (means.get("policy/judge_verdict", 0.0) + unread) / read  # unreadable replies count -1 there
        agree = means.get("policy/judge_agrees", 0.0) / read
        truth = means.get("policy/ground_truth", float("nan"))
        said = f"its verdicts agree with the ground truth on {agree:.0%} of answers, {truth:.0%} of which are right"
        if verdict <= 0.05 or verdict >= 0.95:
            return [(f"the judge gives the same verdict to nearly every answer it reads (mean verdict {verdict:.3f}; "
                    f"{said}): a judge that does not tell answers apart gives no signal; a stronger judge model "
                    "(frozen[].model.path) or a clearer template (a reference answer for it to compare with)")]
        if agree < 0.6:
            return [(f"the judge is a poor guide ({said}): the policy will learn what the judge rewards, not what is "
                    "right; watch data_traj_policy_ground_truth_mean, or use a stronger judge model")]
        return []

    # ------------------------------------------------------------------------------------------------ score
    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        """Policy: the judge's verdict on a train task (None when unreadable), the ground truth on a held-out one.
        Judge: 1 when its verdict agrees with the ground truth, 0 when not, None when unreadable."""
        out: list[float | None] = []
        for t in trajectories:
            unread = t.metrics.get("judge_unparseable", 1.0) == 1.0
            if t.role == "policy":
                if task.split == "heldout":
                    out.append(float(t.metrics.get("ground_truth", self.base.grade(task, t.text))))
                else:
                    out.append(None if unread else float(t.metrics["judge_verdict"]))
            elif t.role == "judge":
                out.append(None if unread else float(t.metrics["judge_agrees"]))
            else:
                raise ValueError(f"{self.name}: unknown role {t.role!r} in trajectory {t.group_id}")
        return out
