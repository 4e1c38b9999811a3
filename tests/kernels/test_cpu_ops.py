"""The fused CPU operators (inferd/kernels/cpu_ops.cpp) against their torch references (inferd/kernels/reference.py,
paged.py): pointwise ops bit for bit (they round where the references round), reductions within float rounding, bad
arguments refused with an error (never a crash), and whole engines on the fused ops against the references under the
greedy exactness rule (tests/parity.py), in float32 and in bfloat16."""

from __future__ import annotations

import pytest
import torch

from inferd import kernels
from inferd.kernels import build, reference

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def fused():
    ops = kernels.fused_cpu()
    assert ops is not None, f"the fused CPU kernels did not build: {build.error()}"  # make setup builds them
    return ops


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in units of the dtype's last place at b's magnitude."""
    eps = torch.finfo(a.dtype).eps
    a32, b32 = a.float(), b.float()
    return float(((a32 - b32).abs() / (b32.abs().clamp(min=1e-6) * eps)).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm(fused, dtype, with_x):
    g = torch.Generator().manual_seed(0)
    for rows, n in [(1, 576), (5, 64), (37, 576)]:
        x = torch.randn(rows, n, generator=g).to(dtype) if with_x else None
        res = (torch.randn(rows, n, generator=g) * 3).to(dtype)
        w = torch.randn(n, generator=g).to(dtype)
        res_ref, res_fused = res.clone(), res.clone()
        out_ref = reference.add_rms_norm(x, res_ref, w, 1e-5)
        out = fused.add_rms_norm(x, res_fused, w, 1e-5)
        assert torch.equal(res_fused, res_ref)  # the residual add rounds exactly as torch's
        # the sum of squares adds in another order: at most one rounding step apart
        assert ulps(out, out_ref) <= (2 if dtype == torch.bfloat16 else 64), (rows, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_is_bitwise_the_reference(fused, dtype):
    g = torch.Generator().manual_seed(1)
    H, KV, D, blocks, bs = 9, 3, 64, 8, 16
    T = 11
    tables = torch.randn(512, D, generator=g)
    cos, sin = tables.cos().to(dtype), tables.sin().to(dtype)
    positions = torch.randint(0, 512, (T,), generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=g).to(dtype)
    results = []
    for impl in (reference.rope_kv_write, fused.rope_kv_write):
        q = qkv.clone()
        kc, vc = torch.zeros(KV, blocks, bs, D, dtype=dtype), torch.zeros(KV, blocks, bs, D, dtype=dtype)
        impl(q, positions, cos, sin, kc, vc, slots, H, KV)
        results.append((q, kc, vc))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_partial_rotary(fused, dtype):
    """Tables narrower than head_dim (Phi's partial_rotary_factor): each q and k head's first R dims rotate, bit for
    bit as the reference rotates them, and the rest pass through to the cache unchanged."""
    g = torch.Generator().manual_seed(10)
    H, KV, D, R, T = 6, 2, 64, 32, 7
    tables = torch.randn(64, R, generator=g)
    cos, sin = tables.cos().to(dtype), tables.sin().to(dtype)
    positions = torch.randint(0, 64, (T,), generator=g)
    slots = torch.randperm(4 * 16, generator=g)[:T]
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=g).to(dtype)
    results = []
    for impl in (reference.rope_kv_write, fused.rope_kv_write):
        q = qkv.clone()
        kc, vc = torch.zeros(KV, 4, 16, D, dtype=dtype), torch.zeros(KV, 4, 16, D, dtype=dtype)
        impl(q, positions, cos, sin, kc, vc, slots, H, KV)
        results.append((q, kc, vc))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    heads, before = results[1][0].view(T, -1, D)[:, :H + KV], qkv.view(T, -1, D)[:, :H + KV]
    assert torch.equal(heads[..., R:], before[..., R:]) and not torch.equal(heads[..., :R], before[..., :R])


def test_rope_kv_write_into_a_lower_precision_cache(fused):
    g = torch.Generator().manual_seed(2)
    H, KV, D = 4, 2, 16
    qkv = torch.randn(3, (H + 2 * KV) * D, generator=g)
    cos, sin = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
    pos, slots = torch.tensor([0, 3, 7]), torch.tensor([5, 0, 9])
    caches = []
    for impl in (reference.rope_kv_write, fused.rope_kv_write):
        kc, vc = torch.zeros(KV, 2, 8, D, dtype=torch.bfloat16), torch.zeros(KV, 2, 8, D, dtype=torch.bfloat16)
        impl(qkv.clone(), pos, cos, sin, kc, vc, slots, H, KV)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(fused, dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(13, 2 * 1536, generator=g) * 4).to(dtype)
    out, ref = fused.silu_mul(gate_up), reference.silu_mul(gate_up)
    # torch's vectorized exp and the C library's may differ in the last bit of float32
    assert ulps(out, ref) <= (1 if dtype == torch.bfloat16 else 8)


def _paged_case(g, dtype, kv_dtype, lens, H=9, KV=3, D=64, bs=16, num_blocks=64):
    B = len(lens)
    k_cache = torch.randn(KV, num_blocks, bs, D, generator=g).to(kv_dtype)
    v_cache = torch.randn(KV, num_blocks, bs, D, generator=g).to(kv_dtype)
    width = max(-(-n // bs) for n in lens)
    perm = torch.randperm(num_blocks, generator=g)  # every sequence its own scattered blocks
    tables = torch.zeros(B, width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        need = -(-n // bs)
        tables[b, :need] = perm[used:used + need].to(torch.int32)
        used += need
    q = torch.randn(B, H, D, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


# heads (query, KV) and head_dim: SmolLM2's 9/3 x 64, Llama 3's 4 per KV head, multi-head, 8 per KV head at 32 (the
# bf16 AVX-512 path covers head_dim 64 with up to 4 query heads per KV head; the others the generic loops)
SHAPES = [(9, 3, 64), (8, 2, 64), (4, 4, 64), (8, 1, 32)]


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("shape", SHAPES)
def test_paged_decode_attention(fused, dtype, kv_dtype, shape):
    g = torch.Generator().manual_seed(4)
    H, KV, D = shape
    for lens in ([1], [128], [5, 17, 16, 33, 200, 1, 64]):
        q, kc, vc, tables, ctx = _paged_case(g, dtype, kv_dtype, lens, H=H, KV=KV, D=D)
        out = fused.paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
        ref = reference.paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
        # float32 throughout against the reference's matmuls in dtype: float32 rounding, or bf16's
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        # the exact answer, in float64 per row: the fused kernel is at least as close to it as the reference
        exact = _exact_attention(q, kc, vc, tables, ctx, 0.125)
        assert (out.double() - exact).abs().max() <= (ref.double() - exact).abs().max() + 1e-6


def _exact_attention(q, kc, vc, tables, lens, scale):
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


# a layer's attention options (paged.attend): name -> (window, sinks, softcap). The window (20) cuts the rows of 33
# and 200 positions (the 200-row's first 11 blocks are skipped) and not the shorter ones; 500 covers every row.
# softcap 1.0 puts the scaled scores on both sides of the soft-cap's polynomial/exponential switch (|s| = 0.625).
OPTIONS = {"window": (20, False, 0.0), "window-covering": (500, False, 0.0), "sinks": (0, True, 0.0),
           "softcap": (0, False, 1.0), "window+sinks+softcap": (20, True, 1.0)}


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 1, 32)])  # the bf16 AVX-512 path (D 64, group 3); generic loops
def test_paged_decode_attention_options(fused, dtype, kv_dtype, shape):
    """window, sinks and softcap against the reference, as the model passes them (keywords; sinks a parameter in
    the model's dtype), within the tolerance and the at-least-as-close-to-exact rule of the plain test."""
    g = torch.Generator().manual_seed(7)
    H, KV, D = shape
    q, kc, vc, tables, ctx = _paged_case(g, dtype, kv_dtype, [1, 17, 33, 200], H=H, KV=KV, D=D)
    sinks = torch.nn.Parameter(torch.randn(H, generator=g).to(dtype))
    plain = fused.paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, (window, with_sinks, softcap) in OPTIONS.items():
        opts = dict(window=window, sinks=sinks if with_sinks else None, softcap=softcap)
        with torch.inference_mode():
            out = fused.paged_decode_attention(q, kc, vc, tables, ctx, 0.125, **opts)
        ref = reference.paged_decode_attention(q, kc, vc, tables, ctx, 0.125, **opts)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=name)
        # the reference over float64 q and caches (its softmax runs in float32): the fused kernel at least as close
        exact = reference.paged_decode_attention(q.double(), kc.double(), vc.double(), tables, ctx, 0.125, **opts)
        assert (out.double() - exact).abs().max() <= (ref.double() - exact).abs().max() + 1e-6, name
        if window != 500:  # each option changes these rows (so the comparisons above can fail)
            assert (out.float() - plain.float()).abs().max() > 1e-2, name
        else:
            torch.testing.assert_close(out, plain, atol=0, rtol=0)


def test_paged_decode_attention_with_a_strided_query(fused):
    """The model passes q as a view into the fused qkv rows (row stride = the qkv width)."""
    g = torch.Generator().manual_seed(5)
    q, kc, vc, tables, ctx = _paged_case(g, torch.float32, torch.float32, [9, 40])
    wide = torch.randn(2, 9 * 64 + 2 * 3 * 64, generator=g)
    wide[:, :9 * 64] = q.reshape(2, -1)
    view = wide[:, :9 * 64].view(2, 9, 64)
    assert not view.is_contiguous()
    torch.testing.assert_close(fused.paged_decode_attention(view, kc, vc, tables, ctx, 0.125),
                               fused.paged_decode_attention(q, kc, vc, tables, ctx, 0.125), atol=0, rtol=0)


def test_the_fake_kernels_agree_with_the_ops(fused):
    """torch.library.opcheck: schema (what each op mutates), fake kernel (shapes, dtypes) and autograd registration
    against real calls, so that torch.compile traces them as they run (bench/compile_step.py)."""
    g = torch.Generator().manual_seed(9)
    rows, n = 3, 64
    x, res, w = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    torch.library.opcheck(torch.ops.inferd.add_rms_norm, (x, res, w, 1e-5))
    torch.library.opcheck(torch.ops.inferd.add_rms_norm, (None, res, w, 1e-5))
    torch.library.opcheck(torch.ops.inferd.silu_mul, (torch.randn(rows, 2 * n, generator=g),))
    q, kc, vc, tables, ctx = _paged_case(g, torch.float32, torch.float32, [5, 33])
    torch.library.opcheck(torch.ops.inferd.paged_decode_attention, (q, kc, vc, tables, ctx, 0.125))
    torch.library.opcheck(torch.ops.inferd.paged_decode_attention, (q, kc, vc, tables, ctx, 0.125),
                          dict(window=8, sinks=torch.randn(9, generator=g), softcap=2.0))
    H, KV, D, T = 9, 3, 64, 4
    tab = torch.randn(64, D, generator=g)
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=g)
    torch.library.opcheck(torch.ops.inferd.rope_kv_write,
                          (qkv, torch.arange(T), tab.cos(), tab.sin(), kc, vc, torch.randperm(64 * 16)[:T], H, KV))
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, 4), dtype=torch.int32, generator=g)
    torch.library.opcheck(torch.ops.inferd.apply_token_bitmask,
                          (torch.randn(rows, 100, generator=g), mask, torch.tensor([0, 2])))


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_the_grammar_mask_equals_xgrammars(fused, vocab):
    """apply_token_bitmask writes -inf exactly where xgrammar's own kernel does (the reference): random words, words
    of all ones (skipped) and all zeros, a vocabulary that is no multiple of 32, every row or some."""
    import xgrammar

    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (6, words), dtype=torch.int32, generator=g)
    mask[:, ::5] = -1
    mask[:, 1::7] = 0
    logits = torch.randn(6, vocab, generator=g)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 4]):
        ours, ref = logits.clone(), logits.clone()
        torch.ops.inferd.apply_token_bitmask(ours, mask, torch.tensor(rows))
        xgrammar.apply_token_bitmask_inplace(ref, mask, vocab_size=vocab, indices=None if len(rows) == 6 else rows)
        assert torch.equal(ours, ref) and torch.isinf(ours).any()
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.inferd.apply_token_bitmask(logits, mask, torch.tensor([6]))
    with pytest.raises(RuntimeError, match="covers"):
        torch.ops.inferd.apply_token_bitmask(logits, mask[:, :words - 1].contiguous(), torch.tensor([0]))


def test_bad_arguments_raise_instead_of_reading_out_of_bounds(fused):
    g = torch.Generator().manual_seed(6)
    q, kc, vc, tables, ctx = _paged_case(g, torch.float32, torch.float32, [20])
    with pytest.raises(RuntimeError, match="block id"):
        fused.paged_decode_attention(q, kc, vc, torch.full_like(tables, 10_000), ctx, 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        fused.paged_decode_attention(q, kc, vc, tables, torch.tensor([999], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        fused.paged_decode_attention(q, kc, vc, tables.long(), ctx, 1.0)
    with pytest.raises(RuntimeError, match="sinks"):
        fused.paged_decode_attention(q, kc, vc, tables, ctx, 1.0, sinks=torch.zeros(3))
    with pytest.raises(RuntimeError, match="window"):
        fused.paged_decode_attention(q, kc, vc, tables, ctx, 1.0, window=-1)
    qkv = torch.randn(2, (9 + 6) * 64)
    with pytest.raises(RuntimeError, match="slot"):
        fused.rope_kv_write(qkv, torch.tensor([0, 1]), torch.ones(4, 64), torch.ones(4, 64), kc, vc,
                            torch.tensor([0, 10 ** 9]), 9, 3)
    with pytest.raises(RuntimeError, match="position"):
        fused.rope_kv_write(qkv, torch.tensor([0, 4]), torch.ones(4, 64), torch.ones(4, 64), kc, vc,
                            torch.tensor([0, 1]), 9, 3)
    with pytest.raises(RuntimeError, match="even"):  # wider than head_dim, or odd
        fused.rope_kv_write(qkv, torch.tensor([0, 1]), torch.ones(4, 66), torch.ones(4, 66), kc, vc,
                            torch.tensor([0, 1]), 9, 3)


def test_select():
    assert kernels.select("cpu", torch.float32, torch.float32, "reference") is kernels.REFERENCE
    assert kernels.select("cpu", torch.bfloat16, torch.bfloat16).decode_in_place
    # a float8 cache: the KV ops stay references, the others fused
    fp8 = kernels.select("cpu", torch.bfloat16, torch.float8_e4m3fn)
    assert not fp8.decode_in_place and fp8.rope_kv_write is reference.rope_kv_write
    assert fp8.add_rms_norm is not reference.add_rms_norm
    assert kernels.select("meta", torch.float32, torch.float32) is kernels.REFERENCE
    with pytest.raises(ValueError, match="no fused kernels"):
        kernels.select("meta", torch.float32, torch.float32, "fused")
    with pytest.raises(ValueError, match="unknown kernels mode"):
        kernels.select("cpu", torch.float32, torch.float32, "fast")


def test_the_build_is_keyed_by_this_cpu_and_cached(tmp_path, monkeypatch):
    """A build for another CPU (another key) is never loaded, and an existing build is not compiled again."""
    compiler = build._compiler()
    key = build.build_key(compiler)
    monkeypatch.setattr(build, "_cpu_flags", lambda: "fpu sse2 avx2")
    assert build.build_key(compiler) != key
    monkeypatch.undo()
    lib = build.build()  # already built by make setup: returns at once
    assert lib.parent.name == key and lib.exists()


def test_without_a_working_compiler_the_references_run(tmp_path, monkeypatch):
    """A failed build (here: a "compiler" that fails) is an error from build() and False from load(), whose
    caller (kernels.select) then runs the references; INFERD_KERNELS=reference never loads the library."""
    monkeypatch.setenv("INFERD_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(RuntimeError, match="failed"):
        build.build()
    assert not list(tmp_path.glob("*/*.so"))  # nothing half-written is left to be loaded
    monkeypatch.setattr(build, "_state", {})
    assert build.load() is False and "failed" in build.error()
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv(build.DISABLE_ENV, "reference")
    assert build.load() is False and build.error() == "INFERD_KERNELS=reference"


def test_the_kernels_flag_reaches_the_engine_and_the_workers():
    import argparse

    from inferd.cli.engine_flags import add_engine_args, engine_config
    from inferd.cli.serve import worker_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).kernels == "auto"
    args = p.parse_args(["--kernels", "reference"])
    assert engine_config(args).kernels == "reference"
    args.heartbeat_interval, args.echo = 0.5, False
    out = worker_args(args, "m")
    assert out[out.index("--kernels") + 1] == "reference"
    with pytest.raises(SystemExit):
        p.parse_args(["--kernels", "fast"])
