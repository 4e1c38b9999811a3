"""The dense families beside Llama: Qwen3 (q/k norm, head_dim from the config, sliding layers from
max_window_layers), Gemma 3 text (interleaved sliding and global layers with two RoPE tables, (1 + w) norms, four norms
a layer, GELU, scaled embeddings, final soft-cap), Gemma 2 (soft-capped scores and logits), Phi-3/4 (fused checkpoint
projections, partial rotary, longrope, every layer sliding) and Mistral (every layer sliding). Each tiny random model
is saved by transformers (save_pretrained), loaded by our loader and compared with transformers by the exactness rule
(tests/parity.py) under staggered arrivals with chunked prefill and a prefix-cache hit, and under preemption, on
prompts shorter and longer than its window; and the proof that the comparison fails a model built wrong (a q/k-norm
epsilon, a window off by one, Gemma's embedding scale missing, a wrong partial-rotary split, Gemma 2's score soft-cap
missing)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.models.build import build_model
from inferd.models.loader import load_model_config, load_state_dict
from parity import PEAKED_HEAD, assert_greedy_parity, hf_greedy, run_staggered

WINDOW = 12
PROMPT_LENS = [5, 11, 23, 40, 52]  # shorter and longer than every window
MAX_NEW = [10, 12, 9, 12, 9]
SHARED_PREFIX = 32  # the two longest prompts share 2 blocks


def _hf_model(family: str):
    """(transformers model, its config) of a tiny random `family` model: 2-3 layers, hidden 64, vocab 512."""
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    if family == "qwen3":  # head_dim 32 (not hidden / heads); layer 0 global, layer 1 sliding
        cfg = tf.Qwen3Config(**common, num_hidden_layers=2, head_dim=32, rms_norm_eps=1e-6, use_sliding_window=True,
                             sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=False)
        cls = tf.Qwen3ForCausalLM
    elif family == "gemma3":  # sliding, global, sliding; the global layers' RoPE linearly scaled; logits soft-capped
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}}
        cfg = tf.Gemma3TextConfig(**common, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24,
                                  sliding_window=WINDOW - 2, sliding_window_pattern=2, rope_parameters=rope,
                                  final_logit_softcapping=30.0, rms_norm_eps=1e-6)
        cls = tf.Gemma3ForCausalLM
    elif family == "gemma2":  # sliding, global; scores and logits soft-capped (caps low enough to bite)
        cfg = tf.Gemma2Config(**common, num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=24,
                              sliding_window=WINDOW, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                              rms_norm_eps=1e-6)
        cls = tf.Gemma2ForCausalLM
    elif family == "phi3":  # Phi-4-mini's shape of things: partial rotary 0.75, longrope, every layer sliding
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.05, 1.2, 1.5, 2.0, 3.0], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
                "original_max_position_embeddings": 128}
        cfg = tf.Phi3Config(**common, num_hidden_layers=2, rope_parameters=rope, original_max_position_embeddings=128,
                            sliding_window=WINDOW + 4, pad_token_id=0, tie_word_embeddings=False)
        cls = tf.Phi3ForCausalLM
    else:  # mistral: every layer sliding
        cfg = tf.MistralConfig(**common, num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False)
        cls = tf.MistralForCausalLM
    torch.manual_seed(5)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms start at 1 (Gemma: 0): make them distinguishable
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
        norm = model.model.norm.weight  # a peaked head (tests/parity.py); Gemma's scale is 1 + w
        norm.copy_((1 + norm) * PEAKED_HEAD - 1 if family.startswith("gemma") else norm * PEAKED_HEAD)
    return model


FAMILIES = ["qwen3", "gemma3", "gemma2", "phi3", "mistral"]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family name -> the tiny model (built once, on first use), our load of it, prompts and transformers' runs."""
    built = {}

    def get(name: str) -> SimpleNamespace:
        if name not in built:
            hf = _hf_model(name)
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            cfg = load_model_config(path)
            state = load_state_dict(path, cfg, torch.float32)
            g = torch.Generator().manual_seed(11)
            prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
            prompts[4][:SHARED_PREFIX] = prompts[3][:SHARED_PREFIX]
            refs = [hf_greedy(lambda: hf, p, n) for p, n in zip(prompts, MAX_NEW)]
            built[name] = SimpleNamespace(name=name, cfg=cfg, state=state, prompts=prompts, refs=refs,
                                          model=build_model(cfg, state, torch.float32))
        return built[name]

    return get


def make_engine(t, model=None, cfg=None, blocks: int = 64, **kw) -> Engine:
    from inferd.engine.runner import kv_bytes_per_block

    cfg = cfg or t.cfg
    config = EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, torch.float32) * blocks, record_logits=True,
                          **kw)
    return Engine(model or t.model, cfg, config, torch.float32)


def run(t, scenario: str, model=None, cfg=None):
    params = [SamplingParams(max_tokens=len(ref.tokens), temperature=0, ignore_eos=True) for ref in t.refs]
    if scenario == "chunked-prefix":  # chunks of 16 beside decodes; prompt 4 arrives after prompt 3's prefix
        engine = make_engine(t, model, cfg, max_num_batched_tokens=16, max_num_seqs=8)
        reqs, trace = run_staggered(engine, t.prompts, params, every=4)
    else:  # preemption: 5 blocks for 5 prompts of up to 4 blocks each (sliding layers give blocks back: with 7 no
        # family preempts)
        engine = make_engine(t, model, cfg, blocks=5, max_num_batched_tokens=64, max_num_seqs=8)
        reqs, trace = run_staggered(engine, t.prompts, params, every=1)
    return engine, reqs, trace


def check_all(t, reqs) -> None:
    for i, (req, ref) in enumerate(zip(reqs, t.refs)):
        assert req.finish_reason.value == "length"
        assert_greedy_parity(req.output_token_ids, req.debug_logits, ref, f"{t.name} prompt {i}")


@pytest.mark.parametrize("scenario", ["chunked-prefix", "preemption"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_parity(families, name, scenario):
    family = families(name)
    engine, reqs, trace = run(family, scenario)
    check_all(family, reqs)
    engine.kv_cache.check_no_leaks()
    assert any(d > 0 and p > 0 for d, p, _ in trace), trace  # decodes beside prefill chunks
    if scenario == "chunked-prefix":
        assert reqs[4].num_cached_tokens == SHARED_PREFIX
    else:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_config_reads_the_family(families, name):
    """What each family's parity rests on, read from its config.json (test_model_config checks every field against
    the transformers model)."""
    family = families(name)
    c = family.cfg
    windows = [c.layer_window(i) for i in range(c.num_hidden_layers)]
    if family.name == "qwen3":
        assert (c.head_dim, c.qk_norm, windows) == (32, True, [0, WINDOW])
    elif family.name == "gemma3":
        assert (c.qk_norm, c.query_pre_attn_scalar, c.final_logit_softcapping) == (True, 24.0, 30.0)
        assert windows == [WINDOW - 2, 0, WINDOW - 2] and c.tie_word_embeddings
        assert (c.rope_theta, c.rope_local_theta, c.rope_scaling["factor"]) == (1e6, 1e4, 2.0)
    elif family.name == "gemma2":
        assert (c.qk_norm, c.attn_logit_softcapping, c.final_logit_softcapping) == (False, 2.0, 30.0)
        assert windows == [WINDOW, 0] and c.rope_local_theta is None
    elif family.name == "phi3":
        assert (c.rotary_dim, c.rope_scaling["rope_type"], windows) == (12, "longrope", [WINDOW + 4] * 2)
    else:
        assert windows == [WINDOW, WINDOW]


def _qk_norm_eps(model, cfg):
    for layer in model.layers:
        layer.self_attn.q_norm.eps = layer.self_attn.k_norm.eps = 1e-5  # transformers': 1e-6
    return model


def _no_embed_scale(model, cfg):
    model.embed_scale = 1.0
    return model


def _rotary_split(cfg):
    """RoPE on the first half of each head instead of three quarters (longrope's factors cut to match)."""
    scaling = {**cfg.rope_scaling, "short_factor": cfg.rope_scaling["short_factor"][:4],
               "long_factor": cfg.rope_scaling["long_factor"][:4]}
    return dataclasses.replace(cfg, partial_rotary_factor=0.5, rope_scaling=scaling)


MUTATIONS = {
    # name: (family, the config ours is built with, a change to the built model)
    "qk-norm-eps": ("qwen3", None, _qk_norm_eps),
    "window-off-by-one": ("mistral", lambda c: dataclasses.replace(c, sliding_window=c.sliding_window + 1), None),
    "gemma-window-off-by-one": ("gemma3", lambda c: dataclasses.replace(c, sliding_window=c.sliding_window - 1),
                                None),
    "gemma-embedding-scale": ("gemma3", None, _no_embed_scale),
    "partial-rotary-split": ("phi3", _rotary_split, None),
    "gemma2-no-attention-softcap": ("gemma2", lambda c: dataclasses.replace(c, attn_logit_softcapping=None), None),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_wrong_model_fails_the_rule(families, mutation):
    """The chunked comparison above (its two middle prompts, 23 and 40 tokens: across every window), of a model built
    wrong: the rule must fail it."""
    name, change_cfg, change_model = MUTATIONS[mutation]
    family = families(name)
    family = SimpleNamespace(**{**vars(family), "prompts": family.prompts[2:4], "refs": family.refs[2:4]})
    cfg = change_cfg(family.cfg) if change_cfg else family.cfg
    model = build_model(cfg, family.state, torch.float32)
    model = change_model(model, cfg) if change_model else model
    _, reqs, _ = run(family, "chunked-prefix", model, cfg)
    with pytest.raises(AssertionError, match="beyond the float32 bound"):
        check_all(family, reqs)


def test_gemma3_multimodal_folder_reads_its_text_part():
    """A Gemma 3 multimodal config.json (Gemma3ForConditionalGeneration) is read by its text_config, and its
    checkpoint's text weights (transformers 5's and 4's prefixes) by their text model's names."""
    import transformers as tf

    from inferd.models.config import ModelConfig
    from inferd.models.loader import _normalize_hf_name

    text = tf.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=10,
                               sliding_window_pattern=2)
    multimodal = tf.Gemma3Config(text_config=text.to_dict()).to_dict()
    assert multimodal["model_type"] == "gemma3"
    assert ModelConfig.from_hf_dict(multimodal) == ModelConfig.from_hf_dict(text.to_dict())
    for prefix in ("model.language_model.", "language_model.model."):
        assert _normalize_hf_name(prefix + "layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight"


def test_tensor_parallel_shards_phi3s_fused_projections():
    """Each rank's rows of Phi-3's fused qkv_proj and gate_up_proj are its rows of q, k, v (gate, up), as the
    unfused checkpoint of the same weights shards them."""
    from inferd.models.config import ModelConfig
    from inferd.models.parallel import shard_state_dict

    cfg = ModelConfig(architecture="phi3", vocab_size=8, hidden_size=8, intermediate_size=6, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=2)
    p = "model.layers.0."
    q, k, v, gate, up = (torch.randn(n, 8) for n in (8, 4, 4, 6, 6))
    fused = {p + "self_attn.qkv_proj.weight": torch.cat([q, k, v]),
             p + "mlp.gate_up_proj.weight": torch.cat([gate, up])}
    unfused = {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
               p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
    for rank in range(2):
        a, b = shard_state_dict(fused, cfg, 2, rank), shard_state_dict(unfused, cfg, 2, rank)
        assert torch.equal(a[p + "self_attn.qkv_proj.weight"], torch.cat([b[p + f"self_attn.{n}_proj.weight"]
                                                                          for n in "qkv"]))
        assert torch.equal(a[p + "mlp.gate_up_proj.weight"], torch.cat([b[p + "mlp.gate_proj.weight"],
                                                                       b[p + "mlp.up_proj.weight"]]))


def test_a_window_past_the_context_is_dropped():
    """Mistral v0.1's window of 4096 at a context of 4096 or less never hides a position: its layers attend plainly
    (the fused decode stack runs them); at a longer context they slide."""
    from inferd.models.config import ModelConfig
    from inferd.models.llama import LlamaForCausalLM

    cfg = ModelConfig(architecture="mistral", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4, sliding_window=4096,
                      max_position_embeddings=32768)
    with torch.device("meta"):
        assert all(layer.self_attn.plain for layer in LlamaForCausalLM(cfg, 4096).layers)
        assert [layer.self_attn.window for layer in LlamaForCausalLM(cfg, 4097).layers] == [4096, 4096]


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_speculative_decoding(families, name):
    """n-gram drafts verified as multi-token rows through sliding windows and two rotary tables (Gemma 3), partial
    rotary and longrope (Phi-3): the same tokens and logits as transformers, drafts proposed on the way."""
    family = families(name)
    params = [SamplingParams(max_tokens=len(ref.tokens), temperature=0, ignore_eos=True) for ref in family.refs]
    engine = make_engine(family, speculative="ngram", num_draft=4, ngram_min=1, max_num_batched_tokens=64,
                         max_num_seqs=8)
    reqs, _ = run_staggered(engine, family.prompts, params, every=2)
    check_all(family, reqs)
    assert engine.stats.spec_drafted > 0
    engine.kv_cache.check_no_leaks()
