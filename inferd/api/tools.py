"""Tool calling: rendering tools into the prompt, constraining the calls, and parsing them back out (also while
streaming).

A tool-call format says how a model writes a call. Two are known (`--tool-call-parser`):
- ``hermes``: ``<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen2.5/Qwen3);
- ``llama3_json``: ``{"name": "NAME", "parameters": {...}}`` (Llama 3.1/3.2).
The calls are constrained with xgrammar's structural tag for the format: with ``auto`` the text is free until the
model opens a call, and the call itself then follows the function's parameters schema; with ``required`` at least one
call is made; with a named function exactly that call. So the arguments of every call that completes validate against
its parameters. ``none`` renders the tools but neither constrains nor parses.

A model whose chat template knows tools gets them through the template (``tools=``); one whose template does not
(the default SmolLM2) gets FALLBACK_SYSTEM_PROMPT (a hermes-format instruction listing the tools) in its system
message, its earlier assistant tool calls written out in the hermes format, and tool results as user messages in
``<tool_response>`` tags (Hermes' own convention).

The parser is one incremental state machine fed the text as it is generated; a non-streamed response feeds it all
at once, so streamed deltas always assemble to the non-streamed answer.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..config import TOOL_CALL_PARSERS  # noqa: F401 (the names of FORMATS)
from ..engine.structured import JSON_MAX_WHITESPACE


@dataclass(frozen=True)
class ToolFormat:
    name: str
    xgrammar_model: str  # xgrammar's structural tag builder for this format
    trigger: str  # the text that opens a call
    prefix: str  # a call's start up to the function's name: PREFIX NAME MIDDLE ARGUMENTS TAIL
    middle: str  # between the name and the arguments object
    tail: str  # what closes a call after its arguments object
    separator: str  # between two calls when the output is calls only (tool_choice required)
    filler: str  # characters around calls that are not content (dropped when a call follows or precedes them)


FORMATS = {
    "hermes": ToolFormat("hermes", "qwen_3", "<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ',
                         "}\n</tool_call>", "\n", " \t\r\n"),
    "llama3_json": ToolFormat("llama3_json", "llama", '{"name": ', '{"name": "', '", "parameters": ', "}", "; ",
                              " \t\r\n;"),
}


@lru_cache(maxsize=None)
def _head(fmt: ToolFormat) -> re.Pattern:
    """A call's start up to its arguments, capturing the function's name."""
    return re.compile(re.escape(fmt.prefix) + r'([^"\\]+)' + re.escape(fmt.middle))

FALLBACK_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>")


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def default_parser(template: str | None) -> str:
    """The format a template's model writes: Llama 3's python tag / ipython role, else hermes (also the
    fallback's)."""
    if template and ("<|python_tag|>" in template or "ipython" in template) and "<tool_call>" not in template:
        return "llama3_json"
    return "hermes"


def _arguments_value(arguments: Any) -> Any:
    """A history's call arguments for a template: the JSON object (templates apply `tojson`), or the text as is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def render_messages(messages: list[dict[str, Any]], tools: list[dict] | None, native: bool
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, apply_chat_template kwargs) for a conversation that may hold tools, assistant tool calls and tool
    results. messages: dicts with role, content (str) and optionally name, tool_calls, tool_call_id."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": _arguments_value(c["function"].get("arguments"))}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        role = m["role"]
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
            continue
        m = dict(m)
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            written = [f'<tool_call>\n{json.dumps({"name": c["function"]["name"], "arguments": _arguments_value(c["function"].get("arguments"))}, ensure_ascii=False)}\n</tool_call>'
                       for c in calls]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + written)
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = FALLBACK_SYSTEM_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def tool_constraint(fmt: ToolFormat, tools: list[dict], tool_choice: Any, parallel: bool) -> str:
    """The structural tag (JSON text) that constrains the calls: tool_choice 'auto', 'required' or a named
    function ({'type': 'function', 'function': {'name': ...}})."""
    import xgrammar

    tag = xgrammar.get_model_structural_tag(fmt.xgrammar_model, tools=tools,
                                             tool_choice="auto" if tool_choice == "required" else tool_choice,
                                             reasoning=False, parallel_tool_calls=parallel,
                                             max_whitespace_cnt=JSON_MAX_WHITESPACE)
    data = json.loads(tag.model_dump_json())
    if tool_choice == "required":  # calls only, at least one (xgrammar's "required" lets text run on after them)
        data["format"] = {"type": "tags_with_separator", "tags": data["format"]["tags"],
                          "separator": fmt.separator, "at_least_one": True, "stop_after_first": not parallel}
    return json.dumps(data)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""
    done: bool = False

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class _Scan:
    """Where the arguments object of the call being read stands: brace depth, inside a string, after a backslash."""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False

    def feed(self, text: str) -> int:
        """Characters of text that belong to the arguments; len(text) when it has not ended yet."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                self.depth -= 1
                if self.started and self.depth == 0:
                    return i + 1
            elif not self.started and not ch.isspace():
                self.started = True  # a scalar (the grammar allows only objects; be lenient when unconstrained)
        return len(text)


@dataclass
class ToolCallParser:
    """Splits generated text into content and tool calls as it arrives. feed() returns the deltas to send now:
    ("content", text) and ("call", ToolCall, arguments fragment, first) items, first marking a call's opening delta
    (index, id, name)."""
    fmt: ToolFormat
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _state: str = "text"  # text | head | args | tail
    _scan: _Scan = field(default_factory=_Scan)
    _tail_left: str = ""
    _held_space: str = ""  # whitespace not yet sent as content: dropped if a call follows it
    content: str = ""

    def feed(self, text: str, final: bool = False) -> list[tuple]:
        self._buf += text
        out: list[tuple] = []
        while True:
            before = (self._state, len(self._buf))
            if self._state == "text":
                self._text(out, final)
            elif self._state == "head":
                self._head(out, final)
            elif self._state == "args":
                self._args(out)
            elif self._state == "tail":
                self._tail()
            if (self._state, len(self._buf)) == before:
                break
        if final and self._buf:  # an unfinished call (max_tokens): its text stays content, as nothing was sent
            if self._state in ("head",):
                self._emit_text(out, self._buf, final=True)
            self._buf = ""
        if final and self._held_space and not self.calls:
            self._emit(out, self._held_space)
            self._held_space = ""
        return out

    def _emit(self, out: list, text: str) -> None:
        if text:
            self.content += text
            out.append(("content", text))

    def _emit_text(self, out: list, text: str, final: bool = False) -> None:
        """Content, holding whitespace back until something that is not whitespace (or the end) follows it."""
        if not text:
            return
        stripped = text.rstrip(self.fmt.filler)
        if not stripped:
            self._held_space += text
            return
        self._emit(out, self._held_space + stripped)
        self._held_space = text[len(stripped):]

    def _text(self, out: list, final: bool) -> None:
        trigger = self.fmt.trigger
        at = self._buf.find(trigger)
        if at >= 0:
            self._emit_text(out, self._buf[:at])
            self._held_space = ""  # whitespace before a call is not content
            self._buf = self._buf[at:]
            self._state = "head"
            return
        # keep back a tail that could still become the trigger
        keep = 0
        for k in range(min(len(trigger) - 1, len(self._buf)), 0, -1):
            if trigger.startswith(self._buf[-k:]):
                keep = k
                break
        if final:
            keep = 0
        text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        self._emit_text(out, text)

    def _head(self, out: list, final: bool) -> None:
        m = _head(self.fmt).match(self._buf)
        if m is None:
            # not (yet) a call's head: once it can no longer become one, it is text
            if len(self._buf) > 512 or not _could_be_head(self._buf, self.fmt):
                self._emit_text(out, self._buf[:1])
                self._buf = self._buf[1:]
                self._state = "text"
            return
        call = ToolCall(len(self.calls), new_call_id(), m.group(1))
        self.calls.append(call)
        out.append(("call", call, "", True))
        self._buf = self._buf[m.end():]
        self._scan = _Scan()
        self._state = "args"

    def _args(self, out: list) -> None:
        if not self._buf:
            return
        call = self.calls[-1]
        n = self._scan.feed(self._buf)
        piece, self._buf = self._buf[:n], self._buf[n:]
        call.arguments += piece
        if piece:
            out.append(("call", call, piece, False))
        if self._scan.started and self._scan.depth == 0 and not self._scan.in_string:
            call.done = True
            self._state = "tail"
            self._tail_left = self.fmt.tail

    def _tail(self) -> None:
        k = 0
        while k < len(self._buf) and k < len(self._tail_left) and self._buf[k] == self._tail_left[k]:
            k += 1
        self._buf = self._buf[k:]
        self._tail_left = self._tail_left[k:]
        if not self._tail_left or (self._buf and k == 0):
            self._state = "text"  # closed (or the closing text never came: what follows is text again)

    def result(self) -> tuple[str | None, list[dict]]:
        """(content, tool calls) once everything was fed (final=True): content is None when the answer is calls
        only."""
        calls = [c.as_dict() for c in self.calls]
        content = self.content
        if calls and not content.strip(self.fmt.filler):
            return None, calls
        return content, calls


def _could_be_head(buf: str, fmt: ToolFormat) -> bool:
    """Whether buf is a prefix of some call head (a name of any characters but quotes)."""
    if len(buf) <= len(fmt.prefix):
        return fmt.prefix.startswith(buf)
    if not buf.startswith(fmt.prefix):
        return False
    rest = buf[len(fmt.prefix):]
    q = rest.find('"')
    if q < 0:
        return "\\" not in rest
    return fmt.middle.startswith(rest[q:]) or rest[q:].startswith(fmt.middle)
