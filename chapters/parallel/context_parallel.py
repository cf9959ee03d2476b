# %% [markdown]
# # A.4 · Context parallelism: one sequence over several ranks
#
# Long sequences cut along the sequence itself: each of the `cp` ranks holds $s/cp$ tokens of
# every sample through the whole model. Everything except attention is per-token and needs no
# change; attention needs the keys and values of the whole sequence. This page builds the
# load-balanced split, the batch slicing and an attention that is exact under CP.

# %%
from __future__ import annotations

import torch
import torch.nn.functional as F

from tinytron.parallel._comm import all_gather_dim, reduce_scatter_dim
from tinytron.parallel.grid import ParallelGrid

__all__ = ["cp_chunk_ids", "cp_positions", "split_for_context_parallel",
           "slice_batch_for_context_parallel", "restore_sequence_order",
           "gather_from_context_parallel", "gather_kv_for_context_parallel",
           "context_parallel_attention"]

# %% [markdown]
# ## The split: $2\cdot cp$ chunks, zig-zag
#
# With a causal mask, token $i$ attends to $i + 1$ keys, so the last quarter of a sequence does
# far more work than the first. Cutting into $cp$ contiguous pieces would leave rank 0 idle
# most of the time. Megatron cuts into $2\cdot cp$ chunks and gives rank $r$ chunks $r$ and
# $2cp - 1 - r$ — one cheap, one expensive (`get_pretrain_batch_on_this_cp_rank`,
# `megatron/core/utils.py:2308`). For $cp = 2$ and $s = 8$:
#
# | chunk | 0 | 1 | 2 | 3 |
# |---|---|---|---|---|
# | positions | 0 1 | 2 3 | 4 5 | 6 7 |
# | rank | 0 | 1 | 1 | 0 |
#
# rank 0 holds positions $[0, 1, 6, 7]$, rank 1 holds $[2, 3, 4, 5]$. Causal work (keys seen):
# rank 0 $1+2+7+8 = 18$, rank 1 $3+4+5+6 = 18$: balanced. Every per-sample tensor of the batch
# (tokens, labels, loss mask, position ids) is sliced the same way, so RoPE and the loss see
# the real global positions.

# %%
def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) that CP rank `cp_rank` holds: r and 2*cp-1-r."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _check_seq(seq_len: int, cp_size: int) -> int:
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp_size}")
    return seq_len // (2 * cp_size)


def cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the seq_len/cp tokens CP rank `cp_rank` holds, in its local order."""
    chunk = _check_seq(seq_len, cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in cp_chunk_ids(cp_size, cp_rank)])


def split_for_context_parallel(t: torch.Tensor, grid: ParallelGrid, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's two chunks of `t` along `seq_dim`, concatenated (a copy)."""
    cp = grid.size("cp")
    if cp == 1:
        return t
    index = cp_positions(t.shape[seq_dim], cp, grid.rank("cp")).to(t.device)
    return t.index_select(seq_dim, index)


# Per-batch metadata that has no sequence dim (Megatron skips the same keys, `utils.py:2342-2348`).
_CP_METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size")


def slice_batch_for_context_parallel(batch: dict, grid: ParallelGrid) -> dict:
    """Slice every tensor of a [b, s, ...] batch to this CP rank (attention_mask on its query dim 2)."""
    return {key: (val if not torch.is_tensor(val) or key in _CP_METADATA_KEYS else
                  split_for_context_parallel(val, grid, 2 if key == "attention_mask" else 1))
            for key, val in batch.items()}


def restore_sequence_order(t_gathered: torch.Tensor, cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """Undo the zig-zag: a rank-order concatenation of every CP rank's tokens -> natural order."""
    seq_len = t_gathered.shape[seq_dim]
    order = torch.cat([cp_positions(seq_len, cp_size, r) for r in range(cp_size)])
    return t_gathered.index_select(seq_dim, torch.argsort(order).to(t_gathered.device))


def gather_from_context_parallel(t_local: torch.Tensor, grid: ParallelGrid, seq_dim: int = 1) -> torch.Tensor:
    """The full sequence, in natural order, on every CP rank (no autograd; for logging and tests)."""
    with torch.no_grad():
        gathered = all_gather_dim(t_local.detach(), grid, "cp", seq_dim)
    return restore_sequence_order(gathered, grid.size("cp"), seq_dim)

# %% [markdown]
# ## Attention over the whole sequence
#
# Queries stay local; keys and values are all-gathered over the CP group, so each rank attends
# its $s/cp$ queries to all $s$ keys. The causal mask compares **global** positions: query at
# position $p_q$ may see key at $p_k$ iff $p_k \le p_q$. After the gather the keys sit in rank
# order (rank 0's chunks, then rank 1's, ...), so their positions are the concatenation of every
# rank's `cp_positions`. For the example above, rank 0's query at position 6 sees keys
# $\{0, 1, 6\}$ from itself and $\{2, 3, 4, 5\}$ from rank 1.
#
# In backward, every rank produced a gradient for **every** gathered key (from its own
# queries), so the gradient of my $K$ is the sum over ranks of the slices that belong to me: a
# reduce-scatter. That is the autograd function below; the forward communication is
# $2 (cp-1)/cp \cdot s \cdot h_{kv}$ elements per layer (K and V), the backward the same.
#
# This is the `"all_gather"` flavour of Megatron's `cp_comm_type`
# (`megatron/core/transformer/transformer_config.py:891-895`, implemented inside Transformer
# Engine's `DotProductAttention`); the default `"p2p"` passes K/V blocks around a ring and
# overlaps each hop with the attention on the previous block, never holding all of $K$ at once.
#
# ```mermaid
# flowchart LR
#   Q0["rank 0: Q,K,V of chunks 0,3"] -->|all-gather K,V| KV["K,V of chunks 0,3,1,2 on both ranks"]
#   Q1["rank 1: Q,K,V of chunks 1,2"] -->|all-gather K,V| KV
#   KV --> A0["rank 0: softmax(Q0 K^T + mask) V"]
#   KV --> A1["rank 1: softmax(Q1 K^T + mask) V"]
# ```

# %%
class _GatherKV(torch.autograd.Function):
    """All-gather along `dim` over CP forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, grid, dim):
        ctx.grid, ctx.dim = grid, dim
        return all_gather_dim(x, grid, "cp", dim)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim(g, ctx.grid, "cp", ctx.dim), None, None


def gather_kv_for_context_parallel(x: torch.Tensor, grid: ParallelGrid, seq_dim: int = 2) -> torch.Tensor:
    """All CP ranks' K (or V) in rank order; autograd reduce-scatters the gradient back."""
    return _GatherKV.apply(x, grid, seq_dim) if grid.size("cp") > 1 else x


def _causal_cp_mask(s_local: int, grid: ParallelGrid, device) -> torch.Tensor:
    """[s_local, s_full] boolean mask, True where a local query may attend a gathered key."""
    cp, seq_len = grid.size("cp"), s_local * grid.size("cp")
    q_pos = cp_positions(seq_len, cp, grid.rank("cp"))
    k_pos = torch.cat([cp_positions(seq_len, cp, r) for r in range(cp)])
    return (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).to(device)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: ParallelGrid,
                               *, causal: bool = True, scale: float | None = None,
                               dropout_p: float = 0.0) -> torch.Tensor:
    """SDPA over the full sequence for local q,k,v [b, heads, s/cp, d] (zig-zag order); returns [b, hq, s/cp, d]."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[-2] != k.shape[-2]:
        raise ValueError(f"expected q, k, v as [b, heads, s, d] with equal s, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")
    k, v = gather_kv_for_context_parallel(k, grid), gather_kv_for_context_parallel(v, grid)
    if q.shape[1] != k.shape[1]:  # GQA: expand after the gather, so the wire carries kv heads only
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if grid.size("cp") == 1 or not causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p)
    mask = _causal_cp_mask(q.shape[-2], grid, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)

# %% [markdown]
# ## Demo
#
# The split of the worked example, then two CP ranks running attention on a zig-zag-split
# sequence, compared with plain causal attention on the whole sequence: outputs and the
# gradients of $Q$, $K$, $V$.

# %%
if __name__ == "__main__":
    for r in range(2):
        print(f"cp rank {r}: chunks {cp_chunk_ids(2, r)}, positions {cp_positions(8, 2, r).tolist()}")
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    work = [sum(p + 1 for p in cp_positions(8, 2, r).tolist()) for r in range(2)]
    print("causal keys seen per rank:", work)
    assert work == [18, 18]
    tokens = torch.arange(8).unsqueeze(0)
    gathered = torch.cat([tokens[:, cp_positions(8, 2, r)] for r in range(2)], dim=1)
    assert torch.equal(restore_sequence_order(gathered, 2), tokens)

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.parallel._workers import cp_attention_parity

    errors = run_on_ranks(cp_attention_parity, 2)
    print("max |cp - full| (out, dq, dk, dv) per rank:", [f"{e:.1e}" for e in errors])
    assert max(errors) < 1e-5

# %% [markdown]
# ## Summary
#
# - Zig-zag chunks ($r$ and $2cp-1-r$) balance causal work; every per-token tensor of the batch
#   is sliced the same way, so positions stay global.
# - Exact attention under CP only needs all of $K, V$ and a mask built from global positions;
#   the gather's backward is a reduce-scatter.
# - Gradients of weights now come from different tokens on each CP rank: they are reduced over
#   `dp_cp`, not `dp` (chapter 05).
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/utils.py:2308` (zig-zag batch split), `cp_comm_type`
#   (`transformer_config.py:891`), Transformer Engine's `attn_forward_func_with_cp`
#   (ring "p2p", "all_gather", "a2a" i.e. Ulysses, and "a2a+p2p" hierarchies).
# - torchtitan: `context_parallel()` from `torch.distributed.tensor.experimental` with a ring
#   attention over SDPA and round-robin load balancing.
#
# ## Exercises
#
# 1. Compute the causal work per rank for $cp = 4$, $s = 16$ with contiguous chunks and with the
#    zig-zag; what is the speed-up of the slowest rank?
# 2. Replace the all-gather by a ring: pass K/V to the next rank $cp - 1$ times and combine the
#    partial softmaxes with their log-sum-exp.
