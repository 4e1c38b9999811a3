"""Roofline accounting (bytes and FLOPs of a step, by hand on a small config) and `inferd profile` on the tiny
Llama: its table's figures follow from the accounting and the given peaks, the bound from the ridge point, and a
roofline PNG is written."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from inferd.bench.profile import answer, cmd_profile, run_profile
from inferd.cli.profile import add_profile_arguments
from inferd.models.config import ModelConfig
from inferd.telemetry.roofline import Peaks, model_cost

pytestmark = pytest.mark.timeout(120)


def small_config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=2,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False)


def test_step_cost_by_hand():
    cost = model_cost(small_config(), weight_bytes=1000, kv_dtype=torch.float32, embedding_bytes_per_value=4)
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16 each, down 16x8 = 64+32+32+64+384 = 576
    assert cost.matmul_params == 2 * 576 and cost.lm_head_params == 8 * 100
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 2 * 4  # K and V, 2 layers, 2 KV heads, head_dim 2, fp32
    # two decodes (contexts 10 and 20) and a 3-token prefill chunk ending at context 3; 2 rows sampled
    nbytes, flops = cost.step([1, 1, 3], [10, 20, 3], sampled=2)
    assert nbytes == 1000 + 8 * 4 * 5 + 64 * (10 + 20 + 3)  # weights, 5 embedding rows, the KV attended
    pairs = 10 + 20 + (1 + 2 + 3)  # causal pairs within the prefill chunk
    assert flops == 2 * 1152 * 5 + 2 * 800 * 2 + 4 * 2 * 4 * 2 * pairs
    half = model_cost(small_config(), 500, torch.bfloat16, 2, tensor_parallel=2)  # one rank's share, bf16 KV
    assert half.matmul_params == 576 and half.kv_bytes_per_token == 2 * 2 * 1 * 2 * 2
    assert Peaks(10.0, 40.0, "flags").ridge == 4.0


def test_profile_of_the_tiny_model(tiny_llama_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_profile_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--dtype", "float32", "--contexts", "32",
                              "--max-batch", "4", "--prefill", "16,48", "--steps", "3", "--peak-bandwidth", "20e9",
                              "--peak-flops", "100e9", "--mixed-batches", "2,8", "--mixed-prefill", "8,24",
                              "--out", str(tmp_path)])
    result = run_profile(args)
    points = result["points"]
    # mixed steps: batch 8 is over --max-batch, so only batch 2, beside prompt chunks of 8 and 24 tokens
    assert [(p["kind"], p["batch"], p["context"], p["prefill_tokens"]) for p in points] == \
        [("decode", 1, 32, 0), ("decode", 2, 32, 0), ("decode", 4, 32, 0), ("prefill", 1, 16, 0),
         ("prefill", 1, 48, 0), ("mixed", 2, 32, 8), ("mixed", 2, 32, 24)]
    mixed = [p for p in points if p["kind"] == "mixed"]
    assert mixed[0]["flops"] < mixed[1]["flops"]  # more prompt tokens, more work in the step
    assert mixed[0]["tokens_per_s"] == pytest.approx((2 + 8) / mixed[0]["step_s"])
    # the planner's worker model reads them: a mixed step's extra over its decode rows, 0 without prompt tokens
    from inferd.planner.sim import StepModel

    (tmp_path / "profile.json").write_text(json.dumps(result))
    model = StepModel.load(tmp_path / "profile.json")
    # (on a tiny model a mixed step can time under the plain decode step: what prompt tokens add is never below 0)
    decode_2 = next(p["step_s"] for p in points if p["kind"] == "decode" and p["batch"] == 2)
    assert model.step(2, 32, 24) == pytest.approx(decode_2 + max(0.0, mixed[1]["step_s"] - decode_2))
    assert model.extra(2, 0) == 0.0
    ridge = result["peaks"]["ridge"]
    assert ridge == pytest.approx(5.0) and result["peaks"]["source"] == "flags"
    for p in points:
        assert p["mbu"] == pytest.approx(p["bytes"] / p["step_s"] / 20e9)
        assert p["mfu"] == pytest.approx(p["flops"] / p["step_s"] / 100e9)
        assert p["bound"] == ("memory" if p["flops"] / p["bytes"] < ridge else "compute")
        assert p["bytes"] > result["weight_bytes"]  # the weights once, plus the KV cache and embedding rows
    decode = [p for p in points if p["kind"] == "decode"]
    # the weights are read once per step whatever the batch: intensity grows with the batch
    assert decode[0]["intensity"] < decode[1]["intensity"] < decode[2]["intensity"]
    assert decode[2]["flops"] == pytest.approx(4 * decode[0]["flops"], rel=0.05)
    assert "context 32:" in answer(result)


def test_profile_command_writes_the_plot(tiny_llama_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_profile_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--dtype", "float32", "--contexts", "16",
                              "--max-batch", "2", "--prefill", "16", "--steps", "2", "--peak-bandwidth", "20e9",
                              "--peak-flops", "100e9", "--out", str(tmp_path)])
    assert cmd_profile(args) == 0
    assert (tmp_path / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "profile.json").exists()
    assert "MBU" in capsys.readouterr().out


def test_calibration_is_cached_per_cpu_model_and_recalibrated_on_request(tmp_path, monkeypatch):
    import json

    from inferd.telemetry import roofline

    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path))
    device = torch.device("cpu")
    key = roofline.device_key(device)
    assert roofline.cpu_model() in key and f"torch-{torch.__version__}" in key
    # a stale entry (far too low peaks) is used as it is ...
    (tmp_path / "peaks.json").write_text(json.dumps({key: {"bandwidth": 1.0, "flops/float32": 2.0}}))
    stale = roofline.peaks(device, torch.float32, max_other_load=1.0)
    assert (stale.bandwidth, stale.flops, stale.source) == (1.0, 2.0, "cache")
    # ... until recalibrate measures again and replaces it in the cache
    fresh = roofline.peaks(device, torch.float32, recalibrate=True, max_other_load=1.0)
    assert fresh.source == "calibrated" and fresh.bandwidth > 1e6 and fresh.flops > 1e6
    cached = json.loads((tmp_path / "peaks.json").read_text())[key]
    assert cached == {"bandwidth": fresh.bandwidth, "flops/float32": fresh.flops}


def test_cpus_of_one_name_with_other_features_calibrate_apart(monkeypatch):
    """Hosts lend CPUs of one model name ("AMD EPYC") with and without native bf16: their peaks must not share a
    cache entry (a bf16 peak measured where bf16 is emulated made MFU read above 100% where it is native)."""
    import builtins
    import io

    from inferd.telemetry import roofline

    real_open = builtins.open

    def cpuinfo(flags: str):
        def fake_open(path, *a, **kw):
            if path == "/proc/cpuinfo":
                return io.StringIO(f"model name\t: AMD EPYC\nflags\t\t: fpu sse2 {flags}\n")
            return real_open(path, *a, **kw)
        return fake_open

    keys = []
    for flags in ("avx2", "avx2 avx512f avx512_bf16", "avx2 avx512f avx512_bf16 amx_bf16 amx_tile"):
        monkeypatch.setattr(builtins, "open", cpuinfo(flags))
        keys.append(roofline.device_key(torch.device("cpu")))
    assert len(set(keys)) == 3 and all(k.startswith("AMD EPYC[avx2") for k in keys)
    assert "[avx2+avx512f+avx512_bf16+amx_bf16]" in keys[2]


def test_a_calibration_on_a_busy_cpu_is_not_cached(tmp_path, monkeypatch):
    """Real load: two spinning processes take the CPU while the calibration runs; its peaks serve this run only."""
    import subprocess
    import sys

    from inferd.telemetry import roofline

    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path))
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        got = roofline.peaks(torch.device("cpu"), torch.float32, max_other_load=0.1)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert got.source == "calibrated, busy: not cached" and got.bandwidth > 0
    assert not (tmp_path / "peaks.json").exists()


def test_profile_warns_when_points_beat_the_peaks():
    result = {"peaks": {"source": "cache"}, "points": [
        {"kind": "decode", "context": 16, "batch": 1, "bound": "memory", "mbu": 1.3, "mfu": 0.1},
        {"kind": "decode", "context": 16, "batch": 2, "bound": "memory", "mbu": 0.9, "mfu": 0.2}]}
    text = answer(result)
    assert "WARNING: 1 points above 100% MBU or MFU" in text and "--recalibrate" in text
    result["points"][0]["mbu"] = 0.95
    assert "WARNING" not in answer(result)


def test_calibration_is_sized_to_the_device():
    """A GPU gets a product and a copy large enough, timed over several runs, that sync and idle clocks do not
    dominate (a 2048^3 bf16 matmul is ~22 us on an H200); a CPU keeps the small ones. Both measure sane figures."""
    from inferd.telemetry.roofline import calibration_sizes, measure_bandwidth, measure_flops

    cpu_copy, cpu_n, cpu_inner = calibration_sizes(torch.device("cpu"))
    gpu_copy, gpu_n, gpu_inner = calibration_sizes(torch.device("cuda", 1))
    assert gpu_n >= 4 * cpu_n and gpu_copy >= 4 * cpu_copy and gpu_inner > cpu_inner == 1
    assert 1e8 < measure_bandwidth(torch.device("cpu"), nbytes=8 << 20, repeats=2, inner=2) < 1e13
    assert 1e8 < measure_flops(torch.device("cpu"), torch.float32, n=128, repeats=2, inner=2) < 1e14
