"""`bash bench/gpu_check.sh --dry-run`: the GPU check's own code on the CPU with tiny shapes (CUDA graphs are never
captured off CUDA). Checks the JSON it writes: every key there, counts equal to what was asked for, numbers positive
and consistent with each other, the summary and the plots."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BATCHES, PROMPT, NEW = [1, 4], 16, 8  # the dry run's settings (bench/gpu_check.py parse_args)
PARITY_BATCH, PARITY_TOKENS = 4, 32

pytestmark = pytest.mark.timeout(300)


def llama_parameters(shape: dict) -> int:
    """transformers' LlamaForCausalLM: embedding, per layer q/k/v/o, gate/up/down, two norms,
    the final norm and, untied, the head."""
    h, v, layers = shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"]
    hd = h // shape["num_attention_heads"]
    attention = h * shape["num_attention_heads"] * hd * 2 + 2 * h * shape["num_key_value_heads"] * hd
    head = 0 if shape["tie_word_embeddings"] else v * h
    return v * h + layers * (attention + 3 * h * shape["intermediate_size"] + 2 * h) + h + head


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, json.loads((out / "gpu_check.json").read_text()), proc.stdout


def check_run(point: dict, batch: int) -> None:
    assert point["batch"] == batch and point["prompt_tokens"] == PROMPT
    assert point["requested_tokens"] == batch * NEW
    assert point["tokens"] == point["requested_tokens"]  # greedy, ignore_eos: never short
    assert point["seconds"] > 0
    assert point["tokens_per_s"] == pytest.approx(point["tokens"] / point["seconds"])


def test_engine_and_transformers_runs(dry_run):
    _, report, _ = dry_run
    assert report["dry_run"] is True and report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["settings"] == {"batches": BATCHES, "prompt_tokens": PROMPT, "new_tokens": NEW,
                                  "parity": [PARITY_BATCH, PARITY_TOKENS]}
    assert [m["name"] for m in report["models"]] == ["smollm2-135m", "llama-1b", "llama-8b"]
    assert report["complete"] is True
    assert report["peaks"]["bandwidth"] > 0 and report["peaks"]["flops"] > 0
    for m in report["models"]:
        assert m["parameters"] == llama_parameters(m["shape"])
        assert [p["batch"] for p in m["hf_generate"]["points"]] == BATCHES
        for point, batch in zip(m["hf_generate"]["points"], BATCHES):
            check_run(point, batch)
        for label in ("cuda_graphs", "eager", "torch_attention"):
            run = m[label]
            assert run["cuda_graphs_flag"] is (label != "eager")
            # the default kernels (on a CPU the fused ones) against the torch references
            assert run["kernels"] == ("reference" if label == "torch_attention" else "fused-cpu")
            # on a CPU nothing is captured; the dry run's graphs engine runs the graphs' static-shape decode path
            # uncaptured (so the parity below compares that path with the eager one), the eager engine never does
            assert run["graphs_captured"] == 0 and run["capture_bytes"] == 0
            assert (run["graph_steps"] > 0) is (label != "eager")
            assert run["load_s"] > 0 and run["kv_blocks"] > 0
            assert [p["batch"] for p in run["points"]] == BATCHES
            for point, batch in zip(run["points"], BATCHES):
                check_run(point, batch)
                assert point["decode_steps"] == NEW - 1  # one prefill step gives the first token of every row
                assert point["decode_step_ms"] > 0 and point["decode_step_bytes"] > 0
                assert point["decode_mbu"] == pytest.approx(point["decode_step_bytes"]
                                                            / (point["decode_step_ms"] / 1000)
                                                            / report["peaks"]["bandwidth"])
        assert m["cuda_graphs"]["kv_blocks"] == m["eager"]["kv_blocks"] - 1  # the padded rows' scratch block
        for g, e, t, h in zip(m["cuda_graphs"]["points"], m["eager"]["points"], m["torch_attention"]["points"],
                              m["hf_generate"]["points"]):
            r = m["ratios"][str(g["batch"])]
            assert r["kernels_over_torch_tokens_per_s"] == pytest.approx(g["tokens_per_s"] / t["tokens_per_s"])
            assert r["graphs_over_eager_tokens_per_s"] == pytest.approx(g["tokens_per_s"] / e["tokens_per_s"])
            assert r["graphs_over_hf_tokens_per_s"] == pytest.approx(g["tokens_per_s"] / h["tokens_per_s"])
            assert r["eager_over_graphs_decode_step"] == pytest.approx(e["decode_step_ms"] / g["decode_step_ms"])
        # the static path (padded batches and block tables) against the eager one, and the kernels against the torch
        # references, by the exactness rule: every token compared unless a near-tie let them part, logits all but
        # equal (fp32)
        for parity in (m["parity_graphs_vs_eager"], m["parity_kernels_vs_torch"]):
            assert parity["ok"] and parity["failures"] == [], parity
            assert (parity["requests"], parity["tokens"]) == (PARITY_BATCH, PARITY_BATCH * PARITY_TOKENS)
            assert parity["matched"] > 0 and parity["max_logit_diff"] < 1e-3, parity


def test_profile_and_outputs(dry_run):
    out, report, stdout = dry_run
    prof = report["profile"]
    decode = [p for p in prof["points"] if p["kind"] == "decode"]
    assert sorted({(p["context"], p["batch"]) for p in decode}) == [(c, b) for c in (16, 32) for b in (1, 2, 4)]
    assert sorted(p["context"] for p in prof["points"] if p["kind"] == "prefill") == [16, 32]
    for p in prof["points"]:
        assert p["step_s"] > 0 and p["bytes"] > 0 and p["flops"] > 0 and 0 < p["mbu"] and 0 < p["mfu"]
        assert p["intensity"] == pytest.approx(p["flops"] / p["bytes"])
    assert prof["peaks"]["bandwidth"] > 0 and prof["peaks"]["flops"] > 0
    assert "context 16:" in prof["answer"] and "context 32:" in prof["answer"]
    summary = (out / "summary.txt").read_text()
    assert summary in stdout
    assert "DRY RUN" in summary and all(name in summary for name in ("smollm2-135m", "llama-1b", "llama-8b"))
    assert summary.count("greedy parity, graphs against eager: ok") == 3
    assert summary.count("greedy parity, kernels against torch attention: ok") == 3
    assert report["seconds"] > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert sorted(report["plots"]) == ["roofline.png", "throughput.png"]
    for name in report["plots"]:
        assert (out / name).stat().st_size > 1000


def test_a_run_cut_short_keeps_what_it_measured(tmp_path):
    """The JSON is rewritten after every stage: a failure in the second model (an unknown shape here, before any of
    its stages) leaves the first model's stages and the calibrated peaks on disk, marked incomplete."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--models", "smollm2-135m,no-such-shape",
                           "--no-profile"], cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode != 0 and "no-such-shape" in proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["complete"] is False and report["peaks"]["bandwidth"] > 0
    [first] = report["models"]
    assert first["name"] == "smollm2-135m" and first["parity_kernels_vs_torch"]["ok"]
