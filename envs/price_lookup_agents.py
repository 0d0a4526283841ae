"""The price-lookup agent (`astratk.envs.price_lookup`) as agent frameworks write it, for `AgentEnv` to train as is.

Each function takes what `AgentEnv` passes (`task`, `base_url`, `api_key`, `model`) and returns the agent's answer;
each offers the model the tool `lookup(item)` and lets its framework run the tool loop. Nothing in them knows about
astratk: point a framework's OpenAI-compatible model at `base_url` and it talks to the run's policy.

- `openai_agents`: the OpenAI Agents SDK (`pip install openai-agents`). The SDK's default model speaks the Responses
  API, which the endpoint does not serve (it answers a one-line 404 saying so): give the Agent an
  `OpenAIChatCompletionsModel`, as here. Tracing is switched off (it would send traces to OpenAI's servers).
- `langgraph`: LangChain's `create_agent` (a LangGraph graph: model node, tool node, loop) over `langchain-openai`'s
  `ChatOpenAI`, streaming (`stream: true`, with `stream_options.include_usage`), as LangChain users often configure it
  (`pip install langchain langchain-openai`).

An agent whose model never gives an answer within its turn limit returns None (reward 0), as `price_lookup.agent` does.
"""

from __future__ import annotations

from typing import Any

from astratk.envs.price_lookup import lookup as lookup_price

MAX_TURNS = 3  # model calls per episode: a lookup, the answer, one spare


def openai_agents(task: dict[str, Any], base_url: str, api_key: str, model: str) -> str | None:
    """The OpenAI Agents SDK: an `Agent` with one function tool, run by `Runner.run_sync`."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def lookup(item: str) -> str:
        """The price of an item."""
        return lookup_price(task["prices"], item)

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    agent = Agent(name="shopper", tools=[lookup], model=OpenAIChatCompletionsModel(model=model, openai_client=client))
    try:
        return Runner.run_sync(agent, task["prompt"], max_turns=MAX_TURNS).final_output
    except MaxTurnsExceeded:
        return None


def langgraph(task: dict[str, Any], base_url: str, api_key: str, model: str) -> str | None:
    """LangChain's agent (`create_agent`: a LangGraph graph, the successor of LangGraph's `create_react_agent`) over
    a streaming `ChatOpenAI`."""
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError

    @tool
    def lookup(item: str) -> str:
        """The price of an item."""
        return lookup_price(task["prices"], item)

    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_retries=0, timeout=60, streaming=True,
                     stream_usage=True)
    graph = create_agent(llm, [lookup])
    try:  # each model call and each tool run is one step of the graph
        out = graph.invoke({"messages": [("user", task["prompt"])]}, {"recursion_limit": 2 * MAX_TURNS})
    except GraphRecursionError:
        return None
    return out["messages"][-1].content
