"""A multi-turn tool task for `AgentEnv`, small enough for a tiny character-level model: look a price up, answer it.

Each row is a question ("price of K7?") and a small price list of its own (random per row, so a model cannot learn
the prices, only how to use the tool). The agent, written with the `openai` client and nothing from astratk, offers
the model one function, `lookup(item)`; a good episode is two calls: the model calls `lookup` with the item from the
question, the agent runs it and sends the result back as a `tool` message, and the model answers with the number.
The reward is 1 for the right price and 0 otherwise.

`rows(n, seed)` makes the dataset, `agent` and `reward` are what `AgentEnv` takes, and `demonstrations(row)` is a
good episode turn by turn, for the supervised warm start of a tiny model (`AgentEnv(demonstrations=...)`).

Example:
    >>> r = rows(1, seed=0)[0]
    >>> r["prompt"], r["answer"] == str(r["prices"][r["item"]])
    ('price of B5?', True)
    >>> lookup(r["prices"], r["item"]) == f"{r['item']}: {r['answer']}"
    True
"""

from __future__ import annotations

import json
import random
import string
from typing import Any

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "The price of an item.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}]
ITEMS_PER_ROW = 4


def price_list(rng: random.Random) -> dict[str, int]:
    """`ITEMS_PER_ROW` distinct item codes like "K7" with prices 10-99, drawn from `rng`."""
    codes: list[str] = []
    while len(codes) < ITEMS_PER_ROW:
        code = rng.choice(string.ascii_uppercase) + str(rng.randint(1, 9))
        if code not in codes:
            codes.append(code)
    return {c: rng.randint(10, 99) for c in codes}


def rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` questions, each with its own price list of `ITEMS_PER_ROW` items (codes like "K7", prices 10-99: fixed
    widths, so that a character-level model of a few layers learns to copy them)."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        prices = price_list(rng)
        codes = list(prices)
        item = rng.choice(codes)
        key = (item, json.dumps(prices, sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        out.append({"prompt": f"price of {item}?", "item": item, "prices": prices, "answer": str(prices[item])})
    return out


def lookup(prices: dict[str, int], item: Any) -> str:
    """The tool: "K7: 42", or why there is no answer."""
    if not isinstance(item, str) or item not in prices:
        return f"no item {item}"
    return f"{item}: {prices[item]}"


def agent(task: dict[str, Any], base_url: str, api_key: str, model: str, max_calls: int = 3) -> str | None:
    """A plain `openai`-client tool loop: ask, run each tool call, send the results back, until the model answers."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
    for _ in range(max_calls):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            try:
                item = json.loads(call.function.arguments).get("item")
            except (json.JSONDecodeError, AttributeError):
                item = None
            messages.append({"role": "tool", "tool_call_id": call.id, "content": lookup(task["prices"], item)})
    return None


def reward(task: dict[str, Any], output: Any) -> float:
    return 1.0 if isinstance(output, str) and output.strip() == task["answer"] else 0.0


def demonstrations(task: dict[str, Any]) -> list[tuple[list[dict[str, Any]], Any, list[dict[str, Any]]]]:
    """A good episode as (messages so far, the assistant's next message, tools), one per assistant turn: a message
    dict (a tool call) or the text of the answer."""
    ask = [{"role": "user", "content": task["prompt"]}]
    arguments = {"item": task["item"]}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": arguments}}]}
    result = {"role": "tool", "tool_call_id": "call_0", "content": lookup(task["prices"], task["item"])}
    # the call as a message: the model's chat template writes its text (no template text written by hand here)
    return [(ask, call, TOOLS), ([*ask, call, result], task["answer"], TOOLS)]
