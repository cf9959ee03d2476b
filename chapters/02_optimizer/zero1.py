# %% [markdown]
# # 02 · Optimizer: ZeRO-1, who owns what
#
# [The previous page's](mixed_precision.py) optimizer keeps 12 bytes of fp32 master weight and
# Adam state per parameter, and every data-parallel rank keeps the same 12: $dp$ copies of
# state that only one rank needs. ZeRO-1 gives each parameter's state to one rank. This page
# decides who owns what, first by whole parameters, then by equal ranges of every bucket of
# [chapter 05's contiguous buffer](../05_buffers/param_and_grad_buffer.py), and counts the
# bytes that saves on one GPU of the running example; [the next page](distributed.py) builds
# the optimizer that steps those ranges.
#
# You will build: `owners_by_size`, `NaiveZeRO1`, `ownership_table`, `plot_ownership_map`,
# `bytes_per_param`, `optimizer_ledger`.

# %%
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tinytron.buffers import ParamAndGradBuffer

__all__ = ["owners_by_size", "NaiveZeRO1", "bytes_per_param", "ownership_table",
           "plot_ownership_map", "optimizer_ledger"]


# %% [markdown]
# ## First, whole parameters
#
# The idea of ZeRO stage 1 (Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training
# Trillion Parameter Models*, 2020) fits in one sentence: every data-parallel rank keeps the
# whole model and computes every gradient, but each parameter's fp32 master and Adam moments
# live on exactly one rank, the one that updates it. The simplest split is by whole
# parameters, worth building first because it shows what the real one has to fix.
#
# The step, on every rank:
#
# 1. all-reduce every gradient to the data-parallel mean (the
#    [naive DDP of chapter 05](../05_buffers/naive_ddp.py));
# 2. step only the parameters this rank owns, with an inner optimizer that has never seen the
#    others (so it holds their state for nobody);
# 3. broadcast each parameter from its owner, so that every rank has the whole new model.
#
# Ownership is a bin-packing: parameters, largest first, each to the rank that owns the fewest
# elements so far. Worked example: the demo's MLP has tensors of 512, 256, 32, 32, 32 and 8
# elements (two weights, two biases, a norm's weight and bias: 872 in all). At $dp = 2$ rank 0
# takes the 512, rank 1 the 256 and then, being lighter, every small one: 512 against 360
# elements of optimizer state, 59% and 41% instead of 50% each.

# %%
def owners_by_size(numels: list[int], dp: int) -> list[int]:
    """The owning DP rank of each whole parameter: largest first, to the least-loaded rank."""
    load, owner = [0] * dp, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        owner[i] = min(range(dp), key=load.__getitem__)
        load[owner[i]] += numels[i]
    return owner


# %% [markdown]
# The optimizer around it: each rank builds its inner optimizer over the parameters it owns
# only, and a step is the three moves above, one collective per parameter.

# %%
class NaiveZeRO1:
    """ZeRO-1 over whole parameters: mean grads everywhere, step my params, broadcast each param."""

    def __init__(self, params, make_optimizer, group=None):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.owner = owners_by_size([p.numel() for p in self.params], self.world)
        mine = [p for p, o in zip(self.params, self.owner) if o == rank]
        self.optimizer = make_optimizer(mine) if mine else None   # state for my params only

    @torch.no_grad()
    def step(self) -> None:
        """All-reduce every grad to the mean, step what I own, broadcast every param from its owner."""
        for p in self.params:
            p.grad.div_(self.world)
            if self.world > 1:
                dist.all_reduce(p.grad, group=self.group)
        if self.optimizer is not None:
            self.optimizer.step()
        for p, owner in zip(self.params, self.owner):
            if self.world > 1:
                dist.broadcast(p.data, src=dist.get_global_rank(self.group or dist.group.WORLD,
                                                                owner), group=self.group)

    def zero_grad(self) -> None:
        """Drop every gradient (owned or not: all of them were computed)."""
        for p in self.params:
            p.grad = None


# %% [markdown]
# It trains exactly like the real DistributedOptimizer ([the next page's](distributed.py) last
# demo checks it on two ranks), and it already divides the 12 bytes of state per parameter by
# roughly $dp$. Three things keep it from being what Megatron runs:
#
# - **Balance.** Whole parameters pack unevenly. A 7B Llama's 32,000 × 4,096 embedding is
#   131M elements, almost 2% of the model; at $dp = 64$ an even share is 105M, so the rank that
#   owns the embedding holds 25% more state than its share, and the step waits for the slowest
#   rank.
# - **Traffic.** An all-reduce moves every gradient to every rank, yet each rank reads only
#   the ones it owns. A reduce-scatter delivers just those and moves half the bytes of an
#   all-reduce; the all-gather afterwards replaces the broadcasts.
# - **Calls.** One all-reduce and one broadcast per parameter: twice 291 calls for the 7B model,
#   where the buffer has a handful of buckets.
#
# The real optimizer answers all three with one change: it splits every *bucket* of the flat
# buffer into $dp$ equal ranges, ignoring parameter boundaries.
#
# ## Who owns what
#
# After chapter 05's reduce-scatter, DP rank $r$ holds the averaged gradient for the range
# $[rS, (r+1)S)$ of every bucket, $S = \text{bucket numel}/dp$, and nothing valid elsewhere. The
# ranges cut through parameters: one can be split between two ranks. For every
# parameter piece inside its range the optimizer keeps four ranges (Megatron's
# `_build_model_gbuf_param_range_map`, `megatron/core/optimizer/distrib_optimizer.py:123`):
# where the piece is in the whole buffer, in the bucket, in my shard, and in the flattened
# parameter. [Chapter 05's](../05_buffers/param_and_grad_buffer.py) `Bucket.shard_param_ranges(r)`
# returns exactly these (`ShardRange`).
#
# Worked example (chapter 05's): params `a[10], b[100], c[30]`, `dp=2`, bucket size 100. Reverse
# order with 64-aligned starts gives bucket 0 = `c[0:30]`, pad, `b` at 64..164, padded to 256;
# bucket 1 = `a` at 256..266, padded to 384. Rank 0 owns `[0,128)` of bucket 0 → all of `c` and
# `b[0:64]`; rank 1 owns `[128,256)` → `b[64:100]`. In bucket 1 rank 0 owns `a` entirely and rank
# 1 owns only padding.
#
# Memory per parameter (bf16 params, fp32 grads, Adam): 2 (param buffer) + 4 (grad buffer) +
# $12/dp$ (fp32 master, `exp_avg`, `exp_avg_sq`) bytes, against 18 without sharding: at $dp=8$
# that is 7.5 bytes, 2.4× less.
#
# All of these bytes are **resident**, alive for the whole run, unlike the activations that
# each micro-batch makes and frees
# ([chapter 01 measures both](../01_main_loop/resident_flowing.py)). The fp32 masters and Adam
# moments, 12 of the 18 bytes, are the part this optimizer shards.

# %%
def bytes_per_param(dp: int, sharded: bool = True) -> float:
    """Resident bytes per parameter: bf16 param + fp32 grad + fp32 (master, m, v) / dp."""
    return 2 + 4 + 12 / (dp if sharded else 1)


# %% [markdown]
# Who owns what, as rows: for every DP rank and bucket, each piece with its range inside the
# parameter and inside the buffer.

# %%
def ownership_table(buffer: ParamAndGradBuffer, names: dict | None = None) -> list[tuple]:
    """(dp_rank, bucket, param name, param range, buffer range) for every owned piece."""
    names = names or {}
    rows = []
    for r in range(buffer.dp_size):
        for b in buffer.buckets:
            for piece in b.shard_param_ranges(r):
                name = names.get(piece.param, buffer.name(piece.param))
                rows.append((r, b.bucket_id, name, (piece.param_start, piece.param_end),
                             (piece.buffer_start, piece.buffer_end)))
    return rows


# %% [markdown]
# The same pieces as a picture: one bar per DP rank along the buffer, colored by parameter,
# with the padding in gray and the bucket starts in red.

# %%
def plot_ownership_map(buffer: ParamAndGradBuffer, ax=None, title: str = ""):
    """One row per DP rank: the pieces of each param that rank steps, colored by param."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.8 + 0.6 * buffer.dp_size))
    order = sorted(buffer.params, key=lambda q: buffer.param_index_map[q][0])
    color = {p: plt.get_cmap("tab20")(i % 20) for i, p in enumerate(order)}
    for r in range(buffer.dp_size):
        for b in buffer.buckets:
            s, e = b.shard_range(r)
            ax.barh(r, e - s, left=b.offset + s, height=0.8, color="#eeeeee", edgecolor="#999999")
            for piece in b.shard_param_ranges(r):
                width = piece.buffer_end - piece.buffer_start
                ax.barh(r, width, left=piece.buffer_start, height=0.8,
                        color=color[piece.param], edgecolor="black", lw=0.4)
                if width > buffer.numel / 25:
                    label = f"{buffer.name(piece.param)}[{piece.param_start}:{piece.param_end}]"
                    ax.text(piece.buffer_start + width / 2, r, label, ha="center",
                            va="center", fontsize=6, rotation=90 if width < buffer.numel / 8 else 0)
    for b in buffer.buckets:
        ax.axvline(b.offset, color="red", lw=1.2)
    ax.set_yticks(range(buffer.dp_size), [f"dp rank {r}" for r in range(buffer.dp_size)])
    ax.invert_yaxis()
    ax.set_xlabel("buffer offset (gray = padding; red = bucket start)")
    ax.set_title(title or "who steps what", fontsize=9)
    return ax


# %% [markdown]
# ## The running example: the optimizer's ledger on one GPU
#
# The book's 7.5e9-parameter model at TP2·PP2·DP64 (see [the front page](../index.md)): a GPU of
# the first pipeline stage holds 16 of the 32 layers and the embedding, halved by TP, which
# [appendix B counts](../model/config.py) as 2,007,629,824 parameters, about 2.0e9. Without the
# DistributedOptimizer each of them costs $2 + 4 + 12 = 18$ bytes; with it,
# $2 + 4 + 12/64 = 6.19$. The code below prints the ledger by kind. The optimizer's share
# drops from 24 GB to 0.38 GB, and what is left is dominated by the fp32 grad buffer, which
# only sharding the gradients too would cut (ZeRO-2, or FSDP, which also shards the params).

# %%
def optimizer_ledger(num_params: int, dp: int, sharded: bool = True) -> dict[str, int]:
    """Resident bytes on one rank, by kind: bf16 params, fp32 grads, fp32 master and Adam m, v."""
    share = dp if sharded else 1
    owned = math.ceil(num_params / share)  # this rank's range of every bucket
    return {"params (bf16, param buffer)": 2 * num_params,
            "grads (fp32, grad buffer)": 4 * num_params,
            "master weights (fp32)": 4 * owned,
            "Adam exp_avg (fp32)": 4 * owned,
            "Adam exp_avg_sq (fp32)": 4 * owned}


if __name__ == "__main__":
    from tinytron.model import count_parameters_per_rank, llama_7b_config

    n = count_parameters_per_rank(llama_7b_config(), tp=2, pp=2, pp_rank=0)
    plain, zero1 = optimizer_ledger(n, 64, sharded=False), optimizer_ledger(n, 64)
    print(f"{n:,} parameters on a GPU of the first stage (TP2·PP2·DP64)")
    print(f"{'':30s} {'without':>10s} {'with DistOpt':>13s}")
    for kind in plain:
        print(f"{kind:30s} {plain[kind] / 1e9:8.2f} GB {zero1[kind] / 1e9:10.3f} GB")
    total_plain, total_zero1 = sum(plain.values()), sum(zero1.values())
    print(f"{'total':30s} {total_plain / 1e9:8.2f} GB {total_zero1 / 1e9:10.2f} GB")
    assert round(n / 1e9, 1) == 2.0
    assert total_plain == 18 * n and abs(total_zero1 / n - (2 + 4 + 12 / 64)) < 1e-6

# %% [markdown]
# ## Demo: the ownership map of a small model at DP 4
#
# A two-layer toy stack in bf16, laid out by [chapter 05's buffer](../05_buffers/param_and_grad_buffer.py) for 4 DP ranks with a small
# bucket size. The map is computed from the same `shard_param_ranges` the optimizer uses; no
# process group is needed to draw it.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.buffers.param_and_grad_buffer import toy_layer_stack

    stack = toy_layer_stack(vocab=64)
    names = {p: n.replace(".weight", "") for n, p in stack.named_parameters()}
    params = list(stack.parameters())
    buf = ParamAndGradBuffer(params, param_dtype=torch.bfloat16, grad_dtype=torch.float32,
                             dp_size=4, bucket_size=6000, use_distributed_optimizer=True,
                             param_names=names)
    rows = ownership_table(buf)
    for r in range(4):
        mine = [f"{n}{list(pr)}" for rank, _, n, pr, _ in rows if rank == r]
        print(f"dp rank {r} steps {sum(pr[1] - pr[0] for rank, _, _, pr, _ in rows if rank == r):5d}"
              f" elements: {', '.join(mine[:4])}{' ...' if len(mine) > 4 else ''}")
    plot_ownership_map(buf, title="DistributedOptimizer ownership, dp=4, bucket_size=6000")
    plt.tight_layout()
    plt.show()
    covered = {}
    for _, _, n, (s, e), _ in rows:
        covered[n] = covered.get(n, 0) + e - s
    assert all(covered[names[p]] == p.numel() for p in params)   # every element owned once
    for dp in (1, 2, 8, 64):
        print(f"dp={dp:3d}: {bytes_per_param(dp):5.2f} bytes/param (unsharded {bytes_per_param(dp, False):.0f})")
    assert bytes_per_param(8) == 7.5


# %% [markdown]
# ## Demo: balance, whole parameters against bucket ranges
#
# The same 18,592 elements split both ways: by whole parameters with `owners_by_size`, and by
# the buffer's ranges above. The two 3,072-element `qkv` weights cannot be cut, so whole
# parameters leave the heaviest rank about 10% above an even share; the ranges differ only by
# their padding, about 1%.

# %%
if __name__ == "__main__":
    by_range = [sum(pr[1] - pr[0] for rank, _, _, pr, _ in rows if rank == r) for r in range(4)]
    owner = owners_by_size([p.numel() for p in params], 4)
    by_param = [sum(p.numel() for p, o in zip(params, owner) if o == r) for r in range(4)]
    even = sum(by_param) / 4
    print(f"whole parameters: {by_param}, heaviest {max(by_param) / even - 1:+.1%} over an even share")
    print(f"bucket ranges:    {by_range}, heaviest {max(by_range) / even - 1:+.1%} over an even share")
    assert sum(by_range) == sum(by_param) == sum(p.numel() for p in params)
    assert max(by_param) / even > 1.08 and max(by_range) / even < 1.02
    assert owners_by_size([512, 32, 32, 32, 256, 8], 2) == [0, 1, 1, 1, 1, 1]  # the MLP: 512 / 360

# %% [markdown]
# ## Summary
#
# - ZeRO-1 keeps each parameter's fp32 master and Adam moments on one DP rank: $12/dp$ bytes
#   per parameter instead of 12, while every rank keeps its bf16 params and fp32 grads (2 + 4).
# - Over whole parameters it is three steps (all-reduce, step my params, broadcast) and trains
#   the same model; it is unbalanced, moves twice the gradient bytes it needs, and issues two
#   calls per parameter.
# - Megatron splits every bucket into $dp$ equal ranges instead: a parameter may be cut between
#   ranks, and each piece carries its four ranges (`ShardRange`).
# - On the running example's GPU the optimizer's share falls from 24 GB to 0.38 GB; the fp32
#   grad buffer is then the largest term.
#
# ## How production does it
#
# - Megatron: the range maps in `megatron/core/optimizer/distrib_optimizer.py`, on the buckets
#   of `megatron/core/distributed/param_and_grad_buffer.py`.
#   <details><summary>Megatron detail: where each piece is</summary>
#
#   In `distrib_optimizer.py`: `_build_model_gbuf_param_range_map:123`, the range maps
#   `:123-323`, the param groups built from them `:324`.
#
#   </details>
# - PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) shards per parameter (dim-0 DTensor
#   shards) instead of per bucket range, and also shards the params themselves (ZeRO-3);
#   torchtitan uses it.
#
# ## Exercises
#
# 1. In the ownership map, which parameter is split between two ranks? What would go wrong if
#    the optimizer assumed whole parameters (think of Muon).
#
#    <details><summary>Answer</summary>
#
#    More than one: `ownership_table` gives each layer's `fc2`
#    2016 elements on rank 0 and 32 on rank 1, each `qkv` 992 on rank 2 and 2080 on rank 3,
#    and the embedding a piece on every rank. An update that needs the whole matrix, as Muon's
#    Newton–Schulz does, cannot be computed from a 1-D slice.
#
#    </details>
#
# 2. In the running example, at which DP size does the sharded optimizer state (0.38 GB at
#    DP 64) become larger than the bf16 params? What does that say about small DP groups?
#
#    <details><summary>Answer</summary>
#
#    $12n/dp > 2n$ when $dp < 6$. With `optimizer_ledger` and
#    $n$ = 2,007,629,824: 4.82 GB of state against 4.02 GB of params at DP 5; at DP 6 the two are
#    equal (4 bytes apart, from rounding up the owned range); at DP 7, 3.44 GB. Below about 6
#    ranks the optimizer state, not the weights, is the larger resident cost.
#
#    </details>
#
# 3. Split the toy stack by whole parameters at DP 8. How far above an even share is the
#    heaviest rank, and why can no whole-parameter split do better?
#
#    <details><summary>Answer</summary>
#
#    `owners_by_size` gives 3,072, 3,072, then 2,080 five times and 2,048: an even share is
#    18,592 / 8 = 2,324, so the two ranks holding a `qkv` weight are 32% above it. Each `qkv`
#    alone is larger than an even share, so whichever rank holds one holds at least 3,072.
#    The bucket ranges cut the `qkv` weights: their heaviest rank holds 2,352, 1% above.
#
#    </details>
