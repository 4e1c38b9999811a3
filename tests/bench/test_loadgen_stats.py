"""inferd.bench.loadgen without a server: the statistics over hand-made records, the SSE parser, the workload and
arrivals, the argument layer, and the streaming client against an in-process fake server (httpx.MockTransport)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket

import httpx
import numpy as np
import pytest

from inferd.bench.loadgen import (
    LOW_TOKEN_ID,
    BenchConfig,
    RequestRecord,
    SSEParser,
    arrival_offsets,
    bench_config,
    build_report,
    generate_workload,
    parse_goodput,
    report_tables,
    run_benchmark,
    summarize,
)
from inferd.cli.bench import add_bench_arguments, cmd_bench


def _rec(ttft, e2e, out, itls=(), prompt=10, error=None):
    return RequestRecord(prompt_tokens=prompt, output_tokens=out, ttft=ttft, e2e=e2e, itls=list(itls), error=error)


# ---------------------------------------------------------------------------------------------------------------
# summarize


def test_summarize_counts_throughput_and_latencies():
    records = [_rec(0.1, 0.5, 5, [0.1, 0.1, 0.1, 0.1], prompt=10),
               _rec(0.2, 1.2, 3, [0.4, 0.6], prompt=20),
               _rec(None, 0.05, 0, prompt=30, error="HTTP 500: boom")]
    s = summarize(records, duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 8)  # failed requests are not counted
    assert s["duration"] == 2.0
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["mean_ttft_ms"] == pytest.approx(150.0)
    assert s["median_ttft_ms"] == pytest.approx(150.0)
    assert s["p99_ttft_ms"] == pytest.approx(199.0)  # linear interpolation between 100 and 200
    assert s["std_ttft_ms"] == pytest.approx(50.0)
    # TPOT = (e2e - ttft) / (out - 1): 0.4 / 4 = 100 ms and 1.0 / 2 = 500 ms
    assert s["mean_tpot_ms"] == pytest.approx(300.0)
    # ITL pools the samples of all requests: [100, 100, 100, 100, 400, 600]
    itl_ms = np.array([100, 100, 100, 100, 400, 600], dtype=float)
    assert s["mean_itl_ms"] == pytest.approx(itl_ms.mean())
    assert s["median_itl_ms"] == pytest.approx(100.0)
    assert s["p90_itl_ms"] == pytest.approx(np.percentile(itl_ms, 90))
    assert s["p99_itl_ms"] == pytest.approx(np.percentile(itl_ms, 99))
    assert s["mean_e2el_ms"] == pytest.approx(850.0)
    assert "request_goodput" not in s


def test_percentiles_are_numpy_linear():
    records = [_rec(t, t + 1.0, 1) for t in (1.0, 2.0, 3.0, 4.0)]
    s = summarize(records, duration=10.0)
    assert s["median_ttft_ms"] == pytest.approx(2500.0)
    assert s["p90_ttft_ms"] == pytest.approx(3700.0)
    assert s["p99_ttft_ms"] == pytest.approx(3970.0)
    assert s["std_ttft_ms"] == pytest.approx(np.std([1000.0, 2000.0, 3000.0, 4000.0]))


def test_single_token_outputs_have_no_tpot_and_empty_stats_are_none():
    r = _rec(0.3, 0.3, 1)
    assert r.tpot is None
    s = summarize([r], duration=1.0)
    assert s["mean_tpot_ms"] is None and s["p99_tpot_ms"] is None
    assert s["mean_itl_ms"] is None
    assert s["mean_ttft_ms"] == pytest.approx(300.0)


def test_all_failed_and_zero_duration():
    s = summarize([_rec(None, 0.0, 0, error="x")], duration=0.0)
    assert (s["completed"], s["failed"]) == (0, 1)
    assert s["request_throughput"] == 0.0 and s["output_throughput"] == 0.0
    assert s["mean_ttft_ms"] is None and s["mean_e2el_ms"] is None


def test_goodput_counts_requests_meeting_every_slo():
    records = [_rec(0.1, 0.5, 5),    # ttft 100 ms, tpot 100 ms: good
               _rec(0.6, 1.0, 5),    # ttft 600 ms: misses ttft
               _rec(0.1, 2.1, 5),    # tpot 500 ms: misses tpot
               _rec(0.2, 0.2, 1),    # no tpot (one token): counts as meeting it
               _rec(None, 0.1, 0, error="x")]
    s = summarize(records, duration=2.0, goodput_slos={"ttft": 500.0, "tpot": 150.0})
    assert s["request_goodput"] == pytest.approx(1.0)  # 2 good requests / 2 s
    s = summarize(records, duration=2.0, goodput_slos={"e2el": 1000.0})
    assert s["request_goodput"] == pytest.approx(1.5)


def test_report_is_json_and_renders():
    config = BenchConfig(model="m", num_prompts=2, goodput={"ttft": 100.0})
    records = [_rec(0.1, 0.5, 5, [0.1] * 4), _rec(None, 0.1, 0, error="boom")]
    report = build_report(config, records, duration=1.0)
    again = json.loads(json.dumps(report, allow_nan=False))
    assert again["config"]["request_rate"] == "inf"
    assert again["ttfts"] == [0.1, None] and again["output_lens"] == [5, 0] and again["errors"] == [None, "boom"]
    assert again["itls"][0] == [0.1] * 4
    assert all(t.row_count for t in report_tables(report))


# ---------------------------------------------------------------------------------------------------------------
# SSE parser


SSE = (b": keep-alive\n\n"
       b"data: {\"a\": 1}\n\n"
       b"data: {\"b\":\r\ndata: 2}\r\n\r\n"
       b"event: ignored\rdata:[DONE]\r\r")


def test_sse_parser_whole_and_split_at_every_byte():
    expected = ['{"a": 1}', '{"b":\n2}', "[DONE]"]
    p = SSEParser()
    assert p.feed(SSE) + p.close() == expected
    p, events = SSEParser(), []
    for i in range(len(SSE)):
        events += p.feed(SSE[i:i + 1])
    assert events + p.close() == expected


def test_sse_parser_crlf_split_across_chunks_is_one_line_end():
    p = SSEParser()
    assert p.feed(b"data: x\r") == []
    assert p.feed(b"\n") == []  # the \n finishes the \r\n: not a blank line
    assert p.feed(b"\r\n") == ["x"]


def test_sse_parser_unterminated_last_event_and_utf8():
    p = SSEParser()
    data = "data: {\"text\": \"é€\"}".encode()
    assert p.feed(data[:-4]) == [] and p.feed(data[-4:]) == []
    assert p.close() == ['{"text": "é€"}']


# ---------------------------------------------------------------------------------------------------------------
# Workload, arrivals, arguments


def test_workload_lengths_ids_and_determinism():
    config = BenchConfig(num_prompts=50, input_len=100, output_len=20, range_ratio=0.5, vocab_size=2000)
    specs = generate_workload(config, random.Random(7))
    assert len(specs) == 50
    assert all(50 <= len(s.prompt) <= 150 and 10 <= s.output_len <= 30 for s in specs)
    assert all(LOW_TOKEN_ID <= t < 2000 for s in specs for t in s.prompt)
    assert len({len(s.prompt) for s in specs}) > 1
    again = generate_workload(config, random.Random(7))
    assert [s.prompt for s in again] == [s.prompt for s in specs]
    exact = generate_workload(BenchConfig(num_prompts=5, input_len=33, output_len=4), random.Random(0))
    assert [(len(s.prompt), s.output_len) for s in exact] == [(33, 4)] * 5


def test_arrival_offsets():
    assert arrival_offsets(4, math.inf, random.Random(0)) == [0.0] * 4
    offsets = arrival_offsets(4001, 20.0, random.Random(0))
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] / 4000 == pytest.approx(1 / 20.0, rel=0.1)  # mean gap 1/rate
    assert arrival_offsets(10, 5.0, random.Random(3)) == arrival_offsets(10, 5.0, random.Random(3))


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(list(argv))


def test_arguments_build_the_config():
    config = bench_config(_parse())
    assert (config.url, config.model, config.num_prompts, config.input_len, config.output_len) == \
        ("http://127.0.0.1:8000", None, 64, 128, 128)
    assert math.isinf(config.request_rate) and config.concurrency is None and config.warmup == 1
    config = bench_config(_parse("--request-rate", "2.5", "--max-concurrency", "4", "--goodput", "ttft:500",
                                 "tpot:50", "--seed", "3", "--vocab-size", "32000"))
    assert (config.request_rate, config.max_concurrency, config.seed, config.vocab_size) == (2.5, 4, 3, 32000)
    assert config.goodput == {"ttft": 500.0, "tpot": 50.0}


@pytest.mark.parametrize("argv", [("--concurrency", "2", "--request-rate", "3"), ("--range-ratio", "1"),
                                  ("--goodput", "ttft"), ("--goodput", "latency:5"), ("--goodput", "tpot:-1"),
                                  ("--vocab-size", "1000"), ("--num-prompts", "0")])
def test_bad_arguments(argv):
    with pytest.raises(ValueError):
        bench_config(_parse(*argv))
    assert cmd_bench(_parse(*argv)) == 2


def test_parse_goodput_none():
    assert parse_goodput(None) is None and parse_goodput([]) is None


# ---------------------------------------------------------------------------------------------------------------
# The streaming client against a fake server


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


class FakeServer:
    """/v1/models and streamed /v1/completions, one chunk per token, sliced into odd byte pieces; `mode` breaks it."""

    def __init__(self, mode: str = "ok"):
        self.mode = mode
        self.bodies: list[dict] = []
        self.headers: list[httpx.Headers] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.headers.append(request.headers)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.mode == "http500":
            return httpx.Response(500, json={"error": {"message": "engine on fire", "type": "server_error"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self._stream(body))

    def _events(self, body: dict) -> list[bytes]:
        n = body["max_tokens"]
        events = [b": ping\n\n"]
        for i in range(n):
            # token 1's text is held back (e.g. half a UTF-8 character): an empty, unfinished choice is a token
            choice = {"index": 0, "text": "" if i == 1 else f"t{i}", "finish_reason": None}
            events.append(_sse({"object": "text_completion", "choices": [choice]}))
            if self.mode == "error" and i == 2:
                return events + [_sse({"error": {"message": "out of KV cache", "code": 500}})]
        events.append(_sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))  # end marker
        events.append(_sse({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                     "completion_tokens": n, "total_tokens": n}}))
        return events if self.mode == "truncated" else events + [_sse(b"[DONE]")]

    async def _stream(self, body: dict):
        data = b"".join(self._events(body))
        for i in range(0, len(data), 7):
            await asyncio.sleep(0)
            yield data[i:i + 7]


def _run(server: FakeServer, **kw) -> dict:
    config = BenchConfig(url="http://fake:1", api_key="sk-test", num_prompts=5, input_len=12, output_len=6, **kw)
    return asyncio.run(run_benchmark(config, transport=httpx.MockTransport(server)))


@pytest.mark.parametrize("arrivals", [dict(concurrency=2), dict(request_rate=200.0, max_concurrency=2),
                                      dict(range_ratio=0.5)])
def test_client_against_fake_server(arrivals):
    server = FakeServer()
    report = _run(server, **arrivals)
    assert report["config"]["model"] == "fake-model"  # resolved from /v1/models
    assert (report["completed"], report["failed"]) == (5, 0)
    assert len(server.bodies) == 6  # one warm-up request, not counted
    for body, n_in, n_out, itls, ttft, e2e in zip(server.bodies[1:], report["input_lens"], report["output_lens"],
                                                  report["itls"], report["ttfts"], report["e2els"]):
        assert len(body["prompt"]) == n_in and body["max_tokens"] == n_out
        assert (body["model"], body["stream"], body["ignore_eos"]) == ("fake-model", True, True)
        assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
        assert len(itls) == n_out - 1  # the end-marker chunk is no token; the empty unfinished one is
        assert 0 <= ttft <= e2e
    assert all(h["authorization"] == "Bearer sk-test" for h in server.headers)
    assert report["total_output_tokens"] == sum(report["output_lens"])


@pytest.mark.parametrize("mode, message", [("http500", "HTTP 500: engine on fire"), ("error", "out of KV cache"),
                                           ("truncated", "stream ended before data: [DONE]")])
def test_failures_are_recorded(mode, message):
    server = FakeServer(mode)
    report = _run(server, model="m", warmup=0, concurrency=5)
    assert (report["completed"], report["failed"]) == (0, 5)
    assert report["errors"] == [message] * 5


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cmd_bench_unreachable_server(capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert cmd_bench(_parse("--url", url, "--num-prompts", "2")) == 1  # no model: GET /v1/models fails
    assert "cannot reach" in capsys.readouterr().err
    assert cmd_bench(_parse("--url", url, "--model", "m", "--num-prompts", "2", "--warmup", "0")) == 1
    assert "2 request(s) failed" in capsys.readouterr().out
