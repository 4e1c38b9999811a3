"""The LoRA adapters this server serves (`--enable-lora`): loaded at start (`--lora-modules NAME=PATH`) or at run
time (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`: routes/lora.py), each checked against the base model
before it is listed (models/lora_format.py, off the event loop: it reads the adapter's files). A request names an
adapter as its `model`; its worker reads the adapter from the path on first use (engine/lora.py), so a worker that
joins later, or a replay on a survivor, needs nothing from here but the request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ..config import MAX_SERVED_LORAS
from ..models.config import ModelConfig
from ..models.lora_format import AdapterError, AdapterSpec, check_name, read_adapter


@dataclass(frozen=True)
class LoraOptions:
    modules: tuple[tuple[str, str], ...] = ()  # --lora-modules NAME=PATH
    max_rank: int = 16
    max_bytes: int = 512 << 20
    root: str | None = None


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    spec: AdapterSpec
    created: int

    @property
    def params_value(self) -> list[str]:
        """What a request's SamplingParams.lora carries to the worker."""
        return [self.name, self.spec.path, self.spec.digest]


class LoraCatalog:
    def __init__(self, config: ModelConfig, options: LoraOptions, reserved: set[str]):
        self.config, self.options = config, options
        self.reserved = reserved  # the base model's and the embedding models' names
        self._adapters: dict[str, ServedAdapter] = {}
        self._loading: set[str] = set()

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def get(self, name: str) -> ServedAdapter | None:
        return self._adapters.get(name)

    def adapters(self) -> list[ServedAdapter]:
        return list(self._adapters.values())

    async def load(self, name: object, path: object) -> ServedAdapter:
        """Check and list an adapter; AdapterError (a 400 with its code) when it cannot be served."""
        name = check_name(name)
        if name in self.reserved:
            raise AdapterError("adapter_invalid", f"`{name}` is the name of a model this server serves")
        if name in self._adapters or name in self._loading:
            raise AdapterError("adapter_already_loaded", f"an adapter named `{name}` is already loaded: unload it "
                                                         "first")
        if len(self._adapters) + len(self._loading) >= MAX_SERVED_LORAS:
            raise AdapterError("too_many_adapters", f"this server serves at most {MAX_SERVED_LORAS} adapters")
        o = self.options
        self._loading.add(name)
        try:
            spec = await asyncio.to_thread(read_adapter, path, self.config, o.max_rank, o.max_bytes, o.root)
        finally:
            self._loading.discard(name)
        adapter = ServedAdapter(name, spec, int(time.time()))
        self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> bool:
        """False when no adapter has that name. Requests already running with it run to their end."""
        return self._adapters.pop(name, None) is not None
