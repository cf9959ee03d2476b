"""An independent reference for the benchmarks: a Llama-style decoder and its training step in
plain PyTorch, written with torch modules only and importing nothing from tinytron.

What the benchmarks hold tinytron against, so that whatever the model costs does not cancel
out of the ratio (a loop that runs tinytron's own GPTModel cancels it). The shape and the init
scheme are tinytron's: pre-norm layers of GQA attention and a SwiGLU MLP, rotate-half RoPE,
tied input/output embedding, every matrix drawn from N(0, init_std), the two matrices that
write into the residual stream (attention output, MLP down) from N(0, init_std / sqrt(2 L)),
norm weights ones. The code is the plain way to write it: separate q/k/v and gate/up/down
linears, batch-first activations, cos/sin tables built once at construction,
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``, ``F.cross_entropy``,
``AdamW(foreach=True)`` and ``clip_grad_norm_(foreach=True)``.

The data side is plain as well: ``TokenWindows`` reads consecutive (seq + 1)-token windows
straight out of a Megatron ``.bin`` token file with ``numpy.memmap`` (the dtype code read from
the ``.idx`` header: magic ``MMIDIDX\\x00\\x00``, version, dtype code; Megatron's
``megatron/core/datasets/indexed_dataset.py`` ``DType``).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PlainLlama", "PlainTrainer", "TokenWindows"]


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, h: int, heads: int, groups: int):
        super().__init__()
        self.heads, self.groups, self.d = heads, groups, h // heads
        self.wq = nn.Linear(h, heads * self.d, bias=False)
        self.wk = nn.Linear(h, groups * self.d, bias=False)
        self.wv = nn.Linear(h, groups * self.d, bias=False)
        self.wo = nn.Linear(heads * self.d, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.d).transpose(1, 2)   # [b, n, s, d]
        k = self.wk(x).view(b, s, self.groups, self.d).transpose(1, 2)
        v = self.wv(x).view(b, s, self.groups, self.d).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.heads * self.d))


class _SwiGLU(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.w_gate = nn.Linear(h, f, bias=False)
        self.w_up = nn.Linear(h, f, bias=False)
        self.w_down = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class _Block(nn.Module):
    def __init__(self, h, heads, groups, f, eps):
        super().__init__()
        self.attn_norm, self.attn = _RMSNorm(h, eps), _Attention(h, heads, groups)
        self.mlp_norm, self.mlp = _RMSNorm(h, eps), _SwiGLU(h, f)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class PlainLlama(nn.Module):
    """tokens [b, s] -> logits [b, s, V]; tied embedding; RoPE tables for seq_length positions."""

    def __init__(self, hidden_size: int, num_layers: int, num_attention_heads: int,
                 num_query_groups: int, ffn_hidden_size: int, vocab_size: int, seq_length: int,
                 rotary_base: float = 10000.0, norm_epsilon: float = 1e-5,
                 init_std: float = 0.02):
        super().__init__()
        h, d = hidden_size, hidden_size // num_attention_heads
        self.tok = nn.Embedding(vocab_size, h)
        self.blocks = nn.ModuleList(
            _Block(h, num_attention_heads, num_query_groups, ffn_hidden_size, norm_epsilon)
            for _ in range(num_layers))
        self.norm = _RMSNorm(h, norm_epsilon)
        inv_freq = 1.0 / rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(seq_length, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)                     # [s, d]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        out_std = init_std / math.sqrt(2 * num_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, out_std if name.endswith(("wo.weight", "w_down.weight"))
                              else init_std)

    def forward(self, tokens):
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(self.norm(x), self.tok.weight)


class PlainTrainer:
    """One optimizer step = m micro-batches of (logits, token-mean CE, backward), clip, AdamW."""

    def __init__(self, model: nn.Module, lr: float, weight_decay: float, clip: float,
                 ddp: bool = False):
        self.params = list(model.parameters())
        self.model = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, foreach=True)
        self.clip, self.ddp = clip, ddp

    def step(self, micro_batches) -> torch.Tensor:
        """The step's loss (token mean over all micro-batches), a 0-d tensor, not synchronized."""
        import contextlib

        self.opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(())
        m = len(micro_batches)
        for j, (tokens, labels) in enumerate(micro_batches):
            sync = (self.model.no_sync() if self.ddp and j < m - 1 else contextlib.nullcontext())
            with sync:
                logits = self.model(tokens)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       labels.reshape(-1))
                (loss / m).backward()
            loss_sum = loss_sum + loss.detach()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.opt.step()
        return loss_sum / m


_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}


class TokenWindows:
    """Consecutive (seq + 1)-token windows of a Megatron .bin/.idx pair, read by numpy.memmap."""

    def __init__(self, prefix: str, seq_length: int):
        with open(prefix + ".idx", "rb") as f:
            header = f.read(9 + 8 + 1)
        if header[:9] != b"MMIDIDX\x00\x00":
            raise ValueError(f"{prefix}.idx is not a Megatron index file")
        code = struct.unpack("<B", header[17:18])[0]
        self.tokens = np.memmap(prefix + ".bin", dtype=_DTYPES[code], mode="r")
        self.seq = seq_length
        self.windows = (len(self.tokens) - 1) // seq_length
        self.next_window = 0

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, labels [rows, seq] (int64) of the next `rows` windows, wrapping around."""
        out = np.empty((rows, self.seq + 1), dtype=np.int64)
        for r in range(rows):
            w = self.next_window % self.windows
            out[r] = self.tokens[w * self.seq: w * self.seq + self.seq + 1]
            self.next_window += 1
        t = torch.from_numpy(out)
        return t[:, :-1], t[:, 1:]
