"""The encoder embedding model (BERT and its family): transformers' own model class (AutoModel: no rewrite) over
padded rows, pooled as the model's folder says (pooling.py): token ids in, one vector per input out.
"""

from __future__ import annotations

import torch

from .pooling import PoolingConfig, pool_padded, read_pooling


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
        pooled = pool_padded(hidden, mask, self.pooling.mode)
        if self.pooling.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.cpu()
