# %% [markdown]
# # C.4 · Kernels: flash attention, causal and grouped, forward and backward
#
# Attention's eager form writes an $[s, s]$ score matrix per head, softmaxes it, keeps the
# probabilities for the backward, and multiplies by $V$. At the running example's $s = 4096$
# that is 1 GiB of bf16 probabilities per micro-batch per layer on a TP rank. Tiling the
# computation so that a block of queries streams over blocks of keys, with an online softmax,
# never stores a score: the output and one log-sum-exp per query row are all that leaves the
# chip, and the backward recomputes the scores from them.
#
# You will build: `flash_attention` (Triton: forward, and a backward in two kernels with
# no atomics) beside `attention_reference` (the `scaled_dot_product_attention` call of
# appendix B) and `attention_eager` (the materialized form, to measure what tiling saves).

# %%
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tinytron.kernels._checks import ATTENTION_HEAD_DIMS, check_attention_inputs
from tinytron.kernels._triton import INTERPRET, dot_flags, mma, round_to, row_warps, tl, triton

__all__ = ["flash_attention", "attention_reference", "attention_eager", "attention_flops",
           "attention_bytes", "ATTENTION_HEAD_DIMS"]


# %% [markdown]
# ## The algorithm
#
# For one query row $q$ and keys $k_1 \dots k_s$: scores $x_j = q \cdot k_j / \sqrt d$, output
# $o = \sum_j p_j v_j$ with $p = \mathrm{softmax}(x)$. Split the keys into blocks of $B_N$. Keep,
# per query row, the running maximum $m$, the running denominator $\ell = \sum_j e^{x_j - m}$
# and the running *unnormalized* output $a = \sum_j e^{x_j - m} v_j$. A new block with scores
# $x_c$ gives
#
# $$m' = \max(m, \max x_c), \quad \alpha = e^{m - m'}, \quad
#   \ell' = \alpha\,\ell + \textstyle\sum_c e^{x_c - m'}, \quad
#   a' = \alpha\,a + \textstyle\sum_c e^{x_c - m'} v_c,$$
#
# and at the end $o = a / \ell$ and $\mathrm{lse} = m + \log \ell$ (the merge rule of page
# [C.3](cross_entropy.py), now carrying a vector). A program owns $B_M$ query rows, so the products are matrix products on
# tiles: $X = Q_{B_M} K_{B_N}^\top$ ($B_M \times B_N$) and $P V_{B_N}$ ($B_M \times d$).
#
# Worked example, one query, $d = 1$, $q = 1$, keys $[0, 1, 2, 3]$, values $[1, 2, 3, 4]$ in two
# blocks (scale 1). Block 1: $m = 1$, $\ell = e^{-1} + 1 = 1.368$, $a = e^{-1} \cdot 1 + 2 =
# 2.368$. Block 2: $m' = 3$, $\alpha = e^{-2} = 0.135$, $\ell' = 0.185 + e^{-1} + 1 = 1.553$,
# $a' = 0.320 + 3e^{-1} + 4 = 5.424$; $o = 5.424 / 1.553 = 3.493$, the exact
# $\sum_j \mathrm{softmax}(x)_j v_j$.
#
# **Causal.** Query $i$ sees keys $j \le i$. A query block $[iB_M, (i+1)B_M)$ stops its loop at
# key $(i + 1)B_M$: the blocks above the diagonal are never loaded (half the work), and only
# the blocks crossing the diagonal need the mask. **Grouped queries.** Query head $h$ reads
# key/value head $h / (a/g)$ (appendix B's layout), so a program just offsets its K and V
# pointers; nothing is repeated in memory. **Precision.** Tiles are bf16/fp16 into the tensor
# cores with fp32 accumulation; $m$, $\ell$, $a$ and the lse are fp32.

# %%
@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, num_heads, num_kv_heads,
                     scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """o and lse for BLOCK_M query rows of one (batch, head), streaming over key blocks."""
    start_m, bh = tl.program_id(0), tl.program_id(1)
    batch, head = bh // num_heads, bh % num_heads
    kv = (batch * num_kv_heads + head // (num_heads // num_kv_heads)).to(tl.int64)
    q_base = q_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM
    k_base, v_base = k_ptr + kv * seq_len * HEAD_DIM, v_ptr + kv * seq_len * HEAD_DIM
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_base + rows[:, None] * HEAD_DIM + dims[None, :], mask=rows[:, None] < seq_len,
                other=0.0)
    row_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = tl.minimum((start_m + 1) * BLOCK_M, seq_len) if CAUSAL else seq_len
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kv_offs, kv_in = cols[:, None] * HEAD_DIM + dims[None, :], cols[:, None] < seq_len
        k = tl.load(k_base + kv_offs, mask=kv_in, other=0.0)
        v = tl.load(v_base + kv_offs, mask=kv_in, other=0.0)
        x = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST,
                PRECISION) * scale
        valid = cols[None, :] < seq_len
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        x = tl.where(valid, x, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(x, axis=1))
        alpha = tl.exp(row_max - new_max)
        p = tl.exp(x - new_max[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = mma(round_to(p, v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
        row_max = new_max
    out = acc / denom[:, None]
    tl.store(o_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :],
             round_to(out, o_ptr.dtype.element_ty), mask=rows[:, None] < seq_len)
    tl.store(lse_ptr + bh.to(tl.int64) * seq_len + rows, row_max + tl.log(denom),
             mask=rows < seq_len)


# %% [markdown]
# ## The backward, from the saved log-sum-exp
#
# With $P = e^{X - \mathrm{lse}}$ recomputed tile by tile from $Q$, $K$ and the saved lse, and
# $dO$ the upstream gradient:
#
# $$dV = P^\top dO, \quad dP = dO\,V^\top, \quad dX = P \odot (dP - \delta), \quad
#   \delta_i = \textstyle\sum_j P_{ij}\, dP_{ij} = dO_i \cdot O_i,$$
#
# $$dQ = dX\,K / \sqrt d, \qquad dK = dX^\top Q / \sqrt d .$$
#
# $\delta$ is one number per query row, computed first from $O$ and $dO$ (a small kernel). Then
# the sums go in two directions: $dK$ and $dV$ sum over *query* rows, $dQ$ over *key* columns.
# One kernel per direction keeps every sum inside one program, with no atomics and a
# deterministic result:
#
# - **dK, dV**: a program owns $B_N$ keys of one key/value head and walks every query block of
#   every query head in its group (under causality only the blocks at or below the diagonal),
#   so GQA's sum over the $a/g$ heads of a group happens in registers too;
# - **dQ**: a program owns $B_M$ queries of one head and walks its key blocks, as the forward.
#
# The price is recomputing $X$ and $dP$ in both kernels: 7 tile products per tile pair
# instead of the 5 of a single kernel that accumulates $dQ$ with atomic adds (FlashAttention-2's
# choice), so the backward costs 3.5 forwards instead of 2.5.
#
# ```mermaid
# flowchart LR
#   D["delta kernel<br/>δ = rowsum(dO ∘ O)"] --> KV["dK/dV kernel<br/>program = (key block, kv head)<br/>loop: heads of the group × query blocks"]
#   D --> Q["dQ kernel<br/>program = (query block, head)<br/>loop: key blocks ≤ diagonal"]
#   L["saved lse (fp32, 1 per row)"] --> KV
#   L --> Q
# ```

# %%
@triton.jit
def _attn_bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, n_rows, HEAD_DIM: tl.constexpr,
                           BLOCK_M: tl.constexpr):
    """delta[row] = sum(o[row] * do[row]) in fp32."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = rows.to(tl.int64)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(o_ptr + offs, mask=rows[:, None] < n_rows, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offs, mask=rows[:, None] < n_rows, other=0.0).to(tl.float32)
    tl.store(delta_ptr + rows, tl.sum(o * do, axis=1), mask=rows < n_rows)


# %% [markdown]
# Both gradient kernels need the same tile of probabilities, recomputed from $Q$, $K$ and the
# saved lse with the forward's mask. A `@triton.jit` helper called from a kernel is inlined
# into it, so writing it once costs nothing at run time.

# %%
@triton.jit
def _probs(q, k, lse, rows, cols, seq_len, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """P = exp(q k^T * scale - lse) on one tile, zero where masked."""
    x = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST, PRECISION)
    valid = (rows[:, None] < seq_len) & (cols[None, :] < seq_len)
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None])
    return tl.where(valid, tl.exp(x * scale - lse[:, None]), 0.0)


# %% [markdown]
# The dK/dV kernel holds its $B_N$ keys and values in registers for the whole run and loops
# twice: over the query heads of its group, then over the query blocks that can see these keys
# (under causality, from the query block holding the row of its first key onward). Both sums
# stay in fp32 accumulators until the single store at the end.

# %%
@triton.jit
def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                          seq_len, num_heads, num_kv_heads, scale, CAUSAL: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dK, dV for BLOCK_N keys of one kv head, summed over its query heads and query blocks."""
    start_n, bkv = tl.program_id(0), tl.program_id(1)
    batch, kv_head = bkv // num_kv_heads, bkv % num_kv_heads
    group = num_heads // num_kv_heads
    kv_off = bkv.to(tl.int64) * seq_len * HEAD_DIM
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    kv_offs = cols[:, None] * HEAD_DIM + dims[None, :]
    k = tl.load(k_ptr + kv_off + kv_offs, mask=cols[:, None] < seq_len, other=0.0)
    v = tl.load(v_ptr + kv_off + kv_offs, mask=cols[:, None] < seq_len, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0  # first block that sees us
    for g in range(0, group):
        bh = (batch * num_heads + kv_head * group + g).to(tl.int64)
        for start_m in range(lo, seq_len, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            q_offs = bh * seq_len * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
            q = tl.load(q_ptr + q_offs, mask=rows[:, None] < seq_len, other=0.0)
            do = tl.load(do_ptr + q_offs, mask=rows[:, None] < seq_len, other=0.0)
            lse = tl.load(lse_ptr + bh * seq_len + rows, mask=rows < seq_len, other=0.0)
            delta = tl.load(delta_ptr + bh * seq_len + rows, mask=rows < seq_len, other=0.0)
            p = _probs(q, k, lse, rows, cols, seq_len, scale, CAUSAL, BLOCK_M, BLOCK_N, UPCAST,
                       PRECISION)
            dv = mma(tl.trans(round_to(p, do.dtype)), do, dv, UPCAST, PRECISION)
            dp = mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST,
                     PRECISION)
            ds = p * (dp - delta[:, None])
            dk = mma(tl.trans(round_to(ds, q.dtype)), q, dk, UPCAST, PRECISION)
    out_mask = cols[:, None] < seq_len
    tl.store(dk_ptr + kv_off + kv_offs, round_to(dk * scale, dk_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dv_ptr + kv_off + kv_offs, round_to(dv, dv_ptr.dtype.element_ty), mask=out_mask)


# %% [markdown]
# The dQ kernel is the forward's loop again, recomputing $P$ and $dP$ like the dK/dV kernel
# but summing $dS\,K$ over keys instead of over queries.

# %%
@triton.jit
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, seq_len,
                        num_heads, num_kv_heads, scale, CAUSAL: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dQ for BLOCK_M query rows of one head, summed over its key blocks."""
    start_m, bh = tl.program_id(0), tl.program_id(1)
    batch, head = bh // num_heads, bh % num_heads
    kv = (batch * num_kv_heads + head // (num_heads // num_kv_heads)).to(tl.int64)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_offs = bh.to(tl.int64) * seq_len * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=rows[:, None] < seq_len, other=0.0)
    do = tl.load(do_ptr + q_offs, mask=rows[:, None] < seq_len, other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * seq_len + rows, mask=rows < seq_len, other=0.0)
    delta = tl.load(delta_ptr + bh.to(tl.int64) * seq_len + rows, mask=rows < seq_len, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = tl.minimum((start_m + 1) * BLOCK_M, seq_len) if CAUSAL else seq_len
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kv_offs = kv * seq_len * HEAD_DIM + cols[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(k_ptr + kv_offs, mask=cols[:, None] < seq_len, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=cols[:, None] < seq_len, other=0.0)
        p = _probs(q, k, lse, rows, cols, seq_len, scale, CAUSAL, BLOCK_M, BLOCK_N, UPCAST,
                   PRECISION)
        dp = mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST,
                 PRECISION)
        ds = p * (dp - delta[:, None])
        dq = mma(round_to(ds, k.dtype), k, dq, UPCAST, PRECISION)
    tl.store(dq_ptr + q_offs, round_to(dq * scale, dq_ptr.dtype.element_ty),
             mask=rows[:, None] < seq_len)


# %% [markdown]
# ## Launching: tiles, checks, autograd
#
# The grid is (query blocks, batch × heads) for the forward and dQ, (key blocks, batch × key/value
# heads) for dK/dV. Interpreted, every tile is $16 \times 16$, so that the tests' short
# sequences cross several ragged, diagonal and skipped blocks. Compiled, a tile must fit two
# budgets of one streaming multiprocessor: **shared memory** (the K and V tiles in flight, one
# set per pipeline stage; an A100, sm_80, lets a block opt in to 163 KiB, an H100, sm_90, to
# 227 KiB) and **registers** (65,536 per SM, at most 255 per thread; a thread that needs more
# *spills* to local memory, which lives in DRAM behind the L1 cache). Every fp32 accumulator
# element lives in some thread's registers: the forward's $O$ tile is
# $B_M \cdot d / (32 \cdot \text{warps})$ values per thread, the dK/dV kernel holds two of them.
#
# The tiles below were chosen by compiling candidates ahead of time for both targets with the
# ptxas that Triton ships (no GPU needed; the script is the private module
# `chapters/kernels/_compile.py`), with Triton 3.6 (the version on the lent H200) and 3.9, at
# every head size the configs use: 32 (`tiny.toml`), 64 (`gpt_125m.toml`) and 128
# (`gpt_1b.toml`, the 7B example). A slow test re-compiles them at every config's sizes and
# asserts no spills. At $d = 128$ in bf16, with grouped queries:
#
# | kernel | $B_M \times B_N$, warps, stages | shared B/block sm_80 / sm_90 | registers/thread sm_80 / sm_90, Triton 3.6 | sm_90, Triton 3.9 | spills |
# |---|---|---|---|---|---|
# | forward | $64 \times 32$, 8, 3 | 28,672 / 32,768 | 255 / 228 | 202 | 0 |
# | dK, dV | $16 \times 64$, 8, 2 | 43,136 / 49,280 | 255 / 231 | 194 | 0 |
# | dQ | $32 \times 64$, 8, 2 | 49,152 / 49,152 | 253 / 220 | 177 | 0 |
#
# At $d = 64$ they take 114, 128 and 147 registers on sm_90 (Triton 3.6), at $d = 32$ 64, 74
# and 152. The small $\delta$ kernel is a row kernel (64 rows of $O$ and $dO$, 8192 lanes, 16
# warps by the rule of page [C.1](rmsnorm.py)): 52 registers per thread on sm_80, 40 on sm_90,
# no spills.
#
# The tiles this page used before passed with Triton 3.9 but not with 3.6: at $d = 128$ on
# sm_90 the $64 \times 64$ forward at 4 warps took 255 registers and spilled 20 B per thread,
# dQ ($64 \times 32$, 4 warps) 255 and 416 B, and dK/dV ($32 \times 64$, 8 warps) used 238 of
# its 255. At 4 warps each thread holds a quarter of a $64 \times 128$ fp32 accumulator (64
# values) beside its slices of the Q, K and V tiles, which Triton loads into registers before
# staging them for the tensor cores; 8 warps halve every share. Smaller tiles are not simply
# safer, though: $32 \times 32$ dQ at 8 warps spills 12 B at $d = 64$ and $32 \times 32$ dK/dV
# 24 B at $d = 32$ (Triton 3.6, sm_90), which is why every head size is compiled. On sm_90, the
# lent device's architecture, each chosen tile stays at least 24 registers under the limit (a
# $64 \times 64$ forward at 8 warps also compiles cleanly, but at 250).
# Whether they are also the *fastest* is a question for a benchmark on the GPU.
#
# **fp32.** Exact fp32 products (`input_precision="ieee"`) cannot use the tensor cores, so
# the products run on the FMA units and every operand tile sits in registers. With the old
# $128 \times 64$ tiles a block needed 229,888 B of shared memory at $d = 128$ (more than an
# A100's 163 KiB: it would not launch); even $32 \times 32$ tiles at 4 warps spill 200 B per
# thread on sm_80 and 1,076 B on sm_90, and TF32 $64 \times 64$ spills 536 B. So compiled fp32
# inputs take the `scaled_dot_product_attention` call the kernel replaces (PyTorch picks its own
# fp32 kernel); the fp32 kernels still run under the interpreter, where they are the exact
# reference of the CPU tests. Inputs are `[b, heads, s, d]`, contiguous, with one of the head
# sizes the kernels take; anything else is a `ValueError` that names it (the checks are in the
# chapter's private module `chapters/kernels/_checks.py`).

# %%
DELTA_ROWS = 64  # rows of O and dO per program of the delta kernel


def _tiles(head_dim: int) -> dict:
    """(BLOCK_M, BLOCK_N, launch options) of the forward, the dK/dV and the dQ kernels."""
    if INTERPRET:
        return {"fwd": (16, 16, {}), "dkdv": (16, 16, {}), "dq": (16, 16, {})}
    return {"fwd": (64, 32, {"num_warps": 8, "num_stages": 3}),
            "dkdv": (16, 64, {"num_warps": 8, "num_stages": 2}),
            "dq": (32, 64, {"num_warps": 8, "num_stages": 2})}


# %% [markdown]
# The autograd function runs one forward launch and saves what the backward needs: the inputs
# (which exist anyway), the output and the lse (4 bytes per query row), never the $s \times s$
# probabilities. The backward launches the three kernels in order, $\delta$ first, since both
# others read it.

# %%
class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        b, hq, s, d = q.shape
        o = torch.empty_like(q)
        lse = torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
        bm, bn, opts = _tiles(d)["fwd"]
        upcast, precision = dot_flags(q.dtype)
        _attn_fwd_kernel[(triton.cdiv(s, bm), b * hq)](
            q, k, v, o, lse, s, hq, k.shape[1], scale, CAUSAL=causal, HEAD_DIM=d, BLOCK_M=bm,
            BLOCK_N=bn, UPCAST=upcast, PRECISION=precision, **opts)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        tiles = _tiles(d)
        upcast, precision = dot_flags(q.dtype)
        flags = dict(CAUSAL=ctx.causal, HEAD_DIM=d, UPCAST=upcast, PRECISION=precision)
        delta = torch.empty_like(lse)
        _attn_bwd_delta_kernel[(triton.cdiv(b * hq * s, DELTA_ROWS),)](
            o, do, delta, b * hq * s, HEAD_DIM=d, BLOCK_M=DELTA_ROWS,
            num_warps=row_warps(DELTA_ROWS * d))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bm, bn, opts = tiles["dkdv"]
        _attn_bwd_dkdv_kernel[(triton.cdiv(s, bn), b * hkv)](
            q, k, v, do, lse, delta, dk, dv, s, hq, hkv, ctx.scale, BLOCK_M=bm, BLOCK_N=bn,
            **flags, **opts)
        bm, bn, opts = tiles["dq"]
        _attn_bwd_dq_kernel[(triton.cdiv(s, bm), b * hq)](
            q, k, v, do, lse, delta, dq, s, hq, hkv, ctx.scale, BLOCK_M=bm, BLOCK_N=bn,
            **flags, **opts)
        return dq, dk, dv, None, None


# %% [markdown]
# The public function checks, picks the default scale $1/\sqrt d$ and applies. Beside it sit the
# two forms it is measured against: the `scaled_dot_product_attention` call it replaces, and the
# materialized form that writes every score.

# %%
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, causal) v for q [b, a, s, d] and k, v [b, g, s, d] (GQA).

    bf16/fp16 run the Triton kernels; fp32 runs them only under the interpreter, and compiled
    takes `attention_reference` (no fp32 tiles fit an A100 or H100 without spilling).
    """
    check_attention_inputs(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.dtype == torch.float32 and not INTERPRET:  # no fp32 tiles fit: see "fp32" above
        return attention_reference(q, k, v, causal=bool(causal), scale=scale)
    return _FlashAttention.apply(q, k, v, bool(causal), scale)


def attention_reference(q, k, v, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """The call the kernel replaces: appendix B's scaled_dot_product_attention with GQA."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def attention_eager(q, k, v, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Attention with the [s, s] scores materialized (softmax in fp32), to measure what tiling saves."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    x = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = q.shape[2]
        x = x.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(x.float(), dim=-1).to(q.dtype) @ v


# %% [markdown]
# Last, the counts: the FLOPs and the least bytes of each pass (for the roofline below), and
# `tile_schedule`, the forward's loop bounds replayed in Python, which the demo draws.

# %%
def attention_flops(b: int, heads: int, s: int, d: int, causal: bool = True) -> dict[str, float]:
    """Matmul FLOPs: forward 2 products, backward 7 here (2 recomputed), halved when causal."""
    pair = 2.0 * b * heads * s * s * d * (0.5 if causal else 1.0)  # one s x s x d product
    return {"forward": 2 * pair, "backward": 7 * pair}


def attention_bytes(b: int, heads: int, kv_heads: int, s: int, d: int,
                    dtype: torch.dtype) -> dict[str, int]:
    """Bytes a pass must at least move: Q, K, V, O (and their gradients) once, plus the fp32 lse."""
    e = torch.empty((), dtype=dtype).element_size()
    q_bytes, kv_bytes, row = b * heads * s * d * e, b * kv_heads * s * d * e, 4 * b * heads * s
    return {"forward": 2 * q_bytes + 2 * kv_bytes + row,
            "backward": 4 * q_bytes + 4 * kv_bytes + 2 * row}


def tile_schedule(seq_len: int, block_m: int, block_n: int, causal: bool = True) -> torch.Tensor:
    """Per (query block, key block): 0 skipped, 1 loaded and masked, 2 loaded unmasked.

    The loop bounds are the forward kernel's: query block i visits key blocks up to
    min((i + 1) * block_m, seq_len); a visited tile needs the mask when it crosses the diagonal
    or the ragged end of the keys.
    """
    nm, nn = -(-seq_len // block_m), -(-seq_len // block_n)
    out = torch.zeros(nm, nn, dtype=torch.int64)
    for i in range(nm):
        hi = min((i + 1) * block_m, seq_len) if causal else seq_len
        for j in range(-(-hi // block_n)):
            crosses = causal and (j + 1) * block_n - 1 > i * block_m
            ragged = (j + 1) * block_n > seq_len  # padded key columns
            out[i, j] = 1 if crosses or ragged else 2
    return out


# %% [markdown]
# ## The roofline for the running example
#
# A TP rank of the running example attends with $b = 2$, $a/t = 16$ query heads, $g/t = 4$
# key/value heads, $s = 4096$, $d = 128$, causal. The forward is two $s \times s \times d$
# products per head, halved by causality: 137 GFLOP, against 84 MB that must move (Q, K, V in,
# O and the lse out): 1,600 FLOP per byte, five times an H100's ridge of 295. Flash attention
# is **compute-bound**, so its goal is a fraction of the tensor-core peak, not of the bandwidth.
#
# | pass | FLOPs | bytes (at least) | roofline (H100 SXM, 989 TFLOP/s) |
# |---|---|---|---|
# | forward | 137 GFLOP | 84 MB | 139 µs |
# | backward (7 products) | 481 GFLOP | 169 MB | 486 µs (347 µs with 5) |
#
# The materialized form instead writes and reads the scores: $b \cdot 16 \cdot s^2$ = 537 M of
# them per layer, 1.07 GB in bf16 just to keep the probabilities for the backward (the demo
# counts what `attention_eager` keeps and moves), which for a stage's 16 layers is 17 GB per
# micro-batch in flight. The benchmark compares the kernel's TFLOP/s with
# `scaled_dot_product_attention`'s flash backend on a GPU.

# %% [markdown]
# ## Demo: the tiles, the worked example, and parity with causal GQA at ragged lengths
#
# The picture shows which tiles a causal forward visits at $s = 72$ with $16 \times 16$ tiles.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.kernels._measure import EagerTraffic, saved_tensor_bytes

    sched = tile_schedule(72, 16, 16)
    fig, ax = plt.subplots(figsize=(3.6, 3.2))
    ax.imshow(sched, cmap=plt.matplotlib.colors.ListedColormap(["#eeeeee", "#f0a35e", "#4c72b0"]))
    ax.set(xlabel="key block", ylabel="query block (one program each)",
           title="causal forward, s = 72, 16 x 16 tiles")
    for (i, j), kind in zip(torch.cartesian_prod(torch.arange(5), torch.arange(5)).tolist(),
                            sched.flatten().tolist()):
        ax.text(j, i, ["skip", "mask", "full"][kind], ha="center", va="center", fontsize=7)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The worked example through the kernel: a head of 16 with one non-zero channel, so the output is
# the hand-computed 3.493.

# %%
if __name__ == "__main__":
    q = torch.zeros(1, 1, 4, 16)
    q[..., 0] = 1.0
    k, v = torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 4, 16)
    k[0, 0, :, 0], v[0, 0, :, 0] = torch.arange(4.0), torch.arange(1.0, 5.0)
    worked = flash_attention(q, k, v, causal=False, scale=1.0)[0, 0, 0, 0].item()
    print(f"worked example: o = {worked:.3f}")

# %% [markdown]
# Forward and backward against `scaled_dot_product_attention` in fp32: GQA ratios 1, 2 and 4,
# lengths that are not multiples of the tile, causal and not, fp32 and bf16 inputs (bf16 is held
# to $2^{-6}$ of the largest value: with $P$ and $dS$ rounded to bf16 for the tensor cores, its
# error is that of SDPA's own bf16 path, ~0.5%).

# %%
if __name__ == "__main__":
    def gaps(dtype, b, heads, kv_heads, s, d, causal):
        """Relative gaps (o, dq, dk, dv): the kernel in `dtype` against SDPA in fp32."""
        gen = torch.Generator().manual_seed(s)
        q, do = (torch.randn(b, heads, s, d, generator=gen) for _ in range(2))
        k, v = (torch.randn(b, kv_heads, s, d, generator=gen) for _ in range(2))
        res = []
        for fn, cast in ((flash_attention, dtype), (attention_reference, torch.float32)):
            leaves = [t.to(cast).clone().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves, causal)
            out.backward(do.to(cast))
            res.append([out.detach()] + [t.grad for t in leaves])
        return [((a.float() - r.float()).abs().max() / r.float().abs().max()).item()
                for a, r in zip(*res)]

    cases = [(torch.float32, 1, 2, 2, 24, 16, True), (torch.float32, 1, 4, 2, 33, 32, True),
             (torch.float32, 2, 4, 1, 20, 16, False), (torch.bfloat16, 1, 4, 2, 33, 16, True)]
    results = {c: gaps(*c) for c in cases}
    for c, g in results.items():
        print(f"{str(c[0]):>14} b{c[1]} heads {c[2]}/{c[3]} s {c[4]} d {c[5]} causal {c[6]}: "
              f"(o, dq, dk, dv) {[f'{x:.0e}' for x in g]}")

# %% [markdown]
# Last, what each form keeps for the backward and what the eager form moves per score, and the
# asserts.

# %%
if __name__ == "__main__":
    b, h, s, d = 1, 2, 64, 16
    qkv = [torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    _, kept_eager = saved_tensor_bytes(attention_eager, *qkv)
    _, kept_flash = saved_tensor_bytes(flash_attention, *qkv)
    with EagerTraffic() as eager:
        attention_eager(*qkv)
    print(f"kept for backward: eager {kept_eager} B, flash {kept_flash} B; eager forward moves "
          f"{eager.total() / (b * h * s * s):.1f} B per score")

    assert (sched == 0).sum() == 10 and (sched == 1).sum() == 5  # above the diagonal never loaded
    assert abs(worked - 3.493) < 1e-3
    assert all(max(g) < 1e-5 for c, g in results.items() if c[0] == torch.float32)
    assert max(results[cases[-1]]) < 2 ** -6  # bf16 inputs, and P and dS rounded to bf16
    assert kept_eager > 2 * kept_flash

# %% [markdown]
# ## Summary
#
# - A program owns a block of queries and streams key/value blocks through an online softmax:
#   no score leaves the chip, the forward keeps one fp32 lse per row, and causal tiles above the
#   diagonal are never loaded.
# - The backward recomputes the probabilities from the lse, computes $\delta = dO \cdot O$ first,
#   and splits the two reductions into a dK/dV kernel (which also sums GQA's heads of a group)
#   and a dQ kernel: deterministic, at the price of recomputing two tile products.
# - GQA costs nothing but a pointer offset; bf16 tiles feed the tensor cores with fp32
#   accumulation.
#
# ## How production does it
#
# - Megatron runs attention through Transformer Engine (`TEDotProductAttention`,
#   `megatron/core/extensions/transformer_engine.py:1583`), which dispatches to FlashAttention-2/3
#   or cuDNN's fused attention; `attention_backend` (`megatron/core/transformer/transformer_config.py:143`)
#   chooses. The unfused path with a fused softmax is `megatron/core/transformer/dot_product_attention.py`
#   and `megatron/core/fusions/fused_softmax.py:11` (`ScaledUpperTriangMaskedSoftmax`).
# - FlashAttention-2 accumulates dQ with atomics in one backward kernel; FlashAttention-3 adds
#   warp specialization and asynchronous TMA copies on Hopper; context parallelism (appendix A)
#   merges per-chunk results with the same lse rule.
#
# ## Exercises
#
# 1. Split the forward loop into the blocks strictly below the diagonal (no mask) and the
#    diagonal blocks (masked): how many `where`s does that save at $s = 4096$?
#
#    <details><summary>Answer</summary>
#
#    The compiled forward uses $64 \times 32$ tiles
#    (<code>_tiles</code>). <code>tile_schedule(4096, 64, 32)</code> visits 4,160 tiles per
#    (batch, head): 128 cross the diagonal and 4,032 lie strictly below it. Each visited tile runs
#    one <code>where</code> over its $64 \times 32$ scores, so the split saves 4,032 of 4,160
#    (97%) per (batch, head), or 129,024 per layer of the running example ($b = 2$, 16 heads per
#    rank).
#
#    </details>
#
# 2. Accumulate dQ with `tl.atomic_add` inside the dK/dV kernel. Measure the FLOPs saved and
#    show that two runs no longer give bit-identical gradients.
#
#    <details><summary>Hint</summary>
#
#    Today the dQ kernel recomputes $S = QK^T$ and $P$ for its own
#    tiles, the same work the dK/dV kernel already did. With atomics, each dK/dV program adds its
#    $dS\,K$ share into dQ, so that recompute goes away. But the order of the adds then depends on
#    which program finishes first, and fp32 addition is not associative: compare two runs' dQ with
#    <code>torch.equal</code>.
#
#    </details>
#
# 3. Add appendix B's packed-document mask (attention restarts at each end-of-document): which
#    per-row numbers must the kernel load, and which tiles can it skip entirely?
#
#    <details><summary>Hint</summary>
#
#    Per row, the start of its document (or a document id); a key
#    is valid when it is in the same document and, causally, not later. A tile whose key block
#    ends before the first document start of its query block can be skipped, like the tiles above
#    the diagonal in <code>tile_schedule</code>; only tiles that cross a document boundary need
#    the mask.
#
#    </details>
