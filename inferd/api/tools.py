"""Tool calling: rendering tools into the prompt, constraining the calls, and parsing them back out (also while
streaming).

A tool-call format says how a model writes a call. These are known (`--tool-call-parser`):
- ``hermes``: ``<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen2.5/Qwen3);
- ``llama3_json``: ``{"name": "NAME", "parameters": {...}}`` (Llama 3.1/3.2);
- ``mistral``: ``[TOOL_CALLS][{"name": "NAME", "arguments": {...}}, ...]`` (Mistral 7B v0.3, Mixtral), and the newer
  ``[TOOL_CALLS]NAME[ARGS]{...}`` (Mistral Small 3.2, Magistral); the constraint writes the first form, one call per
  ``[TOOL_CALLS]`` (``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens in Mistral's tokenizers: the text keeps them,
  see `marker_tokens`);
- ``harmony``: gpt-oss's channels, parsed by inferd/api/harmony.py, not here.
The calls are constrained with xgrammar's structural tag for the format: with ``auto`` the text is free until the
model opens a call, and the call itself then follows the function's parameters schema; with ``required`` at least one
call is made; with a named function exactly that call. So the arguments of every call that completes validate against
its parameters. ``none`` renders the tools but neither constrains nor parses.

A model whose chat template knows tools gets them through the template (``tools=``); one whose template does not
(the default SmolLM2) gets FALLBACK_SYSTEM_PROMPT (a hermes-format instruction listing the tools) in its system
message, its earlier assistant tool calls written out in the hermes format, and tool results as user messages in
``<tool_response>`` tags (Hermes' own convention).

The parser is one incremental state machine fed the text as it is generated; a non-streamed response feeds it all
at once, so streamed deltas always assemble to the non-streamed answer, however the text is cut into chunks. A
call's arguments are the one JSON value the model wrote, whatever the parameters schema makes it (an object, an
array, a string, a number, true/false/null). It reads what the grammar writes and more (other whitespace in a call's
syntax, a missing or malformed closing tag, text after a call); a call naming a function the request does not have
is text. What is not a call is content, none of it dropped (whitespace next to a call aside).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from ..config import (
    TOOL_CALL_MAX_HEAD_CHARS,
    TOOL_CALL_PARSERS,  # noqa: F401 (the names of FORMATS)
)
from ..engine.structured import JSON_MAX_WHITESPACE

# pieces of a call's syntax (ToolFormat.head / .end): literal text, optional whitespace, the function's name
WS, NAME = "\0ws", "\0name"  # (no literal piece holds a NUL)
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")  # schemas.FunctionName
MAX_NAME = 64


@dataclass(frozen=True)
class ToolFormat:
    name: str
    xgrammar_model: str  # xgrammar's structural tag builder for this format
    head: tuple[str, ...]  # a call's start up to its arguments: head ARGUMENTS end (the first piece opens a call)
    end: tuple[str, ...]  # what closes a call after its arguments (its first non-space piece closes the call's object)
    separator: str  # between two calls when the output is calls only (tool_choice required)
    filler: str  # characters around calls that are not content (dropped when a call follows or precedes them)
    alternatives: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()  # other (head, end) forms, same trigger
    next_head: tuple[str, ...] = ()  # a list of calls: what opens the next call right after one ended (head's form)
    list_end: tuple[str, ...] = ()  # ... and what closes the list
    markers: tuple[str, ...] = ()  # special tokens the text must keep (the tokenizer would drop them)

    @property
    def trigger(self) -> str:
        return self.head[0]


# The grammar writes the exact text (``<tool_call>\n{"name": "f", "arguments": ``); the parser also reads a call
# with other whitespace between the pieces (a compact or a pretty-printed one): a call written any JSON way is a call.
_OBJECT_HEAD = ("{", WS, '"name"', WS, ":", WS, '"', NAME, '"', WS, ",", WS)
FORMATS = {
    "hermes": ToolFormat("hermes", "qwen_3", ("<tool_call>", WS) + _OBJECT_HEAD + ('"arguments"', WS, ":", WS),
                         (WS, "}", WS, "</tool_call>"), "\n", " \t\r\n"),
    "llama3_json": ToolFormat("llama3_json", "llama", _OBJECT_HEAD + ('"parameters"', WS, ":", WS), (WS, "}"),
                              "; ", " \t\r\n;"),
    "mistral": ToolFormat("mistral", "", ("[TOOL_CALLS]", WS, "[", WS) + _OBJECT_HEAD + ('"arguments"', WS, ":", WS),
                          (WS, "}"), "", " \t\r\n",
                          alternatives=((("[TOOL_CALLS]", WS, NAME, "[ARGS]", WS), ()),),
                          next_head=(WS, ",", WS) + _OBJECT_HEAD + ('"arguments"', WS, ":", WS), list_end=(WS, "]"),
                          markers=("[TOOL_CALLS]", "[ARGS]")),
}
DONE, MORE, NO = "done", "more", "no"


def _match(pattern: tuple[str, ...], buf: str, names: frozenset[str] | None = None) -> tuple[str, int, str | None]:
    """Whether buf starts with pattern: (DONE, characters it took, the name), (MORE, 0, None) when buf is a prefix of
    it (whitespace at its end could still run on, so a piece after it must have begun), or (NO, 0, None). With
    `names`, a name outside them is NO."""
    pos, name = 0, None
    for piece in pattern:
        if piece == WS:
            while pos < len(buf) and buf[pos].isspace():
                pos += 1
            if pos == len(buf):
                return MORE, 0, None
        elif piece == NAME:
            end = pos
            while end < len(buf) and buf[end] in NAME_CHARS:
                end += 1
            if end - pos > MAX_NAME or end == pos < len(buf):
                return NO, 0, None
            if end == len(buf):
                return MORE, 0, None
            name = buf[pos:end]
            if names is not None and name not in names:
                return NO, 0, None
            pos = end
        else:
            n = min(len(piece), len(buf) - pos)
            if buf[pos:pos + n] != piece[:n]:
                return NO, 0, None
            if n < len(piece):
                return MORE, 0, None
            pos += n
    return DONE, pos, name


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
            written = ["<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                     "arguments": _arguments_value(c["function"].get("arguments"))},
                                                    ensure_ascii=False) + "\n</tool_call>"
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
    if fmt.xgrammar_model:
        import xgrammar

        tag = xgrammar.get_model_structural_tag(fmt.xgrammar_model, tools=tools,
                                                 tool_choice="auto" if tool_choice == "required" else tool_choice,
                                                 reasoning=False, parallel_tool_calls=parallel,
                                                 max_whitespace_cnt=JSON_MAX_WHITESPACE)
        data = json.loads(tag.model_dump_json())
    else:
        data = _mistral_tag(tools, tool_choice, parallel)
    if tool_choice == "required":  # calls only, at least one (xgrammar's "required" lets text run on after them)
        data["format"] = {"type": "tags_with_separator", "tags": data["format"]["tags"],
                          "separator": fmt.separator, "at_least_one": True, "stop_after_first": not parallel}
    return json.dumps(data)


def _mistral_tag(tools: list[dict], tool_choice: Any, parallel: bool) -> dict:
    """The structural tag of Mistral's calls (xgrammar has no builder for it): ``[TOOL_CALLS][{"name": "NAME",
    "arguments": ARGS}]``, one call per trigger (parallel calls: one trigger after another)."""
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    tags = [{"type": "tag", "begin": '[TOOL_CALLS][{"name": ' + json.dumps(t["function"]["name"]) + ', "arguments": ',
             "content": {"type": "json_schema", "json_schema": t["function"].get("parameters") or {"type": "object"},
                         "max_whitespace_cnt": JSON_MAX_WHITESPACE},
             "end": "}]"}
            for t in tools if named is None or t["function"]["name"] == named]
    if named is not None:
        return {"type": "structural_tag", "format": tags[0]}
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"], "tags": tags,
                                                 "at_least_one": False, "stop_after_first": not parallel}}


def marker_tokens(fmt: ToolFormat, tokenizer: Any) -> frozenset[int]:
    """The ids of the format's markers that are special tokens of this tokenizer (decoding would drop them)."""
    special = getattr(tokenizer, "special_token_ids", lambda _texts: {})(fmt.markers)
    return frozenset(special.values())


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


LITERAL_CHARS = frozenset("0123456789+-.eEtrufalsn")  # what a number, true, false or null is made of


@dataclass
class _Scan:
    """Where the arguments (one JSON value) of the call being read stand: brace depth, inside a string, after a
    backslash, inside a bare literal (a number, true, false, null), ended."""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False
    literal: bool = False
    ended: bool = False

    def feed(self, text: str) -> int:
        """Characters of text that belong to the arguments; len(text) when they have not ended yet."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:  # a string value: it ends with its closing quote
                        self.ended = True
                        return i + 1
                continue
            if self.literal:
                if ch in LITERAL_CHARS:
                    continue
                self.ended = True  # a bare value ends at the first character that cannot continue it
                return i
            if ch == '"':
                self.in_string = self.started = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                if self.depth == 0:  # no value at all (`"arguments": }`): the arguments are empty
                    self.ended = True
                    return i
                self.depth -= 1
                if self.depth == 0:
                    self.ended = True
                    return i + 1
            elif self.depth == 0 and not ch.isspace():
                self.started = self.literal = True
        return len(text)


@dataclass
class ToolCallParser:
    """Splits generated text into content and tool calls as it arrives. feed() returns the deltas to send now:
    ("content", text) and ("call", ToolCall, arguments fragment, first) items, first marking a call's opening delta
    (index, id, name). `names`: the request's functions (a call of any other name is text); None: any name.

    A call is opened once its head is complete (up to the first character of its arguments); its arguments are then
    sent as they arrive, exactly the JSON value the model wrote, until that value ends; the closing text after it is
    dropped. Whatever is not a call's syntax is content (whitespace next to a call is not). Text is held back only
    while it could still be a call's head or end."""
    fmt: ToolFormat
    names: frozenset[str] | None = None
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _state: str = "text"  # text | head | args | end
    _scan: _Scan = field(default_factory=_Scan)
    _held_space: str = ""  # whitespace not yet sent as content: dropped if a call follows it
    _after_call: bool = False  # a call just ended: the whitespace after it is no content either
    _form: int = 0  # which of the format's forms the call being read has (0: head/end, k: alternatives[k - 1])
    content: str = ""

    def feed(self, text: str, final: bool = False) -> list[tuple]:
        self._buf += text
        out: list[tuple] = []
        while True:
            before = (self._state, len(self._buf))
            if self._state == "text":
                self._text(out, final)
            elif self._state == "head":
                self._head(out)
            elif self._state == "args":
                self._args(out)
            elif self._state == "end":
                self._end()
            elif self._state == "next":
                self._next(out)
            if (self._state, len(self._buf)) == before:
                break
        if final and self._buf:
            if self._state == "head":  # cut before its arguments began: nothing of it was sent, it is text
                self._emit_text(out, self._buf)
            # state "end": the end of a complete call was cut off (max_tokens): it is the call's syntax, not text
            self._buf = ""
        if final and self._held_space and not self.calls:
            self._emit(out, self._held_space)
            self._held_space = ""
        return out

    def _emit(self, out: list, text: str) -> None:
        if text:
            self.content += text
            out.append(("content", text))

    def _emit_text(self, out: list, text: str) -> None:
        """Content, holding whitespace back until something that is not whitespace (or the end) follows it, and
        leaving out the whitespace right after a call (kept as a separator only when content came before the
        call)."""
        if self._after_call:
            body = text.lstrip(self.fmt.filler)
            self._held_space += text[:len(text) - len(body)]
            if not body:
                return
            text, self._after_call = body, False
            if not self.content:
                self._held_space = ""
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

    def _head_match(self, heads: list[tuple[str, ...]]) -> tuple[str, int, str | None, int]:
        """The first of heads that matches the buffer: (DONE, characters, name, which); MORE while one still
        could; else NO."""
        more = False
        for which, head in enumerate(heads):
            found, n, name = _match(head, self._buf, self.names)
            if max(n, len(self._buf) if found == MORE else 0) > TOOL_CALL_MAX_HEAD_CHARS:
                found = NO  # (a head that long is text however it arrives, in one piece or many)
            if found == DONE:
                return DONE, n, name, which
            more = more or found == MORE
        return (MORE if more else NO), 0, None, 0

    def _head(self, out: list) -> None:
        found, n, name, form = self._head_match([self.fmt.head] + [h for h, _ in self.fmt.alternatives])
        if found == MORE:
            return
        if found != DONE:  # not a call: its first character is text, and the rest is read again as text
            self._emit_text(out, self._buf[:1])
            self._buf = self._buf[1:]
            self._state = "text"
            return
        self._held_space, self._after_call = "", False  # whitespace before a call is not content
        self._open_call(out, name, n, form)

    def _open_call(self, out: list, name: str | None, n: int, form: int) -> None:
        call = ToolCall(len(self.calls), new_call_id(), name)
        self.calls.append(call)
        out.append(("call", call, "", True))
        self._buf = self._buf[n:]
        self._scan = _Scan()
        self._state = "args"
        self._form = form

    def _args(self, out: list) -> None:
        if not self._buf:
            return
        call = self.calls[-1]
        n = self._scan.feed(self._buf)
        piece, self._buf = self._buf[:n], self._buf[n:]
        call.arguments += piece
        if piece:
            out.append(("call", call, piece, False))
        if self._scan.ended:
            call.done = True
            self._state = "end"

    def _end(self) -> None:
        end = self.fmt.end if self._form == 0 else self.fmt.alternatives[self._form - 1][1]
        found, n, _ = _match(end, self._buf)
        if found == MORE:
            return
        if found == NO:  # not the whole closing text: the call's closing brace (if there) is syntax, the rest text
            closing = next(piece for piece in end if piece != WS)
            found, n, _ = _match((WS, closing), self._buf)
            if found != DONE:
                n = 0
        self._buf = self._buf[n:]
        self._state = "next" if self._form == 0 and self.fmt.next_head else "text"
        self._after_call = True

    def _next(self, out: list) -> None:
        """After a call in a list of calls: the next call of the list, the list's end, or (neither) text."""
        found, n, name, _ = self._head_match([self.fmt.next_head])
        if found == DONE:
            self._open_call(out, name, n, 0)
            return
        closed, m, _ = _match(self.fmt.list_end, self._buf)
        if MORE in (found, closed):
            return
        if closed == DONE:
            self._buf = self._buf[m:]
        self._state = "text"

    def result(self) -> tuple[str | None, list[dict]]:
        """(content, tool calls) once everything was fed (final=True): content is None when the answer is calls
        only."""
        calls = [c.as_dict() for c in self.calls]
        content = self.content
        if calls and not content.strip(self.fmt.filler):
            return None, calls
        return content, calls
