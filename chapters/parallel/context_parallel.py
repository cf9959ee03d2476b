# %% [markdown]
# # A.4 · Context parallelism: one sequence over several ranks
#
# Long sequences cut along the sequence itself: each of the `cp` ranks holds $s/cp$ tokens of
# every sample through the whole model. Everything except attention is per-token and needs no
# change; attention needs the keys and values of the whole sequence. This page builds the
# load-balanced split, the batch slicing and an attention that is exact under CP.

# %%
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tinytron.parallel._checks import check_qkv, check_seq_for_cp
from tinytron.parallel._comm import all_gather_dim, reduce_scatter_dim
from tinytron.parallel.grid import ParallelGrid

__all__ = ["cp_chunk_ids", "cp_positions", "split_for_context_parallel",
           "slice_batch_for_context_parallel", "restore_sequence_order",
           "gather_from_context_parallel", "gather_kv_for_context_parallel",
           "context_parallel_attention", "ring_attention"]

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
#
# The functions below are that table as code: `cp_chunk_ids` names the two chunks,
# `cp_positions` lists their global positions (the sequence length must divide into $2cp$
# chunks; that check and the shape checks of the attention live in
# `tinytron.parallel._checks`, with the same messages), and the slicing helpers apply the
# positions to every tensor of a batch. `restore_sequence_order` is the inverse permutation,
# used to show a CP run's per-token results in natural order.

# %%
def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) that CP rank `cp_rank` holds: r and 2*cp-1-r."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the seq_len/cp tokens CP rank `cp_rank` holds, in its local order."""
    chunk = check_seq_for_cp(seq_len, cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in cp_chunk_ids(cp_size, cp_rank)])


# %% [markdown]
# With the positions known, a rank cuts its share out of any tensor along the sequence, and out of
# a whole batch at once: every tensor with a sequence dim, not the metadata.

# %%
def split_for_context_parallel(t: torch.Tensor, grid: ParallelGrid, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's two chunks of `t` along `seq_dim`, concatenated (a copy)."""
    cp = grid.size("cp")
    if cp == 1:
        return t
    index = cp_positions(t.shape[seq_dim], cp, grid.rank("cp")).to(t.device)
    return t.index_select(seq_dim, index)


# Per-batch metadata that has no sequence dim (Megatron skips the same keys, `utils.py:2340-2346`).
_CP_METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size")


def slice_batch_for_context_parallel(batch: dict, grid: ParallelGrid) -> dict:
    """Slice every tensor of a [b, s, ...] batch to this CP rank (attention_mask on its query dim 2)."""
    return {key: (val if not torch.is_tensor(val) or key in _CP_METADATA_KEYS else
                  split_for_context_parallel(val, grid, 2 if key == "attention_mask" else 1))
            for key, val in batch.items()}


# %% [markdown]
# The way back, for logging and tests: the inverse permutation, and an all-gather that returns the
# whole sequence in natural order.

# %%
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
# The cost in small numbers: $cp = 2$, $s = 8$, two kv heads of width 4 ($h_{kv} = 8$). Each
# rank holds 4 tokens, so it sends $4 \cdot 8 = 32$ elements of $K$ and 32 of $V$ and receives
# as many: $2 \cdot (cp - 1)/cp \cdot s \cdot h_{kv} = 2 \cdot \tfrac12 \cdot 8 \cdot 8 = 64$
# elements per layer, as the formula says. GQA is why the gather happens before the heads are
# repeated: with 8 query heads over 2 kv heads, repeating first would put four times as much
# on the wire.
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
    check_qkv(q, k, v)
    k, v = gather_kv_for_context_parallel(k, grid), gather_kv_for_context_parallel(v, grid)
    if q.shape[1] != k.shape[1]:  # GQA: expand after the gather, so the wire carries kv heads only
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if grid.size("cp") == 1 or not causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p)
    mask = _causal_cp_mask(q.shape[-2], grid, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)

# %% [markdown]
# <details><summary>Megatron detail: the zig-zag in the kernel</summary>
#
# <p>Megatron hands CP attention to Transformer Engine, which builds the zig-zag mask inside its
# kernel (<code>cp_comm_type</code>, <code>transformer_config.py:891-895</code>). tinytron runs
# PyTorch's SDPA on the gathered keys with an explicit boolean mask of global positions, so the
# page can show the mask; it holds all of $K, V$ at once, which the default <code>"p2p"</code>
# ring avoids (next section).</p>
#
# </details>

# %% [markdown]
# ## The ring variant
#
# The all-gather holds all of $K, V$ on every rank at once. A **ring** never does: in step
# $i = 0, \dots, cp-1$ each rank attends its queries to the K/V block that started on rank
# $(r - i) \bmod cp$, then passes that block to the next rank and receives one from the previous
# (Megatron's default `cp_comm_type="p2p"`; production overlaps each hop with the next block's
# math). Softmax over the whole row is rebuilt from per-block pieces with the log-sum-exp: for
# block outputs $o_a, o_b$ with row log-sum-exps $\ell_a, \ell_b$,
#
# $$\ell = \log(e^{\ell_a} + e^{\ell_b}), \qquad o = e^{\ell_a - \ell} o_a + e^{\ell_b - \ell} o_b .$$
#
# The shift is an autograd function: forward sends to the next rank, backward sends the gradient
# back to the previous one, so autograd alone produces the K/V gradients (every block's gradient
# travels back around the ring to its owner). This teaching version keeps every step's scores
# for backward; real kernels (FlashAttention with a ring) recompute them.

# %%
class _RingShift(torch.autograd.Function):
    """Forward: send to the next CP rank, receive from the previous. Backward: the reverse."""

    @staticmethod
    def _exchange(x, grid, to_next: bool):
        ranks, me = grid.ranks("cp"), grid.rank("cp")
        dst, src = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
        if not to_next:
            dst, src = src, dst
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ops = [dist.P2POp(dist.isend, x, dst, grid.group("cp")),
               dist.P2POp(dist.irecv, out, src, grid.group("cp"))]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return out

    @staticmethod
    def forward(ctx, x, grid):
        ctx.grid = grid
        return _RingShift._exchange(x, grid, True)

    @staticmethod
    def backward(ctx, g):
        return _RingShift._exchange(g, ctx.grid, False), None


# %% [markdown]
# Each ring step attends the local queries to one K/V block with a mask built from global
# positions, and returns the block's output and log-sum-exp; `ring_attention` merges them step by
# step with the formula above.

# %%
def _block_attention(q, k, v, q_pos, k_pos, scale):
    """Attention of q to one K/V block with a global-position causal mask; returns (out, lse)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    # A large finite negative instead of -inf: a row that sees nothing in this block gets a finite
    # lse about 1e30 below the real one, so its weight exp(lse_b - lse) underflows to exactly 0.
    scores = scores.masked_fill(k_pos.unsqueeze(0) > q_pos.unsqueeze(1), -1e30)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: ParallelGrid,
                   *, scale: float | None = None) -> torch.Tensor:
    """Causal attention under CP by passing K/V blocks around the ring; same contract as context_parallel_attention."""
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cp, me, s_local = grid.size("cp"), grid.rank("cp"), q.shape[-2]
    seq_len, scale = s_local * cp, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q_pos = cp_positions(seq_len, cp, me).to(q.device)
    out, lse = None, None
    for step in range(cp):
        k_pos = cp_positions(seq_len, cp, (me - step) % cp).to(q.device)
        o_b, l_b = _block_attention(q, k, v, q_pos, k_pos, scale)
        if out is None:
            out, lse = o_b, l_b  # step 0 is my own block: every row sees at least its diagonal
        else:
            new_lse = torch.logaddexp(lse, l_b)
            out = torch.exp(lse - new_lse) * out + torch.exp(l_b - new_lse) * o_b
            lse = new_lse
        if step < cp - 1:
            k, v = _RingShift.apply(k, grid), _RingShift.apply(v, grid)
    return out.to(q.dtype)

# %% [markdown]
# ## Demo
#
# The split of the worked example and the causal work per rank for $cp = 4$, $s = 64$ with
# contiguous and with zig-zag chunks; then two CP ranks running both attentions on a
# zig-zag-split sequence, compared with plain causal attention on the whole sequence: outputs
# and the gradients of $Q$, $K$, $V$.

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
    import matplotlib.pyplot as plt

    cp, seq = 4, 64
    zigzag = [int((cp_positions(seq, cp, r) + 1).sum()) for r in range(cp)]
    contiguous = [sum(range(r * seq // cp + 1, (r + 1) * seq // cp + 1)) for r in range(cp)]
    fig, ax = plt.subplots(figsize=(6, 3))
    width = 0.38
    ax.bar([r - width / 2 for r in range(cp)], contiguous, width, label="contiguous chunks")
    ax.bar([r + width / 2 for r in range(cp)], zigzag, width, label="zig-zag (r, 2cp-1-r)")
    ax.set_xlabel("CP rank"), ax.set_ylabel("query-key pairs (causal)")
    ax.set_title(f"Causal attention work per rank, cp={cp}, s={seq}")
    ax.set_xticks(range(cp)), ax.legend()
    plt.show()
    print("contiguous:", contiguous, " zig-zag:", zigzag)
    assert len(set(zigzag)) == 1 and max(contiguous) / min(contiguous) > 5

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.parallel._workers import cp_attention_parity

    errors = run_on_ranks(cp_attention_parity, 2)  # per rank: [all-gather, ring]
    for i, name in enumerate(("all-gather", "ring")):
        print(f"{name:>10}: max |cp - full| (out, dq, dk, dv) per rank:", [f"{e[i]:.1e}" for e in errors])
    assert max(max(e) for e in errors) < 1e-5

# %% [markdown]
# ## Summary
#
# - Zig-zag chunks ($r$ and $2cp-1-r$) balance causal work; every per-token tensor of the batch
#   is sliced the same way, so positions stay global.
# - Exact attention under CP only needs all of $K, V$ and a mask built from global positions;
#   the gather's backward is a reduce-scatter. The ring gets the same result holding one block
#   at a time, merging blocks with their log-sum-exp.
# - Gradients of weights now come from different tokens on each CP rank: they are reduced over
#   `dp_cp`, not `dp` ([chapter 05](../05_buffers/bucket_group.py)).
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/utils.py:2308` (zig-zag batch split), `cp_comm_type`
#   (`transformer_config.py:891`), Transformer Engine's `attn_forward_func_with_cp`
#   (ring "p2p", "all_gather", "a2a" i.e. Ulysses, and "a2a+p2p" hierarchies). *Ulysses*
#   (DeepSpeed-Ulysses) swaps which dimension is split: an all-to-all turns "my chunk of the
#   sequence, all heads" into "the whole sequence, my share of the heads", attention runs
#   unsplit per head, and a second all-to-all turns the result back.
# - torchtitan: `context_parallel()` from `torch.distributed.tensor.experimental` with a ring
#   attention over SDPA and round-robin load balancing.
#
# ## Exercises
#
# 1. Compute the causal work per rank for $cp = 4$, $s = 16$ with contiguous chunks and with the
#    zig-zag; what is the speed-up of the slowest rank?
#
#    <details><summary>Answer</summary>
#
#    Count the (query, key) pairs with key $\le$ query.
#    Contiguous chunks of 4 give ranks 0 to 3 $1+2+3+4 = 10$, 26, 42 and 58 pairs. With the
#    zig-zag, rank $r$ holds chunks $r$ and $7 - r$ of 2 tokens, and chunk $c$ has $4c + 3$ pairs,
#    so every rank gets $4r + 3 + 4(7-r) + 3 = 34$. The slowest rank goes from 58 to 34:
#    $58/34 = 1.71\times$ faster, and all 136 pairs are spread evenly.
#
#    </details>
#
# 2. `ring_attention` sends K and V as two messages per hop; stack them into one and measure
#    the difference on 4 ranks.
#
#    <details><summary>Hint</summary>
#
#    <code>torch.stack([k, v])</code> before
#    <code>_RingShift.apply</code> and unbind after: one <code>batch_isend_irecv</code> pair per
#    hop instead of two, so $cp - 1$ fewer message latencies per direction, the same bytes. On
#    gloo and small blocks the latency dominates; time <code>ring_attention</code> over many calls
#    on 4 processes with <code>run_on_ranks</code>.
#
#    </details>
#
# 3. Show that with the zig-zag layout every off-diagonal ring step is exactly half visible (no
#    step can be skipped), then count the steps rank 0 could skip at $cp = 4$ with contiguous
#    chunks.
#
#    <details><summary>Answer</summary>
#
#    In the zig-zag each rank holds one early chunk $r$ and one
#    late chunk $2cp-1-r$. Against another rank's block, of the four (query chunk, key chunk)
#    pairs two lie wholly in the past and two wholly in the future, so exactly half the pairs are
#    visible: at $s = 64$, $cp = 4$, every off-diagonal step sees 0.5 of its scores (the own block
#    0.53), and none can be skipped. With contiguous chunks rank 0 holds the first quarter: the
#    blocks of ranks 1, 2 and 3 are all in its future, so it could skip all 3 of its off-diagonal
#    steps.
#
#    </details>
