"""StepRow: one sequence's share of a model step over the paged KV cache. Plain data, passed from the engine (its
runner, the tensor-parallel ranks, the CUDA-graph path) to the model, and by whatever else runs the model over the
cache (an embedding pass): it lives here so that none of them imports another to name it."""

from __future__ import annotations

from typing import NamedTuple


class StepRow(NamedTuple):
    """One sequence's share of a step: all a runner needs, and all that a tensor-parallel rank is sent."""
    token_ids: list[int]  # the tokens computed this step
    start: int  # the position of the first of them
    block_ids: list[int]  # the sequence's block table (at least the blocks up to start + len(token_ids))
    samples: int  # how many of its last rows give logits: 0, 1, or 1 + the speculative drafts it verifies
    # its block tables in KV cache groups 1.. (sliding-window layers: inferd/engine/kv_groups.py); block_ids is
    # group 0's
    window_block_ids: tuple[list[int], ...] | list[list[int]] = ()
