"""The OpenAI-compatible request and response schemas (pydantic), which are also the OpenAPI document.

Requests forbid unknown fields (OpenAI answers them with 400 too). OpenAI parameters that inferd does not implement
yet are declared, so that the schema is honest about them, and refused by `unsupported_parameters()` whenever they
are set to anything but their neutral value: never silently ignored. vLLM's extensions (`top_k`, `ignore_eos`,
`min_tokens`, `repetition_penalty`, `stop_token_ids`, `return_tokens_as_token_ids`) are accepted.

Responses are built as plain dicts on the hot path (see responses.py); the models below describe them for the
OpenAPI document, and the schema tests check that every response conforms.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from ..config import (
    MAX_IDENTIFIER_CHARS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS_PER_REQUEST,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
)

INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1

# OpenAI's types: an integer field refuses 3.0 ("expected an integer, but got a decimal number") and "3"; a number
# field takes 3 and 3.5, never "3", true, NaN or infinity
Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0, le=(1 << 31) - 1)]
StopString = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
# names and identifiers the client chooses (model, user, a message's name, ...): bounded, they are logged and kept
Identifier = Annotated[StrictStr, Field(max_length=MAX_IDENTIFIER_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format; json_schema: {"name", "schema", "strict", "description"} (checked in serving)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one constraint."""
    json_: dict[str, Any] | bool | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = Field(None, description="EBNF; refused where the server (--no-grammar) or the key's "
                                      "tenant (allow_grammar: false) turned this kind off")
    json_object: StrictBool | None = None
    structural_tag: StrictStr | dict[str, Any] | None = None
    disable_any_whitespace: StrictBool | None = Field(None, description="JSON (a schema, json_object, or "
                                                      "response_format's): no whitespace of the model's choosing")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _SamplingFields(_Strict):
    """What /v1/completions and /v1/chat/completions share."""
    model: Identifier | None = Field(None, description="the served model's id (GET /v1/models); omitted: the default")
    max_tokens: StrictInt | None = Field(None, ge=1, description="omitted: the rest of the context window")
    temperature: Float | None = Field(None, ge=0, le=2, description="default 1; 0 = greedy")
    top_p: Float | None = Field(None, gt=0, le=1)
    n: StrictInt | None = Field(None, ge=1, le=MAX_N)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    user: Identifier | None = None
    logit_bias: Annotated[dict[StrictStr, Annotated[Float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = Field(
        None, description="token id (as a string) -> bias added to its logit, in [-100, 100]")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM extension: one of json, regex, choice, grammar, json_object, structural_tag")
    # vLLM's older names for the same constraints
    guided_json: dict[str, Any] | StrictStr | None = Field(None, description="vLLM extension (older name)")
    guided_regex: StrictStr | None = Field(None, description="vLLM extension (older name)")
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = Field(
        None, description="vLLM extension (older name)")
    guided_grammar: StrictStr | None = Field(None, description="vLLM extension (older name)")
    # vLLM extensions
    top_k: StrictInt | None = Field(None, ge=-1, description="vLLM extension; 0 or -1 = off")
    ignore_eos: StrictBool | None = Field(False, description="vLLM extension")
    min_tokens: StrictInt | None = Field(0, ge=0, description="vLLM extension")
    repetition_penalty: Float | None = Field(None, gt=0, le=10, description="vLLM extension")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="vLLM extension")
    return_tokens_as_token_ids: StrictBool | None = Field(
        False, description="vLLM extension: logprobs name tokens 'token_id:N'")
    prompt_logprobs: StrictInt | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="vLLM extension: every prompt token's logprob and the top-N")

    def _unsupported_common(self) -> list[str]:
        return []


class CompletionRequest(_SamplingFields):
    prompt: (StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)])
    max_tokens: StrictInt | None = Field(None, ge=0, description="omitted: the rest of the context window; 0 (with "
                                         "echo): the prompt alone, e.g. for its logprobs")
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool | None = Field(None, description="the prompt before the completion, in its text and logprobs")
    best_of: StrictInt | None = Field(None, ge=1, description="not supported yet: only equal to n")
    suffix: StrictStr | None = Field(None, description="not supported yet: only null or ''")

    def unsupported_parameters(self) -> list[str]:
        names = self._unsupported_common()
        if self.best_of is not None and self.best_of != (self.n or 1):
            names.append("best_of")
        if self.suffix:
            names.append("suffix")
        return names


class TextContentPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class FunctionCallIn(_Strict):
    name: Identifier
    arguments: StrictStr


class ToolCallIn(_Strict):
    """An assistant message's earlier tool call, as the client sends the history back."""
    id: Identifier
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | Annotated[list[TextContentPart], Field(min_length=1)] | None = None
    name: Identifier | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Identifier | None = None

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        # OpenAI: only an assistant message (one that carries tool calls) may have null content
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or a list of content parts), not null")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message may carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


FunctionName = Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]


class FunctionDef(_Strict):
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="preferred over max_tokens")
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")
    add_generation_prompt: StrictBool | None = Field(True, description="vLLM extension")
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: variables for the chat template, e.g. {\"enable_thinking\": false}")
    # OpenAI parameters not supported yet: only their neutral values are accepted
    functions: list[dict[str, Any]] | None = Field(None, description="not supported: only null or []")
    function_call: Identifier | dict[str, Any] | None = Field(None, description="not supported: 'none' or null")
    audio: dict[str, Any] | None = Field(None, description="not supported: only null")
    modalities: list[Identifier] | None = Field(None, description="only ['text']")
    prediction: dict[str, Any] | None = Field(None, description="not supported: only null")
    store: StrictBool | None = Field(None, description="not supported: only false")
    metadata: dict[str, StrictStr] | None = Field(None, description="not supported: only null or {}")
    service_tier: Identifier | None = Field(None, description="only 'auto' or 'default'")
    reasoning_effort: Identifier | None = Field(None, description="gpt-oss: low, medium or high; else only null")
    verbosity: Identifier | None = Field(None, description="not supported: only null")
    web_search_options: dict[str, Any] | None = Field(None, description="not supported: only null")
    moderation: dict[str, Any] | None = Field(None, description="not supported: only null")
    prompt_cache_key: Identifier | None = Field(None, description="accepted: inferd caches prefixes by content")
    prompt_cache_retention: Identifier | None = Field(None, description="not supported: only null")
    prompt_cache_options: dict[str, Any] | None = Field(None, description="not supported: only null")
    safety_identifier: Identifier | None = None

    def unsupported_parameters(self) -> list[str]:
        names = self._unsupported_common()
        checks = {
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none"),
            "audio": self.audio is not None,
            "modalities": self.modalities not in (None, ["text"]),
            "prediction": self.prediction is not None,
            "store": bool(self.store),
            "metadata": bool(self.metadata),
            "service_tier": self.service_tier not in (None, "auto", "default"),
            "reasoning_effort": self.reasoning_effort is not None,
            "verbosity": self.verbosity is not None,
            "web_search_options": self.web_search_options is not None,
            "moderation": self.moderation is not None,
            "prompt_cache_retention": self.prompt_cache_retention is not None,
            "prompt_cache_options": self.prompt_cache_options is not None,
        }
        return names + [name for name, unsupported in checks.items() if unsupported]


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: either a raw prompt or chat messages (through the chat template)."""
    model: Identifier | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool | None = Field(True, description="for a raw prompt: add BOS if the model has one")
    add_generation_prompt: StrictBool | None = True


class DetokenizeRequest(_Strict):
    model: Identifier | None = None
    tokens: list[TokenId]


# ---- responses (documentation and schema tests) ----------------------------------------------------------------
class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = Field(None, description="with --reasoning-parser: the model's thinking")


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None
    versions: dict[str, int] | None = None  # model version -> workers serving it (two during a rollout)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    root: str | None = None  # a LoRA adapter's path


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: str
    reason: str | None = None
