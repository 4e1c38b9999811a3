"""The embedding engine (`inferd worker --task embed`): requests queued and run together in forward passes of an
embedding model, one vector per input, pooled (and normalized) as the model's sentence-transformers folder says.

Two kinds of model (which one a path is: models/embedding_models.py):
- an encoder (BERT and its family) runs through transformers' own model class, padded (models/encoder.py);
- a decoder that our engine loads (a Llama/Mistral/Qwen2 folder or a GGUF file) runs through our own model and
  paged KV cache (DecoderEmbedder, over ModelRunner): each batch is one varlen prefill pass over every input,
  nothing sampled, and the KV written is dropped after the pass (blocks are taken afresh by the next one). Pooling
  (models/pooling.py): the last token's final hidden state (default) or the mean over the input, normalized by
  default (what vLLM's embed task does), unless the folder's sentence-transformers config or --embed-pooling /
  --embed-normalize say otherwise.

EmbedEngine has
the engine's interface as the worker's step loop sees it (add_request, step, abort, ...): requests wait in its queue,
and a step runs them together (dynamic batching) once the oldest has waited `embed_max_wait_ms` or the waiting ones
fill `embed_max_batch_tokens`; the oldest always runs, so one huge input never starves the rest, and what runs is
sorted by length and split where padding would waste more than a quarter (runner.split_by_length).
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..models.embedding_models import embedding_model_name, is_decoder_model, resolve_embedding_model
from ..models.encoder import EncoderEmbedder
from ..models.pooling import PoolingConfig, pool, resolve_pooling
from .engine import StepStats
from .errors import InvalidRequestError
from .outputs import RequestOutput
from .protocol import EngineInfo, EngineSnapshot, ScheduleHook


class DecoderEmbedder:
    """A decoder model through our own engine's model and paged KV cache: a batch of inputs is one varlen
    prefill pass (no padding, no sampling); the KV it writes is not kept (every pass takes blocks 0.. afresh)."""

    padded = False  # varlen: a batch runs whole, in one pass

    def __init__(self, path: str, dtype: torch.dtype, device: str, pooling: PoolingConfig,
                 max_model_len: int | None, max_batch_tokens: int, max_num_seqs: int, block_size: int):
        from ..models.build import load_model
        from .runner import ModelRunner

        model, config, tokenizer = load_model(path, dtype=dtype, device=device, max_positions=max_model_len)
        self.folder = path
        self.model = model
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = torch.device(device)
        self.pooling = pooling
        self.max_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.dim = config.hidden_size
        self.vocab_size = config.vocab_size
        self.block_size = block_size
        self.max_batch_tokens = max(max_batch_tokens, self.max_len)
        # a pass holds at most max_batch_tokens tokens in at most max_num_seqs inputs: each wastes < 1 block
        num_blocks = -(-self.max_batch_tokens // block_size) + max_num_seqs
        self.runner = ModelRunner(model, config, num_blocks, block_size, dtype, device)

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        from ..models.step_row import StepRow

        # one-token inputs first: the runner takes them as decode rows, which come before the prefill chunks
        order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
        rows, next_block = [], 0
        for i in order:
            n = len(batch[i])
            used = -(-n // self.block_size)
            rows.append(StepRow(batch[i], 0, list(range(next_block, next_block + used)), 0))
            next_block += used
        if next_block > self.runner.kv.shape[3]:
            raise ValueError(f"an embedding pass of {next_block} blocks is over the pool's {self.runner.kv.shape[3]}")
        hidden, _ = self.runner.forward(rows)
        pooled = pool(hidden.float(), [len(batch[i]) for i in order], self.pooling.mode)
        if self.pooling.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        out = torch.empty_like(pooled)
        out[torch.tensor(order, device=pooled.device)] = pooled
        return out.cpu()


@dataclass
class EmbedRequest:
    request_id: str
    token_ids: list[int]
    arrived: float
    arrival_seq: int = 0


class EmbedEngine:
    task = "embed"

    def __init__(self, embedder: EncoderEmbedder, config, max_wait_s: float, max_batch_tokens: int):
        self.embedder = embedder
        self.served_name = embedding_model_name(embedder.folder)
        self.config = config
        self.max_model_len = embedder.max_len
        self.model_config = SimpleNamespace(vocab_size=embedder.vocab_size, eos_token_ids=[],
                                            max_position_embeddings=embedder.max_len)
        self.eos_token_ids = frozenset()
        self.dtype = embedder.dtype
        self.waiting: list[EmbedRequest] = []
        # no KV cache is kept: reported as a pool that is never short
        self.num_kv_blocks = max(1, config.max_num_seqs * -(-self.max_model_len // config.block_size))
        self.requests: dict[str, EmbedRequest] = {}
        self.stats = StepStats()
        self.max_wait_s = max_wait_s
        self.max_batch_tokens = max(max_batch_tokens, self.max_model_len)
        self.num_passes = 0  # model forward passes (a batch may take several: split by length)
        self._arrivals = itertools.count()
        self._pending: list[RequestOutput] = []

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params=None, request_id: str | None = None,
                    num_prompt_tokens: int | None = None) -> str:
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("the input is empty")
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < self.embedder.vocab_size)), None)
        if bad is not None:
            raise InvalidRequestError(f"input token id {bad!r} is outside the vocabulary [0, "
                                      f"{self.embedder.vocab_size})")
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(f"this model's maximum context length is {self.max_model_len} tokens; the "
                                      f"input has {len(ids)}")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = EmbedRequest(request_id, ids, time.monotonic(), next(self._arrivals))
        self.requests[request_id] = req
        self.waiting.append(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        self._pending.append(RequestOutput(request_id, [], finished=True, finish_reason="abort",
                                           num_prompt_tokens=len(req.token_ids)))
        return True

    def take_pending_outputs(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        return out

    def take_failed(self) -> list:
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    # ---- the worker's view (EngineProtocol, protocol.py) -----------------------------------------------------
    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def failed_step_request_ids(self) -> list[str]:
        return [r.request_id for r in self.waiting]

    def on_schedule(self, hook: ScheduleHook | None) -> None:
        """Embedding requests sample nothing (have no seed): the hook is never called."""

    def close(self) -> None:
        pass

    def info(self) -> EngineInfo:
        return EngineInfo(self.max_model_len, self.embedder.vocab_size, self.eos_token_ids, self.num_kv_blocks,
                          self.config.block_size, task=self.task, embedding_dim=self.embedder.dim,
                          served_name=self.served_name)

    def snapshot(self) -> EngineSnapshot:
        _, prefill, decode, nbytes, flops = self.stats.last
        return EngineSnapshot(waiting=len(self.waiting), kv_blocks_free=self.num_kv_blocks,
                              kv_num_blocks=self.num_kv_blocks, num_steps=self.stats.num_steps,
                              busy=self.has_unfinished_requests(), last_prefill_tokens=prefill,
                              last_decode_tokens=decode, last_bytes=nbytes, last_flops=flops)

    # ---- the step -------------------------------------------------------------------------------------------
    def _ready(self) -> bool:
        waiting = self.waiting
        if not waiting:
            return False
        if time.monotonic() - waiting[0].arrived >= self.max_wait_s:
            return True
        return sum(len(r.token_ids) for r in waiting) >= self.max_batch_tokens or \
            len(waiting) >= self.config.max_num_seqs

    def step(self) -> list[RequestOutput]:
        """Runs what has waited long enough (see the module); else sleeps a millisecond (the loop then takes the
        requests that arrived meanwhile) and returns nothing."""
        outputs = self.take_pending_outputs()
        if not self._ready():
            time.sleep(0.001)
            return outputs
        from .runner import split_by_length

        t0 = time.perf_counter()
        waiting = self.waiting
        chosen, tokens = [], 0
        for req in list(waiting):  # oldest first: the oldest always runs
            cost = len(req.token_ids)
            if chosen and (tokens + cost > self.max_batch_tokens or len(chosen) >= self.config.max_num_seqs):
                continue
            chosen.append(req)
            tokens += cost
        for req in chosen:
            waiting.remove(req)
        chosen.sort(key=lambda r: len(r.token_ids))
        # an encoder's cost is rows x width: sorted by length and split where padding would waste over a quarter
        lens = [len(r.token_ids) for r in chosen]
        groups = split_by_length(lens, self.config.block_size) if self.embedder.padded else [(0, len(chosen))]
        for lo, hi in groups:
            group = chosen[lo:hi]
            vectors = self.embedder.embed([r.token_ids for r in group])
            self.num_passes += 1
            self.stats.num_steps += 1  # what heartbeats report: forward passes
            for req, vec in zip(group, vectors):
                self.requests.pop(req.request_id, None)
                outputs.append(RequestOutput(req.request_id, [], finished=True, finish_reason="stop",
                                             num_prompt_tokens=len(req.token_ids), embedding=vec.tolist()))
        seconds = time.perf_counter() - t0
        self.stats.num_tokens += tokens
        self.stats.seconds += seconds
        self.stats.last = (seconds, tokens, 0, 0, 0)
        return outputs

    @classmethod
    def from_config(cls, config, max_wait_s: float, max_batch_tokens: int, pooling: str = "auto",
                    normalize: str = "auto") -> EmbedEngine:
        """ValueError for a pooling the model cannot take."""
        from ..config import resolve_dtype

        dtype = resolve_dtype(config.dtype, config.device)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dtype = torch.float32
        path = resolve_embedding_model(config.model or "default")
        decoder = is_decoder_model(path)
        how = resolve_pooling(path, decoder, pooling, normalize)
        if decoder:
            embedder = DecoderEmbedder(path, dtype, config.device, how, config.max_model_len, max_batch_tokens,
                                       config.max_num_seqs, config.block_size)
        else:
            embedder = EncoderEmbedder(path, dtype, config.device, how)
        return cls(embedder, config, max_wait_s, max_batch_tokens)
