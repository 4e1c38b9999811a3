"""inferd.bench.loadgen end to end against a live server (the `tiny_server` fixture: .url, .api_key, .model).
Asserts on counts and consistency only, never on timing magnitudes."""

from __future__ import annotations

import argparse
import asyncio
import json

from inferd.bench.loadgen import BenchConfig, run_benchmark
from inferd.cli.bench import add_bench_arguments, cmd_bench

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 16, 8
VOCAB_SIZE = 32000  # prompt ids in [1000, 32000): valid for any tokenizer-backed test model
REPORT_KEYS = {"date", "config", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
               "request_throughput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
               "ttfts", "e2els", "itls", "errors"} | {f"{stat}_{metric}_ms" for stat in ("mean", "median", "std",
                                                                                        "p90", "p99")
                                                     for metric in ("ttft", "tpot", "itl", "e2el")}


def _check_report(report: dict, model: str) -> None:
    assert REPORT_KEYS <= set(report)
    assert report["errors"] == [None] * NUM_PROMPTS
    assert (report["completed"], report["failed"]) == (NUM_PROMPTS, 0)
    assert report["config"]["model"] == model
    assert report["input_lens"] == [INPUT_LEN] * NUM_PROMPTS  # the prompt is token ids: its length is exact
    assert report["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS  # ignore_eos: every request runs to max_tokens
    assert report["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert report["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    for ttft, e2e, itls in zip(report["ttfts"], report["e2els"], report["itls"]):
        assert 0 < ttft <= e2e
        # one chunk per token, except where the server holds text back (an incomplete UTF-8 character)
        assert 1 <= len(itls) <= OUTPUT_LEN - 1
        assert all(x >= 0 for x in itls)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert report[f"mean_{metric}_ms"] is not None
    assert report["duration"] > 0 and report["request_throughput"] > 0


def test_fixed_concurrency(tiny_server):
    config = BenchConfig(url=tiny_server.url, model=tiny_server.model, api_key=tiny_server.api_key,
                         num_prompts=NUM_PROMPTS, input_len=INPUT_LEN, output_len=OUTPUT_LEN, concurrency=3,
                         vocab_size=VOCAB_SIZE, goodput={"ttft": 1e9})
    report = asyncio.run(run_benchmark(config))
    _check_report(report, tiny_server.model)
    assert report["config"]["concurrency"] == 3
    assert report["request_goodput"] == report["request_throughput"]  # an SLO every request meets


def test_poisson_through_cmd_bench(tiny_server, tmp_path):
    """The command path: model from GET /v1/models, Poisson arrivals, the JSON report written."""
    out = tmp_path / "bench.json"
    argv = ["--url", tiny_server.url, "--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN),
            "--output-len", str(OUTPUT_LEN), "--request-rate", "20", "--vocab-size", str(VOCAB_SIZE),
            "--output-json", str(out)]
    if tiny_server.api_key:
        argv += ["--api-key", tiny_server.api_key]
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    if not tiny_server.api_key:
        args.api_key = None  # not $OPENAI_API_KEY from the environment
    assert cmd_bench(args) == 0
    report = json.loads(out.read_text())
    _check_report(report, tiny_server.model)
    assert report["config"]["request_rate"] == 20.0 and report["config"]["concurrency"] is None
