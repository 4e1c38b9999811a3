"""Reasoning output through the HTTP API, with the official `openai` client against a real `inferd serve --echo
--reasoning-parser qwen3`: the echo engine answers with its prompt, and the model's chat template prints the last
user message only, so a test scripts the model's output exactly. reasoning_content apart from content (streamed:
reasoning deltas, then content deltas, assembling to the non-streamed answer), tool calls from the content only,
chat_template_kwargs reaching the template (enable_thinking false: no reasoning), bad ones as 400s in OpenAI's shape,
and a structured output with reasoning accepted; through the Anthropic Messages API, the reasoning as a thinking
block (streamed as thinking deltas) before the text and tool_use blocks, and thinking disabled reaching the template."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.api.test_tool_parser import WEATHER

# the template prints only the last message (and what enable_thinking false makes a Qwen3 template write), then
# <|im_end|>, the stop token the requests name: the echo engine's output is the scripted text
SCRIPT_TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}[no thinking] {% endif %}"
                   "{{ messages[-1]['content'] }}<|im_end|>")
IM_END = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama's config (the echo engine reads no weights) with SmolLM2's tokenizer and the script template."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("scripted")
    LlamaConfig(vocab_size=len(smollm2_tokenizer.hf), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                eos_token_id=IM_END).save_pretrained(path)
    smollm2_tokenizer.hf.save_pretrained(path)
    (path / "chat_template.jinja").write_text(SCRIPT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(scripted_dir, tmp_path_factory):
    from servers import kill_group, start_server

    server = start_server(scripted_dir, tmp_path_factory.mktemp("reasoning") / "serve.log", "--echo",
                          "--max-model-len", "512", "--reasoning-parser", "qwen3", model_name="thinker")
    yield server
    kill_group(server.proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def say(client, server, text: str, **kwargs):
    return client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": text}],
                                          max_tokens=400, extra_body={"stop_token_ids": [IM_END],
                                                                      **kwargs.pop("extra_body", {})}, **kwargs)


THOUGHT = "<think>\nThe user wants 6 x 7. That is 42 (not </thin>).\n</think>\n\nIt is 42."


def test_reasoning_content_apart_from_content_streamed_and_not(client, server):
    r = say(client, server, THOUGHT)
    message = r.choices[0].message
    assert message.reasoning_content == "\nThe user wants 6 x 7. That is 42 (not </thin>).\n"
    assert message.content == "It is 42." and r.choices[0].finish_reason == "stop"
    reasoning, content = [], []
    for chunk in say(client, server, THOUGHT, stream=True):
        for choice in chunk.choices:
            if getattr(choice.delta, "reasoning_content", None):
                assert not content, "a reasoning delta after the content began"
                reasoning.append(choice.delta.reasoning_content)
            if choice.delta.content:
                content.append(choice.delta.content)
    assert len(reasoning) > 1 and len(content) > 1  # streamed as generated, token by token
    assert ("".join(reasoning), "".join(content)) == (message.reasoning_content, message.content)


def test_enable_thinking_false_reaches_the_template_and_splits_nothing(client, server):
    r = say(client, server, THOUGHT, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = r.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content == "[no thinking] " + THOUGHT  # the template saw the variable; the tags are content


def test_tool_calls_come_from_the_content_and_constraints_follow_the_thinking(client, server):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    r = say(client, server, "<think>Maybe " + call + "?</think>\n\nChecking.\n" + call, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.message.reasoning_content == "Maybe " + call + "?"
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = say(client, server, '<think>Six sevens.</think>\n{"n": 42}',
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert r.choices[0].message.reasoning_content == "Six sevens."
    assert json.loads(r.choices[0].message.content) == {"n": 42}


def test_bad_chat_template_kwargs_are_400s_and_good_ones_are_not(server):
    def post(kwargs):
        return httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"model": server.model, "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 4, "chat_template_kwargs": kwargs})

    for kwargs in ({"enable_thinking": "no"}, {"tools": []}, {"bad name": 1}, {"x": "<|im_start|>"}, "not an object"):
        r = post(kwargs)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and "chat_template_kwargs" in (error["param"] or "")
    assert post({"enable_thinking": True, "anything": {"nested": [1, "two"]}}).status_code == 200


def test_messages_api_thinking_text_and_tool_use_blocks(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    # (the echo engine ignores EOS; the Messages API has no stop_token_ids: a stop sequence ends the script)
    ask = {"model": server.model, "max_tokens": 400, "tools": [tool], "stop_sequences": ["@@"],
           "messages": [{"role": "user", "content": "<think>Maybe rain.</think>\n\nChecking.\n" + call + "@@"}]}
    m = client.messages.create(**ask)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].thinking == "Maybe rain." and m.content[1].text == "Checking."
    assert (m.content[2].name, m.content[2].input) == ("get_weather", {"city": "Oslo", "unit": "celsius"})
    events = list(client.messages.create(**ask, stream=True))
    blocks = [e.content_block.type for e in events if e.type == "content_block_start"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert blocks == ["thinking", "text", "tool_use"]
    assert deltas == sorted(deltas, key=["thinking_delta", "text_delta", "input_json_delta"].index)
    assert deltas.count("thinking_delta") > 1  # streamed as generated
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert json.loads(partial) == m.content[2].input
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [b.model_dump(exclude={"id"}) for b in m.content]
    off = client.messages.create(model=server.model, max_tokens=400, thinking={"type": "disabled"},
                                 stop_sequences=["@@"], messages=[{"role": "user", "content": THOUGHT + "@@"}])
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == "[no thinking] " + THOUGHT
    assert (off.stop_reason, off.stop_sequence) == ("stop_sequence", "@@")
