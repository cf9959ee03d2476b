# %% [markdown]
# # C.3 · Kernels: cross-entropy without fp32 logits
#
# The logits are the largest activation of the step: $[s b, V/t]$ on the last pipeline stage,
# 1.05 GB of bf16 per micro-batch in the running example. Appendix A's vocab-parallel loss first
# makes an fp32 copy (2.1 GB), then keeps an fp32 softmax of the same size for the backward.
# This page computes the same loss reading the bf16 logits in vocabulary chunks with an
# *online* log-sum-exp, keeps only one fp32 number per token for the backward, and plugs into
# appendix A's tensor-parallel all-reduces.
#
# You will build: `cross_entropy` and `vocab_parallel_cross_entropy` (Triton, forward and
# backward) beside appendix A's `vocab_parallel_cross_entropy` (the reference), and
# `cross_entropy_bytes`.

# %%
from __future__ import annotations

import torch
import torch.distributed as dist

from tinytron.kernels._triton import (INTERPRET, check_tensor, round_to, row_warps,
                                      rows_per_program, tl, triton)
from tinytron.parallel import ParallelGrid
from tinytron.parallel import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy_reference
from tinytron.parallel._comm import all_reduce

__all__ = ["cross_entropy", "vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_reference",
           "cross_entropy_bytes", "cross_entropy_saved_bytes"]

# %% [markdown]
# ## Log-sum-exp, one chunk at a time
#
# The loss of a token is $\ell = \mathrm{lse}(z) - z_y$ with
# $\mathrm{lse}(z) = m + \log \sum_j e^{z_j - m}$ and $m = \max_j z_j$ for stability. Computed
# naively that is two passes over the row: one for $m$, one for the sum. The online form keeps
# a running maximum $m$ and a running sum $S$ *relative to it*; a new chunk $c$ with maximum
# $m_c$ updates
#
# $$m' = \max(m, m_c), \qquad S' = S\,e^{m - m'} + \sum_{j \in c} e^{z_j - m'},$$
#
# so one pass over the row suffices, and a chunk of the row is all a program ever holds.
#
# Worked example, appendix A's row $z = [1, 2, 3, 0]$ in chunks of two, target 2. Chunk 1:
# $m = 2$, $S = e^{-1} + e^{0} = 1.368$. Chunk 2: $m' = 3$,
# $S' = 1.368\,e^{-1} + e^{0} + e^{-3} = 0.503 + 1 + 0.050 = 1.553$. So
# $\mathrm{lse} = 3 + \log 1.553 = 3.440$ and $\ell = 3.440 - z_2 = 0.440$, appendix A's number.
#
# ## The same merge across TP ranks
#
# Chunks of a row that live on *different* TP ranks merge by the same rule. Each rank runs the
# kernel over its $V/t$ columns and returns three numbers per token: its maximum $m_r$, its sum
# $S_r$ relative to $m_r$, and the target logit if it owns the target (else 0). Then
#
# 1. all-reduce MAX of $m_r$ → $M$;
# 2. all-reduce SUM of $[S_r e^{m_r - M},\; z_y - M \text{ (owner only)}]$ → $S$, $z_y - M$;
# 3. $\ell = \log S - (z_y - M)$, and $\mathrm{lse} = M + \log S$ is kept for the backward.
#
# These are appendix A's collectives on the TP group (`dist.all_reduce` with MAX, then its
# `all_reduce` SUM helper), with the sum-exp and target all-reduces stacked into one call as
# Megatron's fused version does (`megatron/core/fusions/fused_cross_entropy.py:94` and `:112`):
# two all-reduces of $[N]$ and $[2, N]$ floats per micro-batch instead of three.
#
# ```mermaid
# flowchart LR
#   subgraph R0["TP rank 0: columns 0 .. V/t-1"]
#     K0["kernel: per row, a loop over<br/>BLOCK_V chunks → m0, S0, z_y?"]
#   end
#   subgraph R1["TP rank 1: columns V/t .. V-1"]
#     K1["kernel → m1, S1, z_y?"]
#   end
#   K0 --> MAX["all-reduce MAX → M"]
#   K1 --> MAX
#   MAX --> SUM["all-reduce SUM [S_r e^(m_r - M), z_y - M]"]
#   SUM --> L["loss = log S - (z_y - M)<br/>keep lse = M + log S (4 B/token)"]
# ```

# %%
@triton.jit
def _ce_fwd_kernel(logits_ptr, labels_ptr, max_ptr, sumexp_ptr, target_ptr, n_rows, n_cols,
                   vocab_start, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per row: running max, sum of exp relative to it, and the target logit if owned."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    label = tl.load(labels_ptr + rows, mask=row_ok, other=0).to(tl.int64) - vocab_start
    row_max = tl.zeros([ROWS], dtype=tl.float32) - float("inf")
    sum_exp = tl.zeros([ROWS], dtype=tl.float32)
    target = tl.zeros([ROWS], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :],
                    mask=row_ok[:, None] & (cols[None, :] < n_cols),
                    other=-float("inf")).to(tl.float32)
        z = tl.where(row_ok[:, None], z, 0.0)  # rows past the end: finite, never stored
        new_max = tl.maximum(row_max, tl.max(z, axis=1))
        sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), axis=1)
        row_max = new_max
        target += tl.sum(tl.where(cols[None, :] == label[:, None], z, 0.0), axis=1)
    tl.store(max_ptr + rows, row_max, mask=row_ok)
    tl.store(sumexp_ptr + rows, sum_exp, mask=row_ok)
    tl.store(target_ptr + rows, target, mask=row_ok)


# %% [markdown]
# ## The backward recomputes the softmax
#
# $\partial \ell / \partial z_j = (p_j - [j = y])\,g$ with $p_j = e^{z_j - \mathrm{lse}}$ and $g$
# the upstream gradient of the token's loss. With $\mathrm{lse}$ saved (4 bytes per token), the
# backward kernel walks the row's chunks again, recomputes $p$ from the logits, and writes the
# gradient in the logits' dtype. Nothing of size $[N, V/t]$ in fp32 exists at any moment, and no
# communication is needed: each rank's slice of the softmax is local, as in appendix A.

# %%
@triton.jit
def _ce_bwd_kernel(logits_ptr, labels_ptr, lse_ptr, dloss_ptr, dlogits_ptr, n_rows, n_cols,
                   vocab_start, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    """dlogits[row] = (exp(z - lse) - onehot(label)) * dloss[row], chunk by chunk."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    label = tl.load(labels_ptr + rows, mask=row_ok, other=0).to(tl.int64) - vocab_start
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    dloss = tl.load(dloss_ptr + rows, mask=row_ok, other=0.0)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (cols[None, :] < n_cols)
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        z = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        onehot = tl.where(cols[None, :] == label[:, None], 1.0, 0.0)
        grad = (tl.exp(z - lse[:, None]) - onehot) * dloss[:, None]
        tl.store(dlogits_ptr + offs, round_to(grad, dlogits_ptr.dtype.element_ty), mask=mask)


# %% [markdown]
# ## The autograd function
#
# The function takes this rank's logits `[..., V/t]` in their own dtype (no `.float()` first),
# the labels `[...]` (global vocabulary ids) and the grid, runs the kernel, the two all-reduces,
# and saves the logits (a reference to the tensor that exists anyway, not a copy), the labels
# and `lse`. With one TP rank the all-reduces vanish and it is the plain `cross_entropy`.
# The loss is fp32, like appendix A's.
#
# Compiled, a program walks its row in chunks of 4096 columns (8 KiB of bf16) with 8 warps, so
# each thread holds 16 fp32 logits of a chunk (the rule of `row_warps` on page
# [C.1](rmsnorm.py)); ahead of time, at a 128,256-entry vocabulary, the forward needs 55
# registers per thread on sm_80 (48 on sm_90), the backward 48, no spills. The loop over chunks
# is what lets this kernel take any vocabulary, where RMSNorm's whole-row program stops at
# 8192.

# %%
def _tiles(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK_V, programs): chunks of 4096 columns compiled (8 KiB of bf16), 64 interpreted."""
    block = min(64 if INTERPRET else 4096, triton.next_power_of_2(n_cols))
    rows = rows_per_program(block)
    return rows, block, triton.cdiv(n_rows, rows)


# %% [markdown]
# The autograd function runs the forward kernel for each row's local max, local sum and target
# logit, then combines the ranks with one max all-reduce and one sum all-reduce. It keeps the
# logits and one log-sum-exp per row; the backward kernel recomputes the softmax from them.

# %%
class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, grid):
        n_cols = logits.shape[-1]
        z = logits.view(-1, n_cols)
        y = labels.reshape(-1)
        vocab_start = grid.rank("tp") * n_cols
        stats = torch.empty(3, z.shape[0], dtype=torch.float32, device=z.device)
        rows, block, programs = _tiles(z.shape[0], n_cols)
        _ce_fwd_kernel[(programs,)](z, y, stats[0], stats[1], stats[2], z.shape[0], n_cols,
                                    vocab_start, ROWS=rows, BLOCK_V=block,
                                    num_warps=row_warps(rows * block))
        local_max, local_sum, target = stats
        global_max = local_max.clone()
        if grid.size("tp") > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=grid.group("tp"))
        owned = (y >= vocab_start) & (y < vocab_start + n_cols)
        pair = torch.stack([local_sum * torch.exp(local_max - global_max),
                            torch.where(owned, target - global_max, 0.0)])
        sum_exp, target_minus_max = all_reduce(pair, grid, "tp")
        ctx.save_for_backward(z, y, global_max + torch.log(sum_exp))
        ctx.vocab_start, ctx.shape = vocab_start, logits.shape
        return (torch.log(sum_exp) - target_minus_max).view(labels.shape)

    @staticmethod
    def backward(ctx, dloss):
        z, y, lse = ctx.saved_tensors
        dloss = dloss.contiguous().view(-1).float()
        dlogits = torch.empty_like(z)
        rows, block, programs = _tiles(*z.shape)
        _ce_bwd_kernel[(programs,)](z, y, lse, dloss, dlogits, z.shape[0], z.shape[1],
                                    ctx.vocab_start, ROWS=rows, BLOCK_V=block,
                                    num_warps=row_warps(rows * block))
        return dlogits.view(ctx.shape), None, None


# %% [markdown]
# The public function first checks what the kernels cannot take (logits of another dtype or
# layout, labels that are not integers, do not match the logits' shape minus the vocabulary dim
# or sit on another device: each a `ValueError` naming it) and only then applies the function;
# `cross_entropy` is its one-rank case.

# %%
def vocab_parallel_cross_entropy(logits_local: torch.Tensor, labels: torch.Tensor,
                                 grid: ParallelGrid | None = None) -> torch.Tensor:
    """Per-token fp32 CE from this TP rank's vocab slice [..., V/t] with the Triton kernels."""
    grid = grid if grid is not None else ParallelGrid.single()
    check_tensor("cross-entropy logits", logits_local)
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cross-entropy labels must be int64 or int32, got {labels.dtype}")
    if logits_local.dim() < 2 or tuple(logits_local.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"logits {tuple(logits_local.shape)} and labels {tuple(labels.shape)} "
                         "must agree on all but the last (vocab) dim")
    if labels.device != logits_local.device:
        raise ValueError(f"labels are on {labels.device}, logits on {logits_local.device}")
    return _VocabParallelCE.apply(logits_local, labels.contiguous(), grid)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token fp32 CE over the full vocabulary [..., V] (the one-rank case)."""
    return vocab_parallel_cross_entropy(logits, labels, None)


# %% [markdown]
# Two counts close the mechanism: the bytes the kernels move (for the roofline below) and the
# bytes autograd keeps between the forward and the backward, fused or eager (for chapter 07's
# memory model). The second is where the fusion saves memory, not only time.

# %%
def cross_entropy_bytes(num_tokens: int, vocab_local: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes the kernels read + write: forward the logits once; backward logits in, grad out."""
    e = torch.empty((), dtype=dtype).element_size()
    logits = num_tokens * vocab_local * e
    return {"forward": logits + 20 * num_tokens, "backward": 2 * logits + 16 * num_tokens}


def cross_entropy_saved_bytes(num_tokens: int, vocab_local: int, dtype: torch.dtype,
                              fused: bool) -> int:
    """Bytes autograd keeps from the loss's forward to its backward, logits included."""
    if fused:  # the logits tensor itself, the int64 labels and one fp32 lse per token
        return num_tokens * vocab_local * torch.empty((), dtype=dtype).element_size() + 12 * num_tokens
    # appendix A: an fp32 softmax, the int64 local target index and a bool "not mine" mask
    return 4 * num_tokens * vocab_local + 9 * num_tokens


# %% [markdown]
# ## Bytes, memory and the roofline for the running example
#
# The last stage of the running example holds $N = s b = 8192$ tokens of $V/t = 64{,}128$
# logits per micro-batch: 525 M elements, 1.05 GB in bf16. The kernels read them once forward,
# and once more backward while writing the gradient. Appendix A's eager loss at TP 2 runs the
# chain of A.3 (max, shift, exp, sum, divide) and moves 42 bytes per logit forward and 30
# backward, starting from `logits.float()` as appendix B's model calls it. On one rank it takes
# one `log_softmax` pass instead and exponentiates only in the backward (A.3's one-rank path),
# and the demo below, which runs on one rank, counts 26 bytes per logit forward and the same
# 30 backward, against the kernels' 2 and 4. The table is the running example's TP 2, so its
# eager column is the chain's.
#
# | | kernels | eager (appendix A's chain, TP 2) |
# |---|---|---|
# | forward bytes (roofline, H100 SXM) | 1.05 GB (313 µs) | 22.1 GB (6.6 ms) |
# | backward bytes (roofline) | 2.10 GB (627 µs) | 15.8 GB (4.7 ms) |
# | kept for the backward | 1.05 GB (the bf16 logits) + 98 KB | 2.10 GB (an fp32 softmax) |
#
# The saved 1.05 GB per micro-batch in flight is the last-stage term chapter 07's memory model
# adds (`cross_entropy_saved_bytes`); the forward's transient fp32 copies (`logits.float()`,
# $z - M$, $e^{z - M}$, each 2.1 GB) never exist with the kernel. The benchmark measures the
# peak: on the CPU at 256 tokens × 4,096 columns of bf16 logits (2 MiB), forward plus backward
# peaks at 2.0 MiB with the kernels (the gradient) and 8.0 MiB with appendix A's one-rank
# loss, 4.0× (`python benchmarks/bench_kernels.py --device cpu`).
#
# <details><summary>Measured: appendix A's loss before its one-rank pass</summary>
#
# The chain, before A.3 took one `log_softmax` pass on one rank, peaked at 12.0 MiB there.
#
# </details>

# %% [markdown]
# ## Demo: one rank, then two ranks on gloo
#
# First the worked example; then fp32 and bf16 logits over a ragged vocabulary (200 columns in
# chunks of 64) against appendix A's loss on `logits.float()`; the bytes both move, and what
# each keeps for the backward. Then two ranks split the vocabulary and the fused loss is
# compared with appendix A's and with `F.cross_entropy` over the full logits.

# %%
if __name__ == "__main__":
    from tinytron.kernels._measure import EagerTraffic, saved_tensor_bytes

    z = torch.tensor([[1.0, 2.0, 3.0, 0.0]], requires_grad=True)
    loss = cross_entropy(z, torch.tensor([2]))
    loss.backward(torch.ones(1))
    print(f"worked example: loss {loss.item():.3f}, grad {[round(v, 3) for v in z.grad[0].tolist()]}")
    assert abs(loss.item() - 0.440) < 1e-3 and abs(z.grad.sum().item()) < 1e-6

# %% [markdown]
# Next, fp32 and bf16 logits over a ragged vocabulary against appendix A's loss on
# `logits.float()`.

# %%
if __name__ == "__main__":
    def one_rank_gaps(dtype, num_tokens=10, vocab=200):
        """Relative gaps of the loss and the logits' gradient, kernel vs appendix A."""
        gen = torch.Generator().manual_seed(1)
        logits = (3 * torch.randn(num_tokens, vocab, generator=gen)).to(dtype)
        labels = torch.randint(0, vocab, (num_tokens,), generator=gen)
        dloss = torch.rand(num_tokens, generator=gen)
        out = []
        for fused in (True, False):
            x = logits.clone().requires_grad_()
            loss = (cross_entropy(x, labels) if fused else
                    vocab_parallel_cross_entropy_reference(x.float(), labels, ParallelGrid.single()))
            loss.backward(dloss)
            out.append((loss, x.grad.float()))
        return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*out)]

    gaps32, gaps16 = one_rank_gaps(torch.float32), one_rank_gaps(torch.bfloat16)
    print("fp32 (loss, grad) relative gap:", [f"{g:.1e}" for g in gaps32])
    print("bf16 (loss, grad) relative gap:", [f"{g:.1e}" for g in gaps16])

# %% [markdown]
# Then the bytes both paths move per logit, and what each keeps for the backward.

# %%
if __name__ == "__main__":
    n, v = 32, 256
    logits = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    with EagerTraffic() as eager:
        loss = vocab_parallel_cross_entropy_reference(logits.float(), labels, ParallelGrid.single())
        eager.phase = "backward"
        loss.backward(torch.ones(n))
    per = {p: round(eager.total(p) / (n * v)) for p in ("forward", "backward")}
    kernel = {k: round(b / (n * v)) for k, b in cross_entropy_bytes(n, v, torch.bfloat16).items()}
    print(f"bytes per logit: eager {per}, kernels {kernel}")
    _, kept_fused = saved_tensor_bytes(cross_entropy, logits, labels)
    _, kept_eager = saved_tensor_bytes(
        lambda x, y: vocab_parallel_cross_entropy_reference(x.float(), y, ParallelGrid.single()),
        logits, labels)
    print(f"kept for backward: fused {kept_fused} B, eager {kept_eager} B")

    assert max(gaps32) < 1e-6 and max(gaps16) < 2 ** -7
    # one rank: A.3's log_softmax path (the chain at TP > 1 reads and writes 16 B/logit more)
    assert per == {"forward": 26, "backward": 30} and kernel == {"forward": 2, "backward": 4}
    assert kept_fused == cross_entropy_saved_bytes(n, v, torch.bfloat16, fused=True)
    assert kept_eager == cross_entropy_saved_bytes(n, v, torch.bfloat16, fused=False)

# %%
if __name__ == "__main__":
    from tinytron.kernels import _workers
    from tinytron.launch import run_on_ranks

    results = run_on_ranks(_workers.vocab_parallel_parity, 2, "float32", timeout=120)
    for rank, r in enumerate(results):
        print(f"TP rank {rank}:", {k: (f"{v:.1e}" if isinstance(v, float) else v)
                                    for k, v in r.items()})
    assert all(max(r["loss_vs_unfused"], r["grad_vs_unfused"], r["loss_vs_full"],
                   r["grad_vs_full"]) < 1e-5 for r in results)

# %% [markdown]
# ## Summary
#
# - An online log-sum-exp reads each row of logits once, in chunks, in its own dtype; the merge
#   rule for chunks is the merge rule for TP ranks, so the vocab-parallel loss needs only
#   appendix A's MAX all-reduce and one stacked SUM all-reduce.
# - The backward recomputes the softmax from the logits and one saved fp32 `lse` per token:
#   half the memory kept per micro-batch on the last stage, and none of the fp32 temporaries.
# - Equal to appendix A's loss to fp32 rounding (and within bf16 rounding for bf16 logits).
#
# ## How production does it
#
# - Megatron: `megatron/core/fusions/fused_cross_entropy.py` (`_VocabParallelCrossEntropy:87`,
#   one MAX all-reduce at `:94` and the predicted-logit and sum-exp all-reduces merged at
#   `:112`), selected by `cross_entropy_loss_fusion` / `cross_entropy_fusion_impl`
#   (`megatron/core/model_parallel_config.py:239-244`) in
#   `megatron/core/models/common/language_module/language_module.py:156-186`; the `te` choice
#   calls Transformer Engine's Triton cross-entropy kernel. The unfused path is appendix A's
#   (`megatron/core/tensor_parallel/cross_entropy.py`).
# - Fusing the output-layer matmul into the loss (compute logits chunk by chunk and never store
#   them) removes even the 1.05 GB of bf16 logits; Liger-Kernel and torchtune's chunked loss do
#   this.
#
# ## Exercises
#
# 1. Write the gradient into the logits' own storage (the logits are not needed after the
#    backward). What does that save, and what breaks if someone else still holds the logits?
#
#    <details><summary>Answer</summary>
#
#    It saves the <code>empty_like</code> gradient buffer of
#    <code>_VocabParallelCE.backward</code>: a second $[N, V/t]$ tensor,
#    $8192 \times 64128 \times 2$ B = 1.05 GB in bf16 on a rank of the running example, at the
#    peak of the last stage. Anyone else who still reads the logits (a metric, a second loss, a
#    hook) then reads gradients instead, silently.
#
#    </details>
#
# 2. Add label smoothing: which extra per-row quantity must the forward kernel return, and
#    which extra all-reduce does the vocab-parallel form need?
#
#    <details><summary>Hint</summary>
#
#    With smoothing $\varepsilon$ the loss adds
#    $-\tfrac{\varepsilon}{V}\sum_j \log p_j$, which needs the row's sum of logits. Each rank sums
#    its own slice in the same pass as the max and the sum of exponentials; the slices' sums must
#    then be added across the TP group. Then read the label-smoothing branch of
#    <code>megatron/core/tensor_parallel/cross_entropy.py</code> and check which quantities it
#    reduces across the group.
#
#    </details>
#
# 3. Fuse the output layer: loop over vocabulary chunks of the weight, compute each logit
#    chunk with a matmul, and update the online log-sum-exp. What must the backward recompute?
#
#    <details><summary>Hint</summary>
#
#    The point is never to store the $[N, V/t]$ logits. The
#    backward then has no logits to read: it must recompute each chunk with the same matmul, turn
#    it into softmax minus one-hot with the saved log-sum-exp (as <code>_ce_bwd_kernel</code>
#    does), and use it at once for the gradients of the hidden states and of the weight
#    chunk.
#
#    </details>
