"""Small models and rank functions for the buffers chapter's demos and tests (not a page)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TinyNet(torch.nn.Module):
    """Embedding, residual MLP blocks, a weight used twice per forward, norm, output head."""

    def __init__(self, vocab: int = 64, hidden: int = 32, ffn: int = 48, num_layers: int = 3):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.RMSNorm(hidden), torch.nn.Linear(hidden, ffn),
                                torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
            for _ in range(num_layers))
        self.shared = torch.nn.Linear(hidden, hidden, bias=False)  # applied twice: golden counts
        self.final_norm = torch.nn.RMSNorm(hidden)
        self.output = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, vocab] for tokens [b, s]."""
        x = self.embedding(tokens)
        for block in self.blocks:
            x = x + block(x)
        x = x + self.shared(torch.tanh(self.shared(x)))
        return self.output(self.final_norm(x))


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32) of ``model`` on ``tokens``."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def make_batches(seed: int, num_steps: int, world: int, num_micro: int, micro_bs: int,
                 seq: int = 9, vocab: int = 64) -> torch.Tensor:
    """Token ids [step, dp rank, micro-batch, b, s], identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num_steps, world, num_micro, micro_bs, seq), generator=g)
