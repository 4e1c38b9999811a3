"""Chat template analysis: when can a chat template be rendered once (or not at all) per request?

The tokenizer renders a template with message contents replaced by sentinels, to know which characters of the
prompt are the template's and which are the user's (user text must never become control tokens). `template_traits`
proves on a template's Jinja syntax tree, conservatively, that the template only prints contents verbatim (then
the real render is the sentinel render with the contents put back: one render instead of two) and that it renders
deterministically (then the sentinel render depends only on the conversation's shape, `conversation_shape`, and can
be cached). Anything the proof does not cover counts as "unsure" and keeps the two-render path.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from typing import Any

# The shape cache: at most this many shapes per Tokenizer, each at most this long (message fields but contents;
# template text), so that clients sending odd shapes (long names, thousands of messages) can't make it big.
SEGMENTS_CACHE_SIZE = 512
SHAPE_MAX_CHARS = 1024
TEMPLATE_TEXT_MAX_CHARS = 8192
# Names a template may read that are not assigned in it: what HF passes to every render (plus the special tokens,
# passed in separately), Jinja's and HF's deterministic globals. Anything else (strftime_now, lipsum, a global a newer
# transformers might add) makes the render possibly non-deterministic, hence not cacheable.
_TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "loop", "raise_exception", "namespace", "dict", "range",
     "cycler", "joiner"}
)
_LOOP_ATTRS = frozenset({"first", "last", "index", "index0", "revindex", "revindex0", "length", "depth", "depth0"})


@functools.lru_cache(maxsize=64)
def template_traits(template: str, variables: frozenset[str] = frozenset()) -> tuple[bool, bool]:
    """(opaque, deterministic) for a chat template; both False when unsure.

    opaque: rendering it with string contents equals rendering it with contents replaced by sentinels, then putting
    the contents back in place of the sentinels, whatever the contents. Proven on the template's syntax tree, very
    conservatively: message data is reachable only through ``messages``, ``for m in messages`` loop variables
    (assigned nowhere else) and a few ``loop`` attributes; a message is only ever read by a constant key that is not
    a dict method; a content is only ever read as an operand of ``+``/``~`` chains of plain strings (constants, other
    message fields, special-token variables, contents) that are printed by a ``{{ }}`` standing at the template's top
    level or inside ``for``/``if`` blocks only (no macro, ``set`` block, filter block, autoescape). So a template
    neither tests, measures, filters nor captures a content: it only concatenates it (into a str, as Python's ``+`` of
    two str or Jinja's ``~`` does), and HF's environment (autoescape off, no finalize) prints it unchanged.

    deterministic: it reads no name but ``_TEMPLATE_NAMES``, `variables` and its own variables, and uses no
    ``random`` filter: rendering the same input twice gives the same text.
    """
    try:
        from jinja2 import nodes
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # parsed as HF's environment does (its {% generation %} tag aside, which makes this fail: unsure)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        tree = env.parse(template)
    except Exception:
        return False, False

    parent: dict[int, tuple[Any, str]] = {}  # id(node) -> (parent node, field of the parent holding it)
    everything = []
    stack: list[Any] = [tree]
    while stack:
        node = stack.pop()
        everything.append(node)
        for field, value in node.iter_fields():
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, nodes.Node):
                    parent[id(child)] = (node, field)
                    stack.append(child)

    names = [n for n in everything if isinstance(n, nodes.Name)]
    stores = Counter(n.name for n in names if n.ctx != "load")
    loop_vars = {
        n.target.name for n in everything
        if isinstance(n, nodes.For) and not n.recursive and isinstance(n.target, nodes.Name)
        and isinstance(n.iter, nodes.Name) and n.iter.name == "messages"
    }

    def is_message(node: Any) -> bool:  # an expression whose value is a message dict
        if isinstance(node, nodes.Name):
            return node.ctx == "load" and node.name in loop_vars
        return (isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name) and node.node.name == "messages"
                and isinstance(node.arg, nodes.Const) and type(node.arg.value) is int)

    def is_plain_string(node: Any) -> bool:  # an expression whose value is a plain str (or it raises, in both renders)
        if isinstance(node, (nodes.Add, nodes.Concat)):
            return all(is_plain_string(child) for child in node.iter_child_nodes())
        if isinstance(node, nodes.Const):
            return type(node.value) is str
        if isinstance(node, nodes.Name):
            return node.ctx == "load" and node.name in variables and not stores[node.name]
        if isinstance(node, (nodes.Getitem, nodes.Getattr)):  # a message field (HF passes them as plain data)
            return is_message(node.node) and message_key(node) is not None
        return False

    def message_key(node: Any) -> str | None:  # the key of message[key] / message.key, if a constant one
        if isinstance(node, nodes.Getattr):
            return node.attr
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and type(node.arg.value) is str:
            return node.arg.value
        return None

    def content_printed_verbatim(node: Any) -> bool:
        up, field = parent[id(node)]
        while isinstance(up, (nodes.Add, nodes.Concat)):
            node = up
            up, field = parent[id(node)]
        if not isinstance(up, nodes.Output) or not is_plain_string(node):
            return False
        node = up
        while node is not tree:
            up, field = parent[id(node)]
            if not isinstance(up, (nodes.Template, nodes.For, nodes.If)) or field not in ("body", "else_", "elif_"):
                return False
            node = up
        return True

    def message_read_safely(node: Any) -> bool:  # node is a message: read one field of it, nothing else
        up, field = parent[id(node)]
        key = message_key(up) if field == "node" else None
        if key is None:
            return False
        if key == "content":
            return content_printed_verbatim(up)
        return not key.startswith("_") and not hasattr(dict, key)

    opaque = (
        all(stores[v] == 1 for v in loop_vars) and not stores["messages"] and not stores["loop"]
        and not any(isinstance(n, (nodes.EvalContextModifier, nodes.Extends)) for n in everything)
    )
    for n in names:
        if not opaque:
            break
        if n.ctx != "load":
            continue
        up, field = parent[id(n)]
        if n.name == "messages":
            if isinstance(up, nodes.For) and field == "iter":
                opaque = isinstance(up.target, nodes.Name) and up.target.name in loop_vars
            elif isinstance(up, nodes.Filter) and field == "node" and up.name in ("length", "count"):
                opaque = not (up.args or up.kwargs or up.dyn_args or up.dyn_kwargs)
            else:
                opaque = field == "node" and is_message(up) and message_read_safely(up)
        elif n.name in loop_vars:
            opaque = message_read_safely(n)
        elif n.name == "loop":
            opaque = isinstance(up, nodes.Getattr) and field == "node" and up.attr in _LOOP_ATTRS

    deterministic = not any(
        (isinstance(n, nodes.Name) and n.ctx == "load" and not stores[n.name] and n.name not in _TEMPLATE_NAMES
         and n.name not in variables)
        or (isinstance(n, nodes.Filter) and n.name == "random")
        for n in everything
    ) and not stores.keys() & {"strftime_now", "lipsum"}
    return opaque, deterministic


def conversation_shape(messages: Sequence[Any]) -> tuple[tuple[tuple[str, str | None], ...], ...] | None:
    """The messages less their contents (None), if they are dicts of plain strings not too long; else None (not
    cacheable)."""
    shape = []
    budget = SHAPE_MAX_CHARS
    for m in messages:
        if type(m) is not dict:
            return None
        fields = []
        for k, v in m.items():
            if type(k) is not str or type(v) is not str:
                return None
            if k == "content":
                fields.append((k, None))
            else:
                fields.append((k, v))
                budget -= len(k) + len(v)
        shape.append(tuple(fields))
    return tuple(shape) if budget >= 0 else None
