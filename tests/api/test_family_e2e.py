"""A Qwen3-shaped and a gpt-oss-shaped model end to end: `inferd serve` on a folder each, the official `openai` client,
reasoning and tool calls as their users get them (Qwen3: `<think>` and hermes calls through --reasoning-parser qwen3
and --tool-call-parser hermes; gpt-oss: harmony, chosen by itself for a harmony chat template, its analysis channel as
reasoning_content and its tool calls constrained to harmony's form).

The models are real checkpoints of the two architectures, run by our engine, whose weights are set so their output is
a script: every layer's output projections are zero (attention and MLP, experts included, add nothing to the
residual), so the final norm of the last token's embedding alone picks the next token, and the head maps each script
token's embedding (orthonormal, for the few of them) to the next script token. The prompt's last token starts the
script. Everything else (the chat template or harmony's renderer, the tokenizer with the family's markers as added
tokens, the engine's sampling and detokenization, the parsers, the grammar of a required tool call, SSE and the
client) is what a user of such a model runs."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import openai
import pytest
import torch

O200K = Path(__file__).resolve().parent.parent / "data" / "o200k_base.tiktoken.xz"
CITY = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
                   "additionalProperties": False}}}
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")
# harmony renders a gpt-oss prompt itself; a template that writes harmony is what makes the server choose it
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|channel|>final<|message|>"
                    "{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
WORDS = ["Let", " me", " check", "It", " rains", "analysis"]


def _single_tokens(tok, pieces: list[str]) -> list[int]:
    ids = []
    for piece in pieces:
        enc = tok.encode(piece, add_special_tokens=False)
        assert len(enc) == 1, (piece, enc)  # the script is a chain of distinct single tokens
        ids.append(enc[0])
    assert len(set(ids)) == len(ids), ids
    return ids


def script_model(hf, chain: list[int]) -> None:
    """Zero every output projection and make the head map chain[i]'s embedding to chain[i + 1]."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if any(k in name for k in ("o_proj", "down_proj")):
                p.zero_()
        emb, head = hf.model.embed_tokens.weight, hf.lm_head.weight
        basis, _ = torch.linalg.qr(torch.randn(emb.shape[1], len(chain), generator=torch.Generator().manual_seed(1)))
        norm = emb.shape[1] ** 0.5  # the final RMSNorm turns a unit basis vector into one of norm sqrt(hidden)
        for i, token in enumerate(chain):
            emb[token] = basis[:, i]
        for i, nxt in enumerate(chain[1:]):  # logit 10 for the next token; the random rows give ~0.2
            head[nxt] = 10.0 * basis[:, i] / norm


def _tokenizer(smollm2_tokenizer, path, added: list[str], special: bool):
    from transformers import AutoTokenizer

    smollm2_tokenizer.hf.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)  # a copy: the session's tokenizer stays as it is
    if special:
        tok.add_special_tokens({"additional_special_tokens": added})
    else:
        tok.add_tokens(added)
    return tok


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, smollm2_tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("qwen3-e2e")
    tok = _tokenizer(smollm2_tokenizer, path, ["<think>", "</think>"], special=False)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Weather?"}], chat_template=QWEN3_TEMPLATE,
                                                add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    think, end_think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    let, me, check, sunny, today, _ = _single_tokens(tok, WORDS)
    chain = [prompt[-1], think, let, me, check, end_think, sunny, today, im_end]
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      eos_token_id=im_end, bos_token_id=None, tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(cfg).eval()
    script_model(hf, chain)
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, smollm2_tokenizer):
    from transformers import GptOssConfig, GptOssForCausalLM

    path = tmp_path_factory.mktemp("gpt-oss-e2e")
    tok = _tokenizer(smollm2_tokenizer, path, HARMONY_MARKERS, special=True)
    _, _, message, channel, _, ret, call = tok.convert_tokens_to_ids(HARMONY_MARKERS)
    let, me, check, _, _, analysis = _single_tokens(tok, WORDS)
    assistant = tok.encode("<|start|>assistant", add_special_tokens=False)[-1]  # where harmony's prompt ends
    chain = [assistant, channel, analysis, message, let, me, check, ret]
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=1024,
                       eos_token_id=[ret, call], bos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    hf = GptOssForCausalLM(cfg).eval()
    script_model(hf, chain)
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    return path


def _serve(path, tmp_path_factory, name: str, *extra: str, env: dict[str, str] | None = None):
    from servers import start_server

    return start_server(path, tmp_path_factory.mktemp(name) / "serve.log", "--max-model-len", "512", *extra,
                        model_name=name, env=env)


@pytest.fixture(scope="module")
def servers(qwen3_dir, gpt_oss_dir, tmp_path_factory):
    from inferd.api import harmony
    from servers import kill_group

    # harmony renders with the o200k vocabulary (this model's tokenizer is not o200k: the operator gives the file)
    vocab = tmp_path_factory.mktemp("tiktoken")
    (vocab / harmony.VOCAB_FILE).write_bytes(lzma.decompress(O200K.read_bytes()))
    started = {"qwen3": _serve(qwen3_dir, tmp_path_factory, "qwen3", "--reasoning-parser", "qwen3",
                               "--tool-call-parser", "hermes"),
               "gpt-oss": _serve(gpt_oss_dir, tmp_path_factory, "gpt-oss",
                                 env={"TIKTOKEN_ENCODINGS_BASE": str(vocab)})}
    yield started
    for server in started.values():
        kill_group(server.proc)


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(server, stream: bool = False, max_tokens: int = 40, **kw):
    return client_of(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Weather?"}], max_tokens=max_tokens, temperature=0,
        stream=stream, **kw)


def streamed(server, **kw) -> tuple[str, str, str]:
    reasoning, content, finish = [], [], None
    for chunk in chat(server, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(reasoning), "".join(content), finish


def test_qwen3_reasoning_streamed_and_not(servers):
    server = servers["qwen3"]
    [choice] = chat(server).choices
    assert choice.message.reasoning_content.strip() == "Let me check"
    assert choice.message.content.strip() == "It rains"
    assert choice.finish_reason == "stop"
    reasoning, content, finish = streamed(server)
    assert (reasoning, content, finish) == (choice.message.reasoning_content, choice.message.content, "stop")
    # enable_thinking false reaches the template (it closes an empty thinking block in the prompt) and turns the
    # parser off: whatever the model writes is content
    [plain] = chat(server, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices
    assert getattr(plain.message, "reasoning_content", None) is None and plain.message.content


def test_qwen3_required_tool_call_after_thinking(servers):
    [choice] = chat(servers["qwen3"], tools=[CITY], tool_choice="required", max_tokens=300).choices
    assert choice.message.reasoning_content.strip() == "Let me check"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Paris")
    assert choice.finish_reason == "tool_calls"


def test_gpt_oss_analysis_is_reasoning(servers):
    server = servers["gpt-oss"]
    [choice] = chat(server).choices
    assert choice.message.reasoning_content == "Let me check"
    assert not choice.message.content
    reasoning, content, _ = streamed(server)
    assert (reasoning, content) == ("Let me check", "")


def test_gpt_oss_required_tool_call(servers, gpt_oss_dir):
    """A required call in harmony's commentary form. The grammar lets a model think first, and this scripted one
    would think forever (its analysis never ends on a token the grammar allows): the client bars the word "analysis"
    with logit_bias, so the call is the way left."""
    from transformers import AutoTokenizer

    [analysis] = AutoTokenizer.from_pretrained(gpt_oss_dir).encode("analysis", add_special_tokens=False)
    [choice] = chat(servers["gpt-oss"], tools=[CITY], tool_choice="required", max_tokens=300,
                    logit_bias={str(analysis): -100}).choices
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Paris")
    assert choice.finish_reason == "tool_calls"
