"""`inferd serve --speculative ngram` on the default model: a stream whose steps carry several accepted tokens
reaches the `openai` client whole and equal to the plain offline engine's greedy output (exactness rule), usage and
logprobs count every token, a stop string inside accepted drafts cuts the text where plain decoding does, and
/metrics reports drafted and accepted tokens."""

from __future__ import annotations

import openai
import pytest
from offline import assert_same_greedy, offline_greedy, token_ids

from servers import begin_server, kill_group

COPY_TEXT = ("Copy the list exactly.\nList: red apple, green pear, yellow banana, purple plum, orange mango, "
             "red apple, green pear, yellow banana, purple plum, orange mango, red apple, green pear,")
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def spec_server_and_reference(tmp_path_factory, request):
    """The server, and the offline engine's greedy tokens and logits for COPY_TEXT (what both tests compare with),
    computed while the server starts."""
    log = tmp_path_factory.mktemp("spec-server") / "serve.log"
    starting = begin_server(None, log, "--kv-cache-bytes", "128M", "--speculative", "ngram", "--num-draft", "4",
                            model_name="smollm2-spec")
    try:
        engine = request.getfixturevalue("smollm2_engine")
        reference = offline_greedy(engine, engine.tokenizer.encode(COPY_TEXT), MAX_TOKENS, ignore_eos=True)
        yield starting.ready(), reference
    finally:
        kill_group(starting.proc)


@pytest.fixture(scope="module")
def spec_server(spec_server_and_reference):
    return spec_server_and_reference[0]


@pytest.fixture(scope="module")
def reference(spec_server_and_reference):
    return spec_server_and_reference[1]


def test_stream_equals_plain_greedy(spec_server, smollm2_engine, reference):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(model=spec_server.model, prompt=COPY_TEXT, max_tokens=MAX_TOKENS,
                                       temperature=0, logprobs=1, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids, logprobs, text, usage, widest = [], [], "", None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                ids += token_ids(choice.logprobs.tokens)
                logprobs += choice.logprobs.token_logprobs
                widest = max(widest, len(choice.logprobs.tokens))
    prompt_ids = smollm2_engine.tokenizer.encode(COPY_TEXT)
    ref, ref_logits = reference
    matched = assert_same_greedy(ids, logprobs, ref, ref_logits, "speculative stream")
    if matched == MAX_TOKENS:
        assert text == smollm2_engine.tokenizer.decode(ref)
    assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens == len(prompt_ids)
    assert widest > 1  # some chunk carried the several tokens of one step with accepted drafts
    m = spec_server.metrics()
    assert m["inferd_spec_accepted_tokens_total"] > 0
    assert m["inferd_spec_draft_tokens_total"] >= m["inferd_spec_accepted_tokens_total"]


def test_stop_string_inside_drafts(spec_server, smollm2_engine, reference):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ref, ref_logits = reference
    ref_text = smollm2_engine.tokenizer.decode(ref)
    stop = " pear,"
    assert stop in ref_text
    r = client.completions.create(model=spec_server.model, prompt=COPY_TEXT, max_tokens=MAX_TOKENS, temperature=0,
                                  stop=[stop], logprobs=1,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    choice = r.choices[0]
    ids = token_ids(choice.logprobs.tokens)
    # by the exactness rule: when a near-tie let the runs part before the stop, nothing after it can be compared
    if assert_same_greedy(ids, choice.logprobs.token_logprobs, ref, ref_logits, "stop", prefix=True) < len(ids):
        return
    assert choice.finish_reason == "stop"
    assert choice.text == ref_text.split(stop)[0]
