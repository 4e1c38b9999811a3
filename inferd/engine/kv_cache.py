"""KVCacheManager: one pool of fixed-size KV blocks, reference-counted, with prefix caching.

A full block is identified by a hash chain over token contents: hash(parent block's hash, this block's token ids).
The chain is stable across processes and machines (SHA-256 over a fixed byte encoding, never Python's hash()), so
a router can compute which worker holds a prompt's prefix. A block with refcount 0 that carries a hash stays in the
cache as "evictable" and is reused on a hit or recycled least-recently-used first when the pool runs dry.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
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


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # no cached content
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0 but cached, LRU first
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.stats = PrefixCacheStats()

    # ---- capacity -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus evictable."""
        return len(self.free_blocks) + len(self.evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def check_no_leaks(self) -> None:
        """Raises AssertionError unless every block is unreferenced and free or evictable."""
        referenced = [b for b, c in enumerate(self.ref_counts) if c != 0]
        assert not referenced, f"blocks still referenced: {referenced[:10]} (of {len(referenced)})"
        assert len(self.free_blocks) + len(self.evictable) == self.num_blocks, (
            f"free {len(self.free_blocks)} + evictable {len(self.evictable)} != {self.num_blocks} blocks")

    # ---- prefix cache ---------------------------------------------------------------------------------------
    def _update_hashes(self, request: Request) -> None:
        """Extend the request's hash chain over its full blocks."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs],
                                            request.params.cache_salt))

    def match_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding the longest prefix of the request's tokens; at least one token is left to
        compute, because the last prompt position must run through the model to give logits."""
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for h in request.block_hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation -----------------------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if self.free_blocks:
            return self.free_blocks.popleft()
        block, _ = self.evictable.popitem(last=False)  # least recently used
        del self.cached[self.block_hash[block]]
        self.block_hash[block] = None
        return block

    def admit(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """First allocation of a waiting request: take the prefix-cache hits, then room for num_new_tokens
        beyond them. All or nothing."""
        evictable_hits = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        num_cached_tokens = len(cached_blocks) * self.block_size
        need = self.blocks_needed(num_cached_tokens + num_new_tokens) - len(cached_blocks)
        if need > self.num_free_blocks - evictable_hits:
            return False
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
        request.block_ids = list(cached_blocks)
        request.num_computed_tokens = num_cached_tokens
        request.num_cached_tokens = num_cached_tokens
        self.stats.queries += request.num_tokens
        self.stats.hits += num_cached_tokens
        return self._grow(request, num_new_tokens)

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Room for num_new_tokens more tokens after the computed ones. All or nothing."""
        return self._grow(request, num_new_tokens)

    def _grow(self, request: Request, num_new_tokens: int) -> bool:
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            block = self._take_free_block()
            self.ref_counts[block] = 1
            request.block_ids.append(block)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are now full of computed KV under their hashes."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(num_full):
            block = request.block_ids[i]
            if self.block_hash[block] is not None:
                continue
            h = request.block_hashes[i]
            if h in self.cached:  # the same content computed twice concurrently: keep the first copy
                continue
            self.block_hash[block] = h
            self.cached[h] = block

    def free(self, request: Request) -> None:
        """Drop the request's references. Tail blocks are released first, so among this request's blocks the
        tail is evicted before the shared-looking head."""
        for block in reversed(request.block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self.evictable[block] = None  # most recently used end
                else:
                    self.free_blocks.append(block)
        request.block_ids = []
        request.num_computed_tokens = 0
