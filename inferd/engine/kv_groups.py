"""KV cache groups: which layers share block tables, and how the KV pool's bytes are split between them.

A model whose layers all attend to their whole context has one group: one pool of blocks, one block table per
request, every layer's KV of a block in the same block id (the cache as it always was). A model with sliding-window
layers (Mistral, Gemma 2/3, gpt-oss) has a group for its full-attention layers and one per sliding window; a sliding
group gives back a request's blocks that fall wholly out of its window (kv_cache.py), so it needs only about
window / block_size blocks per request however long the context grows (vLLM's hybrid KV cache manager does the same).

The split of the bytes (split_kv_budget): each sliding group gets the most blocks it can ever hold at once (every
sequence slot at its window plus one step's tokens: sliding_group_cap), never more than an equal share would give it;
the rest goes to the full-attention group, whose need grows with the context. So a sliding group never runs dry
before the full group does, and every byte it does not need holds more context for the full layers. vLLM instead
carves equal-sized pages out of one shared pool (its groups have the same number of layers); that shares the bytes
dynamically but needs layer groups of equal size, which Gemma 3's 22 + 4 layers are not.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.config import ModelConfig


@dataclass(frozen=True)
class KVGroup:
    window: int  # the sliding window of its layers; 0: full attention (its blocks are never given back early)
    layers: tuple[int, ...]  # the decoder layers whose KV it holds, in order
    num_blocks: int = 0  # blocks of its tensor (the last one of a sliding group is its null block)


def kv_cache_groups(config: ModelConfig, reclaim: bool = True) -> list[KVGroup]:
    """The model's groups, blocks not yet assigned: the full-attention layers first (group 0), then one group per
    sliding window in the order of its first layer. reclaim False: one group of every layer that keeps every
    position (sliding layers still attend inside their window; only the memory is not given back)."""
    layers = range(config.num_hidden_layers)
    if not reclaim:
        return [KVGroup(0, tuple(layers))]
    by_window: dict[int, list[int]] = {}
    for layer in layers:
        by_window.setdefault(config.layer_window(layer), []).append(layer)
    order = sorted(by_window, key=lambda w: (w != 0, by_window[w][0]))
    return [KVGroup(w, tuple(by_window[w])) for w in order]


def sliding_group_cap(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most blocks a sliding group can hold at once, its null block included: a request computing n tokens from
    position c holds the blocks of positions [c - window + 1, c + n), at most ceil((window - 1) / block_size) + 1 +
    ceil(n / block_size) blocks, and a step's n add up to max_num_batched_tokens."""
    per_seq = -(-(window - 1) // block_size) + 2  # the window's blocks, the partial one, one more for rounding n up
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size) + 1


def split_kv_budget(groups: list[KVGroup], budget_bytes: int, bytes_per_layer_block: int, block_size: int,
                    max_num_seqs: int, max_num_batched_tokens: int) -> list[KVGroup]:
    """groups with their num_blocks (module docstring). bytes_per_layer_block: one layer's K and V of one block."""
    sizes = [len(g.layers) * bytes_per_layer_block for g in groups]
    if len(groups) == 1:
        return [KVGroup(groups[0].window, groups[0].layers, budget_bytes // sizes[0])]
    equal = budget_bytes // sum(sizes)  # what keeping every position in every layer would give each group
    counts = [min(equal, sliding_group_cap(g.window, block_size, max_num_seqs, max_num_batched_tokens))
              if g.window else 0 for g in groups]
    left = budget_bytes - sum(n * s for n, s in zip(counts, sizes))
    unbounded = [i for i, g in enumerate(groups) if not g.window]
    if unbounded:  # the full-attention group (there is one at most)
        counts[unbounded[0]] = left // sizes[unbounded[0]]
    else:  # sliding groups only: the rest in equal block counts, for more prefix cache
        extra = left // sum(sizes)
        counts = [n + extra for n in counts]
    return [KVGroup(g.window, g.layers, n) for g, n in zip(groups, counts)]
