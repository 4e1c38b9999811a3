"""ModelRunner: owns the model and the KV cache tensors; turns a scheduled batch into tensors and runs it. Its
collaborators come in when it is built: the other tensor-parallel ranks (a StepPeers), the CUDA-graph decode path
(a DecodeGraphSpec it builds and captures), batch-invariant attention."""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from ..kernels import REFERENCE as REFERENCE_OPS
from ..models.attention import AttentionMetadata, DecodeGroup, PrefillSeq, build_decode_mask
from ..models.batch_invariant import build_groups
from ..models.config import ModelConfig
from ..models.step_row import StepRow
from .cuda_graph import DecodeGraphs, DecodeGraphSpec
from .kv_groups import KVGroup
from .scheduler import SchedulerOutput


class StepPeers(Protocol):
    """The other tensor-parallel ranks as rank 0's runner sees them (tensor_parallel.TensorParallelGroup): each
    step's rows are sent to them before the step runs here, and they run it beside this one."""

    def send_step(self, rows: list[StepRow]) -> None: ...


def step_rows(sched: SchedulerOutput) -> list[StepRow]:
    rows = []
    for s in sched.scheduled:
        r = s.request
        start = r.num_computed_tokens
        tokens = r.token_ids[start:start + s.num_tokens - s.num_draft]
        if s.num_draft:
            tokens = tokens + r.draft_token_ids[:s.num_draft]
        if r.window_block_ids:
            rows.append((tokens, start, r.block_ids, s.num_logits, r.window_block_ids))  # a StepRow's fields
        else:
            rows.append((tokens, start, r.block_ids, s.num_logits))
    return rows


def keep_freed_memory_mapped() -> bool:
    """Stop glibc from returning large freed blocks to the OS. Every step allocates tensors of tens of MB
    (gathered KV, activations); by default glibc serves those with fresh mmap()s and unmaps them on free, so every
    step pays a page fault per 4 KB touched. Measured on SmolLM2 at batch 64 (docs/benchmarks.md): a decode step
    786 ms -> 346 ms. Process-wide and idempotent; a no-op where glibc's mallopt is not there."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))


def split_by_length(lens: list[int], block_size: int, max_waste: float = 0.25) -> list[tuple[int, int]]:
    """Cut decode rows (sorted by context length, shortest first) into contiguous groups whose padding to the
    group's longest context stays under max_waste of the gathered blocks: the KV gather and attention read
    max_blocks x rows, so one group mixing 100- and 400-token contexts reads ~2x what it needs."""
    groups: list[tuple[int, int]] = []
    lo, used = 0, 0
    for i, n in enumerate(lens):
        blocks = -(-n // block_size)
        if i > lo and blocks * (i + 1 - lo) > (1 + max_waste) * (used + blocks):
            groups.append((lo, i))
            lo, used = i, 0
        used += blocks
    if lens:
        groups.append((lo, len(lens)))
    return groups


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, tensor_parallel: int = 1) -> int:
    """On one device: with tensor parallelism each holds num_key_value_heads / tensor_parallel heads. dtype: the
    KV cache's (`--kv-dtype`), which may be narrower than the activations'."""
    elem = torch.empty((), dtype=dtype).element_size()
    kv_heads = config.num_key_value_heads // tensor_parallel
    return 2 * config.num_hidden_layers * kv_heads * block_size * config.head_dim * elem


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", tensor_parallel: int = 1,
                 parallel: StepPeers | None = None, kv_dtype: torch.dtype | None = None,
                 decode_graphs: DecodeGraphSpec | None = None, batch_invariant: bool = False,
                 groups: list[KVGroup] | None = None):
        """tensor_parallel: model is this rank's shard of it, and the KV cache holds this rank's KV heads.
        parallel (rank 0 only): the other ranks, sent every step before it runs here.
        kv_dtype: the KV cache's storage dtype (None: dtype, the activations'); attention reads it back in dtype.
        decode_graphs: the static-shape decode path over this runner's pool (cuda_graph.py), captured as CUDA graphs
        when it says so. batch_invariant: every row's attention the same way (inferd/models/batch_invariant.py).
        groups: the KV cache groups with their block counts (kv_groups.py); None: one group of every layer, of
        num_blocks blocks."""
        if parallel is not None and decode_graphs is not None:
            raise ValueError("CUDA graphs are not used with tensor parallelism")
        self.model = model
        self.parallel = parallel
        self.batch_invariant = batch_invariant
        self.config = config
        self.block_size = block_size
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory_mapped()
        # one tensor per KV cache group (kv_groups.py), [layers of the group, 2, kv heads, blocks, block, head_dim];
        # zeros, not empty: padded decode slots (and a sliding group's null block) are masked, and 0 * garbage could
        # be NaN
        self.groups = groups or [KVGroup(0, tuple(range(config.num_hidden_layers)), num_blocks)]
        kv_heads = config.num_key_value_heads // tensor_parallel
        self.kv_tensors = [torch.zeros(len(g.layers), 2, kv_heads, g.num_blocks, block_size, config.head_dim,
                                       dtype=self.kv_dtype, device=self.device) for g in self.groups]
        self.kv = self.kv_tensors[0]
        layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for g, kv in zip(self.groups, self.kv_tensors):
            layer_kv.update((layer, (kv[i, 0], kv[i, 1])) for i, layer in enumerate(g.layers))
        self.kv_caches = [layer_kv[i] for i in range(config.num_hidden_layers)]
        self.decode_graphs: DecodeGraphs | None = None
        if decode_graphs is not None:
            graphs = DecodeGraphs(model, self.kv_caches, config.vocab_size, dtype, block_size, decode_graphs,
                                  [(g.window, g.num_blocks - 1) for g in self.groups[1:]])
            self.decode_graphs = graphs.capture() if decode_graphs.capture else graphs

    def prepare(self, rows: list[StepRow]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        meta = self._metadata(rows, [row[2] for row in rows], (input_ids, positions, logits_rows))
        for g, group in enumerate(self.groups[1:]):  # the sliding groups' own slots and tables
            meta.by_window[group.window] = self._metadata(rows, [row[4][g] for row in rows])
        dev = self.device
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta, logits_rows)

    def _metadata(self, rows: list[StepRow], tables: list[list[int]],
                  inputs: tuple[list[int], list[int], list[int]] | None = None) -> AttentionMetadata:
        """The attention metadata of one KV cache group: rows' slots and block tables (tables: each row's in it).
        inputs: (token ids, positions, logits rows) to fill on the way (the first group's pass)."""
        bs = self.block_size
        slots: list[int] = []
        prefills: list[PrefillSeq] = []
        decode_lens: list[int] = []
        decode_tables: list[list[int]] = []
        prefill_blocks: list[list[int]] = []
        row = 0
        for (tokens, start, _, samples, *_), blocks in zip(rows, tables):
            n = len(tokens)
            if inputs is not None:
                inputs[0].extend(tokens)
                inputs[1].extend(range(start, start + n))
                if samples:
                    inputs[2].extend(range(row + n - samples, row + n))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_lens.append(start + 1)
                decode_tables.append(blocks[:(start + bs) // bs])
            else:
                used = -(-(start + n) // bs)
                prefill_blocks.append(blocks[:used])
                prefills.append(PrefillSeq(row, row + n, start, None))
            row += n
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                                 num_decode_tokens=len(decode_lens), prefills=prefills)
        if self.batch_invariant:  # every query row over its own context (batch_invariant.py)
            for p, blocks in zip(prefills, prefill_blocks):
                p.block_ids = torch.tensor(blocks, dtype=torch.long, device=dev)
            meta.invariant = build_groups([(r[1], len(r[0]), blocks) for r, blocks in zip(rows, tables)], bs, dev)
            return meta
        ops = getattr(self.model, "ops", REFERENCE_OPS)
        if prefills and ops.prefill_varlen:  # every chunk in one call, reading the cache in place
            # the chunks' rows follow the decode rows, in order (the scheduler puts one-token rows first)
            if prefills[0].start != len(decode_lens) or any(a.end != b.start for a, b in zip(prefills, prefills[1:])):
                raise RuntimeError("prefill chunks must follow the decode rows, contiguous, for the varlen kernel")
            width = max(len(t) for t in prefill_blocks)
            meta.prefill_tables = torch.tensor([t + [0] * (width - len(t)) for t in prefill_blocks],
                                               dtype=torch.int32, device=dev)
            cu = [0]
            for p in prefills:
                cu.append(cu[-1] + p.end - p.start)
            meta.prefill_cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=dev)
            meta.prefill_context_lens = torch.tensor([p.num_cached + p.end - p.start for p in prefills],
                                                     dtype=torch.int32, device=dev)
        else:  # the per-sequence path (paged.prefill_attention) gathers each sequence's blocks
            for p, blocks in zip(prefills, prefill_blocks):
                p.block_ids = torch.tensor(blocks, dtype=torch.long, device=dev)
        # the fused decode kernel reads block tables in place; the reference gathers padded groups
        if decode_lens and ops.decode_in_place:
            width = max(len(t) for t in decode_tables)
            meta.decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.int32,
                                              device=dev)
            meta.decode_lens = torch.tensor(decode_lens, dtype=torch.int32, device=dev)
        else:
            meta.decode_groups = [
                DecodeGroup(lo, hi, *self._decode_tables(decode_tables[lo:hi], decode_lens[lo:hi]))
                for lo, hi in split_by_length(decode_lens, bs)]
        return meta

    def _decode_tables(self, tables: list[list[int]], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        max_blocks = max(len(t) for t in tables)
        flat = [b for t in tables for b in t + [0] * (max_blocks - len(t))]
        return (torch.tensor(flat, dtype=torch.long, device=self.device),
                build_decode_mask(lens, max_blocks, self.block_size, self.dtype).to(self.device))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Runs one step; returns float32 logits for the rows that sample, in scheduled order (a request verifying
        k drafts has k + 1 consecutive rows)."""
        if self.decode_graphs is not None:  # a step of one-token decodes only, at a shape captured as a CUDA graph
            rows = step_rows(sched)
            shape = self.decode_graphs.plan(rows)
            if shape is not None:
                return self.decode_graphs.execute(rows, shape)
        return self.execute_keeping(sched, [])[0]

    @torch.inference_mode()
    def execute_keeping(self, sched: SchedulerOutput, keep_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """execute, also returning the final hidden states of the step rows keep_rows (prompt logprobs: the eager
        path, never a CUDA graph)."""
        rows = step_rows(sched)
        if self.parallel is not None:
            self.parallel.send_step(rows)  # the other ranks run the same step beside this one
        hidden, logits_rows = self.forward(rows)
        kept = hidden[keep_rows] if keep_rows else hidden[:0]
        if not logits_rows:
            return torch.empty(0, self.config.vocab_size, device=self.device), kept
        return self.model.compute_logits(hidden[logits_rows]), kept

    @torch.inference_mode()
    def forward(self, rows: list[StepRow]) -> tuple[torch.Tensor, list[int]]:
        """The model over one step's rows (writing their KV): final hidden states, and the rows that sample."""
        input_ids, positions, meta, logits_rows = self.prepare(rows)
        return self.model(input_ids, positions, meta, self.kv_caches), logits_rows
