"""Fake (meta) kernels of the fused CPU ops, so that torch.compile can trace a model step that calls them (as opaque
custom ops): output shapes and dtypes only. Imported for its effect; harmless when the library is not loaded."""

from __future__ import annotations

import torch


def register() -> bool:
    """Registers the fake kernels once the ops exist (kernels.build.load() succeeded); False when they do not."""
    if not hasattr(torch.ops, "inferd") or not hasattr(torch.ops.inferd, "add_rms_norm"):
        return False
    if getattr(register, "done", False):
        return True

    @torch.library.register_fake("inferd::add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(residual)

    @torch.library.register_fake("inferd::rope_kv_write")
    def _(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
        return None

    @torch.library.register_fake("inferd::silu_mul")
    def _(gate_up):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @torch.library.register_fake("inferd::paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, context_lens, scale, window=0, sinks=None, softcap=0.0):
        return torch.empty_like(q)

    @torch.library.register_fake("inferd::lora_add")
    def _(y, x, perm, seg_slots, seg_starts, row_slots, a, bt, ranks, parts):
        return None

    @torch.library.register_fake("inferd::decode_layers")
    def _(residual, positions, cos, sin, slot_mapping, block_tables, context_lens, k_caches, v_caches, norms, eps,
          weights, aux, biases, kinds, num_heads, num_kv_heads, scale, lora_perm, lora_seg_slots, lora_seg_starts,
          lora_row_slots, lora_a, lora_bt, lora_ranks, lora_parts):
        return torch.empty_like(residual)

    @torch.library.register_fake("inferd::apply_token_bitmask")
    def _(logits, bitmask, rows):
        return None

    register.done = True
    return True
