"""OpenAI's Responses API over the chat path: `to_chat_request` turns a Responses request (instructions, input items,
flat function tools, text.format) into a ChatCompletionRequest, so that serving, admission, tiers, failover and
cancellation are the chat completions' own; `response_shape` is the delivery Shape that writes the generation as a
Response object (`complete`) or as the Responses event stream (inferd/api/responses_stream.py).

Stateless: nothing is stored, so `previous_response_id` and `conversation` are a 400 saying so, `store` is accepted
and answered `"store": false`, and there is no GET /v1/responses/{id}."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from pydantic import ValidationError

from .errors import invalid, validation_error
from .refusals import worker_error
from .responses import complete as chat_complete
from .responses_schema import (
    FunctionCallItem,
    FunctionCallOutput,
    FunctionTool,
    InputMessage,
    NamedFunctionChoice,
    ResponsesRequest,
)
from .schemas import ChatCompletionRequest

# chat's parameter names in a refusal (serving.prepare speaks chat) as the Responses request names them
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def responses_param(param: str | None) -> str | None:
    """A chat parameter's name (a refusal's `param`) as the Responses request calls it."""
    if param is None:
        return None
    head = param.split("[", 1)[0].split(".", 1)[0]
    return _PARAMS[head] if head in _PARAMS else param


# ---- the request --------------------------------------------------------------------------------------------------
def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that a Responses request means; a 400 for what inferd does not serve."""
    if req.previous_response_id is not None:
        raise invalid("previous_response_id is not supported: inferd stores no responses (every response says "
                      "\"store\": false); send the earlier turns, the output items included, in `input`",
                      param="previous_response_id", code="unsupported_parameter")
    if req.conversation is not None:
        raise invalid("conversation is not supported: inferd keeps no conversations; send the earlier turns in "
                      "`input`", param="conversation", code="unsupported_parameter")
    unsupported = req.unsupported_parameters()
    if unsupported:
        raise invalid(f"unsupported parameter{'s' if len(unsupported) > 1 else ''}: {', '.join(unsupported)} "
                      "(only the neutral value is accepted)", param=unsupported[0], code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
    body = {"model": req.model, "messages": _messages(req), "stream": bool(req.stream),
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "user": req.user, "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
            "parallel_tool_calls": req.parallel_tool_calls,
            "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None}
    tools = _tools(req)
    if tools:
        body["tools"] = tools
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.name is None:
            raise invalid("text.format json_schema needs a name (and a schema)", param="text.format.name")
        schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {k: v for k, v in schema.items() if v is not None}}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:  # (the schema above checks what chat's does: a safety net, still a 400)
        error = validation_error(list(e.errors()))
        error.param = responses_param(error.param)
        raise error from None


def _messages(req: ResponsesRequest) -> list[dict]:
    """The chat messages: the instructions as a system message first, then the input items in order; function calls
    of one turn join the assistant message before them, reasoning items are left out."""
    messages: list[dict] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    joins_calls = False  # the last message is an assistant's that this turn's calls belong to
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
            joins_calls = item.role == "assistant"
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if joins_calls:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                joins_calls = True
        elif isinstance(item, FunctionCallOutput):
            messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
            joins_calls = False
    if not messages:
        raise invalid("input holds no message (reasoning items alone are not a prompt)", param="input")
    return messages


def _tools(req: ResponsesRequest) -> list[dict]:
    """Flat function tools as chat's {"type": "function", "function": {...}}; another type is a 400 naming it."""
    out = []
    for i, tool in enumerate(req.tools or []):
        kind = tool.get("type")
        if kind != "function":
            shown = kind[:64] if isinstance(kind, str) else type(kind).__name__
            raise invalid(f"tools[{i}] is a `{shown}` tool: inferd serves function tools only (no built-in tools "
                          "such as web_search, file_search or code_interpreter)", param=f"tools[{i}].type",
                          code="unsupported_tool_type")
        try:
            function = FunctionTool.model_validate(tool)
        except ValidationError as e:
            raise validation_error([{**err, "loc": ("tools", i, *err.get("loc", ()))} for err in e.errors()]) from None
        out.append({"type": "function", "function": function.model_dump(exclude_none=True, exclude={"type"})})
    return out


def _tool_choice(choice) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        shown = choice.get("type")
        raise invalid(f"tool_choice of type `{str(shown)[:64]}` is not supported: give none, auto, required or "
                      "{\"type\": \"function\", \"name\": ...}", param="tool_choice", code="unsupported_tool_type")
    try:
        named = NamedFunctionChoice.model_validate(choice)
    except ValidationError as e:
        raise validation_error([{**err, "loc": ("tool_choice", *err.get("loc", ()))} for err in e.errors()]) from None
    return {"type": "function", "function": {"name": named.name}}


# ---- the response -------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


@dataclass
class ResponseHead:
    """What every Response object of one request repeats: its id, creation time, model and the request's settings
    as OpenAI echoes them."""
    id: str
    created_at: int
    model: str
    echo: dict = field(default_factory=dict)

    def body(self, status: str, output: list[dict], usage: dict | None = None, incomplete: str | None = None,
             error: dict | None = None) -> dict:
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "model": self.model,
                "output": output, **self.echo, "usage": usage}
        if status == "completed":
            body["completed_at"] = int(time.time())
        return body


def response_head(req: ResponsesRequest, prep) -> ResponseHead:
    tools = [FunctionTool.model_validate(t).model_dump() for t in req.tools or []]
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, dict):
        choice = {"type": "function", "name": choice["name"]}
    fmt = req.text.format if req.text is not None else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}}
    effort = req.reasoning.effort if req.reasoning is not None else None
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": effort, "summary": None},
            "service_tier": "default", "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature, "text": text,
            "tool_choice": choice, "tools": tools, "top_logprobs": 0,
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "user": req.user}
    return ResponseHead("resp_" + prep.id.rsplit("-", 1)[-1], prep.created, prep.model, echo)


def usage(u: dict) -> dict:
    """Chat's usage as the Responses API counts it (reasoning tokens are not counted apart: 0)."""
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict, status: str) -> list[dict]:
    """A chat answer's message as Response output items: its reasoning, its text (also an empty one when there is
    nothing else; whitespace beside function calls is dropped), then its function calls. Only the last item can be
    the one cut off (status incomplete), as in the stream."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs_"), message["reasoning_content"], "completed"))
    calls = message.get("tool_calls") or []
    content = message.get("content") or ""
    if content.strip() or not calls:
        items.append(message_item(new_id("msg_"), content, "completed"))
    for call in calls:
        items.append(call_item(new_id("fc_"), call["id"], call["function"]["name"], call["function"]["arguments"],
                               "completed"))
    items[-1]["status"] = status
    return items


async def complete(head: ResponseHead, generation) -> dict:
    """The whole Response object: the chat answer (inferd/api/responses.py), its items in the Responses shape."""
    chat = await chat_complete(generation)
    choice = chat["choices"][0]
    incomplete = choice["finish_reason"] == "length"
    status = "incomplete" if incomplete else "completed"
    return head.body(status, output_items(choice["message"], status), usage(chat["usage"]),
                     "max_output_tokens" if incomplete else None)


def failed_error(e: Exception) -> dict:
    """A failure as a Response object's `error`: its code one of OpenAI's (which a client's types accept), inferd's
    own code (what a client can act on: queue_timeout, worker_lost, ...) in the message."""
    err = worker_error(e)
    code = "rate_limit_exceeded" if err.status == 429 else "invalid_prompt" if err.status < 500 else "server_error"
    return {"code": code, "message": f"{err.message} (code: {err.code})" if err.code else err.message}
