"""Reasoning output: the model's thinking split from its answer (`--reasoning-parser`), as vLLM's parsers of the
same names do, for models that think inside ``<think>…</think>``.

- ``deepseek_r1``: the output starts thinking (the chat template may have opened ``<think>`` in the prompt already;
  an opening tag the model writes itself is dropped): everything up to ``</think>`` is reasoning, the rest content.
  Output cut off before ``</think>`` is reasoning only.
- ``qwen3``: only an output that opens with ``<think>`` (whitespace before it aside) thinks: up to ``</think>`` is
  reasoning, the rest content. An output that does not open with the tag is content only (so is all of it when the
  request turned thinking off: ``chat_template_kwargs: {"enable_thinking": false}``, see `reasoning_enabled`).
Whitespace between ``</think>`` and the answer is left out of the content; the reasoning is kept as written.

`ReasoningParser` is incremental: fed the text in any chunks (tags cut anywhere) it gives what it gives fed all at
once; it holds back only a tail that could still be a tag. Tool calls are parsed from the content part only
(generation.py chains the two). Structured outputs and tool constraints apply to the content after the reasoning:
`constraint_after_reasoning` wraps the constraint in an xgrammar structural tag whose first element is the thinking
(any text up to ``</think>``), so the grammar constrains the answer and leaves the thinking free.

gpt-oss's harmony format carries its reasoning in a channel of its own (inferd/api/harmony.py), not in tags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..config import REASONING_PARSERS  # noqa: F401 (the names `--reasoning-parser` takes)
from ..engine.structured import JSON_MAX_WHITESPACE, JSON_OBJECT_SCHEMA, parse_choices

THINK_START, THINK_END = "<think>", "</think>"
TAG_PARSERS = ("deepseek_r1", "qwen3")  # the parsers of this module (harmony's is api/harmony.py)
# between </think> and the answer the model writes a little whitespace (Qwen3: "\n\n"); the constraint allows it
_GAP_PATTERN = r"[ \t\r\n]{0,8}"


def reasoning_enabled(template_kwargs: dict[str, Any] | None) -> bool:
    """Whether the request lets the model think: not when its chat_template_kwargs say enable_thinking (Qwen3) or
    thinking (DeepSeek V3.1) is false; the template then writes no thinking and the output is all content."""
    kwargs = template_kwargs or {}
    return kwargs.get("enable_thinking") is not False and kwargs.get("thinking") is not False


@dataclass
class ReasoningParser:
    """Splits generated text into ("reasoning", text) and ("content", text) items as it arrives (see the module's
    docstring). `kind`: deepseek_r1 or qwen3."""
    kind: str
    reasoning: str = ""
    _state: str = "start"  # start | reasoning | gap (whitespace after </think>) | content
    _buf: str = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            before = (self._state, len(self._buf))
            getattr(self, "_" + self._state)(out, final)
            if (self._state, len(self._buf)) == before:
                break
        return out

    def _emit(self, out: list, channel: str, text: str) -> None:
        if not text:
            return
        if channel == "reasoning":
            self.reasoning += text
        if out and out[-1][0] == channel:
            out[-1] = (channel, out[-1][1] + text)
        else:
            out.append((channel, text))

    def _start(self, out: list, final: bool) -> None:
        head = self._buf.lstrip()
        if head.startswith(THINK_START):  # the model opened its thinking: the tag (and space before it) is syntax
            self._buf = head[len(THINK_START):]
            self._state = "reasoning"
        elif THINK_START.startswith(head) and not final:
            return  # could still be the opening tag
        elif self.kind == "deepseek_r1":  # thinking from the first character (the prompt opened it)
            self._state = "reasoning"
        else:
            self._state = "content"

    def _reasoning(self, out: list, final: bool) -> None:
        at = self._buf.find(THINK_END)
        if at >= 0:
            self._emit(out, "reasoning", self._buf[:at])
            self._buf = self._buf[at + len(THINK_END):]
            self._state = "gap"
            return
        keep = 0
        if not final:  # a tail that could still be the closing tag
            keep = next((k for k in range(min(len(THINK_END) - 1, len(self._buf)), 0, -1)
                         if THINK_END.startswith(self._buf[-k:])), 0)
        self._emit(out, "reasoning", self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]

    def _gap(self, out: list, final: bool) -> None:
        body = self._buf.lstrip()
        if body:
            self._buf = body
            self._state = "content"
        elif final:
            self._buf = ""

    def _content(self, out: list, final: bool) -> None:
        self._emit(out, "content", self._buf)
        self._buf = ""


def content_format(kind: str, text: str) -> dict:
    """A constraint (kind, text as inferd/engine/structured.py takes it) as an xgrammar structural-tag format."""
    if kind == "json":
        return {"type": "json_schema", "json_schema": json.loads(text), "max_whitespace_cnt": JSON_MAX_WHITESPACE}
    if kind == "json_object":
        return {"type": "json_schema", "json_schema": json.loads(JSON_OBJECT_SCHEMA),
                "max_whitespace_cnt": JSON_MAX_WHITESPACE}
    if kind in ("json_compact", "json_object_compact"):  # the structural tag's json_schema has no compact option
        import xgrammar

        schema = JSON_OBJECT_SCHEMA if kind.startswith("json_object") else text
        return {"type": "grammar", "grammar": str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))}
    if kind == "regex":
        return {"type": "regex", "pattern": text}
    if kind == "grammar":
        return {"type": "grammar", "grammar": text}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in parse_choices(text)]}
    if kind == "structural_tag":
        return json.loads(text)["format"]
    raise ValueError(f"unknown constraint kind {kind!r}")


def constraint_after_reasoning(kind: str, text: str, parser: str) -> tuple[str, str]:
    """The constraint (kind, text) moved after the thinking: a structural tag whose first element is the thinking
    (any text, then ``</think>`` and a little whitespace; for qwen3 optional and opened by ``<think>``, for
    deepseek_r1 opened by the prompt), then what the constraint asked for. ValueError for a constraint that cannot
    be written so."""
    thinking = {"type": "sequence", "elements": [
        {"type": "tag", "begin": "" if parser == "deepseek_r1" else THINK_START, "content": {"type": "any_text"},
         "end": THINK_END},
        {"type": "regex", "pattern": _GAP_PATTERN}]}
    if parser == "qwen3":  # thinking only if the model opens it: it may answer at once
        thinking = {"type": "optional", "content": thinking}
    elements = [thinking, content_format(kind, text)]
    return "structural_tag", json.dumps({"type": "structural_tag",
                                         "format": {"type": "sequence", "elements": elements}})
