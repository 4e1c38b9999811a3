"""The exactness rule of the suite (the one implementation every test that compares outputs uses), and
token-for-token comparison with Hugging Face transformers by it.

1. Logits, not only tokens. On every position compared (each computed by both runs from the same tokens, the
   position where they part included) our logits, or our top-k logprobs, agree with the reference's within the
   dtype's bound (`Bound`): a fixed multiple of the row's scale, written once below beside its measured baseline.
2. Near-ties only. Greedy: a divergence is accepted only where the reference's top-2 gap is below that same bound.
   Seeded sampling: only where the position's uniform draw lies within 1e-3 of a boundary of the CDF of the filtered
   distribution (`near_cdf_boundary`). Nothing a difference did can make an allowance larger.
3. A minimum. Each output matches at least the bound's min_compared positions (all of them when shorter) before a
   near-tie may part it: a run that parts from its reference at once proves little. Never fewer tokens.

The rule is proven by mutation: a wrong RMSNorm epsilon, RoPE base or key-head order fails it
(tests/engine/test_parity_tiny.py), and tests/test_parity_rule.py pins each clause. Measuring the baselines again:
`INFERD_PARITY_RECORD=/tmp/parity.jsonl pytest ...` records every comparison's largest relative difference;
`python tests/parity.py /tmp/parity.jsonl` summarises them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# ---- the bounds -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """How far our values (logits or logprobs) may be from the reference's at one position: `rel` times the
    position's scale (the reference row's largest magnitude, at least 1). Float rounding grows with the values, so one
    number serves a 2-layer random model with logits to ~6 and a 30-layer model with logits to ~43."""
    name: str
    rel: float
    measured: str  # the baseline the bound was fixed from: `python tests/parity.py RECORD` prints it
    min_compared: int  # positions each output must match before a near-tie may part it from the reference

    def tolerance(self, scale: float) -> float:
        return self.rel * max(1.0, scale)


# float32: 2.7x the largest measured, SmolLM2 GGUF against transformers (1.5e-4 at logits to 41: 30 layers of
# rounding); the peaked tiny models measure 1.9e-6 relative against transformers, 1.7e-6 fused against reference.
# A near-tie under it is rare (peaked tiny models: ~6e-5 against a smallest top-2 gap of 9e-4 in 240 positions),
# so an output must match 8 positions before one may part it.
FP32 = Bound("float32", 1e-5, "3.7e-6 relative (SmolLM2 vs transformers; AMD EPYC AVX-512 BF16)", min_compared=8)
# bfloat16 against bfloat16 (ours: fused kernels against the references): 1.6x the largest measured, 2.6e-2 relative
# on the peaked tiny Llama (the roundings of two layers' hidden states, 2^-8 each, reach the logits). At that bound
# most of a tiny model's positions are near-ties (median top-2 gap ~0.18 against a tolerance of ~0.24), and 3 of 12
# outputs parted from their reference, one at position 7: no minimum holds on every machine, so what a bf16
# comparison proves is every compared position's logits. bf16 against transformers and against our float32 is
# judged by top-1 agreement and KL (tests/engine/test_bf16_parity.py).
BF16 = Bound("bfloat16", 4e-2, "2.6e-2 relative (fused against reference, peaked tiny Llama)", min_compared=0)
BOUNDS = {torch.float32: FP32, torch.bfloat16: BF16}

# Every tiny random model the tests build draws its weights 7.5x wider than transformers' default (0.02): peaked,
# its top-2 logit gaps have a median of ~0.18 instead of ~0.026 (the smallest of 240 greedy positions: 9e-4 instead
# of 1.8e-4), so a near-tie under the float32 bound (~6e-5 at their logit scale) is rare. Wider still (0.3) grows
# the activations until float32 rounding nears the bound (measured 7e-6 relative).
PEAKED_INIT = 0.15
# or, for a model whose weights keep the default spread, its final norm's weight scaled up (all logits x7.5: greedy
# choices unchanged, gaps 7.5x wider)
PEAKED_HEAD = 7.5


def bound_for(dtype: torch.dtype) -> Bound:
    return BOUNDS[dtype]


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
        vocabulary, or for a compact reference over its K largest logits (the ones any choice is made among)."""
        if self.logits is not None:
            return float((ours.float().flatten() - torch.from_numpy(self.logits[i])).abs().max())
        ids = torch.from_numpy(self.top_ids[i])
        return float((ours.flatten()[ids].float() - torch.from_numpy(self.top_values[i])).abs().max())

    def scale(self, i: int) -> float:
        """The scale of position i's logits (Bound): the whole row's largest magnitude, or the K largest logits'."""
        return scale_of(self.logits[i] if self.logits is not None else self.top_values[i])

    def compact(self) -> Reference:
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


def scale_of(row) -> float:
    """A position's scale: the largest magnitude among a row's finite values (a tensor, an array, a list)."""
    t = row.float() if isinstance(row, torch.Tensor) else torch.from_numpy(np.asarray(row, np.float32))
    t = t.flatten()
    t = t[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


def row_diff(ours, ref) -> float:
    """The largest absolute difference between two rows of logits over the whole vocabulary (a token masked out in
    one row and not in the other: infinite)."""
    a = ours.float() if isinstance(ours, torch.Tensor) else torch.as_tensor(np.asarray(ours), dtype=torch.float32)
    b = ref.float() if isinstance(ref, torch.Tensor) else torch.as_tensor(np.asarray(ref), dtype=torch.float32)
    d = (a.flatten() - b.flatten()).abs()
    d[a.flatten() == b.flatten()] = 0.0  # masked out in both (constrained decoding): -inf and -inf agree
    return float(d.nan_to_num(nan=float("inf")).max())


def assert_greedy_parity(ours: list[int], our_logits: list[torch.Tensor], ref: Reference, label: str = "",
                         bound: Bound = FP32, min_compared: int | None = None) -> int:
    """Returns the number of positions compared exactly (len(ref.tokens) when all match)."""
    assert len(ours) == len(ref.tokens), f"{label}: {len(ours)} tokens, reference has {len(ref.tokens)}"
    return greedy_prefix_parity(ours, our_logits, ref, label, bound, min_compared)


def greedy_prefix_parity(ours: list[int], our_logits: list[torch.Tensor], ref: Reference, label: str = "",
                         bound: Bound = FP32, min_compared: int | None = None) -> int:
    """The greedy exactness rule against a transformers reference over the positions both have (ours may be shorter:
    a stop ended it). Returns the number of positions compared exactly: all of them, or the position of an accepted
    near-tie divergence."""
    assert our_logits is not None and len(our_logits) >= min(len(ours), len(ref.tokens)), \
        f"{label}: the rule compares logits, and ours were not recorded"
    return greedy_divergence(ours, ref.tokens, ref.gap, lambda i: ref.max_diff(i, our_logits[i]), label,
                             scale_at=ref.scale, bound=bound, min_compared=min_compared)


def assert_same_rows(ours: list[int], our_rows, ref: list[int], ref_rows, label: str = "", bound: Bound = FP32,
                     min_compared: int | None = None) -> int:
    """The greedy rule between two runs of ours, each with its full logits per position (tensors or arrays)."""
    assert len(our_rows) >= min(len(ours), len(ref)) <= len(ref_rows), f"{label}: logits were not recorded"
    return greedy_divergence(ours, ref, lambda i: top2_gap(ref_rows[i]), lambda i: row_diff(our_rows[i], ref_rows[i]),
                             label, scale_at=lambda i: scale_of(ref_rows[i]), bound=bound, min_compared=min_compared)


def top2_gap(scores) -> float:
    """The gap between the two largest of a position's logits (or logprobs: the same gap): a tensor, an array or a
    list."""
    row = scores.float() if isinstance(scores, torch.Tensor) else torch.from_numpy(np.asarray(scores, np.float32))
    top2 = torch.topk(row.flatten(), 2).values
    return float(top2[0] - top2[1])


def greedy_divergence(ours: list[int], ref: list[int], gap_at: Callable[[int], float],
                      diff_at: Callable[[int], float], label: str = "", *, scale_at: Callable[[int], float],
                      bound: Bound = FP32, min_compared: int | None = None) -> int:
    """The greedy exactness rule over the positions both have. At every position i up to and including the first
    where the tokens differ (each run computed it from the same tokens), diff_at(i), how far our logits (or
    logprobs) are from the reference's, must be within bound.tolerance(scale_at(i)). Where they differ, gap_at(i),
    the reference's top-2 gap, must be below that tolerance too, and at least min_compared positions (all, when
    fewer) must have matched before it. Returns the number of positions compared exactly: min(len(ours), len(ref)),
    or the position of the divergence."""
    n = min(len(ours), len(ref))
    min_compared = bound.min_compared if min_compared is None else min_compared
    worst = 0.0
    compared = n
    for i in range(n):
        tol = bound.tolerance(scale_at(i))
        diff = diff_at(i)
        worst = max(worst, diff / max(1.0, scale_at(i)))
        assert diff <= tol, (f"{label}: position {i}: logits differ by {diff:.3g} from the reference's, beyond the "
                             f"{bound.name} bound {tol:.3g}")
        if ours[i] != ref[i]:
            gap = gap_at(i)
            assert gap < tol, (f"{label}: token {i} is {ours[i]}, reference {ref[i]}; the reference's top-2 gap "
                               f"{gap:.3g} is no near-tie under the {bound.name} bound {tol:.3g}")
            assert i >= min(min_compared, n), (f"{label}: parted from the reference at position {i}, before the "
                                               f"{min(min_compared, n)} positions every comparison must cover")
            compared = i
            break
    _record(label, bound, worst, compared, n)
    return compared


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
                          start: int, label: str = "", *, diff_at: Callable[[int], float],
                          bound: Bound = FP32, min_compared: int | None = None) -> int:
    """Exactness rule for seeded sampling: on every position compared diff_at(i), how far a's logits (or logprobs)
    are from b's, is within the bound; a divergence only where the uniform draw lies within 1e-3 of a CDF boundary
    of the filtered distribution (logits: b's, the reference's; start: the position of a[0] in the sequence), after
    at least min_compared matched positions. Returns the number of positions compared exactly."""
    assert len(a) == len(b), f"{label}: {len(a)} tokens, reference has {len(b)}"
    min_compared = bound.min_compared if min_compared is None else min_compared
    worst = 0.0
    compared = len(a)
    for i, (x, y) in enumerate(zip(a, b)):
        scale = scale_of(logits[i])
        tol, diff = bound.tolerance(scale), diff_at(i)
        worst = max(worst, diff / max(1.0, scale))
        assert diff <= tol, (f"{label}: position {i}: values differ by {diff:.3g} from the reference's, beyond the "
                             f"{bound.name} bound {tol:.3g}")
        if x != y:
            assert near_cdf_boundary(logits[i], params, seed, start + i), \
                f"{label}: position {i}: {x} != {y} with a draw far from any CDF boundary"
            assert i >= min(min_compared, len(a)), \
                f"{label}: parted from the reference at position {i}, before {min(min_compared, len(a))} positions"
            compared = i
            break
    _record(label, bound, worst, compared, len(a))
    return compared


def assert_same_output(ours, ref, params, label: str = "", bound: Bound = FP32) -> None:
    """ours equals ref (both finished engine requests of the same prompt and params, with recorded logits) by the
    exactness rule, greedy or seeded; the finish reasons too when every position matched. ours may be a replay
    given ref's first k output tokens as already generated (it recorded logits for the rest only): those k must be
    ref's, and the rule compares the rest."""
    k = len(ours.output_token_ids) - len(ours.debug_logits)
    assert ours.output_token_ids[:k] == ref.output_token_ids[:k], label
    a, b = ours.output_token_ids[k:], ref.output_token_ids[k:]
    a_rows, b_rows = ours.debug_logits, ref.debug_logits[k:]
    if params.greedy:
        assert len(a) == len(b), label
        compared = assert_same_rows(a, a_rows, b, b_rows, label, bound)
    else:
        compared = assert_sampling_match(a, b, b_rows, params, params.seed, ref.num_prompt_tokens + k, label,
                                         diff_at=lambda i: row_diff(a_rows[i], b_rows[i]), bound=bound)
    if compared == len(b):
        assert (ours.finish_reason, ours.stop_reason) == (ref.finish_reason, ref.stop_reason), label


# ---- measuring the baselines ----------------------------------------------------------------------------------------
_RECORD = os.environ.get("INFERD_PARITY_RECORD")


def _record(label: str, bound: Bound, worst_rel: float, compared: int, n: int) -> None:
    """With INFERD_PARITY_RECORD set, appends one comparison's largest relative difference to that file."""
    if _RECORD:
        with open(_RECORD, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "label": label,
                                "bound": bound.name, "worst_rel": worst_rel, "compared": compared, "n": n}) + "\n")


def run_staggered(engine, prompts: list[list[int]], params, every: int = 2, on_step=None):
    """Submit prompt k at step k*every while the engine keeps stepping; returns (requests in prompt order,
    per-step trace of (num_decodes, num_prefill_chunks, num_finished)). on_step(): called after each step."""
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
        if on_step is not None:
            on_step()
        sched = engine.last_schedule
        n_pref = len(sched.scheduled) - sched.num_decodes if sched else 0
        trace.append((sched.num_decodes if sched else 0, n_pref, sum(o.finished for o in outs)))
        step += 1
        assert step < 100_000
    return [reqs[i] for i in range(len(prompts))], trace


def decode_step_inputs(engine, prompts: list[list[int]], max_tokens: int = 64):
    """The model inputs (ids, positions, attention metadata) of the engine's next step once every prompt is decoding
    (that step still runs): what a test hands to the model's two decode paths."""
    from inferd.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while any(r.num_computed_tokens < len(r.token_ids) - 1 for r in engine.requests.values()):
        engine.step()
    runner, seen = engine.runner, {}
    prepare = runner.prepare
    runner.prepare = lambda rows: seen.setdefault("args", prepare(rows))
    engine.step()
    runner.prepare = prepare
    ids, positions, meta, _ = seen["args"]
    assert meta.decode_tables is not None and not meta.prefills
    return ids, positions, meta


def _summarise(path: str) -> None:
    """The largest relative difference per bound and per test file, and how close each came to its bound."""
    rows = [json.loads(line) for line in open(path)]
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["bound"], r["test"].split("::")[0]), []).append(r)
    for (bound, test), rs in sorted(by.items()):
        worst = max(r["worst_rel"] for r in rs)
        parted = sum(r["compared"] < r["n"] for r in rs)
        print(f"{bound:9} {worst:9.3g} ({worst / BOUNDS_BY_NAME[bound].rel:6.1%} of the bound)  "
              f"{len(rs):4} comparisons, {parted} parted at a near-tie  {test}")


BOUNDS_BY_NAME = {b.name: b for b in BOUNDS.values()}

if __name__ == "__main__":
    import sys

    _summarise(sys.argv[1])
