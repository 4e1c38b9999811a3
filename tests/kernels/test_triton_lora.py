"""The Triton LoRA operator (inferd/kernels/triton_lora.py: lora_add, a shrink and an expand kernel, one row per
program) against the reference segmented operator (inferd/kernels/reference.py lora_add), run on CPU tensors under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1; see tests/kernels/test_triton_elementwise.py for why
it must be set before triton is imported).

The adapters are written into their slots by models/lora.py's LoraTarget and the step is grouped by its LoraState, so
both operators read the buffers the model holds. Each slot's unused region (the A rows past P r, the B elements past
r * out: a rank below the max) is filled with NaN, which only a kernel that reads past its slot's rank would bring
into y. Tiny sizes (the interpreter runs each program in numpy): in 44, parts [16, 8, 8] and [24], max rank 8, 8
rows. float32, float16 and bfloat16 (the interpreter's float32 -> bfloat16 casts truncate instead of rounding, so bf16
is compared within two bf16 ulps, not bit for bit)."""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest.py does it first; kept for running this file alone

import pytest  # noqa: E402
import torch  # noqa: E402

from inferd.kernels import reference, select  # noqa: E402
from inferd.models.lora import LoraState, LoraTarget  # noqa: E402

pytestmark = pytest.mark.timeout(300)

IN, MAX_LORAS, MAX_RANK = 44, 4, 8
RANKS = {0: 4, 1: 8, 2: 8}  # slot 3 stays empty (rank 0)
ROW_SLOTS = [1, -1, 0, 1, 2, -1, 0, 3]  # slots interleaved, two base rows, one row of the empty slot


@pytest.fixture(scope="module")
def tl_mod():
    try:
        import triton
        from triton.runtime.interpreter import InterpretedFunction
    except Exception as e:
        raise AssertionError(f"triton is not importable: {type(e).__name__}: {e}") from e
    if hasattr(triton, "knobs") and hasattr(triton.knobs.runtime, "interpret"):
        triton.knobs.runtime.interpret = True
    from inferd.kernels import triton_lora as mod

    if not isinstance(mod._lora_shrink_kernel, InterpretedFunction):
        mod = importlib.reload(mod)
    assert mod.AVAILABLE, mod.IMPORT_ERROR
    assert isinstance(mod._lora_shrink_kernel, InterpretedFunction), "the kernels would compile for a GPU"
    assert isinstance(mod._lora_expand_kernel, InterpretedFunction), "the kernels would compile for a GPU"
    return mod


def adapters(parts: list[int], dtype: torch.dtype) -> tuple[LoraState, LoraTarget]:
    """A projection's slots holding RANKS' adapters (each targets every part but slot 1, which leaves part 0 of a
    multi-part projection to the base), their unused regions NaN, and the step of ROW_SLOTS begun."""
    g = torch.Generator().manual_seed(len(parts))
    state = LoraState(MAX_LORAS, MAX_RANK, add=None)
    target = LoraTarget(state, IN, parts, dtype, torch.device("cpu"))
    out = sum(parts)
    for slot, r in RANKS.items():
        weights = {p: (torch.randn(r, IN, generator=g) * 0.2, torch.randn(size, r, generator=g) * 0.2)
                   for p, size in enumerate(parts) if not (slot == 1 and p == 0 and len(parts) > 1)}
        target.write(slot, r, weights, scale=2.0 / r)
        state.ranks[slot] = r
        target.a[slot, len(parts) * r:] = float("nan")
        target.bt[slot, r * out:] = float("nan")
    target.a[3] = float("nan")  # the empty slot: rank 0, nothing of it is read
    target.bt[3] = float("nan")
    state.begin_step(ROW_SLOTS, torch.device("cpu"))
    return state, target


def run(op, state: LoraState, target: LoraTarget, x: torch.Tensor, y0: torch.Tensor) -> torch.Tensor:
    y = y0.clone()
    s = state.step
    op(y, x, s.perm, s.seg_slots, s.seg_starts, s.row_slots, target.a, target.bt, s.ranks, target.parts)
    return y


SMALL_TILES = (8, 8, 16)  # BLOCK_J, BLOCK_K, BLOCK_C


@pytest.mark.parametrize("dtype,tiles", [(torch.float32, None), (torch.float16, None), (torch.bfloat16, None),
                                         (torch.float32, SMALL_TILES), (torch.float16, SMALL_TILES)],
                         ids=["fp32-one-tile", "fp16-one-tile", "bf16-one-tile", "fp32-small-tiles",
                              "fp16-small-tiles"])  # the tiling does not depend on the dtype: bf16 once
@pytest.mark.parametrize("parts", [[16, 8, 8], [24]], ids=["3-parts", "1-part"])
def test_lora_add_matches_the_reference(tl_mod, monkeypatch, parts, dtype, tiles):
    """one-tile: each program's A rows, input features (a tail: 44 of 64) and output columns in one tile, no split
    of k; small-tiles: BLOCK_J 8 (a rank-4 slot's A blocks: one, a part-masked, one skipped), BLOCK_K 8 (6 k tiles,
    the last a tail, in 4 splits of 2 tiles: the last split empty), BLOCK_C 16 (a block of columns across two parts,
    and a tail for 24)."""
    if tiles:
        for name, value in zip(("BLOCK_J", "BLOCK_K", "BLOCK_C"), tiles):
            monkeypatch.setattr(tl_mod, name, value)
        assert tl_mod.split_k_for(len(ROW_SLOTS) * -(-len(parts) * MAX_RANK // 8), -(-IN // 8)) == 4
    state, target = adapters(parts, dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(ROW_SLOTS), IN, generator=g).to(dtype)
    y0 = torch.randn(len(ROW_SLOTS), sum(parts), generator=g).to(dtype)
    ref = run(reference.lora_add, state, target, x, y0)
    ours = run(tl_mod.lora_add, state, target, x, y0)
    assert torch.isfinite(ours).all(), "a kernel read past a slot's rank (the NaN filling)"
    base = [t for t, s in enumerate(ROW_SLOTS) if s < 0]
    assert torch.equal(ours[base], y0[base]), "the base model's rows changed"
    delta = (ref.float() - y0.float()).abs()
    assert float(delta[[t for t, s in enumerate(ROW_SLOTS) if RANKS.get(s)]].amax(1).min()) > 0.01  # rows moved
    # float32: the same products summed in another order (measured: at most 2.4e-7 at a scale of 3.5, 0.7 float32
    # ulp of the scale). float16/bfloat16: both round xa, the delta and y + delta to the dtype from float32 sums of
    # the same products (float16 measured bit-equal); the interpreter's bf16 casts truncate where torch rounds to
    # nearest even, so bf16 parts by up to an ulp per rounding (measured: 0.68 bf16 ulp of the scale). Two ulps of the
    # scale for both.
    scale = float(ref.float().abs().max())
    tol = 1e-6 * scale if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * scale
    diff = float((ours.float() - ref.float()).abs().max())
    assert diff <= tol, f"{diff:.3g} beyond {tol:.3g}"
    if dtype == torch.float16:
        # the rounding points are the reference's: an element parts only where the two float32 sums (another order)
        # round to different fp16 values (measured: none; without the delta's rounding, 7 to 10% part)
        parted = float((ours != ref).float().mean())
        assert parted <= 0.02, f"{parted:.1%} of the elements differ from the reference's fp16 values"


def test_lora_add_in_the_triton_namespace(tl_mod):
    """The ops a model on the Triton path gets carry the kernel, and a LoraTarget adds through it (Linear's call)."""
    ops = select("cpu", torch.float32, torch.float32, "triton")
    assert ops.lora_add is tl_mod.lora_add
    state, target = adapters([16, 8, 8], torch.float32)
    x = torch.randn(len(ROW_SLOTS), IN, generator=torch.Generator().manual_seed(3))
    y0 = torch.zeros(len(ROW_SLOTS), 32)
    ref = run(reference.lora_add, state, target, x, y0)
    state.add = ops.lora_add
    y = y0.clone()
    target.apply(y, x)
    assert float((y - ref).abs().max()) <= 1e-6 * float(ref.abs().max())


def test_lora_add_guards_slot_and_rank_values(tl_mod):
    """Without host checks (a GPU sync): a slot outside [0, S) adds nothing, a rank above the max is clamped to it,
    and a base-only step leaves y as it was."""
    state, target = adapters([16, 8, 8], torch.float32)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(4))
    y0 = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    for slots in ([MAX_LORAS, -1, 99], [-1, -1, -1]):
        y = y0.clone()
        tl_mod.lora_add(y, x, None, [], [0], torch.tensor(slots, dtype=torch.int32), target.a, target.bt,
                        state.ranks, target.parts)
        assert torch.equal(y, y0), slots
    # slot 1 has rank 8 = the max: read as rank 9, its parts would start at the wrong rows and columns
    y = y0.clone()
    tl_mod.lora_add(y, x, None, [], [0], torch.tensor([1, 1, -1], dtype=torch.int32), target.a, target.bt,
                    [4, 9, 8, 0], target.parts)
    ref = y0.clone()
    reference.lora_add(ref, x, torch.tensor([0, 1]), [1], [0, 2], None, target.a, target.bt, [4, 8, 8, 0],
                       target.parts)
    assert float((y - ref).abs().max()) <= 1e-6 * float(ref.abs().max())


def test_lora_add_rejects_bad_shapes(tl_mod):
    state, target = adapters([24], torch.float32)
    s = state.step
    x = torch.zeros(len(ROW_SLOTS), IN)
    with pytest.raises(ValueError, match="parts"):
        tl_mod.lora_add(torch.zeros(len(ROW_SLOTS), 24), x, s.perm, s.seg_slots, s.seg_starts, s.row_slots,
                        target.a, target.bt, s.ranks, [12, 10])
    with pytest.raises(ValueError, match="dtype"):
        tl_mod.lora_add(torch.zeros(len(ROW_SLOTS), 24, dtype=torch.float16), x, s.perm, s.seg_slots, s.seg_starts,
                        s.row_slots, target.a, target.bt, s.ranks, target.parts)


def test_split_k_fills_the_gpu_only_when_rows_are_few(tl_mod):
    """Decode (8 rows, one block of A rows, 4096 inputs: 32 k tiles): the k loop is cut in MAX_SPLIT_K; a prefill of
    512 rows has programs enough; splits never exceed the k tiles and are powers of two."""
    assert tl_mod.split_k_for(8, 32) == tl_mod.MAX_SPLIT_K == 16
    assert tl_mod.split_k_for(512, 32) == 1
    assert tl_mod.split_k_for(1, 3) == 2 and tl_mod.split_k_for(24, 6) == 4
