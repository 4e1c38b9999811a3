"""The mixture-of-experts families on our engine against transformers: tiny random Mixtral, Qwen3-MoE (a dense
layer beside an MoE one, q/k norm, top-k weights not renormalised) and gpt-oss (attention sinks, q/k/v/o biases,
alternating sliding (window 8) and full layers, YaRN RoPE, router and expert biases, clamped SwiGLU), each loaded from
its save_pretrained folder, compared token for token and logit by logit by the exactness rule (tests/parity.py) in a
run with chunked prefill, preemption and a prefix-cache hit. The router's choices are compared with transformers'
(every expert reached; one expert taking every token). Mutations prove the comparison can fail: Qwen3-MoE
renormalising where norm_topk_prob is false, gpt-oss clamping at the wrong limit, gpt-oss without its sinks. GGUF
files (qwen3moe; Mixtral as llama.cpp writes it: a "llama" with expert tensors) load to the same weights."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.engine.runner import kv_bytes_per_block
from inferd.models.build import build_model
from inferd.models.loader import load_model_config, load_state_dict
from inferd.models.moe import SparseMoE
from inferd.models.moe_families import moe_prefix
from parity import PEAKED_HEAD, assert_greedy_parity, hf_greedy, run_staggered

PROMPT_LENS = [3, 7, 12, 21, 36, 40]  # around gpt-oss's window of 8, and past two KV blocks of 16
MAX_NEW = [14, 12, 16, 10, 12, 14]
SHARED_PREFIX = 32  # the two longest prompts share two full blocks
NUM_EXPERTS, TOP_K = 8, 2

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts_per_tok=TOP_K, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "mixtral": lambda: _hf("MixtralConfig", "MixtralForCausalLM", num_local_experts=NUM_EXPERTS,
                           max_position_embeddings=512),
    # layer 0 dense (mlp_only_layers), layer 1 MoE; the top-k weights not renormalised (Qwen3MoeConfig's default)
    "qwen3_moe": lambda: _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=NUM_EXPERTS, moe_intermediate_size=48,
                             mlp_only_layers=[0], norm_topk_prob=False, max_position_embeddings=512),
    # transformers' defaults: YaRN (factor 32 over 4096 positions), layer 0 sliding, layer 1 full; a clamp of 1.0 so
    # the clamped SwiGLU clamps these small activations
    "gpt_oss": lambda: _hf("GptOssConfig", "GptOssForCausalLM", num_local_experts=NUM_EXPERTS, sliding_window=8,
                           swiglu_limit=1.0, intermediate_size=48, max_position_embeddings=4096),
}


def _hf(config_name: str, model_name: str, **kw):
    import transformers

    torch.manual_seed(11)
    cfg = getattr(transformers, config_name)(**{**COMMON, **kw})
    if model_name == "GptOssForCausalLM":
        cfg._attn_implementation = "eager"  # the one with sinks
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(PEAKED_HEAD)  # peaked logits (tests/parity.py)
        model.model.embed_tokens.weight.mul_(25.0)  # tokens far apart: each routed its own way
        for name, p in model.named_parameters():
            if name.endswith("sinks") or "norm" in name and name != "model.norm.weight":
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))  # distinguishable
            elif name.endswith("bias"):  # small: a bias every token shares would route every token alike
                p.copy_(torch.randn_like(p) * 0.05)
            elif "experts" in name or "gate.weight" in name or "router.weight" in name:
                p.mul_(7.5)  # decisive routers; expert activations past gpt-oss's clamp
    return model


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    prompts[5][:SHARED_PREFIX] = prompts[4][:SHARED_PREFIX]
    return prompts


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(name): the family's transformers model, saved, loaded by us from the folder, with its references;
    each family built once in this module."""
    cache = {}

    def build(name: str) -> SimpleNamespace:
        if name not in cache:
            hf = FAMILIES[name]()
            folder = tmp_path_factory.mktemp(name)
            hf.save_pretrained(folder)
            cfg = load_model_config(folder)
            state = load_state_dict(folder, cfg, torch.float32)
            model = build_model(cfg, state, torch.float32)
            prompts = _prompts(cfg.vocab_size)
            refs = [hf_greedy(lambda: hf, p, n) for p, n in zip(prompts, MAX_NEW)]
            cache[name] = SimpleNamespace(name=name, hf=hf, folder=folder, cfg=cfg, state=state, model=model,
                                          prompts=prompts, refs=refs)
        return cache[name]

    return build


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, built):
    return built(request.param)


def make_engine(cfg, model, blocks: int = 64, **kw) -> Engine:
    per_block = kv_bytes_per_block(cfg, 16, torch.float32)
    return Engine(model, cfg, EngineConfig(kv_cache_bytes=per_block * blocks, record_logits=True, **kw), torch.float32)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def check_all(t, reqs) -> None:
    for i, (req, ref) in enumerate(zip(reqs, t.refs)):
        assert req.finish_reason.value == "length"
        assert_greedy_parity(req.output_token_ids, req.debug_logits, ref, f"{t.name} prompt {i}")


# chunks of at most 16 tokens beside decodes, prompts arriving every 4 steps, in 6 KV blocks of 16 for sequences of up
# to 54 tokens: requests are preempted and recomputed, and the last prompt finds a block of the shared prefix cached
SCENARIO = dict(max_num_batched_tokens=16, max_num_seqs=8)
BLOCKS, EVERY = 6, 4


def test_greedy_parity(family):
    engine = make_engine(family.cfg, family.model, BLOCKS, **SCENARIO)
    reqs, trace = run_staggered(engine, family.prompts, [greedy(n) for n in MAX_NEW], every=EVERY)
    check_all(family, reqs)
    engine.kv_cache.check_no_leaks()
    assert any(d > 0 and p > 0 for d, p, _ in trace), trace  # decodes beside prefill chunks
    assert engine.scheduler.num_preemptions > 0
    assert reqs[5].num_cached_tokens >= 16  # a prefix-cache hit
    assert max(PROMPT_LENS) > SCENARIO["max_num_batched_tokens"]  # chunked


def test_the_layers_are_what_the_family_has(family):
    """The blocks transformers has, where it has them: an MoE block on Qwen3-MoE's layer 1 only; gpt-oss's window on
    its layer 0 only; sinks on gpt-oss; o_proj's bias on gpt-oss."""
    moe_layers = [i for i, layer in enumerate(family.model.layers) if isinstance(layer.mlp, SparseMoE)]
    assert moe_layers == ([1] if family.name == "qwen3_moe" else [0, 1])
    attn = [layer.self_attn for layer in family.model.layers]
    assert [a.window for a in attn] == ([8, 0] if family.name == "gpt_oss" else [0, 0])
    assert all((a.sinks is not None) == (a.o_proj.bias is not None) == (family.name == "gpt_oss") for a in attn)
    assert all((a.q_norm is not None) == (family.name == "qwen3_moe") for a in attn)


def _hf_router_counts(hf, prompt: list[int]) -> list[torch.Tensor]:
    """Per MoE layer, how many of the prompt's tokens transformers' router sent to each expert (its own choices,
    read by a forward hook on each router)."""
    counts, hooks = [], []
    for layer in hf.model.layers:
        router = getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None)
        if router is None or not hasattr(router, "top_k"):
            continue
        hooks.append(router.register_forward_hook(
            lambda _m, _i, out: counts.append(torch.bincount(out[-1].flatten(), minlength=NUM_EXPERTS))))
    try:
        with torch.no_grad():
            hf(torch.tensor([prompt]))
    finally:
        for h in hooks:
            h.remove()
    return counts


def _our_router_counts(cfg, model, prompt: list[int]) -> list[torch.Tensor]:
    """Per MoE layer, the same from our blocks, after one engine step that prefills the whole prompt."""
    engine = make_engine(cfg, model, max_num_batched_tokens=64)
    engine.add_request(prompt, greedy(1))
    engine.step()
    assert engine.last_schedule.num_tokens == len(prompt)
    return [b.last_expert_counts.clone() for b in model.modules() if isinstance(b, SparseMoE)]


def test_routing_reaches_every_expert_as_transformers_routes(family):
    prompt = family.prompts[5]
    ours = _our_router_counts(family.cfg, family.model, prompt)
    theirs = _hf_router_counts(family.hf, prompt)
    assert len(ours) == len(theirs) == (1 if family.name == "qwen3_moe" else 2)
    for o, t in zip(ours, theirs):
        assert torch.equal(o, t), (o, t)
        assert bool((o > 0).all()), f"an expert no token picked: {o.tolist()}"
        assert int(o.sum()) == TOP_K * len(prompt)


def test_one_expert_takes_every_token(family):
    """Routers that send every token to the same experts: gpt-oss's router bias 50 on expert 5 (its weights zero);
    Mixtral's and Qwen3-MoE's weights zero, so every logit ties and top-k picks the same two experts for every token
    (transformers' topk and ours over the same exact zeros). The routers' choices agree with transformers', the
    chosen experts each take every token, and the outputs keep the exactness rule."""
    import copy

    hf = copy.deepcopy(family.hf)
    state = dict(family.state)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            router = getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None)
            if router is None or not hasattr(router, "top_k"):
                continue
            router.weight.zero_()
            if family.name == "gpt_oss":
                router.bias.zero_()
                router.bias[5] = 50.0
            prefix = moe_prefix(family.cfg, i)
            for name in ("router.weight", "router.bias", "gate.weight"):
                if prefix + name in state:
                    state[prefix + name] = getattr(router, name.split(".")[1]).detach().clone()
    model = build_model(family.cfg, state, torch.float32)
    prompt = family.prompts[4]
    ours = _our_router_counts(family.cfg, model, prompt)
    theirs = _hf_router_counts(hf, prompt)
    for o, t in zip(ours, theirs):
        assert torch.equal(o, t), (o, t)
        taken = [e for e in range(NUM_EXPERTS) if o[e] > 0]
        assert len(taken) == TOP_K and all(int(o[e]) == len(prompt) for e in taken), o.tolist()
        if family.name == "gpt_oss":
            assert 5 in taken
    refs = [hf_greedy(lambda: hf, p, 10) for p in family.prompts[2:5]]
    engine = make_engine(family.cfg, model, max_num_batched_tokens=16, max_num_seqs=8)
    reqs, _ = run_staggered(engine, family.prompts[2:5], greedy(10))
    for i, (req, ref) in enumerate(zip(reqs, refs)):
        assert_greedy_parity(req.output_token_ids, req.debug_logits, ref, f"{family.name} one expert, prompt {i}")


@pytest.mark.parametrize("mutation", ["qwen3-renormalised", "gpt-oss-clamp", "gpt-oss-no-sinks"])
def test_a_wrong_model_fails_the_rule(built, mutation):
    """The chunked comparison above (two of its prompts, 21 and 36 tokens: past gpt-oss's window), of our model built
    wrong: the rule must fail it."""
    family = built("qwen3_moe" if mutation.startswith("qwen3") else "gpt_oss")
    change = {"qwen3-renormalised": dict(norm_topk_prob=True), "gpt-oss-clamp": dict(swiglu_limit=7.0),
              "gpt-oss-no-sinks": dict(attention_sinks=False)}[mutation]
    cfg = dataclasses.replace(family.cfg, **change)
    wrong = build_model(cfg, family.state, torch.float32)
    # two prompts are enough: each mutation moves the first compared position's logits
    reqs, _ = run_staggered(make_engine(cfg, wrong, 64, **SCENARIO), family.prompts[3:5],
                            [greedy(n) for n in MAX_NEW[3:5]], EVERY)
    with pytest.raises(AssertionError, match="beyond the float32 bound"):
        for i, (req, ref) in enumerate(zip(reqs, family.refs[3:5])):
            assert_greedy_parity(req.output_token_ids, req.debug_logits, ref, f"{family.name} prompt {i + 3}")


# ---- GGUF ---------------------------------------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    if n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, cfg, state: dict[str, torch.Tensor]) -> None:
    """`state` (our HF-named load of a save_pretrained folder) as llama.cpp's convert_hf_to_gguf writes it: Mixtral
    as a "llama" with ffn_gate_inp and stacked ffn_{gate,up,down}_exps, q/k rows permuted; Qwen3-MoE as qwen3moe."""
    import gguf

    arch = "llama" if cfg.architecture == "mixtral" else "qwen3moe"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    moe = "block_sparse_moe" if cfg.architecture == "mixtral" else "mlp"
    experts = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps", "gate_proj": "ffn_gate_exps",
               "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if cfg.is_moe_layer(i):
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", state[f"{p}{moe}.gate.weight"].numpy())
            for hf_name, gguf_name in experts.items():
                names = [f"{p}{moe}.experts.{e}.{hf_name}.weight" for e in range(cfg.num_experts)]
                if names[0] in state:
                    w.add_tensor(f"blk.{i}.{gguf_name}.weight", np.stack([state[n].numpy() for n in names]))
        for hf_name, gguf_name in block.items():
            if p + hf_name + ".weight" in state:
                arr = state[p + hf_name + ".weight"].numpy()
                if arch == "llama" and gguf_name == "attn_q":
                    arr = _llama_cpp_permute(arr, cfg.num_attention_heads, cfg.num_attention_heads)
                elif arch == "llama" and gguf_name == "attn_k":
                    arr = _llama_cpp_permute(arr, cfg.num_attention_heads, cfg.num_key_value_heads)
                w.add_tensor(f"blk.{i}.{gguf_name}.weight", arr)
    for hf_name, gguf_name in top.items():
        w.add_tensor(gguf_name, state[hf_name].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_gguf_loads_the_same_model(built, name, tmp_path):
    """Mixtral (a llama.cpp "llama" with experts) and Qwen3-MoE (qwen3moe) written as GGUF (float32) load to the
    folder's config and, tensor for tensor, its weights."""
    family = built(name)
    path = tmp_path / f"{family.name}.gguf"
    _write_gguf(path, family.cfg, family.state)
    cfg = load_model_config(path)
    fields = ["architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "qk_norm", "mlp_only_layers", "num_hidden_layers", "head_dim", "rope_theta",
              "intermediate_size", "tie_word_embeddings"]
    if family.name == "qwen3_moe":  # llama.cpp's qwen3moe always renormalises: the GGUF's config says so
        assert cfg.norm_topk_prob is True and family.cfg.norm_topk_prob is False
        fields.remove("norm_topk_prob")
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(family.cfg, f) for f in fields}
    assert np.float32(cfg.rms_norm_eps) == np.float32(family.cfg.rms_norm_eps)  # GGUF holds a float32
    state = load_state_dict(path, cfg, torch.float32)
    assert set(state) == set(family.state)
    for name, value in family.state.items():
        assert torch.equal(state[name], value), name


# ---- the roofline ------------------------------------------------------------------------------------------------


def test_a_step_counts_only_the_experts_it_touched(built):
    """The engine's bytes per step (telemetry/roofline.py) hold the dense weights and, per MoE layer, only the experts
    the step's tokens picked: a prefill whose tokens reach all 8 experts of both layers reads 2 x 7 experts more than
    the same prefill where one expert per layer takes every token (top-1 routing, router weights zero)."""
    t = built("mixtral")
    prompt = t.prompts[5]
    one_cfg = dataclasses.replace(t.cfg, num_experts_per_tok=1)
    state = dict(t.state)
    for i in range(t.cfg.num_hidden_layers):
        state[moe_prefix(t.cfg, i) + "gate.weight"] = torch.zeros_like(state[moe_prefix(t.cfg, i) + "gate.weight"])
    steps = {}
    for name, cfg, model in (("all", t.cfg, t.model), ("one", one_cfg, build_model(one_cfg, state, torch.float32))):
        engine = make_engine(cfg, model, max_num_batched_tokens=64)
        engine.add_request(prompt, greedy(1))
        engine.step()
        counts = [b.last_expert_counts for b in model.modules() if isinstance(b, SparseMoE)]
        steps[name] = (engine.stats.last[3], engine.cost, [int((c > 0).sum()) for c in counts])
    (all_bytes, cost, all_touched), (one_bytes, one_cost, one_touched) = steps["all"], steps["one"]
    assert all_touched == [8, 8] and one_touched == [1, 1]
    H, inter = t.cfg.hidden_size, t.cfg.moe_intermediate_size
    expert = 3 * H * inter * 4  # gate, up, down in float32
    dense, _ = cost.step([len(prompt)], [len(prompt)], 1)  # everything but the experts
    assert one_cost.weight_bytes == cost.weight_bytes
    assert all_bytes == dense + 2 * 8 * expert
    assert one_bytes == dense + 2 * 1 * expert
    # the FLOPs count the active parameters: top-k experts per token
    active = [c.matmul_params for c in (cost, one_cost)]
    assert active[0] - active[1] == 2 * 3 * H * inter


def test_batch_invariant_mode_refuses_a_mixture_of_experts(built):
    """--batch-invariant fixes each matmul's row tiles; an expert's rows are however many tokens the batch sent it,
    so an MoE model is refused with a clear error rather than run without the guarantee."""
    t = built("mixtral")
    with pytest.raises(ValueError, match="batch-invariant does not run mixture-of-experts"):
        make_engine(t.cfg, t.model, batch_invariant=True)
    make_engine(t.cfg, t.model)  # and the model still runs as before


def test_tensor_parallel_refuses_a_mixture_of_experts(built):
    """Tensor parallelism shards dense MLPs and q/k/v/o; experts, sinks and gpt-oss's o_proj bias it does not: an MoE
    family is refused before any rank starts."""
    from inferd.models.parallel import check_tensor_parallel

    for name in ("mixtral", "gpt_oss"):
        with pytest.raises(ValueError, match="does not run the"):
            check_tensor_parallel(built(name).cfg, 2)
        check_tensor_parallel(built(name).cfg, 1)


def test_speculative_decoding(built):
    """gpt-oss (sinks, alternating windows, MoE): n-gram drafts verified as multi-token rows give transformers' tokens
    and logits."""
    family = built("gpt_oss")
    engine = make_engine(family.cfg, family.model, 64, speculative="ngram", num_draft=4, ngram_min=1,
                         max_num_batched_tokens=64, max_num_seqs=8)
    reqs, _ = run_staggered(engine, family.prompts, [greedy(n) for n in MAX_NEW], every=2)
    check_all(family, reqs)
    assert engine.stats.spec_drafted > 0
    engine.kv_cache.check_no_leaks()
