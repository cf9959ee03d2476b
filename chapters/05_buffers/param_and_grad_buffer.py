# %% [markdown]
# # 05 · Buffers: one contiguous buffer for all grads (and params)
#
# Where every gradient of a step lives, and why its address decides when it can be sent.
# We build Megatron's `_ParamAndGradBuffer`: parameters grouped by dtype, laid out in reverse
# order, cut into buckets, padded so that every bucket splits evenly over the data-parallel
# ranks, with each parameter's `.main_grad` (and, with the distributed optimizer, its `.data`)
# a view into one flat tensor.
#
# ## The read/write loop of one iteration
#
# The buffer is written and read in a fixed cycle every step; this chapter is about that loop.
# With the distributed optimizer (ZeRO-1) it runs:
#
# ```mermaid
# flowchart TB
#   Z["zero_grad_buffer<br/>grad_data = 0"] --> H["backward hooks<br/>write main_grad<br/>(views of grad_data)"]
#   H --> RS["reduce-scatter per bucket<br/>(overlapped with backward)"]
#   RS --> O["optimizer reads its shard<br/>bucket.grad_shard()"]
#   O --> W["optimizer writes new bf16 weights<br/>into param_data (its shard)"]
#   W --> AG["all-gather per bucket<br/>in the next forward's pre-hooks"]
#   AG --> F["forward reads param.data<br/>(views of param_data)"]
#   F --> Z
# ```
#
# This page builds the data structure: where each view lives. [The bucket groups](bucket_group.py)
# launch the collectives, [the DDP wrapper](distributed_data_parallel.py) puts the hooks on the
# model, [`finalize_model_grads`](finalize_model_grads.py) is the
# last stop before the optimizer, [the timeline page](overlap_timeline.py) draws the overlap,
# and [chapter 02's DistributedOptimizer](../02_optimizer/distributed.py) reads and writes the
# shards.
#
# Both buffers are **resident memory**: allocated once, when the model is wrapped, and alive
# for the whole run; each step only zeroes the grad buffer. Per parameter the fp32 grad buffer
# costs 4 bytes and the bf16 param buffer 2, on every data-parallel rank: with the optimizer
# state sharded, they are most of what a rank holds that is not activations.

# %%
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tinytron.buffers._buffer_plot import plot_buffer_layout

__all__ = ["toy_layer_stack", "pad_to_divisor", "pad_param_start", "bucket_end_divisor",
           "pad_bucket_end", "stage_param_shapes", "collective_bytes",
           "BufferKey", "ParamLayout", "compute_param_layout", "group_params_for_buffers",
           "ShardRange", "Bucket", "ParamAndGradBuffer", "plot_buffer_layout"]

# %% [markdown]
# ## Why one flat buffer
#
# Plain PyTorch gives every parameter its own `.grad` tensor. Data parallelism then has to
# average every one of them across the DP ranks: a 7B Llama has 291 weight tensors, so 291
# collectives of very different sizes, most of them too small to keep the network busy
# ([the previous page](naive_ddp.py) builds exactly that and counts the calls).
# Megatron instead allocates **one flat tensor per dtype** and makes each parameter's
# gradient a *view* into it (`param.main_grad`). Now "all-reduce the gradients" is a handful of
# large collectives over contiguous slices — the **buckets**.
#
# Four layout rules make this work (`megatron/core/distributed/param_and_grad_buffer.py:889`,
# `megatron/core/optimizer/distrib_optimizer.py:483`):
#
# 1. **Group by dtype.** Each `BufferKey(param_dtype, grad_dtype)` gets its own buffer
#    (`param_and_grad_buffer.py:825`). `grad_dtype` is fp32 when `grad_reduce_in_fp32` (what
#    Megatron's training script sets for bf16 models) else the param dtype.
# 2. **Reverse order.** Parameters are placed last-registered first. Backward produces grads
#    roughly in reverse registration order, so bucket 0 (the last layers) is complete first
#    and can be reduced while earlier layers are still running backward.
# 3. **Buckets by size.** Walk the reversed list; close a bucket as soon as it holds at least
#    `bucket_size` elements (the parameter that crosses the threshold stays in it). Megatron's
#    default is `max(40_000_000, 1_000_000 · dp)` elements when grads are overlapped, and one
#    single bucket otherwise (`distributed_data_parallel.py:66-72`).
# 4. **Padding (distributed optimizer only).** Each DP rank will own one equal slice of every
#    bucket, so bucket ends are rounded up to a multiple of `lcm(dp, 128)` elements
#    (`param_layout.py:29-42`); every parameter start is rounded up to 64 elements
#    (`param_layout.py:24`) for aligned memory access. A tied embedding weight
#    (`param.shared_embedding`) gets a bucket of its own so it sits at the same place in the
#    first and last pipeline stage's buffers (`distrib_optimizer.py:507`).
#
# ### Worked example in small numbers
#
# Three parameters registered in the order `a` (10 elements), `b` (100), `c` (30), with
# the distributed optimizer, `dp = 2`, `bucket_size = 100`:
#
# | step | param | start (64-aligned) | end | bucket fill | action |
# |---|---|---|---|---|---|
# | 1 | `c` | 0 | 30 | 30 | keep going |
# | 2 | `b` | 64 | 164 | 164 ≥ 100 | close bucket 0, pad end 164 → 256 (`lcm(2,128)=128`) |
# | 3 | `a` | 256 | 266 | 10 | last param: close bucket 1, pad 266 → 384 |
#
# Buffer numel 384: bucket 0 is `[0, 256)`, bucket 1 is `[256, 384)`. Rank 0 owns
# `[0,128)` of bucket 0 and `[256,320)` of bucket 1. Without the distributed optimizer there
# is no padding: `c=[0,30)`, `b=[30,130)` closes bucket 0 at 130, `a=[130,140)`.
#
# ```mermaid
# flowchart LR
#   subgraph B0["bucket 0 = [0, 256)"]
#     c["c 0..30"] --> p1["pad 30..64"] --> b["b 64..164"] --> p2["pad 164..256"]
#   end
#   subgraph B1["bucket 1 = [256, 384)"]
#     a["a 256..266"] --> p3["pad 266..384"]
#   end
#   B0 --> B1
# ```

# %%
def pad_to_divisor(value: int, divisor: int) -> int:
    """Round ``value`` up to a multiple of ``divisor``."""
    return int(math.ceil(value / divisor) * divisor)


def pad_param_start(index: int) -> int:
    """Align a parameter start to 64 elements (Megatron's `pad_param_start`)."""
    return pad_to_divisor(index, 64)


def bucket_end_divisor(dp_size: int, pad_for_high_nccl_busbw: bool = False) -> int:
    """What a bucket end is padded to: lcm(dp, 128), or lcm(dp, 128, 2**16) for NCCL busbw."""
    if pad_for_high_nccl_busbw:
        return math.lcm(dp_size, 128, 2**16)
    return math.lcm(dp_size, 128)


def pad_bucket_end(end: int, dp_size: int, pad_for_high_nccl_busbw: bool = False) -> int:
    """Round a bucket end up so the bucket splits evenly into ``dp_size`` shards."""
    return pad_to_divisor(end, bucket_end_divisor(dp_size, pad_for_high_nccl_busbw))


# %%
@dataclass(frozen=True)
class BufferKey:
    """Which buffer a parameter goes into: one buffer per (param dtype, grad dtype)."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype


def group_params_for_buffers(params, grad_reduce_in_fp32: bool) -> dict[BufferKey, list]:
    """Group trainable params by BufferKey, keeping registration order inside each group."""
    groups: dict[BufferKey, list] = {}
    for p in params:
        if not p.requires_grad:
            raise ValueError(f"param of shape {tuple(p.shape)} does not require grad")
        grad_dtype = torch.float32 if grad_reduce_in_fp32 else p.dtype
        groups.setdefault(BufferKey(p.dtype, grad_dtype), []).append(p)
    return groups


# %%
@dataclass
class ParamLayout:
    """Where each param sits: ``param_index_map[p] = (start, end, bucket_id)`` plus bucket ranges."""

    param_index_map: dict = field(default_factory=dict)
    bucket_indices: list = field(default_factory=list)  # [(start, end)] padded
    per_bucket_numel_unpadded: list = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements in the whole buffer (end of the last bucket)."""
        return self.bucket_indices[-1][1] if self.bucket_indices else 0


# %% [markdown]
# The layout walks the parameters from the last registered to the first, aligns each start
# (with the distributed optimizer), and closes a bucket once it holds `bucket_size` elements,
# or before and after a tied embedding.

# %%
def compute_param_layout(params, bucket_size: int | None, dp_size: int, *,
                         use_distributed_optimizer: bool,
                         pad_for_high_nccl_busbw: bool = False) -> ParamLayout:
    """Lay ``params`` out in reverse order, cut into buckets, padded for the distributed optimizer."""
    if bucket_size is not None and bucket_size <= 0:
        raise ValueError(f"bucket_size must be positive or None, got {bucket_size}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    pad = use_distributed_optimizer
    layout = ParamLayout()
    bucket_start = start = end = 0
    open_params = 0

    def close(param_end: int) -> int:
        layout.per_bucket_numel_unpadded.append(param_end - bucket_start)
        bucket_end = pad_bucket_end(param_end, dp_size, pad_for_high_nccl_busbw) if pad else param_end
        layout.bucket_indices.append((bucket_start, bucket_end))
        return bucket_end

    for p in reversed(list(params)):
        own_bucket = pad and getattr(p, "shared_embedding", False)
        start = pad_param_start(start) if pad else start
        if own_bucket and open_params:  # close the current bucket before a tied embedding
            bucket_start = start = close(start)
            open_params = 0
        end = start + p.numel()
        layout.param_index_map[p] = (start, end, len(layout.bucket_indices))
        open_params += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            bucket_start = start = close(end)
            open_params = 0
        else:
            start = end
    if open_params:
        close(end)
    return layout


# %% [markdown]
# ## Buckets and shards
#
# A bucket is a `[start, end)` slice of the buffer plus the parameters inside it. With the
# distributed optimizer DP rank $r$ owns the shard $[rS, (r+1)S)$ of every bucket, where
# $S = N_b / d$ for a bucket of $N_b$ elements and $d$ DP ranks. The padding rule makes that
# division exact: a bucket whose last parameter ends at buffer offset $e$ ends at
# $\lceil e / m \rceil \cdot m$ with $m = \mathrm{lcm}(d, 128)$, and since every bucket starts
# where the previous one ended, every $N_b$ is a multiple of $m$. After the reduce-scatter only
# that shard holds the averaged gradient, and the optimizer updates only the parameter pieces
# in it. A shard boundary can cut a parameter in two, so the optimizer needs, for every
# parameter touching its shard,
# *which elements of the parameter* map to *which elements of the shard*: `ShardRange`
# (Megatron's DistributedOptimizer builds the same map in
# `megatron/core/optimizer/distrib_optimizer.py:123`, `_build_model_gbuf_param_range_map`).

# %%
@dataclass(frozen=True)
class ShardRange:
    """One param's piece inside one DP rank's shard of a bucket (all ranges are [start, end))."""

    param: torch.nn.Parameter
    param_start: int   # flat element range inside the param
    param_end: int
    shard_start: int   # the same elements inside the rank's shard
    shard_end: int
    bucket_start: int  # ... inside the bucket
    bucket_end: int
    buffer_start: int  # ... inside the whole buffer
    buffer_end: int

    @property
    def numel(self) -> int:
        """Number of elements of this piece."""
        return self.param_end - self.param_start


# %% [markdown]
# A rank's shard as views of the two buffers, and mapped back to parameter pieces. Worked
# example, bucket 0 of the table above (`[0, 256)`, `c` at 0..30, `b` at 64..164) at $d = 2$:
# rank 0's shard is `[0, 128)`, so its pieces are all of `c` (param elements 0..30, shard
# 0..30) and `b[0:64]` (shard 64..128); rank 1's shard `[128, 256)` holds `b[64:100]` at shard
# 0..36 and padding after it. The bucket answers these questions for any rank, so the
# optimizer of [chapter 02](../02_optimizer/distributed.py) and the drawing below read the same
# map; the three methods form a small class of their own, which `Bucket` includes.

# %%
class ShardViews:
    """Mixin for Bucket: a DP rank's shard as buffer views and as parameter pieces."""

    def grad_shard(self, rank: int | None = None) -> torch.Tensor:
        """View of the grad buffer that DP ``rank`` owns in this bucket."""
        s, e = self.shard_range(rank)
        return self.grad_data[s:e]

    def param_shard(self, rank: int | None = None) -> torch.Tensor:
        """View of the param buffer that DP ``rank`` owns (distributed optimizer only)."""
        if self.param_data is None:
            raise ValueError("this buffer has no param_data (use_distributed_optimizer=False)")
        s, e = self.shard_range(rank)
        return self.param_data[s:e]

    def shard_param_ranges(self, rank: int | None = None) -> list[ShardRange]:
        """Every param piece inside DP ``rank``'s shard, in layout order."""
        shard_start, shard_end = self.shard_range(rank)
        out = []
        for p in self.params:
            p_start, p_end = self.param_to_index[p]
            lo, hi = max(p_start, shard_start), min(p_end, shard_end)
            if lo < hi:
                out.append(ShardRange(p, lo - p_start, hi - p_start, lo - shard_start,
                                      hi - shard_start, lo, hi, lo + self.offset, hi + self.offset))
        return out


# %% [markdown]
# The bucket holds views of both buffers, its offset in the whole buffer, and the range of
# each of its parameters relative to its own start; `shard_size` is $N_b / d$ and
# `shard_range(r)` is $[rS, (r+1)S)$.

# %%
class Bucket(ShardViews):
    """A contiguous slice of the buffer: its params, grad/param views, and per-DP-rank shards."""

    def __init__(self, params, param_data, grad_data, offset: int, numel_unpadded: int,
                 bucket_id: int, param_index_map: dict, dp_size: int, dp_rank: int,
                 gradient_scaling_factor: float):
        self.params = list(params)  # layout order (reverse registration order)
        self.param_data = param_data  # None without the distributed optimizer
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.bucket_id = bucket_id
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_to_index = {p: (param_index_map[p][0] - offset, param_index_map[p][1] - offset)
                               for p in self.params}

    @property
    def numel(self) -> int:
        """Elements in the bucket, padding included."""
        return self.grad_data.numel()

    @property
    def shard_size(self) -> int:
        """Elements each DP rank owns."""
        return self.numel // self.dp_size

    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        """Bucket-local [start, end) owned by DP ``rank`` (default: this rank)."""
        rank = self.dp_rank if rank is None else rank
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"dp rank {rank} out of range for dp size {self.dp_size}")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def __repr__(self) -> str:
        return (f"Bucket(id={self.bucket_id}, [{self.offset}, {self.offset + self.numel}), "
                f"{len(self.params)} params, unpadded {self.numel_unpadded})")


# %% [markdown]
# ## The buffer
#
# `ParamAndGradBuffer` allocates `grad_data` (zeros, `grad_dtype`) always and `param_data`
# (`param_dtype`) only with the distributed optimizer (`param_and_grad_buffer.py:962`). Then,
# for every parameter, `param.main_grad = grad_data[start:end].view(shape)` (`:1220`); with the
# distributed optimizer the parameter's current values are copied into `param_data` and
# `param.data` is **re-pointed** to that view (`:1205-1216`). From then on the optimizer writes
# new bf16 weights into `param_data` and one all-gather per bucket refreshes every rank's model
# — no per-tensor copies anywhere.
#
# The views are the heart of it: every `main_grad` (and with the distributed optimizer every
# `param.data`) is re-pointed into the flat buffers, and each bucket receives its slices. After
# `_attach_views`, `a.main_grad.data_ptr()` in the worked example is the address of
# `grad_data[256]`: writing a gradient into `a.main_grad` writes into bucket 1, and zeroing
# the buffer zeroes every `main_grad` at once.

# %%
class BufferViews:
    """Mixin for ParamAndGradBuffer: the params' views into the flat buffers, and the buckets."""

    def _attach_views(self) -> None:
        """Point each param's main_grad (and .data with the distributed optimizer) into the buffer."""
        for p in self.params:
            start, end, _ = self.param_index_map[p]
            if self.param_data is not None:
                view = self.param_data[start:end].view(p.shape)
                view.copy_(p.data)
                p.data = view
            p.main_grad = self.grad_data[start:end].view(p.shape)

    def _make_buckets(self, scaling: float) -> list[Bucket]:
        """One Bucket per layout range, holding views of both buffers."""
        by_bucket: dict[int, list] = {}
        for p, (start, _, b) in sorted(self.param_index_map.items(), key=lambda kv: kv[1][0]):
            by_bucket.setdefault(b, []).append(p)
        buckets = []
        for b, (start, end) in enumerate(self.layout.bucket_indices):
            pdata = self.param_data[start:end] if self.param_data is not None else None
            buckets.append(Bucket(by_bucket.get(b, []), pdata, self.grad_data[start:end], start,
                                  self.layout.per_bucket_numel_unpadded[b], b,
                                  self.param_index_map, self.dp_size, self.dp_rank, scaling))
        return buckets


# %% [markdown]
# What the DDP wrapper calls each step, `reset` to zero and `scale_gradients` for the loss
# scale, touches the whole grad buffer at once; names are for printing.

# %%
class BufferOps(BufferViews):
    """Mixin for ParamAndGradBuffer: whole-buffer operations, and names for printing."""

    def scale_gradients(self, factor: float) -> None:
        """Multiply the whole grad buffer by ``factor`` in place."""
        self.grad_data.mul_(factor)

    def reset(self) -> None:
        """Zero the grad buffer (every main_grad with it)."""
        self.grad_data.zero_()

    def name(self, p) -> str:
        """A readable name for ``p`` (its module path when known)."""
        if p in self.param_names:
            return self.param_names[p]
        return f"param{next(i for i, q in enumerate(self.params) if q is p)}"

    def __repr__(self) -> str:
        return (f"ParamAndGradBuffer({self.param_dtype}->{self.grad_dtype}, numel={self.numel}, "
                f"{len(self.buckets)} buckets, dp={self.dp_size})")


# %% [markdown]
# The buffer itself allocates, lays out, attaches, and cuts into buckets.

# %%
class ParamAndGradBuffer(BufferOps):
    """Flat grad (and param) storage for params of one (param dtype, grad dtype), cut into buckets."""

    def __init__(self, params, *, param_dtype: torch.dtype, grad_dtype: torch.dtype,
                 dp_size: int = 1, dp_rank: int = 0, bucket_size: int | None = None,
                 use_distributed_optimizer: bool = False, pad_for_high_nccl_busbw: bool = False,
                 gradient_scaling_factor: float = 1.0, param_names: dict | None = None):
        self.params = list(params)
        if not self.params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        for p in self.params:
            if p.dtype != param_dtype:
                raise ValueError(f"param dtype {p.dtype} != buffer param_dtype {param_dtype}")
        self.param_dtype, self.grad_dtype = param_dtype, grad_dtype
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.use_distributed_optimizer = use_distributed_optimizer
        self.param_names = param_names or {}
        self.layout = compute_param_layout(self.params, bucket_size, dp_size,
                                           use_distributed_optimizer=use_distributed_optimizer,
                                           pad_for_high_nccl_busbw=pad_for_high_nccl_busbw)
        self.param_index_map = self.layout.param_index_map
        self.numel = self.layout.numel
        if use_distributed_optimizer:
            assert self.numel % dp_size == 0, (self.numel, dp_size)
        device = self.params[0].device
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = (torch.zeros(self.numel, dtype=param_dtype, device=device)
                           if use_distributed_optimizer else None)
        self._attach_views()
        self.buckets = self._make_buckets(gradient_scaling_factor)
        self.param_to_bucket = {p: b for b in self.buckets for p in b.params}


# %% [markdown]
# ## Drawing a real buffer
#
# `plot_buffer_layout` reads nothing but the data structure above: each parameter's
# `(start, end)`, each bucket's range, and the padding between them, with one row per DP rank
# showing which part of every bucket that rank owns. It lives in the chapter's private module
# `tinytron.buffers._buffer_plot` (`chapters/05_buffers/_buffer_plot.py`); the demos need a
# model to lay out, and `toy_layer_stack` gives the parameters of a small transformer stack
# without its forward.

# %%
def toy_layer_stack(hidden: int = 32, ffn: int = 64, vocab: int = 48, num_layers: int = 2,
                    dtype=torch.bfloat16) -> torch.nn.ModuleDict:
    """A model's parameters without its forward: embedding, per layer (norm, qkv, proj, norm, fc1, fc2), final norm."""
    torch.manual_seed(0)
    stack = torch.nn.ModuleDict({"embedding": torch.nn.Embedding(vocab, hidden)})
    for i in range(num_layers):
        stack[f"l{i}_norm1"] = torch.nn.RMSNorm(hidden)
        stack[f"l{i}_qkv"] = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        stack[f"l{i}_proj"] = torch.nn.Linear(hidden, hidden, bias=False)
        stack[f"l{i}_norm2"] = torch.nn.RMSNorm(hidden)
        stack[f"l{i}_fc1"] = torch.nn.Linear(hidden, ffn, bias=False)
        stack[f"l{i}_fc2"] = torch.nn.Linear(ffn, hidden, bias=False)
    stack["final_norm"] = torch.nn.RMSNorm(hidden)
    return stack.to(dtype)  # .to() makes new Parameters: take their names afterwards


# %% [markdown]
# ## Demo: the worked example, then a small Llama-like block
#
# First the three-parameter example from the table, checked number by number; then the
# buffer of a two-layer toy transformer stack (embedding, per layer: norm, QKV, proj, norm,
# MLP up/down; final norm) as Megatron would lay it out for a 4-way data-parallel run.

# %%
if __name__ == "__main__":
    a, b, c = (torch.nn.Parameter(torch.randn(n)) for n in (10, 100, 30))
    example = ParamAndGradBuffer([a, b, c], param_dtype=torch.float32,
                                 grad_dtype=torch.float32, dp_size=2, bucket_size=100,
                                 use_distributed_optimizer=True,
                                 param_names={a: "a", b: "b", c: "c"})
    for p in (c, b, a):
        print(example.name(p), example.param_index_map[p])
    print([bk.shard_range(0) for bk in example.buckets], example.buckets)
    assert example.param_index_map[c] == (0, 30, 0) and example.param_index_map[b] == (64, 164, 0)
    assert example.param_index_map[a] == (256, 266, 1) and example.numel == 384
    assert a.main_grad.data_ptr() == example.grad_data[256:].data_ptr()
    assert a.data.data_ptr() == example.param_data[256:].data_ptr()  # re-pointed into param_data
    plain = compute_param_layout([a, b, c], 100, 2, use_distributed_optimizer=False)
    assert [plain.param_index_map[p] for p in (c, b, a)] == [(0, 30, 0), (30, 130, 0), (130, 140, 1)]

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    stack = toy_layer_stack(hidden=32, ffn=64, vocab=48)
    names = {p: n.replace(".weight", "") for n, p in stack.named_parameters()}
    (key, params), = group_params_for_buffers(stack.parameters(), grad_reduce_in_fp32=True).items()
    buf = ParamAndGradBuffer(params, param_dtype=key.param_dtype, grad_dtype=key.grad_dtype,
                             dp_size=4, bucket_size=4_000, use_distributed_optimizer=True,
                             param_names=names)
    print(key, buf)
    for bk in buf.buckets:
        print(bk, [buf.name(p) for p in bk.params])
    print("rank 1's shard of bucket 0:",
          [(buf.name(r.param), (r.param_start, r.param_end), (r.shard_start, r.shard_end))
           for r in buf.buckets[0].shard_param_ranges(1)])
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(11, 5.5), height_ratios=[3, 5])
    plot_buffer_layout(example, ax0, title="the worked example: dp=2, bucket_size=100")
    plot_buffer_layout(buf, ax1, title="toy 2-layer stack: bf16 params / fp32 grads, dp=4, "
                                       "bucket_size=4000")
    plt.tight_layout()
    plt.show()
    assert buf.buckets[0].params[0] is stack["final_norm"].weight  # reverse order: last first
    assert all(bk.numel % math.lcm(4, 128) == 0 for bk in buf.buckets)
    assert all(buf.param_index_map[p][0] % 64 == 0 for p in params)
    assert all(p.main_grad.dtype == torch.float32 and p.dtype == torch.bfloat16 for p in params)
    pieces = sum(r.numel for bk in buf.buckets for rk in range(4) for r in bk.shard_param_ranges(rk))
    assert pieces == sum(p.numel() for p in params)  # the shards cover every element exactly once

# %% [markdown]
# ## The running example: one GPU's buffers and the bytes its collectives move
#
# The book's model at TP2·PP2·DP64 (see [the front page](../index.md)). A GPU of the first
# pipeline stage holds the embedding and 16 layers, each matrix halved by TP: about 2.0e9
# parameters ([appendix B counts them](../model/config.py)). The layout needs only their
# shapes, so we lay out meta tensors (shapes without storage) in the order the model registers
# them, with Megatron's default bucket size for an overlapped run, $\max(4\cdot10^7,
# 10^6\cdot dp) = 6.4\cdot10^7$ elements, and the distributed optimizer's padding.
#
# A layer holds 109M elements, more than one bucket, so a bucket closes inside almost every
# layer's MLP: about one bucket per layer, plus the tied embedding alone in the last one.
#
# The bytes each rank moves per step follow from the ring algorithms: a reduce-scatter or an
# all-gather over $d$ ranks sends (and receives) $\frac{d-1}{d}$ of the buffer, an all-reduce
# twice that. So the fp32 grads cost one reduce-scatter (instead of plain DDP's all-reduce)
# and the bf16 params one all-gather, half the bytes again.

# %%
def stage_param_shapes(config, tp: int, pp: int, pp_rank: int) -> list[tuple[str, tuple]]:
    """(name, shape) of every parameter of one (TP, PP) rank, in the model's registration order."""
    from tinytron.model.config import stage_layer_ranges

    h, d, f = config.hidden_size, config.head_dim, config.ffn_hidden_size
    a, g, v = config.num_attention_heads, config.num_query_groups, config.vocab_size
    per_layer = [("input_layernorm", (h,)), ("linear_qkv", ((a + 2 * g) * d // tp, h)),
                 ("linear_proj", (h, a * d // tp)), ("pre_mlp_layernorm", (h,)),
                 ("linear_fc1", (2 * f // tp, h)), ("linear_fc2", (h, f // tp))]
    shapes = [("embedding", (v // tp, h))] if pp_rank == 0 else []
    for start, end in stage_layer_ranges(config.num_layers, pp, 1, pp_rank):
        shapes += [(f"layers.{i}.{n}", s) for i in range(start, end) for n, s in per_layer]
    if pp_rank == pp - 1:  # the last stage: final norm, and the output layer (or tied duplicate)
        shapes += [("final_layernorm", (h,)), ("output_layer", (v // tp, h))]
    return shapes


# %% [markdown]
# The ring rule of the paragraph above, as a function: $\frac{d-1}{d}$ of the buffer for a
# reduce-scatter or an all-gather, twice that for an all-reduce.

# %%
def collective_bytes(numel: int, itemsize: int, dp: int, op: str) -> float:
    """Bytes one rank sends per ring collective over dp ranks on a buffer of numel elements."""
    share = (dp - 1) / dp * numel * itemsize
    return {"reduce_scatter": share, "all_gather": share, "all_reduce": 2 * share}[op]


# %% [markdown]
# The first stage's shapes as meta tensors, the tied embedding marked, laid out with the
# default bucket size at DP 64:

# %%
if __name__ == "__main__":
    from tinytron.buffers.bucket_group import default_bucket_size
    from tinytron.buffers.distributed_data_parallel import DistributedDataParallelConfig
    from tinytron.model import count_parameters_per_rank, llama_7b_config

    config, dp = llama_7b_config(), 64
    metas = []
    for name, shape in stage_param_shapes(config, tp=2, pp=2, pp_rank=0):
        t = torch.empty(shape, device="meta")
        t.shared_embedding = name == "embedding"  # tied, pp > 1: its own bucket
        metas.append(t)
    n = sum(t.numel() for t in metas)
    size = default_bucket_size(DistributedDataParallelConfig(overlap_grad_reduce=True), dp)
    layout = compute_param_layout(metas, size, dp, use_distributed_optimizer=True)
    sizes = [e - s for s, e in layout.bucket_indices]
    print(f"{n:,} params on a GPU of the first stage; bucket_size {size:,} elements")
    print(f"{len(sizes)} buckets of {min(sizes) / 1e6:.1f}M..{max(sizes) / 1e6:.1f}M elements; "
          f"buffer {layout.numel:,} elements ({layout.numel - n:,} of padding)")
    print(f"fp32 grad buffer {4 * layout.numel / 1e9:.2f} GB, bf16 param buffer "
          f"{2 * layout.numel / 1e9:.2f} GB; one rank's fp32 shard of a 64M-element bucket: "
          f"{4 * size / dp / 2**20:.0f} MiB")
    for what, nbytes in (("grads, reduce-scatter (fp32)", collective_bytes(layout.numel, 4, dp, "reduce_scatter")),
                         ("params, all-gather (bf16)", collective_bytes(layout.numel, 2, dp, "all_gather")),
                         ("plain DDP: grads, all-reduce", collective_bytes(layout.numel, 4, dp, "all_reduce"))):
        print(f"  {what:30s} {nbytes / 1e9:6.2f} GB sent per rank per step")
    assert n == count_parameters_per_rank(config, tp=2, pp=2, pp_rank=0)
    assert size == 64_000_000 and layout.numel % math.lcm(dp, 128) == 0
    assert len(sizes) == 18 and sizes[-1] == 128_256 // 2 * 4096  # the tied embedding: alone, last
    assert layout.numel - n < 1e-3 * n  # padding is negligible at this scale

# %% [markdown]
# ## Summary
#
# - One flat buffer per `(param dtype, grad dtype)`; every `main_grad` (and, with the
#   distributed optimizer, every `param.data`) is a view into it.
# - Reverse registration order puts the last layers in bucket 0, which backward fills first.
# - Buckets close once they reach `bucket_size`; with the distributed optimizer param starts
#   are 64-aligned and bucket ends padded to `lcm(dp, 128)` so each DP rank owns an equal
#   shard; a tied embedding gets a bucket of its own.
# - `Bucket.shard_param_ranges(r)` maps DP rank `r`'s shard back to parameter pieces: this is
#   what [chapter 02's distributed optimizer](../02_optimizer/distributed.py) updates.
# - The running example's first-stage GPU: an 8.03 GB fp32 grad buffer and a 4.02 GB bf16
#   param buffer (resident for the whole run), 18 buckets of 64M elements and more, and per
#   step 7.9 GB sent by the grads' reduce-scatter plus 3.95 GB by the params' all-gather.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/distributed/param_and_grad_buffer.py` (`_ParamAndGradBuffer`
#   :940, `_ParamAndGradBucket` :72, `group_params_for_buffers` :825, default layout :889),
#   `megatron/core/optimizer/param_layout.py` (padding helpers :19-42, `BufferKey` :46),
#   `megatron/core/optimizer/distrib_optimizer.py:483` (the padded layout).
# - PyTorch DDP (`torch/nn/parallel/distributed.py`, the C++ `Reducer`) also buckets grads
#   (25 MB default, first bucket 1 MB) but copies grads into bucket storage unless
#   `gradient_as_bucket_view=True`; FSDP2 (`torch.distributed.fsdp`) shards per parameter
#   group instead of per bucket.
#
# ## Exercises
#
# 1. Lay out ten 95×95 weights with `bucket_size=18000` and `dp=4` with and without the
#    distributed optimizer; how many buckets and how much padding in each case?
#    <details><summary>Answer</summary>
#
#    Five buckets of two weights either way (one weight,
#    9,025 elements, is under 18,000; two reach it). Without the distributed optimizer nothing
#    is padded: 90,250 elements. With it each second weight starts at 9,088 (64-aligned), so a
#    bucket holds 18,113 elements and is padded to $142 \cdot 128$ = 18,176: 90,880 elements,
#    630 of them padding.
#
#    </details>
#
# 2. Turn on `pad_for_high_nccl_busbw` for the toy stack. How much bigger does the buffer get?
#    <details><summary>Answer</summary>
#
#    Every bucket end is then padded to
#    $\mathrm{lcm}(4, 128, 2^{16}) = 65{,}536$ elements. The toy stack's 18,080 parameters in 5
#    buckets take 18,560 elements without it and $5 \cdot 65{,}536$ = 327,680 with it, 17.7×
#    larger: the flag is for buckets of tens of millions of elements, where it costs little.
#
#    </details>
#
# 3. Why must a tied embedding have its own bucket for the first and last pipeline stage to
#    agree on which DP rank owns which element?
#    <details><summary>Hint</summary>
#
#    The two stages hold different parameters around their copy
#    of the embedding, so its offset inside a shared bucket would differ, and with it which
#    shard, of which DP rank, each of its elements falls in. Alone in a bucket starting at a
#    padded boundary, its shards are the same on both stages (`own_bucket` in
#    `compute_param_layout`).
#
#    </details>
