"""The echo worker (inferd/worker/echo.py): EchoEngine in process (echo cycle, replay, aborts, the max_num_seqs cap,
validation, the hello), then one real `inferd serve --echo` process on the tiny Llama's config and tokenizer, driven
with the official client: usage counts, finish_reason "length", streamed text, and a prompt over the context."""

from __future__ import annotations

import httpx
import openai
import pytest

from inferd.config import EngineConfig
from inferd.engine import InvalidRequestError, SamplingParams
from inferd.worker.echo import EchoEngine
from inferd.worker.server import build_hello
from servers import kill_group, start_server

MAX_MODEL_LEN = 256


# ---- EchoEngine in process ------------------------------------------------------------------------------------
@pytest.fixture
def engine(tiny_llama_dir) -> EchoEngine:
    return EchoEngine.from_config(EngineConfig(model=str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=2))


def run_all(engine: EchoEngine) -> dict[str, list]:
    """Steps until idle; request id -> its outputs."""
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_echo_stops_on_a_stop_token_after_min_tokens(engine):
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=50, stop_token_ids=[5], min_tokens=2), "a")
    outs = run_all(engine)["a"]
    assert [t for o in outs for t in o.new_token_ids] == [5, 6, 7, 8, 5]
    assert (outs[-1].finish_reason, outs[-1].stop_reason, outs[-1].num_output_tokens) == ("stop", 5, 5)


def test_echo_cycles_the_prompt_and_finishes_by_length(engine):
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=7), "a")
    outs = run_all(engine)["a"]
    assert [t for o in outs for t in o.new_token_ids] == [5, 6, 7, 5, 6, 7, 5]
    assert [o.finish_reason for o in outs] == [None] * 6 + ["length"]
    assert (outs[-1].num_prompt_tokens, outs[-1].num_output_tokens) == (3, 7)
    snap = engine.snapshot()
    assert snap.kv_blocks_free == snap.kv_num_blocks and not engine.requests


def test_replay_continues_the_cycle(engine):
    # the original prompt [5, 6, 7] already produced [5, 6]: the replay goes on with 7, 5
    engine.add_request([5, 6, 7, 5, 6], SamplingParams(max_tokens=4), "r", num_prompt_tokens=3)
    outs = run_all(engine)["r"]
    assert [o.new_token_ids[0] for o in outs] == [7, 5]
    assert (outs[-1].finish_reason, outs[-1].num_output_tokens) == ("length", 4)


def test_running_is_capped_at_max_num_seqs_and_aborts_free_the_slot(engine):
    for rid in "abc":
        engine.add_request([1, 2], SamplingParams(max_tokens=50), rid)
    assert {o.request_id for o in engine.step()} == {"a", "b"}
    snap = engine.snapshot()
    assert (snap.running, snap.waiting) == (2, 1)
    assert engine.abort("a") and not engine.abort("a")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs][0] == ("a", "abort")
    assert {o.request_id for o in outs[1:]} == {"b", "c"}


def test_validation_is_the_engines(engine):
    vocab = engine.model_config.vocab_size
    bad = [([], SamplingParams(), "empty"), ([vocab], SamplingParams(), "vocabulary"),
           ([1] * 250, SamplingParams(max_tokens=10), "context window"),
           ([1], SamplingParams(max_tokens=0), "max_tokens"), ([1], SamplingParams(top_p=0), "top_p"),
           ([1, 2], SamplingParams(max_tokens=1), "already has")]
    for prompt, params, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(prompt, params, num_prompt_tokens=1 if message == "already has" else None)
    assert not engine.requests


def test_hello_reads_the_config_and_the_flags(engine, tiny_llama_dir):
    hello = build_hello(engine, engine.config, "echo-0", 0.5)
    assert (hello.vocab_size, hello.max_model_len, hello.max_num_seqs) == (49152, MAX_MODEL_LEN, 2)
    assert hello.model == tiny_llama_dir.name and hello.kv_num_blocks >= 2 * MAX_MODEL_LEN // hello.kv_block_size


# ---- `inferd serve --echo` ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("echo-server") / "serve.log"
    s = start_server(tiny_llama_dir, log, "--echo", "--max-model-len", str(MAX_MODEL_LEN), "--heartbeat-interval",
                     "0.1", model_name="echo")
    yield s
    kill_group(s.proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_server_runs_the_echo_worker(server):
    assert "echo worker" in server.log() and "tensors" not in server.log()  # no weights were loaded
    [model] = httpx.get(server.url + "/v1/models").json()["data"]
    assert model["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_chat_usage_and_finish_reason(client, server, smollm2_tokenizer, max_tokens):
    messages = [{"role": "user", "content": "Say something."}]
    prompt = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), max_tokens)
    assert r.usage.total_tokens == len(prompt) + max_tokens
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == smollm2_tokenizer.decode(prompt[:max_tokens])


def test_streamed_completion_echoes_the_prompt(client, server, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("one two three", add_special_tokens=False)
    stream = client.completions.create(model=server.model, prompt=ids, max_tokens=7, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == smollm2_tokenizer.decode((ids * 7)[:7])
    assert reasons == ["length"]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 7)


def test_prompt_over_the_context_is_400(client, server):
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=server.model, prompt=[100] * (MAX_MODEL_LEN + 10), max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="context"):  # the prompt fits, prompt + max_tokens does not
        client.completions.create(model=server.model, prompt=[100] * 250, max_tokens=10)
