"""A two-tool agent task for `AgentEnv` on a real chat model: the total price of two items.

Each row asks for the total of two items of its own small price list (random per row, so no model can know the
prices: without its tools a model scores 0). The agent, written with the `openai` client and nothing from astratk,
gives the model a system prompt and two functions: `lookup(item)`, which returns an item's price, and `add(a, b)`, a
calculator (small models add two-digit numbers badly: SmolLM2-135M-Instruct gets 12 of 64 two-digit sums right). A
good episode is three model turns: both lookups (two calls in one reply), then `add` on the two prices, then the
total. The reward is 1 for the right total (the reply's last number) and 0 otherwise.

`rows(n, seed)` makes the dataset, `agent` and `reward` are what `AgentEnv` takes, and `demonstrations(row)` is a
good episode turn by turn (for `model.warm_start`, or a tiny model's warm start).

Example:
    >>> r = rows(1, seed=0)[0]
    >>> r["prompt"], r["answer"] == str(sum(r["prices"][i] for i in r["items"]))
    ('What is the total price of B5 and M5?', True)
    >>> run_tool(r, "add", {"a": 12, "b": 30})
    '42'
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from astratk.envs.price_lookup import price_list

SYSTEM = "You are a shop assistant. Use the tools to find prices and to add numbers. Reply with the total only."
TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "The price of an item.",
        "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "The sum of two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}},
]
MAX_CALLS = 5  # model turns an episode may take


def rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` distinct questions, each about two items of its own price list (`price_lookup.price_list`)."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        prices = price_list(rng)
        items = rng.sample(list(prices), 2)
        key = (tuple(items), json.dumps(prices, sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        out.append({"prompt": f"What is the total price of {items[0]} and {items[1]}?", "items": items,
                    "prices": prices, "answer": str(prices[items[0]] + prices[items[1]])})
    return out


def _number(x: Any) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def run_tool(task: dict[str, Any], name: str, arguments: Any) -> str:
    """One tool call's result as text (what the agent sends back), or what was wrong with the call."""
    if not isinstance(arguments, dict):
        return "error: arguments must be a JSON object"
    if name == "lookup":
        item = arguments.get("item")
        return str(task["prices"][item]) if isinstance(item, str) and item in task["prices"] else f"no item {item}"
    if name == "add":
        a, b = _number(arguments.get("a")), _number(arguments.get("b"))
        if a is None or b is None:
            return "error: add needs two numbers a and b"
        total = a + b
        return str(int(total)) if total == int(total) else str(total)
    return f"error: no tool {name}"


def agent(task: dict[str, Any], base_url: str, api_key: str, model: str) -> str | None:
    """A plain `openai`-client tool loop: ask, run each tool call, send the results back, until the model answers."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_CALLS):
        message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = None
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(task, call.function.name, arguments)})
    return None


def reward(task: dict[str, Any], output: Any) -> float:
    """1 when the reply's last number is the total."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", output) if isinstance(output, str) else []
    return 1.0 if numbers and _number(numbers[-1]) == float(task["answer"]) else 0.0


def _call(i: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


def demonstrations(task: dict[str, Any]) -> list[tuple[list[dict[str, Any]], Any, list[dict[str, Any]]]]:
    """A good episode as (messages so far, the assistant's next message, tools), one per assistant turn."""
    a, b = task["items"]
    pa, pb = task["prices"][a], task["prices"][b]
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    looks = {"role": "assistant", "content": "", "tool_calls": [_call(0, "lookup", {"item": a}),
                                                                  _call(1, "lookup", {"item": b})]}
    out = [(list(history), looks, TOOLS)]
    history += [looks, {"role": "tool", "tool_call_id": "call_0", "content": str(pa)},
                {"role": "tool", "tool_call_id": "call_1", "content": str(pb)}]
    adds = {"role": "assistant", "content": "", "tool_calls": [_call(2, "add", {"a": pa, "b": pb})]}
    out.append((list(history), adds, TOOLS))
    history += [adds, {"role": "tool", "tool_call_id": "call_2", "content": task["answer"]}]
    out.append((list(history), task["answer"], TOOLS))
    return out
