# %% [markdown]
# # A.2 · Tensor and sequence parallelism: regions and parallel linears
#
# One matrix multiply cut across `tp` ranks, forward and backward, written as four autograd
# "regions" plus three sequence-parallel ones; then the two linears a transformer needs,
# `ColumnParallelLinear` and `RowParallelLinear`, checked against a dense `nn.Linear`.

# %%
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tinytron.parallel._comm import (all_gather_dim, all_gather_dim_async, all_reduce,
                                     reduce_scatter_dim, reduce_scatter_dim_async, split_dim)
from tinytron.parallel.grid import ParallelGrid

__all__ = [
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "set_tensor_parallel_attributes",
    "normal_init", "shard_tensor", "gather_shards", "linear_with_sequence_parallel_gather",
    "ColumnParallelLinear", "RowParallelLinear",
]

# %% [markdown]
# ## Why regions
#
# A linear layer $Y = X W^\top$ with $W \in \mathbb{R}^{o \times i}$ can be cut two ways across
# $t$ ranks:
#
# - **column-parallel**: each rank holds $o/t$ rows of $W$ and computes $o/t$ output features
#   from the *full* input. Forward needs no communication; backward must **sum** the input
#   gradients of all ranks, because every rank used all of $X$.
# - **row-parallel**: each rank holds $i/t$ columns of $W$ and its slice of $X$'s features, and
#   computes a *partial* $Y$. Forward must **sum** the partial outputs; backward needs nothing.
#
# Column then row (the MLP's `fc1` → `fc2`, attention's QKV → output projection) costs one
# all-reduce forward and one backward per block. Megatron names the two conjugate operations
# (`megatron/core/tensor_parallel/mappings.py`):
#
# | region | forward | backward | Megatron |
# |---|---|---|---|
# | `copy_to_tp_region` | identity | all-reduce | `_CopyToModelParallelRegion` `:197` |
# | `reduce_from_tp_region` | all-reduce | identity | `_ReduceFromModelParallelRegion` `:217` |
# | `scatter_to_tp_region` | split last dim | all-gather last dim | `:236` |
# | `gather_from_tp_region` | all-gather last dim | split last dim | `:256` |
#
# **Sequence parallelism** notices that between the blocks (norms, dropout, residual adds) every
# TP rank holds the same $[s, b, h]$ tensor: wasteful. Keep $s/t$ of the sequence per rank there,
# and replace each all-reduce by a reduce-scatter (leaving a block) plus an all-gather (entering
# the next one). Same bytes on the wire — an all-reduce *is* a reduce-scatter plus an
# all-gather — and activation memory between blocks divided by $t$:
#
# | region | forward | backward | Megatron |
# |---|---|---|---|
# | `scatter_to_sequence_parallel_region` | split seq dim | all-gather seq dim | `:276` |
# | `gather_from_sequence_parallel_region` | all-gather seq dim | reduce-scatter seq dim | `:296` |
# | `reduce_scatter_to_sequence_parallel_region` | reduce-scatter seq dim | all-gather seq dim | `:351` |
#
# **Layout.** As in Megatron, activations inside the layers are $[s, b, h]$, so the sequence dim
# is `dim=0` by default; every sequence-parallel function and layer takes `sequence_dim` so a
# $[b, s, h]$ caller can pass `sequence_dim=1`. The TP-split features are always the last dim.
#
# ```mermaid
# flowchart LR
#   X["X [s/t,b,h]"] -->|all-gather s| G["X [s,b,h]"]
#   G --> C["column: X W1_r^T  [s,b,f/t]"]
#   C --> R["row: . W2_r^T  partial [s,b,h]"]
#   R -->|reduce-scatter s| Y["Y [s/t,b,h]"]
# ```

# %%
class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid):
        ctx.grid = grid
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.grid, "tp"), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid):
        return all_reduce(x, grid, "tp")

    @staticmethod
    def backward(ctx, g):
        return g, None


# %% [markdown]
# `_Copy` and `_Reduce` are the pair of plain tensor parallelism: the identity one way, the all-
# reduce the other. The next two are a mirrored pair too: keep my slice forward and all-gather the
# gradient, or all-gather forward and reduce-scatter (or split) the gradient.

# %%
class _Split(torch.autograd.Function):
    """Forward keeps my slice of `dim`; backward all-gathers the slices back."""

    @staticmethod
    def forward(ctx, x, grid, dim):
        ctx.grid, ctx.dim = grid, dim
        return split_dim(x, grid, "tp", dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim(g, ctx.grid, "tp", ctx.dim), None, None


class _Gather(torch.autograd.Function):
    """Forward all-gathers along `dim`; backward reduce-scatters (or just splits) the grad."""

    @staticmethod
    def forward(ctx, x, grid, dim, reduce_grad):
        ctx.grid, ctx.dim, ctx.reduce_grad = grid, dim, reduce_grad
        return all_gather_dim(x, grid, "tp", dim)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_grad:
            return reduce_scatter_dim(g, ctx.grid, "tp", ctx.dim), None, None, None
        return split_dim(g, ctx.grid, "tp", ctx.dim), None, None, None


# %% [markdown]
# Sequence parallelism's exit: sum the partial outputs and keep my slice of the sequence in one
# reduce-scatter; the gradient comes back by all-gather.

# %%
class _ReduceScatter(torch.autograd.Function):
    """Forward reduce-scatters along `dim`; backward all-gathers the grad."""

    @staticmethod
    def forward(ctx, x, grid, dim):
        ctx.grid, ctx.dim = grid, dim
        return reduce_scatter_dim(x, grid, "tp", dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim(g, ctx.grid, "tp", ctx.dim), None, None

# %%
def copy_to_tp_region(x: torch.Tensor, grid: ParallelGrid) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over TP backward."""
    return _Copy.apply(x, grid) if grid.size("tp") > 1 else x


def reduce_from_tp_region(x: torch.Tensor, grid: ParallelGrid) -> torch.Tensor:
    """All-reduce over TP forward; identity backward."""
    return _Reduce.apply(x, grid) if grid.size("tp") > 1 else x


def scatter_to_tp_region(x: torch.Tensor, grid: ParallelGrid) -> torch.Tensor:
    """Keep my slice of the last dim forward; all-gather the last dim backward."""
    return _Split.apply(x, grid, x.dim() - 1) if grid.size("tp") > 1 else x


def gather_from_tp_region(x: torch.Tensor, grid: ParallelGrid) -> torch.Tensor:
    """All-gather the last dim forward; keep my slice of the gradient backward."""
    return _Gather.apply(x, grid, x.dim() - 1, False) if grid.size("tp") > 1 else x


def scatter_to_sequence_parallel_region(x: torch.Tensor, grid: ParallelGrid,
                                        sequence_dim: int = 0) -> torch.Tensor:
    """Keep my 1/tp of the sequence forward; all-gather the sequence backward."""
    return _Split.apply(x, grid, sequence_dim) if grid.size("tp") > 1 else x


def gather_from_sequence_parallel_region(x: torch.Tensor, grid: ParallelGrid, sequence_dim: int = 0,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence forward; reduce-scatter (or split, if the consumer is replicated) backward."""
    if grid.size("tp") == 1:
        return x
    return _Gather.apply(x, grid, sequence_dim, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, grid: ParallelGrid,
                                               sequence_dim: int = 0) -> torch.Tensor:
    """Sum over TP and keep my 1/tp of the sequence forward; all-gather backward."""
    return _ReduceScatter.apply(x, grid, sequence_dim) if grid.size("tp") > 1 else x

# %% [markdown]
# `gather_from_sequence_parallel_region` has two backwards. When the gathered tensor feeds a
# TP-split computation (a column-parallel linear), each rank's gradient is a *partial* sum over
# its output features: reduce-scatter. When it feeds something every rank computes identically,
# each rank already has the full gradient: just split (`tensor_parallel_output_grad=False`).
#
# ## Parameters and initialization
#
# Each sharded parameter carries the attributes Megatron's optimizer and checkpoint code read
# (`set_tensor_model_parallel_attributes`, `megatron/core/tensor_parallel/layers.py:104`):
# `tensor_model_parallel = True`, `partition_dim` (the dim that is split), `partition_stride = 1`.
# A parameter that is replicated over TP but sees only $1/t$ of the tokens under sequence
# parallelism (the row-parallel bias, the norms) gets `sequence_parallel = True`: its gradient
# must be all-reduced over TP before the optimizer step
# ([chapter 05](../05_buffers/finalize_model_grads.py)).
#
# To make the **full** weight identical whatever `tp` is, each layer materializes the full
# $[o, i]$ master weight in fp32 on the CPU from a seeded generator and keeps its slice —
# Megatron's `_initialize_affine_weight_cpu` (`layers.py:152`, used with
# `--use-cpu-initialization`). `normal_init(std, seed)` builds such an initializer; give every
# layer its own seed.

# %%
def set_tensor_parallel_attributes(param: torch.nn.Parameter, partition_dim: int) -> None:
    """Mark a TP-sharded parameter: tensor_model_parallel, partition_dim, partition_stride."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1


def normal_init(std: float = 0.02, seed: int = 0) -> Callable[[torch.Tensor], None]:
    """An init method filling the FULL weight from N(0, std^2) with its own seeded CPU generator."""
    def init(weight: torch.Tensor) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            weight.normal_(0.0, std, generator=gen)
    return init


# %% [markdown]
# Loading and exporting full weights needs the two directions of one cut: my slice of a full
# tensor, and the full tensor from every rank's slice.

# %%
def shard_tensor(full: torch.Tensor, grid: ParallelGrid, partition_dim: int) -> torch.Tensor:
    """This TP rank's slice of a full tensor along `partition_dim` (for loading full weights)."""
    size = grid.size("tp")
    if full.shape[partition_dim] % size:
        raise ValueError(f"dim {partition_dim} of shape {tuple(full.shape)} is not divisible "
                         f"by tp={size}")
    return full.chunk(size, dim=partition_dim)[grid.rank("tp")].clone()


def gather_shards(shard: torch.Tensor, grid: ParallelGrid, partition_dim: int) -> torch.Tensor:
    """The full tensor from every TP rank's slice (no autograd; for export and tests)."""
    with torch.no_grad():
        return all_gather_dim(shard.detach(), grid, "tp", partition_dim)


# %% [markdown]
# The layers below build their weight from these: the full fp32 tensor on the CPU, initialized,
# then only this rank's slice kept as the parameter.

# %%
def _make_sharded_weight(shape, partition_dim, grid, init_method, device, dtype):
    """Create the full weight on CPU in fp32 with `init_method`, keep my TP slice as a Parameter."""
    full = torch.empty(shape, dtype=torch.float32)
    (init_method or normal_init())(full)
    weight = torch.nn.Parameter(shard_tensor(full, grid, partition_dim).to(device=device, dtype=dtype))
    set_tensor_parallel_attributes(weight, partition_dim)
    return weight


def _check_divisible(name: str, value: int, grid: ParallelGrid) -> int:
    tp = grid.size("tp")
    if value % tp:
        raise ValueError(f"{name}={value} is not divisible by tp={tp}")
    return value // tp

# %% [markdown]
# ## The two linears
#
# `ColumnParallelLinear` (`layers.py:778`) splits the output features: its weight is
# $[o/t, i]$ (`partition_dim=0`) and its bias $[o/t]$. Its input enters through
# `copy_to_tp_region`, or, under sequence parallelism, through
# an all-gather of the sequence (input $[s/t, b, i]$ → $[s, b, i]$, below). `gather_output=True`
# returns the full $o$ features (the dense-equivalent output).
#
# `RowParallelLinear` (`layers.py:1142`) splits the input features: weight $[o, i/t]$
# (`partition_dim=1`). Its output leaves through `reduce_from_tp_region` or, under sequence
# parallelism, `reduce_scatter_to_sequence_parallel_region` ($[s, b, o]$ partial →
# $[s/t, b, o]$ summed). The bias is added **after** the reduction (added before, it would be
# summed $t$ times), so it is replicated and flagged `sequence_parallel` under SP.
#
# <details><summary>Megatron detail: the (output, bias) return</summary>
#
# <p>Both linears return just the output tensor; Megatron's return <code>(output, bias)</code> so
# that the caller can fuse the bias add into the next op.</p>
#
# </details>
#
# ## Under SP, save the slice and gather again in backward
#
# The column-parallel linear's weight gradient needs the whole input, $[s, b, i]$. Left to
# autograd, `gather_from_sequence_parallel_region` followed by `F.linear` keeps the gathered
# tensor until backward: $t$ times this rank's slice, in every linear after a norm (QKV and
# fc1 in each layer). Megatron keeps only the local $[s/t, b, i]$ slice and runs the all-gather
# a second time in backward. The backward also overlaps its communication: the re-gather runs
# while the input-gradient GEMM does, and the input gradient's reduce-scatter while the
# weight-gradient GEMM does.
#
# <details><summary>Megatron detail: where, line by line</summary>
#
# `LinearWithGradAccumulationAndAsyncCommunication`,
# `megatron/core/tensor_parallel/layers.py:464`: the forward saves the ungathered input at
# `:486` and gathers into a scratch buffer at `:499-505`; the backward re-gathers it
# asynchronously at `:543-545`. The re-gather runs beside the input-gradient GEMM (`:552`,
# waited at `:556`), the input gradient's reduce-scatter (`:576-578`) beside the weight-gradient
# GEMM (`:651`, waited at `:655`).
#
# </details>
#
# `linear_with_sequence_parallel_gather` is that function, and `ColumnParallelLinear` calls it
# under SP. It saves this rank's slice of $X$ and $W$; its backward starts the all-gather of the
# slice, computes $\partial X = G W$, waits, starts the reduce-scatter of $\partial X$,
# computes $\partial W = G^\top X$, and waits again. Each GEMM is the call autograd's
# `MmBackward0` makes for `F.linear` (same operands, same transposes), so the gradients equal
# those of the gather-then-`F.linear` form bit for bit; the tests compare them. At $s = 4096$,
# $b = 1$, $h = 4096$ in bf16 and $t = 4$ each of the two linears of a layer now keeps 8 MiB
# instead of 32; the price is one more all-gather per linear in backward, hidden behind a GEMM
# on a GPU.

# %%
class _LinearGatheredInput(torch.autograd.Function):
    """all_gather_seq(X) W^T + b, saving the local X slice; backward gathers it again."""

    @staticmethod
    def forward(ctx, x, weight, bias, grid, dim):
        ctx.grid, ctx.dim, ctx.has_bias = grid, dim, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_dim(x, grid, "tp", dim), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gathered = all_gather_dim_async(x, ctx.grid, "tp", ctx.dim)  # runs under the next GEMM
        g2d = grad.reshape(-1, grad.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            full = g2d.mm(weight).view(*grad.shape[:-1], weight.shape[1])
            grad_x = reduce_scatter_dim_async(full, ctx.grid, "tp", ctx.dim)
        total = gathered()
        grad_w = g2d.t().mm(total.reshape(-1, total.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = g2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (grad_x() if grad_x is not None else None), grad_w, grad_b, None, None


def linear_with_sequence_parallel_gather(x: torch.Tensor, weight: torch.Tensor,
                                         bias: torch.Tensor | None, grid: ParallelGrid,
                                         sequence_dim: int = 0) -> torch.Tensor:
    """F.linear of the TP-gathered sequence, keeping only this rank's slice for backward."""
    if grid.size("tp") == 1:
        return F.linear(x, weight, bias)
    return _LinearGatheredInput.apply(x, weight, bias, grid, sequence_dim)

# %%
class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split by output rows over TP; input [s, b, in] (or [s/tp, b, in] under SP)."""

    def __init__(self, input_size: int, output_size: int, grid: ParallelGrid, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, sequence_dim: int = 0,
                 init_method: Callable[[torch.Tensor], None] | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        if sequence_parallel and gather_output:
            raise ValueError("gather_output=True is not supported with sequence_parallel=True")
        self.grid, self.input_size, self.output_size = grid, input_size, output_size
        self.output_size_per_partition = _check_divisible("output_size", output_size, grid)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.sequence_dim = sequence_dim
        device = device if device is not None else grid.device
        self.weight = _make_sharded_weight((output_size, input_size), 0, grid, init_method, device, dtype)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(self.output_size_per_partition, device=device, dtype=dtype))
            set_tensor_parallel_attributes(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = linear_with_sequence_parallel_gather(x, self.weight, self.bias, self.grid,
                                                     self.sequence_dim)
        else:
            y = F.linear(copy_to_tp_region(x, self.grid), self.weight, self.bias)
        return gather_from_tp_region(y, self.grid) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} "
                f"(local {self.output_size_per_partition}), sp={self.sequence_parallel}")


# %% [markdown]
# The row-parallel twin: its input arrives already split along the features (the column
# layer's output), its partial products are summed over TP, and the bias comes after the sum.

# %%
class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split by input columns over TP; output [s, b, out] (or [s/tp, b, out] under SP)."""

    def __init__(self, input_size: int, output_size: int, grid: ParallelGrid, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, sequence_dim: int = 0,
                 init_method: Callable[[torch.Tensor], None] | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True")
        self.grid, self.input_size, self.output_size = grid, input_size, output_size
        self.input_size_per_partition = _check_divisible("input_size", input_size, grid)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.sequence_dim = sequence_dim
        device = device if device is not None else grid.device
        self.weight = _make_sharded_weight((output_size, input_size), 1, grid, init_method, device, dtype)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, device=device, dtype=dtype))
            self.bias.sequence_parallel = sequence_parallel  # replicated: grad all-reduced over TP under SP
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.grid)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.grid, self.sequence_dim)
        else:
            y = reduce_from_tp_region(partial, self.grid)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (local {self.input_size_per_partition}), "
                f"out={self.output_size}, sp={self.sequence_parallel}")

# %% [markdown]
# ## Demo: a TP MLP equals the dense MLP
#
# Two ranks run `fc1` (column) → GELU → `fc2` (row) on a $[s{=}8, b{=}2, h{=}16]$ input, with and
# without sequence parallelism, and compare output, input gradient and the full weight
# gradients (gathered from the shards) against one dense `nn.Linear` pair built from the same
# seeds. Under SP, `fc2.bias` saw only half the tokens on each rank, so its gradient is summed
# over TP first — exactly what the `sequence_parallel` flag asks the optimizer to do.

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.parallel._workers import tp_mlp_both_modes

    errors = run_on_ranks(tp_mlp_both_modes, 2)  # per rank: [without SP, with SP]
    for i, sp in enumerate((False, True)):
        print(f"sequence_parallel={sp}: max |tp - dense| per rank:", [f"{e[i]:.1e}" for e in errors])
    assert max(max(e) for e in errors) < 1e-5

# %% [markdown]
# ## Summary
#
# - Column-parallel needs an all-reduce of the input gradient; row-parallel an all-reduce of the
#   output. The regions put exactly those collectives into autograd.
# - Sequence parallelism swaps each all-reduce for reduce-scatter + all-gather and keeps only
#   $s/t$ tokens per rank between blocks; the replicated parameters there need a TP gradient
#   all-reduce (`param.sequence_parallel`).
# - Initializing the full weight and slicing it makes every TP layout start from the same model.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/tensor_parallel/mappings.py` (regions),
#   `megatron/core/tensor_parallel/layers.py` (`ColumnParallelLinear` `:778`,
#   `RowParallelLinear` `:1142`, the fused weight-grad accumulation into `main_grad` and the
#   async all-gather/grad-reduce overlap at `:464`). Transformer Engine's `TELinear` replaces
#   these on GPUs and overlaps the TP communication with the GEMMs.
# - torchtitan: `ColwiseParallel` / `RowwiseParallel` / `SequenceParallel` from
#   `torch.distributed.tensor.parallel`, expressed as DTensor placements
#   (`torchtitan/models/llama3/infra/parallelize.py`).
#
# ## Exercises
#
# 1. Count the bytes each rank sends per MLP block with and without SP for $s=4096$, $b=1$,
#    $h=4096$, bf16, $t=8$.
#
#    <details><summary>Answer</summary>
#
#    The block's activation is $[s, b, h]$ =
#    $4096 \cdot 4096 \cdot 2$ B = 33.6 MB. With ring collectives an all-reduce sends $2(t-1)/t$
#    of it per rank, an all-gather or a reduce-scatter $(t-1)/t$. Without SP the forward has one
#    all-reduce after fc2: 58.7 MB per rank. With SP it has one all-gather before fc1 and one
#    reduce-scatter after fc2, 29.4 MB each: the same 58.7 MB. The backward mirrors the forward,
#    58.7 MB again either way. SP saves activation memory, not bytes on the wire.
#
#    </details>
#
# 2. Put the row-parallel bias before the reduction and watch the parity check fail by a factor.
#
#    <details><summary>Hint</summary>
#
#    Each of the $t$ ranks would add the full bias to its partial
#    sum, and the all-reduce (or reduce-scatter) adds the $t$ copies: the output carries
#    $t \cdot b$ instead of $b$. Move the bias add in <code>RowParallelLinear.forward</code> and
#    read the demo's gap.
#
#    </details>
#
# 3. When is `tensor_parallel_output_grad=False` the right backward for
#    `gather_from_sequence_parallel_region`? Build a case where the reduce-scatter would
#    multiply the gradient by $t$.
#
#    <details><summary>Hint</summary>
#
#    The reduce-scatter in the backward is right when each rank's
#    gathered copy feeds a different computation (its own columns of the next weight), so the
#    gradients are partial sums. When every rank uses the gathered tensor identically, as a
#    replicated computation after the gather, each rank's gradient is already the full one, and
#    summing $t$ equal copies multiplies it by $t$; then only the split is right.
#
#    </details>
