"""lm-evaluation-harness end to end, offline: `lm_eval --model local-completions` against `inferd serve` on the
default model in float32, on the two small tasks of evals/tasks (a multiple-choice task scored by loglikelihood:
/v1/completions with echo, logprobs and max_tokens 1; a generate_until task), gives the same per-item answers as
`lm_eval --model hf` on the same weights in float32, by the exactness rule: every loglikelihood within the float32
bound, the same choice and the same generated text unless a near-tie under the bound decides.

The hf side costs minutes of a 2-core machine (transformers dequantizing the GGUF, generating without a KV cache
shared across items), so its per-item answers are committed (tests/data/lm_eval_hf.json, with what the near-tie
judgments need: each generated position's top-2 gap and scale, from transformers). Record them again after a change
of the tasks, the model or lm-eval:

    .venv/bin/python tests/evaluation/test_lm_eval.py

which runs `lm_eval --model hf` itself. The test checks the record belongs to the task files as they are."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from parity import FP32  # noqa: E402

TASKS = REPO / "evals" / "tasks"
TASK_NAMES = ("inferd_mc", "inferd_gen")
RECORD = REPO / "tests" / "data" / "lm_eval_hf.json"
BATCH = 8

pytestmark = pytest.mark.timeout(600)


def offline_env(home: Path) -> dict[str, str]:
    """Nothing reaches for a hub: the datasets are local JSONL files, the tokenizer and weights local folders."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(home), "TOKENIZERS_PARALLELISM": "false"}


def tasks_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(TASKS.iterdir()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def run_lm_eval(model: str, model_args: str, out: Path, *extra: str) -> dict[str, list[dict]]:
    """`lm_eval` (the command) on the two tasks with per-sample logs; returns each task's samples by doc_id."""
    command = [str(Path(sys.executable).parent / "lm_eval"), "--model", model, "--model_args", model_args,
               "--tasks", ",".join(TASK_NAMES), "--include_path", str(TASKS), "--batch_size", str(BATCH),
               "--output_path", str(out), "--log_samples", *extra]
    done = subprocess.run(command, cwd=REPO, env=offline_env(out / "hf-home"), capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    samples = {}
    for name in TASK_NAMES:
        [path] = out.glob(f"*/samples_{name}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[name] = sorted(rows, key=lambda r: r["doc_id"])
    return samples


def loglikelihoods(row: dict) -> list[float]:
    return [float(r[0][0]) for r in row["resps"]]


def generation(row: dict) -> str:
    return row["resps"][0][0]


# ---- the test -----------------------------------------------------------------------------------------------------
def test_local_completions_gives_the_answers_of_lm_eval_hf(smollm2_server, smollm2_tokenizer, tmp_path):
    record = json.loads(RECORD.read_text())
    assert record["tasks_digest"] == tasks_digest(), \
        "evals/tasks changed since the hf record: run `.venv/bin/python tests/evaluation/test_lm_eval.py`"
    tokenizer_dir = tmp_path / "tokenizer"
    smollm2_tokenizer.hf.save_pretrained(tokenizer_dir)
    args = (f"model={smollm2_server.model},base_url={smollm2_server.url}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={tokenizer_dir},max_retries=1")
    ours = run_lm_eval("local-completions", args, tmp_path / "out")
    check_multiple_choice(ours["inferd_mc"], record["inferd_mc"], record["scale"])
    check_generations(ours["inferd_gen"], record["inferd_gen"], smollm2_tokenizer)


def check_multiple_choice(ours: list[dict], ref: list[dict], scale: float) -> None:
    """Each choice's loglikelihood within the bound (a sum of n tokens' logprobs: n times twice the logits' bound),
    and the same answer unless the reference's two best choices are within that of each other (a near-tie)."""
    assert len(ours) == len(ref) > 0
    for mine, theirs in zip(ours, ref):
        lls = loglikelihoods(mine)
        assert len(lls) == len(theirs["loglikelihoods"])
        tols = [n * 2 * FP32.tolerance(scale) for n in theirs["tokens"]]
        for i, (a, b, tol) in enumerate(zip(lls, theirs["loglikelihoods"], tols)):
            assert abs(a - b) <= tol, f"doc {mine['doc_id']} choice {i}: {a} vs {b}: beyond the float32 bound"
        best = max(range(len(lls)), key=lls.__getitem__)
        ref_best = max(range(len(lls)), key=theirs["loglikelihoods"].__getitem__)
        if best != ref_best:
            gap = theirs["loglikelihoods"][ref_best] - theirs["loglikelihoods"][best]
            assert gap <= tols[best] + tols[ref_best], f"doc {mine['doc_id']}: answer {best}, hf's {ref_best}"


def check_generations(ours: list[dict], ref: list[dict], tokenizer) -> None:
    """The same text, or a text that parts from hf's at a generated position whose top-2 logits (transformers')
    are within the float32 bound of each other."""
    assert len(ours) == len(ref) > 0
    for mine, theirs in zip(ours, ref):
        text = generation(mine)
        if text == theirs["text"]:
            continue
        ids = theirs["token_ids"]
        common = os.path.commonprefix([text, theirs["text"]])
        # the first of hf's generated tokens that the common text does not cover
        k = next(i for i in range(len(ids) + 1) if i == len(ids) or
                 len(tokenizer.decode(ids[:i + 1], skip_special_tokens=False)) > len(common))
        assert k < len(ids), f"doc {mine['doc_id']}: {text!r} vs hf's {theirs['text']!r}"
        gap, scale = theirs["gaps"][k], theirs["scales"][k]
        assert gap <= FP32.tolerance(scale), \
            f"doc {mine['doc_id']}: {text!r} parts from hf's {theirs['text']!r} at token {k}, top-2 gap {gap}"


# ---- recording the hf side ----------------------------------------------------------------------------------------
def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's own split of (context, continuation) into token ids (HFLM._encode_pair)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    head = tokenizer.encode(context, add_special_tokens=False)
    return head, whole[len(head):]


def record() -> None:
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inferd.models.loader import default_model_path

    gguf = Path(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        samples = run_lm_eval("hf", f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32", Path(tmp),
                              "--device", "cpu")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    scale, mc, gen = 0.0, [], []
    with torch.no_grad():
        for row in samples["inferd_mc"]:
            counts = []
            for arg in row["arguments"].values():
                head, tail = encode_pair(tok, arg["arg_0"], arg["arg_1"])
                logits = model(torch.tensor([head + tail])).logits[0]
                scale = max(scale, float(logits[len(head) - 1:].abs().max()))
                counts.append(len(tail))
            mc.append({"doc_id": row["doc_id"], "loglikelihoods": loglikelihoods(row), "tokens": counts})
        for row in samples["inferd_gen"]:
            context, text = row["arguments"]["gen_args_0"]["arg_0"], generation(row)
            head = tok.encode(context, add_special_tokens=False)
            ids = tok.encode(context + text, add_special_tokens=False)[len(head):]
            logits = model(torch.tensor([head + ids])).logits[0, len(head) - 1:]
            top2 = torch.topk(logits, 2, dim=-1).values
            gen.append({"doc_id": row["doc_id"], "text": text, "token_ids": ids,
                        "gaps": (top2[:, 0] - top2[:, 1]).tolist(), "scales": logits.abs().amax(-1).tolist()})
    RECORD.write_text(json.dumps({"tasks_digest": tasks_digest(), "scale": scale, "inferd_mc": mc,
                                  "inferd_gen": gen}, indent=1) + "\n")
    print(f"wrote {RECORD}: {len(mc)} multiple-choice items, {len(gen)} generations, logit scale {scale:.1f}")


if __name__ == "__main__":
    record()
