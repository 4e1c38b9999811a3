"""The generation service: the one path from an admitted request to a finished ticket.

`GenerationService` admits a request (the tenant's quota, the queue, a worker's room: a `Ticket`) and hands back a
`Generation` that owns the ticket to the end: it dispatches the request's sequences to the worker the gateway bound
it to, reads their outputs (moving to another worker when one is lost: inferd/gateway/failover.py), turns them into
text events, and releases the ticket in exactly one place (`Generation._release`), on every way out: the worker's
last output, an error, a refusal while queued, a client gone, a write timeout. `close()` is synchronous and
idempotent, so cleanup in a cancelled scope (a client that disconnected) cannot skip the release; `admitted()`
(an async context manager) closes it on the way out of any block. Embedding requests (`embed`) and Batch API lines
(`collect`) go through the same service.

The API process owns text: workers send token ids; here each choice is detokenized incrementally and checked for
stop strings with the same logic as the engine (`TextWithStops`), so that a stop string never reaches the client,
also when it spans two tokens. The worker stops on the same token by itself; should the two ever disagree, the
choice ends here and the worker is told to abort.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from ..engine.kv_cache import block_salt
from ..engine.request import SamplingParams
from ..gateway.admission import Gateway, Ticket
from ..gateway.failover import replaying
from ..gateway.tenants import Tenant
from ..models.tokenizer import IncrementalDetokenizer, TextWithStops
from ..worker.client import WorkerClient, WorkerDead
from ..worker.protocol import WorkerOutput
from .embeddings import EmbeddingModel, EmbeddingRequest
from .errors import APIError
from .harmony import HarmonyParser
from .reasoning import ReasoningParser
from .refusals import is_server_error, worker_error
from .responses import complete
from .serving import OpenAIServing, Prepared
from .tools import ToolCallParser


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
    reasoning: ReasoningParser | None = None  # splits the reasoning off first (--reasoning-parser)
    reasoning_pieces: list[str] = field(default_factory=list)  # emitted reasoning, for non-streaming responses
    harmony: HarmonyParser | None = None  # gpt-oss's channels: reasoning, content and tool calls in one
    prompt_logprobs: list | None = None  # the engine's prompt logprobs (the first copy: a replay sends them again)
    echoed: bool = False  # echo: the prompt has led this choice's text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class GenerationService:
    """Admits requests and runs them to the end (see the module's docstring). `state`: the server's ServerState
    (its gateway, serving, metrics and rollout are read when used: they may be set after the service is made)."""

    def __init__(self, state):
        self.state = state

    async def admit(self, prep: Prepared, tenant: Tenant, tier_rank: int, queue_timeout: float | None) -> Generation:
        """Admission (quota, queue, overload): a Generation that holds the ticket from here on (nothing awaits
        between the two), or the refusal as an APIError (429, 503, ...)."""
        serving = self.state.require_serving()
        lora = prep.params[0].lora if prep.params else None
        ticket = await _admit(self.state.gateway, tenant, tier_rank, prep.prompt_tokens, prep.reserved_tokens,
                              queue_timeout, prompt=prep.prompts[0], num_seqs=len(prep.params),
                              salt=block_salt(tenant.cache_salt, lora), adapter=prep.adapter)
        if prep.adapter is not None:
            self.state.metrics.lora_requests.labels(adapter=prep.adapter).inc()
        salt = tenant.cache_salt
        for params in prep.params:  # the worker's prefix cache shares blocks only under the same salt
            params.cache_salt = salt
        try:
            return Generation(self, serving, prep, ticket)
        except BaseException:
            ticket.finish(0)
            raise

    @asynccontextmanager
    async def admitted(self, prep: Prepared, tenant: Tenant, tier_rank: int,
                       queue_timeout: float | None = None) -> AsyncIterator[Generation]:
        """admit(), closed on the way out of the block whatever happens in it."""
        generation = await self.admit(prep, tenant, tier_rank, queue_timeout)
        try:
            yield generation
        finally:
            generation.close()

    async def collect(self, prep: Prepared, tenant: Tenant, tier_rank: int, queue_timeout: float | None = None) -> dict:
        """The whole (non-streaming) response of a request: admitted, run to the end, released."""
        async with self.admitted(prep, tenant, tier_rank, queue_timeout) as generation:
            await generation.start()
            return await complete(generation)

    async def embed(self, model: EmbeddingModel, req: EmbeddingRequest, tenant: Tenant, tier_rank: int,
                    queue_timeout: float | None) -> dict:
        """An embedding request (model: the EmbeddingModel of the model it names) in OpenAI's shape: admitted in
        that model's own gateway (the same tenants' quotas), each input run on the bound worker (again on another
        when that one is lost: an embedding has no state to carry over), the ticket released on every way out."""
        ids = await model.inputs(req)
        tokens = sum(len(x) for x in ids)
        ticket = await _admit(model.gateway, tenant, tier_rank, tokens, tokens, queue_timeout, prompt=None,
                              num_seqs=len(ids))
        used = 0
        try:
            worker = ticket.worker or await ticket.wait()
            base = "emb-" + uuid.uuid4().hex
            params = SamplingParams(max_tokens=1, temperature=0.0, cache_salt=tenant.cache_salt)

            async def one(i: int, x: list[int]) -> list[float]:
                nonlocal used
                async for out in replaying(ticket, f"{base}-{i}", x, params, worker, None):
                    if out.finished:
                        if out.embedding is None:
                            raise APIError(500, "the embedding worker answered without a vector", code="engine_error")
                        used += len(x)
                        ticket.on_output(1)
                        return out.embedding
                raise APIError(503, "the embedding worker ended the request", code="worker_lost",
                               headers={"Retry-After": "1"})

            vectors = await asyncio.gather(*(one(i, x) for i, x in enumerate(ids)))
        finally:
            ticket.finish(used)
        model.num_requests += 1
        return model.response(req, vectors, tokens)

    def finished(self, generation: Generation) -> None:
        """A generation released its ticket: one that reached a worker counts for its version (rollout figures)."""
        rollout = self.state.rollout
        if rollout is None or generation.dispatched_at is None:
            return
        ttft = tpot = None
        c = generation.choices[0]
        if c.first_token_at is not None:
            ttft = c.first_token_at - generation.prep.received_at
            if c.num_output_tokens > 1 and generation.last_output_at is not None:
                tpot = (generation.last_output_at - c.first_token_at) / (c.num_output_tokens - 1)
        rollout.observe(generation.ticket.version, ttft, tpot, is_server_error(generation.error))


async def _admit(gateway: Gateway, tenant: Tenant, tier_rank: int, prompt_tokens: int, reserved_tokens: int,
                 queue_timeout: float | None, prompt: list[int] | None, num_seqs: int, salt: str | None = None,
                 adapter: str | None = None) -> Ticket:
    """gateway.admit with its refusals as the APIErrors a client sees. salt: the prompt's block salt (the tenant's,
    and its LoRA adapter's); adapter: its name, for the router."""
    try:
        return await gateway.admit(tenant, tier_rank, prompt_tokens, reserved_tokens, queue_timeout, prompt=prompt,
                                   num_seqs=num_seqs, cache_salt=tenant.cache_salt if salt is None else salt,
                                   adapter=adapter)
    except Exception as e:  # RateLimited, Overloaded, QueueShareExceeded, NoWorkerAvailable, the limiter down
        raise worker_error(e) from None


_END = object()  # the driver's last queue item: every choice ended


class Generation:
    """One admitted request: its ticket, and its choices running in the workers, merged into one stream of
    (choice, new text, new logprob entries, output) events in arrival order.

    A driver task (not the HTTP response's task: no cancelled scope reaches it) reads the workers' outputs as they
    arrive, detokenizes them, checks stop strings and queues the events for whoever writes the response; it ends when
    the worker's last output for every choice has arrived (or on an error, or when closed), and then releases the
    ticket: the request's room and quota come back then, whether or not the client has read anything. A generation
    never started releases it in close(), which is synchronous, so that cleanup inside a cancelled scope (a client
    that disconnected) cannot be skipped."""

    def __init__(self, service: GenerationService, serving: OpenAIServing, prep: Prepared, ticket: Ticket):
        self.service = service
        self.serving = serving
        self.prep = prep
        self.ticket = ticket
        tok = self.serving.tokenizer
        self.choices = [ChoiceState(i, TextWithStops(IncrementalDetokenizer(tok, prep.prompts[prep.prompt_of[i]],
                                                                            keep_special_ids=prep.keep_special),
                                                     prep.params[i].stop))
                        for i in range(len(prep.params))]
        if prep.tool_format is not None:
            for c in self.choices:
                c.tools = ToolCallParser(prep.tool_format, prep.tool_names)
        if prep.reasoning is not None:
            for c in self.choices:
                c.reasoning = ReasoningParser(prep.reasoning)
        if prep.harmony:
            for c in self.choices:
                c.harmony = HarmonyParser(prep.tool_names)
        self._events: asyncio.Queue = asyncio.Queue()  # events, an exception, then _END
        self._driver: asyncio.Task | None = None
        self._released = False
        self.dispatched_at: float | None = None
        self.last_output_at: float | None = None  # when the last worker output arrived
        self.error: Exception | None = None  # what ended the generation early (the rollout's error rate counts it)
        self.num_replays = 0
        self.longest_gap_s = 0.0  # the longest pause between two outputs that a replay caused

    async def start(self) -> None:
        """Waits for the worker the gateway binds the request to (at once unless it waits in the queue; raises
        QueueTimeout or Overloaded when it leaves the queue without one), then sends it every choice, with the
        engine priority of its tier."""
        ticket, prep = self.ticket, self.prep
        worker = ticket.worker or await ticket.wait()
        for params in prep.params:
            params.priority = ticket.tier_rank
        streams = [self._choice_stream(i, worker) for i in range(len(self.choices))]
        self.dispatched_at = time.perf_counter()
        metrics = self.serving.metrics
        metrics.dispatch_overhead.observe(self.dispatched_at - prep.received_at - ticket.queue_seconds)
        metrics.prompt_tokens.inc(sum(len(prep.prompts[p]) for p in prep.prompt_of))
        self._driver = asyncio.get_running_loop().create_task(self._drive(streams))
        self._driver.add_done_callback(lambda _: self._release())  # runs even if cancelled before it started

    def _choice_stream(self, index: int, worker: WorkerClient) -> AsyncGenerator[WorkerOutput, None]:
        """One choice's outputs, moved to another worker (replayed from its journal) when its worker is lost."""
        prep, choice = self.prep, self.choices[index]

        def on_replay(e: Exception) -> None:
            self.num_replays += 1
            self.serving.metrics.replays.labels("worker_lost" if isinstance(e, WorkerDead) else "drain").inc()

        return replaying(self.ticket, f"{prep.id}-{index}", prep.prompts[prep.prompt_of[index]], prep.params[index],
                         worker, choice.token_ids, started=lambda: any(c.token_ids for c in self.choices),
                         may_replay=lambda: not choice.finished, on_replay=on_replay)

    async def _drive(self, streams: list[AsyncGenerator[WorkerOutput, None]]) -> None:
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

    async def _pump(self, index: int, stream: AsyncGenerator[WorkerOutput, None]) -> None:
        choice = self.choices[index]
        try:
            async for out in stream:
                if choice.finished:  # ended here (a stop string) before the worker noticed
                    break
                delta, entries, calls, reasoning = self._apply(choice, out)
                # whether THIS event ended the choice: the writer may read it long after the driver moved on
                self._events.put_nowait((choice, delta, entries, out, choice.finished, calls, reasoning))
                if choice.finished:  # also when it ended here: leaving the loop aborts it in the worker
                    break
        finally:
            await stream.aclose()

    def _release(self) -> None:
        """The one place the ticket is released (once): what it holds comes back, settled with the tokens used."""
        if self._released:
            return
        self._released = True
        self.ticket.finish(self.usage()["total_tokens"] if self.dispatched_at is not None else 0)
        self.service.finished(self)

    async def events(self) -> AsyncIterator[tuple[ChoiceState, str, list, WorkerOutput, bool, list, str]]:
        """Yields (choice, text delta, logprob entries, the output, whether it ended the choice, tool-call deltas,
        reasoning delta) per step and choice, until every choice is finished. Raises the first worker error."""
        while True:
            item = await self._events.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def _apply(self, choice: ChoiceState, out: WorkerOutput) -> tuple[str, list, list, str]:
        now = time.perf_counter()
        if self.last_output_at is not None and self.num_replays:
            self.longest_gap_s = max(self.longest_gap_s, (out.received_at or now) - self.last_output_at)
        self.last_output_at = out.received_at or now
        if out.new_token_ids:  # the tenant's fair share and the drain rate count them
            self.ticket.on_output(len(out.new_token_ids))
        if choice.first_token_at is None and out.new_token_ids:
            choice.first_token_at = now
            self.serving.metrics.ttft.observe(now - self.prep.received_at)
        choice.num_prompt_tokens = out.num_prompt_tokens
        choice.num_output_tokens = out.num_output_tokens
        choice.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None and choice.prompt_logprobs is None:
            choice.prompt_logprobs = out.prompt_logprobs
            # a replay of this choice needs them no more: it may take prefix-cache hits (prompt_logprobs.py)
            self.prep.params[choice.index].prompt_logprobs = None
        if out.finished and out.finish_reason not in ("stop", "length"):
            raise WorkerDead(f"the worker ended the request ({out.finish_reason})")
        if self.prep.echo_only:  # max_tokens 0: the prompt alone; the token the engine sampled is dropped
            choice.num_output_tokens = 0
            if out.finished:
                choice.finish_reason = "length"
            if choice.finished:
                self._observe_finish(choice, now)
            delta, entries = self._echo(choice, "", [])
            self._keep(choice, delta, entries, "")
            return delta, entries, [], ""
        delta, matched = choice.text.add(out.new_token_ids, final=out.finished)
        if out.finished:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
        if matched is not None and not out.finished:
            choice.finish_reason, choice.stop_reason = "stop", matched
        if matched is not None:
            choice.stop_reason = matched
        entries = [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs] if self.prep.logprobs else []
        calls: list = []
        reasoning = ""
        if choice.reasoning is not None:  # the reasoning first: tool calls are parsed from the content only
            items = choice.reasoning.feed(delta, final=choice.finished)
            reasoning = "".join(text for channel, text in items if channel == "reasoning")
            delta = "".join(text for channel, text in items if channel == "content")
        if choice.harmony is not None:  # the channels give the reasoning, the content and the tool calls at once
            items = choice.harmony.feed(delta, final=choice.finished)
            reasoning = "".join(item[1] for item in items if item[0] == "reasoning")
            delta = "".join(item[1] for item in items if item[0] == "content")
            calls = [item[1:] for item in items if item[0] == "call"]
            if choice.finished and choice.finish_reason == "stop" and choice.harmony.calls:
                choice.finish_reason = "tool_calls"
        if choice.tools is not None:  # the text splits into content and tool-call deltas
            items = choice.tools.feed(delta, final=choice.finished)
            delta = "".join(item[1] for item in items if item[0] == "content")
            calls = [item[1:] for item in items if item[0] == "call"]
            if choice.finished and choice.finish_reason == "stop" and choice.tools.calls:
                choice.finish_reason = "tool_calls"
        if choice.finished:
            self._observe_finish(choice, now)
        if self.prep.echo:
            delta, entries = self._echo(choice, delta, entries)
        self._keep(choice, delta, entries, reasoning)
        return delta, entries, calls, reasoning

    def _keep(self, choice: ChoiceState, delta: str, entries: list, reasoning: str) -> None:
        if not self.prep.stream:  # a stream's text and logprobs are not kept once queued for the client
            choice.logprobs.extend(entries)
            if delta:
                choice.pieces.append(delta)
            if reasoning:
                choice.reasoning_pieces.append(reasoning)

    def _echo(self, choice: ChoiceState, delta: str, entries: list) -> tuple[str, list]:
        """echo: the prompt's text (and its logprob entries, the first without one) lead the choice's first event."""
        if not choice.echoed:
            choice.echoed = True
            prompt = self.prep.prompts[self.prep.prompt_of[choice.index]]
            delta = self.serving.tokenizer.decode(prompt, skip_special_tokens=False) + delta
            if self.prep.logprobs:  # (the engine sent them with the first output; None where one is missing)
                given = choice.prompt_logprobs or []
                entries = [(t, None, None) if p >= len(given) or given[p] is None else
                           (t, given[p].logprob, given[p].top) for p, t in enumerate(prompt)] + entries
        return delta, entries

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
            self._release()

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

