"""The request schema of OpenAI's Responses API (`POST /v1/responses`), pydantic, as much of it as inferd serves.

As for chat (inferd/api/schemas.py): unknown fields are a 400; OpenAI parameters inferd does not implement are
declared and refused by `unsupported_parameters()` unless neutral. inferd keeps no server-side state: `store` is
accepted (the response says `"store": false`), `previous_response_id` and `conversation` are refused with the reason
(send the earlier turns in `input`). The translation into a chat request is inferd/api/responses_api.py's."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag

from ..config import MAX_METADATA_ENTRIES, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS, MAX_TOOLS
from .schemas import Float, FunctionName, Identifier


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400, as for chat


class InputText(_Strict):
    """A text part of an input message (`input_text`), or of an earlier answer sent back (`output_text`, with the
    annotations and logprobs the response carried)."""
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Strict):
    """A message: the client's, or an earlier answer sent back (an output `message` item: id, status)."""
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | Annotated[list[InputText], Field(min_length=1)]
    id: Identifier | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    """A function call the model made in an earlier turn, sent back with its output."""
    type: Literal["function_call"]
    call_id: Identifier
    name: FunctionName
    arguments: StrictStr
    id: Identifier | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutput(_Strict):
    """The result of a function call (`call_id` names it)."""
    type: Literal["function_call_output"]
    call_id: Identifier
    output: StrictStr | Annotated[list[InputText], Field(min_length=1)]
    id: Identifier | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Strict):
    """An earlier answer's reasoning sent back: accepted and left out of the prompt (chat templates drop earlier
    turns' thinking too)."""
    type: Literal["reasoning"]
    id: Identifier | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


_KINDS = ("message", "function_call", "function_call_output", "reasoning")


def _item_kind(item: Any) -> str | None:
    """An input item's tag: its type (a message may leave it out). Tags carry a dash so that an error's `param`
    leaves them out (inferd/api/errors.py): "input.0.content", not "input.0.message.content"."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None) or "message"
    return f"item-{kind}" if kind in _KINDS else None


InputItem = Annotated[Annotated[InputMessage, Tag("item-message")]
                      | Annotated[FunctionCallItem, Tag("item-function_call")]
                      | Annotated[FunctionCallOutput, Tag("item-function_call_output")]
                      | Annotated[ReasoningItem, Tag("item-reasoning")],
                      Discriminator(_item_kind, custom_error_type="invalid_item",
                                    custom_error_message="an input item's type must be message, function_call, "
                                                         "function_call_output or reasoning (inferd takes text "
                                                         "only: no images, files or built-in tools)")]


class FunctionTool(_Strict):
    """A function tool, flat as the Responses API has it (chat nests it under `function`)."""
    type: Literal["function"]
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Strict):
    """`text.format`: text, json_object, or json_schema ({name, schema, strict, description} at this level)."""
    type: Literal["text", "json_object", "json_schema"]
    name: Identifier | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Identifier | None = Field(None, description="not supported: only null or medium")


class ReasoningConfig(_Strict):
    effort: Identifier | None = Field(None, description="gpt-oss (harmony): low, medium or high; else only null")
    summary: Identifier | None = Field(None, description="accepted; the reasoning item carries the whole text")
    generate_summary: Identifier | None = None


Metadata = Annotated[dict[Annotated[StrictStr, Field(max_length=MAX_METADATA_KEY_CHARS)],
                          Annotated[StrictStr, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
                     Field(max_length=MAX_METADATA_ENTRIES)]


class ResponsesRequest(_Strict):
    model: Identifier | None = Field(None, description="the served model's id; omitted: the default")
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: StrictStr | None = Field(None, description="a system message before the input")
    max_output_tokens: StrictInt | None = Field(None, ge=1, description="omitted: the rest of the context window")
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="function tools only; another type is a 400 naming it")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    stream: StrictBool | None = False
    store: StrictBool | None = Field(None, description="accepted; nothing is stored (the response says false)")
    metadata: Metadata | None = Field(None, description="echoed in the response")
    user: Identifier | None = None
    safety_identifier: Identifier | None = None
    prompt_cache_key: Identifier | None = Field(None, description="accepted: inferd caches prefixes by content")
    reasoning: ReasoningConfig | None = None
    service_tier: Identifier | None = Field(None, description="only auto or default")
    truncation: Literal["auto", "disabled"] | None = Field(None, description="only disabled")
    # OpenAI parameters not supported: refused unless neutral
    previous_response_id: Identifier | None = Field(
        None, description="refused: inferd keeps no responses; send the earlier turns in `input`")
    conversation: StrictStr | dict[str, Any] | None = Field(None, description="refused: inferd keeps no state")
    background: StrictBool | None = Field(None, description="only false")
    include: list[Identifier] | None = Field(None, description="only empty")
    max_tool_calls: StrictInt | None = Field(None, description="not supported: only null")
    top_logprobs: StrictInt | None = Field(None, description="not supported: only null or 0")
    prompt: dict[str, Any] | None = Field(None, description="not supported (stored prompts): only null")
    prompt_cache_retention: Identifier | None = Field(None, description="not supported: only null")
    stream_options: dict[str, Any] | None = Field(None, description="accepted with stream: true; ignored")

    def unsupported_parameters(self) -> list[str]:
        checks = {
            "background": bool(self.background),
            "include": bool(self.include),
            "max_tool_calls": self.max_tool_calls is not None,
            "top_logprobs": bool(self.top_logprobs),
            "prompt": self.prompt is not None,
            "prompt_cache_retention": self.prompt_cache_retention is not None,
            "service_tier": self.service_tier not in (None, "auto", "default"),
            "truncation": self.truncation == "auto",
            "text.verbosity": self.text is not None and self.text.verbosity not in (None, "medium"),
        }
        return [name for name, unsupported in checks.items() if unsupported]
