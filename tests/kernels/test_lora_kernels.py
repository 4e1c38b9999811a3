"""The fused CPU LoRA operator (torch.ops.inferd.lora_add, inferd/kernels/cpu_lora.h) against reference.lora_add:
rows of several adapters of different ranks and of the base model in one call, one slot's rows scattered over y,
x a strided view; and the whole decode stack in one call (decode_layers) with LoRA rows, bit for bit the Python
layers over the same ops."""

from __future__ import annotations

import types

import pytest
import torch

from inferd import kernels
from inferd.config import EngineConfig
from inferd.engine import Engine
from inferd.engine.runner import kv_bytes_per_block
from inferd.kernels import build, reference
from inferd.models.build import load_model
from inferd.models.lora import LoraState, LoraTarget, attach, projections
from parity import decode_step_inputs

DTYPES = [torch.float32, torch.bfloat16]
# fp32: the same sums in another order; bf16: each rounding of the reference's (xa, the delta, y + delta) may land
# one bf16 step away
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


@pytest.fixture(scope="module")
def fused():
    ops = kernels.fused_cpu()
    assert ops is not None, f"the fused CPU kernels did not build: {build.error()}"
    return ops


def _target(g, dtype, in_features, parts, ranks, max_rank=16):
    """A projection's slots with random adapters of the given ranks (slot s: ranks[s]; 0 stays empty)."""
    state = LoraState(len(ranks), max_rank, None)
    target = LoraTarget(state, in_features, parts, dtype, torch.device("cpu"))
    for slot, r in enumerate(ranks):
        if r:
            target.write(slot, r, {p: (torch.randn(r, in_features, generator=g) * 0.2,
                                       torch.randn(size, r, generator=g) * 0.2) for p, size in enumerate(parts)}, 2.0)
            state.ranks[slot] = r
    return state, target


def _both(fused, state, target, y, x, row_slots):
    """reference.lora_add and the fused op on copies of y, with the step of these rows' slots."""
    state.begin_step(row_slots, torch.device("cpu"))
    s = state.step
    out = []
    for add in (reference.lora_add, fused.lora_add):
        yy = y.clone()
        add(yy, x, s.perm, s.seg_slots, s.seg_starts, s.row_slots, target.a, target.bt, s.ranks, target.parts)
        out.append(yy)
    return out


# a decode step's rows of three adapters (ranks 4, 16 = max, 4) and the base model (-1), no slot's rows contiguous;
# and a long run of one slot (a prefill chunk: past 256 rows at::mm runs it) beside a short one
ROWS = {"decode": [0, -1, 1, 0, 2, -1, 1, 0, 2, 1], "chunk": [1] * 260 + [-1, 0, 0, -1]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [[128, 64, 64], [80]], ids=["three-parts", "one-part"])
@pytest.mark.parametrize("rows", list(ROWS), ids=list(ROWS))
def test_lora_add_is_the_reference(fused, dtype, parts, rows):
    g = torch.Generator().manual_seed(len(parts) * 7 + len(rows))
    row_slots = ROWS[rows]
    in_features = 96 if len(parts) == 3 else 200  # 200: no multiple of 32 (the vector loops' tails)
    state, target = _target(g, dtype, in_features, parts, [4, 16, 4, 0])
    wide = torch.randn(len(row_slots), in_features + 24, generator=g).to(dtype)
    x = wide[:, 8:8 + in_features]  # a strided view, as a slice of the fused qkv rows is
    assert not x.is_contiguous()
    y = torch.randn(len(row_slots), sum(parts), generator=g).to(dtype)
    want, got = _both(fused, state, target, y, x, row_slots)
    base = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[base], y[base])  # the base model's rows untouched, bit for bit
    adapted = [i for i, s in enumerate(row_slots) if s >= 0]
    assert (got[adapted] != y[adapted]).any(dim=1).all()  # every adapter row got its delta
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_add_without_adapter_rows_changes_nothing(fused, dtype):
    g = torch.Generator().manual_seed(3)
    _, target = _target(g, dtype, 64, [64], [8, 0])
    y = torch.randn(3, 64, generator=g).to(dtype)
    before = y.clone()
    fused.lora_add(y, torch.randn(3, 64, generator=g).to(dtype), torch.empty(0, dtype=torch.long), [], [0],
                   torch.full((3,), -1, dtype=torch.int32), target.a, target.bt, [8, 0], [64])
    assert torch.equal(y, before)


def test_lora_add_refuses_bad_arguments(fused):
    g = torch.Generator().manual_seed(4)
    _, target = _target(g, torch.float32, 64, [32, 32], [8, 0])
    y, x = torch.zeros(2, 64), torch.randn(2, 64, generator=g)
    rows = torch.tensor([0, 1])
    slots = torch.tensor([0, 0], dtype=torch.int32)
    bad = [("rows of y", rows + 1, [0], [0, 2], [8, 0]), ("distinct", torch.tensor([1, 1]), [0], [0, 2], [8, 0]),
           ("max_rank", rows, [0], [0, 2], [32, 0]), ("slot out of range", rows, [5], [0, 2], [8, 0]),
           ("seg_starts", rows, [0], [0, 1], [8, 0])]
    for match, perm, seg_slots, seg_starts, ranks in bad:
        with pytest.raises(RuntimeError, match=match):
            fused.lora_add(y, x, perm, seg_slots, seg_starts, slots, target.a, target.bt, ranks, [32, 32])
    with pytest.raises(RuntimeError, match="sum"):
        fused.lora_add(y, x, rows, [0], [0, 2], slots, target.a, target.bt, [8, 0], [32, 16])
    # the schema (y mutated, nothing returned) and the fake kernel agree with a real call (torch.compile traces it)
    torch.library.opcheck(torch.ops.inferd.lora_add, (y, x, rows, [0], [0, 2], slots, target.a, target.bt, [8, 0],
                                                      [32, 32]), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_decoder_stack_in_one_call_adds_lora_as_the_layers_do(tiny_llama_dir, dtype):
    """A decode step of rows of adapters 0 and 1 (ranks 8 and 4) and the base model: decode_layers (taken: one call)
    gives the Python layers' bits; the base row is what it is without LoRA, the adapters' rows are not."""
    model, cfg, tok = load_model(str(tiny_llama_dir), dtype=dtype)
    engine = Engine(model, cfg, EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, dtype) * 64), dtype, tok)
    ops = model.ops
    assert ops.decode_layers is not None
    state = attach(model, max_loras=4, max_rank=8, add=ops.lora_add, dtype=dtype, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    for slot, rank in ((0, 8), (1, 4)):
        for layer in range(cfg.num_hidden_layers):
            for linear in projections(model, layer).values():
                t = linear.lora
                t.write(slot, rank, {p: (torch.randn(rank, t.in_features, generator=g) * 0.3,
                                         torch.randn(size, rank, generator=g) * 0.3) for p, size in
                                     enumerate(t.parts)}, 2.0)
        state.ranks[slot] = rank
    ids, positions, meta = decode_step_inputs(engine, [[5 + i, 9, 13 + 2 * i] for i in range(4)], max_tokens=16)
    calls = []
    one_call = types.SimpleNamespace(**vars(ops))
    one_call.decode_layers = lambda *a: calls.append(1) or ops.decode_layers(*a)
    layers = types.SimpleNamespace(**vars(ops))
    layers.decode_layers = None
    runner, out = engine.runner, {}
    kv = runner.kv.clone()
    with torch.inference_mode():
        for name, step_ops, row_slots in (("plain", one_call, [-1] * 4), ("stacked", one_call, [0, -1, 1, 0]),
                                          ("layered", layers, [0, -1, 1, 0])):
            runner.kv.copy_(kv)
            state.begin_step(row_slots, torch.device("cpu"))
            model.ops = step_ops
            try:
                out[name] = model(ids, positions, meta, runner.kv_caches)
            finally:
                model.ops = ops
                state.end_step()
            out[name + " kv"] = runner.kv.clone()
    assert len(calls) == 2  # the stack ran in one call, with LoRA rows and without
    assert torch.equal(out["stacked"], out["layered"])  # the same ops in the same order: the same bits
    assert torch.equal(out["stacked kv"], out["layered kv"])
    assert torch.equal(out["stacked"][1], out["plain"][1])  # the base model's row: no adapter
    for row in (0, 2, 3):
        assert not torch.equal(out["stacked"][row], out["plain"][row])
