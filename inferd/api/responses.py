"""OpenAI's response shapes of a generation: the whole response (`complete`), or the server-sent events of a stream
(`stream`: role chunks, text and logprob chunks, finish chunks, usage, [DONE]; a failure after the start is an error
event). `generation` is an inferd/api/generation.py Generation."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from .refusals import worker_error

_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def sse(payload: dict) -> bytes:
    return b"data: " + _DUMPS(payload).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def complete(generation) -> dict:
    """Runs every choice to the end; the whole (non-streaming) response."""
    async for _ in generation.events():
        pass
    prep = generation.prep
    choices = []
    for c in generation.choices:
        text = "".join(c.pieces)
        logprobs = _logprobs(generation, c, c.logprobs, 0) if prep.logprobs else None
        if prep.chat:
            message = {"role": "assistant", "content": text, "refusal": None}
            if c.reasoning is not None:  # vLLM's field: null when the model wrote no reasoning
                message["reasoning_content"] = "".join(c.reasoning_pieces) or None
                message["content"] = text or None
            if c.harmony is not None:
                content, calls = c.harmony.result()
                message["reasoning_content"], message["content"] = c.harmony.reasoning or None, content
                if calls:
                    message["tool_calls"] = calls
            if c.tools is not None:
                content, calls = c.tools.result()
                if calls:
                    message["content"], message["tool_calls"] = content, calls
            choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        else:
            choices.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
            if prep.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = prompt_logprobs(generation, c)
    body = {"id": prep.id, "object": "chat.completion" if prep.chat else "text_completion", "created": prep.created,
            "model": prep.model, "choices": choices, "usage": generation.usage(), "system_fingerprint": None}
    if prep.chat and prep.prompt_logprobs is not None:  # vLLM's place for them in chat: the response's, once
        body["prompt_logprobs"] = prompt_logprobs(generation, generation.choices[0])
    return body


def prompt_logprobs(generation, choice) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt position, None for the first, else {token id: {logprob, rank,
    decoded_token}} of the prompt's token and the top-n."""
    entries = choice.prompt_logprobs
    if entries is None:
        return None
    text = generation.serving.token_text
    as_ids = generation.prep.tokens_as_ids
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        position = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": text(e.token_id, as_ids)}}
        for rank, (t, v) in enumerate(e.top, 1):
            position.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": text(t, as_ids)})
        out.append(position)
    return out


async def first_event(generation):
    """Waits for the first event of a stream, so that a refusal can still be an HTTP error. Returns (events
    iterator, first event)."""
    events = generation.events()
    return events, await anext(events)


async def stream(generation, events, first) -> AsyncIterator[bytes]:
    """The SSE body: role chunks (chat), one chunk per step and choice with text or logprobs, a finish chunk per
    choice, the usage chunk when asked for, then [DONE]. A failure after the start is an error event."""
    prep, write_overhead = generation.prep, generation.serving.metrics.write_overhead
    head = {"id": prep.id, "object": "chat.completion.chunk" if prep.chat else "text_completion",
            "created": prep.created, "model": prep.model}
    if prep.include_usage:
        head["usage"] = None
    offsets = [0] * len(generation.choices)  # text_offset of completion logprobs
    # vLLM's prompt_logprobs, when asked for: in each choice's first chunk (chat: the stream's first content chunk)
    prompt_pending = [prep.prompt_logprobs is not None] * (1 if prep.chat else len(generation.choices))
    try:
        if prep.chat:
            for c in generation.choices:
                yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        event = first
        while event is not None:
            choice, delta, entries, out, finished, calls, reasoning = event
            slot = 0 if prep.chat else choice.index
            pending = prompt_pending[slot] and choice.prompt_logprobs is not None
            if delta or entries or calls or reasoning or pending:
                logprobs = _logprobs(generation, choice, entries, offsets[choice.index]) if prep.logprobs else None
                if logprobs and not prep.chat:
                    offsets[choice.index] += sum(len(t) for t in logprobs["tokens"])
                chunk = _chunk_choice(prep.chat, choice.index, delta, logprobs, None)
                extra = {}
                if pending:
                    prompt_pending[slot] = False
                    if prep.chat:
                        extra["prompt_logprobs"] = prompt_logprobs(generation, choice)
                    else:
                        chunk["prompt_logprobs"] = prompt_logprobs(generation, choice)
                if reasoning:  # before the content in the delta, as it came first
                    chunk["delta"] = {"reasoning_content": reasoning, **chunk["delta"]}
                if calls:
                    chunk["delta"]["tool_calls"] = _tool_call_deltas(calls)
                yield sse({**head, "choices": [chunk], **extra})
                write_overhead.observe(time.perf_counter() - out.received_at)
            if finished:
                yield sse({**head, "choices": [_chunk_choice(prep.chat, choice.index, "", None, choice)]})
            event = await anext(events, None)
        if prep.include_usage:
            yield sse({**head, "choices": [], "usage": generation.usage()})
    except Exception as e:  # the stream has started: the error goes in band
        generation.error = e
        yield sse(worker_error(e).body())
    finally:
        generation.close()  # synchronous: this may run in a cancelled scope (the client went away)
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


def _chunk_choice(chat: bool, index: int, text: str, logprobs, finished) -> dict:
    reason = finished.finish_reason if finished else None
    if chat:
        choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                  "finish_reason": reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    if finished is not None:
        choice["stop_reason"] = finished.stop_reason
    return choice


def _logprobs(generation, choice, entries: list, offset: int) -> dict:
    as_ids = generation.prep.tokens_as_ids
    text = generation.serving.token_text
    if generation.prep.chat:
        def item(token_id, logprob):
            s = text(token_id, as_ids)
            return {"token": s, "logprob": logprob, "bytes": list(s.encode())}
        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]} for t, lp, top in entries]}
    tokens, offsets = [], []
    for t, _, _ in entries:
        tokens.append(text(t, as_ids))
        offsets.append(offset)
        offset += len(tokens[-1])
    # (an echoed prompt's first token has neither a logprob nor a top: None, as OpenAI's)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [None if top is None else {text(i, as_ids): v for i, v in top} for _, _, top in entries],
            "text_offset": offsets}

