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
# compact references, committed (the default model's: its transformers run costs ~20 s on every clean clone)
COMMITTED_REFS = Path(__file__).parent / "data" / "hf-reference"
COMPACT_TOP_K = 64


@dataclass
class Reference:
    """A transformers run: its tokens, and per position its logits: all of them, or (a compact reference) the
    COMPACT_TOP_K largest with their token ids."""
    tokens: list[int]
    logits: np.ndarray | None  # [n, vocab] float32
    top_ids: np.ndarray | None = None  # [n, K] int64, by decreasing logit
    top_values: np.ndarray | None = None  # [n, K] float32

    def gap(self, i: int) -> float:
        """The top-2 logit gap at position i."""
        if self.logits is not None:
            return top2_gap(self.logits[i])
        return float(self.top_values[i][0] - self.top_values[i][1])

    def max_diff(self, i: int, ours: torch.Tensor) -> float:
        """How far our logits at position i are from the reference's: the largest absolute difference over the whole
        vocabulary, or for a compact reference over its K largest logits. That is a lower bound of the whole
        vocabulary's, so the near-tie allowance (10x it) can only be smaller: a compact reference is never more
        lenient than the rule."""
        if self.logits is not None:
            return float((ours - torch.from_numpy(self.logits[i])).abs().max())
        ids = torch.from_numpy(self.top_ids[i])
        return float((ours.flatten()[ids].float() - torch.from_numpy(self.top_values[i])).abs().max())

    def compact(self) -> "Reference":
        top = torch.topk(torch.from_numpy(self.logits), COMPACT_TOP_K, dim=-1)
        return Reference(self.tokens, None, top.indices.numpy(), top.values.numpy())


def hf_greedy(get_model, prompt: list[int], max_new_tokens: int, cache_key: str | None = None,
              committed: bool = False) -> Reference:
    """transformers' generate, greedy, never stopping at EOS; cached on disk when cache_key is given.
    get_model() returns the HF model; it is only called on a cache miss. committed: the compact reference in
    tests/data/hf-reference is used when there is one for this key, and written there when there is none (commit
    it: the key holds the pinned transformers and torch versions, the model file's size, the prompt and the length)."""
    path = None
    if cache_key is not None:
        import transformers

        key = json.dumps([cache_key, transformers.__version__, torch.__version__, prompt, max_new_tokens])
        digest = hashlib.sha256(key.encode()).hexdigest()
        path = REF_CACHE / (digest + ".npz")
        stored = COMMITTED_REFS / (digest + ".npz")
        if committed and stored.exists():
            data = np.load(stored)
            return Reference(data["tokens"].tolist(), None, data["top_ids"], data["top_values"])
        if path.exists():
            data = np.load(path)
            ref = Reference(data["tokens"].tolist(), data["logits"])
            if committed:
                _save_compact(ref, stored)
            return ref
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
        if committed:
            _save_compact(Reference(tokens, logits), stored)
    return Reference(tokens, logits)


def _save_compact(ref: Reference, path: Path) -> None:
    small = ref.compact()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez_compressed(tmp, tokens=np.array(small.tokens), top_ids=small.top_ids, top_values=small.top_values)
    os.replace(tmp, path)


def assert_greedy_parity(ours: list[int], our_logits: list[torch.Tensor] | None, ref: Reference,
                         label: str = "") -> int:
    """Returns the number of positions compared exactly (len(ref.tokens) when all match)."""
    assert len(ours) == len(ref.tokens), f"{label}: {len(ours)} tokens, reference has {len(ref.tokens)}"
    return greedy_prefix_parity(ours, our_logits, ref, label)


def greedy_prefix_parity(ours: list[int], our_logits: list[torch.Tensor] | None, ref: Reference,
                         label: str = "") -> int:
    """The greedy exactness rule over the positions both have (ours may be shorter: a stop ended it). Returns the
    number of positions compared exactly: all of them, or the position of an accepted near-tie divergence."""
    diff_at = None if our_logits is None else (lambda i: ref.max_diff(i, our_logits[i]))
    return greedy_divergence(ours, ref.tokens, ref.gap, diff_at, label)


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
