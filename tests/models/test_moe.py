"""The sparse MoE block (inferd/models/moe.py) against transformers' own blocks (MixtralSparseMoeBlock,
Qwen3MoeSparseMoeBlock, GptOssMLP), fp32, tiny (hidden 64, 8 experts, top-2, expert width 32), by the float32 bound
of tests/parity.py on the block's output rows; mutations of each family's routing and activation fail that bound;
int8/int4 experts against the dequantized weights; the checkpoint names save_pretrained writes load too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from inferd.models.moe import MoESpec, SparseMoE, hf_block_prefix
from inferd.models.quantize import _float_weight, quantize_model, weight_bytes
from parity import FP32, scale_of

pytestmark = pytest.mark.timeout(120)

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 2
FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")
INPUT_SCALE = 4.0  # wide enough that gpt-oss's clamp at 7 bites on some gate/up values (asserted)


def hf_config(family: str, **kw):
    common = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts_per_tok=TOP_K)
    if family == "mixtral":
        from transformers import MixtralConfig

        cfg = MixtralConfig(intermediate_size=INTER, num_local_experts=EXPERTS, **common, **kw)
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(moe_intermediate_size=INTER, intermediate_size=4 * INTER, num_experts=EXPERTS,
                             **common, **kw)
    else:
        from transformers import GptOssConfig

        cfg = GptOssConfig(intermediate_size=INTER, num_local_experts=EXPERTS, layer_types=["full_attention"],
                           **common, **kw)
    cfg._experts_implementation = "eager"  # transformers' own per-expert loop (its reference code)
    return cfg


def hf_block(family: str, seed: int = 0, **kw):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls = {"mixtral": MixtralSparseMoeBlock, "qwen3_moe": Qwen3MoeSparseMoeBlock, "gpt_oss": GptOssMLP}[family]
    cfg = hf_config(family, **kw)
    block = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return block, cfg


def hf_out(block, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]  # GptOssMLP returns (hidden, router_scores)


def inputs(T: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(seed)) * INPUT_SCALE


def diff_and_tol(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """The largest difference over the rows, and the float32 bound at the rows' scale."""
    return float((ours - ref).abs().max()), FP32.tolerance(scale_of(ref))


def assert_close(ours, ref, label):
    diff, tol = diff_and_tol(ours, ref)
    assert diff <= tol, f"{label}: differs by {diff:.3g}, beyond the float32 bound {tol:.3g}"


def assert_far(ours, ref, label):
    diff, tol = diff_and_tol(ours, ref)
    assert diff > 100 * tol, f"{label}: the mutation is within {diff:.3g} (bound {tol:.3g}): the test would miss it"


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    block, cfg = hf_block(request.param)
    spec = MoESpec.from_hf_config(cfg)
    return request.param, block, SparseMoE.from_hf_block(block, spec)


@torch.no_grad()
def test_matches_transformers(pair):
    family, block, ours = pair
    packed = SparseMoE(ours.spec)
    packed.load_state_dict(ours.state_dict())
    assert packed.pack() and packed.experts.packed is not None  # oneDNN's layout, as build_model leaves a CPU model
    for T in (1, 37):
        x = inputs(T)
        ref = hf_out(block, x)
        assert_close(ours(x), ref, f"{family} T={T}")
        assert_close(packed(x), ref, f"{family} T={T}, packed")
    assert bool((ours.last_expert_counts > 0).all()), f"{family}: 37 tokens did not reach every expert"


@torch.no_grad()
def test_every_token_to_the_same_experts(pair):
    """A batch whose every token picks experts 3 and 5: one matmul pair per active expert over all 37 rows."""
    family, block, ours = pair
    router = block.router if family == "gpt_oss" else block.gate
    saved = router.weight.clone()
    try:
        x = inputs(37).abs()  # positive inputs: the positive rows win for every token
        router.weight.mul_(0.01)
        router.weight[3] = 1.0
        router.weight[5] = 0.98  # second, by a margin that float32 softmax keeps above the zeros
        ours.router.load(router.weight, getattr(router, "bias", None))
        out = ours(x)
        assert ours.last_expert_counts.tolist() == [0, 0, 0, 37, 0, 37, 0, 0]
        assert_close(out, hf_out(block, x), f"{family} one expert pair")
        # an expert-parallel shard holding experts no token chose adds nothing
        shard = SparseMoE(ours.spec, (0, 2))
        ex = ours.experts
        shard.load_router(ours.router.weight, ours.router.bias)
        shard.load_experts(ex.gate_up, ex.down, ex.gate_up_bias, ex.down_bias)
        assert torch.equal(shard(x), torch.zeros_like(x))
    finally:
        router.weight.copy_(saved)
        ours.router.load(saved, getattr(router, "bias", None))


@torch.no_grad()
def test_qwen3_norm_topk_prob_both_ways():
    x = inputs(37)
    for norm in (True, False):
        block, cfg = hf_block("qwen3_moe", norm_topk_prob=norm)
        spec = MoESpec.from_hf_config(cfg)
        assert spec.norm_topk_prob is norm
        ref = hf_out(block, x)
        assert_close(SparseMoE.from_hf_block(block, spec)(x), ref, f"qwen3_moe norm_topk_prob={norm}")
        # mutation: the other choice (renormalising when the config says not to, and the reverse)
        wrong = SparseMoE.from_hf_block(block, dataclasses.replace(spec, norm_topk_prob=not norm))
        assert_far(wrong(x), ref, f"qwen3_moe norm_topk_prob={not norm} against {norm}")


@torch.no_grad()
def test_mutations_fail(pair):
    family, block, ours = pair
    x = inputs(37)
    ref = hf_out(block, x)
    spec = ours.spec
    if family == "gpt_oss":
        gate_up = torch.stack([ours.experts.gate_up_mm(e, x) for e in range(EXPERTS)])
        assert float(gate_up.abs().max()) > spec.swiglu_limit, "the clamp never bites: the mutation proves nothing"
        mutants = {"no clamp": dataclasses.replace(spec, swiglu_limit=1e9),
                   "alpha 1.0": dataclasses.replace(spec, swiglu_alpha=1.0)}
    elif family == "mixtral":  # no renormalisation of the top-k softmax weights
        mutants = {"unnormalised": dataclasses.replace(spec, family="qwen3_moe", norm_topk_prob=False)}
    else:
        mutants = {"top-3": dataclasses.replace(spec, top_k=3)}
    for what, mutant in mutants.items():
        m = SparseMoE(mutant)
        m.load_state_dict(ours.state_dict())
        assert_far(m(x), ref, f"{family} {what}")
    # gpt-oss's interleaved gate/up taken as concatenated
    if family == "gpt_oss":
        m = SparseMoE(spec)
        state = {k: v.detach() for k, v in block.state_dict().items()}
        gu, gub = state["experts.gate_up_proj"], state["experts.gate_up_proj_bias"]
        m.load_router(state["router.weight"], state["router.bias"])
        m.load_experts(gu.transpose(1, 2), state["experts.down_proj"].transpose(1, 2), gub,
                       state["experts.down_proj_bias"])
        assert_far(m(x), ref, "gpt_oss gate/up not de-interleaved")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_loads_saved_checkpoint_names(family, tmp_path):
    """save_pretrained writes per-expert names (mixtral: block_sparse_moe.experts.N.w1/w3/w2, qwen3_moe:
    mlp.experts.N.gate_proj/up_proj/down_proj); they load to the same block."""
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = hf_config(family)
    model = (MixtralForCausalLM if family == "mixtral" else Qwen3MoeForCausalLM)(cfg).eval()
    with torch.no_grad():
        for p in model.model.layers[0].mlp.parameters():
            p.normal_(0, 0.15)
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    prefix = hf_block_prefix(state, "model.layers.0.")
    assert prefix == ("model.layers.0.block_sparse_moe." if family == "mixtral" else "model.layers.0.mlp.")
    assert prefix + "experts.0.down_proj.weight" in state or prefix + "experts.0.w2.weight" in state
    ours = SparseMoE(MoESpec.from_hf_config(cfg))
    used = ours.load_hf_state(state, prefix)
    assert used == {k for k in state if k.startswith(prefix)}
    x = inputs(37)
    with torch.no_grad():
        assert_close(ours(x), hf_out(model.model.layers[0].mlp, x), f"{family} from its checkpoint")


# Against a float block over the dequantized weights, by the float32 bound: int8's convert-and-multiply path is a
# float matmul over those weights; int4 runs torch's int4 kernel where an expert has <= 4 rows (another accumulation
# order). Measured (all three families, T = 1 and 37): <= 3.5e-7 relative for both, against the bound's 1e-5.
@pytest.mark.parametrize("mode", ["int8", "int4"])
@torch.no_grad()
def test_quantized_experts_match_dequantized(mode, pair):
    family, _, ours = pair
    q = SparseMoE(ours.spec)
    q.load_state_dict(ours.state_dict())
    q.pack()  # as build_model leaves it: quantize_model reads the packed weights back

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = q

    assert quantize_model(Holder(), mode) == 2 * EXPERTS  # the experts' matrices; the router keeps its precision
    from inferd.models.moe import QuantizedExperts

    assert isinstance(q.experts, QuantizedExperts) and q.experts.mode == mode
    assert q.router.weight.dtype == torch.float32
    # the reference: a float block over the dequantized weights
    deq = SparseMoE(ours.spec)
    deq.load_state_dict(ours.state_dict())

    def dense(m):
        return m.dequantize(torch.float32) if mode == "int8" else _float_weight(m)  # int4's dense copy

    deq.experts.gate_up.copy_(torch.stack([dense(m) for m in q.experts.gate_up]))
    deq.experts.down.copy_(torch.stack([dense(m) for m in q.experts.down]))
    assert not torch.equal(deq.experts.gate_up, ours.experts.gate_up)  # quantized: not the float weights
    for T in (1, 37):
        x = inputs(T)
        assert_close(q(x), deq(x), f"{family} {mode} T={T}")
    # int8 stores a byte per weight: a touched expert reads ~1/4 of its float32 bytes
    if mode == "int8":
        assert q.weight_bytes_touched([0]) - q.router_bytes() < ours.weight_bytes_touched([0]) / 3


def test_weight_bytes_touched_counts_each_expert_once(pair):
    family, _, ours = pair
    per_expert = (2 * INTER * HIDDEN + HIDDEN * INTER) * 4 + ((2 * INTER + HIDDEN) * 4 if family == "gpt_oss" else 0)
    router = (EXPERTS * HIDDEN + (EXPERTS if family == "gpt_oss" else 0)) * 4
    assert ours.weight_bytes_touched([]) == router
    assert ours.weight_bytes_touched([3, 3, 5]) == router + 2 * per_expert
    assert ours.weight_bytes_touched(torch.tensor([[1, 2], [2, 1]])) == router + 2 * per_expert
    with torch.no_grad():
        ours(inputs(1))
    assert ours.weight_bytes_touched() == router + TOP_K * per_expert  # one token: its k experts only
    # the whole block as stored, also once packed for oneDNN (the stacked weights freed)
    packed = SparseMoE(ours.spec)
    packed.load_state_dict(ours.state_dict())
    assert weight_bytes(packed) == router + EXPERTS * per_expert
    packed.pack()
    assert weight_bytes(packed) == router + EXPERTS * per_expert  # oneDNN's blocked layout: no padding here
