"""Reasoning split from the answer (inferd/api/reasoning.py), in process: each parser gives the same reasoning and
content whatever chunks the text arrives in (tags cut anywhere), with vLLM's semantics per name; reasoning then tool
calls (parsed from the content only); constraints moved after the thinking; chat_template_kwargs checked."""

from __future__ import annotations

import pytest

from inferd.api.errors import APIError
from inferd.api.reasoning import ReasoningParser, constraint_after_reasoning, reasoning_enabled
from inferd.api.template_kwargs import check_template_kwargs
from inferd.api.tools import FORMATS, ToolCallParser
from inferd.config import CHAT_TEMPLATE_KWARGS_MAX_CHARS, CHAT_TEMPLATE_KWARGS_MAX_DEPTH


def chunkings(text: str):
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def split(kind: str, pieces: list[str]) -> tuple[str, str]:
    parser = ReasoningParser(kind)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        for channel, text in parser.feed(piece, final=i == len(pieces) - 1):
            assert text
            if channel == "reasoning":
                assert not content, "reasoning after content"
                reasoning += text
            else:
                content += text
    assert parser.reasoning == reasoning
    return reasoning, content


CASES = [  # text, (reasoning, content) for deepseek_r1, for qwen3
    ("<think>\nLet me see: 2 < 3.\n</think>\n\nYes.", ("\nLet me see: 2 < 3.\n", "Yes."),
     ("\nLet me see: 2 < 3.\n", "Yes.")),
    # the prompt opened <think> (DeepSeek R1, Qwen3 thinking models): only deepseek_r1 reads reasoning without the tag
    ("I think </thin> is not the tag.</think>Answer", ("I think </thin> is not the tag.", "Answer"),
     ("", "I think </thin> is not the tag.</think>Answer")),
    ("Just an answer.", ("Just an answer.", ""), ("", "Just an answer.")),
    ("  <think>cut off before the end", ("cut off before the end", ""), ("cut off before the end", "")),
    ("<think></think>", ("", ""), ("", "")),
    ("<think></think>\n\nOnly content", ("", "Only content"), ("", "Only content")),
    ("<thin", ("<thin", ""), ("", "<thin")),
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    ("Text with <think>in the middle</think>", ("Text with <think>in the middle", ""),
     ("", "Text with <think>in the middle</think>")),
]


@pytest.mark.parametrize("text,deepseek,qwen", CASES)
def test_every_chunking_gives_the_same_split(text, deepseek, qwen):
    for kind, expected in (("deepseek_r1", deepseek), ("qwen3", qwen)):
        for pieces in chunkings(text):
            assert split(kind, pieces) == expected, (kind, pieces)


def test_tool_calls_are_parsed_from_the_content_only():
    text = ('<think>I could write <tool_call>{"name": "say", "arguments": "no"}</tool_call> here.</think>\n\n'
            'Calling.\n<tool_call>\n{"name": "say", "arguments": "yes"}\n</tool_call>')
    for pieces in chunkings(text):
        reasoning_parser, tools = ReasoningParser("qwen3"), ToolCallParser(FORMATS["hermes"], frozenset({"say"}))
        reasoning = ""
        for i, piece in enumerate(pieces):
            items = reasoning_parser.feed(piece, final=i == len(pieces) - 1)
            reasoning += "".join(t for channel, t in items if channel == "reasoning")
            tools.feed("".join(t for channel, t in items if channel == "content"), final=i == len(pieces) - 1)
        content, calls = tools.result()
        assert reasoning.startswith("I could write <tool_call>") and content == "Calling."
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("say", '"yes"')]


def test_a_constraint_applies_after_the_thinking():
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    for parser, opening in (("qwen3", "<think>"), ("deepseek_r1", "")):
        kind, text = constraint_after_reasoning("json", schema, parser)
        grammar = Grammar.from_structural_tag(text)
        assert kind == "structural_tag"
        assert _is_grammar_accept_string(grammar, opening + 'free {text}, "not json"</think>\n\n{"a": 1}')
        assert not _is_grammar_accept_string(grammar, opening + "free</think>\n\nNot JSON.")
        # deepseek_r1: the prompt opened the thinking, no answer before it ends; qwen3 may answer at once
        assert _is_grammar_accept_string(grammar, '{"a": 1}') == (parser == "qwen3")
    choice = Grammar.from_structural_tag(constraint_after_reasoning("choice", '["yes", "no"]', "qwen3")[1])
    assert _is_grammar_accept_string(choice, "<think>hmm</think>no")
    assert not _is_grammar_accept_string(choice, "<think>hmm</think>maybe")
    regex = Grammar.from_structural_tag(constraint_after_reasoning("regex", "[0-9]{3}", "deepseek_r1")[1])
    assert _is_grammar_accept_string(regex, "hmm</think>\n123") and not _is_grammar_accept_string(regex, "x</think>12")


def test_chat_template_kwargs_are_checked():
    assert check_template_kwargs({"enable_thinking": False, "x": [1, {"y": "z"}]}, None) == {
        "enable_thinking": False, "x": [1, {"y": "z"}]}
    assert not reasoning_enabled({"enable_thinking": False}) and reasoning_enabled({"enable_thinking": True})
    assert reasoning_enabled(None) and not reasoning_enabled({"thinking": False})
    nested: list = []  # as deep as the limit allows: {"deep": nested} is one level more
    for _ in range(CHAT_TEMPLATE_KWARGS_MAX_DEPTH - 1):
        nested = [nested]
    bad = [{"enable_thinking": "false"}, {"messages": []}, {"tokenize": True}, {"add_generation_prompt": False},
           {"not a name": 1}, {"deep": nested}, {"long": "x" * CHAT_TEMPLATE_KWARGS_MAX_CHARS}, {"s": "<|im_end|>"}]
    for kwargs in bad:
        with pytest.raises(APIError) as e:
            check_template_kwargs(kwargs, lambda text: "<|im_end|>" in text)
        assert e.value.status == 400 and e.value.param == "chat_template_kwargs", kwargs
    check_template_kwargs({"deep": nested[0]}, None)  # at the limit
