"""A chat request's `chat_template_kwargs` (vLLM's extension): extra variables for the chat template, e.g.
``{"enable_thinking": false}`` for Qwen3. They reach the template as HF's apply_chat_template passes its keyword
arguments, so a name that would change the rendering itself (messages, tools, tokenize, ...) is refused, as are
values the template would print with a special token's text (outside the message contents, so they would become
that token), and oversized or deeply nested ones (CHAT_TEMPLATE_KWARGS_MAX_CHARS, _MAX_DEPTH)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from ..config import CHAT_TEMPLATE_KWARGS_MAX_CHARS, CHAT_TEMPLATE_KWARGS_MAX_DEPTH
from .errors import invalid

PARAM = "chat_template_kwargs"
# apply_chat_template's own parameters and the variables the renderer sets itself: not the client's to set
RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "raise_exception", "strftime_now",
})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_BOOLEANS = ("enable_thinking", "thinking")  # the switches templates test with `is false`: a string would be truthy


def check_template_kwargs(kwargs: dict[str, Any] | None, contains_special_text: Callable[[str], bool] | None
                          ) -> dict[str, Any]:
    """The kwargs to pass to the chat template ({} for none), or a 400 naming chat_template_kwargs."""
    if not kwargs:
        return {}
    for key in kwargs:
        if not _NAME.fullmatch(key):
            raise invalid(f"{PARAM}: {key[:80]!r} is not a template variable name (letters, digits, _; at most 64)",
                          param=PARAM)
        if key in RESERVED:
            raise invalid(f"{PARAM}: {key!r} is set by the server, not by chat_template_kwargs", param=PARAM)
    for key in _BOOLEANS:
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise invalid(f"{PARAM}.{key} must be a boolean, got {type(kwargs[key]).__name__}", param=PARAM)
    depth = _depth(kwargs)
    if depth > CHAT_TEMPLATE_KWARGS_MAX_DEPTH:
        raise invalid(f"{PARAM} is nested more than {CHAT_TEMPLATE_KWARGS_MAX_DEPTH} levels deep "
                      "(CHAT_TEMPLATE_KWARGS_MAX_DEPTH)", param=PARAM)
    text = json.dumps(kwargs, ensure_ascii=False)
    if len(text) > CHAT_TEMPLATE_KWARGS_MAX_CHARS:
        raise invalid(f"{PARAM} has {len(text)} characters as JSON, over the limit of {CHAT_TEMPLATE_KWARGS_MAX_CHARS} "
                      "(CHAT_TEMPLATE_KWARGS_MAX_CHARS)", param=PARAM)
    if contains_special_text is not None and contains_special_text(text):
        raise invalid(f"{PARAM} must not contain the text of the model's special tokens", param=PARAM)
    return dict(kwargs)


def _depth(value: Any) -> int:
    """Levels of nesting of a JSON value (a dict of scalars: 1), counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
        else:
            deepest = max(deepest, d)
            continue
        deepest = max(deepest, d + 1)
        if deepest > CHAT_TEMPLATE_KWARGS_MAX_DEPTH:
            return deepest
    return deepest
