"""Tokenizer wrapper: safe encoding, chat templates without special-token injection, incremental detokenization.

GGUF tokenizers are converted by transformers (slow, ~4.5 s) and cached with ``save_pretrained`` under
``$INFERD_CACHE_DIR`` (default ``~/.cache/inferd``), keyed by the GGUF file's absolute path, size and mtime.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .chat_template import SEGMENTS_CACHE_SIZE as _SEGMENTS_CACHE_SIZE
from .chat_template import TEMPLATE_TEXT_MAX_CHARS as _TEMPLATE_TEXT_MAX_CHARS
from .chat_template import conversation_shape as _conversation_shape
from .chat_template import template_traits as _template_traits

__all__ = [
    "IncrementalDetokenizer", "TextWithStops", "Tokenizer", "cache_dir", "gguf_tokenizer_cache_path", "load_tokenizer",
]

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 1
_META_FILE = "inferd_tokenizer.json"
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _dedup(ids: Iterable[int | None]) -> list[int]:
    """Ids in first-seen order, without None and repeats."""
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


# --------------------------------------------------------------------------------------------------------------------
# loading and caching


def cache_dir() -> Path:
    """Root of inferd's cache: $INFERD_CACHE_DIR, else ~/.cache/inferd."""
    root = os.environ.get("INFERD_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "inferd"


def _gguf_cache_key(path: str) -> str:
    import tokenizers
    import transformers

    st = os.stat(path)
    raw = "\n".join(
        [
            os.path.abspath(path),
            str(st.st_size),
            str(st.st_mtime_ns),
            f"transformers={transformers.__version__}",
            f"tokenizers={tokenizers.__version__}",
            f"format={_CACHE_FORMAT}",
        ]
    )
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:40]


def gguf_tokenizer_cache_path(path: str | os.PathLike[str]) -> Path:
    """Folder where the converted tokenizer of GGUF file `path` is (or would be) cached."""
    return cache_dir() / "tokenizers" / _gguf_cache_key(os.path.abspath(os.fspath(path)))


_LAZY_IMPORT = threading.Lock()


def auto_tokenizer():
    """transformers.AutoTokenizer. Its lazy module resolves names unsafely from two threads at once (one of them
    gets an ImportError): the API process loads its tokenizers on threads side by side, so they resolve it here."""
    with _LAZY_IMPORT:
        from transformers import AutoTokenizer
    return AutoTokenizer


def _from_folder(folder: str) -> Any:
    """AutoTokenizer.from_pretrained(folder), through the class it picked last time when the folder is unchanged
    (tokenizer_class.py: the AutoTokenizer import costs the API process a torch import at every start)."""
    from .tokenizer_class import remember_class, remembered_class

    with _LAZY_IMPORT:  # importing the class's module resolves transformers' lazy names too
        cls = remembered_class(cache_dir(), folder)
    if cls is not None:
        return cls.from_pretrained(folder)
    hf = auto_tokenizer().from_pretrained(folder)
    remember_class(cache_dir(), folder, hf)
    return hf


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load the tokenizer of a HF model folder or of a .gguf file (converted once, then cached)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        hf = _from_folder(path)
        config_eos: list[int] = []
        config_file = os.path.join(path, "config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
            config_eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        from .loader import generation_config_eos_ids  # here: the loader imports torch, the API process need not

        return Tokenizer(hf, eos_token_ids=generation_config_eos_ids(path) + config_eos, name_or_path=path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer path {path} does not exist")
    if not path.lower().endswith(".gguf"):
        raise ValueError(f"tokenizer path {path} is neither a model folder nor a .gguf file")

    cached = gguf_tokenizer_cache_path(path)
    damaged = False
    if (cached / _META_FILE).is_file():
        try:
            with open(cached / _META_FILE, encoding="utf-8") as f:
                meta = json.load(f)
            hf = _from_folder(str(cached))
            return Tokenizer(hf, eos_token_ids=meta["eos_token_ids"], name_or_path=path)
        except Exception:  # a damaged cache entry: convert again and replace it
            logger.warning("ignoring unreadable tokenizer cache %s", cached, exc_info=True)
            damaged = True

    hf = auto_tokenizer().from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    from .loader import read_gguf_metadata  # here: the loader imports torch, the API process need not

    fields = read_gguf_metadata(path).fields
    gguf_eos = _dedup(fields.get(key) for key in _GGUF_EOS_KEYS)
    _write_cache(cached, hf, {"eos_token_ids": gguf_eos, "source": path}, replace=damaged)
    return Tokenizer(hf, eos_token_ids=gguf_eos, name_or_path=path)


def _write_cache(target: Path, hf: Any, meta: dict[str, Any], replace: bool = False) -> None:
    """Save `hf` into `target` atomically: write a temp folder next to it, then rename it into place.

    Readers only ever see a complete entry (or none). If another process got there first its entry is kept, unless
    `replace` is set (the existing entry could not be loaded).
    """
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent)
        hf.save_pretrained(tmp)
        with open(os.path.join(tmp, _META_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f)
        if (target / _META_FILE).is_file() and not replace:
            return  # another process finished first
        if target.exists():  # a damaged or unreadable entry
            shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)  # atomic; fails if another process renamed its copy in meanwhile, which is fine
        tmp = None
    except OSError:
        if not (target / _META_FILE).is_file():
            logger.warning("could not write tokenizer cache %s", target, exc_info=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _plain_tokenizers_backend(hf: Any) -> bool:
    """Whether `hf` is a transformers fast tokenizer whose call is transformers' own, a thin layer over the Rust
    tokenizer (some model classes, e.g. CodeLlama's, override it)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(hf)
    return (
        isinstance(hf, TokenizersBackend) and cls.__call__ is PreTrainedTokenizerBase.__call__
        and all(getattr(cls, name) is getattr(TokenizersBackend, name)
                for name in ("_encode_plus", "set_truncation_and_padding", "backend_tokenizer"))
    )


def _interleave(
    template_pieces: Sequence[str], content_ids: Sequence[int], contents: list[str]
) -> list[tuple[str, bool]]:
    """[(T0, False), (contents[k1], True), (T1, False), ...]: a sentinel render with the contents put back."""
    segments: list[tuple[str, bool]] = [(template_pieces[0], False)]
    for k, t in zip(content_ids, template_pieces[1:]):
        segments += [(contents[k], True), (t, False)]
    return segments


# --------------------------------------------------------------------------------------------------------------------
# the tokenizer


class Tokenizer:
    """A HF tokenizer plus the stop set, injection-safe encoding and chat templating.

    Encoding goes through a lock because transformers toggles a flag on the shared Rust tokenizer to implement
    ``split_special_tokens``; use the methods here (not ``hf`` directly) from concurrent threads.
    """

    def __init__(self, hf: Any, eos_token_ids: Iterable[int] = (), name_or_path: str | None = None):
        self.hf = hf
        self.name_or_path = name_or_path
        self.eos_token_ids: list[int] = _dedup([*eos_token_ids, hf.eos_token_id])
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)
        self._lock = threading.RLock()
        added = hf.added_tokens_decoder  # id -> AddedToken
        self._special_tokens = {tok.content: (i, tok) for i, tok in added.items() if tok.special}
        self._special_ids = {i for i, _ in self._special_tokens.values()}
        contents = sorted(self._special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, contents))) if contents else None
        # Message contents are replaced by "inferd<nonce>s<k>e" sentinels to render a chat template without them
        # (see _render_segments). One nonce per Tokenizer, drawn at random (64 bits) when the process loads it, lets
        # the split regex be compiled once instead of per request, and is as safe as one per request: what keeps
        # sentinels unambiguous is that a conversation containing the nonce (in any field) never uses it, but gets
        # a one-off nonce, exactly as a per-request nonce was redrawn; so knowing the nonce (a template that mangles
        # sentinels, like `| upper`, can print it) gains a client nothing but that slower path.
        self._nonce = secrets.token_hex(8)
        self._sentinel_re = re.compile(f"inferd{self._nonce}s(\\d+)e")
        # template variables HF passes to every render besides messages & co (bos_token, eos_token, ...)
        self._template_variables = frozenset(hf.special_tokens_map)
        # (template, add_generation_prompt, messages less their contents) -> (template pieces, content order); only
        # for templates proven to place contents verbatim and to render deterministically (_template_traits)
        self._segments_cache: dict[tuple[Any, ...], tuple[tuple[str, ...], tuple[int, ...]]] = {}
        self._distrusted_templates: set[str] = set()
        self._direct_encoding = _plain_tokenizers_backend(hf)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"

    def contains_special_text(self, text: str) -> bool:
        """Whether text holds a special token's literal text (e.g. "<|im_end|>"): text that a template prints outside
        message contents (tools, tool-call arguments) would be tokenized into that special token."""
        return self._special_re is not None and self._special_re.search(text) is not None

    def special_token_ids(self, texts: Iterable[str]) -> dict[str, int]:
        """{text: id} for those of texts that are special tokens of this tokenizer (tool-call and channel markers
        that the text of an output must keep: IncrementalDetokenizer's keep_special_ids)."""
        return {t: self._special_tokens[t][0] for t in texts if t in self._special_tokens}

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):  # named templates
            template = template.get("default")
        return template or None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize user text; text that looks like a special token is encoded as plain text."""
        return self._encode_plain(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def _encode_plain(self, text: str, add_special_tokens: bool = False) -> list[int]:
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True))

    # ---- chat template

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Render the chat template and tokenize it without adding special tokens again.

        Special tokens written by the template become special ids; special-token-looking text inside message
        contents never does. For ordinary messages the result equals ``hf.apply_chat_template(..., tokenize=True)``.
        """
        if kwargs.get("chat_template") is None and self.chat_template is None:
            raise ValueError(
                f"the tokenizer of {self.name_or_path or 'this model'} has no chat template; "
                "use the completions API (raw prompt) or pass chat_template="
            )
        segments = self._render_segments(messages, add_generation_prompt, kwargs)
        full = "".join([text for text, _ in segments])
        spans: list[tuple[int, int]] = []
        pos = 0
        for text, is_content in segments:
            if is_content and text:
                spans.append((pos, pos + len(text)))
            pos += len(text)

        if getattr(self.hf, "is_fast", False):
            # Usual case: tokenize the whole string like HF does (exact parity, including across template/content
            # boundaries), then check that no special token came from message content.
            ids, offsets = self._encode_with_offsets(full)
            special_ids = self._special_ids
            if spans:
                starts = [s for s, _ in spans]
                for i in [i for i, token_id in enumerate(ids) if token_id in special_ids]:
                    s, e = offsets[i]
                    k = bisect.bisect_right(starts, s) - 1  # last content span starting at or before s
                    if (k >= 0 and s < spans[k][1]) or (k + 1 < len(spans) and spans[k + 1][0] < e):
                        return self._encode_segments(segments)  # content would inject a special token
            return ids
        return self._encode_segments(segments)

    def _encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of `text`, special tokens parsed, none added: what
        ``hf(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=False)`` returns, from
        the Rust tokenizer directly (that call costs as much again in Python). Fast tokenizers only."""
        if not self._direct_encoding:
            with self._lock:
                enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=False)
            return list(enc["input_ids"]), enc["offset_mapping"]
        backend = self.hf.backend_tokenizer
        with self._lock:
            # the settings transformers makes before every call (it leaves them set after, for the next call to reset)
            if backend.truncation is not None:
                backend.no_truncation()
            if backend.padding is not None:
                backend.no_padding()
            if backend.encode_special_tokens:
                backend.encode_special_tokens = False
            enc = backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def _render_segments(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> list[tuple[str, bool]]:
        """The rendered chat as (text, is_message_content) pieces.

        Renders once with every message content replaced by a unique alphanumeric sentinel (so the template's own
        text is known exactly) and once with the real contents (so template filters like ``| trim`` are honoured).

        Fewer renders when `_template_traits` proves that the template only ever prints contents verbatim, without
        otherwise looking at them (ChatML templates like SmolLM2's and Qwen2's; not Llama 3's ``| trim``): then the
        real render is always the sentinel render with the contents put back, so it is not made. If the template also
        renders deterministically, the split sentinel render depends only on the conversation's shape (the messages
        less their contents, add_generation_prompt), so it is cached per shape and a conversation of a known shape is
        not rendered at all. A shape is cached after both renders agreed on it (as they must); if they ever disagree,
        the proof was wrong and the template is rendered twice from then on.
        """
        opaque = cacheable = False
        if kwargs.keys() <= {"chat_template"}:  # no tools, documents, continue_final_message, template variables
            template = self.hf.get_chat_template(kwargs.get("chat_template"))
            if template not in self._distrusted_templates:
                opaque, deterministic = _template_traits(template, self._template_variables)
                cacheable = opaque and deterministic
        key = None
        if cacheable and type(add_generation_prompt) is bool:
            shape = _conversation_shape(messages)
            if shape is not None:
                key = (template, add_generation_prompt, shape)
                hit = self._segments_cache.get(key)
                if hit is not None:  # every content is a str (in the shape's message order)
                    return _interleave(hit[0], hit[1], [m["content"] for m in messages if "content" in m])

        contents: list[str] = []
        nonce, sentinel_re = self._nonce, self._sentinel_re
        if any(nonce in str(m) for m in messages):  # the conversation contains the nonce: use a one-off one
            while any(nonce in str(m) for m in messages):
                nonce = secrets.token_hex(8)
            sentinel_re = re.compile(f"inferd{nonce}s(\\d+)e")

        def sentinel(text: str) -> str:
            contents.append(text)
            return f"inferd{nonce}s{len(contents) - 1}e"

        masked = []
        for message in messages:
            m = dict(message)
            content = m.get("content")
            if isinstance(content, str):
                m["content"] = sentinel(content)
            elif isinstance(content, list):  # OpenAI-style parts
                opaque = False  # proven for string contents only
                parts = []
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        part = {**part, "text": sentinel(part["text"])}
                    parts.append(part)
                m["content"] = parts
            masked.append(m)

        rendered_masked = self._render(masked, add_generation_prompt, kwargs)
        pieces = sentinel_re.split(rendered_masked)  # [T0, k1, T1, k2, ..., Tn]
        template_pieces = pieces[0::2]
        content_ids = [int(k) for k in pieces[1::2]]

        plain = _interleave(template_pieces, content_ids, contents)
        if len(rendered_masked) > _TEMPLATE_TEXT_MAX_CHARS:
            key = None  # too long to cache
        if opaque and key is None:
            return plain
        rendered = self._render(messages, add_generation_prompt, kwargs)
        if "".join([text for text, _ in plain]) == rendered:
            if key is not None:
                if len(self._segments_cache) >= _SEGMENTS_CACHE_SIZE:
                    try:  # forget the oldest shape
                        del self._segments_cache[next(iter(self._segments_cache))]
                    except (KeyError, RuntimeError, StopIteration):  # another thread got there first
                        pass
                self._segments_cache[key] = (tuple(template_pieces), tuple(content_ids))
            return plain
        if opaque:  # cannot happen if _template_traits is right; if it is not, stop trusting it for this template
            logger.warning("chat template analysis failed: a template renders contents differently; not caching")
            self._distrusted_templates.add(template)

        # The template transforms contents (e.g. Llama 3's `content | trim`): find each one's rendered form.
        segments: list[tuple[str, bool]] = [(template_pieces[0], False)]
        pos = len(template_pieces[0])
        ok = rendered.startswith(template_pieces[0])
        for k, t in zip(content_ids, template_pieces[1:]):
            if not ok:
                break
            c = contents[k]
            for candidate in dict.fromkeys((c, c.strip(), c.rstrip(), c.lstrip())):
                if rendered.startswith(candidate + t, pos):
                    segments += [(candidate, True), (t, False)]
                    pos += len(candidate) + len(t)
                    break
            else:
                ok = False
        if ok and pos == len(rendered):
            return segments
        logger.warning("chat template transforms message contents unpredictably; tokenizing them untransformed")
        return plain

    def encode_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """Tokenize (text, is_content) pieces rendered by something other than the chat template (harmony): template
        text with its special tokens parsed, content text with them split."""
        return self._encode_segments(segments)

    def _encode_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """Tokenize template text with its special tokens parsed and content text with them split."""
        ids: list[int] = []
        buf: list[str] = []
        strip_next = False  # the previous special token eats whitespace on its right (AddedToken.rstrip)

        def flush() -> None:
            text = "".join(buf)
            buf.clear()
            if text:
                ids.extend(self._encode_plain(text))

        for text, is_content in segments:
            if is_content or self._special_re is None:
                parts: list[tuple[str, bool]] = [(text, False)]
            else:
                parts, last = [], 0
                for m in self._special_re.finditer(text):
                    parts += [(text[last : m.start()], False), (m.group(0), True)]
                    last = m.end()
                parts.append((text[last:], False))
            for part, is_special in parts:
                if not is_special:
                    if strip_next and part:
                        part = part.lstrip()
                        strip_next = not part
                    buf.append(part)
                    continue
                token_id, token = self._special_tokens[part]
                if getattr(token, "lstrip", False) and buf:
                    buf[:] = ["".join(buf).rstrip()]
                flush()
                ids.append(token_id)
                strip_next = bool(getattr(token, "rstrip", False))
        flush()
        return ids


# --------------------------------------------------------------------------------------------------------------------
# incremental detokenization


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Decodes a small window of preceding tokens together with the new ones and emits only the new characters
    (the prefix_offset/read_offset technique of vLLM and TGI), so leading spaces come out right; holds text back while
    it ends with U+FFFD (an incomplete UTF-8 character). Call :meth:`flush` at the end of generation to emit text
    still held back (only ever invalid UTF-8). ``"".join(add(...) outputs) + flush()`` equals
    ``tokenizer.decode(generated_ids, skip_special_tokens)``.
    """

    _PROMPT_CONTEXT = 5  # prompt tokens decoded along with the first generated ones
    _COMPACT_AT = 64  # drop token ids before the window once this many have piled up

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 keep_special_ids: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # special tokens written out all the same (markers a tool-call or channel parser reads: api/tools.py)
        self.keep_special_ids = keep_special_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = list(prompt_ids[-(self._PROMPT_CONTEXT + 1) :]) if len(prompt_ids) else []
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - self._PROMPT_CONTEXT, 0)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._chunks: list[str] = []
        self._text: str | None = ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        keep = self.keep_special_ids
        if not keep or keep.isdisjoint(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        pieces, run = [], []
        for i in ids:
            if i in keep:
                pieces += [self.tokenizer.decode(run, skip_special_tokens=True) if run else "",
                           self.tokenizer.decode([i], skip_special_tokens=False)]
                run = []
            else:
                run.append(i)
        pieces.append(self.tokenizer.decode(run, skip_special_tokens=True) if run else "")
        return "".join(pieces)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text is None:
            self._text = "".join(self._chunks)
        return self._text

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Feed generated token ids; return the newly completed text ("" if nothing is complete yet)."""
        if len(new_token_ids):
            self._ids.extend(int(i) for i in new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete/invalid UTF-8 tail, as U+FFFD); call when generation ends."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if len(self._ids) == self._read_offset:
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if self._prefix_offset >= self._COMPACT_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._chunks.append(delta)
        self._text = None
        return delta


class TextWithStops:
    """Incremental text of one request, holding back what could still become a stop string. The engine (to stop at
    once) and the API process (to emit text that never contains a stop string) run the same logic."""

    def __init__(self, detokenizer: IncrementalDetokenizer, stops: list[str]):
        self.detok = detokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # decoded so far
        self.emitted = 0  # characters of text already sent

    def add(self, token_ids: list[int], final: bool) -> tuple[str, str | None]:
        """Returns (new text to emit, the stop string matched or None)."""
        start = max(0, len(self.text) - self.hold)
        self.text += self.detok.add(token_ids)
        if final:
            self.text += self.detok.flush()  # an incomplete UTF-8 tail is emitted as the tokenizer decodes it
        matches = [(i, s) for s in self.stops if (i := self.text.find(s, max(0, start - len(s)))) != -1]
        if matches:
            i, s = min(matches)  # the earliest stop string in the text wins
            self.text = self.text[:i]
            out = self.text[self.emitted:]
            self.emitted = len(self.text)
            return out, s
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out, None
