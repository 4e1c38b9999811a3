"""`inferd bench --report DIR` (inferd/bench/report.py): a small sweep (2 rates x 2 concurrencies) against a live
server (the `tiny_server` fixture: a real engine on a 2-layer random Llama, the cheapest server that streams real
tokens), then the files it wrote are read back: report.md's rows against results.json, counts against the workload,
the PNGs as images. Asserts on consistency only, never on timing magnitudes."""

from __future__ import annotations

import argparse
import json
import math
import re
import socket

import numpy as np
import pytest

from inferd.bench.report import DEFAULT_REPORT_CONCURRENCIES, DEFAULT_REPORT_RATES, write_report
from inferd.cli.bench import add_bench_arguments, cmd_bench

pytestmark = pytest.mark.timeout(300)

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 16, 6
RATES, CONCURRENCIES = (20.0, 40.0), (1, 3)
VOCAB_SIZE = 32000  # prompt ids in [1000, 32000): valid for the tiny model's tokenizer
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPECTED_PLOTS = {"latency_vs_rate.png", "throughput_vs_concurrency.png", "latency_vs_concurrency.png",
                  "ttft_cdf.png", "tpot_cdf.png", "goodput.png"}
# report.md's column headers -> (results.json summary key, decimals printed): written here independently of
# report.py's own table definition, so that a renamed, misplaced or misformatted column fails
COLUMNS = {"sent": ("sent", 0), "completed": ("completed", 0), "failed": ("failed", 0),
           "duration (s)": ("duration", 2), "req/s": ("request_throughput", 3),
           "output tok/s": ("output_throughput", 2), "goodput (req/s)": ("request_goodput", 3),
           "E2E p50 (ms)": ("median_e2el_ms", 2), "E2E p99 (ms)": ("p99_e2el_ms", 2)}
for _metric, _label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
    for _stat, _p in (("median", "p50"), ("p90", "p90"), ("p99", "p99")):
        COLUMNS[f"{_label} {_p} (ms)"] = (f"{_stat}_{_metric}_ms", 2)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(list(argv))
    if "--api-key" not in argv:
        args.api_key = None  # not $OPENAI_API_KEY from the environment
    return args


def _tables(markdown: str) -> dict[str, list[dict[str, str]]]:
    """Each '## ' section's table as a list of {header: cell} rows."""
    tables, section, header = {}, None, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            section, header = line[3:], None
        elif line.startswith("|") and section is not None:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not all(set(c) <= {"-"} for c in cells):
                tables.setdefault(section, []).append(dict(zip(header, cells, strict=True)))
    return tables


def _check_cell(text: str, value, decimals: int, where: str) -> None:
    if value is None:
        assert text == "-", where
    elif decimals == 0:
        assert text == str(value), where
    else:
        assert re.fullmatch(rf"-?\d+\.\d{{{decimals}}}", text), where
        assert float(text) == pytest.approx(value, abs=0.5 * 10 ** -decimals + 1e-9), where


@pytest.fixture(scope="module")
def report_dir(tiny_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-report") / "report"
    args = _parse("--url", tiny_server.url, "--api-key", tiny_server.api_key, "--num-prompts", str(NUM_PROMPTS),
                  "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--vocab-size", str(VOCAB_SIZE),
                  "--rates", ",".join(f"{r:g}" for r in RATES),
                  "--concurrencies", ",".join(map(str, CONCURRENCIES)),
                  "--goodput", "ttft:1e9", "--report", str(out))
    assert cmd_bench(args) == 0  # every request of every point succeeded
    return out


def test_results_json_counts(report_dir, tiny_server):
    results = json.loads((report_dir / "results.json").read_text())
    points = results["points"]
    assert [(p["kind"], p["value"]) for p in points] == \
        [("rate", r) for r in RATES] + [("concurrency", c) for c in CONCURRENCIES]
    assert len({p["seed"] for p in points}) == len(points)  # no point reuses another's prompts
    assert results["workload"]["model"] == tiny_server.model  # resolved from GET /v1/models
    for p in points:
        s, req = p["summary"], p["requests"]
        assert s["sent"] == NUM_PROMPTS == s["completed"] + s["failed"]
        assert s["failed"] == 0 and req["error"] == [None] * NUM_PROMPTS
        assert all(len(column) == s["sent"] for column in req.values())
        assert req["output_len"] == [OUTPUT_LEN] * NUM_PROMPTS and req["input_len"] == [INPUT_LEN] * NUM_PROMPTS
        assert s["total_output_tokens"] == sum(req["output_len"])
        assert s["request_throughput"] == pytest.approx(s["completed"] / s["duration"])
        assert s["request_goodput"] == s["request_throughput"]  # an SLO every request meets
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert s[f"median_{metric}_ms"] <= s[f"p90_{metric}_ms"] <= s[f"p99_{metric}_ms"]
        # the per-request figures are the ones the percentiles were taken over
        for stat, q in (("median", 50), ("p90", 90), ("p99", 99)):
            assert s[f"{stat}_ttft_ms"] == pytest.approx(np.percentile(np.array(req["ttft"]) * 1000, q))
            assert s[f"{stat}_tpot_ms"] == pytest.approx(np.percentile(np.array(req["tpot"]) * 1000, q))
        assert max(req["e2el"]) <= s["duration"] + 1e-9
        for ttft, tpot, e2e in zip(req["ttft"], req["tpot"], req["e2el"]):
            assert 0 < ttft <= e2e
            assert tpot == pytest.approx((e2e - ttft) / (OUTPUT_LEN - 1))


def test_report_md_rows_match_results(report_dir, tiny_server):
    results = json.loads((report_dir / "results.json").read_text())
    markdown = (report_dir / "report.md").read_text()
    tables = _tables(markdown)
    rate_rows = next(rows for title, rows in tables.items() if title.startswith("Offered load"))
    conc_rows = next(rows for title, rows in tables.items() if title.startswith("Fixed concurrency"))
    assert [r["rate (req/s)"] for r in rate_rows] == [f"{r:g}" for r in RATES]
    assert [r["concurrency"] for r in conc_rows] == [str(c) for c in CONCURRENCIES]
    for row, point in zip(rate_rows + conc_rows, results["points"], strict=True):
        assert set(COLUMNS) <= set(row)
        for header, (key, decimals) in COLUMNS.items():
            _check_cell(row[header], point["summary"][key], decimals, f"{point['label']}: {header}")
    assert results["command_explicit"] in markdown
    assert f"--report {report_dir}" in results["command_explicit"]
    assert "--rates 20,40 --concurrencies 1,3" in results["command_explicit"]
    for text in (markdown, (report_dir / "results.json").read_text()):
        assert tiny_server.api_key not in text  # a secret never lands in a report


def test_plots_are_png_images(report_dir):
    import matplotlib.image

    markdown = (report_dir / "report.md").read_text()
    written = {p.name for p in report_dir.glob("*.png")}
    assert written == EXPECTED_PLOTS
    for name in sorted(written):
        data = (report_dir / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 1000, name
        image = matplotlib.image.imread(report_dir / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, name
        assert image.std() > 0, name  # not a blank canvas
        assert f"]({name})" in markdown, name


def test_failed_points_still_render(tmp_path):
    """A point where every request failed has no latencies: '-' cells, no crash, no line in the plots."""
    ok = {"sent": 2, "completed": 2, "failed": 0, "duration": 1.0, "request_throughput": 2.0,
          "output_throughput": 10.0} | {f"{s}_{m}_ms": 5.0 for s in ("mean", "median", "std", "p90", "p99")
                                          for m in ("ttft", "tpot", "itl", "e2el")}
    bad = {"sent": 2, "completed": 0, "failed": 2, "duration": 0.5, "request_throughput": 0.0,
           "output_throughput": 0.0} | {f"{s}_{m}_ms": None for s in ("mean", "median", "std", "p90", "p99")
                                          for m in ("ttft", "tpot", "itl", "e2el")}
    good_requests = {"ttft": [0.004, 0.006], "tpot": [0.005, 0.005], "e2el": [0.03, 0.04], "input_len": [4, 4],
                     "output_len": [5, 5], "error": [None, None]}
    bad_requests = {"ttft": [None, None], "tpot": [None, None], "e2el": [0.1, 0.2], "input_len": [4, 4],
                    "output_len": [0, 0], "error": ["HTTP 503: overloaded"] * 2}
    results = {"date": "2026-01-01T00:00:00", "command": None, "command_explicit": "inferd bench --report x",
               "workload": {"url": "http://h", "model": "m", "num_prompts": 2, "input_len": 4, "output_len": 5,
                            "range_ratio": 0.0, "max_concurrency": None, "seed": 0, "temperature": 0.0,
                            "vocab_size": 32000, "warmup": 0, "goodput": None},
               "rates": [1.0, 2.0], "concurrencies": [1],
               "points": [{"kind": "rate", "value": 1.0, "label": "rate 1 req/s", "seed": 0, "summary": ok,
                           "requests": good_requests},
                          {"kind": "rate", "value": 2.0, "label": "rate 2 req/s", "seed": 1, "summary": bad,
                           "requests": bad_requests},
                          {"kind": "concurrency", "value": 1, "label": "concurrency 1", "seed": 2, "summary": ok,
                           "requests": good_requests}]}
    plots = write_report(results, str(tmp_path))
    assert set(plots) == EXPECTED_PLOTS - {"goodput.png"}  # no SLOs: no goodput plot
    rows = _tables((tmp_path / "report.md").read_text())
    bad_row = next(rows for title, rows in rows.items() if title.startswith("Offered load"))[1]
    assert (bad_row["failed"], bad_row["TTFT p50 (ms)"], bad_row["ITL p99 (ms)"]) == ("2", "-", "-")
    assert "goodput (req/s)" not in bad_row
    assert "rate 2 req/s: 2 x HTTP 503: overloaded" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text()) == results


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv", [("--rates", "1,2"), ("--concurrencies", "4"),
                                  ("--report", "R", "--concurrency", "2"), ("--report", "R", "--request-rate", "3"),
                                  ("--report", "R", "--output-json", "x.json"),
                                  ("--report", "R", "--rates", "", "--concurrencies", ""),
                                  ("--report", "R", "--rates", "1,x"), ("--report", "R", "--rates", "0"),
                                  ("--report", "R", "--rates", "inf"), ("--report", "R", "--concurrencies", "0")])
def test_bad_report_arguments(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    url = f"http://127.0.0.1:{_closed_port()}"
    assert cmd_bench(_parse("--url", url, *argv)) == 2
    assert "inferd bench:" in capsys.readouterr().err
    assert not (tmp_path / "R").exists()  # refused before anything ran or was written


def test_defaults_and_unreachable_server(tmp_path, capsys):
    """No --rates / --concurrencies: the named defaults; a server that is not there: exit 1 and nothing written."""
    from inferd.bench.loadgen import bench_config
    from inferd.bench.report import sweep_config

    url = f"http://127.0.0.1:{_closed_port()}"
    args = _parse("--url", url, "--report", str(tmp_path / "R"))
    sweep = sweep_config(args, bench_config(args))
    assert (sweep.rates, sweep.concurrencies) == (list(DEFAULT_REPORT_RATES), list(DEFAULT_REPORT_CONCURRENCIES))
    assert all(math.isfinite(r) for r in sweep.rates)
    assert cmd_bench(args) == 1
    assert "cannot reach" in capsys.readouterr().err
    assert not (tmp_path / "R").exists()
