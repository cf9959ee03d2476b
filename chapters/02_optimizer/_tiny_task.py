"""The tiny training task of chapter 02's last page: a random successor table (not a page)."""

from __future__ import annotations

import torch


def markov_batch(step: int, batch: int, seq: int, vocab: int, seed: int = 0) -> tuple:
    """Tokens from a fixed random successor table (p=0.9) and their next-token labels."""
    table = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch,), generator=g)
    for t in range(seq):
        follow = torch.rand(batch, generator=g) < 0.9
        tokens[:, t + 1] = torch.where(follow, table[tokens[:, t]],
                                       torch.randint(vocab, (batch,), generator=g))
    return tokens[:, :-1], tokens[:, 1:]


def cfg_on_gpu(model: torch.nn.Module) -> bool:
    """True when the model's params live on a CUDA device."""
    return next(model.parameters()).is_cuda
