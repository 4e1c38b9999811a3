"""KVCacheManager: pools of fixed-size KV blocks, reference-counted, with prefix caching; one pool per KV cache
group (kv_groups.py: the full-attention layers, the layers of each sliding window).

A full block is identified by a hash chain over token contents: hash(parent block's hash, this block's token ids).
The chain is stable across processes and machines (SHA-256 over a fixed byte encoding, never Python's hash()), so
a router can compute which worker holds a prompt's prefix. A block with refcount 0 that carries a hash stays in the
cache as "evictable" and is reused on a hit or recycled least-recently-used first when the pool runs dry.

Sliding groups (after vLLM's SlidingWindowManager): before a request computes from position c, a sliding group gives
back the request's blocks that lie wholly before c - window + 1 (no query of this step or a later one sees them) and
puts its null block in their place in the table: the attention masks those positions anyway, so the null block is
never read for real (its contents are zeros, or the CUDA graphs' padded rows, which is where it doubles as their
scratch block). A request is admitted or grown only when every group has the blocks it needs. A prefix hit must hold
in every group: the full group needs each block before the hit point, a sliding group the blocks of the window before
it (the ones it gave back earlier may be gone), so the hit is the longest prefix both have.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from .request import Request

_ROOT_HASH = b"inferd-kv-v1"


def hash_block_tokens(parent: bytes | None, token_ids: list[int] | tuple[int, ...], salt: str = "") -> bytes:
    """The stable content hash of one full block, chained to its parent block's hash. The first block's hash starts
    from the salt (a tenant's, or its cache group's): the same prefix under two salts shares nothing, so a tenant
    cannot learn through cache hits, routing or latency that another one sent it."""
    h = hashlib.sha256(parent if parent is not None else _ROOT_HASH)
    if parent is None and salt:
        h.update(b"\0salt\0" + salt.encode())
    h.update(len(token_ids).to_bytes(4, "little"))
    for t in token_ids:
        h.update(int(t).to_bytes(4, "little", signed=False))
    return h.digest()


def block_salt(cache_salt: str, lora: list | None = None) -> str:
    """The salt a request's blocks are hashed under: its cache salt, and its LoRA adapter's digest (an adapter's KV
    is not the base model's, nor another adapter's). The router hashes prompts with the same salt."""
    return cache_salt if lora is None else f"{cache_salt}|lora:{lora[2]}"


def hash_prompt_blocks(token_ids: list[int], block_size: int, salt: str = "") -> list[bytes]:
    """Hash chain of every full block of token_ids."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], salt)
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of which served from the cache


class BlockPool:
    """One group's blocks: reference counts, content hashes, the free list and the evictable (cached, unreferenced)
    blocks, least recently used first. A sliding group's null block (id num_blocks) lies outside the pool."""

    def __init__(self, num_blocks: int, window: int = 0):
        self.num_blocks = num_blocks
        self.window = window
        self.null = num_blocks if window else -1  # -1: a full group has none (no table entry is ever -1)
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # no cached content
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0 but cached, LRU first
        self.cached: dict[bytes, int] = {}  # hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)  # least recently used
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} freed twice"
        if self.ref_counts[block] == 0:
            if self.block_hash[block] is not None:
                self.evictable[block] = None  # most recently used end
            else:
                self.free_blocks.append(block)

    def publish(self, block: int, h: bytes) -> None:
        if self.block_hash[block] is None and h not in self.cached:  # a duplicate computed concurrently: keep one
            self.block_hash[block] = h
            self.cached[h] = block

    def first_needed(self, position: int, block_size: int) -> int:
        """The first block index a query at position (or later) still sees: 0 in a full group."""
        return max(0, position - self.window + 1) // block_size if self.window else 0

    def check_no_leaks(self, label: str) -> None:
        referenced = [b for b, c in enumerate(self.ref_counts) if c != 0]
        assert not referenced, f"{label}: blocks still referenced: {referenced[:10]} (of {len(referenced)})"
        assert self.num_free == self.num_blocks, (
            f"{label}: free {len(self.free_blocks)} + evictable {len(self.evictable)} != {self.num_blocks} blocks")


class KVCacheManager:
    def __init__(self, num_blocks: int | list[int], block_size: int = 16, enable_prefix_caching: bool = True,
                 windows: list[int] | None = None):
        """num_blocks: the pool's blocks, or each group's (a sliding group's null block not counted: it is the one
        after them); windows: each group's sliding window (0: full attention), default one full group."""
        counts = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        windows = [0] * len(counts) if windows is None else list(windows)
        if len(windows) != len(counts) or min(counts) < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token per group (got {counts} x {block_size}, "
                             f"windows {windows})")
        self.pools = [BlockPool(n, w) for n, w in zip(counts, windows)]
        self.num_blocks = sum(counts)  # all groups' (what the metrics count)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        # group 0's state under its old names (one group: the whole cache)
        pool = self.pools[0]
        self.ref_counts, self.block_hash, self.free_blocks = pool.ref_counts, pool.block_hash, pool.free_blocks
        self.evictable, self.cached = pool.evictable, pool.cached

    @staticmethod
    def table(request: Request, group: int) -> list[int]:
        """The request's block table in a group: group 0's is request.block_ids, the others' window_block_ids."""
        return request.block_ids if group == 0 else request.window_block_ids[group - 1]

    # ---- capacity -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, in all groups: free plus evictable."""
        return sum(p.num_free for p in self.pools)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        """The fullest group's share of blocks in use (it is the one that runs out)."""
        return max(1.0 - p.num_free / p.num_blocks for p in self.pools)

    def short_of(self, num_tokens: int, max_step_tokens: int) -> tuple[int, int] | None:
        """(blocks needed, blocks the group has) of the first group that could never hold a request of num_tokens
        computed in steps of at most max_step_tokens; None when every group could."""
        need = self.blocks_needed(num_tokens)
        for pool in self.pools:
            n = need if not pool.window else min(need, self.blocks_needed(pool.window - 1 + max_step_tokens) + 1)
            if n > pool.num_blocks:
                return n, pool.num_blocks
        return None

    def blocks_in_use(self, request: Request) -> list[int]:
        """Per group, the blocks the request holds (null entries not counted)."""
        return [sum(1 for b in self.table(request, g) if b != p.null) for g, p in enumerate(self.pools)]

    def check_no_leaks(self) -> None:
        """Raises AssertionError unless every block of every group is unreferenced and free or evictable."""
        for g, pool in enumerate(self.pools):
            pool.check_no_leaks(f"group {g}" if len(self.pools) > 1 else "pool")

    # ---- prefix cache ---------------------------------------------------------------------------------------
    def _update_hashes(self, request: Request) -> None:
        """Extend the request's hash chain over its full blocks."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs],
                                            block_salt(request.params.cache_salt, request.params.lora)))

    def match_prefix(self, request: Request) -> list[int]:
        """Group 0's table of the longest prefix of the request's tokens cached in every group (the hit point
        k blocks: a full group holds blocks [0, k), a sliding one those of the window before k; the blocks before
        that are its null block); at least one token is left to compute, because the last prompt position must run
        through the model to give logits."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return []  # a request computing prompt logprobs needs every position's hidden state: it runs them all
        self._update_hashes(request)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        k = len(hashes)
        for pool in self.pools:  # a full group: its run of hits from the start
            if not pool.window:
                k = next((i for i, h in enumerate(hashes[:k]) if h not in pool.cached), k)
        while k > 0:  # sliding groups: the window before k, else try k = the missing block (vLLM's right-to-left)
            missing = None
            for pool in self.pools:
                if pool.window:
                    first = pool.first_needed(k * self.block_size, self.block_size)
                    missing = next((i for i in range(k - 1, first - 1, -1) if hashes[i] not in pool.cached), None)
                    if missing is not None:
                        break
            if missing is None:
                break
            k = missing
        return self._hit_table(request, 0, k)

    def _hit_table(self, request: Request, group: int, k: int) -> list[int]:
        """A group's table for a prefix hit of k blocks (match_prefix has checked they are cached)."""
        pool = self.pools[group]
        first = pool.first_needed(k * self.block_size, self.block_size)
        return [pool.null] * first + [pool.cached[h] for h in request.block_hashes[first:k]]

    # ---- allocation -----------------------------------------------------------------------------------------
    def admit(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """First allocation of a waiting request: take the prefix-cache hits (cached_blocks: match_prefix's), then
        room for num_new_tokens beyond them, in every group. All or nothing."""
        k = len(cached_blocks)
        tables = [cached_blocks] + [self._hit_table(request, g, k) for g in range(1, len(self.pools))]
        need = self.blocks_needed(k * self.block_size + num_new_tokens) - k
        for pool, hits in zip(self.pools, tables):
            evictable_hits = sum(1 for b in hits if b != pool.null and pool.ref_counts[b] == 0)
            if need > pool.num_free - evictable_hits:
                return False
        for pool, hits in zip(self.pools, tables):
            for b in hits:
                if b != pool.null:
                    pool.ref(b)
        request.block_ids = list(cached_blocks)
        request.window_block_ids = [list(t) for t in tables[1:]]
        num_cached_tokens = k * self.block_size
        request.num_computed_tokens = num_cached_tokens
        request.num_cached_tokens = num_cached_tokens
        self.stats.queries += request.num_tokens
        self.stats.hits += num_cached_tokens
        return self._grow(request, num_new_tokens)

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Room for num_new_tokens more tokens after the computed ones, in every group. All or nothing (the blocks
        a sliding group gives back because they left the window are given back either way)."""
        return self._grow(request, num_new_tokens)

    def _slide(self, request: Request) -> None:
        """Sliding groups give back the request's blocks that no query from num_computed_tokens on sees."""
        for g, pool in enumerate(self.pools):
            if not pool.window:
                continue
            table = self.table(request, g)
            i = min(pool.first_needed(request.num_computed_tokens, self.block_size), len(table)) - 1
            while i >= 0 and table[i] != pool.null:  # the null entries are a prefix: stop at the first one
                pool.release(table[i])
                table[i] = pool.null
                i -= 1

    def _grow(self, request: Request, num_new_tokens: int) -> bool:
        if len(self.pools) == 1 and not self.pools[0].window:  # one full group: the short path of every step
            pool = self.pools[0]
            need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
            if need > pool.num_free:
                return False
            for _ in range(need):
                request.block_ids.append(pool.take())
            return True
        self._slide(request)
        total = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        needs = [total - len(self.table(request, g)) for g in range(len(self.pools))]
        if any(n > p.num_free for n, p in zip(needs, self.pools)):
            return False
        for g, (pool, n) in enumerate(zip(self.pools, needs)):
            table = self.table(request, g)
            for _ in range(n):
                table.append(pool.take())
        return True

    def fits_after_freeing(self, request: Request, cached_blocks: list[int], num_new_tokens: int,
                           victims: list[Request]) -> bool:
        """A dry run of admit() on the state after freeing the victims: in each group a block comes free when the
        victims hold all its references, except a prefix hit of the request (admit() takes those separately)."""
        k = len(cached_blocks)
        need = self.blocks_needed(k * self.block_size + num_new_tokens) - k
        for g, pool in enumerate(self.pools):
            hits = set(cached_blocks if g == 0 else self._hit_table(request, g, k)) - {pool.null}
            available = pool.num_free - sum(1 for b in hits if pool.ref_counts[b] == 0)
            dropped = Counter(b for v in victims for b in self.table(v, g) if b != pool.null)
            available += sum(1 for b, n in dropped.items() if n == pool.ref_counts[b] and b not in hits)
            if need > available:
                return False
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are now full of computed KV under their hashes, in every group."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for g, pool in enumerate(self.pools):
            table = self.table(request, g)
            for i in range(num_full):
                if table[i] != pool.null:
                    pool.publish(table[i], request.block_hashes[i])

    def free(self, request: Request) -> None:
        """Drop the request's references in every group. Tail blocks are released first, so among this request's
        blocks the tail is evicted before the shared-looking head."""
        for g, pool in enumerate(self.pools):
            for block in reversed(self.table(request, g)):
                if block != pool.null:
                    pool.release(block)
        request.block_ids = []
        request.window_block_ids = [[] for _ in self.pools[1:]]
        request.num_computed_tokens = 0
