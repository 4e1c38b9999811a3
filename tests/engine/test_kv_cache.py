"""KVCacheManager: reference counts, prefix hits, LRU eviction, all-or-nothing allocation, no leaks."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from inferd.engine import KVCacheManager, Request, SamplingParams, hash_block_tokens, hash_prompt_blocks


def req(tokens, rid="r") -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def admit(kv: KVCacheManager, r: Request) -> bool:
    hits = kv.match_prefix(r)
    ok = kv.admit(r, hits, r.num_tokens - len(hits) * kv.block_size)
    return ok


def compute_all(kv: KVCacheManager, r: Request) -> None:
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)


def test_hash_chain_is_stable_across_processes():
    tokens = list(range(100, 148))
    here = [h.hex() for h in hash_prompt_blocks(tokens, 16)]
    code = ("from inferd.engine import hash_prompt_blocks; "
            "print(','.join(h.hex() for h in hash_prompt_blocks(list(range(100, 148)), 16)))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip().split(",")
    assert here == other and len(here) == 3
    # chained: the same block content under a different parent hashes differently
    assert hash_block_tokens(None, tokens[16:32]) != hash_prompt_blocks(tokens, 16)[1]


def test_prefixes_are_shared_only_under_the_same_salt():
    """The salt (a tenant's, or its cache group's) starts the chain: what the worker caches and what the router
    computes agree, and another salt matches nothing, not even the first block."""
    from inferd.gateway.router import Router

    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(1, 14))  # 3 full blocks + 1 token

    def salted(rid, salt):
        return Request(rid, list(tokens), SamplingParams(max_tokens=4, cache_salt=salt))

    a = salted("a", "tenant-a")
    assert admit(kv, a)
    compute_all(kv, a)
    assert kv.match_prefix(salted("b", "tenant-b")) == []
    assert kv.match_prefix(req(tokens, "unsalted")) == []
    assert kv.match_prefix(salted("a2", "tenant-a")) == a.block_ids[:3]
    assert hash_prompt_blocks(tokens, 4, "tenant-a") == a.block_hashes
    router = Router()  # what the router computes for affinity (from the attached worker's block size)
    router.workers.append(SimpleNamespace(hello=SimpleNamespace(kv_block_size=4)))
    assert router.prompt_hashes(tokens, "tenant-a") == a.block_hashes
    assert router.prompt_hashes(tokens, "tenant-b")[0] != a.block_hashes[0]
    kv.free(a)
    kv.check_no_leaks()


def test_allocate_free_and_no_leak():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req(range(10), "a")
    assert admit(kv, a)
    assert len(a.block_ids) == 3 and kv.num_free_blocks == 5
    a.num_computed_tokens = 10
    assert kv.allocate(a, 3)  # 10 computed + 3 new = 13 tokens -> 4 blocks
    assert len(a.block_ids) == 4
    kv.free(a)
    kv.check_no_leaks()


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req(range(12), "a")
    assert admit(kv, a)
    b = req(range(100, 108), "b")
    assert not admit(kv, b)  # needs 2, only 1 free
    assert b.block_ids == [] and kv.num_free_blocks == 1
    kv.free(a)
    kv.check_no_leaks()


def test_prefix_hit_shares_blocks_and_counts():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req(list(range(1, 14)), "a")  # 3 full blocks + 1 token
    assert admit(kv, a)
    compute_all(kv, a)
    b = req(list(range(1, 13)) + [99, 98], "b")  # shares 3 full blocks
    hits = kv.match_prefix(b)
    assert hits == a.block_ids[:3]
    assert kv.admit(b, hits, b.num_tokens - 12)
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 12
    assert all(kv.ref_counts[x] == 2 for x in hits)
    assert kv.stats.hits == 12 and kv.stats.queries == a.num_tokens + b.num_tokens
    kv.free(a)
    kv.free(b)
    kv.check_no_leaks()
    assert len(kv.evictable) == 3  # cached content stays, evictable


def test_whole_prompt_hit_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req(range(8), "a")
    assert admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    b = req(range(8), "b")
    assert len(kv.match_prefix(b)) == 1  # 2 full blocks cached, but one must be recomputed for logits
    kv.check_no_leaks()


def test_lru_eviction_recycles_oldest_and_forgets_hash():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req([1, 2, 3, 4], "a")
    assert admit(kv, a)
    compute_all(kv, a)
    kv.free(a)  # 2 cached, evictable blocks
    b = req([5, 6, 7, 8, 9, 10], "b")  # needs 3 blocks: 2 free + 1 evicted
    assert admit(kv, b)
    assert len(kv.evictable) == 1
    # the tail block of `a` was evicted first; its head block ([1, 2]) still hits
    c = req([1, 2, 3, 4, 11], "c")
    assert len(kv.match_prefix(c)) == 1
    kv.free(b)
    kv.check_no_leaks()


def test_double_free_is_caught():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req(range(4), "a")
    assert admit(kv, a)
    blocks = list(a.block_ids)
    kv.free(a)
    a.block_ids = blocks
    with pytest.raises(AssertionError):
        kv.free(a)


def test_prefix_caching_can_be_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = req(range(9), "a")
    assert admit(kv, a)
    compute_all(kv, a)
    assert kv.match_prefix(req(range(9), "b")) == []
    kv.free(a)
    assert len(kv.free_blocks) == 8
