"""The exactness rule of the suite (the one implementation every test that compares tokens uses), and token-for-token
comparison with Hugging Face transformers by it.

Greedy: our tokens must equal the reference; a divergence is accepted only at a position where the reference's
top-2 logit gap is below max(1e-3, 10x the largest logit difference seen on the positions matched before it),
i.e. where the choice was a near-tie (`greedy_divergence`). Seeded sampling: only where the position's uniform draw
lies within 1e-3 of a boundary of the CDF of the filtered distribution (`near_cdf_boundary`). Nothing after the
first divergence can be compared. Never fewer tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

REF_CACHE = Path(os.environ.get("INFERD_CACHE_DIR", ".cache/inferd")) / "hf-reference"


@dataclass
class Reference:
    tokens: list[int]
    logits: np.ndarray  # [n, vocab] float32


def hf_greedy(get_model, prompt: list[int], max_new_tokens: int, cache_key: str | None = None) -> Reference:
    """transformers' generate, greedy, never stopping at EOS; cached on disk when cache_key is given.
    get_model() returns the HF model; it is only called on a cache miss."""
    path = None
    if cache_key is not None:
        import transformers

        key = json.dumps([cache_key, transformers.__version__, torch.__version__, prompt, max_new_tokens])
        path = REF_CACHE / (hashlib.sha256(key.encode()).hexdigest() + ".npz")
        if path.exists():
            data = np.load(path)
            return Reference(data["tokens"].tolist(), data["logits"])
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
                           pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    model = get_model()
    model.generation_config.eos_token_id = None  # generate() falls back to it even when told None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                generation_config=gen)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float().numpy()
    assert len(tokens) == max_new_tokens, "the reference stopped early"
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, tokens=np.array(tokens), logits=logits)
        os.replace(tmp, path)
    return Reference(tokens, logits)


def assert_greedy_parity(ours: list[int], our_logits: list[torch.Tensor] | None, ref: Reference,
                         label: str = "") -> int:
    """Returns the number of positions compared exactly (len(ref.tokens) when all match)."""
    assert len(ours) == len(ref.tokens), f"{label}: {len(ours)} tokens, reference has {len(ref.tokens)}"
    return greedy_prefix_parity(ours, our_logits, ref, label)


def greedy_prefix_parity(ours: list[int], our_logits: list[torch.Tensor] | None, ref: Reference,
                         label: str = "") -> int:
    """The greedy exactness rule over the positions both have (ours may be shorter: a stop ended it). Returns the
    number of positions compared exactly: all of them, or the position of an accepted near-tie divergence."""
    diff_at = None if our_logits is None else \
        (lambda i: float((our_logits[i] - torch.from_numpy(ref.logits[i])).abs().max()))
    return greedy_divergence(ours, ref.tokens, lambda i: top2_gap(ref.logits[i]), diff_at, label)


def top2_gap(scores) -> float:
    """The gap between the two largest of a position's logits (or logprobs: the same gap): a tensor, an array or a
    list."""
    row = scores.float() if isinstance(scores, torch.Tensor) else torch.from_numpy(np.asarray(scores, np.float32))
    top2 = torch.topk(row.flatten(), 2).values
    return float(top2[0] - top2[1])


def greedy_divergence(ours: list[int], ref: list[int], gap_at: Callable[[int], float],
                      diff_at: Callable[[int], float] | None = None, label: str = "") -> int:
    """The greedy exactness rule over the positions both have: at the first position i where they differ,
    gap_at(i) (the reference's top-2 logit gap there) must be below max(1e-3, 10x the largest diff_at(j) over the
    matched positions j < i), diff_at(j) being how far our logits (or logprobs) were from the reference's at j (None:
    not known, taken as 0). Returns the number of positions compared exactly: min(len(ours), len(ref)), or i."""
    max_diff = 0.0
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = gap_at(i)
            allowed = max(1e-3, 10 * max_diff)
            assert gap < allowed, (
                f"{label}: token {i} is {a}, reference {b}; reference top-2 gap {gap:.3g} is no near-tie "
                f"(allowed {allowed:.3g}; max logit diff so far {max_diff:.3g})")
            return i
        if diff_at is not None:
            max_diff = max(max_diff, diff_at(i))
    return min(len(ours), len(ref))


def near_cdf_boundary(logits: torch.Tensor, params, seed: int, position: int) -> bool:
    """The seeded-sampling exactness rule at one position: True when the uniform draw of (seed, position) lies within
    1e-3 of a boundary of the CDF of the distribution the sampler draws from (logits filtered by params), i.e. where
    a last-bit difference in the logits may legitimately pick the neighbouring token."""
    from inferd.engine.sampler import filtered_sorted_probs, uniform_draw

    probs, _ = filtered_sorted_probs(logits, params)
    cdf = torch.cumsum(probs, 0)
    u = uniform_draw(seed, position)
    return float((cdf - u * float(cdf[-1])).abs().min()) < 1e-3


def assert_sampling_match(a: list[int], b: list[int], logits: list[torch.Tensor], params, seed: int,
                          start: int, label: str = "") -> int:
    """Exactness rule for seeded sampling: a divergence only where the uniform draw lies within 1e-3 of a CDF
    boundary of the filtered distribution (logits: b's, the reference's; start: the position of a[0] in the
    sequence). Returns the number of positions compared exactly."""
    assert len(a) == len(b), f"{label}: {len(a)} tokens, reference has {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            assert near_cdf_boundary(logits[i], params, seed, start + i), \
                f"{label}: position {i}: {x} != {y} with a draw far from any CDF boundary"
            return i
    return len(a)


def assert_same_output(ours, ref, params, label: str = "") -> None:
    """ours equals ref (both finished engine requests of the same prompt and params, with recorded logits) by the
    exactness rule, greedy or seeded; the finish reasons too when every position matched."""
    if params.greedy:
        compared = assert_greedy_parity(ours.output_token_ids, ours.debug_logits,
                                        Reference(ref.output_token_ids,
                                                  np.stack([x.float().numpy() for x in ref.debug_logits])), label)
    else:
        compared = assert_sampling_match(ours.output_token_ids, ref.output_token_ids, ref.debug_logits, params,
                                         params.seed, ref.num_prompt_tokens, label)
    if compared == len(ref.output_token_ids):
        assert (ours.finish_reason, ours.stop_reason) == (ref.finish_reason, ref.stop_reason), label


def run_staggered(engine, prompts: list[list[int]], params, every: int = 2):
    """Submit prompt k at step k*every while the engine keeps stepping; returns (requests in prompt order,
    per-step trace of (num_decodes, num_prefill_chunks, num_finished))."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    pending = list(range(len(prompts)))
    reqs = {}
    trace = []
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i = pending.pop(0)
            rid = engine.add_request(prompts[i], params[i])
            reqs[i] = engine.requests[rid]
        outs = engine.step()
        sched = engine.last_schedule
        n_pref = len(sched.scheduled) - sched.num_decodes if sched else 0
        trace.append((sched.num_decodes if sched else 0, n_pref, sum(o.finished for o in outs)))
        step += 1
        assert step < 100_000
    return [reqs[i] for i in range(len(prompts))], trace
