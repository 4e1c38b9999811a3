"""The engine's flags: one row per EngineConfig field an operator sets on the command line.

From this table alone come the flags of every command that runs an engine (serve, worker, generate, chat; their
defaults are EngineConfig's), the EngineConfig built from the parsed flags, and the argv that hands a config on to a
worker process (`inferd serve` starts `inferd worker` with it). A worker's tensor-parallel ranks get the whole
EngineConfig, every field, from the worker (inferd/engine/tensor_parallel.py). Adding an engine flag is one row here
(and its line in docs/configuration.md); every EngineConfig field must have a row or a reason in FLAGLESS
(tests/cli/test_engine_flags.py)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import (
    DEFAULT_LOWER_TIER_PREFILL_TOKENS,
    DEFAULT_MAX_CPU_LORAS,
    DEFAULT_MAX_LORA_BYTES,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    DEFAULT_NUM_DRAFT,
    DEFAULT_SPECULATIVE_MAX_BATCH,
    DEFAULT_TIER_SHARES,
    GRAMMAR_COMPILE_PROCESSES,
    GRAMMAR_COMPILE_TIMEOUT_S,
    GRAMMAR_MASK_BUDGET_MS_PER_STEP,
    GRAMMAR_MASK_BUDGET_S,
    KV_DTYPES,
    MAX_NUM_DRAFT,
    SPECULATIVE_METHODS,
    TIER_ACTIVE_WINDOW_S,
    EngineConfig,
)
from .types import parse_bytes, positive_float, positive_int, tier_shares_arg

DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


@dataclass(frozen=True)
class Flag:
    field: str  # the EngineConfig field; its default is the flag's
    flag: str  # e.g. "--max-num-seqs"
    help: str | None = None
    parse: Callable[[str], Any] | None = None  # argparse's type (None: the text as given)
    choices: Sequence[str] | None = None
    metavar: str | None = None
    group: str | None = None  # the argument group it is listed under in --help (None: the command's options)
    switch: bool = False  # takes no value: given, the field is the opposite of its default (--no-prefix-caching)

    @property
    def dest(self) -> str:
        """The attribute argparse stores it under."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        return DEFAULTS[self.field]


SPECULATIVE = "speculative decoding"
LORA = "LoRA adapters"
GRAMMAR = "structured outputs' time budgets (a request past one ends with grammar_too_slow)"

ENGINE_FLAGS = (
    Flag("model", "--model", "HF model folder or .gguf file (default: SmolLM2-135M-Instruct)"),
    Flag("dtype", "--dtype", "auto: bf16 where the device computes it natively, else fp32",
         choices=["auto", "float32", "bfloat16", "float16"]),
    Flag("kv_dtype", "--kv-dtype", "the KV cache's storage dtype (auto: the activations'); bfloat16 or float8_e4m3fn "
         "hold 2x or 4x the tokens of fp32 in --kv-cache-bytes, attention still computes in --dtype",
         choices=KV_DTYPES),
    Flag("device", "--device"),
    Flag("kv_cache_bytes", "--kv-cache-bytes", "size of the KV cache pool (default: 1G on a CPU; on CUDA what the card "
         "has left after the weights and a profiled step, within --gpu-memory-utilization)", parse_bytes),
    Flag("gpu_memory_utilization", "--gpu-memory-utilization", "on CUDA without --kv-cache-bytes: the share of the "
         "card this worker may fill (weights, KV pool, activations)", float),
    Flag("block_size", "--block-size", "tokens per KV block", int),
    Flag("max_model_len", "--max-model-len", "context window (default: the model's)", int),
    Flag("max_num_seqs", "--max-num-seqs", "running sequences per step", int),
    Flag("max_num_batched_tokens", "--max-num-batched-tokens", "token budget of one step", int),
    Flag("tier_shares", "--tier-shares", "each tier's nominal share of the seats (running sequences) and of a step's "
         "prompt tokens; a tier below its share lends the rest and takes it back at the next step (default "
         f"{DEFAULT_TIER_SHARES}); strict: tiers in strict priority (the gateway of `inferd serve` uses it too)",
         tier_shares_arg, metavar="TIER=SHARE,...|strict"),
    Flag("lower_tier_prefill_tokens", "--lower-tier-prefill-tokens", "while a more important tier has work or had "
         f"some in the last {TIER_ACTIVE_WINDOW_S:g} s, a tier's prompt tokens per step are held to its share of the "
         f"step's budget, and at least this many (default {DEFAULT_LOWER_TIER_PREFILL_TOKENS})", positive_int),
    Flag("enable_prefix_caching", "--no-prefix-caching", switch=True),
    Flag("tensor_parallel", "--tensor-parallel", "split each layer over N processes (devices); N must divide the "
         "heads, KV heads and MLP size", int, metavar="N"),
    Flag("quantize", "--quantize", "int8: weight-only int8 with a scale per output channel (half of bf16's weight "
         "bytes; needs --dtype bfloat16 or float16); int4: 4-bit codes with a scale and minimum per 32 values (GGUF "
         "Q4_1's scheme) read by single-stream decode steps, ~1.8x faster there than bf16 on the fused CPU kernels "
         "(~3x the torch references; docs/benchmarks.md); batched steps use the dequantized weights (no memory "
         "saved)", choices=["int8", "int4"]),
    Flag("kernels", "--kernels", "the step's operators: auto = the fused CPU kernels (inferd/kernels, built for this "
         "CPU) where they apply, the Triton attention kernels on CUDA, else the plain torch references; fused = "
         "refuse to start without them; reference = the torch references only; triton = the Triton attention "
         "kernels (on a CPU only under TRITON_INTERPRET=1: for tests)",
         choices=["auto", "fused", "reference", "triton"]),
    Flag("cuda_graphs", "--no-cuda-graphs", "on CUDA, run decode steps eagerly instead of replaying CUDA graphs "
         "captured at start", switch=True),
    Flag("batch_invariant", "--batch-invariant", "a sequence's logits independent of its batch and of prefill vs "
         "decode, so that greedy and seeded streams replay exactly in bf16 too (failover); slower "
         "(docs/benchmarks.md)", switch=True),
    Flag("speculative", "--speculative", "ngram: draft tokens by prompt lookup, verified in one forward pass; outputs "
         "unchanged (default: off)", choices=list(SPECULATIVE_METHODS), group=SPECULATIVE),
    Flag("num_draft", "--num-draft", f"draft tokens per sequence and step (1..{MAX_NUM_DRAFT}, default "
         f"{DEFAULT_NUM_DRAFT})", int, group=SPECULATIVE),
    Flag("ngram_min", "--ngram-min", f"shortest suffix looked up (default {DEFAULT_NGRAM_MIN})", int,
         group=SPECULATIVE),
    Flag("ngram_max", "--ngram-max", f"longest suffix looked up (default {DEFAULT_NGRAM_MAX})", int, group=SPECULATIVE),
    Flag("speculative_max_batch", "--speculative-max-batch", "no drafts in a step with more decoding sequences than "
         f"this (default {DEFAULT_SPECULATIVE_MAX_BATCH})", int, group=SPECULATIVE),
    Flag("grammar_mask_budget_ms", "--grammar-mask-budget-ms", "one request's grammar work (token mask + accepting the "
         "sampled token), in CPU time, per token of a step: past it the step stops waiting for it (default "
         f"{GRAMMAR_MASK_BUDGET_MS_PER_STEP:g}; honest grammars take well under 5)", positive_float, group=GRAMMAR),
    Flag("grammar_mask_budget_s", "--grammar-mask-budget-s", "one request's grammar work over its whole output "
         f"(default {GRAMMAR_MASK_BUDGET_S:g})", positive_float, group=GRAMMAR),
    Flag("grammar_compile_timeout_s", "--grammar-compile-timeout", "a grammar compile that used this much CPU time is "
         f"killed with its process (default {GRAMMAR_COMPILE_TIMEOUT_S:g})", positive_float, metavar="SECONDS",
         group=GRAMMAR),
    Flag("grammar_compile_processes", "--grammar-compile-processes", "grammar compiles run at once, each in a process "
         f"of its own (default {GRAMMAR_COMPILE_PROCESSES})", positive_int, metavar="N", group=GRAMMAR),
    Flag("enable_lora", "--enable-lora", "serve LoRA adapters (PEFT format) on this base model, a request naming one "
         "as its model; one step mixes adapters and the base", switch=True, group=LORA),
    Flag("max_loras", "--max-loras", f"adapters one step can run (slots in the model; default {DEFAULT_MAX_LORAS})",
         positive_int, metavar="N", group=LORA),
    Flag("max_lora_rank", "--max-lora-rank", f"the largest adapter rank served (default {DEFAULT_MAX_LORA_RANK})",
         positive_int, metavar="R", group=LORA),
    Flag("max_cpu_loras", "--max-cpu-loras", "adapters kept in host memory, least recently used dropped first "
         f"(default {DEFAULT_MAX_CPU_LORAS})", positive_int, metavar="N", group=LORA),
    Flag("max_lora_bytes", "--max-lora-bytes", "the largest adapter weights file accepted (default "
         f"{DEFAULT_MAX_LORA_BYTES >> 20}M)", parse_bytes, group=LORA),
    Flag("lora_root", "--lora-root", "adapters are read only from under this folder (default: anywhere the "
         "process can read)", metavar="DIR", group=LORA),
)

# EngineConfig fields with no flag, and why
FLAGLESS = {
    "detokenize": "set by the process, not the operator: a worker sends token ids and turns it off (the API process "
                  "detokenizes); generate and chat keep it on",
    "record_logits": "keeps every sampled row's logits on the request: for tests and debugging, never for serving",
    "static_decode": "the CUDA graphs' static-shape decode path without graphs, for CPU checks of that path (tests, "
                     "bench/gpu_check.py --dry-run); off in serving",
    "sliding_window_reclaim": "off only to compare with keeping every position (tests, "
                              "bench/sliding_window_memory.py): the outputs are the same, the memory is not",
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every row's flag, with EngineConfig's default."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in ENGINE_FLAGS:
        target = p
        if f.group is not None:
            if f.group not in groups:
                groups[f.group] = p.add_argument_group(f.group)
            target = groups[f.group]
        if f.switch:
            target.add_argument(f.flag, action="store_true", help=f.help)
        else:
            target.add_argument(f.flag, type=f.parse, default=f.default, choices=f.choices, metavar=f.metavar,
                                help=f.help)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the parsed flags (the fields without one: their defaults)."""
    values = {}
    for f in ENGINE_FLAGS:
        given = getattr(args, f.dest)
        values[f.field] = (not f.default if given else f.default) if f.switch else given
    return EngineConfig(**values)


def engine_argv(config: EngineConfig, only: Collection[str] | None = None) -> list[str]:
    """The flags that give a command config's settings: each flagged field whose value is not the default (the
    command's parser supplies those), in the table's order; only: these fields alone."""
    out: list[str] = []
    for f in ENGINE_FLAGS:
        value = getattr(config, f.field)
        if (only is not None and f.field not in only) or value == f.default:
            continue
        out += [f.flag] if f.switch else [f.flag, str(value)]
    return out
