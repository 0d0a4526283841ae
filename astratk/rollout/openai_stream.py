"""Streaming answers of the OpenAI endpoint (`stream: true`): a finished chat completion written as Server-Sent Events
the way OpenAI streams one, so agent frameworks that stream by default run unchanged.

The engines generate whole samples (a batch at a time), so the endpoint samples the completion first, records it
exactly as a non-streaming call (the same token-space capture), and then streams it: per choice a first chunk with
the role, content deltas (one per token, each with that token's log-probs when asked; a token that completes no
character yet is sent with the next), tool-call deltas (id, type and name first, then the arguments), a last chunk
with `finish_reason`, and with `stream_options: {"include_usage": true}` a final chunk holding `usage` (`usage: null`
on the others), then `data: [DONE]`. A client that joins the deltas gets exactly the message the non-streaming
answer holds, so a session recognises it when the agent sends it back. While the sample is being generated the
stream carries SSE comments (`: keep-alive`), so a client's read timeout sees bytes; an error after the stream has
begun is sent as `data: {"error": ...}` before `[DONE]`, as OpenAI does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from astratk.contracts import Completion

# a completion longer than this streams every PREFIX_STRIDE tokens: text offsets come from decoding prefixes
LONG = 512
PREFIX_STRIDE = 16


def sse(data: Any) -> bytes:
    """One Server-Sent Event: `data: <json>` (or the literal `[DONE]`) and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def chunks(body: dict[str, Any], completions: tuple[Completion, ...], tok: Any, include_usage: bool,
           logprobs: bool) -> Iterator[dict[str, Any]]:
    """`body` (the non-streaming answer, `choices` built from `completions`) as `chat.completion.chunk` objects."""
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"],
            "system_fingerprint": body.get("system_fingerprint")}
    if include_usage:
        head["usage"] = None

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lp: list | None = None) -> dict:
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None if lp is None else
                                     {"content": lp}, "finish_reason": finish}]}

    for answer, c in zip(body["choices"], completions, strict=True):
        i, message = answer["index"], answer["message"]
        entries = (answer.get("logprobs") or {}).get("content") if logprobs else None
        yield chunk(i, {"role": "assistant", "content": ""})
        calls = message.get("tool_calls")
        if calls:  # the text around the calls in one delta, then each call
            first = True
            if message.get("content"):
                yield chunk(i, {"content": message["content"]}, lp=entries)
                first = False
            for j, call in enumerate(calls):
                fn = call["function"]
                yield chunk(i, {"tool_calls": [{"index": j, "id": call["id"], "type": "function",
                                                "function": {"name": fn["name"], "arguments": ""}}]},
                            lp=entries if first else None)
                first = False
                yield chunk(i, {"tool_calls": [{"index": j, "function": {"arguments": fn["arguments"]}}]})
        else:
            for piece, span in token_pieces(tok, c.token_ids, message.get("content") or ""):
                lp = entries[span[0]:span[1]] if entries is not None else None
                if piece or lp:
                    yield chunk(i, {"content": piece}, lp=lp)
        yield chunk(i, {}, finish=answer["finish_reason"])
    if include_usage:
        yield {**head, "choices": [], "usage": body["usage"]}


def token_pieces(tok: Any, ids: tuple[int, ...] | list[int], text: str) -> Iterator[tuple[str, tuple[int, int]]]:
    """`text` (the decoding of `ids`) cut where each token's text ends: (piece, (first token, end token)) pairs
    whose pieces join to exactly `text`. A token whose text is not yet a prefix of `text` (half of a multi-byte
    character, a space the tokenizer cleans up later) rides with the next piece; what is left goes last, "" when
    only tokens without text are left (their log-probs still have a chunk to ride in)."""
    ids = list(ids)
    stride = 1 if len(ids) <= LONG else PREFIX_STRIDE
    sent, first = 0, 0
    for end in range(stride, len(ids) + stride, stride):
        end = min(end, len(ids))
        prefix = tok.decode(ids[:end], skip_special_tokens=True)
        if len(prefix) > sent and text.startswith(prefix):
            yield text[sent:len(prefix)], (first, end)
            sent, first = len(prefix), end
    if sent < len(text) or first < len(ids):  # the rest; "" for tokens that add no text (an end-of-turn token)
        yield text[sent:], (first, len(ids))
