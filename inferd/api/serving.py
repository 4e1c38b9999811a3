"""OpenAI semantics, without HTTP: a validated request becomes engine requests (one per prompt and choice), their
per-step outputs become OpenAI response dicts or SSE chunks.

The API process owns text: workers send token ids; here each choice is detokenized incrementally and checked for
stop strings with the same logic as the engine (`TextWithStops`), so that a stop string never reaches the client,
also when it spans two tokens. The worker stops on the same token by itself; should the two ever disagree, the
choice ends here and the worker is told to abort.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


from ..config import MAX_CHOICES_PER_REQUEST, MAX_REPLAYS_PER_REQUEST, TOKENIZE_INLINE_MAX_CHARS
from ..engine.request import SamplingParams
from ..gateway.admission import Overloaded, QueueShareExceeded, QueueTimeout
from ..gateway.limits import LimiterUnavailable
from ..gateway.router import NoWorkerAvailable, Router
from ..models.tokenizer import IncrementalDetokenizer, TextWithStops, Tokenizer
from ..telemetry.metrics import Metrics
from ..worker.client import RequestFailed, RequestRejected, WorkerDead, WorkerUnavailable
from ..worker.protocol import WorkerOutput
from .errors import INVALID_REQUEST, APIError, internal_error, invalid
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from .tokenizing import off_the_loop
from .tools import FORMATS, ToolCallParser, ToolFormat, default_parser, render_messages, template_knows_tools
from .tools import tool_constraint

_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def sse(payload: dict) -> bytes:
    return b"data: " + _DUMPS(payload).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def not_ready(reason: str, retry_after: int = 1) -> APIError:
    return APIError(503, reason, code="not_ready", headers={"Retry-After": str(retry_after)})


def worker_error(exc: Exception) -> APIError:
    """A failure of the worker side as the client sees it."""
    if isinstance(exc, RequestRejected):
        return invalid(str(exc), code="invalid_value")
    if isinstance(exc, NoWorkerAvailable):
        return not_ready(str(exc), exc.retry_after)
    if isinstance(exc, Overloaded):
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, LimiterUnavailable):
        return APIError(503, f"{exc}; retry shortly", code="limiter_unavailable",
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, QueueShareExceeded):
        return APIError(429, str(exc), "rate_limit_exceeded", code="queue_share_exceeded",
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, QueueTimeout):
        return APIError(503, str(exc), code="queue_timeout", headers={"Retry-After": "1"})
    if isinstance(exc, WorkerDead):
        return APIError(503, f"the worker serving this request was lost and no other could take it over: {exc}",
                        code="worker_lost", headers={"Retry-After": "1"})
    if isinstance(exc, WorkerUnavailable):  # its worker shut down and no other could take the request over
        return APIError(503, f"the request was stopped by a shutdown: {exc}", code="shutdown",
                        headers={"Retry-After": "1"})
    if isinstance(exc, RequestFailed) and exc.code is not None:  # the request's own fault: its grammar too slow
        return invalid(str(exc), code=exc.code)
    if isinstance(exc, RequestFailed):
        return internal_error("the engine failed this request", exc, code="engine_error")
    return internal_error("internal error", exc)


def is_server_error(exc: Exception | None) -> bool:
    """A failure on the server's side that a version answers for (the rollout's error rate): the engine failed the
    request, its worker died with it, or an unexpected error. Not the client's invalid request, not the gateway's
    refusals (quota, overload, line deadline), not a drain moving it elsewhere."""
    if exc is None:
        return False
    if isinstance(exc, (RequestRejected, Overloaded, QueueShareExceeded, QueueTimeout, NoWorkerAvailable,
                        LimiterUnavailable, APIError)):
        return False
    if isinstance(exc, RequestFailed) and exc.code is not None:  # the request's own grammar ran out of time
        return False
    return isinstance(exc, (RequestFailed, WorkerDead)) or not isinstance(exc, WorkerUnavailable)


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

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens as usage counts them: each prompt once, whatever n is."""
        return sum(len(p) for p in self.prompts)

    @property
    def reserved_tokens(self) -> int:
        """What the request may cost at most: its prompts and every choice's max_tokens (reserved at admission)."""
        return self.prompt_tokens + sum(p.max_tokens for p in self.params)


@dataclass
class ChoiceState:
    index: int
    text: TextWithStops
    pieces: list[str] = field(default_factory=list)  # emitted text, for non-streaming responses
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    logprobs: list = field(default_factory=list)  # per token: (token id, logprob, [(id, logprob)...])
    token_ids: list[int] = field(default_factory=list)  # the journal: every generated token id, for a replay
    tools: ToolCallParser | None = None  # splits the text into content and tool calls (requests with tools)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OpenAIServing:
    def __init__(self, router: Router, tokenizer: Tokenizer, model_name: str, metrics: Metrics,
                 tool_call_parser: str | None = None, allow_grammar: bool = True):
        self.router = router
        # the free-form `grammar` kind of structured outputs (EBNF: the one whose cost a client controls most), server
        # wide (--no-grammar); a tenant may also be refused it (its keys-file entry's allow_grammar)
        self.allow_grammar = allow_grammar
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.native_tools = template_knows_tools(template)  # else: the fallback tool prompt (api/tools.py)
        self.tool_format = FORMATS[tool_call_parser or default_parser(template if self.native_tools else None)]
        self.model_name = model_name
        self.metrics = metrics
        self._token_text: dict[int, str] = {}
        # the longest token's text: a prompt of more characters than max_model_len x this cannot fit the context
        # whatever it tokenizes to, so it is refused before it costs any tokenizing
        vocab = tokenizer.hf.get_vocab() if hasattr(tokenizer, "hf") else {}
        self.max_token_chars = max((len(t) for t in vocab), default=0) or 64

    async def prepare(self, req: CompletionRequest | ChatCompletionRequest, received_at: float,
                      allow_grammar: bool = True) -> Prepared:
        """prepare_completion or prepare_chat; a long prompt is first bounded by its size, then tokenized off the
        event loop (an 8 MiB prompt must not stall every stream), in a small pool of threads. allow_grammar: False
        when the request's tenant may not use the `grammar` kind of structured outputs."""
        chat = isinstance(req, ChatCompletionRequest)
        self.check_grammar_allowed(req, allow_grammar)  # before any tokenizing or parsing
        prepare = self.prepare_chat if chat else self.prepare_completion
        chars = _prompt_chars(req)
        if chars <= TOKENIZE_INLINE_MAX_CHARS:
            return prepare(req, received_at)
        hello = self.router.hello
        if hello is not None and chars > hello.max_model_len * self.max_token_chars:
            what = "messages" if chat else "prompt"
            raise invalid(f"This model's maximum context length is {hello.max_model_len} tokens; the {what} has "
                          f"{chars} characters, more than that many tokens can hold.", param=what,
                          code="context_length_exceeded")
        return await off_the_loop(prepare, req, received_at)

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
        if requested is not None and requested != self.model_name:
            raise APIError(404, f"The model `{requested}` does not exist (this server serves `{self.model_name}`)",
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
        return self._prepare(False, "cmpl-", req, prompts, req.max_tokens, req.logprobs, received_at, spec)

    def prepare_chat(self, req: ChatCompletionRequest, received_at: float) -> Prepared:
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
        spec = self._constraint(req)
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
                text = tool_constraint(self.tool_format, tools, choice, req.parallel_tool_calls is not False)
            except Exception as e:
                raise invalid(f"the tools cannot be compiled into a constraint: {e}", param="tools") from None
            spec = ("structural_tag", text)
            self._check_spec(spec, "tools")
            tool_format = self.tool_format
        prompt = self.chat_prompt(req.messages, bool(req.add_generation_prompt), tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prep = self._prepare(True, "chatcmpl-", req, [prompt], max_tokens, logprobs, received_at, spec)
        prep.tool_format = tool_format
        prep.tool_names = frozenset(t["function"]["name"] for t in tools)
        return prep

    def _constraint(self, req) -> tuple[str, str] | None:
        """The (kind, text) grammar that response_format, structured_outputs or vLLM's guided_* ask for (at most
        one of them), parsed here so that a bad one is a 400 before the request is admitted."""
        found: list[tuple[str, tuple[str, str]]] = []
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
                    tools: list[dict] | None = None) -> list[int]:
        rendered = []
        check = getattr(self.tokenizer, "contains_special_text", None)
        for i, m in enumerate(messages):
            # a template prints these outside the message contents, where a special token's text becomes the token
            for field, value in (("name", m.name), ("tool_call_id", m.tool_call_id)):
                if value is not None and check is not None and check(value):
                    raise invalid(f"messages[{i}].{field} must not contain the text of the model's special tokens",
                                  param=f"messages[{i}].{field}")
            # the template knows system, user and assistant; OpenAI's developer role is the system role renamed
            message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            rendered.append(message)
        if tools or any(m.role == "tool" or m.tool_calls for m in messages):
            if self.native_tools:  # the template prints tools and calls outside the contents: no special tokens there
                outside = json.dumps([tools, [m.get("tool_calls") for m in rendered]], ensure_ascii=False)
                if check is not None and check(outside):
                    raise invalid("tools and tool calls must not contain the text of the model's special tokens",
                                  param="tools")
            rendered, kwargs = render_messages(rendered, tools, self.native_tools)
        else:
            kwargs = {}
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
            for i in range(n):
                params = self._sampling_params(req, budget, logprobs, seed + len(param_list))
                params.structured, params.logit_bias = spec, bias
                param_list.append(params)
                prompt_of.append(p_index)
        return Prepared(chat, prefix + uuid.uuid4().hex, self.model_name, prompts, prompt_of, param_list,
                        bool(req.stream), bool(req.stream_options and req.stream_options.include_usage),
                        logprobs is not None, bool(req.return_tokens_as_token_ids), received_at)

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

    # ---- running --------------------------------------------------------------------------------------------
    def start(self, prep: Prepared) -> "Run":
        return Run(self, prep)

    def token_text(self, token_id: int, as_id: bool) -> str:
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


_END = object()  # the driver's last queue item: every choice ended


class Run:
    """The choices of one request running in the workers, merged into one stream of (choice, new text, new
    logprob entries, output) events in arrival order.

    A driver task (not the HTTP response's task: no cancelled scope reaches it) reads the workers' outputs as they
    arrive, detokenizes them, checks stop strings and queues the events for whoever writes the response; it ends when
    the worker's last output for every choice has arrived (or on an error, or when closed), and then calls on_done:
    the request's room and quota are released then, whether or not the client has read anything. close() is
    synchronous, so that cleanup inside a cancelled scope (a client that disconnected) cannot be skipped."""

    def __init__(self, serving: OpenAIServing, prep: Prepared):
        self.serving = serving
        self.prep = prep
        tok = serving.tokenizer
        self.choices = [ChoiceState(i, TextWithStops(IncrementalDetokenizer(tok, prep.prompts[prep.prompt_of[i]]),
                                                     prep.params[i].stop))
                        for i in range(len(prep.params))]
        if prep.tool_format is not None:
            for c in self.choices:
                c.tools = ToolCallParser(prep.tool_format, prep.tool_names)
        self._events: asyncio.Queue = asyncio.Queue()  # events, an exception, then _END
        self._driver: asyncio.Task | None = None
        self.on_tokens = None  # called with the number of new tokens of every output (the gateway's fair share)
        self.on_done = None  # called once, synchronously, when the run has ended (released its worker)
        self._done_called = False
        self.dispatched_at: float | None = None
        self.last_output_at: float | None = None  # when the last worker output arrived
        # async (lost worker, error) -> a new worker for a replay (the gateway's Ticket.rebind); None: no replay
        self.rebind = None
        self.error: Exception | None = None  # what ended the run early (the rollout's error rate counts it)
        self.num_replays = 0
        self.longest_gap_s = 0.0  # the longest pause between two outputs that a replay caused

    def dispatch(self, worker=None, priority: int = 0, queue_seconds: float = 0.0) -> None:
        """Sends every choice to `worker` (the gateway's choice; default: the router's pick), with the engine
        priority of its band; NoWorkerAvailable if there is none."""
        prep, router = self.prep, self.serving.router
        if worker is None:
            worker = router.pick()  # fail before anything is sent when no worker is attached
        for params in prep.params:
            params.priority = priority
        streams = [self._choice_stream(i, worker) for i in range(len(self.choices))]
        self.dispatched_at = time.perf_counter()
        self.serving.metrics.dispatch_overhead.observe(self.dispatched_at - prep.received_at - queue_seconds)
        self.serving.metrics.prompt_tokens.inc(sum(len(prep.prompts[p]) for p in prep.prompt_of))
        self._driver = asyncio.get_running_loop().create_task(self._drive(streams))
        self._driver.add_done_callback(lambda _: self._ended())  # runs even if cancelled before it started

    async def _choice_stream(self, index: int, worker) -> AsyncIterator[WorkerOutput]:
        """One choice's outputs. When its worker dies, hangs or drains under it, the choice is replayed on the
        worker the gateway rebinds the request to: the prompt plus every token already generated (the journal),
        the original prompt length (so max_tokens, penalties, min_tokens and seeded sampling positions are the
        original request's) and a new epoch; the client's stream just continues."""
        prep, router = self.prep, self.serving.router
        prompt, params = prep.prompts[prep.prompt_of[index]], prep.params[index]
        journal = self.choices[index].token_ids
        attempt = 0
        while True:
            request_id = f"{prep.id}-{index}" + (f".r{attempt}" if attempt else "")
            stream = router.generate(request_id, prompt + journal if journal else prompt, params, worker,
                                     num_prompt_tokens=len(prompt) if journal else None)
            try:
                async for out in stream:
                    journal.extend(out.new_token_ids)
                    yield out
                return
            except WorkerUnavailable as e:
                if self.rebind is None or attempt >= MAX_REPLAYS_PER_REQUEST or self.choices[index].finished:
                    raise
                worker = await self.rebind(worker, e, any(c.token_ids for c in self.choices))
                attempt += 1
                self.num_replays += 1
                self.serving.metrics.replays.labels("worker_lost" if isinstance(e, WorkerDead) else "drain").inc()
            finally:
                await stream.aclose()

    async def _drive(self, streams: list) -> None:
        try:
            if len(streams) == 1:  # the common case: no task per choice
                await self._pump(0, streams[0])
            else:
                pumps = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]
                try:
                    await asyncio.gather(*pumps)
                finally:  # one failed (or the run was closed): the others stop too, before the run ends
                    for pump in pumps:
                        pump.cancel()
                    await asyncio.gather(*pumps, return_exceptions=True)
        except asyncio.CancelledError:  # closed: nobody reads the events any more
            raise
        except Exception as e:  # the first worker error ends the request (the others are closed)
            self.error = e
            self._events.put_nowait(e)
        finally:
            self._events.put_nowait(_END)

    async def _pump(self, index: int, stream) -> None:
        choice = self.choices[index]
        try:
            async for out in stream:
                if choice.finished:  # ended here (a stop string) before the worker noticed
                    break
                delta, entries, calls = self._apply(choice, out)
                # whether THIS event ended the choice: the writer may read it long after the driver moved on
                self._events.put_nowait((choice, delta, entries, out, choice.finished, calls))
                if choice.finished:  # also when it ended here: leaving the loop aborts it in the worker
                    break
        finally:
            await stream.aclose()

    def _ended(self) -> None:
        if self._done_called:
            return
        self._done_called = True
        if self.on_done is not None:
            self.on_done()

    async def events(self) -> AsyncIterator[tuple[ChoiceState, str, list, WorkerOutput, bool]]:
        """Yields (choice, text delta, logprob entries, the output, whether it ended the choice) per step and
        choice, until every choice is finished. Raises the first worker error."""
        while True:
            item = await self._events.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def _apply(self, choice: ChoiceState, out: WorkerOutput) -> tuple[str, list, list]:
        now = time.perf_counter()
        if self.last_output_at is not None and self.num_replays:
            self.longest_gap_s = max(self.longest_gap_s, (out.received_at or now) - self.last_output_at)
        self.last_output_at = out.received_at or now
        if self.on_tokens is not None and out.new_token_ids:
            self.on_tokens(len(out.new_token_ids))
        if choice.first_token_at is None and out.new_token_ids:
            choice.first_token_at = now
            self.serving.metrics.ttft.observe(now - self.prep.received_at)
        choice.num_prompt_tokens = out.num_prompt_tokens
        choice.num_output_tokens = out.num_output_tokens
        choice.num_cached_tokens = out.num_cached_tokens
        delta, matched = choice.text.add(out.new_token_ids, final=out.finished)
        if out.finished:
            if out.finish_reason not in ("stop", "length"):
                raise WorkerDead(f"the worker ended the request ({out.finish_reason})")
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
        if matched is not None and not out.finished:
            choice.finish_reason, choice.stop_reason = "stop", matched
        if matched is not None:
            choice.stop_reason = matched
        entries = [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs] if self.prep.logprobs else []
        calls: list = []
        if choice.tools is not None:  # the text splits into content and tool-call deltas
            items = choice.tools.feed(delta, final=choice.finished)
            delta = "".join(item[1] for item in items if item[0] == "content")
            calls = [item[1:] for item in items if item[0] == "call"]
            if choice.finished and choice.finish_reason == "stop" and choice.tools.calls:
                choice.finish_reason = "tool_calls"
        if choice.finished:
            self._observe_finish(choice, now)
        if not self.prep.stream:  # a stream's text and logprobs are not kept once queued for the client
            choice.logprobs.extend(entries)
            if delta:
                choice.pieces.append(delta)
        return delta, entries, calls

    def _observe_finish(self, choice: ChoiceState, now: float) -> None:
        m = self.serving.metrics
        m.finished.labels(choice.finish_reason).inc()
        m.generation_tokens.inc(choice.num_output_tokens)
        m.e2e.observe(now - self.prep.received_at)
        if choice.num_output_tokens > 1 and choice.first_token_at is not None:
            m.tpot.observe((now - choice.first_token_at) / (choice.num_output_tokens - 1))

    @property
    def ended(self) -> bool:
        """The driver has ended (every choice finished, failed or was closed) or was never started."""
        return self._driver is None or self._driver.done()

    def close(self) -> None:
        """Stops whatever still runs (its driver closes the worker streams, which aborts them in the workers) and
        releases the request. Synchronous and idempotent: safe in a cancelled scope."""
        if self._driver is not None and not self._driver.done():
            self._driver.cancel()
        elif self._driver is None:
            self._ended()

    async def aclose(self) -> None:
        """close(), then waits until the driver has let go of the workers."""
        self.close()
        if self._driver is not None:
            await asyncio.gather(self._driver, return_exceptions=True)

    def usage(self) -> dict:
        seen, prompt_tokens, cached = set(), 0, 0
        for choice in self.choices:
            p = self.prep.prompt_of[choice.index]
            if p not in seen:
                seen.add(p)
                prompt_tokens += choice.num_prompt_tokens or len(self.prep.prompts[p])
                cached += choice.num_cached_tokens
        completion = sum(c.num_output_tokens for c in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def _prompt_chars(req) -> int:
    """Characters of text to tokenize (token-id prompts: none)."""
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.text()) for m in req.messages)
    prompt = req.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


# ---- OpenAI response shapes --------------------------------------------------------------------------------------
async def complete(run: Run) -> dict:
    """Runs every choice to the end; the whole (non-streaming) response."""
    async for _ in run.events():
        pass
    prep = run.prep
    choices = []
    for c in run.choices:
        text = "".join(c.pieces)
        logprobs = _logprobs(run, c, c.logprobs, 0) if prep.logprobs else None
        if prep.chat:
            message = {"role": "assistant", "content": text, "refusal": None}
            if c.tools is not None:
                content, calls = c.tools.result()
                if calls:
                    message["content"], message["tool_calls"] = content, calls
            choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        else:
            choices.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
    return {"id": prep.id, "object": "chat.completion" if prep.chat else "text_completion", "created": prep.created,
            "model": prep.model, "choices": choices, "usage": run.usage(), "system_fingerprint": None}


async def first_event(run: Run):
    """Waits for the first event of a stream, so that a refusal can still be an HTTP error. Returns (events
    iterator, first event)."""
    events = run.events()
    return events, await anext(events)


async def stream(run: Run, events, first) -> AsyncIterator[bytes]:
    """The SSE body: role chunks (chat), one chunk per step and choice with text or logprobs, a finish chunk per
    choice, the usage chunk when asked for, then [DONE]. A failure after the start is an error event."""
    prep, write_overhead = run.prep, run.serving.metrics.write_overhead
    head = {"id": prep.id, "object": "chat.completion.chunk" if prep.chat else "text_completion",
            "created": prep.created, "model": prep.model}
    if prep.include_usage:
        head["usage"] = None
    offsets = [0] * len(run.choices)  # text_offset of completion logprobs
    try:
        if prep.chat:
            for c in run.choices:
                yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        event = first
        while event is not None:
            choice, delta, entries, out, finished, calls = event
            if delta or entries or calls:
                logprobs = _logprobs(run, choice, entries, offsets[choice.index]) if prep.logprobs else None
                if logprobs and not prep.chat:
                    offsets[choice.index] += sum(len(t) for t in logprobs["tokens"])
                chunk = _chunk_choice(prep.chat, choice.index, delta, logprobs, None)
                if calls:
                    chunk["delta"]["tool_calls"] = _tool_call_deltas(calls)
                yield sse({**head, "choices": [chunk]})
                write_overhead.observe(time.perf_counter() - out.received_at)
            if finished:
                yield sse({**head, "choices": [_chunk_choice(prep.chat, choice.index, "", None, choice)]})
            event = await anext(events, None)
        if prep.include_usage:
            yield sse({**head, "choices": [], "usage": run.usage()})
    except Exception as e:  # the stream has started: the error goes in band
        run.error = e
        yield sse(worker_error(e).body())
    finally:
        run.close()  # synchronous: this may run in a cancelled scope (the client went away)
    yield SSE_DONE


def _tool_call_deltas(calls: list) -> list[dict]:
    """OpenAI's streamed tool-call deltas: a call's first one carries its index, id, type and name; the next ones
    its index and argument fragments (consecutive fragments of one call merged)."""
    deltas: list[dict] = []
    for call, fragment, first in calls:
        if first:
            deltas.append({"index": call.index, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": fragment}})
        elif deltas and deltas[-1]["index"] == call.index:
            deltas[-1]["function"]["arguments"] += fragment
        else:
            deltas.append({"index": call.index, "function": {"arguments": fragment}})
    return deltas


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


def _chunk_choice(chat: bool, index: int, text: str, logprobs, finished: ChoiceState | None) -> dict:
    reason = finished.finish_reason if finished else None
    if chat:
        choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                  "finish_reason": reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    if finished is not None:
        choice["stop_reason"] = finished.stop_reason
    return choice


def _logprobs(run: Run, choice: ChoiceState, entries: list, offset: int) -> dict:
    as_ids = run.prep.tokens_as_ids
    text = run.serving.token_text
    if run.prep.chat:
        def item(token_id, logprob):
            s = text(token_id, as_ids)
            return {"token": s, "logprob": logprob, "bytes": list(s.encode())}
        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]} for t, lp, top in entries]}
    tokens, offsets = [], []
    for t, _, _ in entries:
        tokens.append(text(t, as_ids))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{text(i, as_ids): v for i, v in top} for _, _, top in entries], "text_offset": offsets}

