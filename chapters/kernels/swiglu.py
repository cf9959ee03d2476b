# %% [markdown]
# # C.2 · Kernels: SwiGLU, the gate and the up half read once
#
# Between the MLP's two matmuls sits $\mathrm{silu}(\text{gate}) \odot \text{up}$: elementwise,
# so its time is all memory traffic, and eagerly it is two ops in the forward and a small graph
# of them in the backward, with an extra $[N, f]$ tensor kept alive for the backward. One kernel
# each way reads the fc1 output once and writes once, and keeps nothing but its input.
#
# You will build: `swiglu` (Triton, forward and backward) beside `swiglu_reference`, and
# `swiglu_bytes`.

# %%
from __future__ import annotations

import torch
import torch.nn.functional as F

from tinytron.kernels._triton import (INTERPRET, check_tensor, round_to, row_warps,
                                      rows_per_program, tl, triton)

__all__ = ["swiglu", "swiglu_reference", "swiglu_bytes"]

# %% [markdown]
# ## The layout the kernel reads
#
# Appendix B's `linear_fc1` produces, per token, the $f/t$ gate values followed by the $f/t$ up
# values of this TP rank: a row of $2f/t$ (`SwiGLUMLP.forward` splits it with `chunk(2, -1)`,
# Megatron's `swiglu` at `megatron/core/fusions/fused_bias_swiglu.py:16`). A program of the
# kernel owns a tile of rows and one block of `BLOCK` columns $[j B, (j + 1) B)$:
# it loads those columns of the gate half and the *same* columns of the up half ($f$ elements
# further along each row), and writes that block of the output.
#
# On a GPU a tile is 4 rows of 1024 columns (4096 lanes) with 8 warps, 16 fp32 values of each
# tensor per thread, the rule of `row_warps` on page [C.1](rmsnorm.py). Compiled ahead of time
# at the running example's $f = 14336$, the forward takes 45 registers per thread and the
# backward (gate, up and $g$ live together) 80, on sm_80 and sm_90 alike, with no spills and no
# shared memory. Under the interpreter the blocks are 64 columns, so small tests stay ragged.
#
# ```mermaid
# flowchart LR
#   subgraph IN["fc1 output row (2f values)"]
#     G["gate[jB:(j+1)B]"]
#     U["up[jB:(j+1)B]<br/>(offset f)"]
#   end
#   G --> K["program (row tile, j):<br/>silu(g) * u in fp32"]
#   U --> K
#   K --> O["out[row, jB:(j+1)B]"]
# ```
#
# The grid puts row tiles on its first axis (CUDA allows $2^{31} - 1$ there, and a micro-batch
# can hold more than the 65,535 tokens the second axis takes) and column blocks on the second.
#
# **Bytes.** For $N$ tokens and width $f$ in bf16 the kernel reads $2Nf$ and writes $Nf$
# elements: 6 bytes per output element. Eagerly, `silu` reads the gate and writes $s$, `mul`
# reads $s$ and up and writes the output: 10 bytes. The backward is where eager loses most: the
# demo counts 26 bytes per output element (two `mul`s, `silu_backward`, and the `cat` that
# assembles the fc1 gradient from its two halves) against the kernel's 10 (read $g$, gate, up;
# write both halves in place in one $[N, 2f]$ gradient).

# %%
@triton.jit
def _swiglu_fwd_kernel(x_ptr, out_ptr, n_rows, f, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out[rows, cols] = silu(x[rows, cols]) * x[rows, f + cols], in fp32."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < f)
    in_offs = rows.to(tl.int64)[:, None] * 2 * f + cols[None, :]
    gate = tl.load(x_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + in_offs + f, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    out_offs = rows.to(tl.int64)[:, None] * f + cols[None, :]
    tl.store(out_ptr + out_offs, round_to(out, out_ptr.dtype.element_ty), mask=mask)


# %% [markdown]
# ## The backward
#
# With $\sigma = \mathrm{sigmoid}(a)$ for the gate $a$, $\mathrm{silu}(a) = a\sigma$ and
# $\mathrm{silu}'(a) = \sigma\,(1 + a(1 - \sigma))$. For an upstream gradient $g$:
#
# $$\partial\,\text{up} = g \cdot a\sigma, \qquad \partial\,\text{gate} = g \cdot \text{up} \cdot
#   \sigma\,(1 + a(1 - \sigma)).$$
#
# The kernel recomputes $\sigma$ from the saved fc1 output instead of keeping
# $\mathrm{silu}(a)$ from the forward: one `exp` per element is free for a memory-bound kernel,
# and the $[N, f]$ tensor eager autograd saves is not kept at all. Megatron's `SwiGLUFunction`
# makes the same choice (`fused_bias_swiglu.py:147`, the backward formula at `:55`).
#
# Worked example, $a = 1$, up $= 2$, $g = 1$: $\sigma = 0.7311$, output $= 1.4621$,
# $\partial\,\text{up} = 0.7311$, $\partial\,\text{gate} = 2 \cdot 0.7311 \cdot 1.2689 = 1.8553$.

# %%
@triton.jit
def _swiglu_bwd_kernel(x_ptr, dy_ptr, dx_ptr, n_rows, f, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """d gate and d up of out = silu(gate) * up, written into one [N, 2f] gradient."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < f)
    in_offs = rows.to(tl.int64)[:, None] * 2 * f + cols[None, :]
    gate = tl.load(x_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + in_offs + f, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * f + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = dy * gate * sig
    tl.store(dx_ptr + in_offs, round_to(d_gate, dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + in_offs + f, round_to(d_up, dx_ptr.dtype.element_ty), mask=mask)


# %%
def _tiles(n_rows: int, f: int) -> tuple[int, int, tuple[int, int]]:
    """(ROWS, BLOCK, grid): 1024 columns compiled, 64 interpreted (small tests stay ragged)."""
    block = min(64 if INTERPRET else 1024, triton.next_power_of_2(f))
    rows = rows_per_program(block)
    return rows, block, (triton.cdiv(n_rows, rows), triton.cdiv(f, block))


# %% [markdown]
# The autograd function launches the two kernels on the same tiles. It keeps only the fc1 output
# for the backward, which recomputes the sigmoid from it.

# %%
class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        two_f = x.shape[-1]
        f = two_f // 2
        x2 = x.view(-1, two_f)
        out = torch.empty(x2.shape[0], f, dtype=x.dtype, device=x.device)
        rows, block, grid = _tiles(x2.shape[0], f)
        _swiglu_fwd_kernel[grid](x2, out, x2.shape[0], f, ROWS=rows, BLOCK=block,
                                 num_warps=row_warps(rows * block))
        ctx.save_for_backward(x2)
        ctx.shape = x.shape
        return out.view(*x.shape[:-1], f)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        f = x2.shape[1] // 2
        dy2 = dy.contiguous().view(-1, f)
        dx = torch.empty_like(x2)
        rows, block, grid = _tiles(x2.shape[0], f)
        _swiglu_bwd_kernel[grid](x2, dy2, dx, x2.shape[0], f, ROWS=rows, BLOCK=block,
                                 num_warps=row_warps(rows * block))
        return dx.view(ctx.shape)


# %% [markdown]
# The public function checks its input and calls `apply`. Beside it sit the eager code it
# replaces, the parity reference of the demo, and the kernel's byte count for the roofline below.

# %%
def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :f]) * x[..., f:] for x [..., 2f], with the Triton kernels."""
    check_tensor("swiglu input (fc1 output)", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"swiglu input must have an even last dim (gate and up halves), "
                         f"got shape {tuple(x.shape)}")
    return _SwiGLU.apply(x)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """The eager torch code the kernel replaces (appendix B's SwiGLUMLP, between the matmuls)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_bytes(num_rows: int, f: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes the kernels read + write: forward 2Nf in, Nf out; backward 3Nf in, 2Nf out."""
    e = torch.empty((), dtype=dtype).element_size()
    return {"forward": 3 * num_rows * f * e, "backward": 5 * num_rows * f * e}


# %% [markdown]
# ## The roofline for the running example
#
# The MLP works on the whole sequence of the micro-batch (sequence parallelism all-gathers it
# before fc1): $N = s b = 8192$ tokens and $f / t = 7168$ columns on a TP rank, 58.7 M output
# elements. Three FLOPs-ish per element for a handful of bytes: memory-bound, like every
# elementwise kernel.
#
# | pass | kernel bytes | kernel roofline (H100 SXM) | eager bytes | eager roofline |
# |---|---|---|---|---|
# | forward | 352 MB | 105 µs | 587 MB | 175 µs |
# | backward | 587 MB | 175 µs | 1,527 MB | 456 µs |
#
# and the memory: eager autograd keeps $\mathrm{silu}(a)$, $[N, f]$ in bf16, per layer per
# micro-batch in flight: 117 MB per layer, 1.9 GB for a stage's 16 layers. The kernel keeps
# only the fc1 output, which eager keeps too.

# %% [markdown]
# ## Demo: equal to the reference, fewer bytes, less kept for the backward
#
# Forward and backward of both paths on a ragged width ($f = 100$ with 64-column blocks),
# fp32 and bf16, with a non-contiguous upstream gradient; then the bytes of the eager ops
# against the kernel's, and what autograd keeps alive for the backward.

# %%
if __name__ == "__main__":
    from tinytron.kernels._measure import EagerTraffic, saved_tensor_bytes

    def both_paths(dtype, n_rows=12, f=100):
        """Relative max difference of output and input gradient, kernel vs reference."""
        gen = torch.Generator().manual_seed(0)
        x = (2 * torch.randn(n_rows, 2 * f, generator=gen)).to(dtype)
        dy = torch.randn(f, n_rows, generator=gen).to(dtype).t()
        out = []
        for fn in (swiglu, swiglu_reference):
            xi = x.clone().requires_grad_()
            y = fn(xi)
            y.backward(dy)
            out.append((y.float(), xi.grad.float()))
        return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*out)]

    gaps32, gaps16 = both_paths(torch.float32), both_paths(torch.bfloat16)
    print("fp32 (out, grad) relative gap:", [f"{g:.1e}" for g in gaps32])
    print("bf16 (out, grad) relative gap:", [f"{g:.1e}" for g in gaps16])

# %% [markdown]
# The worked example above, through the kernel: gate 1, up 2 gives the gradients 1.8553 and
# 0.7311.

# %%
if __name__ == "__main__":
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)  # the worked example: gate 1, up 2
    swiglu(x).backward(torch.ones(1, 1))
    print("worked example grad (gate, up):", [round(v, 4) for v in x.grad.flatten().tolist()])

# %% [markdown]
# Then the bytes of the eager ops against the kernel's, and what autograd keeps alive for the
# backward; the asserts at the end state all of the demo's claims.

# %%
if __name__ == "__main__":
    n, f = 64, 256
    xb = torch.randn(n, 2 * f, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, f, dtype=torch.bfloat16)
    with EagerTraffic() as eager:
        y = swiglu_reference(xb)
        eager.phase = "backward"
        y.backward(dy)
    per = {p: eager.total(p) / (n * f) for p in ("forward", "backward")}
    fused = {k: v / (n * f) for k, v in swiglu_bytes(n, f, torch.bfloat16).items()}
    print(f"bytes per output element: eager {per}, kernel {fused}")
    print("eager backward ops:", " ".join(eager.op_names("backward")))
    _, saved_eager = saved_tensor_bytes(swiglu_reference, xb)
    _, saved_kernel = saved_tensor_bytes(swiglu, xb)
    print(f"kept for backward: eager {saved_eager} B, kernel {saved_kernel} B "
          f"(the fc1 output is {xb.numel() * 2} B)")

    assert max(gaps32) < 1e-6 and max(gaps16) < 2 ** -7
    assert [round(v, 4) for v in x.grad.flatten().tolist()] == [1.8553, 0.7311]
    assert per == {"forward": 10.0, "backward": 26.0} and fused == {"forward": 6, "backward": 10}
    assert saved_kernel == xb.numel() * 2 and saved_eager == saved_kernel + n * f * 2

# %% [markdown]
# ## Summary
#
# - One program per (row tile, column block) reads the gate block and the up block $f$ apart and
#   writes one output block: 6 bytes per bf16 element forward, 10 backward, against 10 and 26
#   eagerly.
# - The backward recomputes the sigmoid instead of keeping $\mathrm{silu}(\text{gate})$: an
#   $[N, f]$ tensor per layer less in flight between forward and backward.
# - The gradient lands in one $[N, 2f]$ tensor laid out like the fc1 output, so no `cat`.
#
# ## How production does it
#
# - Megatron: `megatron/core/fusions/fused_bias_swiglu.py` (`swiglu:16`, `swiglu_back:55`,
#   `SwiGLUFunction:147` saving only the input, optionally in fp8), called from
#   `megatron/core/transformer/mlp.py:270-303` when `bias_activation_fusion` is on; those are
#   `torch.jit` / `torch.compile` fusions rather than hand-written kernels.
# - Transformer Engine's fused MLP (`TEFusedMLP`, `megatron/core/extensions/transformer_engine.py:2504`)
#   goes further and fuses the activation into the surrounding GEMMs' epilogues.
#
# ## Exercises
#
# 1. Fuse the activation into fc1's epilogue: which bytes disappear, and what must the
#    backward then recompute?
#
#    <details><summary>Hint</summary>
#
#    Follow the fc1 output $[N, 2f]$ in <code>swiglu_bytes</code>:
#    fused into the epilogue it is never written or read back, only $[N, f]$ is written. But
#    <code>_SwiGLU.backward</code> needs the gate and up halves; without them the backward must
#    recompute fc1's output (a matmul) or keep it anyway.
#
#    </details>
#
# 2. Store the saved fc1 output in fp8 (Megatron's `fp8_input_store`): how much memory does
#    that save per layer of the running example, and what does it cost in accuracy?
#
#    <details><summary>Answer</summary>
#
#    The saved fc1 output is $[N, 2f/t] = 8192 \times 14336$ per
#    TP rank, 117.4 M elements. One byte instead of two saves 117 MB per layer per micro-batch in
#    flight, 1.88 GB for a stage's 16 layers. The cost: fp8 (e4m3) keeps 4 significant bits
#    against bf16's 8, and a range of about $\pm 448$, so the gradients computed from the stored
#    input carry that coarser rounding.
#
#    </details>
#
# 3. Megatron's `bias_swiglu` adds a bias before the activation. Add one to the kernels and
#    return its gradient (a column sum, like RMSNorm's weight).
#
#    <details><summary>Hint</summary>
#
#    The forward loads one bias block per column block and adds it
#    before the sigmoid. The bias gradient is $d\,\text{gate}$ and $d\,\text{up}$ summed over
#    rows: write per-program partials as <code>_RMSNorm.backward</code> does with
#    <code>dw_partial</code>, then sum them. Megatron's version is
#    <code>megatron/core/fusions/fused_bias_swiglu.py</code>.
#
#    </details>
