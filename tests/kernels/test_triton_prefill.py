"""The Triton paged prefill attention kernel (inferd/kernels/triton_prefill.py) against the torch reference
(paged.prefill_attention, one sequence at a time) and an exact float64 computation, run on CPU through Triton's
interpreter: several ragged sequences in one launch, cached contexts, chunks across block boundaries, a one-token
row over a long cache, GQA groups 1/3/8, head_dim 32/64, block sizes 8/16, strided q, float8 and fp16 caches.

How interpretation is forced (read from triton 3.9.0's sources, and tried): `triton.jit` decides at DECORATION time
-- runtime/jit.py's `jit()` returns an `InterpretedFunction` when `knobs.runtime.interpret` is true, a compiling
`JITFunction` otherwise, and nothing looks again at launch. `knobs.runtime.interpret` (knobs.py) is an `env_bool`
descriptor that reads TRITON_INTERPRET from os.environ on every access unless a value was assigned to it (an
assignment wins and is also written back to the environment). Two consequences:

- our kernel module must be imported (or reloaded) while interpretation is on: this file sets TRITON_INTERPRET=1
  when pytest imports it, before it imports triton, and the `prefill` fixture assigns the knob and reloads
  inferd.kernels.triton_prefill if its kernel is not an InterpretedFunction (the module was imported while the knob
  was off);
- triton's OWN library functions are decorated the same way when triton is first imported: tl.zeros, tl.max, tl.sum
  (triton/language/standard.py) are JITFunctions if triton was imported before interpretation was on, and the
  interpreter then stops at the first of them with "Cannot call @triton.jit'd outside of the scope of a kernel" --
  no reload of our module fixes that. Setting the variable at the top of this file is enough as long as nothing
  imports triton earlier in the session (true today: nothing collected before this file imports it). If that
  changes (say, inferd/kernels/__init__.py importing a Triton module eagerly), the fixture fails with a message
  saying so; the fix is `os.environ.setdefault("TRITON_INTERPRET", "1")` at the top of tests/conftest.py (on a
  machine without a GPU), or TRITON_INTERPRET=1 in the environment.

Both settings stay for the rest of the session on purpose (this suite has no GPU tests; a Triton kernel module
imported later is interpreted too).

The interpreter computes float32 and float16 correctly but not bfloat16 (garbage with triton 3.9.0 here), so only
fp32/fp16 activations and fp32/fp16/float8 caches are tested. Without triton the tests fail (the fixture asserts),
they do not skip: a machine meant to run them that lacks triton is a broken setup.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import (see the docstring)

import pytest  # noqa: E402
import torch  # noqa: E402

from inferd.kernels import paged, reference  # noqa: E402

try:
    import triton  # noqa: E402
    from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

    TRITON_ERROR = None
except Exception as e:  # reported by the fixture, so every test fails with the reason
    triton = None
    TRITON_ERROR = f"{type(e).__name__}: {e}"


@pytest.fixture(scope="module")
def prefill():
    assert triton is not None, f"triton is not importable: {TRITON_ERROR}"
    if hasattr(triton, "knobs") and hasattr(triton.knobs.runtime, "interpret"):
        triton.knobs.runtime.interpret = True
    from inferd.kernels import triton_prefill as mod

    if not isinstance(mod._paged_prefill_kernel, InterpretedFunction):  # imported before interpretation was forced
        mod = importlib.reload(mod)
    assert mod.AVAILABLE, mod.IMPORT_ERROR
    assert isinstance(mod._paged_prefill_kernel, InterpretedFunction), "the kernel would compile for a GPU"
    assert isinstance(triton.language.zeros, InterpretedFunction), (
        "triton was imported in this process before TRITON_INTERPRET=1 was set, so its library functions (tl.zeros, "
        "tl.max, tl.sum) cannot run in the interpreter: set TRITON_INTERPRET=1 before anything imports triton "
        "(tests/conftest.py, or the environment); see this module's docstring")
    return mod.paged_prefill_attention


class Case:
    """Several sequences in one paged cache, each with random K/V at every position of its context (written through
    paged.write_kv into scattered blocks) and a chunk of queries after its cached part."""

    def __init__(self, seqs: list[tuple[int, int]], H: int, KV: int, D: int, block_size: int, q_dtype: torch.dtype,
                 kv_dtype: torch.dtype, seed: int = 0, q_layout: str = "contiguous"):
        g = torch.Generator().manual_seed(seed)
        self.seqs, self.H, self.KV, self.D, self.bs = seqs, H, KV, D, block_size
        self.q_dtype, self.scale = q_dtype, D ** -0.5
        nblocks = [-(-(c + n) // block_size) for c, n in seqs]
        total = sum(nblocks) + 3  # a few blocks nobody owns
        order = torch.randperm(total, generator=g)  # scattered, out of order
        if kv_dtype == torch.float8_e4m3fn:  # unowned slots: arbitrary finite codes
            k_bits = torch.randint(0, 0x7F, (KV, total, block_size, D), generator=g, dtype=torch.uint8)
            self.k_cache, self.v_cache = k_bits.view(kv_dtype), k_bits.flip(-1).clone().view(kv_dtype)
        else:  # unowned slots: NaN, so a read of one shows in the output
            self.k_cache = torch.full((KV, total, block_size, D), float("nan"), dtype=kv_dtype)
            self.v_cache = torch.full((KV, total, block_size, D), float("nan"), dtype=kv_dtype)
        self.block_ids: list[torch.Tensor] = []
        tables = torch.zeros((len(seqs), max(nblocks)), dtype=torch.int32)
        at = 0
        for s, ((c, n), nb) in enumerate(zip(seqs, nblocks)):
            ids = order[at:at + nb]
            at += nb
            self.block_ids.append(ids)
            tables[s, :nb] = ids.to(torch.int32)
            ctx = c + n
            pos = torch.arange(ctx)
            slots = ids[pos // block_size] * block_size + pos % block_size
            k = torch.randn(ctx, KV, D, generator=g)
            v = torch.randn(ctx, KV, D, generator=g)
            paged.write_kv(self.k_cache, self.v_cache, k, v, slots)
        self.block_tables = tables
        lens = [n for _, n in seqs]
        self.cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
        self.context_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
        T = sum(lens)
        q = torch.randn(T, H, D, generator=g).to(q_dtype)
        if q_layout == "qkv":  # q as the engine sees it: the first H*D columns of the fused qkv rows
            qkv = torch.randn(T, (H + 2 * KV) * D, generator=g).to(q_dtype)
            qkv[:, :H * D] = q.reshape(T, H * D)
            q = qkv[:, :H * D].view(T, H, D)
        elif q_layout == "head_major":  # row stride D, head stride T * D
            q = q.transpose(0, 1).contiguous().transpose(0, 1)
        self.q = q

    def chunk(self, s: int) -> slice:
        return slice(int(self.cu[s]), int(self.cu[s + 1]))

    def run(self, prefill, **kw) -> torch.Tensor:
        return prefill(self.q, self.k_cache, self.v_cache, self.cu, self.context_lens, self.block_tables,
                       self.scale, **kw)

    def reference(self) -> torch.Tensor:
        """paged.prefill_attention per sequence. A first chunk (nothing cached) gets its own k/v as read back from
        the cache in q's dtype (dequantized for float8), so both sides attend over the same values."""
        outs = []
        for s, (c, n) in enumerate(self.seqs):
            ids = self.block_ids[s]
            k = v = None
            if c == 0:
                k = paged.gather_blocks(self.k_cache, ids, self.q_dtype).view(self.KV, -1, self.D)[:, :n]
                v = paged.gather_blocks(self.v_cache, ids, self.q_dtype).view(self.KV, -1, self.D)[:, :n]
                k, v = k.transpose(0, 1), v.transpose(0, 1)
            outs.append(paged.prefill_attention(self.q[self.chunk(s)], k, v, self.k_cache, self.v_cache, c, ids,
                                                self.scale))
        return torch.cat(outs)

    def exact(self) -> torch.Tensor:
        """float64 attention over the values the kernel reads (the cache's, rounded to q's dtype as it does)."""
        outs = []
        group = self.H // self.KV
        for s, (c, n) in enumerate(self.seqs):
            ids, ctx = self.block_ids[s], c + n
            keys = paged.gather_blocks(self.k_cache, ids, self.q_dtype).view(self.KV, -1, self.D)[:, :ctx].double()
            vals = paged.gather_blocks(self.v_cache, ids, self.q_dtype).view(self.KV, -1, self.D)[:, :ctx].double()
            keys, vals = keys.repeat_interleave(group, 0), vals.repeat_interleave(group, 0)  # [H, ctx, D]
            q = self.q[self.chunk(s)].double().transpose(0, 1)  # [H, n, D]
            scores = q @ keys.transpose(1, 2) * self.scale
            visible = torch.arange(ctx)[None, :] <= (torch.arange(n)[:, None] + c)
            scores = scores.masked_fill(~visible, float("-inf"))
            outs.append((scores.softmax(-1) @ vals).transpose(0, 1))
        return torch.cat(outs)


def check(case: Case, out: torch.Tensor) -> None:
    assert out.shape == case.q.shape and out.dtype == case.q_dtype
    ref = case.reference()
    if case.q_dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # both are roundings of the exact result: the kernel must be at least as close as the reference
        exact = case.exact()
        err = float((out.double() - exact).abs().max())
        ref_err = float((ref.double() - exact).abs().max())
        assert err <= ref_err + 1e-3, (err, ref_err)
        torch.testing.assert_close(out.double(), exact, atol=2e-3, rtol=2e-3)


# (num_cached, chunk length): first chunks, later chunks, chunks across block boundaries, one-token rows
RAGGED = [(0, 17), (3, 5), (16, 16), (33, 1), (0, 40), (3, 1)]


def test_ragged_batch_gqa3(prefill):
    """SmolLM2's head shape (9 query heads over 3 KV heads), small tiles: several query and key tiles per sequence,
    tiles that start mid-sequence and sequences that start mid-tile."""
    case = Case(RAGGED, H=9, KV=3, D=32, block_size=16, q_dtype=torch.float32, kv_dtype=torch.float32)
    check(case, case.run(prefill, block_m=16, block_n=16))


@pytest.mark.parametrize("H,KV", [(2, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_gqa_and_block_sizes(prefill, H, KV, block_size):
    seqs = [(0, 5), (33, 17), (16, 1)]
    case = Case(seqs, H=H, KV=KV, D=32, block_size=block_size, q_dtype=torch.float32, kv_dtype=torch.float32,
                seed=block_size + H)
    check(case, case.run(prefill, block_m=16, block_n=16))


def test_head_dim_64_default_tiles(prefill):
    """The default (64-wide) tiles: one query tile covers several sequences' worth of rows in the grid bound."""
    case = Case([(0, 40), (3, 17), (16, 5)], H=4, KV=2, D=64, block_size=16, q_dtype=torch.float32,
                kv_dtype=torch.float32, seed=3)
    check(case, case.run(prefill))


def test_one_token_over_a_long_cache(prefill):
    """Decode-like rows in a prefill launch: a single query whose key loop runs over many tiles and blocks."""
    case = Case([(150, 1), (0, 3), (77, 1)], H=3, KV=1, D=32, block_size=8, q_dtype=torch.float32,
                kv_dtype=torch.float32, seed=4)
    check(case, case.run(prefill, block_m=16, block_n=32))


@pytest.mark.parametrize("layout", ["qkv", "head_major"])
def test_strided_q_and_out(prefill, layout):
    case = Case([(3, 17), (0, 5)], H=9, KV=3, D=32, block_size=16, q_dtype=torch.float32, kv_dtype=torch.float32,
                seed=5, q_layout=layout)
    assert not case.q.is_contiguous()
    out = torch.full((case.q.shape[1], case.q.shape[0], case.D), float("nan")).transpose(0, 1)  # strided too
    got = case.run(prefill, out=out, block_m=16, block_n=16)
    assert got is out
    check(case, out)


def test_float8_cache_with_float32_q(prefill):
    case = Case([(0, 17), (33, 5), (3, 1)], H=9, KV=3, D=32, block_size=16, q_dtype=torch.float32,
                kv_dtype=torch.float8_e4m3fn, seed=6)
    check(case, case.run(prefill, block_m=16, block_n=16))


def test_float8_decoding_is_exact_for_every_code(prefill):
    """A one-position context makes the output its value row exactly (softmax weight 1): 8 one-token sequences
    whose V rows hold all 256 codes (the two NaN codes, never written, replaced by 0) read back as torch's float8 ->
    float32 conversion exactly -- subnormals and +-448 included. (Bit for bit but for -0, which comes out +0: the
    accumulator starts at +0 and +0 + -0 = +0; the decoder itself keeps the sign.)"""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0
    S, D = 8, 32
    v_bits = codes.view(1, S, 1, D)
    v_cache = v_bits.view(torch.float8_e4m3fn)
    k_cache = torch.zeros_like(v_bits).view(torch.float8_e4m3fn)
    q = torch.randn(S, 1, D)
    cu = torch.arange(S + 1, dtype=torch.int32)
    tables = torch.arange(S, dtype=torch.int32).view(S, 1)
    out = prefill(q, k_cache, v_cache, cu, torch.ones(S, dtype=torch.int32), tables, D ** -0.5)
    expect = v_cache.view(S, 1, D).to(torch.float32)
    assert torch.equal(out, expect)  # == treats -0 as 0
    assert int((out.view(torch.int32) != expect.view(torch.int32)).sum()) == 1  # just the -0 code


@pytest.mark.parametrize("H,KV,block_size", [(9, 3, 16), (8, 1, 8)])
def test_float16(prefill, H, KV, block_size):
    case = Case(RAGGED[:4], H=H, KV=KV, D=32, block_size=block_size, q_dtype=torch.float16,
                kv_dtype=torch.float16, seed=7)
    check(case, case.run(prefill, block_m=16, block_n=16))


# a layer's attention options (paged.attend): (name, window, sinks, softcap). Query tiles of 32 rows over key tiles
# of 16: with the window (5), a row near a query tile's end sees nothing in the tile's first key tiles (the running
# max stays -inf there), and keys before a query tile's first window are never read.
OPTION_CASES = [("window", 5, False, 0.0), ("sinks", 0, True, 0.0), ("softcap", 0, False, 1.0),
                ("all", 5, True, 1.0)]


@pytest.mark.parametrize("name,window,with_sinks,softcap", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_attention_options(prefill, name, window, with_sinks, softcap):
    """window, sinks and softcap against reference.paged_prefill_attention (the varlen contract over paged.attend):
    a first chunk of 40 rows, later chunks, one-token rows; GQA 2 query heads per KV head."""
    case = Case([(0, 40), (3, 5), (33, 1), (16, 16)], H=4, KV=2, D=32, block_size=8, q_dtype=torch.float32,
                kv_dtype=torch.float32, seed=10)
    g = torch.Generator().manual_seed(11)
    opts = dict(window=window, sinks=torch.randn(4, generator=g) if with_sinks else None, softcap=softcap)
    out = case.run(prefill, block_m=32, block_n=16, **opts)
    ref = reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.cu, case.context_lens,
                                            case.block_tables, case.scale, **opts)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (out - case.reference()).abs().max() > 1e-2  # the option matters here (so the comparison can fail)
    with pytest.raises(ValueError, match="softcap"):
        case.run(prefill, softcap=-1.0)


def test_single_sequence(prefill):
    """S == 1: the in-kernel search over cu_seqlens_q has a single candidate."""
    case = Case([(5, 20)], H=2, KV=1, D=32, block_size=8, q_dtype=torch.float32, kv_dtype=torch.float32, seed=8)
    check(case, case.run(prefill, block_m=16, block_n=16))


def test_bad_arguments(prefill):
    case = Case([(0, 3)], H=2, KV=2, D=32, block_size=8, q_dtype=torch.float32, kv_dtype=torch.float32)
    args = (case.cu, case.context_lens, case.block_tables, case.scale)
    q48 = torch.randn(3, 2, 48)
    kc48 = torch.zeros(2, 2, 8, 48)
    with pytest.raises(ValueError, match="head_dim"):
        prefill(q48, kc48, kc48, *args)
    kc_odd = torch.zeros(2, 2, 6, 32)
    with pytest.raises(ValueError, match="block_size"):
        prefill(case.q, kc_odd, kc_odd, *args)
    with pytest.raises(ValueError, match="multiple"):
        prefill(torch.randn(3, 3, 32), case.k_cache, case.v_cache, *args)
    with pytest.raises(ValueError, match="int32"):
        prefill(case.q, case.k_cache, case.v_cache, case.cu.long(), *args[1:])
    with pytest.raises(ValueError, match="tile"):
        case.run(prefill, block_m=8)


def test_imports_without_triton():
    """The engine imports the module everywhere: without triton it loads, says so, and fails only when called."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from inferd.kernels import triton_prefill as m\n"
        "assert not m.AVAILABLE\n"
        "try:\n"
        "    m.paged_prefill_attention(*[torch.zeros(1)] * 6, 1.0)\n"
        "except RuntimeError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_float64_helper_matches_the_reference():
    """The exact helper itself, against paged.prefill_attention in float32 (no kernel involved)."""
    case = Case([(3, 5), (0, 4)], H=4, KV=2, D=32, block_size=8, q_dtype=torch.float32, kv_dtype=torch.float32)
    torch.testing.assert_close(case.exact().float(), case.reference(), atol=1e-5, rtol=1e-5)
    assert math.isfinite(float(case.exact().abs().max()))
