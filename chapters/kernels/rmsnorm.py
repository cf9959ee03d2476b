# %% [markdown]
# # C.1 · Kernels: RMSNorm, one pass forward and one pass backward
#
# Every layer normalizes the residual stream twice. In eager PyTorch that is eight small ops,
# each streaming the whole activation through memory; a kernel reads the row once, keeps it in
# registers, and writes the result once. This page writes that kernel in Triton, its backward
# (with the weight gradient reduced across row blocks), and counts the bytes it saves.
#
# You will build: `rms_norm` (the Triton path, an autograd function over two kernels) beside
# `rms_norm_reference` (the torch code it replaces), and `rms_norm_bytes` (its memory traffic).

# %%
from __future__ import annotations

import torch

from tinytron.kernels._triton import (MAX_ROW_LANES, check_tensor, num_row_programs, round_to,
                                      row_warps, rows_per_program,
                                      tl, triton)

__all__ = ["rms_norm", "rms_norm_reference", "rms_norm_bytes", "rms_norm_forward_bound",
           "rms_norm_other_order", "rms_norm_moved"]

# %% [markdown]
# ## What the eager version costs
#
# $y = w \odot \mathrm{cast}\big(x \cdot r\big)$ with $r = 1/\sqrt{\overline{x^2} + \epsilon}$, the
# statistics in fp32 even for bf16 input, and the cast back to the input dtype *before* the
# weight (appendix B's `RMSNorm`, the Hugging Face convention). The reference below is exactly
# appendix B's forward. Eagerly it runs `to(float32)`, `pow`, `mean`, `add`, `rsqrt`, `mul`,
# `to(bfloat16)`, `mul`: every op reads its inputs from memory and writes its output back, and
# the fp32 temporaries are twice the size of the bf16 activation. The demo counts these bytes op
# by op (a dispatch mode that sums each op's input and output sizes): **36 bytes per element
# forward for bf16 input, against 4 for the kernel** (read $x$ once, write $y$ once), and 96
# against 6 in the backward, whose autograd graph is twice as long. Autograd also keeps 6 bytes
# per element for the backward (an fp32 copy of $x$ and the bf16 normalized row) where the
# kernel keeps the 2-byte input, which the previous layer's output already is, and one fp32
# $r$ per row.
#
# Worked example, one row $x = [1, 2, 3, 4]$, $\epsilon = 0$: $\overline{x^2} = 30/4 = 7.5$,
# $r = 0.3651$, normalized row $[0.365, 0.730, 1.095, 1.461]$.
#
# ## The forward kernel: whole rows per program
#
# A program loads a tile of `ROWS` whole rows (each `BLOCK_H` wide, the next power of two
# $\ge h$, with a mask for the ragged tail: $h = 100$ loads 128 lanes, 28 masked), squares and
# sums each row in fp32, and writes $y$ and each row's $r$, which the backward reuses instead of
# recomputing the sum. For $h = 4096$ a row is 8 KiB of bf16 and one row fills a program
# (`ROWS = 1`); narrower rows share one, at most 4 (`rows_per_program`: 16 rows of 128 spill
# 4 B per thread on sm_80 with Triton 3.6), and under the interpreter, where every program
# costs Python time, tiles are larger. Either way $x$ is read exactly once.
# Megatron gets this fusion from Transformer Engine's RMSNorm (`TENorm`,
# `megatron/core/extensions/transformer_engine.py:675`) or Apex's persistent layer norm
# (`megatron/core/fusions/fused_layer_norm.py:30`).

# %%
@triton.jit
def _rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps,
                        ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """y = w * cast(x * rstd), rstd = 1/sqrt(mean(x^2) + eps) in fp32, for ROWS whole rows."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)
    normed = round_to(x * rstd[:, None], w.dtype)  # rounded before the weight, as torch does
    y = normed.to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(y_ptr + offs, round_to(y, y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


# %% [markdown]
# ## The backward: dx per row, dw reduced across row blocks
#
# With $n = x r$ (fp32), $\hat n = \mathrm{cast}(n)$ and upstream gradient $g$:
#
# $$\frac{\partial L}{\partial w} = \sum_{\text{rows}} g \odot \hat n, \qquad
#   \frac{\partial L}{\partial x} = r \Big(u - n\,\overline{u \odot n}\Big), \quad u = g \odot w,$$
#
# the second because $\partial r / \partial x_j = -r^3 x_j / h$. The row terms are local to a
# row; the weight gradient is a sum over **all** rows, which no single program sees. The
# backward therefore launches $G$ programs (four per SM on a GPU); program $p$ walks row tiles
# $p, p + G, p + 2G, \dots$, accumulates its partial $\sum g \odot \hat n$ in fp32 registers,
# and writes one row of a $[G, h]$ buffer; a last reduction over $G$ gives $\partial L/\partial w$.
# Two stages keep the sum deterministic, with no atomics. (Under sequence parallelism each TP
# rank has summed only its own tokens; chapter 05's `finalize_model_grads` all-reduces the
# weight gradient over TP, exactly as for the torch path.)
#
# ```mermaid
# flowchart LR
#   subgraph rows["rows of x, g (N = 12), G = 4 programs"]
#     r0["rows 0, 4, 8 → program 0"]
#     r1["rows 1, 5, 9 → program 1"]
#     r2["rows 2, 6, 10 → program 2"]
#     r3["rows 3, 7, 11 → program 3"]
#   end
#   r0 --> P["partial dw [G, h] (fp32)"]
#   r1 --> P
#   r2 --> P
#   r3 --> P
#   P -->|"sum over G"| W["dw [h]"]
#   rows --> DX["dx, written row by row"]
# ```

# %%
@triton.jit
def _rmsnorm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols,
                        ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """dx for row tiles pid, pid + G, ...; this program's partial sum of dy * cast(x * rstd)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * ROWS
    cols = tl.arange(0, BLOCK_H)
    w_raw = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)
    w = w_raw.to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(pid * ROWS, n_rows, step):
        rows = start + tl.arange(0, ROWS)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)[:, None]
        normed = x * rstd
        dw += tl.sum(dy * round_to(normed, w_raw.dtype).to(tl.float32), axis=0)
        u = dy * w
        dot = tl.sum(u * normed, axis=1)[:, None] / n_cols
        tl.store(dx_ptr + offs, round_to(rstd * (u - normed * dot), dx_ptr.dtype.element_ty),
                 mask=mask)
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=cols < n_cols)


# %% [markdown]
# ## Warps: how wide a row one program can hold
#
# A whole-row program keeps every value of its row in registers, spread over its threads. Triton's
# default of 4 warps (128 threads) gives each thread 32 fp32 values per tensor at $h = 4096$, and
# the backward has four such tensors alive at once ($x$, $g$, $w$ and the $dw$ partial). The
# launch therefore sets `num_warps` from the tile, 16 values per thread (`row_warps`: 4096 lanes
# → 8 warps, 8192 → 16), compiled ahead of time for sm_80 and sm_90 with Triton's ptxas:
#
# | $h$ | warps | registers/thread, forward / backward (sm_80) | spills |
# |---|---|---|---|
# | 4096 (7B) | 8 | 64 / 114 | 0 |
# | 8192 (70B) | 16 | 72 / 128 | 0 |
# | 16384 | 16 | 120 / 128 | 564 B in the backward |
#
# A block of 16 warps may use at most 128 registers per thread ($65{,}536 / 512$), and 32 warps
# only 64, so more warps cannot hold a 16384-wide row either; the kernels take $h \le 8192$ and
# refuse a wider row with a `ValueError` that names the limit. (A wider row needs a loop over
# column chunks, as the cross-entropy kernel of [C.3](cross_entropy.py) does over the vocabulary.)

# %% [markdown]
# ## The autograd function and the reference beside it
#
# `rms_norm` flattens the leading dims into rows, checks what the kernels cannot take (a
# dtype other than fp32/bf16/fp16, a weight of another dtype or size, a non-contiguous input:
# each a `ValueError` naming it, never a wrong result) and saves $x$, $w$ and the $N$ fp32
# values of $r$. A non-contiguous upstream gradient is made contiguous in the backward (autograd
# may hand one over; copying it is correct, only slower). `rms_norm_bytes` is the kernel's
# traffic: what its loads and stores touch.

# %%
def _check_rms_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    """ValueError for inputs the kernels cannot take."""
    check_tensor("rms_norm input x", x)
    check_tensor("rms_norm weight", weight, dims=1, dtype=x.dtype)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm weight has {weight.shape[0]} entries, x has hidden size "
                         f"{x.shape[-1]}")
    if x.shape[-1] > MAX_ROW_LANES:
        raise ValueError(f"rms_norm hidden size {x.shape[-1]} > {MAX_ROW_LANES}: a row must fit "
                         "one program's registers (16 warps, 16 fp32 values per thread)")


def row_tiles(h: int) -> tuple[int, int]:
    """(ROWS, BLOCK_H): whole rows padded to a power of two, several per program when narrow."""
    block = triton.next_power_of_2(h)
    return rows_per_program(block), block


# %% [markdown]
# The autograd function launches the two kernels. The forward keeps $x$, the weight and one fp32
# `rstd` per row for the backward; the backward makes the upstream gradient contiguous and sums
# the weight-gradient partials of all programs.

# %%
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.shape[-1]
        x2 = x.view(-1, h)
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        rows, block = row_tiles(h)
        _rmsnorm_fwd_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, weight, y, rstd, x2.shape[0], h, eps, ROWS=rows, BLOCK_H=block,
            num_warps=row_warps(rows * block))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, h = x2.shape
        dy2 = dy.contiguous().view(n_rows, h)
        dx = torch.empty_like(x2)
        rows, block = row_tiles(h)
        grid = num_row_programs(triton.cdiv(n_rows, rows), x2.device)
        dw_partial = torch.empty(grid, h, dtype=torch.float32, device=x2.device)
        _rmsnorm_bwd_kernel[(grid,)](dy2, x2, weight, rstd, dx, dw_partial, n_rows, h,
                                     ROWS=rows, BLOCK_H=block, num_warps=row_warps(rows * block))
        return dx.view(ctx.shape), dw_partial.sum(0).to(weight.dtype), None


# %% [markdown]
# The public function is the check followed by `apply`. Beside it sit the two things the rest of
# the page measures it against: the eager code it replaces (the parity reference of the demo)
# and its byte count (the roofline below).

# %%
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dim of x with the Triton kernels (forward and backward)."""
    _check_rms_inputs(x, weight)
    return _RMSNorm.apply(x, weight, float(eps))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """The eager torch code the kernel replaces (appendix B's RMSNorm.forward)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm_bytes(num_rows: int, hidden: int, dtype: torch.dtype,
                   num_programs: int = 528) -> dict[str, int]:
    """Bytes the kernels read + write: forward x, w in, y, rstd out; backward dy, x, w, rstd in,
    dx and the [G, h] fp32 partials out (G = 4 per SM, 528 on an H100 SXM)."""
    e = torch.empty((), dtype=dtype).element_size()
    act = num_rows * hidden * e
    forward = 2 * act + hidden * e + 4 * num_rows
    backward = 3 * act + hidden * e + 4 * num_rows + 2 * 4 * num_programs * hidden
    return {"forward": forward, "backward": backward}


# %% [markdown]
# ## How close to torch: a bound, not equality
#
# The kernel and the reference compute one formula, not the same bits. The reference sums the
# squares in torch's reduction order, the kernel in its own (each thread a run of lanes, then a
# tree across threads and warps), and compiled, `1.0 / tl.sqrt` becomes PTX's `sqrt.approx.f32`
# and `div.full.f32` where torch calls `rsqrtf`. Most bf16 outputs still agree bit for bit; a
# few are one rounding step apart. How far, with $u = 2^{-24}$ (fp32's unit roundoff):
#
# 1. **The sum of squares.** Summed in any order, $h$ non-negative rounded squares land within
#    $h u$ (to first order) of the exact sum: a summation's error is at most its depth, below
#    $h$, times $u$ times the sum of the terms' magnitudes (Higham, *Accuracy and Stability of
#    Numerical Algorithms*, §4.2). The mean and the $+\epsilon$ are two more roundings.
# 2. **Through the root.** $1/\sqrt{m}$ halves a relative error, the root itself adds at most
#    $6u$ (2 ulp for CUDA's `rsqrtf`; `sqrt.approx` plus `div.full` for the kernel, per the
#    CUDA and PTX manuals) and $n = x r$ one rounding. Two implementations' fp32 normalized
#    values therefore differ by at most $\rho |n|$, $\rho = (h + 16) u$: at most $4.9 \cdot
#    10^{-4}$ for the widest row the kernel takes, $h = 8192$, below $2^{-10}$.
# 3. **Rounding to bf16.** Values that close round to the same bf16 number or to neighbors:
#    the normalized values $\hat n$ differ by at most one step $\sigma(\hat n)$ (bf16's spacing,
#    $2^{-7} \cdot 2^{\lfloor \log_2 |\hat n| \rfloor}$). The weight scales that step, and rounding
#    the product adds at most one step of the output:
#    $|y_{\text{kernel}} - y_{\text{torch}}| \le |w| (\rho |\hat n| + \sigma(\hat n)) +
#    \sigma\big(|w| (|\hat n| + \rho |\hat n| + \sigma(\hat n))\big)$.
# 4. **How many.** An output moves only when a bf16 rounding boundary lies within $\rho |n|$ of
#    its normalized value; boundaries are more than $2^{-8} |n|$ apart, so at most a fraction
#    $2^8 \rho = (h + 16) / 2^{16}$ of the outputs move, 3.2% at $h = 2048$ (for values spread
#    evenly between boundaries). Rounding errors partly cancel, so in practice far fewer do.
#
# `rms_norm_forward_bound` is item 3 per element, `rms_norm_other_order` an emulation of
# another order (runs of `h / threads` lanes per thread, a tree over the threads, $1/\sqrt{\cdot}$
# for the reciprocal root). The demo and a CPU test check the bound against it, and the GPU
# test holds the compiled kernel to both items 3 and 4.

# %%
def _spacing(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gap between neighbors of `dtype` at |v| (eps times v's power of two), in fp32."""
    power = (v.float().view(torch.int32) & 0x7F800000).view(torch.float32)
    fi = torch.finfo(dtype)
    return fi.eps * power.clamp_min(fi.tiny)


def rms_norm_forward_bound(x: torch.Tensor, weight: torch.Tensor,
                           eps: float = 1e-5) -> torch.Tensor:
    """Per element, how far any fp32 summation order may move y from rms_norm_reference."""
    rho = (x.shape[-1] + 16) * 2.0 ** -24
    x32 = x.float()
    n = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float().abs()
    w = weight.float().abs()
    gap = rho * n + _spacing(n, x.dtype)
    return w * gap + _spacing(w * (n + gap), x.dtype)


def rms_norm_other_order(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                         threads: int = 256, acc_dtype: torch.dtype = torch.float32):
    """The forward with a kernel-like summation order (a CPU emulation of item 1)."""
    x32 = x.float()
    h = x32.shape[-1]
    squares = (x32 * x32).to(acc_dtype).reshape(-1, threads, h // threads)
    acc = squares[..., 0]
    for i in range(1, squares.shape[-1]):  # each thread sums its run of lanes in order
        acc = acc + squares[..., i]
    while acc.shape[1] > 1:                # then a tree across the threads
        acc = acc[:, : acc.shape[1] // 2] + acc[:, acc.shape[1] // 2:]
    r = 1.0 / torch.sqrt(acc.float() / h + eps)
    return (weight * (x32.reshape(-1, h) * r).to(x.dtype)).reshape(x.shape)


def rms_norm_moved(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   eps: float = 1e-5) -> tuple[int, float]:
    """(outputs of y that differ from rms_norm_reference, worst gap over its bound): items 3, 4."""
    gap = (y.float() - rms_norm_reference(x, weight, eps).float()).abs()
    return int((gap > 0).sum()), (gap / rms_norm_forward_bound(x, weight, eps)).max().item()


# %% [markdown]
# ## The roofline for the running example
#
# A TP rank of the running example (TP 2 with sequence parallelism, micro-batch 2, $s = 4096$)
# normalizes $s b / t = 4096$ tokens of $h = 4096$: 32 MiB of bf16. About 4 FLOPs per element
# against 4 bytes moved is an arithmetic intensity of ~1 FLOP/byte, far below an H100's ridge
# of $989\,\text{TFLOP/s} / 3.35\,\text{TB/s} = 295$ FLOP/byte: the kernel is memory-bound,
# and its best possible time is its bytes over the bandwidth.
#
# | pass | kernel bytes | kernel roofline (H100 SXM) | eager bytes (36 / 96 B per element) | eager roofline |
# |---|---|---|---|---|
# | forward | 67.1 MB | 20.0 µs | 606 MB | 181 µs |
# | backward | 118.0 MB (17.3 MB of it fp32 partials) | 35.2 µs | 1,614 MB | 482 µs |
#
# A pipeline stage of the running example holds 16 layers, so 32 norms run per micro-batch: the
# eager forward and backward would spend ~21 ms of pure memory time on normalization per
# micro-batch, the kernels ~1.8 ms. The benchmark (`benchmarks/bench_kernels.py`) measures the achieved bandwidth on a GPU.

# %% [markdown]
# ## Demo: equal to the reference, in fp32 and bf16, at a ragged width
#
# Rows of width 100 (a ragged block: 128 lanes, 28 masked) in fp32 and bf16 through both
# paths, forward and backward, with a non-contiguous upstream gradient; then the bytes each
# path moves, counted op by op for eager and from the kernel's loads and stores; then what
# autograd keeps for the backward. On a CPU the kernels run under Triton's interpreter.

# %%
if __name__ == "__main__":
    from tinytron.kernels._measure import EagerTraffic, saved_tensor_bytes

    def both_paths(dtype, n_rows=24, hidden=100):
        """Forward + backward through the kernel and the reference on the same inputs."""
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(n_rows, hidden, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        dy = torch.randn(hidden, n_rows, generator=gen).to(dtype).t()  # non-contiguous grad
        out = []
        for fn in (rms_norm, rms_norm_reference):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fn(xi, wi, 1e-5)
            y.backward(dy)
            out.append((y.float(), xi.grad.float(), wi.grad.float()))
        # the largest difference relative to the largest reference value, per tensor
        return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*out)]

    gaps32, gaps16 = both_paths(torch.float32), both_paths(torch.bfloat16)
    print("fp32 max |triton - torch| / max |torch| (y, dx, dw):", [f"{g:.1e}" for g in gaps32])
    print("bf16 max |triton - torch| / max |torch| (y, dx, dw):", [f"{g:.1e}" for g in gaps16])

# %% [markdown]
# Then the bytes. The dispatch-mode counter records every op the eager code runs; `rms_norm_bytes`
# gives the kernel's loads and stores. Last, what autograd keeps for the backward, for both paths.

# %%
if __name__ == "__main__":
    n_rows, hidden = 64, 256
    x = torch.randn(n_rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n_rows, hidden, dtype=torch.bfloat16)
    with EagerTraffic() as eager:
        y = rms_norm_reference(x, w)
        eager.phase = "backward"
        y.backward(dy)
    elements = n_rows * hidden
    per_elem = {p: eager.total(p) / elements for p in ("forward", "backward")}
    fused = rms_norm_bytes(n_rows, hidden, torch.bfloat16, num_programs=0)
    print("eager forward ops:", " ".join(eager.op_names("forward")))
    print(f"bytes per element, eager: forward {per_elem['forward']:.1f}, backward "
          f"{per_elem['backward']:.1f}; kernel: forward {fused['forward'] / elements:.1f}, "
          f"backward {fused['backward'] / elements:.1f}")
    _, saved_eager = saved_tensor_bytes(rms_norm_reference, x, w)
    _, saved_kernel = saved_tensor_bytes(rms_norm, x, w)
    print(f"saved for backward: eager {saved_eager / elements:.2f} B/element, "
          f"kernel {saved_kernel / elements:.2f} B/element")

# %% [markdown]
# An input the kernel cannot take is refused with a message, not computed wrong. Then the claims
# of the demo, in numbers.

# %%
if __name__ == "__main__":
    try:
        rms_norm(torch.randn(8, 6).t(), torch.ones(8))
        raise AssertionError("a transposed input must be refused")
    except ValueError as err:
        print("refused:", err)

    assert max(gaps32) < 1e-5
    assert max(gaps16) < 2 ** -6  # a couple of bf16 roundings (bf16 keeps 8 significant bits)
    assert round(per_elem["forward"]) == 36 and round(per_elem["backward"]) == 96
    assert round(fused["forward"] / elements) == 4 and round(fused["backward"] / elements) == 6
    assert saved_eager > 2.5 * saved_kernel

# %% [markdown]
# The bound against another summation order, at the GPU test's shape (2048 tokens of
# $h = 2048$, bf16): the emulated order moves a handful of the 4.2 M outputs (26 here), every
# one within its bound and the worst at 0.90 of it, so the bound is close to tight; and the
# count stays far below the $(h + 16)/2^{16}$ allowed. Three wrong kernels break it: summing
# the squares in bf16 exceeds the per-element bound, and rounding $r$ to bf16 or casting
# after the weight (instead of before) moves a quarter of the outputs.

# %%
if __name__ == "__main__":
    gen = torch.Generator().manual_seed(0)
    xb = torch.randn(2048, 2048, generator=gen).bfloat16()
    wb = (1 + 0.1 * torch.randn(2048, generator=gen)).bfloat16()
    allowed = xb.numel() * (2048 + 16) / 2 ** 16
    x32 = xb.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    wrong = {"squares summed in bf16": rms_norm_other_order(xb, wb, acc_dtype=torch.bfloat16),
             "r rounded to bf16": wb * (x32 * r.bfloat16().float()).bfloat16(),
             "cast after the weight": (x32 * r * wb.float()).bfloat16()}
    moved, worst = rms_norm_moved(rms_norm_other_order(xb, wb), xb, wb)  # (moved, gap / bound)
    print(f"another order: {moved} of {xb.numel():,} outputs moved (allowed {allowed:,.0f}), "
          f"worst gap / bound {worst:.2f}")
    broken = {name: rms_norm_moved(y, xb, wb) for name, y in wrong.items()}
    for name, (n, gap) in broken.items():
        print(f"{name}: {n:,} moved, worst gap / bound {gap:.2f}")
    assert 0 < moved <= allowed and worst <= 1
    assert all(n > allowed or gap > 1 for n, gap in broken.values())

# %% [markdown]
# ## Summary
#
# - A program reads its rows of $x$ once and writes $y$ and each row's $r$: 4 bytes per bf16
#   element against 36 for the eight eager ops.
# - The backward reuses $r$, writes $\partial L/\partial x$ row by row, and reduces
#   $\partial L/\partial w$ in two deterministic stages: per-program partials, then a sum.
# - Statistics in fp32, the cast before the weight, and the tolerances stated: fp32 equal to
#   $10^{-5}$; bf16 not bitwise equal to torch (another summation order), but within a derived
#   bound: one bf16 step of the normalized value times $|w|$ plus one step of the output, for
#   at most $(h + 16)/2^{16}$ of the outputs.
#
# ## How production does it
#
# - Megatron takes the fused norm from Transformer Engine (`TENorm`,
#   `megatron/core/extensions/transformer_engine.py:675`, with a fused residual variant at
#   `:505`) or Apex (`megatron/core/fusions/fused_layer_norm.py:30`, persistent kernels for a
#   list of hidden sizes at `:73`); `megatron/core/transformer/torch_norm.py` is the eager
#   fallback this page's reference mirrors.
# - Fusing the norm into the next matmul (`TELayerNormColumnParallelLinear`,
#   `transformer_engine.py:989`) removes even the write of $y$.
#
# ## Exercises
#
# 1. Fuse the residual add into the forward: read $x$ and the residual, write the new residual
#    and $y$. How many bytes per element does that save over two kernels?
#
#    <details><summary>Answer</summary>
#
#    In bf16, two kernels move 10 bytes per element in the
#    forward: the add reads $x$ and the residual and writes the new residual (6), the norm reads
#    it back and writes $y$ (4, as <code>rms_norm_bytes</code> counts). The fused kernel reads $x$
#    and the residual and writes the new residual and $y$: 8. It saves the 2-byte re-read of the
#    new residual, a fifth of the traffic.
#
#    </details>
#
# 2. Replace the two-stage weight reduction with `tl.atomic_add`. What changes in the result
#    from run to run, and why does that matter for chapter 08's reproducibility checks?
#
#    <details><summary>Hint</summary>
#
#    Floating-point addition is not associative. With atomics the
#    order in which the programs add into $dw$ depends on which finishes first, so the last bits
#    of $dw$ change from run to run. Look at how <code>_RMSNorm.backward</code> sums
#    <code>dw_partial</code> in a fixed order, and at what chapter 08 compares bit for
#    bit.
#
#    </details>
#
# 3. At which hidden size does one row no longer fit one program's registers, and what would
#    a two-pass (sum, then normalize) kernel cost in extra reads?
#
#    <details><summary>Answer</summary>
#
#    Above <code>MAX_ROW_LANES</code> = 8,192: 16 warps of 32
#    threads holding 16 fp32 values each, $16 \cdot 32 \cdot 16 = 8192$ lanes;
#    <code>_check_rms_inputs</code> refuses a wider row. A two-pass kernel reads $x$ twice, once
#    for the sum of squares and once to normalize: in bf16 the forward goes from 4 to 6 bytes per
#    element, 50% more.
#
#    </details>
