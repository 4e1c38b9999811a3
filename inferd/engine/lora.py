"""The engine's LoRA adapters (`--enable-lora`): which adapters a worker holds, and where.

Two levels, as S-LoRA pages adapters:
- **host**: adapters read from disk (checked against the base model: models/lora_format.py), kept in host memory,
  at most max_cpu_loras of them, least recently used dropped first (read again from disk when asked for again).
  The worker reads an adapter here when a request for it arrives, on its connection's thread, never on the step
  thread (`prepare`).
- **slots**: max_loras adapters live in the model's stacked buffers (models/lora.py), the ones a step can run. A
  waiting request whose adapter has no slot gets one when the scheduler admits it (`acquire`, the scheduler's
  admission gate): a free slot, or the least recently used slot that no running request holds (its adapter stays
  on the host). When every slot is held by running requests the request waits, and the others go on; a slot frees
  when its last request finishes, so a request never waits for a slot that cannot come.

A request names its adapter in SamplingParams.lora as [name, path, digest] (the gateway checked it; the digest is
the adapter's identity, so a name loaded again with other weights is another adapter).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..models import lora as model_lora
from ..models.lora_format import MODULES, AdapterError, AdapterSpec, read_adapter
from .errors import InvalidRequestError

# our fused projections and their parts, by PEFT module name; PEFT's fused names (Phi-3) cover every part
_PARTS: dict[str, tuple[str, tuple[int, ...]]] = {
    **{m: (proj, (part,)) for m, (proj, part) in model_lora.TARGETS.items()},
    "qkv_proj": ("qkv_proj", (0, 1, 2)), "gate_up_proj": ("gate_up_proj", (0, 1)),
}
assert set(_PARTS) == set(MODULES)


@dataclass(frozen=True)
class AdapterRef:
    name: str
    path: str
    digest: str

    @classmethod
    def from_params(cls, value) -> AdapterRef:
        if (not isinstance(value, (list, tuple)) or len(value) != 3
                or not all(isinstance(v, str) and 0 < len(v) <= 4096 for v in value)):
            raise InvalidRequestError("lora must be [name, path, digest]")
        return cls(*value)

    @property
    def key(self) -> tuple[str, str]:
        return self.name, self.digest


@dataclass
class HostAdapter:
    spec: AdapterSpec
    # (layer, our projection) -> part -> (A [r, in], B [out_p, r]) in the model's dtype, on the host
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]


class LoraManager:
    def __init__(self, model: torch.nn.Module, model_config, max_loras: int, max_rank: int, max_cpu_loras: int,
                 max_bytes: int, root: str | None, dtype: torch.dtype, device: str | torch.device, add):
        if max_loras < 1 or max_rank < 1 or max_cpu_loras < max_loras:
            raise ValueError(f"--max-loras ({max_loras}) and --max-lora-rank ({max_rank}) must be at least 1, and "
                             f"--max-cpu-loras ({max_cpu_loras}) at least --max-loras")
        self.model_config, self.max_rank, self.max_bytes, self.root = model_config, max_rank, max_bytes, root
        self.dtype, self.device = dtype, torch.device(device)
        self.state = model_lora.attach(model, max_loras, max_rank, add, dtype, self.device)
        self.model = model
        self.max_cpu_loras = max_cpu_loras
        self._host: OrderedDict[tuple[str, str], HostAdapter] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # the host dict: connection threads prepare, the step thread acquires
        self.slot_keys: list[tuple[str, str] | None] = [None] * max_loras
        self._slot_used = [0] * max_loras  # the step each slot last ran in (LRU among the unheld)
        self._tick = 0
        self.loads = 0  # adapters written into a slot
        self.evictions = 0  # adapters a slot dropped for another
        self.disk_reads = 0  # adapters read from disk into host memory

    # ---- host ---------------------------------------------------------------------------------------------------
    def prepare(self, ref: AdapterRef) -> None:
        """The adapter in host memory, read from disk when it is not (any thread but the step's ideally);
        AdapterError when it cannot be served."""
        with self._lock:
            if ref.key in self._host:
                self._host.move_to_end(ref.key)
                return
        adapter = self._read(ref)
        with self._lock:
            self._host[ref.key] = adapter
            self._host.move_to_end(ref.key)
            self.disk_reads += 1
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)

    def _read(self, ref: AdapterRef) -> HostAdapter:
        from safetensors.torch import load_file

        from ..models.lora_format import WEIGHTS_FILE, parse_key

        spec = read_adapter(ref.path, self.model_config, self.max_rank, self.max_bytes, self.root)
        tensors = load_file(f"{spec.path}/{WEIGHTS_FILE}")
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            parsed = parse_key(key)
            assert parsed is not None  # read_adapter checked every name
            layer, module, which = parsed
            pairs.setdefault((layer, module), {})[which] = t.to(self.dtype)
        parts = model_lora.lora_parts(self.model)
        weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), ab in pairs.items():
            proj, covered = _PARTS[module]
            if proj not in model_lora.projections(self.model, layer):
                raise AdapterError("adapter_shape_mismatch", f"layer {layer} has no {module} this engine adapts "
                                                             "(a mixture-of-experts layer)")
            a, b = ab["A"], ab["B"]
            entry = weights.setdefault((layer, proj), {})
            offsets = [sum(parts[proj][:p]) for p in covered]
            for p, off in zip(covered, offsets):  # a fused PEFT module shares its A, its B is split by part
                lo = off - offsets[0]
                entry[p] = (a, b[lo:lo + parts[proj][p]])
        return HostAdapter(spec, weights)

    def unavailable(self, waiting) -> list[tuple[object, str]]:
        """The waiting requests whose adapter is in no slot and cannot be read into host memory (its files gone
        since the gateway checked them), with why: they end with an error rather than wait for an adapter that is
        never coming. Reads from disk the adapters of the others that were dropped from host memory."""
        out = []
        for req in waiting:
            value = req.params.lora
            if value is None:
                continue
            ref = AdapterRef.from_params(value)
            if ref.key in self.slot_keys:
                continue
            try:
                self.prepare(ref)
            except AdapterError as e:
                out.append((req, f"LoRA adapter {ref.name}: {e}"))
        return out

    # ---- slots (the step thread) --------------------------------------------------------------------------------
    def acquire(self, req, running) -> bool:
        """The scheduler's admission gate: True when req may run now (its adapter in a slot: req.lora_slot),
        False when every slot is held by running requests of other adapters (it waits)."""
        value = req.params.lora
        if value is None:
            req.lora_slot = -1
            return True
        ref = AdapterRef.from_params(value)
        if ref.key in self.slot_keys:
            req.lora_slot = self.slot_keys.index(ref.key)
            return True
        held = {r.lora_slot for r in running if r.params.lora is not None}
        free = [s for s, k in enumerate(self.slot_keys) if k is None]
        if not free:
            free = sorted((s for s in range(len(self.slot_keys)) if s not in held), key=lambda s: self._slot_used[s])
        if not free:
            return False
        slot = free[0]
        try:
            self.prepare(ref)  # normally there already (unavailable() ran this step); else from disk, now
        except AdapterError:
            return False  # gone since: the next step's unavailable() ends the request
        with self._lock:
            adapter = self._host[ref.key]
        if self.slot_keys[slot] is not None:
            self.evictions += 1
        self._write(slot, adapter)
        self.slot_keys[slot] = ref.key
        self.loads += 1
        req.lora_slot = slot
        return True

    def _write(self, slot: int, adapter: HostAdapter) -> None:
        r = adapter.spec.rank
        for layer in range(len(self.model.layers)):
            for proj, linear in model_lora.projections(self.model, layer).items():
                weights = adapter.weights.get((layer, proj))
                if weights is None:
                    linear.lora.clear(slot)
                else:
                    linear.lora.write(slot, r, weights, adapter.spec.scale)
        self.state.ranks[slot] = r

    def begin_step(self, requests: list, rows_per_request: list[int]) -> None:
        """Group the step's rows by slot (rows in scheduled order: each request's rows together)."""
        self._tick += 1
        row_slots: list[int] = []
        for req, n in zip(requests, rows_per_request):
            slot = req.lora_slot if req.params.lora is not None else -1
            if slot >= 0:
                self._slot_used[slot] = self._tick
            row_slots += [slot] * n
        self.state.begin_step(row_slots, self.device)

    def end_step(self) -> None:
        self.state.end_step()

    def loaded(self) -> list[str]:
        """The names of the adapters in a slot."""
        return sorted({k[0] for k in self.slot_keys if k is not None})

    def held(self) -> list[str]:
        """The names of the adapters this worker holds (host memory: a request for them starts without a disk
        read): what the router prefers a worker by."""
        with self._lock:
            return sorted({k[0] for k in self._host})
