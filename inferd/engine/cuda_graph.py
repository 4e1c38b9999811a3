"""DecodeGraphs: decode-only steps at fixed shapes, captured as CUDA graphs at engine start.

A decode step of a small model on a GPU is bound by kernel launches, not by the GPU: every layer launches a few dozen
small kernels from Python. A CUDA graph records one step's kernels once and replays them with one launch, but only
for fixed shapes and fixed memory addresses. So a step whose rows are all one-token decodes that sample runs here on
a static-shape path:

- its batch is padded up to the next size of a ladder (1, 2, 4, 8, ... up to max_num_seqs); with a decode kernel that
  reads the block tables in place (the Triton kernel on CUDA) the tables have one width, that of max_model_len, and
  there is one graph per batch size; with the reference attention, which gathers the whole padded table, the tables
  are padded to the next of a few context buckets (powers of two of blocks) and there is one graph per (batch,
  blocks) pair; all captured largest first into one shared memory pool;
- every input lives in one preallocated buffer (token ids, positions, cache slots, context lengths, the block table
  flattened as [batch, blocks]): a step only copies its values in (one host-to-device copy from pinned memory) and
  replays. Inside the captured region nothing depends on the step's values: no Python-side shape decision, no
  .item()/.tolist(), the same allocations every time; the decode mask is computed on the device from the lengths;
- padded rows are token 0 at position 0 with context length 1, and both their slot and their block table point into
  a scratch block of the KV pool that the KVCacheManager never hands out (the engine keeps the pool's last block
  back), so they never touch a real sequence's cache; real rows' tables are padded with that block too (masked);
- logits of every row land in one static float32 buffer; the step returns a copy of the real rows;
- a model with sliding-window layers has further KV cache groups (kv_groups.py): the buffer holds each one's slots and
  block table too, their padded rows and padded table entries pointing at the group's null block (never handed out,
  masked), and the graph's AttentionMetadata carries them by window as the eager path's does.

The computation is the model's own forward (inferd/models/llama.py) over an AttentionMetadata with one decode group,
the same code as the eager path, so whatever attention does (a KV cache stored in a lower dtype included) is what
the graph records. run_static() executes the very same static-shape computation without a graph: that is how it is
tested on a CPU, where capture() refuses to run. Steps that are not pure one-token decodes (prefill chunks,
speculative verification rows), or whose batch or context falls outside the captured shapes, take the normal path.

torch.compile is not used: on this project's CPU it did not beat eager (docs/machines.md), and the graph already takes
away the launch overhead it would mostly remove on a GPU; measure before adding it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..models.attention import AttentionMetadata, DecodeGroup
from ..models.step_row import StepRow

if TYPE_CHECKING:
    from ..config import EngineConfig

MIN_CONTEXT_BUCKET_TOKENS = 128  # the smallest context bucket; shorter contexts are padded to it (masked)


def wants_decode_graphs(config: EngineConfig) -> bool:
    """CUDA graphs apply on a CUDA device in one process; the flag is ignored elsewhere. Tensor parallelism is left
    out: every rank must run the same shapes in lockstep, and only rank 0 would pad."""
    return bool(config.cuda_graphs) and torch.device(config.device).type == "cuda" and config.tensor_parallel == 1


@dataclass(frozen=True)
class DecodeGraphSpec:
    """What a ModelRunner builds its DecodeGraphs from (the runner owns the model and the KV pool they run on).
    batch_sizes / buckets (in blocks): default batch_ladder(max_batch) and context_buckets up to
    ceil(max_model_len / block_size). A (batch, blocks) shape is kept only if batch x blocks <= max_gather_blocks
    (default: the pool's block count): the attention of a step gathers that many blocks per layer."""
    max_batch: int
    max_model_len: int
    scratch_block: int  # a block of the KV pool that no sequence ever owns (the padded rows write there)
    capture: bool = True  # False: the same static-shape path run uncaptured (a CPU check of it: --static-decode)
    batch_sizes: Sequence[int] | None = None
    buckets: Sequence[int] | None = None
    max_gather_blocks: int | None = None


def decode_graph_spec(config: EngineConfig, num_blocks: int, max_model_len: int) -> DecodeGraphSpec | None:
    """The engine's decode graphs for a pool of num_blocks (its last block kept back as the scratch block), or None:
    not on this device (wants_decode_graphs) nor asked for uncaptured (static_decode), a pool of one block, or
    batch-invariant steps (they never take the padded static path)."""
    capture = wants_decode_graphs(config)
    if not (capture or config.static_decode) or num_blocks < 2 or config.batch_invariant:
        return None
    return DecodeGraphSpec(config.max_num_seqs, max_model_len, scratch_block=num_blocks - 1, capture=capture)


def batch_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, and max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def context_buckets(max_blocks: int, min_blocks: int = 1) -> list[int]:
    """Block-table widths: min_blocks, 2 x min_blocks, ... below max_blocks, and max_blocks itself."""
    sizes, b = [], max(1, min_blocks)
    while b < max_blocks:
        sizes.append(b)
        b *= 2
    return sizes + [max_blocks]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], vocab_size: int,
                 dtype: torch.dtype, block_size: int, spec: DecodeGraphSpec,
                 window_groups: Sequence[tuple[int, int]] = ()):
        """model and kv_caches: a ModelRunner's (whatever dtype the cache is stored in); dtype: the activations'
        (the decode mask's, as in the eager path). window_groups: (window, null block) of each KV cache group after
        the first (kv_groups.py), whose slots and tables the buffer holds too; their null block is their padded
        rows' scratch block. Nothing is captured here: capture() does (ModelRunner calls it when spec.capture)."""
        num_pool_blocks = max(k.shape[1] for k, _ in kv_caches)  # group 0's, the largest (kv_groups.py)
        if not 0 <= spec.scratch_block < num_pool_blocks:
            raise ValueError(f"scratch block {spec.scratch_block} is not in the KV pool ({num_pool_blocks} blocks)")
        self.model = model
        self.kv_caches = kv_caches
        self.device = kv_caches[0][0].device
        self.dtype = dtype
        self.block_size = bs = block_size
        self.scratch_block = spec.scratch_block
        max_blocks = -(-spec.max_model_len // bs)
        self.batch_sizes = sorted(spec.batch_sizes or batch_ladder(spec.max_batch))
        # a decode kernel that reads the block tables in place (kernels: Triton on CUDA, the fused CPU op) does work
        # in proportion to each row's own context, whatever the table's width: one width, the graphs keyed by batch
        # size only; the reference gathers the whole padded table, so it keeps context buckets
        self.in_place = bool(getattr(self.model, "ops", None) is not None and self.model.ops.decode_in_place)
        default_buckets = ([max_blocks] if self.in_place
                           else context_buckets(max_blocks, -(-MIN_CONTEXT_BUCKET_TOKENS // bs)))
        self.buckets = sorted(spec.buckets or default_buckets)
        limit = num_pool_blocks if spec.max_gather_blocks is None else spec.max_gather_blocks
        if self.in_place and spec.max_gather_blocks is None:
            limit = max(self.batch_sizes) * max(self.buckets)  # nothing is gathered: every shape is kept
        self.shapes = {(b, c) for b in self.batch_sizes for c in self.buckets if b * c <= limit}
        if not self.shapes:
            raise ValueError(f"no decode shape fits max_gather_blocks={limit}")
        self.max_batch = m = self.batch_sizes[-1]
        # one buffer for every input: ids, positions, slots, context lengths (max_batch each), then the block table
        # of the step's shape, [batch, blocks] row-major
        self._offsets = (0, m, 2 * m, 3 * m, 4 * m)
        self._table_size = max(b * c for b, c in self.shapes)
        size = 4 * m + self._table_size
        # then per further KV cache group: its slots (max_batch) and its table (the largest shape's)
        self.window_groups = list(window_groups)
        size += len(self.window_groups) * (m + self._table_size)
        self.inputs = torch.zeros(size, dtype=torch.long, device=self.device)
        cuda = self.device.type == "cuda"
        self._staging = torch.zeros(size, dtype=torch.long, pin_memory=True) if cuda else self.inputs
        self._host = self._staging.numpy()
        self._copied = torch.cuda.Event() if cuda else None  # the last host-to-device copy of _staging
        self._columns = torch.arange(max(self.buckets) * bs, device=self.device)
        self.logits = torch.zeros(m, vocab_size, dtype=torch.float32, device=self.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0  # device memory reserved by capturing (the graphs' pool)
        self.steps = Counter()  # (batch, blocks) -> steps run on this path
        self.padded_rows = 0  # rows run on this path that were padding

    # ---- which steps ----------------------------------------------------------------------------------------
    def plan(self, rows: Sequence[StepRow]) -> tuple[int, int] | None:
        """The (batch, blocks) shape this step runs at, or None when it must take the normal path: a row that is
        not a one-token decode sampling exactly one token (a prefill chunk, a speculative verification row, a
        row that gives no logits), or a batch or context beyond the kept shapes."""
        n = len(rows)
        if n == 0 or n > self.max_batch:
            return None
        bs, need = self.block_size, 1
        for row in rows:
            tokens, start, samples = row[0], row[1], row[3]
            if len(tokens) != 1 or samples != 1:
                return None
            need = max(need, start // bs + 1)
        batch = next(b for b in self.batch_sizes if b >= n)
        blocks = next((c for c in self.buckets if c >= need), None)
        shape = (batch, blocks)
        return shape if shape in self.shapes else None

    # ---- running ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, rows: Sequence[StepRow], shape: tuple[int, int]) -> torch.Tensor:
        """One step at shape (from plan): the captured graph when there is one, else the same computation
        eagerly. Float32 logits [len(rows), vocab], rows in order."""
        self._load(rows, *shape)
        graph = self.graphs.get(shape)
        if graph is not None:
            graph.replay()
        else:
            self._forward(*shape)
        return self._output(rows, shape)

    def run_static(self, rows: Sequence[StepRow]) -> torch.Tensor:
        """The static-shape computation without a graph (CPU tests, and a check of the graphs against it)."""
        shape = self.plan(rows)
        if shape is None:
            raise ValueError("not a step the static decode path takes (see plan)")
        self._load(rows, *shape)
        with torch.inference_mode():
            self._forward(*shape)
            return self._output(rows, shape)

    def _output(self, rows: Sequence[StepRow], shape: tuple[int, int]) -> torch.Tensor:
        self.steps[shape] += 1
        self.padded_rows += shape[0] - len(rows)
        return self.logits[:len(rows)].clone()  # a copy: the next step overwrites the buffer

    def _views(self, batch: int, blocks: int) -> tuple[torch.Tensor, ...]:
        ids, pos, slots, lens, table = self._offsets
        x = self.inputs
        return (x[ids:ids + batch], x[pos:pos + batch], x[slots:slots + batch], x[lens:lens + batch],
                x[table:table + batch * blocks])

    def _load(self, rows: Sequence[StepRow], batch: int, blocks: int) -> None:
        """The step's values into the input buffer; rows [len(rows), batch) are padding."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the pinned buffer
        h, (o_ids, o_pos, o_slot, o_len, o_tab) = self._host, self._offsets
        bs, scratch, n = self.block_size, self.scratch_block, len(rows)
        table = h[o_tab:o_tab + batch * blocks].reshape(batch, blocks)
        table[:] = scratch
        for i, row in enumerate(rows):
            tokens, start, block_ids = row[0], row[1], row[2]
            used = start // bs + 1
            h[o_ids + i] = tokens[0]
            h[o_pos + i] = start
            h[o_slot + i] = block_ids[start // bs] * bs + start % bs
            h[o_len + i] = start + 1
            table[i, :used] = block_ids[:used]
        h[o_ids + n:o_ids + batch] = 0
        h[o_pos + n:o_pos + batch] = 0
        h[o_slot + n:o_slot + batch] = scratch * bs
        h[o_len + n:o_len + batch] = 1
        end = o_tab + batch * blocks
        for g, (_, null) in enumerate(self.window_groups):
            o_gslot, o_gtab = self._group_offsets(g)
            gtable = h[o_gtab:o_gtab + batch * blocks].reshape(batch, blocks)
            gtable[:] = null
            for i, row in enumerate(rows):
                start, block_ids = row[1], row[4][g]
                h[o_gslot + i] = block_ids[start // bs] * bs + start % bs
                gtable[i, :start // bs + 1] = block_ids[:start // bs + 1]
            h[o_gslot + n:o_gslot + batch] = null * bs
            end = o_gtab + batch * blocks
        if self._copied is not None:
            self.inputs[:end].copy_(self._staging[:end], non_blocking=True)
            self._copied.record()

    def _load_padding(self) -> None:
        """Every row padding, at every shape (capture's warm-up runs then write only the scratch block)."""
        h, (o_ids, _, o_slot, o_len, o_tab) = self._host, self._offsets
        h[o_ids:o_slot] = 0
        h[o_slot:o_len] = self.scratch_block * self.block_size
        h[o_len:o_tab] = 1
        h[o_tab:o_tab + self._table_size] = self.scratch_block
        for g, (_, null) in enumerate(self.window_groups):
            o_gslot, o_gtab = self._group_offsets(g)
            h[o_gslot:o_gtab] = null * self.block_size
            h[o_gtab:o_gtab + self._table_size] = null
        if self._copied is not None:
            self.inputs.copy_(self._staging)
            torch.cuda.synchronize(self.device)

    def _group_offsets(self, g: int) -> tuple[int, int]:
        """Where the slots and the table of KV cache group g + 1 lie in the input buffer."""
        base = 4 * self.max_batch + self._table_size + g * (self.max_batch + self._table_size)
        return base, base + self.max_batch

    def _forward(self, batch: int, blocks: int) -> None:
        """The captured region: shapes depend only on (batch, blocks), values only on the input buffer."""
        ids, positions, slots, lens, table = self._views(batch, blocks)
        meta = self._metadata(batch, blocks, slots, lens, table)
        for g, (window, _) in enumerate(self.window_groups):
            o_gslot, o_gtab = self._group_offsets(g)
            meta.by_window[window] = self._metadata(batch, blocks, self.inputs[o_gslot:o_gslot + batch], lens,
                                                    self.inputs[o_gtab:o_gtab + batch * blocks])
        hidden = self.model(ids, positions, meta, self.kv_caches)
        self.logits[:batch].copy_(self.model.compute_logits(hidden))

    def _metadata(self, batch: int, blocks: int, slots: torch.Tensor, lens: torch.Tensor,
                  table: torch.Tensor) -> AttentionMetadata:
        """One KV cache group's decode metadata over its views of the input buffer."""
        if self.in_place:  # the kernel reads int32 tables and lengths in place; no mask
            meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch,
                                     decode_tables=table.view(batch, blocks).to(torch.int32),
                                     decode_lens=lens.to(torch.int32))
        else:
            width = blocks * self.block_size
            invalid = self._columns[:width].unsqueeze(0) >= lens.unsqueeze(1)  # [batch, width]
            mask = torch.zeros((batch, width), dtype=self.dtype, device=self.device)
            mask = mask.masked_fill_(invalid, float("-inf")).view(1, batch, 1, width)
            meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch,
                                     decode_groups=[DecodeGroup(0, batch, table, mask)])
        return meta

    # ---- capture (CUDA only) ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> DecodeGraphs:
        """Record one graph per kept shape, largest first, into one memory pool. Each shape first runs once
        eagerly on a side stream (lazy library set-up must not happen inside a capture). Only on CUDA."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device; this runner is on {self.device}")
        started = time.perf_counter()
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        self._load_padding()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.device)
        current = torch.cuda.current_stream(self.device)
        for shape in sorted(self.shapes, reverse=True):  # the smaller graphs reuse the larger ones' pool memory
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self._forward(*shape)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(*shape)
            self.graphs[shape] = graph
        torch.cuda.synchronize(self.device)
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - reserved
        self.capture_seconds = time.perf_counter() - started
        return self
