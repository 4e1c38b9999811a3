"""The static-shape decode path of CUDA graphs (inferd/engine/cuda_graph.py), run eagerly on a CPU: the same tokens
as the normal path by the exactness rule, padded rows that never touch a real sequence's KV, and on a CPU no capture
at all (the flag is ignored). The graphs themselves need a GPU: bench/gpu_check.sh."""

from __future__ import annotations

import argparse

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.engine.cuda_graph import DecodeGraphSpec, batch_ladder, context_buckets, wants_decode_graphs
from inferd.engine.runner import ModelRunner, kv_bytes_per_block
from parity import Reference, assert_greedy_parity, run_staggered

BLOCK = 16
MAX_MODEL_LEN = 256  # the micro model's context: 16 blocks
BUCKETS = (1, 2, 4, 8, 16)  # every width, so that uneven contexts land in different buckets
PROMPT_LENS = [3, 9, 17, 31, 47, 64, 90]
MAX_NEW = [12, 16, 9, 14, 11, 18, 10]  # uneven: the batch shrinks as requests finish (7 -> 8 padded, 5, 3, ...)


def static_runner(micro, blocks: int, max_batch: int = 8, **kw) -> ModelRunner:
    """A runner whose KV pool has one block beyond the `blocks` a KVCacheManager hands out: the padded rows'
    scratch block, as the engine reserves it on CUDA."""
    spec = DecodeGraphSpec(max_batch, MAX_MODEL_LEN, scratch_block=blocks, capture=False,
                           buckets=kw.pop("buckets", BUCKETS), **kw)
    return ModelRunner(micro.model, micro.cfg, blocks + 1, BLOCK, torch.float32, decode_graphs=spec)


def make_engine(micro, blocks: int, static: bool, **kw) -> Engine:
    engine = micro.engine(blocks=blocks, record_logits=True, max_model_len=MAX_MODEL_LEN, **kw)
    if static:
        engine.runner = static_runner(micro, blocks, kw.get("max_num_seqs", 8))
    return engine


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_ladders():
    assert batch_ladder(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_ladder(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_ladder(1) == [1]
    assert context_buckets(128, 8) == [8, 16, 32, 64, 128]
    assert context_buckets(17, 8) == [8, 16, 17]
    assert context_buckets(4, 8) == [4]


def test_plan_takes_only_one_token_decodes_that_sample_once(micro):
    graphs = static_runner(micro, 40, max_batch=8, max_gather_blocks=32).decode_graphs
    table = list(range(16))

    def decode(start: int, samples=1) -> tuple:
        return ([5], start, table, samples)

    assert graphs.plan([decode(3)]) == (1, 1)
    assert graphs.plan([decode(3), decode(16), decode(40)]) == (4, 4)  # 3 rows padded to 4; 41 tokens: 3 blocks -> 4
    assert graphs.plan([decode(100)] * 3) == (4, 8)
    assert graphs.plan([decode(100)] * 5) is None  # 8 x 8 blocks > max_gather_blocks
    assert graphs.plan([decode(3, samples=True)]) == (1, 1)  # a bool `samples` still counts as one
    assert graphs.plan([]) is None
    assert graphs.plan([decode(3)] * 9) is None  # beyond the ladder
    assert graphs.plan([decode(3), ([5, 6, 7], 10, table, 1)]) is None  # a prefill chunk
    assert graphs.plan([decode(3), ([5, 6, 7], 10, table, 3)]) is None  # a speculative verification row
    assert graphs.plan([decode(3), decode(9, samples=0)]) is None  # a row that gives no logits
    assert graphs.plan([decode(200)] * 3) is None  # 4 x 16 blocks > max_gather_blocks
    assert graphs.plan([decode(200)] * 2) == (2, 16)


def test_static_path_gives_the_normal_path_tokens(micro):
    """Staggered arrivals: decode-only steps (padded to 8, 4, 2 rows, several context buckets) take the static path,
    steps with prefill chunks the normal one; every token matches the normal engine by the exactness rule."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, micro.cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    params = [greedy(n) for n in MAX_NEW]
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64)
    normal, static = make_engine(micro, 100, False, **kw), make_engine(micro, 100, True, **kw)
    assert normal.runner.decode_graphs is None  # on a CPU the engine itself never turns the path on
    ref_reqs, _ = run_staggered(normal, prompts, params)
    ours, _ = run_staggered(static, prompts, params)
    for i, (ref, req) in enumerate(zip(ref_reqs, ours)):
        reference = Reference(ref.output_token_ids, torch.stack(ref.debug_logits).numpy())
        assert_greedy_parity(req.output_token_ids, req.debug_logits, reference, f"prompt {i}")
    steps = static.runner.decode_graphs.steps
    assert len({b for b, _ in steps}) >= 3, steps  # several padded batch sizes
    assert len({c for _, c in steps}) >= 3, steps  # uneven contexts in several buckets
    assert static.runner.decode_graphs.padded_rows > 0
    static.kv_cache.check_no_leaks()


def test_padded_rows_never_touch_a_real_sequence_kv(micro):
    """Three sequences of uneven length (41, 6 and 61 tokens of context), decoded at batch 4 (one padded row) with
    tables padded to 4 blocks: only the three new slots and the scratch block change, and logits and KV are those of
    the normal path."""
    blocks = 20
    runner = static_runner(micro, blocks)
    graphs = runner.decode_graphs
    tables = [[0, 1, 2], [3], [4, 5, 6, 7]]  # block 0 is a real sequence's: padding writing there would show
    lens = [40, 5, 60]
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for table, n in zip(tables, lens):
            runner.forward([(torch.randint(0, micro.cfg.vocab_size, (n,), generator=g).tolist(), 0, table, 1)])
    rows = [([7], 40, tables[0], 1), ([9], 5, tables[1], 1), ([11], 60, tables[2], 1)]
    assert graphs.plan(rows) == (4, 4)
    before = runner.kv.clone()
    logits = graphs.run_static(rows)
    after = runner.kv.clone()

    changed = (after != before).any(dim=-1).any(dim=2).any(dim=1).any(dim=0)  # [num_blocks, block_size]
    new_slots = {(t[p // BLOCK], p % BLOCK) for t, p in zip(tables, lens)}
    real = changed.clone()
    real[blocks] = False
    assert {tuple(x) for x in real.nonzero().tolist()} == new_slots
    assert changed[blocks].any(), "the padded row wrote nowhere in the scratch block"

    runner.kv.copy_(before)
    with torch.inference_mode():
        hidden, logits_rows = runner.forward(rows)
        expected = micro.model.compute_logits(hidden[logits_rows])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after[:, :, :, :blocks], runner.kv[:, :, :, :blocks], rtol=1e-5, atol=1e-5)


def test_cpu_ignores_the_flag_and_never_captures(micro, monkeypatch):
    def no_capture(*args, **kwargs):
        raise AssertionError("a CUDA graph capture was attempted")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_capture)
    monkeypatch.setattr(torch.cuda, "graph", no_capture)
    assert wants_decode_graphs(EngineConfig(device="cuda"))
    assert wants_decode_graphs(EngineConfig(device="cuda:1"))
    assert not wants_decode_graphs(EngineConfig(device="cuda", cuda_graphs=False))
    assert not wants_decode_graphs(EngineConfig(device="cuda", tensor_parallel=2))
    assert not wants_decode_graphs(EngineConfig(device="cpu", cuda_graphs=True))

    per_block = kv_bytes_per_block(micro.cfg, BLOCK, torch.float32)
    outputs = []
    for flag in (True, False):
        engine = Engine(micro.model, micro.cfg, EngineConfig(kv_cache_bytes=per_block * 32, cuda_graphs=flag),
                        torch.float32)
        assert engine.runner.decode_graphs is None
        assert engine.kv_cache.num_blocks == 32  # no block kept back for padding
        outputs.append([r.output_token_ids for r in engine.generate([[1, 5, 9], [4, 4, 4, 4, 4]], greedy(6))])
    assert outputs[0] == outputs[1]
    with pytest.raises(RuntimeError, match="CUDA device"):
        static_runner(micro, 8).decode_graphs.capture()


def test_no_cuda_graphs_flag():
    from inferd.cli.engine_flags import add_engine_args, engine_config
    from inferd.cli.serve import worker_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).cuda_graphs is True
    args = p.parse_args(["--no-cuda-graphs"])
    assert engine_config(args).cuda_graphs is False
    args.heartbeat_interval = 0.5
    assert "--no-cuda-graphs" in worker_args(args, "m")
    args = p.parse_args([])
    args.heartbeat_interval = 0.5
    assert "--no-cuda-graphs" not in worker_args(args, "m")

