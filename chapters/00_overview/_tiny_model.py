"""The chapter's model: tinytron.model's GPT at tiny size, plus a minimal stand-in LM.

The demos train the book's own GPTModel (appendix B). TinyLM is a second, deliberately plain
model with the same call signature; the tests use it to show that the batch, loss and GRPO code
of this chapter depend only on "tokens [b, s] in, logits [b, s, V] or per-token loss out".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyLM", "build_demo_model", "per_token_cross_entropy"]


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Unreduced fp32 cross entropy [b, s] of logits [b, s, V] against labels [b, s]."""
    b, s, v = logits.shape
    return F.cross_entropy(logits.float().reshape(b * s, v), labels.reshape(-1),
                           reduction="none").view(b, s)


class _Block(nn.Module):
    """Pre-norm attention + MLP block that takes Megatron's bool mask (True = masked)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x, attention_mask):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if attention_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # SDPA's bool mask means "may attend": flip Megatron's polarity
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """GPT-shaped LM with the same call signature as tinytron.model.GPTModel."""

    def __init__(self, vocab_size: int = 262, hidden: int = 32, num_layers: int = 2,
                 heads: int = 2, max_seq: int = 64, seed: int = 1234):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.pos = nn.Embedding(vocab_size, hidden), nn.Embedding(max_seq, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, tokens, position_ids=None, labels=None, attention_mask=None):
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.embed(tokens) + self.pos(position_ids)
        for blk in self.blocks:
            x = blk(x, attention_mask)
        logits = self.head(self.norm(x))
        return logits if labels is None else per_token_cross_entropy(logits, labels)


def build_demo_model(vocab_size: int = 262, seq_length: int = 64, seed: int = 1234, **overrides):
    """The book's GPTModel at tiny_config size (one process); returns (model, name)."""
    from tinytron.model import GPTModel, tiny_config

    config = tiny_config(vocab_size=vocab_size, seq_length=seq_length, seed=seed, **overrides)
    return GPTModel(config), "tinytron.model.GPTModel"
