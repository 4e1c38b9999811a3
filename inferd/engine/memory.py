"""How big the KV pool is: `--kv-cache-bytes` when given (and always on a CPU, default 1 GiB), else, on a CUDA
device, what the card has left after the weights and the largest step's activations, times
`--gpu-memory-utilization` of the whole card (as vLLM sizes it).

The activation peak is profiled, not guessed: a throwaway runner with a pool just big enough runs the model over a
prefill chunk of max_num_batched_tokens tokens and the logits of max_num_seqs rows (the largest step the scheduler
can make), and torch's peak allocation above what was allocated before is the peak. kv_pool_bytes() is the
arithmetic, a pure function (tested on a CPU); profile_activation_peak() needs the device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..models.config import ModelConfig

# kept free beyond the profiled peak: the CUDA graphs' pool, the sampler's scratch, allocator fragmentation
GPU_MEMORY_HEADROOM_BYTES = 512 << 20


def kv_pool_bytes(total: int, in_use: int, activation_peak: int, utilization: float,
                  headroom: int = GPU_MEMORY_HEADROOM_BYTES) -> int:
    """Bytes for the KV pool: utilization x total, less what the device already holds (this process's weights and
    anything another process holds: in_use = total - free) and the step's activation peak and a headroom.
    ValueError when nothing is left: the message says what to change."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(utilization * total) - in_use - activation_peak - headroom
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no device memory left for the KV cache: {utilization:.2f} x {total / gib:.1f} GiB, less "
            f"{in_use / gib:.2f} GiB in use (the weights and other processes) and {activation_peak / gib:.2f} GiB "
            f"for a step's activations and {headroom / gib:.2f} GiB of headroom. Raise --gpu-memory-utilization, "
            "lower --max-num-batched-tokens, or give --kv-cache-bytes")
    return budget


def run_largest_step(model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype,
                     kv_dtype: torch.dtype) -> None:
    """The largest step the scheduler can make, on a throwaway pool of just its blocks: one prefill chunk of
    max_num_batched_tokens tokens (or max_model_len if less) and the logits of max_num_seqs rows. Any device."""
    from .runner import ModelRunner

    bs = config.block_size
    tokens = max(1, min(config.max_num_batched_tokens, config.max_model_len or model_config.max_position_embeddings))
    blocks = -(-tokens // bs)
    runner = ModelRunner(model, model_config, blocks, bs, dtype, config.device, kv_dtype=kv_dtype)
    samples = min(config.max_num_seqs, tokens)
    with torch.inference_mode():
        hidden, rows = runner.forward([([0] * tokens, 0, list(range(blocks)), samples)])
        model.compute_logits(hidden[rows])


def profile_activation_peak(model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                            dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """Peak bytes run_largest_step allocates on the CUDA device above what was allocated before it (its throwaway
    pool included, which is small: the chunk's own blocks)."""
    device = torch.device(config.device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_largest_step(model, model_config, config, dtype, kv_dtype)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


def resolve_kv_cache_bytes(model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                           dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """config.kv_cache_bytes when set; on a CPU (or any device torch cannot query) the default; on CUDA the card's
    free memory as kv_pool_bytes() counts it, after profiling a step."""
    from ..config import DEFAULT_KV_CACHE_BYTES

    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    device = torch.device(config.device)
    if device.type != "cuda":
        return DEFAULT_KV_CACHE_BYTES
    peak = profile_activation_peak(model, model_config, config, dtype, kv_dtype)
    free, total = torch.cuda.mem_get_info(device)
    return kv_pool_bytes(total, total - free, peak, config.gpu_memory_utilization)
