"""Sliding-window layers in the paged KV cache (inferd/engine/kv_groups.py, kv_cache.py): a sliding group gives back
the blocks that left its window, and the outputs are those of keeping every position (the exactness rule,
tests/parity.py), under chunked prefill, preemption, a prefix-cache hit and the static decode path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, KVCacheManager, Request, SamplingParams
from inferd.engine.kv_groups import KVGroup, kv_cache_groups, sliding_group_cap, split_kv_budget
from inferd.engine.runner import kv_bytes_per_block
from parity import assert_same_output

WINDOW, BS, STEP_TOKENS, MAX_SEQS = 8, 4, 16, 4
# the most blocks a request may hold in the sliding group: positions [c - WINDOW + 1, c + n) with n <= STEP_TOKENS
SLIDING_BOUND = -(-(WINDOW - 1 + STEP_TOKENS) // BS) + 1


@pytest.fixture(scope="module")
def windowed(micro):
    """micro's weights with layer 0 sliding (window 8) and layer 1 attending to everything."""
    from inferd.models.build import build_model

    cfg = dataclasses.replace(micro.cfg, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    model = build_model(cfg, micro.hf.state_dict(), torch.float32)

    def engine(blocks_per_layer: int, reclaim: bool = True, **kw) -> Engine:
        per_block = kv_bytes_per_block(cfg, BS, torch.float32)
        config = EngineConfig(kv_cache_bytes=per_block * blocks_per_layer, block_size=BS, max_num_seqs=MAX_SEQS,
                              max_num_batched_tokens=STEP_TOKENS, record_logits=True, sliding_window_reclaim=reclaim,
                              kernels="reference", **kw)
        return Engine(model, cfg, config, torch.float32)

    return engine


PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def run(engine: Engine, batch: list[list[int]], params: SamplingParams = PARAMS) -> tuple[list[Request], list[int]]:
    """Every prompt at once, stepped to the end; returns the requests and the most blocks any request held in
    each group after a step."""
    reqs = [engine.requests[engine.add_request(p, params)] for p in batch]
    most = [0] * len(engine.kv_cache.pools)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        for r in engine.scheduler.running:
            most = [max(m, n) for m, n in zip(most, engine.kv_cache.blocks_in_use(r))]
        steps += 1
        assert steps < 10_000
    engine.kv_cache.check_no_leaks()
    return reqs, most


@pytest.fixture(scope="module")
def kept_everything(windowed):
    """The reference: the same model keeping every position of every layer (one KV cache group)."""
    return run(windowed(64, reclaim=False), prompts(3, 37))


@pytest.mark.parametrize("static_decode", [False, True])
def test_sliding_group_gives_back_blocks_and_outputs_match_keeping_everything(windowed, kept_everything,
                                                                              static_decode):
    """static_decode: the CUDA graphs' static-shape decode path (uncaptured on a CPU), the sliding group's slots and
    tables in its input buffer."""
    batch = prompts(3, 37)  # 37..43 tokens, + 20 generated: 3 chunks of 16 tokens each, then decodes past the window
    engine = windowed(64, static_decode=static_decode)
    ours, most = run(engine, batch)
    if static_decode:
        assert engine.runner.decode_graphs.steps  # decode steps took that path
    ref, kept = kept_everything
    for a, b in zip(ours, ref):
        assert_same_output(a, b, PARAMS, f"prompt of {a.num_prompt_tokens}")
    full, sliding = most
    assert full >= -(-(43 + 19) // BS) == kept[0]  # the full group holds the whole context, as one group does
    assert sliding <= SLIDING_BOUND < full  # the sliding group only the window and the step's tokens


def test_preempted_requests_recompute_the_same_outputs(windowed):
    """A pool too small for three long requests at once: some are preempted and recomputed."""
    batch = prompts(3, 40)
    engine = windowed(28)
    ours, most = run(engine, batch)
    assert engine.scheduler.num_preemptions > 0 and most[1] <= SLIDING_BOUND
    reference = windowed(28, reclaim=False)
    ref, _ = run(reference, batch)
    assert reference.scheduler.num_preemptions > 0
    for a, b in zip(ours, ref):
        assert_same_output(a, b, PARAMS, f"prompt of {a.num_prompt_tokens}")


def test_prefix_hit_past_the_window(windowed):
    """A second request extending a finished one hits the cache beyond the window: its sliding table holds the null
    block before the window and the cached blocks of the window."""
    first = prompts(1, 40)[0]
    second = first + [5, 6, 7, 8, 9, 10]
    outs = []
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for reclaim in (True, False):
        engine = windowed(64, reclaim=reclaim)
        run(engine, [first], SamplingParams(max_tokens=1))
        (req,), _ = run(engine, [second], params)
        outs.append(req)
    ours, ref = outs
    # every full block of the first request's prompt, past the window (its last chunk's too: a one-token request
    # publishes its blocks before its token frees them)
    assert ours.num_cached_tokens == ref.num_cached_tokens == 40
    assert_same_output(ours, ref, params, "prefix hit")


def test_sliding_hit_needs_the_window_before_the_hit_point():
    """vLLM's rule: a hit is as long as the full group's run of cached blocks only where the sliding group still
    has the blocks of the window before it; else it is cut back to where it does."""
    kv = KVCacheManager([32, 12], BS, windows=[0, WINDOW])
    null = kv.pools[1].null
    tokens = list(range(100, 133))  # 8 full blocks and one token

    def new(rid, toks):
        return Request(rid, toks, SamplingParams(max_tokens=4))

    a = new("a", tokens)
    assert kv.admit(a, kv.match_prefix(a), len(tokens))
    a.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(a)
    assert kv.allocate(a, 1)  # the next step starts at 33: the blocks before position 26 left the window
    assert a.window_block_ids[0][:6] == [null] * 6 and kv.blocks_in_use(a) == [9, 3]
    full_blocks = a.block_ids[:8]
    kv.free(a)
    assert kv.match_prefix(new("b", tokens)) == full_blocks  # the window before position 32 is cached
    # d hits 7 blocks (sliding: those of 5 and 6), so they become the most recently used of the evictable ones
    d = new("d", tokens[:29])
    hits = kv.match_prefix(d)
    assert len(hits) == 7 and kv.admit(d, hits, 1)
    kv.free(d)
    # c takes the sliding pool's 4 free blocks and evicts the 6 least recently used cached ones, block 7's among them
    c = new("c", list(range(300, 340)))
    assert kv.admit(c, [], 40) and kv.pools[1].num_free == 2
    b = new("b", tokens)
    hits = kv.match_prefix(b)
    assert hits == full_blocks[:7]  # cut back to 7 blocks: those of 5 and 6 (the window before 28) are there
    kv.free(c)
    assert kv.admit(b, hits, len(tokens) - 28) and b.num_cached_tokens == 28
    assert b.window_block_ids[0][:5] == [null] * 5 and kv.blocks_in_use(b) == [9, 4]
    kv.free(b)
    kv.check_no_leaks()


def test_groups_and_the_split_of_the_budget(windowed, micro):
    cfg = dataclasses.replace(micro.cfg, num_hidden_layers=6, sliding_window=512,
                              layer_types=["sliding_attention"] * 5 + ["full_attention"])
    groups = kv_cache_groups(cfg)
    assert groups == [KVGroup(0, (5,)), KVGroup(512, (0, 1, 2, 3, 4))]
    assert kv_cache_groups(cfg, reclaim=False) == [KVGroup(0, tuple(range(6)))]
    assert kv_cache_groups(micro.cfg) == [KVGroup(0, (0, 1))]  # no sliding layer: one group, as before
    cap = sliding_group_cap(512, 16, 8, 256)
    assert cap == 8 * 34 + 16 + 1
    full, sliding = split_kv_budget(groups, 6 * 1000 * 100, 100, 16, 8, 256)
    assert sliding.num_blocks == cap and full.num_blocks == (6 * 1000 - 5 * cap)  # the rest to the full layers
    small = split_kv_budget(groups, 6 * 100 * 100, 100, 16, 8, 256)
    assert [g.num_blocks for g in small] == [100, 100]  # never less than keeping everything would give
    engine = windowed(64)
    full_pool, sliding_pool = engine.kv_cache.pools
    assert [full_pool.num_blocks, sliding_pool.num_blocks] == [g.num_blocks - bool(g.window)
                                                               for g in engine.kv_groups]
    # the snapshot (metrics, the autoscaler) reports the fullest group: here the sliding one, the smaller pool
    rid = engine.add_request(prompts(1, 40)[0], PARAMS)
    for _ in range(4):
        engine.step()
    held = engine.kv_cache.blocks_in_use(engine.requests[rid])
    assert held[1] / sliding_pool.num_blocks > held[0] / full_pool.num_blocks
    snap = engine.snapshot()
    assert (snap.kv_blocks_in_use, snap.kv_num_blocks) == (held[1], sliding_pool.num_blocks)
    engine.abort(rid)
    engine.kv_cache.check_no_leaks()
