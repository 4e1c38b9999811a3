"""Fused operators of the model step, each beside its plain torch reference (docs/architecture.md, "Kernels").

- add_rms_norm: the residual add fused with the next RMSNorm;
- rope_kv_write: RoPE on q and k, in place in the fused qkv rows, with the KV cache write;
- silu_mul: SiLU(gate) * up over the fused gate/up rows;
- paged_decode_attention: one-token queries attending to their context where it lies in the paged cache (no
  gathered, padded copy; no mask), with a layer's attention options (window=, sinks=, softcap=: paged.attend) in
  every implementation (`attention_options`); rope_kv_write takes tables narrower than head_dim (partial rotary)
  in every implementation (`partial_rotary`);
- decode_layers (CPU): the whole decoder stack of a pure decode step in one call, the same ops in the same order as
  the Python layers (so the same bits) without their per-call Python overhead, LoRA deltas included;
- lora_add: each row's LoRA delta through its own adapter slot (models/lora.py), a segmented matmul per slot
  (Punica's SGMV); on CPU hand-written loops for a decode step's few rows per slot (`cpu_lora.h`), at::mm for longer
  segments;
- paged_prefill_attention (GPU): the prefill chunks of several sequences in one launch, each attending causally to
  its chunk and to the context cached before it, read in place through the block tables (`prefill_varlen`), with
  the same attention options.

`reference.py` (and `paged.py` for attention) hold the torch references; `cpu_ops.cpp` the fused CPU versions
(built by build.py for this CPU, loaded as torch.ops.inferd.*). A model asks `select(device, dtype, kv_dtype, mode)`
once and gets the namespace it calls: the fused ops where they apply (a CPU tensor, a float32/bf16/fp16 cache), the
references elsewhere. `mode="reference"` (`--kernels reference`) forces the references.

On CUDA every op is a Triton kernel (`triton_decode.py`, `triton_prefill.py`: split-K paged decode, varlen paged
prefill, float8 KV decoded in the kernel; `triton_elementwise.py`: add+RMSNorm, RoPE with the KV write (float8 encoded
in the kernel, byte for byte torch's cast), SiLU x up; `triton_moe.py`: the MoE experts as two grouped GEMMs over
expert-sorted tokens, `fused_moe`, which models/moe.py's block calls where its ops have it; `triton_lora.py`: the LoRA
deltas of a step's rows, each row through its own adapter slot, as a shrink and an expand kernel per projection,
`lora_add`). `mode="triton"` selects
the Triton kernels on any device: on a CPU they only run under Triton's interpreter (`TRITON_INTERPRET=1`), which is
how `make test` checks them, alone (tests/kernels/test_triton_*.py) and inside whole engines
(tests/engine/test_triton_engine.py), against the references. One difference in meaning: the varlen prefill kernel
reads a first chunk's own keys and values back from the cache, where the reference attends to them as computed; with a
cache in the activations' dtype they are the same values, with a float8 cache the Triton path sees them rounded to
float8 (as every later chunk and decode does).
"""

from __future__ import annotations

import types

import torch

from . import reference

KERNEL_MODES = ("auto", "fused", "reference", "triton")
FUSED_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_cpu() -> types.SimpleNamespace | None:
    """The fused CPU ops, built and loaded on first use; None where they cannot be (kernels.build.error() says why)."""
    from . import build

    if not build.load():
        return None
    from . import fake

    fake.register()  # torch.compile can trace a step that calls them (bench/compile_step.py)
    ops = torch.ops.inferd
    return types.SimpleNamespace(name="fused-cpu", add_rms_norm=ops.add_rms_norm, rope_kv_write=ops.rope_kv_write,
                                 silu_mul=ops.silu_mul, paged_decode_attention=ops.paged_decode_attention,
                                 decode_in_place=True, paged_prefill_attention=None, prefill_varlen=False,
                                 decode_layers=ops.decode_layers, attention_options=True, partial_rotary=True,
                                 lora_add=ops.lora_add)


# decode_in_place: paged_decode_attention reads block tables in place (the runner builds tables, not gather groups);
# prefill_varlen: paged_prefill_attention takes every prefill chunk of the step in one call (the runner builds
# cu_seqlens, context lengths and block tables for them), else the model runs paged.prefill_attention per sequence
REFERENCE = types.SimpleNamespace(name="reference", add_rms_norm=reference.add_rms_norm,
                                  rope_kv_write=reference.rope_kv_write, silu_mul=reference.silu_mul,
                                  paged_decode_attention=reference.paged_decode_attention, decode_in_place=False,
                                  paged_prefill_attention=None, prefill_varlen=False, decode_layers=None,
                                  attention_options=True, partial_rotary=True, lora_add=reference.lora_add)


def triton_ops() -> types.SimpleNamespace | None:
    """The Triton kernels (attention, add+RMSNorm, RoPE with the KV write, SiLU x up); None where triton does not
    import."""
    from . import triton_decode, triton_elementwise, triton_lora, triton_moe, triton_prefill

    if not (triton_decode.AVAILABLE and triton_prefill.AVAILABLE and triton_elementwise.AVAILABLE):
        return None
    return types.SimpleNamespace(name="triton", add_rms_norm=triton_elementwise.add_rms_norm,
                                 rope_kv_write=triton_elementwise.rope_kv_write, silu_mul=triton_elementwise.silu_mul,
                                 paged_decode_attention=triton_decode.paged_decode_attention, decode_in_place=True,
                                 paged_prefill_attention=triton_prefill.paged_prefill_attention, prefill_varlen=True,
                                 decode_layers=None, attention_options=True, partial_rotary=True,
                                 fused_moe=triton_moe.fused_moe, lora_add=triton_lora.lora_add)


def select(device: torch.device | str, dtype: torch.dtype, kv_dtype: torch.dtype,
           mode: str = "auto") -> types.SimpleNamespace:
    """The ops a model on this device, in dtype over a kv_dtype cache, runs. mode: auto (fused where available),
    fused (ValueError when not available), reference, triton (the Triton attention kernels on any device; ValueError
    without triton). On CUDA, auto and fused mean the Triton kernels. Over a cache the fused CPU ops do not read
    (float8), the ops that touch the cache (the KV write, decode attention) are the references and the others stay
    fused."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"unknown kernels mode {mode!r} (choose one of: {', '.join(KERNEL_MODES)})")
    if mode == "reference":
        return REFERENCE
    device = torch.device(device)
    why = None
    ops = None
    if mode == "triton" or device.type == "cuda":
        ops = triton_ops()
        if ops is None:
            why = "triton is not installed"
            if mode in ("triton", "fused"):
                raise ValueError(why)
            return REFERENCE
        return ops  # the Triton kernels read every KV dtype the cache has (float8 dequantized in the kernel)
    if device.type != "cpu":
        why = f"no fused kernels for {device.type} yet"
    elif dtype not in FUSED_DTYPES:
        why = f"no fused CPU kernels for {dtype}"
    else:
        ops = fused_cpu()
        if ops is None:
            from . import build

            why = f"the fused CPU kernels could not be loaded: {build.error()}"
    if ops is None:
        if mode == "fused":
            raise ValueError(why)
        return REFERENCE
    if kv_dtype not in FUSED_KV_DTYPES:
        ops = types.SimpleNamespace(**vars(ops))
        ops.name = "fused-cpu (reference KV ops)"
        ops.rope_kv_write, ops.paged_decode_attention = REFERENCE.rope_kv_write, REFERENCE.paged_decode_attention
        ops.decode_in_place = False
        ops.decode_layers = None
    return ops
