"""The Triton elementwise kernels (inferd/kernels/triton_elementwise.py: add_rms_norm, rope_kv_write, silu_mul, and
the float8 encoder of the KV write) against their torch references (inferd/kernels/reference.py, paged.write_kv),
run on CPU tensors under Triton's interpreter.

What is exact and what is not: pointwise work that does the reference's ops in the reference's order is compared
bit for bit (the residual add, RoPE, the KV write and its casts, float8 encoding included; add_rms_norm too when the
sum of squares is exact in float32). Two things differ by construction and are compared in ulps (the `ulps` helper of
tests/kernels/test_cpu_ops.py, copied): add_rms_norm's sum of squares (numpy's pairwise sum in the interpreter
against torch's blocked vector sum: another association of the same positive terms) and silu's exp (numpy's expf
against torch's). Each tolerance is explained where it is asserted.

Interpretation: tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton (triton.jit decides at
decoration time whether it compiles for a GPU, triton's own tl.* helpers included); the `te` fixture assigns the
knob too, reloads the kernel module if it was decorated before that, and asserts the kernels are interpreted (see
tests/kernels/test_triton_prefill.py's docstring for the details). The interpreter computes fp32 and fp16 correctly
but not bf16 (garbage: its float32 <-> bfloat16 casts go through a bit-level helper that does not round), so only
fp32/fp16 activations and fp32/fp16/float8 caches are tested here. Without triton every test fails (the fixture
asserts): triton is a test dependency.

Shapes stay small: the interpreter runs each program in numpy, ~2 ms per rope_kv_write program.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest.py does it first; kept for running this file alone

import pytest  # noqa: E402
import torch  # noqa: E402

from inferd.kernels import reference  # noqa: E402

DTYPES = [torch.float32, torch.float16]
# (query heads, KV heads, head_dim): SmolLM2's 9/3 x 64, multi-head, 8 query heads per KV head at 32
SHAPES = [(9, 3, 64), (4, 4, 64), (8, 1, 32)]
SENTINEL = 3.0e4  # fills the gaps of strided rows: finite in fp16, and large enough to show if it is ever read


@pytest.fixture(scope="module")
def te():
    try:
        import triton
        from triton.runtime.interpreter import InterpretedFunction
    except Exception as e:
        raise AssertionError(f"triton is not importable: {type(e).__name__}: {e}") from e
    if hasattr(triton, "knobs") and hasattr(triton.knobs.runtime, "interpret"):
        triton.knobs.runtime.interpret = True
    from inferd.kernels import triton_elementwise as mod

    if not isinstance(mod._rope_kv_write_kernel, InterpretedFunction):  # imported before interpretation was on
        mod = importlib.reload(mod)
    assert mod.AVAILABLE, mod.IMPORT_ERROR
    assert isinstance(mod._rope_kv_write_kernel, InterpretedFunction), "the kernels would compile for a GPU"
    assert isinstance(triton.language.zeros, InterpretedFunction), (
        "triton was imported in this process before TRITON_INTERPRET=1 was set: its library functions cannot run in "
        "the interpreter; set it before anything imports triton (tests/conftest.py, or the environment)")
    return mod


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in units of the dtype's last place at b's magnitude."""
    eps = torch.finfo(a.dtype).eps
    a32, b32 = a.float(), b.float()
    return float(((a32 - b32).abs() / (b32.abs().clamp(min=1e-6) * eps)).max())


def _strided_rows(values: torch.Tensor, gap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): values [rows, n] placed in a [rows, n + gap] buffer whose gap columns hold SENTINEL; the
    view is [rows, n] with row stride n + gap. A kernel that reads past n picks the sentinel up; one that writes
    there changes the buffer."""
    rows, n = values.shape
    buf = torch.full((rows, n + gap), SENTINEL, dtype=values.dtype)
    buf[:, :n] = values
    return buf, buf[:, :n]


# ---- add_rms_norm ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm(te, dtype, with_x):
    g = torch.Generator().manual_seed(0)
    for rows, n, gap in [(1, 576, 0), (5, 64, 3), (37, 576, 0), (4, 100, 5)]:  # 576 and 100: masked tiles
        x = torch.randn(rows, n, generator=g).to(dtype) if with_x else None
        res = (torch.randn(rows, n, generator=g) * 3).to(dtype)
        w = torch.randn(n, generator=g).to(dtype)
        res_ref = res.clone()
        out_ref = reference.add_rms_norm(x, res_ref, w, 1e-5)
        buf, res_view = _strided_rows(res, gap)  # gap 0: contiguous, as the engine passes it
        out = te.add_rms_norm(x, res_view, w, 1e-5)
        assert torch.equal(res_view, res_ref), (rows, n)  # the add rounds exactly as torch's add_
        assert torch.equal(buf[:, n:], torch.full((rows, gap), SENTINEL, dtype=dtype))  # nothing written past n
        assert out.shape == (rows, n) and out.dtype == dtype and out.is_contiguous()
        # The sum of squares is the only step done differently: numpy's pairwise sum against torch's blocked vector
        # sum of the same positive terms, each within ~log2(n) eps relative of the true sum (~10 eps at 576). The
        # rsqrt halves a relative error, and r * inv and w * y each round once more: 8 float32 ulps bounds that.
        # In fp16 those float32 differences only matter where r * inv falls next to an fp16 rounding boundary: one
        # ulp of y, carried through the product (2 allows the product's own rounding).
        assert ulps(out, out_ref) <= (8 if dtype == torch.float32 else 2), (rows, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_bitwise_when_the_sum_of_squares_is_exact(te, dtype):
    """Small integers: every partial sum of squares is an integer below 2^24, exact in float32 in any order, so the
    kernel must round exactly as the reference everywhere else (eps, the IEEE sqrt and division, y rounded to the
    dtype before the weight). Half of x's entries are a tiny eps / 8 instead, added to a nonzero integer: the sum
    rounds back to the integer in the dtype, so the norm must read the ROUNDED sum (as the reference reads residual)
    to stay exact."""
    g = torch.Generator().manual_seed(1)
    tiny = torch.finfo(dtype).eps / 8
    for rows, n in [(37, 576), (5, 64), (3, 100)]:
        for with_x in (True, False):
            res = torch.randint(1, 5, (rows, n), generator=g) * (torch.randint(0, 2, (rows, n), generator=g) * 2 - 1)
            x = None
            if with_x:
                ints = torch.randint(-4, 5, (rows, n), generator=g).float()
                x = torch.where(torch.rand(rows, n, generator=g) < 0.5, tiny, ints).to(dtype)
            res = res.to(dtype)
            w = torch.randn(n, generator=g).to(dtype)
            res_ref, res_te = res.clone(), res.clone()
            out_ref = reference.add_rms_norm(x, res_ref, w, 1e-5)
            out = te.add_rms_norm(x, res_te, w, 1e-5)
            assert torch.equal(res_te, res_ref)
            assert torch.equal(out, out_ref), (rows, n, with_x)


# ---- rope_kv_write -----------------------------------------------------------------------------------------------


def _rope_case(g: torch.Generator, dtype: torch.dtype, T: int, H: int, KV: int, D: int, max_pos: int = 64,
               blocks: int = 8, block_size: int = 16):
    tables = torch.randn(max_pos, D, generator=g) * 3
    cos, sin = tables.cos().to(dtype), tables.sin().to(dtype)
    positions = torch.randint(0, max_pos, (T,), generator=g)
    positions[0] = max_pos - 1  # the last row of the tables
    if T > 1:
        positions[1] = 0
    slots = torch.randperm(blocks * block_size, generator=g)[:T]  # scattered over the blocks, out of order
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=g).to(dtype)
    return qkv, positions, cos, sin, slots


def _run_rope(impl, qkv, positions, cos, sin, slots, H, KV, D, kv_dtype, seed, gap=0, blocks=8, block_size=16):
    """impl on a copy of qkv (rows strided by `gap` sentinel columns) and caches filled with the same random
    values for every impl (so slots nobody writes must stay as they were) -> (qkv buffer, k bits, v bits)."""
    buf, q = _strided_rows(qkv.clone(), gap)
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(KV, blocks, block_size, D, generator=g).to(kv_dtype)
    vc = torch.randn(KV, blocks, block_size, D, generator=g).to(kv_dtype)
    impl(q, positions, cos, sin, kc, vc, slots, H, KV)
    bits = torch.uint8 if kv_dtype.itemsize == 1 else None
    return buf, kc.view(bits) if bits else kc, vc.view(bits) if bits else vc


def _assert_same(a, b):
    for x, y, name in zip(a, b, ("qkv", "k_cache", "v_cache")):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_kv_write_is_bitwise_the_reference(te, dtype, shape):
    H, KV, D = shape
    g = torch.Generator().manual_seed(2)
    for T, gap in [(1, 0), (5, 3), (37, 0)]:
        qkv, positions, cos, sin, slots = _rope_case(g, dtype, T, H, KV, D)
        ref = _run_rope(reference.rope_kv_write, qkv, positions, cos, sin, slots, H, KV, D, dtype, seed=T)
        out = _run_rope(te.rope_kv_write, qkv, positions, cos, sin, slots, H, KV, D, dtype, seed=T, gap=gap)
        _assert_same((ref[0], ref[1], ref[2]), (out[0][:, :qkv.shape[1]], out[1], out[2]))
        assert torch.equal(out[0][:, qkv.shape[1]:], torch.full((T, gap), SENTINEL, dtype=dtype))
        assert not torch.equal(out[0][:, :qkv.shape[1]], qkv)  # it did rotate


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32)])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # values past fp16
def test_rope_kv_write_into_a_cache_of_another_dtype(te, dtype, kv_dtype):
    g = torch.Generator().manual_seed(3)
    H, KV, D, T = 9, 3, 64, 7
    qkv, positions, cos, sin, slots = _rope_case(g, dtype, T, H, KV, D)
    if kv_dtype == torch.float16:  # values that round in fp16: not exactly representable, some past fp16's range
        qkv = qkv * 1000.0
        qkv[:, -D:] = torch.linspace(-7e4, 7e4, D)
    ref = _run_rope(reference.rope_kv_write, qkv, positions, cos, sin, slots, H, KV, D, kv_dtype, seed=4)
    out = _run_rope(te.rope_kv_write, qkv, positions, cos, sin, slots, H, KV, D, kv_dtype, seed=4)
    _assert_same(ref, out)


def test_rope_kv_write_with_a_head_dim_that_is_not_a_power_of_two(te):
    """head_dim 80 (half 40, in tiles of 64 lanes): the masked lanes must neither read past a half nor write."""
    H, KV, D, T = 4, 2, 80, 5
    g = torch.Generator().manual_seed(9)
    for dtype in DTYPES:
        qkv, positions, cos, sin, slots = _rope_case(g, dtype, T, H, KV, D)
        ref = _run_rope(reference.rope_kv_write, qkv, positions, cos, sin, slots, H, KV, D, dtype, seed=10)
        out = _run_rope(te.rope_kv_write, qkv, positions, cos, sin, slots, H, KV, D, dtype, seed=10, gap=3)
        _assert_same((ref[0], ref[1], ref[2]), (out[0][:, :qkv.shape[1]], out[1], out[2]))
        assert torch.equal(out[0][:, qkv.shape[1]:], torch.full((T, 3), SENTINEL, dtype=dtype))


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float8_e4m3fn)])
def test_rope_kv_write_partial_rotary(te, dtype, kv_dtype):
    """Tables narrower than head_dim (Phi's partial_rotary_factor): each q and k head's first R dims rotate, bit for
    bit as the reference rotates them, and the rest (here 48 of 80: a tail that is no power of two) pass through to
    the qkv rows and the cache unchanged."""
    g = torch.Generator().manual_seed(12)
    H, KV, D, R, T = 4, 2, 80, 32, 5
    tables = torch.randn(32, R, generator=g)
    cos, sin = tables.cos().to(dtype), tables.sin().to(dtype)
    positions = torch.randint(0, 32, (T,), generator=g)
    slots = torch.randperm(8 * 16, generator=g)[:T]
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=g).to(dtype)
    ref = _run_rope(reference.rope_kv_write, qkv, positions, cos, sin, slots, H, KV, D, kv_dtype, seed=13)
    out = _run_rope(te.rope_kv_write, qkv, positions, cos, sin, slots, H, KV, D, kv_dtype, seed=13, gap=3)
    _assert_same((ref[0], ref[1], ref[2]), (out[0][:, :qkv.shape[1]], out[1], out[2]))
    heads, before = out[0][:, :qkv.shape[1]].view(T, -1, D)[:, :H + KV], qkv.view(T, -1, D)[:, :H + KV]
    assert torch.equal(heads[..., R:], before[..., R:]) and not torch.equal(heads[..., :R], before[..., :R])


def _fp8_hard_values() -> torch.Tensor:
    """Values where float8_e4m3fn rounding is decided: every midpoint between neighbouring codes (ties, to even),
    subnormal midpoints included, the largest finite code and what lies past it (448 < |x| saturates), +-0."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, increasing
    mids = (codes[:-1] + codes[1:]) / 2
    extra = torch.tensor([448.0, 449.0, 464.0, 470.0, 480.0, 500.0, 1e4, 6e4, 2.0 ** -10, 2.0 ** -11, 0.0, 2.0 ** -20])
    v = torch.cat([mids, codes, extra])
    return torch.cat([v, -v])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_into_a_float8_cache(te, dtype):
    """k is rotated (random magnitudes from the subnormal range to past 448) and v is copied: its heads carry the
    hard values, each exact in fp16 (float8 midpoints have 4 significant bits)."""
    g = torch.Generator().manual_seed(5)
    H, KV, D = 9, 3, 64
    hard = _fp8_hard_values()
    T = -(-hard.numel() // (KV * D))
    qkv, positions, cos, sin, slots = _rope_case(g, dtype, T, H, KV, D)
    x = qkv.float() * 2.0 ** torch.randint(-12, 10, qkv.shape, generator=g).float()
    v = torch.zeros(T * KV * D)
    v[:hard.numel()] = hard
    x[:, (H + KV) * D:] = v.view(T, KV * D)
    qkv = x.to(dtype)
    assert torch.equal(qkv[:, (H + KV) * D:].float().reshape(-1)[:hard.numel()], hard)
    kv_dtype = torch.float8_e4m3fn
    ref = _run_rope(reference.rope_kv_write, qkv, positions, cos, sin, slots, H, KV, D, kv_dtype, seed=6)
    out = _run_rope(te.rope_kv_write, qkv, positions, cos, sin, slots, H, KV, D, kv_dtype, seed=6)
    _assert_same(ref, out)


def test_the_float8_encoder_is_torchs_cast(te):
    """to_fp8e4m3fn (the KV write's encoder) against torch's .to(float8_e4m3fn), byte for byte: every fp16 value
    (loaded as fp16), the rounding midpoints of every code +-1 float32 ulp, and random float32 bit patterns
    (NaN and infinities included). The same algorithm in torch integer ops was checked against torch on all 2^32
    float32 patterns when it was written (~10 min: too long for the suite)."""
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    assert torch.equal(te.to_fp8e4m3fn(halves).view(torch.uint8), halves.to(torch.float8_e4m3fn).view(torch.uint8))
    hard = _fp8_hard_values()
    bits = hard.view(torch.int32)
    near = torch.cat([hard, (bits + 1).view(torch.float32), (bits - 1).view(torch.float32)])
    g = torch.Generator().manual_seed(7)
    rand = torch.randint(-(1 << 31), 1 << 31, (1 << 17,), generator=g, dtype=torch.int64).to(torch.int32)
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan"), 3.4e38, 1e-45, -1e-45])
    for x in (near, rand.view(torch.float32), specials):
        assert torch.equal(te.to_fp8e4m3fn(x).view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


# ---- silu_mul ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(te, dtype):
    g = torch.Generator().manual_seed(8)
    for rows, n, gap in [(1, 64, 0), (5, 576, 7), (37, 100, 0), (13, 1536, 0)]:  # 1536: two column blocks
        gate_up = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)
        buf, view = _strided_rows(gate_up, gap)
        out, ref = te.silu_mul(view), reference.silu_mul(gate_up)
        assert out.shape == (rows, n) and out.dtype == dtype and out.is_contiguous()
        # float32: numpy's expf against torch's, each within ~1 ulp, then 1 + e, the division and the product by
        # up each round once more: 4 ulps. fp16: silu is computed in float32 and rounded to fp16 first, so the two
        # only differ where it lies next to an fp16 rounding boundary (one ulp of silu, carried through the product)
        assert ulps(out, ref) <= (4 if dtype == torch.float32 else 2), (rows, n)
        if dtype == torch.float16:
            assert (out != ref).float().mean() < 0.01  # and that is rare
        assert torch.equal(buf[:, 2 * n:], torch.full((rows, gap), SENTINEL, dtype=dtype))


# ---- arguments ---------------------------------------------------------------------------------------------------


def test_bad_arguments_raise_value_errors(te):
    res, w = torch.randn(3, 64), torch.randn(64)
    with pytest.raises(ValueError, match="rows, n"):
        te.add_rms_norm(None, torch.randn(64), w, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        te.add_rms_norm(None, res, torch.randn(32), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        te.add_rms_norm(None, res, w.half(), 1e-5)
    with pytest.raises(ValueError, match="x must match"):
        te.add_rms_norm(torch.randn(3, 32), res, w, 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        te.add_rms_norm(None, torch.randn(64, 3).t(), w, 1e-5)
    with pytest.raises(ValueError, match="not supported"):
        te.add_rms_norm(None, res.double(), w.double(), 1e-5)

    H, KV, D = 9, 3, 64
    qkv = torch.randn(2, (H + 2 * KV) * D)
    kc, vc = torch.zeros(KV, 4, 16, D), torch.zeros(KV, 4, 16, D)
    tab = torch.ones(8, D)
    pos, slots = torch.tensor([0, 1]), torch.tensor([0, 5])
    args = (qkv, pos, tab, tab, kc, vc, slots, H, KV)

    def call(**kw):
        names = ("qkv", "positions", "cos", "sin", "k_cache", "v_cache", "slot_mapping", "num_heads",
                 "num_kv_heads")
        a = dict(zip(names, args))
        a.update(kw)
        te.rope_kv_write(*(a[k] for k in names))

    with pytest.raises(ValueError, match="position"):
        call(positions=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="position"):
        call(positions=torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="slot"):
        call(slot_mapping=torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slot_mapping=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="positions"):
        call(positions=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="width"):
        call(num_heads=8)
    with pytest.raises(ValueError, match="KV heads"):
        call(num_kv_heads=2)
    with pytest.raises(ValueError, match="cos"):
        call(cos=tab.half())
    with pytest.raises(ValueError, match="cos"):
        call(cos=torch.ones(8, 32))
    with pytest.raises(ValueError, match="differ"):
        call(v_cache=vc.half())
    with pytest.raises(ValueError, match="contiguous"):
        call(qkv=torch.randn((H + 2 * KV) * D, 2).t())
    with pytest.raises(ValueError, match="even"):
        call(qkv=torch.randn(2, (H + 2 * KV) * 3), k_cache=torch.zeros(KV, 4, 16, 3), v_cache=torch.zeros(KV, 4, 16, 3),
             cos=torch.ones(8, 3), sin=torch.ones(8, 3))
    with pytest.raises(ValueError, match="not supported"):
        call(k_cache=kc.to(torch.int8), v_cache=vc.to(torch.int8))

    with pytest.raises(ValueError, match="2 \\* I"):
        te.silu_mul(torch.randn(3, 5))
    with pytest.raises(ValueError, match="contiguous"):
        te.silu_mul(torch.randn(8, 3).t())
    with pytest.raises(ValueError, match="not supported"):
        te.silu_mul(torch.randn(3, 8).double())


def test_imports_without_triton():
    """The engine imports the module everywhere: without triton it loads, says so, and fails only when called."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from inferd.kernels import triton_elementwise as m\n"
        "assert not m.AVAILABLE and 'triton' in m.IMPORT_ERROR\n"
        "calls = [lambda: m.add_rms_norm(None, torch.zeros(1, 4), torch.zeros(4), 1e-5),\n"
        "         lambda: m.silu_mul(torch.zeros(1, 4)), lambda: m.to_fp8e4m3fn(torch.zeros(4)),\n"
        "         lambda: m.rope_kv_write(*[torch.zeros(1)] * 7, 1, 1)]\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as e:\n"
        "        assert 'triton' in str(e)\n"
        "    else:\n"
        "        raise AssertionError('no error')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
