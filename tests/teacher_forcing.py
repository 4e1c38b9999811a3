"""Teacher-forced comparison of next-token distributions: the logits at every position of a fixed token sequence
(our engine in one prefill, or transformers in one forward), and how close two such [positions, vocab] tensors are
(top-1 agreement, mean and largest KL). Feeding both sides the same tokens keeps one divergence from cascading."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.models.step_row import StepRow


@dataclass
class Agreement:
    top1: float  # fraction of positions whose argmax is the same
    mean_kl: float  # KL(p_ref || p_other) in nats, averaged over the positions
    max_kl: float  # and its largest value at one position
    positions: int

    def __str__(self) -> str:
        return (f"{self.positions} positions: top-1 agreement {self.top1:.4f}, KL mean {self.mean_kl:.3g} "
                f"max {self.max_kl:.3g} nats")


def agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> Agreement:
    """ref_logits and logits: [positions, vocab]. In float64: near-flat distributions over a 49k vocabulary have KLs
    of ~1e-7, below float32's rounding of the sum."""
    ref, other = ref_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    kl = (ref.exp() * (ref - other)).sum(-1)
    top1 = (ref.argmax(-1) == other.argmax(-1)).float().mean().item()
    return Agreement(top1, kl.mean().item(), kl.max().item(), len(kl))


def teacher_forced_logits(engine, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Float32 logits at every position of ids through the engine's runner and KV cache (an idle engine of its own:
    its blocks are free to write): in one prefill, or chunk tokens at a time (every chunk after the first then
    attends to its context as read back from the cache)."""
    blocks = list(range(-(-len(ids) // engine.config.block_size)))
    chunk = chunk or len(ids)
    out = []
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            hidden, _ = engine.runner.forward([StepRow(ids[s:s + chunk], s, blocks, True)])
            out.append(engine.runner.model.compute_logits(hidden))
    return torch.cat(out)


def hf_teacher_forced_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits at every position of ids, in one forward (no cache)."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids]), use_cache=False).logits[0].float()
