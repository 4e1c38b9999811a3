"""Structured outputs: a grammar that constrains which tokens a request may sample (xgrammar).

A constrained request carries `SamplingParams.structured = (kind, text)`:
- ``json``: a JSON schema (the text is the schema's JSON), ``json_object``: any JSON object (text ignored; OpenAI's
  JSON mode),
- ``json_compact``, ``json_object_compact``: the same, compact: no whitespace of the model's choosing, the
  separators fixed as ", " and ": " (vLLM's disable_any_whitespace; `--disable-any-whitespace`, per request
  structured_outputs.disable_any_whitespace),
- ``regex``, ``choice`` (the text is a JSON list of strings: exactly one of them), ``grammar`` (EBNF, GBNF-style as
  xgrammar and llama.cpp read it), ``structural_tag`` (xgrammar's structural tag JSON: the tool-call formats).

The grammar is parsed (without the tokenizer, cheap, bounded by MAX_STRUCTURED_CHARS) where the request is
validated, so a bad schema is a 400 before the request is admitted; it is compiled against the tokenizer (the costly
part: per-token masks) in a process of its own, cached per (kind, text), within a time budget, so a slow schema never
stalls the step of the requests already running (grammar_compile.py). Each step, every constrained row's allowed
tokens are written into one bitmask (filled on threads while the model runs, each request within its time budget:
grammar_budget.py) and applied to the logits in one batched call before sampling (before the seeded draw: seeded
outputs stay reproducible); the sampled token then advances the row's matcher. A request ends when its grammar is
complete (the matcher accepted a stop token). A replayed request rebuilds its matcher from the tokens generated
before (Constraint.advance).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ..config import MAX_STRUCTURED_CHARS
from .errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

KINDS = ("json", "json_object", "json_compact", "json_object_compact", "regex", "choice", "grammar", "structural_tag")
COMPACT = "_compact"  # the suffix of a JSON kind without free whitespace
# JSON schemas compile with a bounded run of whitespace between tokens: a small model at temperature 1 otherwise
# loses itself in newlines inside an object that it never closes (vLLM's disable-any-whitespace, as a bound)
JSON_MAX_WHITESPACE = 2
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def compact(kind: str) -> str:
    """The compact variant of a JSON kind (json, json_object); any other kind as it is."""
    return kind + COMPACT if kind in ("json", "json_object") else kind


def json_options(kind: str) -> dict:
    """xgrammar's JSON-schema options of a JSON kind: whitespace of the model's choosing (bounded), or compact."""
    if kind.endswith(COMPACT):
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": JSON_MAX_WHITESPACE}


def _xgr():
    import xgrammar

    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the strings."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def parse_choices(text: str) -> list[str]:
    try:
        choices = json.loads(text)
    except ValueError:
        choices = None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
    return choices


def check_spec(kind: Any, text: Any, param: str = "structured_outputs") -> None:
    """InvalidRequestError (naming param) for a constraint that cannot compile: an unknown kind, an invalid JSON
    schema, regex, choice list, grammar or structural tag. Parses without the tokenizer: milliseconds for what
    MAX_STRUCTURED_CHARS allows."""
    if kind not in KINDS:
        raise InvalidRequestError(f"{param}: the constraint kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(text, str):
        raise InvalidRequestError(f"{param}: the constraint must be a string")
    if len(text) > MAX_STRUCTURED_CHARS:
        raise InvalidRequestError(f"{param}: the constraint has {len(text)} characters, over the limit of "
                                  f"{MAX_STRUCTURED_CHARS} (MAX_STRUCTURED_CHARS)")
    _check_cached(kind, text, param)


@lru_cache(maxsize=256)
def _check_cached(kind: str, text: str, param: str) -> None:
    xgr = _xgr()
    try:
        if kind in ("json", "json_compact"):
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object (or a boolean)")
            xgr.Grammar.from_json_schema(text, **json_options(kind))
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(parse_choices(text)))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(text)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{param}: {e}") from None
    except Exception as e:  # xgrammar reports parse errors as RuntimeError/ValueError with the position
        message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        # "[12:00:00] /project/cpp/regex_converter.cc:83: Regex parsing error ..." -> the part after the location
        if "] " in message and ": " in message:
            message = message.split(": ", 1)[1] if message.startswith("[") else message
        raise InvalidRequestError(f"{param}: invalid {kind.replace('_', ' ')}: {message}") from None


def compile_constraint(compiler, kind: str, text: str):
    """The CompiledGrammar of (kind, text) from an xgrammar GrammarCompiler (in a compile process:
    grammar_compile.py)."""
    c = compiler
    if kind in ("json", "json_object", "json_compact", "json_object_compact"):
        # json_object: any JSON object (xgrammar's builtin JSON grammar also allows arrays, scalars)
        schema = JSON_OBJECT_SCHEMA if kind.startswith("json_object") else text
        return c.compile_json_schema(schema, **json_options(kind))
    if kind == "regex":
        return c.compile_regex(text)
    if kind == "choice":
        return c.compile_grammar(choice_grammar(parse_choices(text)))
    if kind == "grammar":
        return c.compile_grammar(text)
    if kind == "structural_tag":
        return c.compile_structural_tag(text)
    raise InvalidRequestError(f"unknown constraint kind {kind!r}")


class Constraint:
    """One request's grammar state: an xgrammar matcher over its generated tokens."""

    def __init__(self, compiled):
        self.matcher = _xgr().GrammarMatcher(compiled)

    def advance(self, tokens: list[int]) -> bool:
        """Accepts tokens in order (a replay's earlier outputs); False at the first one the grammar refuses."""
        return all(self.matcher.accept_token(t) for t in tokens)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every token allowed."""
    import torch  # here (and below): the API process checks constraints with this module, without torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _fused_apply():
    """torch.ops.inferd.apply_token_bitmask when the fused CPU kernels load (inferd/kernels/cpu_ops.cpp), else None."""
    global _FUSED
    if _FUSED is None:
        import torch

        from ..kernels import build

        _FUSED = torch.ops.inferd.apply_token_bitmask if build.load() else False
    return _FUSED or None


_FUSED = None


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[r] = -inf where bitmask[r]'s bits are 0, for r in rows, in place, in one batched call. On CPU our
    fused op (skips words of all-allowed tokens, AVX-512 masked stores: ~0.1 ms for 32 rows of SmolLM2's
    vocabulary, against 1.2-5 ms for xgrammar's CPU loop); elsewhere xgrammar's kernel (Triton on CUDA)."""
    if not rows:
        return
    import torch

    fused = _fused_apply() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if fused is not None and logits.stride(1) == 1:
        fused(logits, bitmask, torch.tensor(rows, dtype=torch.long))
        return
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    whole = len(rows) == logits.shape[0]
    _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1],
                                       indices=None if whole else rows)
