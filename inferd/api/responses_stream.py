"""The Responses API's event stream of a generation, as OpenAI sends it: each event an SSE `event: TYPE` line and a
`data: JSON` line carrying the same type and a `sequence_number`. response.created, response.in_progress, then per
output item (reasoning, message, function_call, in the order the model wrote them) its added / delta / done events,
then response.completed (or response.incomplete when max_output_tokens ran out). A failure after the start is a
response.failed event (the Response object with its `error` and what was written so far); no [DONE] follows (OpenAI
sends none)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from .responses_api import (
    ResponseHead,
    call_item,
    failed_error,
    message_item,
    new_id,
    reasoning_item,
    usage,
)

_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


class EventWriter:
    """Writes one request's events (numbered from 0), keeping the output items for the last event."""

    def __init__(self, head: ResponseHead):
        self.head = head
        self.seq = 0
        self.items: list[dict] = []  # the output so far (the open item's text grows as its deltas are written)
        self.open: dict | None = None  # the item being written
        self.calls: dict[int, dict] = {}  # tool-call index -> its item
        self.blank = ""  # whitespace held back: it becomes text only if text (not a call) follows, or nothing else

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _DUMPS(payload).encode() + b"\n\n"

    # ---- items --------------------------------------------------------------------------------------------------
    def _open(self, item: dict, in_progress: dict) -> list[bytes]:
        out = self._close("completed")
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=index, item=in_progress))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}))
        elif item["type"] == "reasoning":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={"type": "reasoning_text", "text": ""}))
        return out

    def _close(self, status: str) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index = self.items.index(item)
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            out = [self.event("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[]),
                   self.event("response.content_part.done", **ids, content_index=0, part=part)]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out = [self.event("response.reasoning_text.done", **ids, content_index=0, text=part["text"]),
                   self.event("response.content_part.done", **ids, content_index=0, part=part)]
        else:
            out = [self.event("response.function_call_arguments.done", **ids, name=item["name"],
                              arguments=item["arguments"])]
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def reasoning(self, text: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            item_id = new_id("rs_")
            out += self._open(reasoning_item(item_id, "", "in_progress"),
                              {"id": item_id, "type": "reasoning", "summary": [], "content": [],
                               "status": "in_progress"})
        item = self.open
        item["content"][0]["text"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                              output_index=len(self.items) - 1, content_index=0, delta=text))
        return out

    def text(self, text: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "message":
            if not (self.blank + text).strip():  # whitespace: text only if text follows
                self.blank += text
                return out
            text, self.blank = self.blank + text, ""
            item_id = new_id("msg_")
            out += self._open(message_item(item_id, "", "in_progress"),
                              {**message_item(item_id, "", "in_progress"), "content": []})
        item = self.open
        item["content"][0]["text"] += text
        out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                              content_index=0, delta=text, logprobs=[]))
        return out

    def call(self, call, fragment: str, first: bool) -> list[bytes]:
        out = []
        if first:
            self.blank = ""  # whitespace beside a call is not an answer
            item_id = new_id("fc_")
            item = call_item(item_id, call.id, call.name, "", "in_progress")
            out += self._open(item, dict(item))
            self.calls[call.index] = item
        item = self.calls[call.index]
        if fragment:
            item["arguments"] += fragment
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.items.index(item), delta=fragment))
        return out

    def finish(self, status: str) -> list[bytes]:
        """Closes the open item; an answer with no item at all gets its (maybe empty) message."""
        out = []
        if not self.calls and (self.blank or not any(i["type"] == "message" for i in self.items)):
            self.blank, blank = "", self.blank
            item_id = new_id("msg_")
            out += self._open(message_item(item_id, "", "in_progress"),
                              {**message_item(item_id, "", "in_progress"), "content": []})
            if blank:
                self.open["content"][0]["text"] = blank
                out.append(self.event("response.output_text.delta", item_id=item_id,
                                      output_index=len(self.items) - 1, content_index=0, delta=blank, logprobs=[]))
        return out + self._close(status)

    # ---- the Shape's stream and stream_error ---------------------------------------------------------------
    def _start(self) -> list[bytes]:
        response = self.head.body("in_progress", [])
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def _failed(self, e: Exception) -> bytes:
        error = failed_error(e)
        return self.event("response.failed", response=self.head.body("failed", self.items, error=error))

    def failed_before_start(self, e: Exception) -> list[bytes]:
        """The stream's end when the request failed before its first event (the headers were sent)."""
        return [*self._start(), self._failed(e)]

    async def stream(self, generation, events, first) -> AsyncIterator[bytes]:
        write_overhead = generation.serving.metrics.write_overhead
        for chunk in self._start():
            yield chunk
        try:
            event, finish_reason = first, None
            while event is not None:
                choice, delta, _, out, finished, calls, reasoning = event
                chunks = self.reasoning(reasoning) if reasoning else []
                if delta:
                    chunks += self.text(delta)
                for call, fragment, is_first in calls:
                    chunks += self.call(call, fragment, is_first)
                for chunk in chunks:
                    yield chunk
                if chunks:
                    write_overhead.observe(time.perf_counter() - out.received_at)
                if finished:
                    finish_reason = choice.finish_reason
                event = await anext(events, None)
            incomplete = finish_reason == "length"
            status = "incomplete" if incomplete else "completed"
            for chunk in self.finish(status):
                yield chunk
            body = self.head.body(status, self.items, usage(generation.usage()),
                                  "max_output_tokens" if incomplete else None)
            yield self.event("response.incomplete" if incomplete else "response.completed", response=body)
        except Exception as e:  # the stream has started: the failure goes in band
            generation.error = e
            yield self._failed(e)
        finally:
            generation.close()  # synchronous: this may run in a cancelled scope (the client went away)
