"""What an engine step costs in bytes and FLOPs, the device's peaks, and so what bounds the step (docs/machines.md,
"What bounds a step").

Per step:
- bytes read = every weight once, as stored (the matmul weights and the lm_head; an int8 weight counts 1 byte, its
  scales their own; the embedding table only for the rows looked up), plus the KV cache each scheduled sequence
  attends over (its whole context, every layer, K and V), plus the KV it writes; of a mixture-of-experts layer
  (Mixtral, Qwen3-MoE, gpt-oss) the router and only the experts the step's tokens picked, each once (the model's
  expert_bytes_touched after the step);
- FLOPs = 2 x matmul parameters x tokens run (the lm_head only for the rows sampled; of an MoE layer the active ones:
  the router and top-k experts) + attention: 4 x layers x query heads x head_dim x (query tokens x context
  attended), for QK^T and the weighted sum of V.
Model-bandwidth utilisation (MBU) = bytes / time / peak bandwidth; model-FLOP utilisation (MFU) = FLOPs / time /
peak FLOP/s. A step whose arithmetic intensity (FLOPs per byte) is under the ridge point (peak FLOP/s / peak
bandwidth) is bound by memory, over it by compute.

Peaks come from `--peak-bandwidth` / `--peak-flops`, else from a short calibration (a large copy; a 2048^3 matmul in the
engine's dtype; on CUDA 2 GiB and 8192^3, each timed over 10 back-to-back runs) run once per device (and thread count;
FLOP/s per dtype) and cached in INFERD_CACHE_DIR (default ~/.cache/inferd)/peaks.json: delete it to calibrate again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CALIBRATION_COPY_BYTES = 256 << 20  # far over any L3: DRAM bandwidth
CALIBRATION_MATMUL_N = 2048
# on a GPU those take microseconds (a 2048^3 bf16 matmul: ~22 us on an H200), so the host's sync and the card's idle
# clocks would dominate and MFU would read high: a larger product and copy, each timed over several back-to-back
# runs after a warm-up that brings the clocks up
CUDA_CALIBRATION_COPY_BYTES = 2 << 30
CUDA_CALIBRATION_MATMUL_N = 8192
CUDA_CALIBRATION_INNER = 10  # runs per timed interval


def calibration_sizes(device: torch.device) -> tuple[int, int, int]:
    """(copy bytes, matmul n, runs per timed interval) for a calibration on device."""
    if device.type == "cuda":
        return CUDA_CALIBRATION_COPY_BYTES, CUDA_CALIBRATION_MATMUL_N, CUDA_CALIBRATION_INNER
    return CALIBRATION_COPY_BYTES, CALIBRATION_MATMUL_N, 1
# a CPU calibration during which other processes took more than this share of the CPU is used for this run but not
# cached: peaks measured on a busy machine are too low (seen: 13 GB/s against 35 quiet), and every MBU above them
# would read high (over 100%) until the cache is deleted
CALIBRATION_MAX_OTHER_LOAD = 0.25


@dataclass(frozen=True)
class ModelCost:
    """A model's per-token costs, from its config and its weights as stored."""
    weight_bytes: int  # read once per step: matmul weights, lm_head, norms (not the embedding table nor MoE experts)
    matmul_params: int  # per token through the decoder layers
    lm_head_params: int  # per sampled row
    embedding_row_bytes: int  # one embedding row
    kv_bytes_per_token: int  # K and V of one token, every layer (this process's share under tensor parallelism)
    attention_flops_per_pair: int  # FLOPs per (query token, attended token) pair, every layer

    def step(self, query_tokens: list[int], contexts: list[int], sampled: int, expert_bytes: int = 0
             ) -> tuple[int, int]:
        """(bytes read, FLOPs) of one step: sequence i runs query_tokens[i] tokens and attends over contexts[i]
        (its context after the step); expert_bytes: the MoE experts the step touched (weight_bytes has none)."""
        tokens = sum(query_tokens)
        pairs = sum(q * c - q * (q - 1) // 2 for q, c in zip(query_tokens, contexts))  # causal within the chunk
        flops = 2 * self.matmul_params * tokens + 2 * self.lm_head_params * sampled + self.attention_flops_per_pair \
            * pairs
        kv_read = self.kv_bytes_per_token * sum(contexts)
        return self.weight_bytes + expert_bytes + self.embedding_row_bytes * tokens + kv_read, flops


def model_cost(config, weight_bytes: int, kv_dtype: torch.dtype, embedding_bytes_per_value: int,
               tensor_parallel: int = 1) -> ModelCost:
    """config: the model's ModelConfig; weight_bytes: what one step reads of this process's weights as stored (the
    model's own count: packed, quantized or sharded as they are). Parameters per token come from the config."""
    tp = tensor_parallel
    h, hd, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads // tp, max(1, config.num_key_value_heads // tp)
    inter = config.intermediate_size // tp
    attention = h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h
    # an MoE layer's active parameters per token: its router and top-k experts (a ModelConfig without MoE fields:
    # every layer dense)
    is_moe = getattr(config, "is_moe_layer", lambda layer: False)
    moe = config.num_experts * h + config.num_experts_per_tok * 3 * h * config.moe_intermediate_size \
        if getattr(config, "num_experts", 0) else 0
    matmul_params = sum(attention + (moe if is_moe(i) else 3 * h * inter) for i in range(layers))
    elt = torch.finfo(kv_dtype).bits // 8
    return ModelCost(weight_bytes=weight_bytes, matmul_params=matmul_params,
                     lm_head_params=h * config.vocab_size, embedding_row_bytes=h * embedding_bytes_per_value,
                     kv_bytes_per_token=2 * layers * kv_heads * hd * elt,
                     attention_flops_per_pair=4 * layers * heads * hd)


# ---- peaks ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Peaks:
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s
    source: str  # "flags", "calibrated", "cache"

    @property
    def ridge(self) -> float:
        """FLOPs per byte where a step turns from memory- to compute-bound."""
        return self.flops / self.bandwidth


def _cache_path() -> Path:
    return Path(os.environ.get("INFERD_CACHE_DIR") or Path.home() / ".cache" / "inferd") / "peaks.json"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or "cpu": hosts of one name may lend different CPU models."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


# the CPU features that change the peaks: hosts report one model name ("AMD EPYC") for CPUs with and without native
# bf16, and a bf16 peak calibrated where it is emulated (~200 GFLOP/s) read as the peak where it is native (~390)
# made every MFU there read above 100%
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_isa() -> str:
    """The ISA_FLAGS this CPU has, joined by "+" ("" where /proc/cpuinfo is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return "+".join(flag for flag in ISA_FLAGS if flag in flags)
    except OSError:
        pass
    return ""


def device_key(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{cpu_model()}[{cpu_isa()}]-{os.cpu_count()}cores-{torch.get_num_threads()}threads"
    return f"{name}/torch-{torch.__version__}"


class OtherLoad:
    """CPU share taken by other processes (and the hypervisor: steal) while a block of code runs, from /proc/stat
    less this process's own CPU time; share is None where /proc/stat is not there."""

    def __enter__(self):
        self.start, self.share = self._sample(), None
        return self

    def __exit__(self, *exc):
        end = self._sample()
        if self.start is not None and end is not None:
            busy, total, own = (e - s for e, s in zip(end, self.start))
            self.share = max(0.0, busy - own) / max(1e-9, total)

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        tick, t = os.sysconf("SC_CLK_TCK"), os.times()
        return (sum(v[:3]) + sum(v[5:8])) / tick, sum(v[:8]) / tick, t.user + t.system


def peaks(device: torch.device, dtype: torch.dtype, bandwidth: float | None = None,
          flops: float | None = None, recalibrate: bool = False,
          max_other_load: float = CALIBRATION_MAX_OTHER_LOAD) -> Peaks:
    """The flags when both are given; else the cached calibration of this device (bandwidth: one per device;
    FLOP/s: one per device and dtype), else a new one, cached unless other processes took over max_other_load of
    the CPU while it ran (then used for this run only: source "calibrated, busy: not cached"). recalibrate: measure
    again whatever the cache holds."""
    if bandwidth and flops:
        return Peaks(bandwidth, flops, "flags")
    key, path = device_key(device), _cache_path()
    cache = {}
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    entry = cache.setdefault(key, {})
    dtype_name = str(dtype).removeprefix("torch.")
    if recalibrate:
        entry.pop("bandwidth", None)
        entry.pop(f"flops/{dtype_name}", None)
    missing = "bandwidth" not in entry or f"flops/{dtype_name}" not in entry
    with OtherLoad() as load:
        if "bandwidth" not in entry:
            entry["bandwidth"] = measure_bandwidth(device)
        if f"flops/{dtype_name}" not in entry:
            entry[f"flops/{dtype_name}"] = measure_flops(device, dtype)
    busy = missing and device.type == "cpu" and load.share is not None and load.share > max_other_load
    if busy:
        logger.warning("peak calibration ran while other processes took %.0f%% of the CPU: not cached "
                       "(the peaks are too low; MBU/MFU read high this run)", 100 * load.share)
        return Peaks(bandwidth or entry["bandwidth"], flops or entry[f"flops/{dtype_name}"],
                     "calibrated, busy: not cached")
    if missing:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError:
            pass
    return Peaks(bandwidth or entry["bandwidth"], flops or entry[f"flops/{dtype_name}"],
                 "calibrated" if missing else "cache")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 8,
                      inner: int | None = None) -> float:
    """Copy bandwidth, bytes/s, read + write counted (the best of a few timed intervals of `inner` copies each;
    sizes from calibration_sizes(device) unless given)."""
    default_bytes, _, default_inner = calibration_sizes(device)
    nbytes, inner = nbytes or default_bytes, inner or default_inner
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            dst.copy_(src)
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / inner)
    return 2 * nbytes / best


@torch.inference_mode()
def measure_flops(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 3,
                  inner: int | None = None) -> float:
    """Matmul FLOP/s in dtype (the best of a few timed intervals of `inner` n^3 products each; sizes from
    calibration_sizes(device) unless given)."""
    _, default_n, default_inner = calibration_sizes(device)
    n, inner = n or default_n, inner or default_inner
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(inner):
        a @ b  # warm-up (on a GPU: the clocks up)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / inner)
    return 2 * n ** 3 / best
