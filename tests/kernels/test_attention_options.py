"""The attention options some families add (a sliding window, gpt-oss's sinks, Gemma 2's soft-cap) in the reference
paged operators, against transformers' own eager attention (gpt-oss's for sinks, Gemma 2's for soft-capping) over the
same keys and values laid out densely: decode over block tables and over gathered groups, a first prefill chunk, a
later chunk over the cache, and the varlen contract."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inferd.kernels import paged, reference

N_KV, GROUP, D, BS = 2, 2, 16, 4
H = N_KV * GROUP
CTX = 23  # the sequence's length: 6 blocks, the last one partly filled
OPTIONS = {  # name: (window, sinks, softcap)
    "window": (5, False, 0.0),
    "sinks": (0, True, 0.0),
    "window+sinks": (5, True, 0.0),
    "softcap": (0, False, 3.0),
    "window+softcap": (5, False, 3.0),
}


@pytest.fixture(scope="module")
def seq():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(CTX, N_KV, D, generator=g)
    v = torch.randn(CTX, N_KV, D, generator=g)
    q = torch.randn(CTX, H, D, generator=g)
    sinks = torch.randn(H, generator=g)
    blocks = torch.tensor([7, 2, 9, 0, 4, 11])  # scattered, not in order
    k_cache = torch.zeros(N_KV, 12, BS, D)
    v_cache = torch.zeros(N_KV, 12, BS, D)
    slots = blocks[torch.arange(CTX) // BS] * BS + torch.arange(CTX) % BS
    paged.write_kv(k_cache, v_cache, k, v, slots)
    return q, k, v, sinks, blocks, k_cache, v_cache


def transformers_attention(q, k, v, rows, window, sinks, softcap):
    """Query rows (absolute positions `rows`) over keys 0..len(k)-1, by transformers' eager attention."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    keep = sliding_window_causal_mask_function(window) if window else causal_mask_function
    allowed = keep(0, 0, rows.unsqueeze(1), torch.arange(k.shape[0]).unsqueeze(0))
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
    module = nn.Module()
    module.num_key_value_groups, module.head_dim = GROUP, D
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if sinks is not None:
        assert not softcap
        module.sinks = sinks
        out, _ = gpt_oss_eager(module, qh, kh, vh, mask, scaling=D ** -0.5)
    else:
        out, _ = gemma2_eager(module, qh, kh, vh, mask, scaling=D ** -0.5, softcap=softcap or None)
    return out[0]  # [n, H, D]


def assert_close(ours, ref):
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_decode(seq, name):
    q, k, v, sinks, blocks, k_cache, v_cache = seq
    window, with_sinks, softcap = OPTIONS[name]
    opts = dict(window=window, sinks=sinks if with_sinks else None, softcap=softcap)
    lens = [CTX, 13, 3]  # three queries over prefixes of the same blocks: windows cut, not cut, all of a short one
    qs = torch.stack([q[n - 1] for n in lens])
    tables = blocks.to(torch.int32).expand(len(lens), -1).contiguous()
    ours = reference.paged_decode_attention(qs, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32),
                                            D ** -0.5, **opts)
    for i, n in enumerate(lens):
        ref = transformers_attention(q[n - 1:n], k[:n], v[:n], torch.tensor([n - 1]), window, opts["sinks"], softcap)
        assert_close(ours[i], ref[0])
    # the gathered-groups path (what the runner builds for the references) gives the same rows
    mask = paged.build_decode_mask(lens, len(blocks), BS, torch.float32)
    grouped = paged.decode_attention(qs, k_cache, v_cache, tables.reshape(-1).long(), mask, D ** -0.5, **opts)
    assert_close(grouped, ours)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_prefill(seq, name):
    q, k, v, sinks, blocks, k_cache, v_cache = seq
    window, with_sinks, softcap = OPTIONS[name]
    opts = dict(window=window, sinks=sinks if with_sinks else None, softcap=softcap)
    ref = transformers_attention(q, k, v, torch.arange(CTX), window, opts["sinks"], softcap)
    # a first chunk (its own k, v) of 9 rows, then a later chunk of the rest over the cache
    first = paged.prefill_attention(q[:9], k[:9], v[:9], k_cache, v_cache, 0, blocks, D ** -0.5, **opts)
    later = paged.prefill_attention(q[9:], k[9:], v[9:], k_cache, v_cache, 9, blocks, D ** -0.5, **opts)
    assert_close(first, ref[:9])
    assert_close(later, ref[9:])
    # the varlen contract: both chunks in one call (the first read back from the cache too)
    cu = torch.tensor([0, 9, 9 + CTX - 9], dtype=torch.int32)
    tables = blocks.to(torch.int32).expand(2, -1).contiguous()
    varlen = reference.paged_prefill_attention(torch.cat([q[:9], q[9:]]), k_cache, v_cache, cu,
                                               torch.tensor([9, CTX], dtype=torch.int32), tables, D ** -0.5, **opts)
    assert_close(varlen, ref)


def test_options_change_the_result(seq):
    """Each option matters on these inputs (so the comparisons above can fail)."""
    q, k, v, sinks, blocks, k_cache, v_cache = seq
    plain = transformers_attention(q, k, v, torch.arange(CTX), 0, None, 0.0)
    for name, (window, with_sinks, softcap) in OPTIONS.items():
        opts = dict(window=window, sinks=sinks if with_sinks else None, softcap=softcap)
        ours = paged.prefill_attention(q, k, v, k_cache, v_cache, 0, blocks, D ** -0.5, **opts)
        assert (ours - plain).abs().max() > 1e-2, name
