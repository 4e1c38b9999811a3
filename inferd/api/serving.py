"""OpenAI semantics of a generation request, without HTTP: a validated completion or chat request becomes engine
work (`Prepared`: token ids and sampling parameters, one per prompt and choice), checked against the model (context
window, vocabulary, structured outputs, tools) before it is admitted, so that a bad request is a 400 that costs no
place in the queue. Running it is inferd/api/generation.py's; the response shapes are inferd/api/responses.py's.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from dataclasses import dataclass, field

from ..config import MAX_CHOICES_PER_REQUEST, TOKENIZE_INLINE_MAX_CHARS
from ..engine.request import SamplingParams
from ..engine.structured import compact as compact_kind
from ..gateway.router import Router
from ..models.tokenizer import Tokenizer
from ..telemetry.metrics import Metrics
from . import harmony
from .errors import INVALID_REQUEST, APIError, invalid
from .reasoning import constraint_after_reasoning, content_format, reasoning_enabled
from .refusals import not_ready
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from .template_kwargs import check_template_kwargs
from .tokenizing import off_the_loop
from .tools import (
    FORMATS,
    ToolFormat,
    default_parser,
    marker_tokens,
    render_messages,
    template_knows_tools,
    tool_constraint,
)


# ---- a prepared request ------------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """A validated request as engine work: choice i runs prompts[prompt_of[i]] with params[i]."""
    chat: bool
    id: str
    model: str
    prompts: list[list[int]]
    prompt_of: list[int]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    logprobs: bool
    tokens_as_ids: bool
    received_at: float  # time.perf_counter() at receipt
    created: int = field(default_factory=lambda: int(time.time()))
    tool_format: ToolFormat | None = None  # set when the output is parsed for tool calls
    tool_names: frozenset[str] = frozenset()  # the functions it may call (a call of another name is text)
    reasoning: str | None = None  # the reasoning parser splitting its output (api/reasoning.py), if any
    keep_special: frozenset[int] = frozenset()  # special tokens its text keeps (markers its parsers read)
    harmony: bool = False  # its output is read as gpt-oss's harmony channels (api/harmony.py)
    adapter: str | None = None  # the LoRA adapter it runs with (its `model`), None: the base model
    echo: bool = False  # completions: the prompt comes first in each choice's text (and logprobs)
    echo_only: bool = False  # max_tokens 0 with echo: the prompt alone (the one token the engine samples is dropped)
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` field asked for, with its top-n

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens as usage counts them: each prompt once, whatever n is."""
        return sum(len(p) for p in self.prompts)

    @property
    def reserved_tokens(self) -> int:
        """What the request may cost at most: its prompts and every choice's max_tokens (reserved at admission)."""
        return self.prompt_tokens + sum(p.max_tokens for p in self.params)


class OpenAIServing:
    """Turns validated completion and chat requests into `Prepared` engine work (see the module's docstring)."""

    def __init__(self, router: Router, tokenizer: Tokenizer, model_name: str, metrics: Metrics,
                 tool_call_parser: str | None = None, allow_grammar: bool = True,
                 reasoning_parser: str | None = None, disable_any_whitespace: bool = False):
        self.router = router
        self.compact_json = disable_any_whitespace  # JSON constraints compile compact (--disable-any-whitespace)
        # the free-form `grammar` kind of structured outputs (EBNF: the one whose cost a client controls most), server
        # wide (--no-grammar); a tenant may also be refused it (its keys-file entry's allow_grammar)
        self.allow_grammar = allow_grammar
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.native_tools = template_knows_tools(template)  # else: the fallback tool prompt (api/tools.py)
        self.tool_format = FORMATS[tool_call_parser or default_parser(template if self.native_tools else None)]
        self.reasoning_parser = reasoning_parser
        self.harmony = self._use_harmony(tool_call_parser, reasoning_parser, template)
        if self.harmony:
            self.tool_format, self.reasoning_parser = FORMATS["hermes"], None  # (harmony's parser does both)
        self.model_name = model_name
        self.metrics = metrics
        self._token_text: dict[int, str] = {}
        # the longest token's text: a prompt of more characters than max_model_len x this cannot fit the context
        # whatever it tokenizes to, so it is refused before it costs any tokenizing
        vocab = tokenizer.hf.get_vocab() if hasattr(tokenizer, "hf") else {}
        self.max_token_chars = max((len(t) for t in vocab), default=0) or 64

    def _use_harmony(self, tool_call_parser: str | None, reasoning_parser: str | None, template: str | None) -> bool:
        """Whether the harmony format is in effect: asked for, or (neither parser asked for) the template writes it.
        Loads its vocabulary (offline: api/harmony.py), and what tells the model's tokens apart."""
        asked = "harmony" in (tool_call_parser, reasoning_parser)
        if asked and {tool_call_parser, reasoning_parser} - {"harmony", None}:
            raise ValueError("--tool-call-parser harmony and --reasoning-parser harmony go together (harmony's "
                             "channels carry both): give no other parser beside it")
        if not asked and (tool_call_parser or reasoning_parser or not harmony.is_harmony_template(template)):
            return False
        try:
            harmony.prepare(self.tokenizer)
            harmony.encoding()
        except harmony.HarmonyUnavailable as e:
            if asked:
                raise ValueError(str(e)) from None
            logging.getLogger(__name__).warning("not using the harmony format for this harmony template: %s", e)
            return False
        self.harmony_same_vocab = harmony.same_vocabulary(self.tokenizer)
        self.harmony_markers = frozenset(self.tokenizer.special_token_ids(harmony.MARKERS).values())
        return True

    async def prepare(self, req: CompletionRequest | ChatCompletionRequest, received_at: float,
                      allow_grammar: bool = True, tenant=None) -> Prepared:
        """prepare_completion or prepare_chat; a long prompt is first bounded by its size, then tokenized off the
        event loop (an 8 MiB prompt must not stall every stream), in a small pool of threads. allow_grammar: False
        when the request's tenant may not use the `grammar` kind of structured outputs."""
        chat = isinstance(req, ChatCompletionRequest)
        adapter = self.adapter_for(req.model, tenant)  # a 404 for another tenant's adapter, as for an unknown model
        self.check_grammar_allowed(req, allow_grammar)  # before any tokenizing or parsing
        prepare = self.prepare_chat if chat else self.prepare_completion
        chars = _prompt_chars(req)
        if chars <= TOKENIZE_INLINE_MAX_CHARS:
            return self._with_adapter(prepare(req, received_at), adapter)
        hello = self.router.hello
        if hello is not None and chars > hello.max_model_len * self.max_token_chars:
            what = "messages" if chat else "prompt"
            raise invalid(f"This model's maximum context length is {hello.max_model_len} tokens; the {what} has "
                          f"{chars} characters, more than that many tokens can hold.", param=what,
                          code="context_length_exceeded")
        return self._with_adapter(await off_the_loop(prepare, req, received_at), adapter)

    # ---- LoRA adapters (api/lora_catalog.py) -----------------------------------------------------------------------
    lora = None  # the server's LoraCatalog where --enable-lora

    def adapter_for(self, requested: str | None, tenant):
        """The served adapter a request's `model` names (None: the base model, or a name check_model judges). An
        adapter its tenant may not use does not exist for it: the same 404 as an unknown model."""
        if self.lora is None or requested is None:
            return None
        adapter = self.lora.get(requested)
        if adapter is None:
            return None
        if tenant is not None and not tenant.may_use_adapter(requested):
            raise self._unknown_model(requested)
        return adapter

    @staticmethod
    def _with_adapter(prep: Prepared, adapter) -> Prepared:
        if adapter is not None:
            prep.model = prep.adapter = adapter.name
            for params in prep.params:
                params.lora = adapter.params_value
        return prep

    # ---- preparation ----------------------------------------------------------------------------------------
    embedding_models: frozenset[str] = frozenset()  # the embedding models served beside (a 400 here, not a 404)

    def check_grammar_allowed(self, req: CompletionRequest | ChatCompletionRequest, tenant_allows: bool) -> None:
        """A request for the free-form `grammar` kind where it is off: a 400 `grammar_disabled` (the server's
        --no-grammar) or a 403 `grammar_not_allowed` (the tenant's allow_grammar: false), before it costs anything."""
        if self.allow_grammar and tenant_allows:
            return
        so = req.structured_outputs
        param = ("structured_outputs" if so is not None and so.grammar is not None
                 else "guided_grammar" if req.guided_grammar is not None else None)
        if param is None:
            return
        if not self.allow_grammar:
            raise invalid("this server does not accept the `grammar` kind of structured outputs (it was started with "
                          "--no-grammar): use a JSON schema, a regex or a choice", param=param, code="grammar_disabled")
        raise APIError(403, "this API key's tenant may not use the `grammar` kind of structured outputs (its "
                       "allow_grammar is false): use a JSON schema, a regex or a choice", "permission_error",
                       param=param, code="grammar_not_allowed")

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested in self.embedding_models:
            raise invalid(f"`{requested}` is an embedding model: use /v1/embeddings (this endpoint serves "
                          f"`{self.model_name}`)", param="model", code="wrong_model_kind")
        if requested is not None and requested != self.model_name and (self.lora is None or requested not in self.lora):
            raise self._unknown_model(requested)

    def _unknown_model(self, requested: str) -> APIError:
        return APIError(404, f"The model `{requested}` does not exist (this server serves `{self.model_name}`)",
                        INVALID_REQUEST, param="model", code="model_not_found")

    def prepare_completion(self, req: CompletionRequest, received_at: float) -> Prepared:
        self._check_common(req)
        spec = self._constraint(req)
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        elif isinstance(prompt[0], str):
            prompts = [self.tokenizer.encode(p) for p in prompt]
        else:
            prompts = [list(p) for p in prompt]
        self._check_vocab(prompts)
        echo_only = bool(req.echo) and req.max_tokens == 0
        if req.max_tokens == 0 and not echo_only:
            raise invalid("max_tokens 0 returns nothing without echo: true", param="max_tokens", code="invalid_value")
        # echo_only: the engine samples one token (the prompt's last position runs anyway), which is dropped
        prep = self._prepare(False, "cmpl-", req, prompts, 1 if echo_only else req.max_tokens, req.logprobs,
                             received_at, spec)
        prep.echo, prep.echo_only = bool(req.echo), echo_only
        # echo with logprobs: the prompt's tokens lead each choice's logprobs, so the engine computes them
        return self._ask_prompt_logprobs(prep, req.prompt_logprobs, req.logprobs if req.echo else None)

    def prepare_chat(self, req: ChatCompletionRequest, received_at: float) -> Prepared:
        effort = req.reasoning_effort
        if self.harmony and effort is not None:
            if effort not in harmony.EFFORTS:
                raise invalid(f"reasoning_effort must be one of {', '.join(harmony.EFFORTS)}", param="reasoning_effort")
            req = req.model_copy(update={"reasoning_effort": None})  # (supported here: not refused as unsupported)
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
        spec = self._constraint(req)
        template_kwargs = check_template_kwargs(req.chat_template_kwargs,
                                                getattr(self.tokenizer, "contains_special_text", None))
        reasoning = self.reasoning_parser if reasoning_enabled(template_kwargs) else None
        if self.harmony and spec is not None:  # the analysis channel stays free, the final one is constrained
            spec = ("structural_tag", harmony.final_constraint(content_format(*spec)))
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise invalid("tool_choice needs tools", param="tool_choice")
        tool_format = None
        if choice != "none":
            if not isinstance(choice, str):  # a named function
                if choice.function.name not in [t["function"]["name"] for t in tools]:
                    raise invalid(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                                  "tools", param="tool_choice")
                choice = choice.model_dump()
            if spec is not None:
                raise invalid("tools (with tool_choice other than none) and a response format constrain the same "
                              "output: give one of them", param="response_format")
            try:
                if self.harmony:
                    text = harmony.tool_constraint(tools, choice, req.parallel_tool_calls is not False)
                else:
                    text = tool_constraint(self.tool_format, tools, choice, req.parallel_tool_calls is not False)
            except Exception as e:
                raise invalid(f"the tools cannot be compiled into a constraint: {e}", param="tools") from None
            spec = ("structural_tag", text)
            self._check_spec(spec, "tools")
            tool_format = self.tool_format
        if spec is not None and reasoning is not None:  # the thinking stays free; the answer is constrained
            spec = constraint_after_reasoning(*spec, reasoning)
            self._check_spec(spec, "tools" if tool_format is not None else "response_format")
        prompt = self.chat_prompt(req.messages, bool(req.add_generation_prompt), tools, template_kwargs, effort)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prep = self._prepare(True, "chatcmpl-", req, [prompt], max_tokens, logprobs, received_at, spec)
        self._ask_prompt_logprobs(prep, req.prompt_logprobs, None)
        prep.tool_format = tool_format
        prep.tool_names = frozenset(t["function"]["name"] for t in tools)
        prep.reasoning = reasoning
        if self.harmony:
            prep.harmony, prep.tool_format, prep.keep_special = True, None, self.harmony_markers
            if tool_format is None:  # tool_choice none: a call written all the same is content
                prep.tool_names = frozenset()
        elif tool_format is not None:
            prep.keep_special = marker_tokens(tool_format, self.tokenizer)
        return prep

    def _constraint(self, req) -> tuple[str, str] | None:
        """The (kind, text) grammar that response_format, structured_outputs or vLLM's guided_* ask for (at most
        one of them), parsed here so that a bad one is a 400 before the request is admitted."""
        found: list[tuple[str, tuple[str, str]]] = []
        # JSON without whitespace of the model's choosing (engine/structured.py); not the default for `strict`
        # schemas either: it measured no better (docs/benchmarks.md, issue 31)
        compact = self.compact_json
        rf = req.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", ("json_object", "")))
        elif rf is not None and rf.type == "json_schema":
            js = rf.json_schema
            if not isinstance(js, dict) or not isinstance(js.get("name"), str):
                raise invalid("response_format json_schema needs an object with a name (and a schema)",
                              param="response_format")
            schema = js.get("schema")
            if schema is None:
                found.append(("response_format", ("json_object", "")))
            elif not isinstance(schema, dict):
                raise invalid("response_format json_schema.schema must be an object", param="response_format")
            else:
                found.append(("response_format", ("json", json.dumps(schema))))
        so = req.structured_outputs
        if so is not None:
            given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                         ("grammar", so.grammar), ("structural_tag", so.structural_tag))
                     if v is not None]
            if so.json_object:
                given.append(("json_object", ""))
            if so.disable_any_whitespace is not None:  # the request's own choice wins
                compact = so.disable_any_whitespace
        if so is not None and (given or so.disable_any_whitespace is None):  # alone, it shapes response_format's
            if len(given) != 1:
                raise invalid("structured_outputs needs exactly one of json, regex, choice, grammar, json_object, "
                              "structural_tag", param="structured_outputs")
            found.append(("structured_outputs", _spec(*given[0])))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(req, name)
            if value is not None:
                found.append((name, _spec(kind, value)))
        if not found:
            return None
        if len(found) > 1:
            raise invalid(f"{found[0][0]} and {found[1][0]} both constrain the output: give one of them",
                          param=found[1][0])
        param, spec = found[0]
        if compact:
            spec = (compact_kind(spec[0]), spec[1])
        self._check_spec(spec, param)
        return spec

    @staticmethod
    def _check_spec(spec: tuple[str, str], param: str) -> None:
        from ..engine.errors import InvalidRequestError
        from ..engine.structured import check_spec

        try:
            check_spec(spec[0], spec[1], param)
        except InvalidRequestError as e:
            raise invalid(str(e), param=param, code="invalid_structured_output") from None

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    reasoning_effort: str | None = None) -> list[int]:
        rendered = []
        check = getattr(self.tokenizer, "contains_special_text", None)
        for i, m in enumerate(messages):
            # a template prints these outside the message contents, where a special token's text becomes the token
            for key, value in (("name", m.name), ("tool_call_id", m.tool_call_id)):
                if value is not None and check is not None and check(value):
                    raise invalid(f"messages[{i}].{key} must not contain the text of the model's special tokens",
                                  param=f"messages[{i}].{key}")
            # the template knows system, user and assistant; OpenAI's developer role is the system role renamed
            message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            rendered.append(message)
        if self.harmony:  # harmony renders the conversation, not the chat template
            return harmony.render_prompt(self.tokenizer, rendered, tools, reasoning_effort, self.harmony_same_vocab)
        if tools or any(m.role == "tool" or m.tool_calls for m in messages):
            if self.native_tools:  # the template prints tools and calls outside the contents: no special tokens there
                outside = json.dumps([tools, [m.get("tool_calls") for m in rendered]], ensure_ascii=False)
                if check is not None and check(outside):
                    raise invalid("tools and tool calls must not contain the text of the model's special tokens",
                                  param="tools")
            rendered, kwargs = render_messages(rendered, tools, self.native_tools)
        else:
            kwargs = {}
        if template_kwargs:
            kwargs = {**template_kwargs, **kwargs}
        try:
            return self.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # a template that raises on this conversation (e.g. role order): the client's input
            raise invalid(f"the chat template cannot render these messages: {e}", param="messages") from None

    def _check_common(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self.check_model(req.model)
        unsupported = req.unsupported_parameters()
        if unsupported:
            names = ", ".join(unsupported)
            raise invalid(f"unsupported parameter{'s' if len(unsupported) > 1 else ''}: {names} "
                          "(only the neutral value is accepted for now)", param=unsupported[0],
                          code="unsupported_parameter")
        if req.stream_options is not None and not req.stream:
            raise invalid("stream_options is only allowed when stream is true", param="stream_options")

    def _check_vocab(self, prompts: list[list[int]]) -> None:
        vocab = self.router.hello.vocab_size if self.router.hello else self.tokenizer.vocab_size
        for p in prompts:
            if not p:
                raise invalid("the prompt is empty", param="prompt")
            bad = next((t for t in p if t >= vocab), None)
            if bad is not None:
                raise invalid(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")

    def _prepare(self, chat: bool, prefix: str, req, prompts: list[list[int]], max_tokens: int | None,
                 logprobs: int | None, received_at: float, spec: tuple[str, str] | None = None) -> Prepared:
        """The prompts (tokenized) checked against the model and turned into a Prepared. A refusal here comes after
        the tokenizing: counted, so that work spent on requests that were never served shows."""
        try:
            return self._prepare_tokenized(chat, prefix, req, prompts, max_tokens, logprobs, received_at, spec)
        except APIError as e:
            if 400 <= e.status < 500 and self.metrics is not None:
                self.metrics.refused_after_tokenizing.labels("chat" if chat else "completions").inc()
            raise

    def _prepare_tokenized(self, chat: bool, prefix: str, req, prompts: list[list[int]], max_tokens: int | None,
                           logprobs: int | None, received_at: float, spec: tuple[str, str] | None) -> Prepared:
        hello = self.router.hello
        if hello is None:
            raise not_ready(f"no worker is available: {self.router.not_ready_reason}")
        bias = _logit_bias(req.logit_bias, hello.vocab_size)
        bad = next((t for t in req.stop_token_ids or () if t >= hello.vocab_size), None)
        if bad is not None:
            raise invalid(f"stop token id {bad} is outside the vocabulary [0, {hello.vocab_size})",
                          param="stop_token_ids")
        context = hello.max_model_len
        what = "messages" if chat else "prompt"
        n = req.n or 1
        if len(prompts) * n > MAX_CHOICES_PER_REQUEST:
            raise invalid(f"{len(prompts)} prompts x n={n} is over the limit of {MAX_CHOICES_PER_REQUEST} "
                          "choices per request", param="n")
        param_list, prompt_of = [], []
        seed = req.seed if req.seed is not None else random.getrandbits(63)  # every request is replayable
        for p_index, prompt in enumerate(prompts):
            if len(prompt) >= context:
                raise invalid(f"This model's maximum context length is {context} tokens; the {what} has "
                              f"{len(prompt)} tokens, which leaves no room for a completion.", param=what,
                              code="context_length_exceeded")
            budget = max_tokens if max_tokens is not None else context - len(prompt)
            if len(prompt) + budget > context:
                raise invalid(f"This model's maximum context length is {context} tokens. However, you requested "
                              f"{len(prompt) + budget} tokens ({len(prompt)} in the {what}, {budget} in the "
                              "completion). Please reduce the length of the prompt or completion.",
                              param="max_tokens", code="context_length_exceeded")
            min_tokens = req.min_tokens or 0
            if min_tokens > budget:
                raise invalid(f"min_tokens ({min_tokens}) is over max_tokens ({budget})", param="min_tokens")
            for _ in range(n):
                params = self._sampling_params(req, budget, logprobs, seed + len(param_list))
                params.structured, params.logit_bias = spec, bias
                param_list.append(params)
                prompt_of.append(p_index)
        return Prepared(chat, prefix + uuid.uuid4().hex, self.model_name, prompts, prompt_of, param_list,
                        bool(req.stream), bool(req.stream_options and req.stream_options.include_usage),
                        logprobs is not None, bool(req.return_tokens_as_token_ids), received_at)

    @staticmethod
    def _ask_prompt_logprobs(prep: Prepared, asked: int | None, echoed: int | None) -> Prepared:
        """The engine computes prompt logprobs (inferd/engine/prompt_logprobs.py) with the larger top-n of what the
        response shows: vLLM's `prompt_logprobs` field (asked) and echo's leading entries (echoed). Every choice
        computes its own (with n > 1 too): a choice's first event carries them, whatever order the choices run in."""
        top = max((v for v in (asked, echoed) if v is not None), default=None)
        prep.prompt_logprobs = asked
        for params in prep.params:
            params.prompt_logprobs = top
        return prep

    @staticmethod
    def _sampling_params(req, max_tokens: int, logprobs: int | None, seed: int) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=seed, stop=stop,
            stop_token_ids=list(req.stop_token_ids or []), ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_tokens=req.min_tokens or 0)

    # ---- token text --------------------------------------------------------------------------------------------
    def token_text(self, token_id: int, as_id: bool) -> str:
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

def _prompt_chars(req) -> int:
    """Characters of text to tokenize (token-id prompts: none)."""
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.text()) for m in req.messages)
    prompt = req.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


def _spec(kind: str, value) -> tuple[str, str]:
    """A constraint as (kind, text): schemas and choice lists as JSON text."""
    if kind in ("json", "choice", "structural_tag") and not isinstance(value, str):
        return kind, json.dumps(value)
    return kind, value


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> list:
    """OpenAI's logit_bias (token id strings -> bias) as [id, bias] pairs, every id in the vocabulary."""
    out = []
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise invalid(f"logit_bias key {key!r} is not a token id in the vocabulary [0, {vocab_size})",
                          param="logit_bias")
        out.append([token, float(value)])
    return out

