"""`Judge`: an LLM judge as a reward function, asked over an OpenAI-compatible chat endpoint.

A judge reads a prompt, a completion and whatever dataset columns its template names, and answers in words; the
reward is read from its reply. It is a TRL-style reward function, so `FunctionEnv` takes it in `reward_funcs` beside
functions and reward models, with the same weights; any server that speaks OpenAI's chat API can be the judge
(vLLM's `vllm serve`, astratk's own `OpenAIEndpoint`, a hosted API). The judge's reply is never trained on: it is
scoring, not part of any trajectory.

- The request: the judge's `system` message (optional) and one user message, `template` filled in with `{prompt}`
  (a chat prompt's last user message), `{completion}` (the reply's text) and any column of the row (`{answer}`);
  greedy by default (`temperature` 0), at most `max_tokens` tokens.
- The verdict: `parse="score"` reads the last number of the reply on `scale` (default 0-10) and maps it to 0-1;
  `parse="verdict"` reads the first of `verdicts`' words (default yes = 1, no = 0) as a whole word, case ignored; or a
  function `parse(reply) -> float | None`. A reply it cannot read gives None: the completion gets no reward from the
  judge (FunctionEnv's convention: the other functions' values still count, and a completion no function scores is
  dropped and counted).
- The cost and the failures, per completion, in the run's metrics: `judge/<name>/unparseable` (1 when the reply could
  not be read), `judge/<name>/errors` (1 when the request failed: refused, an HTTP error, no answer within
  `timeout_s`), `judge/<name>/ms` (the request's time). A failed request is retried `retries` times, then counted.
- The completions of a group are asked `concurrency` at a time, so a batching server (vLLM, astratk's endpoint)
  serves them together.

Example:
    >>> judge = Judge("http://127.0.0.1:8000/v1", "Qwen/Qwen2.5-7B-Instruct",  # doctest: +SKIP
    ...               template="Question: {prompt}\\nReference: {answer}\\nAnswer: {completion}\\n"
    ...                        "Is the answer correct? Reply yes or no.", parse="verdict")
    >>> env = FunctionEnv("qa.jsonl", [judge, exact], reward_weights=[1.0, 0.5])  # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import string
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

DEFAULT_TEMPLATE = ("Question:\n{prompt}\n\nAnswer:\n{completion}\n\nRate how correct and helpful the answer is, from "
                    "0 (wrong) to 10 (fully correct). Reply with the number only.")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
log = logging.getLogger(__name__)


def _text(value: Any) -> str:
    """A prompt's or completion's text: a string as it is, chat messages as the last user (prompt) or last
    (completion) message's content."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        users = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        last = (users or value)[-1]
        return str(last.get("content") or "") if isinstance(last, dict) else str(last)
    return "" if value is None else str(value)


def read_verdict(reply: str | None, parse: str | Callable[[str], float | None] = "score",
                 scale: tuple[float, float] = (0.0, 10.0), verdicts: dict[str, float] | None = None) -> float | None:
    """The reward a judge's reply gives (module docstring: "score", "verdict" or a function), or None when it cannot
    be read. `verdicts`' words are matched whole, case ignored; the first one in the reply counts.

    >>> read_verdict("Score: 7"), read_verdict("Yes, it is right.", "verdict"), read_verdict("maybe", "verdict")
    (0.7, 1.0, None)
    """
    if reply is None:
        return None
    if callable(parse):
        value = parse(reply)
        return None if value is None else float(value)
    if parse == "verdict":
        words = {k.lower(): float(v) for k, v in (verdicts or {"yes": 1.0, "no": 0.0}).items()}
        found = [(m.start(), word) for word in words
                 if (m := re.search(rf"\b{re.escape(word)}\b", reply, flags=re.IGNORECASE))]
        return words[min(found)[1]] if found else None
    numbers = _NUMBER.findall(reply)
    if not numbers:
        return None
    low, high = scale
    x = float(numbers[-1])
    return (x - low) / (high - low) if low <= x <= high else None


class Judge:
    """An LLM judge over an OpenAI-compatible endpoint, as a TRL-style reward function (module docstring).

    Args:
        base_url: the endpoint's base URL, up to `/v1` (requests go to `<base_url>/chat/completions`).
        model: the model name the endpoint serves.
        template: the user message, with `{prompt}`, `{completion}` and dataset columns as fields.
        system: a system message before it (None: none).
        parse: "score", "verdict", or a function from the reply's text to a float or None.
        scale: (low, high) of "score": a number outside it is unreadable.
        verdicts: word -> reward for "verdict".
        api_key: sent as `Authorization: Bearer <key>` (default: $OPENAI_API_KEY, if set).
        temperature, max_tokens: the judge's sampling.
        timeout_s: the longest one request may take; retries: further tries of a failed request.
        concurrency: requests in flight at once.
        name: the metric name (`reward/<name>`, `judge/<name>/...`).
    """

    def __init__(self, base_url: str, model: str, *, template: str = DEFAULT_TEMPLATE, system: str | None = None,
                 parse: str | Callable[[str], float | None] = "score", scale: tuple[float, float] = (0.0, 10.0),
                 verdicts: dict[str, float] | None = None, api_key: str | None = None, temperature: float = 0.0,
                 max_tokens: int = 64, timeout_s: float = 60.0, retries: int = 1, concurrency: int = 8,
                 name: str = "judge") -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"Judge: base_url is an http(s) URL up to /v1 (http://127.0.0.1:8000/v1); got {base_url!r}")
        if parse not in ("score", "verdict") and not callable(parse):
            raise ValueError(f"Judge: parse is 'score', 'verdict' or a function of the reply; got {parse!r}")
        low, high = (float(x) for x in scale)
        if not low < high:
            raise ValueError(f"Judge: scale is (low, high) with low < high; got {scale!r}")
        try:
            self.fields = sorted({f for _, f, _, _ in string.Formatter().parse(template) if f})
        except ValueError as e:
            raise ValueError(f"Judge: the template does not parse as a format string ({e}); write literal braces "
                             "as {{ and }}") from e
        if not ({"prompt", "completion"} & set(self.fields)):
            raise ValueError("Judge: the template names neither {prompt} nor {completion}: the judge would not see "
                             "what it judges")
        if timeout_s <= 0 or retries < 0 or concurrency < 1 or max_tokens < 1:
            raise ValueError("Judge: timeout_s > 0, retries >= 0, concurrency >= 1 and max_tokens >= 1")
        self.base_url, self.model, self.template, self.system = base_url.rstrip("/"), model, template, system
        self.parse, self.scale = parse, (low, high)
        self.verdicts = {k.lower(): float(v) for k, v in (verdicts or {"yes": 1.0, "no": 0.0}).items()}
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.temperature, self.max_tokens = temperature, max_tokens
        self.timeout_s, self.retries, self.concurrency = timeout_s, retries, concurrency
        self.__name__ = name
        self.failures = 0  # failed requests in this process (logged at the 1st, 10th, 100th...)

    def __repr__(self) -> str:
        return f"Judge({self.base_url!r}, {self.model!r})"

    # ------------------------------------------------------------------------------------------------ the verdict
    def read(self, reply: str | None) -> float | None:
        """The reward a reply gives, or None when it cannot be read."""
        return read_verdict(reply, self.parse, self.scale, self.verdicts)

    def messages(self, prompt: Any, completion: Any, columns: dict[str, Any]) -> list[dict[str, str]]:
        """The judge's request for one completion."""
        values = {**columns, "prompt": _text(prompt), "completion": _text(completion)}
        missing = [f for f in self.fields if f not in values]
        if missing:
            raise ValueError(f"Judge {self.__name__!r}: its template names {missing}, which is neither a dataset "
                             f"column ({sorted(columns)}) nor prompt/completion")
        user = self.template.format(**values)
        return ([{"role": "system", "content": self.system}] if self.system else []) + [{"role": "user",
                                                                                          "content": user}]

    # ------------------------------------------------------------------------------------------------ the calls
    def ask(self, messages: list[dict[str, str]]) -> str:
        """The judge's reply; raises `RuntimeError` naming the endpoint when every try failed."""
        body = json.dumps({"model": self.model, "messages": messages, "temperature": self.temperature,
                           "max_tokens": self.max_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        problem = ""
        for _ in range(self.retries + 1):
            request = urllib.request.Request(f"{self.base_url}/chat/completions", data=body, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
                    reply = json.loads(r.read())
                return str(reply["choices"][0]["message"].get("content") or "")
            except urllib.error.HTTPError as e:
                problem = f"HTTP {e.code}: {e.read()[:200].decode(errors='replace')}"
            except (urllib.error.URLError, TimeoutError, OSError) as e:
                problem = f"no answer within {self.timeout_s:g}s or refused ({e})"
            except (ValueError, KeyError, IndexError, TypeError) as e:
                problem = f"a reply that is not an OpenAI chat completion ({type(e).__name__}: {e})"
        raise RuntimeError(f"judge {self.__name__!r} at {self.base_url} (model {self.model!r}): {problem}")

    def scored(self, prompts: list[Any], completions: list[Any], **columns: Any
               ) -> tuple[list[float | None], list[dict[str, float]]]:
        """Each completion's reward (None: unreadable or failed), and per completion its counts: what
        `FunctionEnv` calls to put both in the run's metrics."""
        columns = {k: v for k, v in columns.items() if k not in ("completion_ids", "trainer_state")
                   and isinstance(v, list) and len(v) == len(completions)}
        requests = [self.messages(p, c, {k: v[i] for k, v in columns.items()})
                    for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]

        def one(messages: list[dict[str, str]]) -> tuple[str | None, float, bool]:
            start = time.perf_counter()
            try:
                return self.ask(messages), time.perf_counter() - start, False
            except RuntimeError as e:
                self.failures += 1
                if self.failures == 10 ** len(str(self.failures - 1)) or self.failures == 1:  # 1, 10, 100...
                    log.warning("%s (%d failed requests so far; each completion gets no reward from the judge, "
                                "counted in judge/%s/errors)", e, self.failures, self.__name__)
                return None, time.perf_counter() - start, True

        with concurrent.futures.ThreadPoolExecutor(min(self.concurrency, max(1, len(requests)))) as pool:
            replies = list(pool.map(one, requests))
        name, values, metrics = self.__name__, [], []
        for reply, seconds, failed in replies:
            value = self.read(reply)
            values.append(value)
            metrics.append({f"judge/{name}/unparseable": float(value is None and not failed),
                            f"judge/{name}/errors": float(failed), f"judge/{name}/ms": 1e3 * seconds})
        return values, metrics

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        return self.scored(prompts, completions, **columns)[0]
