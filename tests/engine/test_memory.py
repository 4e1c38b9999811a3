"""The KV pool's size (inferd/engine/memory.py): `--kv-cache-bytes` when given, the default on a CPU, and on CUDA
what the card has left within `--gpu-memory-utilization` after the weights and a profiled step. The arithmetic is
checked here; the profile itself needs a GPU (bench/gpu_check.py records the pool it sized)."""

from __future__ import annotations

import argparse

import pytest
import torch

from inferd.cli.engine_flags import add_engine_args, engine_config
from inferd.cli.serve import worker_args
from inferd.config import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_BYTES, EngineConfig
from inferd.engine import Engine
from inferd.engine.memory import GPU_MEMORY_HEADROOM_BYTES, kv_pool_bytes, resolve_kv_cache_bytes, run_largest_step
from inferd.engine.runner import kv_bytes_per_block

GIB = 1 << 30


def test_the_pool_is_what_the_utilization_leaves():
    # an H200's 141 GiB at 0.9, 16 GiB of weights in use, a 3 GiB step: 126.9 - 16 - 3 - headroom
    total = 141 * GIB
    assert kv_pool_bytes(total, 16 * GIB, 3 * GIB, 0.9) == int(0.9 * total) - 19 * GIB - GPU_MEMORY_HEADROOM_BYTES
    # another process on the card counts against it too (in_use = total - free)
    assert kv_pool_bytes(total, 40 * GIB, 3 * GIB, 0.9) == kv_pool_bytes(total, 16 * GIB, 3 * GIB, 0.9) - 24 * GIB
    assert kv_pool_bytes(total, 0, 0, 1.0, headroom=0) == total


@pytest.mark.parametrize("utilization", [0.0, -0.5, 1.5])
def test_a_utilization_outside_0_1_is_refused(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_pool_bytes(80 * GIB, 0, 0, utilization)


def test_a_card_without_room_says_what_to_change():
    with pytest.raises(ValueError, match="--gpu-memory-utilization.*--max-num-batched-tokens.*--kv-cache-bytes"):
        kv_pool_bytes(24 * GIB, 20 * GIB, 2 * GIB, 0.9)


def test_on_a_cpu_the_default_or_the_given_bytes(micro):
    assert resolve_kv_cache_bytes(micro.model, micro.cfg, EngineConfig(), torch.float32,
                                  torch.float32) == DEFAULT_KV_CACHE_BYTES
    assert resolve_kv_cache_bytes(micro.model, micro.cfg, EngineConfig(kv_cache_bytes=12345), torch.float32,
                                  torch.float32) == 12345
    engine = Engine(micro.model, micro.cfg, EngineConfig(), torch.float32)
    assert engine.kv_cache_bytes == DEFAULT_KV_CACHE_BYTES
    assert engine.kv_cache.num_blocks == DEFAULT_KV_CACHE_BYTES // kv_bytes_per_block(micro.cfg, 16, torch.float32)


def test_the_flags_reach_the_engine_and_the_workers():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--gpu-memory-utilization", "0.8"])
    args.heartbeat_interval, args.echo = 0.5, False
    assert engine_config(args).kv_cache_bytes is None and engine_config(args).gpu_memory_utilization == 0.8
    forwarded = worker_args(args, "m")
    assert "--kv-cache-bytes" not in forwarded  # the worker sizes its pool from its own card
    assert forwarded[forwarded.index("--gpu-memory-utilization") + 1] == "0.8"
    args = p.parse_args(["--kv-cache-bytes", "2G"])
    args.heartbeat_interval, args.echo = 0.5, False
    assert engine_config(args).kv_cache_bytes == 2 * GIB
    assert engine_config(args).gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION
    forwarded = worker_args(args, "m")
    assert forwarded[forwarded.index("--kv-cache-bytes") + 1] == str(2 * GIB)


def test_the_profiled_step_runs_on_any_device(micro):
    """The step profile_activation_peak measures on CUDA, run here: a chunk of the whole token budget and the
    logits of max_num_seqs rows, on a pool of just its blocks (a row or table built wrong would raise)."""
    for budget, max_len in ((256, None), (100, 64)):  # the chunk is capped by max_model_len
        run_largest_step(micro.model, micro.cfg, EngineConfig(max_num_batched_tokens=budget, max_model_len=max_len,
                                                              max_num_seqs=8), torch.float32, torch.float32)
