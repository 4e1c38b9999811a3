"""Speculative decoding by prompt lookup (`--speculative ngram`): the proposer, and outputs equal to plain decoding
by the exactness rule (greedy: a divergence only at a top-2 near-tie; seeded sampling: only where the position's
uniform draw lies within 1e-3 of a CDF boundary), with drafts actually verified and accepted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferd.cli import main as cli_main
from inferd.config import EngineConfig
from inferd.engine import SamplingParams
from inferd.engine.speculative import NgramIndex, check_speculative, propose_ngram
from tests.parity import Reference, assert_same_output, greedy_prefix_parity

# a prompt that repeats itself: a random model continues such text in loops, so drafts get accepted
PROMPT = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8, 9]


def test_propose_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 2, 3]
    # suffix [2, 3]: earlier at 1-2 (then 9) and 5-6 (then 4 5 6); [1, 2, 3] is no suffix; latest wins at n=2
    assert propose_ngram(tokens, NgramIndex(), 3, ngram_min=2, ngram_max=4) == [4, 5, 6]
    # a longer match beats a more recent shorter one: suffix [9, 1, 2] occurs once, [1, 2] more recently
    tokens = [9, 1, 2, 7, 7, 1, 2, 8, 9, 1, 2]
    assert propose_ngram(tokens, NgramIndex(), 2, ngram_min=2, ngram_max=3) == [7, 7]
    assert propose_ngram(tokens, NgramIndex(), 2, ngram_min=2, ngram_max=2) == [8, 9]
    # no earlier occurrence of a long enough suffix: nothing
    assert propose_ngram([1, 2, 3, 4, 3], NgramIndex(), 4, ngram_min=2) == []
    assert propose_ngram([1, 2, 3, 4, 3], NgramIndex(), 4, ngram_min=1) == [4, 3]
    # the draft stops at the end of the sequence
    assert propose_ngram([5, 6, 5, 6], NgramIndex(), 4, ngram_min=2) == [5, 6]


def test_index_grows_with_the_sequence():
    index = NgramIndex()
    tokens = [1, 2, 3]
    assert propose_ngram(tokens, index, 2, ngram_min=1) == []
    tokens += [1, 2]
    assert propose_ngram(tokens, index, 2, ngram_min=1) == [3, 1]
    assert index.indexed == 5 and index.positions[1] == [0, 3]
    assert propose_ngram([4, 4], index, 2, ngram_min=1) == [4]  # a shorter sequence: the index starts again


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=1234, ignore_eos=True),
    SamplingParams(max_tokens=37, temperature=0, logprobs=3),  # may stop at EOS; logprobs for every token
], ids=["greedy", "seeded", "greedy-eos-logprobs"])
def test_outputs_equal_plain_decoding(micro, params):
    prompts = [PROMPT, PROMPT[3:] + PROMPT, [3, 4, 5, 3, 4, 5, 3, 4]]
    plain = micro.engine(record_logits=True).generate(prompts, params)
    engine = micro.engine(record_logits=True, speculative="ngram", num_draft=4, ngram_min=1)
    spec = engine.generate(prompts, params)
    for i, (a, b) in enumerate(zip(spec, plain)):
        assert_same_output(a, b, params, f"prompt {i}")
        assert a.num_output_tokens <= params.max_tokens
        if params.logprobs is not None:
            assert a.debug_logits is not None and len(a.debug_logits) == a.num_output_tokens
    stats = engine.stats
    assert stats.spec_drafted > 0 and stats.spec_accepted > 0, (stats.spec_drafted, stats.spec_accepted)
    # accepted drafts are tokens that took no step of their own
    assert stats.num_sampled == sum(r.num_output_tokens for r in spec)
    engine.kv_cache.check_no_leaks()


def test_accepted_tokens_save_steps_and_limits_hold(micro):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain_engine = micro.engine(record_logits=True)
    [plain] = plain_engine.generate([PROMPT], params)
    engine = micro.engine(speculative="ngram", num_draft=4, ngram_min=1, record_logits=True)
    [spec] = engine.generate([PROMPT], params)
    assert_same_output(spec, plain, params, "accepted drafts")
    assert spec.num_output_tokens == 30 and spec.finish_reason.value == "length"
    assert engine.stats.num_steps == plain_engine.stats.num_steps - engine.stats.spec_accepted
    assert engine.stats.spec_accepted > 0


def test_stop_token_inside_accepted_drafts_ends_there(micro):
    """Every token of the output, in turn, as a stop token: the output ends at its first occurrence, as plain
    decoding's would, also when it came inside a step that emitted several tokens (the micro model's greedy output
    for this prompt is one token 34 times, then another: the second one is first sampled as a rejected draft's
    replacement, the stop token then ends a step that accepted drafts before it)."""
    prompt = [468, 275, 506, 364, 417, 311, 464, 78, 468, 275, 506, 364, 417]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    [plain] = micro.engine(record_logits=True).generate([prompt], params)
    out = plain.output_token_ids
    plain_ref = Reference(out, np.stack([x.numpy() for x in plain.debug_logits]))
    ended_mid_step = 0
    for stop in sorted(set(out)):
        engine = micro.engine(speculative="ngram", num_draft=4, ngram_min=1, record_logits=True)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                        stop_token_ids=[stop]))
        req = engine.requests[rid]
        tokens, last = [], None
        while engine.has_unfinished_requests():
            for o in engine.step():
                assert o.request_id == rid
                tokens += o.new_token_ids
                last = o
        end = out.index(stop) + 1
        # verification computes several positions in one pass (another float order): by the exactness rule
        if greedy_prefix_parity(tokens, req.debug_logits, plain_ref, f"stop {stop}") < min(len(tokens), end):
            continue  # a near-tie went the other way before the stop: nothing after it can be compared
        assert tokens == out[:end], stop
        assert last.finished and (last.finish_reason, last.stop_reason) == ("stop", stop)
        ended_mid_step += len(last.new_token_ids) > 1
        engine.kv_cache.check_no_leaks()
    assert ended_mid_step > 0  # some stop token came out of a step with accepted drafts


def test_prefix_cache_blocks_written_by_verification_are_right(micro):
    """A second request whose prompt is the first one's prompt and output reads the blocks that verification rows
    wrote (prefix cache hits), and still decodes as the plain engine does."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine = micro.engine(record_logits=True, speculative="ngram", num_draft=4, ngram_min=1)
    [first] = engine.generate([PROMPT], params)
    second_prompt = PROMPT + first.output_token_ids
    [second] = engine.generate([second_prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert second.num_cached_tokens >= 32  # the blocks over the first request's output were hits
    [ref] = micro.engine(record_logits=True, enable_prefix_caching=False).generate(
        [second_prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert_same_output(second, ref, SamplingParams(temperature=0), "second request")


def test_drafts_never_take_a_decode_slot(micro):
    """With a token budget of one per running sequence there is no room for drafts: every sequence still decodes
    every step, and the outputs are those of plain decoding."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(4)]
    engine = micro.engine(speculative="ngram", num_draft=4, ngram_min=1, max_num_seqs=4, max_num_batched_tokens=4,
                          speculative_max_batch=8)
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        engine.step()
        sched = engine.last_schedule
        decoding = [s for s in sched.scheduled if s.request.num_computed_tokens > 0]
        assert sched.num_tokens <= 4
        if len(sched.scheduled) == 4:  # all four running: each computes exactly its one token
            assert all(s.num_tokens == 1 and s.num_draft == 0 for s in sched.scheduled), decoding
    assert engine.stats.spec_drafted == 0 or engine.stats.num_steps > 0
    engine.kv_cache.check_no_leaks()


def test_large_batches_do_not_speculate(micro):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine = micro.engine(speculative="ngram", ngram_min=1, speculative_max_batch=2)
    engine.generate([PROMPT, PROMPT[1:], PROMPT[2:]], params)  # three decoding at once: above the limit
    assert engine.stats.spec_drafted == 0
    engine = micro.engine(speculative="ngram", ngram_min=1, speculative_max_batch=3)
    engine.generate([PROMPT, PROMPT[1:], PROMPT[2:]], params)
    assert engine.stats.spec_drafted > 0


def test_penalised_requests_are_not_drafted(micro):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=0.5)
    engine = micro.engine(speculative="ngram", ngram_min=1, record_logits=True)
    [spec] = engine.generate([PROMPT], params)
    [plain] = micro.engine(record_logits=True).generate([PROMPT], params)
    assert engine.stats.spec_drafted == 0
    assert_same_output(spec, plain, params, "penalised")


@pytest.mark.parametrize("kw, message", [
    ({"speculative": "medusa"}, "unknown speculative method"),
    ({"speculative": "ngram", "num_draft": 0}, "num_draft"),
    ({"speculative": "ngram", "num_draft": 17}, "num_draft"),
    ({"speculative": "ngram", "ngram_min": 3, "ngram_max": 2}, "ngram_min"),
    ({"speculative": "ngram", "speculative_max_batch": 0}, "speculative_max_batch"),
])
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        check_speculative(EngineConfig(**kw))


def test_cli_refuses_bad_settings_before_loading(capsys):
    with pytest.raises(SystemExit):
        cli_main(["generate", "hi", "--speculative", "medusa"])
    assert "invalid choice" in capsys.readouterr().err
    code = cli_main(["generate", "hi", "--speculative", "ngram", "--num-draft", "0", "--model", "/nonexistent"])
    assert code == 2 and "num_draft must be in [1, 16]" in capsys.readouterr().err


COPY_TEXT = ("Copy the list exactly.\nList: red apple, green pear, yellow banana, purple plum, orange mango, "
             "red apple, green pear, yellow banana, purple plum, orange mango, red apple, green pear,")


def test_real_model_copying_accepts_drafts_and_stops_inside_them(smollm2_fp32):
    """SmolLM2 continuing a repetitive list: drafts from the prompt are accepted, the output is plain greedy's (by
    the exactness rule), and a stop string completed by an accepted draft ends the output where plain decoding's
    ends."""
    from inferd.engine import Engine

    model, config, tokenizer = smollm2_fp32
    prompt = tokenizer.encode(COPY_TEXT)

    def engine(**kw):
        return Engine(model, config, EngineConfig(dtype="float32", kv_cache_bytes=64 << 20, record_logits=True, **kw),
                      torch.float32, tokenizer)

    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    [plain] = engine().generate([prompt], params)
    spec_engine = engine(speculative="ngram")  # the defaults: 4 drafts, n-grams of 2 to 4
    [spec] = spec_engine.generate([prompt], params)
    assert_same_output(spec, plain, params, "copy")
    stats = spec_engine.stats
    assert stats.spec_accepted >= 0.5 * stats.spec_drafted > 0, (stats.spec_accepted, stats.spec_drafted)
    assert stats.num_steps == 1 + spec.num_output_tokens - 1 - stats.spec_accepted  # prefill + one step a token

    # stop strings, each in turn: the output ends with the token that completes the first match, as plain
    # decoding's does; at least one of them is completed inside a step that accepted drafts
    out = plain.output_token_ids
    plain_ref = Reference(out, np.stack([x.numpy() for x in plain.debug_logits]))
    ended_mid_step = 0
    for stop in (" apple", " pear", " banana", ","):
        end = next(k for k in range(1, len(out) + 1) if stop in tokenizer.decode(out[:k]))
        e = engine(speculative="ngram")
        rid = e.add_request(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[stop]))
        req = e.requests[rid]
        outs = []
        while e.has_unfinished_requests():
            outs += [o for o in e.step() if o.request_id == rid]
        tokens = [t for o in outs for t in o.new_token_ids]
        if greedy_prefix_parity(tokens, req.debug_logits, plain_ref, stop) < min(len(tokens), end):
            continue  # a near-tie went the other way before the stop: nothing after it can be compared
        assert tokens == out[:end], stop
        assert "".join(o.new_text for o in outs) == tokenizer.decode(out[:end]).split(stop)[0]
        assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", stop)
        ended_mid_step += len(outs[-1].new_token_ids) > 1
    assert ended_mid_step > 0
