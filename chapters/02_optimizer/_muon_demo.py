"""Test matrices and logits for chapter 02's Muon page demos (not a page)."""

from __future__ import annotations

import torch

from tinytron.optimizer.muon import attention_max_logits


def _spread_matrix(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """A matrix with singular values log-spaced from 1 to 1e-2."""
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen))
    k = min(rows, cols)
    s = torch.logspace(0, -2, k)
    return u[:, :k] @ torch.diag(s) @ v[:, :k].T


def _qkv_logits(x: torch.Tensor, w: torch.Tensor, groups: int, heads: int, d_head: int):
    """Per-head max logit of a fused-QKV attention on x [b, s, hidden]."""
    y = (x @ w.T).view(x.shape[0], x.shape[1], groups, -1, d_head)
    q = y[:, :, :, : heads // groups].reshape(x.shape[0], x.shape[1], heads, d_head)
    k = y[:, :, :, heads // groups]
    return attention_max_logits(q, k, softmax_scale=d_head ** -0.5)
