"""The Triton fused-MoE kernel (inferd/kernels/triton_moe.py) against the block's torch path (inferd/models/moe.py,
one F.linear per active expert), run on CPU tensors under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1; see tests/kernels/test_triton_elementwise.py for why it must be set before triton is imported).

Tiny sizes (the interpreter runs each program in numpy): hidden 64, 8 experts, top-2, expert width 32, fp32 (the
interpreter miscomputes bf16; fp16 is checked at the fp16 rounding of the outputs). The two paths sum the same
products in another order (tl.dot's K steps; the k slots summed after, not index_add_ed), so they are compared by
the float32 bound of tests/parity.py (measured: <= 4e-7 relative, all three families, 1 to 300 tokens)."""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest.py does it first; kept for running this file alone

import pytest  # noqa: E402
import torch  # noqa: E402

from inferd.kernels import REFERENCE, select  # noqa: E402
from inferd.models.moe import MoESpec, SparseMoE  # noqa: E402
from parity import FP32, scale_of  # noqa: E402

pytestmark = pytest.mark.timeout(300)

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 2


@pytest.fixture(scope="module")
def tm():
    try:
        import triton
        from triton.runtime.interpreter import InterpretedFunction
    except Exception as e:
        raise AssertionError(f"triton is not importable: {type(e).__name__}: {e}") from e
    if hasattr(triton, "knobs") and hasattr(triton.knobs.runtime, "interpret"):
        triton.knobs.runtime.interpret = True
    from inferd.kernels import triton_moe as mod

    if not isinstance(mod._moe_gemm_kernel, InterpretedFunction):
        mod = importlib.reload(mod)
    assert mod.AVAILABLE, mod.IMPORT_ERROR
    assert isinstance(mod._moe_gemm_kernel, InterpretedFunction), "the kernel would compile for a GPU"
    return mod


def block(family: str, expert_range=None, dtype=torch.float32) -> SparseMoE:
    spec = MoESpec(family, HIDDEN, INTER, EXPERTS, TOP_K)
    moe = SparseMoE(spec, expert_range)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return moe.to(dtype)


def ops_with(tm):
    import types

    return types.SimpleNamespace(**{**vars(REFERENCE), "name": "reference + triton fused_moe",
                                    "fused_moe": tm.fused_moe})


def test_align_by_expert_pads_each_expert_to_the_block(tm):
    ids = torch.tensor([[2, 0], [2, 5], [0, 2]])  # pairs 0..5: experts 2, 0, 2, 5, 0, 2; expert 5 = "not here"
    pairs, blocks = tm.align_by_expert(ids, 5, 4)
    P = 6
    assert blocks.tolist()[:2] == [0, 2] and set(blocks.tolist()[2:]) == {-1}
    assert pairs[:4].tolist() == [1, 4, P, P]  # expert 0's pairs, in order, then padding
    assert pairs[4:8].tolist() == [0, 2, 5, P]  # expert 2's
    assert set(pairs[8:].tolist()) == {P}  # pair 3 (expert 5, not here) is nowhere
    assert pairs.numel() == blocks.numel() * 4 >= P + 5 * 3


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@torch.no_grad()
def test_fused_moe_matches_the_torch_path(tm, family):
    moe = block(family)
    ops = select("cpu", torch.float32, torch.float32, "triton")  # the namespace a model on the Triton path gets
    assert ops.fused_moe is tm.fused_moe
    # 1 and 37 tokens: 16-row blocks; 300 (600 pairs, >= 64 per expert): 64-row blocks
    for T in (1, 37) if family == "gpt_oss" else (1, 37, 300):
        x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(T)) * 4
        ref = moe(x)  # the torch path (REFERENCE has no fused_moe)
        if T == 37:
            assert bool((moe.last_expert_counts > 0).all())
        ours = moe(x, ops)
        diff, tol = float((ours - ref).abs().max()), FP32.tolerance(scale_of(ref))
        assert diff <= tol, f"{family} T={T}: {diff:.3g} beyond the float32 bound {tol:.3g}"


@torch.no_grad()
def test_fused_moe_over_an_expert_range(tm):
    """Expert parallelism's shard: only experts 4..7 here; the others' pairs contribute nothing, and two shards'
    outputs add up to the whole block's."""
    whole = block("mixtral")
    halves = [SparseMoE(whole.spec, r) for r in ((0, 4), (4, 8))]
    for h in halves:
        h.load_router(whole.router.weight)
        h.load_experts(whole_experts(whole)[0], whole_experts(whole)[1])
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(5)) * 4
    ref = whole(x)
    parts = [h(x, ops_with(tm)) for h in halves]
    torch_parts = [h(x) for h in halves]
    for p, tp in zip(parts, torch_parts):
        assert float((p - tp).abs().max()) <= FP32.tolerance(scale_of(tp))
    total = parts[0] + parts[1]
    assert float((total - ref).abs().max()) <= FP32.tolerance(scale_of(ref))


def whole_experts(moe: SparseMoE):
    return moe.experts.gate_up.detach(), moe.experts.down.detach()


@torch.no_grad()
def test_fused_moe_fp16(tm):
    moe = block("qwen3_moe", dtype=torch.float16)
    x = (torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2)) * 4).half()
    ref = moe(x)
    ours = moe(x, ops_with(tm))
    # each output is a sum of two fp16-rounded terms in both paths, rounded from float32 accumulations of the same
    # products in another order: a few fp16 ulps at the rows' scale
    ulp = torch.finfo(torch.float16).eps * scale_of(ref)
    assert float((ours.float() - ref.float()).abs().max()) <= 4 * ulp
