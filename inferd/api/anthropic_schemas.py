"""The Anthropic Messages API's request and response schemas (pydantic), which are also the OpenAPI document of
POST /v1/messages and POST /v1/messages/count_tokens.

Requests forbid unknown fields, as Anthropic does ("Extra inputs are not permitted"). Content blocks are told apart
by their `type`; the kinds this text-only server cannot serve (images, documents, server tools' blocks) parse, so
that inferd/api/anthropic_messages.py can refuse them with a 400 naming them, rather than a schema error.
`cache_control` is accepted wherever Anthropic allows it and ignored: inferd caches prompt prefixes by content,
without being asked (coding agents send it on every request)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..config import MAX_STOP_STRINGS, MAX_TOOLS
from .schemas import Float, FunctionName, Identifier, StopString


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(BaseModel):
    """Accepted and ignored (see the module's docstring)."""
    type: Literal["ephemeral"]
    ttl: StrictStr | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = Field(None, description="only null or []")


class ToolUseBlock(_Strict):
    """An assistant turn's tool call, as the client sends the history back."""
    type: Literal["tool_use"]
    id: Identifier
    name: Identifier
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    """A user turn's answer to a tool call."""
    type: Literal["tool_result"]
    tool_use_id: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    content: StrictStr | list[TextBlock] | None = None
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    """An earlier turn's thinking: accepted and left out of the prompt (as Anthropic does with earlier turns')."""
    type: Literal["thinking", "redacted_thinking"]
    thinking: StrictStr | None = None
    signature: StrictStr | None = None
    data: StrictStr | None = None


class UnsupportedBlock(BaseModel):
    """A block kind this server does not serve: parsed only to be refused by name."""
    type: Literal["image", "document", "search_result", "server_tool_use", "web_search_tool_result",
                  "container_upload", "mcp_tool_use", "mcp_tool_result"]
    model_config = ConfigDict(extra="allow")


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | UnsupportedBlock,
                         Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: StrictStr | Annotated[list[ContentBlock], Field(min_length=1)]


class Tool(_Strict):
    name: FunctionName
    description: StrictStr | None = None
    input_schema: dict[str, Any] = Field(description="the JSON schema of the tool's input (an object)")
    type: Literal["custom"] | None = Field(None, description="only custom tools (server tools are not served)")
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = Field(None, description="type tool: the tool the model must call")
    disable_parallel_tool_use: StrictBool | None = None


class Metadata(_Strict):
    user_id: Identifier | None = None


class ThinkingConfig(_Strict):
    """disabled: the chat template is told so (enable_thinking false, Qwen3's switch); otherwise the server's
    --reasoning-parser decides whether thinking blocks come back (budget_tokens is not enforced)."""
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: StrictInt | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(None, description="accepted, ignored")
    format: OutputFormat | None = Field(None, description="the answer as JSON following the schema")


class _MessagesFields(_Strict):
    """What a message request and a token count share."""
    model: Identifier = Field(description="the served model's id (GET /v1/models)")
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools")
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(_MessagesFields):
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Float | None = Field(None, ge=0, le=1, description="default 1; 0 = greedy")
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0, description="0 = off")
    stream: StrictBool | None = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(
        None, description="accepted, ignored: inferd's tier is the key's, or the x-inferd-tier header's")


class CountTokensRequest(_MessagesFields):
    pass


# ---- responses (documentation and schema tests) ----------------------------------------------------------------
class TextOut(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOut(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str


class MessageUsage(BaseModel):
    input_tokens: int = Field(description="prompt tokens not read from the prefix cache")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="prompt tokens read from the prefix cache")
    cache_creation_input_tokens: int = Field(description="always 0: caching costs nothing extra here")


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextOut | ToolUseOut | ThinkingOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorBody
