"""The Anthropic Messages API over the chat path: `to_chat_request` translates a Messages request into a
ChatCompletionRequest (so that serving.prepare's checks, chat template, tools and grammar apply unchanged), and
`MESSAGES` is the delivery Shape that writes its generation as Anthropic's Message object or event stream.

The mapping: `system` -> a system message first; a user turn's text blocks -> a user message, its `tool_result`
blocks -> tool messages (in block order); an assistant turn's text -> content, its `tool_use` blocks -> tool_calls
(arguments: the input as JSON); earlier `thinking` blocks are left out. `stop_sequences` -> stop, `tool_choice`
auto/any/tool/none -> auto/required/named/none, `disable_parallel_tool_use` -> parallel_tool_calls false,
`metadata.user_id` -> user, `thinking` disabled -> chat_template_kwargs enable_thinking false,
`output_config.format` -> response_format json_schema. The stop reason: length -> max_tokens, a tool call ->
tool_use, a stop string -> stop_sequence (naming it), any other stop -> end_turn."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from pydantic import ValidationError

from . import anthropic_errors
from .anthropic_schemas import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    UnsupportedBlock,
)
from .errors import APIError, invalid, validation_error
from .refusals import worker_error
from .schemas import ChatCompletionRequest

_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


# ---- the request ---------------------------------------------------------------------------------------------
def to_chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that generates what req asks for; a 400 naming what cannot be served."""
    messages: list[dict] = []
    if req.system is not None:
        messages.append({"role": "system", "content": req.system if isinstance(req.system, str)
                         else [_text_part(b) for b in req.system] or ""})
    for i, m in enumerate(req.messages):
        messages += _turn(m.role, m.content, f"messages.{i}")
    if req.messages[-1].role == "assistant":
        raise invalid("the last message is an assistant turn: continuing it (prefill) is not supported here; end "
                      "with a user turn", param=f"messages.{len(req.messages) - 1}")
    body: dict = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and choice.name is None:
            raise invalid("tool_choice of type tool needs the name of the tool", param="tool_choice.name")
        if choice.type != "tool" and choice.name is not None:
            raise invalid(f"tool_choice of type {choice.type} takes no name", param="tool_choice.name")
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                               else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None and req.thinking.type == "disabled":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, stream=bool(req.stream),
                    user=req.metadata.user_id if req.metadata is not None else None)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # what the Messages schema let through and the chat one does not: still a 400
        raise validation_error(list(e.errors())) from None


def _text_part(block: TextBlock) -> dict:
    if block.citations:
        raise invalid("citations in text blocks are not supported", param="citations")
    return {"type": "text", "text": block.text}


def _turn(role: str, content, where: str) -> list[dict]:
    """One Messages turn as chat messages: user text and tool results in block order; one assistant message."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out: list[dict] = []
    texts: list[dict] = []
    calls: list[dict] = []
    for j, block in enumerate(content):
        param = f"{where}.content.{j}"
        if isinstance(block, UnsupportedBlock):
            raise invalid(f"content blocks of type {block.type!r} are not supported by this server (text, tool_use, "
                          "tool_result and thinking are)", param=param)
        if isinstance(block, ThinkingBlock):  # an earlier turn's thinking: not part of the prompt
            if role != "assistant":
                raise invalid(f"{block.type} blocks belong to assistant turns", param=param)
            continue
        if isinstance(block, TextBlock):
            texts.append(_text_part(block))
        elif isinstance(block, ToolUseBlock):
            if role != "assistant":
                raise invalid("tool_use blocks belong to assistant turns", param=param)
            try:
                arguments = _DUMPS(block.input)
            except ValueError:  # NaN or Infinity, which Python's JSON parser lets into the body
                raise invalid("a tool_use input must be JSON (NaN and Infinity are not)", param=param) from None
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, ToolResultBlock):
            if role != "user":
                raise invalid("tool_result blocks belong to user turns", param=param)
            if texts:  # text before the result stays before it
                out.append({"role": "user", "content": texts})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, param)})
    if role == "assistant":
        message: dict = {"role": "assistant", "content": texts or ("" if not calls else None)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    if texts:
        out.append({"role": "user", "content": texts})
    return out


def _result_text(block: ToolResultBlock, param: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = "".join(_text_part(b)["text"] for b in content)
    # the chat template has no place for the flag: the model reads it in the result itself
    return f"Error: {text}" if block.is_error else text


# ---- the response --------------------------------------------------------------------------------------------
def message_id(prep) -> str:
    return "msg_" + prep.id.removeprefix("chatcmpl-")


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_of(choice) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished choice (see the module's docstring)."""
    reason = choice.finish_reason
    if reason is None:
        return None, None
    if reason == "length":
        return "max_tokens", None
    if reason == "tool_calls":
        return "tool_use", None
    if isinstance(choice.stop_reason, str):  # the stop string it matched (a stop token is an int)
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def usage_of(generation) -> dict:
    """Anthropic counts the prompt tokens read from the cache apart from input_tokens."""
    usage = generation.usage()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_input(arguments: str) -> dict:
    """A call's arguments as its input object; {} when the model's JSON was cut off (stop_reason max_tokens)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def complete(generation) -> dict:
    """Runs the generation to the end; the whole Message object."""
    async for _ in generation.events():
        pass
    prep, c = generation.prep, generation.choices[0]
    content: list[dict] = []
    thinking = "".join(c.reasoning_pieces)
    if thinking:
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    text, calls = "".join(c.pieces), []
    parser = c.harmony if c.harmony is not None else c.tools
    if parser is not None:
        parsed, calls = parser.result()  # the content without the calls' text
        text = parsed or ""
    if text:
        content.append({"type": "text", "text": text})
    for call in calls:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": _tool_input(call["function"]["arguments"])})
    stop_reason, stop_sequence = stop_of(c)
    return {"id": message_id(prep), "type": "message", "role": "assistant", "model": prep.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage_of(generation)}


def event(kind: str, payload: dict) -> bytes:
    """One server-sent event: its type on the `event:` line, the JSON payload (which names it too) on `data:`."""
    return b"event: " + kind.encode() + b"\ndata: " + _DUMPS(payload).encode() + b"\n\n"


def error_event(e: Exception) -> bytes:
    error = worker_error(e)
    return event("error", anthropic_errors.error_body(error.status, error.message))


class _Blocks:
    """The stream's content blocks, one open at a time: opening another (or the end) stops the open one."""

    def __init__(self):
        self.index = -1
        self.open: tuple | None = None  # ("thinking",) | ("text",) | ("tool_use", call index)

    def to(self, key: tuple, block: dict) -> list[bytes]:
        if self.open == key:
            return []
        out = self.stop()
        self.index += 1
        self.open = key
        return out + [event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block})]

    def delta(self, delta: dict) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


async def stream(generation, events, first) -> AsyncIterator[bytes]:
    """message_start, a ping, each content block (thinking, text, tool_use) as start / deltas / stop, then
    message_delta (stop reason, usage) and message_stop. A failure after the start is an error event."""
    prep, write_overhead = generation.prep, generation.serving.metrics.write_overhead
    blocks = _Blocks()
    try:
        usage = {**usage_of(generation), "output_tokens": 0}
        yield event("message_start", {"type": "message_start", "message": {
            "id": message_id(prep), "type": "message", "role": "assistant", "model": prep.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}})
        yield event("ping", {"type": "ping"})
        item = first
        while item is not None:
            choice, delta, _, out, finished, calls, reasoning = item
            chunks: list[bytes] = []
            if reasoning:
                chunks += blocks.to(("thinking",), {"type": "thinking", "thinking": "", "signature": ""})
                chunks.append(blocks.delta({"type": "thinking_delta", "thinking": reasoning}))
            if delta:
                chunks += blocks.to(("text",), {"type": "text", "text": ""})
                chunks.append(blocks.delta({"type": "text_delta", "text": delta}))
            for call, fragment, _first in calls:
                chunks += blocks.to(("tool_use", call.index), {"type": "tool_use", "id": tool_use_id(call.id),
                                                              "name": call.name, "input": {}})
                if fragment:
                    chunks.append(blocks.delta({"type": "input_json_delta", "partial_json": fragment}))
            for chunk in chunks:
                yield chunk
            if chunks:
                write_overhead.observe(time.perf_counter() - out.received_at)
            if finished:
                for chunk in blocks.stop():
                    yield chunk
                stop_reason, stop_sequence = stop_of(choice)
                yield event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                              "usage": usage_of(generation)})
                yield event("message_stop", {"type": "message_stop"})
            item = await anext(events, None)
    except Exception as e:  # the stream has started: the error goes in band
        generation.error = e
        yield error_event(e)
    finally:
        generation.close()  # synchronous: this may run in a cancelled scope (the client went away)


def error_response(e: APIError):
    return anthropic_errors.error_response(e.status, e.message, e.headers)
