"""The Triton paged decode attention kernel (inferd/kernels/triton_decode.py) against the torch reference
(reference.paged_decode_attention) and an exact float64 answer, run on CPU tensors under Triton's interpreter.

How interpretation is forced (read in triton 3.9.0's triton/knobs.py, runtime/jit.py, runtime/interpreter.py, and
tried): `triton.jit` decides when it DECORATES a function -- if `knobs.runtime.interpret` is true it returns an
InterpretedFunction (numpy, runs on CPU tensors), else a JITFunction (compiles for a GPU; nothing looks again at
launch). `knobs.runtime.interpret` is an env_bool descriptor that reads TRITON_INTERPRET from os.environ at every
access unless a value was assigned to it (an assignment wins, and is exported to the environment). Two consequences:

- triton's OWN library functions (tl.cdiv, tl.zeros, tl.max, tl.sum: triton/language/standard.py) are decorated
  when triton is first imported. If that happened before TRITON_INTERPRET=1, they are JITFunctions and the
  interpreter stops at the first one a kernel calls ("Cannot call @triton.jit'd outside of the scope of a kernel");
  no reload of our module fixes that (tried). So this file sets the variable when pytest imports it, before it
  imports triton or the kernel module -- enough while nothing collected earlier imports triton (true today; the
  kernel modules are imported lazily by kernels.triton_ops()). If that changes, the fixture fails with a message
  saying so; the fix is `os.environ.setdefault("TRITON_INTERPRET", "1")` at the top of tests/conftest.py (on a
  machine without a GPU) or TRITON_INTERPRET=1 in the environment.
- our kernel module must be executed while interpretation is on: `_force_interpreter` assigns the knob (where
  triton has it) and reloads inferd.kernels.triton_decode if its kernel is not an InterpretedFunction (reload
  re-executes it in place, so `kernels.triton_ops()`, which looks the function up on the module, sees the new one).

Both settings stay for the rest of the session on purpose: on a CPU, Triton can only run interpreted.

Measured here: the interpreter computes float32 and float16 correctly but returns garbage for bfloat16, so bf16 is
not tested. Shapes stay tiny: the interpreter runs each program in numpy, one tile at a time.

Without triton every test FAILS (the `triton_available` fixture): triton is a test dependency, and a skip would
hide a broken install."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernel module are first imported: see the docstring

import pytest  # noqa: E402
import torch  # noqa: E402

from inferd.kernels import reference, triton_decode  # noqa: E402


def _force_interpreter() -> None:
    if not triton_decode.AVAILABLE:
        return
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "interpret"):
        knobs.runtime.interpret = True
    if not isinstance(triton_decode._paged_decode_split_kernel, InterpretedFunction):
        importlib.reload(triton_decode)  # decorated before TRITON_INTERPRET was set: decorate again


_force_interpreter()

SCALE = 0.125


@pytest.fixture(autouse=True)
def triton_available():
    assert triton_decode.AVAILABLE, f"triton does not import: {triton_decode.IMPORT_ERROR}"
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_decode._paged_decode_split_kernel, InterpretedFunction), "it would compile for a GPU"
    import triton.language as tl

    assert isinstance(tl.zeros, InterpretedFunction), (
        "triton was imported in this process before TRITON_INTERPRET=1 was set, so its library functions (tl.cdiv, "
        "tl.zeros, tl.max, tl.sum) cannot run in the interpreter: set TRITON_INTERPRET=1 before anything imports "
        "triton (tests/conftest.py, or the environment); see this module's docstring")


def _paged_case(g, dtype, kv_dtype, lens, H=9, KV=3, D=64, bs=16, num_blocks=None):
    """Caches with random values, every row its own scattered blocks (tables padded with 0), q in dtype."""
    B = len(lens)
    need = [-(-n // bs) for n in lens]
    num_blocks = num_blocks or sum(need) + 3
    k_cache = torch.randn(KV, num_blocks, bs, D, generator=g).to(kv_dtype)
    v_cache = torch.randn(KV, num_blocks, bs, D, generator=g).to(kv_dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(B, max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    q = torch.randn(B, H, D, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def _exact_attention(q, kc, vc, tables, lens, scale):
    """The answer in float64, row by row over the row's own positions (no padding, no mask)."""
    B, H, D = q.shape
    KV, _, bs, _ = kc.shape
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        slots = [int(tables[b, t // bs]) * bs + t % bs for t in range(n)]
        k = kc.double().reshape(KV, -1, D)[:, slots]  # [KV, n, D]
        v = vc.double().reshape(KV, -1, D)[:, slots]
        qb = q[b].double().view(KV, H // KV, D)
        p = torch.softmax(qb @ k.transpose(1, 2) * scale, dim=-1)
        out[b] = (p @ v).reshape(H, D)
    return out


def _check(out, q, kc, vc, tables, ctx):
    """The project's rule for attention outputs: float32 within 1e-5 of the reference (and at least as close to the
    exact answer, up to float32 rounding); float16 within 2e-3 of the reference and at least as close to the exact
    answer as the reference is, up to one float16 rounding of the output."""
    ref = reference.paged_decode_attention(q, kc, vc, tables, ctx, SCALE)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    tol, slack = (1e-5, 1e-6) if q.dtype == torch.float32 else (2e-3, 1e-3)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    exact = _exact_attention(q, kc, vc, tables, ctx, SCALE)
    assert (out.double() - exact).abs().max() <= (ref.double() - exact).abs().max() + slack


# ragged: one position, exactly one and two blocks (16, 32), one past each (17, 33), and a long row, in one batch
LENS = [1, 16, 17, 32, 33, 300]
# (query heads, KV heads, head_dim): SmolLM2's 9/3 x 64 (group 3), 8 per KV head at 32, multi-head (group 1)
SHAPES = [(9, 3, 64), (8, 1, 32), (4, 4, 32)]
# (block_size, block_n): tiles of 4 blocks (the default tile), of 2 blocks, of half a block
TILINGS = [(16, None), (8, 16), (32, 16)]


# a Latin square of shape x tiling x num_splits (1, 3, the heuristic): every pair of the three meets once, in 9
# cases instead of 27 (the interpreter runs each program in numpy: the full product took ~45 s here)
MATRIX = [(shape, tiling, [1, 3, None][(i + j) % 3])
          for i, shape in enumerate(SHAPES) for j, tiling in enumerate(TILINGS)]


@pytest.mark.parametrize("shape,tiling,num_splits", MATRIX,
                         ids=[f"H{s[0]}-KV{s[1]}-D{s[2]}-bs{t[0]}-n{t[1]}-splits{n}" for s, t, n in MATRIX])
def test_matches_the_reference_float32(shape, tiling, num_splits):
    H, KV, D = shape
    bs, bn = tiling
    g = torch.Generator().manual_seed(H * 100 + D + bs)
    q, kc, vc, tables, ctx = _paged_case(g, torch.float32, torch.float32, LENS, H=H, KV=KV, D=D, bs=bs)
    out = triton_decode.paged_decode_attention(q, kc, vc, tables, ctx, SCALE, num_splits=num_splits, block_n=bn)
    _check(out, q, kc, vc, tables, ctx)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 1, 32)], ids=lambda s: f"H{s[0]}-KV{s[1]}-D{s[2]}")
def test_float16(shape, num_splits):
    H, KV, D = shape
    g = torch.Generator().manual_seed(11)
    q, kc, vc, tables, ctx = _paged_case(g, torch.float16, torch.float16, [1, 17, 33, 150], H=H, KV=KV, D=D)
    out = triton_decode.paged_decode_attention(q, kc, vc, tables, ctx, SCALE, num_splits=num_splits, block_n=16)
    _check(out, q, kc, vc, tables, ctx)


def test_head_dim_128():
    g = torch.Generator().manual_seed(12)
    q, kc, vc, tables, ctx = _paged_case(g, torch.float32, torch.float32, [5, 70], H=4, KV=2, D=128)
    for splits in (1, 2):
        _check(triton_decode.paged_decode_attention(q, kc, vc, tables, ctx, SCALE, num_splits=splits),
               q, kc, vc, tables, ctx)


# a layer's attention options (paged.attend), each with the splits it must survive: (name, window, sinks, softcap,
# num_splits). The window (20) cuts the rows of 40 and 100 positions (their tiles before it are never read; 3 splits
# share what is left) and not those of 1 and 17; a sink must count once however many splits a row has; softcap 1.0
# puts the scaled scores on both sides of tanh_f32's polynomial/exponential switch (|x| = 0.625).
OPTION_CASES = [("window", 20, False, 0.0, 3), ("sinks", 0, True, 0.0, 3), ("softcap", 0, False, 1.0, 1),
                ("all", 20, True, 1.0, 1), ("all", 20, True, 1.0, 3)]


@pytest.mark.parametrize("name,window,with_sinks,softcap,num_splits", OPTION_CASES,
                         ids=[f"{c[0]}-splits{c[4]}" for c in OPTION_CASES])
def test_attention_options(name, window, with_sinks, softcap, num_splits):
    """window, sinks and softcap against the reference (paged.attend), GQA (2 query heads per KV head), float32
    within 1e-5 and at least as close as the reference to the answer over float64 inputs."""
    g = torch.Generator().manual_seed(19)
    q, kc, vc, tables, ctx = _paged_case(g, torch.float32, torch.float32, [1, 17, 40, 100], H=4, KV=2, D=32)
    opts = dict(window=window, sinks=torch.randn(4, generator=g) if with_sinks else None, softcap=softcap)
    out = triton_decode.paged_decode_attention(q, kc, vc, tables, ctx, SCALE, num_splits=num_splits, block_n=16,
                                               **opts)
    ref = reference.paged_decode_attention(q, kc, vc, tables, ctx, SCALE, **opts)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    exact = reference.paged_decode_attention(q.double(), kc.double(), vc.double(), tables, ctx, SCALE, **opts)
    assert (out.double() - exact).abs().max() <= (ref.double() - exact).abs().max() + 1e-6
    plain = reference.paged_decode_attention(q, kc, vc, tables, ctx, SCALE)
    assert (out - plain)[2:].abs().max() > 1e-2  # the option matters on these rows (so the comparison can fail)
    with pytest.raises(ValueError, match="sinks"):
        triton_decode.paged_decode_attention(q, kc, vc, tables, ctx, SCALE, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="window"):
        triton_decode.paged_decode_attention(q, kc, vc, tables, ctx, SCALE, window=-1)


def test_more_splits_than_a_row_has_tiles():
    """Splits past a row's length write empty partials (m = -inf, l = 0) that the merge weighs by 0, never NaN: here
    the 1-position row has 15 empty splits and the 40-position row (3 tiles of 16) has 13."""
    g = torch.Generator().manual_seed(13)
    q, kc, vc, tables, ctx = _paged_case(g, torch.float32, torch.float32, [1, 40, 17], H=9, KV=3, D=32)
    out = triton_decode.paged_decode_attention(q, kc, vc, tables, ctx, SCALE, num_splits=16, block_n=16)
    _check(out, q, kc, vc, tables, ctx)


def test_a_strided_query_and_output():
    """The model passes q as a view into the fused qkv rows (row stride = the qkv width), and may hand an `out`
    that is itself a view: both are read and written through their strides."""
    g = torch.Generator().manual_seed(14)
    H, KV, D = 9, 3, 64
    q, kc, vc, tables, ctx = _paged_case(g, torch.float32, torch.float32, [9, 40, 1], H=H, KV=KV, D=D)
    wide = torch.randn(3, (H + 2 * KV) * D, generator=g)
    wide[:, :H * D] = q.reshape(3, -1)
    view = wide[:, :H * D].view(3, H, D)
    assert not view.is_contiguous()
    for splits in (1, 2):
        contiguous = triton_decode.paged_decode_attention(q, kc, vc, tables, ctx, SCALE, num_splits=splits)
        strided = triton_decode.paged_decode_attention(view, kc, vc, tables, ctx, SCALE, num_splits=splits)
        torch.testing.assert_close(strided, contiguous, atol=0, rtol=0)
        _check(strided, q, kc, vc, tables, ctx)
        # out: every other head of a wider buffer; the heads between are left alone
        buf = torch.full((3, 2 * H, D), 7.0)
        ret = triton_decode.paged_decode_attention(view, kc, vc, tables, ctx, SCALE, num_splits=splits,
                                                   out=buf[:, ::2])
        assert ret.data_ptr() == buf.data_ptr()
        torch.testing.assert_close(buf[:, ::2], contiguous, atol=0, rtol=0)
        assert (buf[:, 1::2] == 7.0).all()


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 1, 32)], ids=lambda s: f"H{s[0]}-KV{s[1]}-D{s[2]}")
def test_float8_cache(shape, num_splits):
    """A float8_e4m3fn cache decoded in the kernel against the reference, which dequantizes exactly to q's float32."""
    H, KV, D = shape
    g = torch.Generator().manual_seed(15)
    q, kc, vc, tables, ctx = _paged_case(g, torch.float32, torch.float8_e4m3fn, [1, 16, 33, 100], H=H, KV=KV, D=D)
    out = triton_decode.paged_decode_attention(q, kc, vc, tables, ctx, SCALE, num_splits=num_splits, block_n=16)
    _check(out, q, kc, vc, tables, ctx)


def _finite_fp8_codes() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8)
    return codes[(codes & 0x7F) != 0x7F]  # 0x7F and 0xFF are NaN: never written to a cache


def test_the_float8_decode_is_exact_for_every_finite_code():
    codes = _finite_fp8_codes()
    assert codes.numel() == 254
    x = codes.view(torch.float8_e4m3fn)
    decoded = triton_decode.dequantize_fp8(x)
    expected = x.to(torch.float32)
    assert torch.equal(decoded, expected)  # equal values: includes +0 == -0, so check the sign bits too
    assert torch.equal(torch.signbit(decoded), torch.signbit(expected))


def test_the_attention_kernel_decodes_every_float8_code():
    """Through the attention kernel itself: a row of one position has softmax weight exactly 1, so its output is
    that position's V, decoded. 8 rows of one position each, 32 values per V row: the 254 codes (and 2 zeros)."""
    D, bs = 32, 16
    codes = torch.cat([_finite_fp8_codes(), torch.zeros(2, dtype=torch.uint8)])
    g = torch.Generator().manual_seed(16)
    k_cache = torch.randn(1, 8, bs, D, generator=g).to(torch.float8_e4m3fn)
    v_bits = torch.zeros(1, 8, bs, D, dtype=torch.uint8)
    tables = torch.randperm(8, generator=g).to(torch.int32).view(8, 1)
    for b in range(8):
        v_bits[0, int(tables[b, 0]), 0] = codes[b * D:(b + 1) * D]
    v_cache = v_bits.view(torch.float8_e4m3fn)
    q = torch.randn(8, 1, D, generator=g)
    ctx = torch.ones(8, dtype=torch.int32)
    expected = codes.view(torch.float8_e4m3fn).to(torch.float32).view(8, 1, D)
    for splits in (1, 2):
        out = triton_decode.paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE, num_splits=splits)
        assert torch.equal(out, expected)


def test_default_num_splits():
    """~2 programs per SM of a 132-SM guess, capped by the tiles of the longest possible row, at least 1."""
    f = triton_decode.default_num_splits
    assert f(1, 3, 1000) == 64  # SmolLM2 at batch 1: 88 splits wanted, MAX_SPLITS caps
    assert f(4, 8, 1000) == 9  # 32 programs per split -> ceil(264 / 32)
    assert f(1, 3, 5) == 5  # a short table: no split without a tile
    assert f(256, 8, 1000) == 1  # the batch alone fills the device
    assert f(1, 1, 0) == 1


def test_the_heuristic_is_what_runs_by_default(monkeypatch):
    """num_splits=None runs default_num_splits with the block table's width as the longest row (no device -> host
    read of context_lens); the 300-position row of a 19-block table at block_n 64 has 5 tiles."""
    seen = []
    real = triton_decode.default_num_splits
    monkeypatch.setattr(triton_decode, "default_num_splits", lambda *a: seen.append(a) or real(*a))
    g = torch.Generator().manual_seed(17)
    q, kc, vc, tables, ctx = _paged_case(g, torch.float32, torch.float32, [1, 300], H=9, KV=3, D=32)
    out = triton_decode.paged_decode_attention(q, kc, vc, tables, ctx, SCALE)
    assert seen == [(2, 3, 5)]
    _check(out, q, kc, vc, tables, ctx)


def test_bad_arguments_raise_a_clear_error():
    g = torch.Generator().manual_seed(18)
    q, kc, vc, tables, ctx = _paged_case(g, torch.float32, torch.float32, [20], H=4, KV=2, D=32)
    f = triton_decode.paged_decode_attention
    with pytest.raises(ValueError, match="head_dim 48"):
        f(torch.randn(1, 4, 48), torch.randn(2, 4, 16, 48), torch.randn(2, 4, 16, 48), tables, ctx, SCALE)
    with pytest.raises(ValueError, match="not a multiple"):
        f(torch.randn(1, 3, 32), kc, vc, tables, ctx, SCALE)
    with pytest.raises(ValueError, match="int32"):
        f(q, kc, vc, tables.long(), ctx, SCALE)
    with pytest.raises(ValueError, match="num_splits"):
        f(q, kc, vc, tables, ctx, SCALE, num_splits=0)
    with pytest.raises(ValueError, match="block_n"):
        f(q, kc, vc, tables, ctx, SCALE, block_n=8)
    with pytest.raises(ValueError, match="power of two"):
        f(q, torch.randn(2, 4, 12, 32), torch.randn(2, 4, 12, 32), tables, ctx, SCALE)
    with pytest.raises(ValueError, match="out must be"):
        f(q, kc, vc, tables, ctx, SCALE, out=torch.empty(1, 4, 32, dtype=torch.float16))


def test_the_module_imports_without_triton(monkeypatch):
    """The engine imports the kernel module on every machine: without triton it loads, says so, and only a call
    fails."""
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    spec = importlib.util.spec_from_file_location("_triton_decode_without_triton", triton_decode.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.AVAILABLE is False and "triton" in module.IMPORT_ERROR
    with pytest.raises(RuntimeError, match="triton is not available"):
        module.paged_decode_attention(torch.randn(1, 4, 32), torch.randn(2, 1, 16, 32), torch.randn(2, 1, 16, 32),
                                      torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), SCALE)
