"""gpt-oss's harmony format, through OpenAI's `openai-harmony` package: the conversation rendered to prompt tokens
(`render_prompt`) and the model's output split by channel (`HarmonyParser`: its StreamableParser): ``analysis`` is
reasoning (message.reasoning_content), ``final`` content, ``commentary`` addressed ``to=functions.NAME`` a tool call
of NAME (a function of the request; otherwise, like commentary without a recipient, content).

Chosen with ``--reasoning-parser harmony`` or ``--tool-call-parser harmony``, or by itself for a model whose chat
template writes harmony (``<|channel|>``, ``<|start|>``: gpt-oss's); then it is both the reasoning and the tool-call
parser, and harmony (not the chat template) renders the prompt.

Offline vocabulary. openai-harmony reads the o200k vocabulary (``o200k_base.tiktoken``) from a folder named by
TIKTOKEN_ENCODINGS_BASE, checking its SHA-256, and else downloads it. `prepare` makes the folder without a network:
$INFERD_CACHE_DIR/tiktoken, the file written from the model's own tokenizer (gpt-oss's is o200k, its first 199998
tokens are the file's ranks; the hash proves the conversion), unless the operator set TIKTOKEN_ENCODINGS_BASE.

Any tokenizer. The prompt is harmony's tokens when the model's tokenizer is o200k_harmony (gpt-oss's); otherwise the
same text tokenized by the model's tokenizer (harmony's markers as its special tokens where it has them; message
contents never become special tokens). The output is read as text that keeps the markers (their special tokens are
kept when detokenizing), encoded again for the StreamableParser, so a model of any vocabulary is parsed; a tail that
could still be a marker is held back, so any chunking gives one result. Output that breaks the format (the parser
raises) is content from there on, as written: nothing is dropped, nothing fails.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..config import TOOL_CALL_MAX_HEAD_CHARS
from ..models.tokenizer import cache_dir
from .tools import ToolCall, new_call_id

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
_MARKER_RE = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # what openai-harmony checks
VOCAB_RANKS = 199998  # o200k_base's ordinary tokens (gpt-oss's ids 0..199997)
EFFORTS = ("low", "medium", "high")  # reasoning_effort (harmony's system message; default medium)


class HarmonyUnavailable(RuntimeError):
    """The o200k vocabulary could not be found or made: harmony cannot be used."""


def is_harmony_template(template: str | None) -> bool:
    return bool(template) and "<|channel|>" in template and "<|start|>" in template


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (a printable character per byte, as byte-level BPE vocabularies write tokens)
    back to bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def vocab_file_from(vocab: dict[str, int]) -> bytes | None:
    """o200k_base.tiktoken's bytes from a byte-level BPE vocabulary (token text -> id, as a tokenizer.json holds
    it), if that vocabulary is o200k's (checked against the file's hash); else None."""
    decode = _byte_decoder()
    by_id: dict[int, bytes] = {}
    for text, i in vocab.items():
        if i < VOCAB_RANKS:
            try:
                by_id[i] = bytes(decode[c] for c in text)
            except KeyError:  # not byte-level
                return None
    if len(by_id) != VOCAB_RANKS:
        return None
    data = b"".join(base64.b64encode(by_id[i]) + b" " + str(i).encode() + b"\n" for i in range(VOCAB_RANKS))
    return data if hashlib.sha256(data).hexdigest() == VOCAB_SHA256 else None


def prepare(tokenizer: Any) -> None:
    """Makes openai-harmony's vocabulary available offline (see the module's docstring); HarmonyUnavailable when
    it cannot be."""
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        return
    folder = cache_dir() / "tiktoken"
    path = folder / VOCAB_FILE
    if not path.is_file():
        hf = getattr(tokenizer, "hf", None)
        data = vocab_file_from(hf.get_vocab()) if hf is not None else None
        if data is None:
            raise HarmonyUnavailable(
                f"the harmony format needs the o200k vocabulary ({VOCAB_FILE}) and this model's tokenizer is not "
                f"o200k: put the file in {folder} or in a folder named by TIKTOKEN_ENCODINGS_BASE")
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".vocab-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: another process reads a whole file or none
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)


@functools.cache
def encoding():
    """openai-harmony's gpt-oss encoding (after `prepare`)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:
        raise HarmonyUnavailable(f"openai-harmony cannot load its vocabulary: {e}") from None


def same_vocabulary(tokenizer: Any) -> bool:
    """Whether the model's tokenizer is o200k_harmony (gpt-oss's): harmony's token ids are the model's."""
    enc = encoding()
    markers = tokenizer.special_token_ids(MARKERS)
    if any(markers.get(m) != enc.encode(m, allowed_special="all")[0] for m in MARKERS):
        return False
    sample = "Hello, world! 12345 — ünïcödé\n  code()"
    return tokenizer.encode(sample, add_special_tokens=False) == _ordinary(enc, sample)


def _ordinary(enc, text: str) -> list[int]:
    """text's tokens, special-token text in it as ordinary text."""
    return enc.encode(text, allowed_special=set(), disallowed_special=())


# ---- the prompt --------------------------------------------------------------------------------------------------
def _conversation(messages: list[dict[str, Any]], tools: list[dict] | None, effort: str | None):
    """harmony's Conversation of OpenAI-style messages (role, content, name, tool_calls, tool_call_id): system and
    developer messages become the developer message's instructions, tools its function tools; an assistant's tool
    call a commentary message to functions.NAME, a tool result a message from functions.NAME."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    system = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize() if effort else "Medium"))
    instructions = "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "developer") and m["content"])
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools([
                ToolDescription.new(t["function"]["name"], t["function"].get("description") or "",
                                    parameters=t["function"].get("parameters")) for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, content))
        elif role == "assistant":
            if content:
                out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
            for c in m.get("tool_calls") or []:
                name, arguments = c["function"]["name"], c["function"].get("arguments")
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                call_names[c.get("id") or ""] = name
                out.append(Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel("commentary")
                           .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))
        elif role == "tool":
            name = m.get("name") or call_names.get(m.get("tool_call_id") or "", "tool")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), content)
                       .with_channel("commentary").with_recipient("assistant"))
    return Conversation.from_messages(out)


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None,
                  effort: str | None, same_vocab: bool) -> list[int]:
    """The prompt tokens (for the model's tokenizer) of a conversation, ending where the assistant answers."""
    from openai_harmony import Role

    enc = encoding()
    tokens = enc.render_conversation_for_completion(_conversation(messages, tools, effort), Role.ASSISTANT)
    if same_vocab:
        return list(tokens)
    segments, run = [], []  # (text, is_content): markers are template text, the rest is tokenized as plain text
    for t in tokens:
        if enc.is_special_token(t):
            if run:
                segments.append((enc.decode_utf8(run), True))
                run = []
            segments.append((enc.decode_utf8([t]), False))
        else:
            run.append(t)
    if run:
        segments.append((enc.decode_utf8(run), True))
    return tokenizer.encode_segments(segments)


def tool_constraint(tools: list[dict], tool_choice: Any, parallel: bool) -> str:
    """xgrammar's structural tag for harmony's tool calls (its own builder: analysis free, calls by schema)."""
    import xgrammar

    from ..engine.structured import JSON_MAX_WHITESPACE

    tag = xgrammar.get_model_structural_tag("harmony", tools=tools, tool_choice=tool_choice, reasoning="auto",
                                            parallel_tool_calls=parallel, max_whitespace_cnt=JSON_MAX_WHITESPACE)
    return tag.model_dump_json()


def final_constraint(content_format: dict) -> str:
    """A response format for harmony: the analysis free, then the final channel's message constrained."""
    analysis = {"type": "tag", "begin": "<|channel|>analysis<|message|>", "content": {"type": "any_text"},
                "end": "<|end|><|start|>assistant"}
    final = {"type": "tag", "begin": "<|channel|>final<|message|>", "content": content_format,
             "end": ["<|return|>", "<|end|>"]}
    return json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "optional", "content": analysis}, final]}})


# ---- the output --------------------------------------------------------------------------------------------------
@dataclass
class HarmonyParser:
    """Splits generated text (markers kept) into ("reasoning", text), ("content", text) and ("call", ToolCall,
    arguments fragment, first) items as it arrives (see the module's docstring). `names`: the request's functions
    (commentary to another recipient is content); empty: no tools."""
    names: frozenset[str] = frozenset()
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _parser: Any = None
    _broken: bool = False
    _seen: int = 0  # the parser's messages already ended
    _header: str = ""  # text the parser took into a header not followed by a message yet
    _call: ToolCall | None = None  # the call being written (its message not ended yet)

    def __post_init__(self) -> None:
        from openai_harmony import Role, StreamableParser

        self._parser = StreamableParser(encoding(), Role.ASSISTANT)

    def feed(self, text: str, final: bool = False) -> list[tuple]:
        self._buf += text
        keep = 0
        if not final:  # a tail that could still become a marker waits for the rest of it
            keep = next((k for k in range(min(len("<|constrain|>") - 1, len(self._buf)), 0, -1)
                         if any(m.startswith(self._buf[-k:]) for m in MARKERS)), 0)
        ready, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        out: list[tuple] = []
        if ready:
            self._process(ready, out)
        if final and not self._broken:
            try:
                self._parser.process_eos()
            except Exception:  # a message cut off mid-header: nothing more of it to say
                pass
            if len(self._parser.messages) > self._seen:
                self._finished(out)
            self._close_call()
            if self._header:  # a header never followed by a message (plain text, say): content as written
                self._emit(out, "content", self._header)
                self._header = ""
        return out

    def _process(self, text: str, out: list) -> None:
        from openai_harmony import StreamState

        enc = encoding()
        for piece in _MARKER_RE.split(text):
            if not piece:
                continue
            if self._broken:
                self._emit(out, "content", piece)
                continue
            tokens = enc.encode(piece, allowed_special="all") if piece in MARKERS else _ordinary(enc, piece)
            try:
                for t in tokens:
                    self._parser.process(t)
                    delta = self._parser.last_content_delta
                    if delta:
                        self._route(out, delta)
                    if len(self._parser.messages) > self._seen:
                        self._finished(out)
            except Exception:  # not harmony from here on (it breaks at a piece's start): content as written
                self._break(out, piece)
                continue
            self._header = self._header + piece if self._parser.state == StreamState.HEADER else ""
            if len(self._header) > TOOL_CALL_MAX_HEAD_CHARS:  # no message begins: not harmony, content as written
                self._break(out, "")

    def _break(self, out: list, piece: str) -> None:
        """The output left the format: what the parser took without a message (a header) and the rest is
        content."""
        self._broken = True
        self._close_call()
        self._emit(out, "content", self._header + piece)
        self._header = ""

    def _route(self, out: list, delta: str) -> None:
        p = self._parser
        channel = p.current_channel
        name = self._function(p.current_recipient)
        if channel == "analysis":
            self._emit(out, "reasoning", delta)
        elif channel == "commentary" and name is not None:
            self._open_call(out, name)
            self._call.arguments += delta
            out.append(("call", self._call, delta, False))
        else:
            self._emit(out, "content", delta)

    def _function(self, recipient: str | None) -> str | None:
        """NAME of a recipient functions.NAME that is one of the request's functions."""
        if recipient and recipient.startswith("functions.") and recipient[len("functions."):] in self.names:
            return recipient[len("functions."):]
        return None

    def _open_call(self, out: list, name: str) -> None:
        if self._call is None:
            self._call = ToolCall(len(self.calls), new_call_id(), name)
            self.calls.append(self._call)
            out.append(("call", self._call, "", True))

    def _finished(self, out: list) -> None:
        """A message ended: a call of it with no arguments written yet is opened now; the call is closed."""
        message = self._parser.messages[-1]
        self._seen = len(self._parser.messages)
        name = self._function(message.recipient)
        if message.channel == "commentary" and name is not None and self._call is None:
            self._open_call(out, name)
        self._close_call()

    def _close_call(self) -> None:
        if self._call is not None:
            self._call.done = True
            self._call = None

    def _emit(self, out: list, channel: str, text: str) -> None:
        if not text:
            return
        if channel == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        if out and out[-1][0] == channel:
            out[-1] = (channel, out[-1][1] + text)
        else:
            out.append((channel, text))

    def result(self) -> tuple[str | None, list[dict]]:
        """(content, tool calls) once everything was fed (final=True); content None when there is none."""
        return self.content or None, [c.as_dict() for c in self.calls]

