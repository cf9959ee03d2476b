# %% [markdown]
# # 02 · Optimizer: the DistributedOptimizer (ZeRO-1)
#
# Every data-parallel rank holds the same bf16 model, but only needs the fp32 master weights and
# Adam state for the part of the model it updates. The DistributedOptimizer splits every bucket
# of [chapter 05's contiguous buffer](../05_buffers/param_and_grad_buffer.py) into `dp` equal ranges, keeps master + state only for its
# range, steps it, writes the new bf16 values into the param buffer, and one all-gather per bucket
# gives every rank the full model again.

# %%
from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.distributed as dist

from tinytron.buffers import ParamAndGradBuffer
from tinytron.kernels import FlatAdamW
from tinytron.optimizer._checks import check_distopt_inner
from tinytron.optimizer.mixed_precision import (MixedPrecisionOptimizer, _group_hparams,
                                                _load_group_hparams, copy_param_attributes)

__all__ = ["NaiveZeRO1", "owners_by_size", "DistributedOptimizer", "merge_sharded_state_dicts",
           "data_parallel_step", "ownership_table", "plot_ownership_map", "bytes_per_param",
           "optimizer_ledger"]

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
# It trains exactly like the real DistributedOptimizer (the demo at the end of the page checks
# it on two ranks), and it already divides the 12 bytes of state per parameter by roughly $dp$.
# Three things keep it from being what Megatron runs:
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
#
# The step (`DistributedOptimizer`, `distrib_optimizer.py:102`; copies `:2661`, `:2707`;
# `step_with_ready_grads:3013`):
#
# ```mermaid
# sequenceDiagram
#   participant B as grad buffer (fp32)
#   participant M as my fp32 shard (master + m, v)
#   participant P as param buffer (bf16)
#   B->>B: reduce-scatter per bucket (chapter 05)
#   B->>M: grad of each piece = main_grad.view(-1)[range]
#   M->>M: unscale, found_inf, global norm over ALL ranks, clip
#   M->>M: Adam on the shard
#   M->>P: write bf16 into param_data[range]
#   P->>P: all-gather per bucket → full model on every rank
# ```
#
# Because every rank holds disjoint pieces, the grad norm (and `found_inf`) is reduced over
# **all** ranks (Megatron's grad-stats group for the distributed optimizer), not only over the
# model-parallel group.

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
# ## The optimizer
#
# It is the mixed-precision optimizer of [the previous page](mixed_precision.py) with three
# parts replaced:
# the master params are fp32 copies of the **owned pieces** (1-D slices) and replace the model
# params in the inner optimizer's groups (a piece of an fp32 param is its own master, a view,
# as Megatron's `shard_model_param` is, `distrib_optimizer.py:442-446`); the grad of a piece
# is the matching slice of `main_grad`; the write-back goes into the bf16 `param_data` at the
# piece's buffer range, followed by the all-gather (synchronous here, or left to the next
# forward's pre-hooks with `overlap_param_gather`). Megatron accepts only Adam as the inner
# optimizer (`distrib_optimizer.py:663-669`); any *elementwise* rule works the same way, but
# Muon needs whole matrices and has its own layer-wise distribution
# ([the next page](layer_wise.py)).
#
# **Fused AdamW.** With `fused_adamw=True` (config `kernels = "triton"`) the pieces' masters and
# moments become views of flat fp32 buffers, and the AdamW step plus the bf16 write-back into
# `param_data` run as one Triton launch that reads the gradients straight from the grad buffer
# ([appendix C](../kernels/fused_adamw.py), `FlatAdamW`); the state dict and the all-gather are
# unchanged.
#
#
# **State dict.** The saved form is [the previous page's](mixed_precision.py)
# layout-independent one: per parameter name, *full* tensors (`fp32_param`, `exp_avg`,
# `exp_avg_sq`, `step`). Each DP rank fills a bucket-shard-sized vector with its pieces and one
# all-gather per bucket and quantity reassembles the bucket; loading takes each rank's slice.
# So a checkpoint written at DP 4 loads at DP 2 or into the plain optimizer, and the reverse.
# Gathering full tensors does not scale, so there is also a *sharded* form without
# communication: `sharded_state_dict()` returns only my pieces, each tagged with its flat
# `range` inside the parameter and the parameter's full `shape` (the idea of Megatron's sharded
# formats, `sharded_param_state_dp_zero` … `_fs_model_space`, `distrib_optimizer.py:1601-1946`);
# `merge_sharded_state_dicts` turns the pieces of all ranks back into the full form.

# %% [markdown]
# The checks that refuse an inner optimizer this layout cannot serve (Muon, or a fused AdamW
# over anything but AdamW) and a DDP that does not shard are in
# `chapters/02_optimizer/_checks.py`.
#
# **The three replaced parts**, as one small class: the grad of a piece is a slice of the
# reduce-scattered buffer; the write-back goes into the param buffer; the step ends with the
# all-gather. Example: a `[4, 8]` weight whose buffer range is split at element 20 between two
# ranks. Rank 0's piece is `param_start, param_end = 0, 20`: its grad is
# `main_grad.view(-1)[0:20]`, its master a 20-element fp32 vector; rank 1's is `[20, 32)`. The
# norm of the whole weight's gradient is $\sqrt{n_0^2 + n_1^2}$ from the two ranks' partial
# sums of squares, which is why the sum runs over the world.

# %%
class ShardedCopies:
    """What the DistributedOptimizer replaces in the mixed-precision step: shard in, shard out."""

    def grad_stats_group(self):
        """Disjoint shards: norms and found_inf are reduced over every rank (the world)."""
        return None

    def _reduce(self) -> bool:
        """Reduce whenever there is more than one rank."""
        return dist.is_initialized() and dist.get_world_size() > 1

    def copy_model_grads_to_main_grads(self) -> None:
        """Grad of each owned piece = its slice of main_grad (valid after the reduce-scatter)."""
        for (model, main), (piece, _) in zip(self.pairs, self.pieces):
            main.grad = model.main_grad.view(-1)[piece.param_start:piece.param_end].float()
            model.grad = None

    def copy_main_params_to_model_params(self) -> None:
        """Write every fp32 piece into the param buffer (bf16 rounding happens here)."""
        if not self.pairs:
            return
        pairs = [(buf.param_data[p.buffer_start:p.buffer_end], m.detach())
                 for (p, buf), (_, m) in zip(self.pieces, self.pairs)]
        pairs = [(d, m) for d, m in pairs if d.data_ptr() != m.data_ptr()]  # fp32 views: in place
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [m for _, m in pairs])

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Step my shards, write them back, all-gather (unless the forward pre-hooks will)."""
        if self.fused_adamw is not None:
            self.fused_adamw.step()
        else:
            super().step_with_ready_grads()
        for chunk in self.model_chunks:  # each chunk's all-gather, unless its pre-hooks will
            if not chunk.ddp_config.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)


# %% [markdown]
# **The optimizer itself** builds its fp32 masters from the pieces, and only from them: a
# parameter without a piece in this rank's ranges is absent from this rank's inner optimizer,
# which therefore holds Adam state for $1/dp$ of the model. Its state dicts are the functions of
# the next section.
#
# First that construction, as a function of the optimizer: walk the groups, keep only the
# params with a piece here, and put an fp32 master of the piece in each one's place.

# %%
def _build_piece_masters(opt) -> None:
    """Replace each model param in the groups by fp32 copies (views, for fp32) of my pieces."""
    opt.piece_of = {piece.param: (piece, buf) for buf in opt.buffers
                    for b in buf.buckets for piece in b.shard_param_ranges()}
    opt.model_param_names, opt.pieces = {}, []
    for group, names in zip(opt.optimizer.param_groups, opt.group_names):
        kept, kept_names = [], []
        for name, p in zip(names, group["params"]):
            opt.model_param_names[p] = name
            if p not in opt.piece_of:
                continue  # no piece of this param in my shards: absent from my inner optimizer
            piece, buf = opt.piece_of[p]
            flat = p.detach().view(-1)[piece.param_start:piece.param_end]
            # fp32 params: the shard *is* the master, a view (distrib_optimizer.py:442-446).
            main = torch.nn.Parameter(flat if p.dtype == torch.float32 else flat.clone().float())
            copy_param_attributes(main, p)
            kept.append(main)
            kept_names.append(name)
            opt.pairs.append((p, main))
            opt.pieces.append((piece, buf))
            opt.names.append(name)
        group["params"], group["param_names"] = kept, kept_names


# %% [markdown]
# With `fused_adamw`, [appendix C](../kernels/fused_adamw.py)'s kernel replaces the inner step: one
# launch that updates the masters and writes the bf16 params, given each piece's place in the
# buffers.

# %%
def _flat_adamw(opt) -> FlatAdamW:
    """The AdamW step and the bf16 write-back as one Triton launch over the shard."""
    return FlatAdamW(opt.optimizer.param_groups, opt.optimizer.state,
                     [(main, buf.grad_data, buf.param_data, piece.buffer_start)
                      for (_, main), (piece, buf) in zip(opt.pairs, opt.pieces)])


# %% [markdown]
# And the optimizer: it finds the buffers of its DDP wrappers, lets the mixed-precision
# constructor build the masters (through the function above), and keeps the three state-dict
# forms of the next section.

# %%
class DistributedOptimizer(ShardedCopies, MixedPrecisionOptimizer):
    """ZeRO-1 on chapter 05's buffers: fp32 master + state only for this DP rank's bucket ranges.

    Example (on every rank of a DP group; the loop is `data_parallel_step` below)::

        ddp = DistributedDataParallel(model, grid, DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True))
        opt = DistributedOptimizer(AdamW(model.parameters(), lr=3e-4), ddp, clip_grad=1.0)
    """

    def __init__(self, optimizer, ddp, *, clip_grad: float = 1.0, grad_scaler=None,
                 log_num_zeros_in_grad: bool = False, grad_norm_skip_threshold: float = math.inf,
                 fused_adamw: bool = False):
        # one DDP wrapper, or one per model chunk (virtual stages): the buffers of all, in order
        self.model_chunks = first, *_ = check_distopt_inner(optimizer, ddp, fused_adamw)
        self.buffers = [buf for chunk in self.model_chunks for buf in chunk.buffers]
        self.dp_group, self.dp_size = first.dp_group, first.dp_size
        super().__init__(optimizer, clip_grad=clip_grad, grad_scaler=grad_scaler, grid=first.grid,
                         log_num_zeros_in_grad=log_num_zeros_in_grad,
                         grad_norm_skip_threshold=grad_norm_skip_threshold)
        # Appendix C: the AdamW step and the bf16 write-back as one Triton launch over the shard.
        self.fused_adamw = None if not fused_adamw else _flat_adamw(self)

    def _build_main_params(self) -> None:
        """Replace each model param in the groups by fp32 copies (views, for fp32) of my pieces."""
        _build_piece_masters(self)

    def state_dict(self) -> dict:
        """Layout-independent state: full tensors per param name, assembled from every DP shard."""
        return _gathered_state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Take my slice of every full tensor; refresh the whole model from the fp32 values."""
        _load_gathered_state_dict(self, sd)

    def sharded_state_dict(self) -> dict:
        """No communication: my pieces, each with its flat range in the param and the full shape."""
        return _pieces_state_dict(self)


# %% [markdown]
# ### Several model chunks
#
# With virtual pipeline stages a rank holds $v$ model chunks, each wrapped in its own DDP with
# its own buffers. Given a list of DDP wrappers, the constructor above builds one optimizer
# over all their buffers, as Megatron's does: one norm, one clip and one step for the whole
# stage; only each chunk's all-gather is its own.
#
# <details><summary>Megatron detail: the chunks' buffers, chained</summary>
#
# Each chunk has its own DDP ([chapter 01's `wrap_with_ddp`](../01_main_loop/run.py): only the
# first one bucketed, `training.py:1783-1787`). Megatron passes the whole model list to
# `get_megatron_optimizer` (`training.py:1979`), and the DistributedOptimizer chains the
# chunks' buffers into one list (`distrib_optimizer.py:685`). Here too `buffers` is every
# chunk's buffers in chunk order, each bucket split into $dp$ ranges as before, and the buffer
# index counts across chunks — the order in which the legacy `distrib_optim.pt` stores its
# world tensors ([chapter 03](../03_checkpoint/legacy.py)).
#
# Each chunk's all-gather runs synchronously at the end of the step, or, with
# `overlap_param_gather`, is left to that chunk's next forward. With `align_param_gather` the
# interleaved schedule launches those gathers itself, chunk $c + 1$ as chunk $c$ starts
# ([chapter 01's interleaved schedule](../01_main_loop/interleaved.py)), and the pre-hooks only
# wait.
#
# </details>
#
# <details><summary>Megatron detail: how the chunked layout is tested</summary>
#
# `tests/test_main_loop_param_sync.py` runs PP 2 × VPP 3 × DP 2 that way: after the first
# step every bucket's gather of every chunk comes from the schedule, none from a pre-hook, and
# three steps give the plain optimizer's weights bit for bit (fp32, no clipping: the same sums,
# an elementwise update). With clipping the norm is summed in another order (shards over the
# world, against whole parameters over the pipeline group), so the trainer's test allows
# $10^{-6}$ relative on the losses of PP 2 × VPP 2 × DP 2 (measured: equal), and
# `tests/test_train_megatron_core.py` compares that layout with megatron-core's own
# DistributedOptimizer, both overlapping the gathers. The recipe is
# `configs/pp2_vpp2_dp2_distopt.toml`.
#
# </details>

# %% [markdown]
# ### The state dict, gathered
#
# Each bucket is rebuilt one quantity at a time (the fp32 param, then each state key): every
# rank writes its pieces into a shard-sized vector and an all-gather assembles the bucket. The
# integer step counters travel separately, as a max over ranks (a rank that owns no piece of
# a parameter has no counter for it).

# %%
def _state_keys(opt) -> list[str]:
    """Tensor state keys, agreed by all DP ranks (a rank may own nothing)."""
    local = sorted({k for _, m in opt.pairs for k, v in opt._state_of[id(m)].get(m, {}).items()
                    if torch.is_tensor(v) and v.numel() == m.numel()})
    if opt.dp_size == 1:
        return local
    everyone = [None] * opt.dp_size
    dist.all_gather_object(everyone, local, group=opt.dp_group)
    return sorted(set().union(*everyone))


# %% [markdown]
# One quantity of one bucket: each rank fills its shard-sized slice from its pieces, and an
# all-gather puts the bucket together.

# %%
def _gather_bucket(opt, bucket, key: str, main_of: dict) -> torch.Tensor:
    """The full bucket of one quantity (fp32 param or a state key) from all DP shards."""
    local = torch.zeros(bucket.shard_size, dtype=torch.float32, device=bucket.grad_data.device)
    for piece in bucket.shard_param_ranges():
        main = main_of[piece.param]
        src = main if key == "fp32_param" else opt._state_of[id(main)].get(main, {}).get(key)
        if src is not None:
            local[piece.shard_start:piece.shard_end] = src.detach().view(-1)
    if opt.dp_size == 1:
        return local
    full = torch.empty(bucket.numel, dtype=torch.float32, device=local.device)
    with warnings.catch_warnings():   # torch 2.13 renamed it; 2.11 has only this name
        warnings.filterwarnings("ignore", category=FutureWarning)
        dist.all_gather_into_tensor(full, local, group=opt.dp_group)
    return full


# %% [markdown]
# The step counters are integers, one per parameter: a MAX all-reduce picks each from whichever
# rank owns a piece of it.

# %%
def _gather_steps(opt, bucket, main_of: dict) -> list[int] | None:
    """Each bucket param's integer step counter, taken from whichever rank owns a piece."""
    steps = torch.full((len(bucket.params),), -1.0, dtype=torch.float64,
                       device=bucket.grad_data.device)
    index = {p: i for i, p in enumerate(bucket.params)}
    for piece in bucket.shard_param_ranges():
        main = main_of[piece.param]
        step = opt._state_of[id(main)].get(main, {}).get("step")
        if step is not None:
            steps[index[piece.param]] = float(step)
    if opt.dp_size > 1:
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=opt.dp_group)
    return None if bool((steps < 0).all()) else [int(v) for v in steps.tolist()]


# %% [markdown]
# The full state dict is those buckets cut back into parameters; loading takes this rank's
# slice of each full tensor, and refreshes the whole model from the fp32 values.

# %%
def _gathered_state_dict(opt) -> dict:
    """{params: {name: full fp32_param and state}, param_groups, grad_scaler}, on every rank."""
    keys = ["fp32_param"] + _state_keys(opt)
    main_of = {model: main for model, main in opt.pairs}
    params = {}
    for buf in opt.buffers:
        for b in buf.buckets:
            fulls = {k: _gather_bucket(opt, b, k, main_of) for k in keys}
            steps = _gather_steps(opt, b, main_of)
            for i, p in enumerate(b.params):
                s, e = b.param_to_index[p]
                entry = {k: full[s:e].view(p.shape).clone() for k, full in fulls.items()}
                if steps is not None and steps[i] >= 0:
                    entry["step"] = steps[i]
                params[opt.model_param_names[p]] = entry
    return {"params": params, "param_groups": _group_hparams(opt.param_groups, opt.group_names),
            "grad_scaler": None if opt.grad_scaler is None else opt.grad_scaler.state_dict()}


@torch.no_grad()
def _load_gathered_state_dict(opt, sd: dict) -> None:
    """This rank's slice of every full tensor into its pieces; every model param from fp32."""
    _load_group_hparams(opt.param_groups, sd["param_groups"])
    missing = [n for n in opt.model_param_names.values() if n not in sd["params"]]
    if missing:
        raise ValueError(f"optimizer state has no entry for params {missing[:5]}")
    for p, name in opt.model_param_names.items():
        p.data.copy_(sd["params"][name]["fp32_param"].view(p.shape))
    for (model, main), (piece, _), name in zip(opt.pairs, opt.pieces, opt.names):
        entry, sl = sd["params"][name], slice(piece.param_start, piece.param_end)
        main.copy_(entry["fp32_param"].reshape(-1)[sl])
        opt._state_of[id(main)][main] = {
            k: (v.reshape(-1)[sl].clone().to(main.device) if torch.is_tensor(v) else v)
            for k, v in entry.items() if k != "fp32_param"}
    if opt.grad_scaler is not None and sd.get("grad_scaler") is not None:
        opt.grad_scaler.load_state_dict(sd["grad_scaler"])


# %% [markdown]
# The sharded form needs no communication: each rank saves its own pieces, tagged with where
# they sit in their parameter, and `merge_sharded_state_dicts` rebuilds the full form.

# %%
def _pieces_state_dict(opt) -> dict:
    """My pieces only, each with its flat range inside the param and the param's full shape."""
    params = {}
    for (model, main), (piece, _), name in zip(opt.pairs, opt.pieces, opt.names):
        entry = {"fp32_param": main.detach().clone(),
                 "range": (piece.param_start, piece.param_end), "shape": tuple(model.shape)}
        for k, v in opt._state_of[id(main)].get(main, {}).items():
            entry[k] = v.detach().clone() if torch.is_tensor(v) else v
        params[name] = entry
    return {"params": params, "param_groups": _group_hparams(opt.param_groups, opt.group_names),
            "grad_scaler": None if opt.grad_scaler is None else opt.grad_scaler.state_dict()}


def merge_sharded_state_dicts(parts: list[dict]) -> dict:
    """Reassemble the layout-independent form from every rank's `sharded_state_dict()`."""
    full: dict = {}
    for part in parts:
        for name, entry in part["params"].items():
            start, end = entry["range"]
            out = full.setdefault(name, {"_numel": math.prod(entry["shape"]),
                                         "_shape": entry["shape"]})
            for k, v in entry.items():
                if k in ("range", "shape"):
                    continue
                if torch.is_tensor(v) and v.numel() == end - start:
                    out.setdefault(k, torch.zeros(out["_numel"], dtype=v.dtype))
                    out[k][start:end] = v.reshape(-1)
                else:
                    out[k] = v
    params = {n: {k: (v.view(e["_shape"]) if torch.is_tensor(v) else v)
                  for k, v in e.items() if not k.startswith("_")} for n, e in full.items()}
    return {"params": params, "param_groups": parts[0]["param_groups"],
            "grad_scaler": parts[0]["grad_scaler"]}


# %% [markdown]
# ## The training loop around it
#
# The optimizer is one step of an iteration, and the order of the steps around it is part of
# the contract (Megatron's `train_step`, `megatron/training/training.py`, with
# `finalize_model_grads`, `megatron/core/distributed/finalize_model_grads.py:445`):
#
# 1. `ddp.zero_grad_buffer()` — zero the grad buffer, reset the bucket counters;
# 2. forward and backward of each micro-batch — grads accumulate into the fp32 buffer; every
#    micro-batch but the last runs under `no_sync()`, so that the last one's backward launches
#    each bucket's reduce-scatter (with `overlap_grad_reduce`, as soon as the bucket is complete);
# 3. `ddp.finish_grad_sync()` — wait for those collectives (`finalize_model_grads` does this,
#    then the tied-embedding and sequence-parallel reductions of
#    [chapter 05](../05_buffers/finalize_model_grads.py)); only now does
#    this rank's shard hold the data-parallel mean;
# 4. `optimizer.step()` — unscale, clip with the global norm, Adam on the shard, write back,
#    all-gather.
#
# Skipping step 3 would let each rank step on its own local gradients, so the optimizer
# refuses to step until this iteration's grad sync has finished. Demo 2 runs this function on
# two ranks.

# %%
def data_parallel_step(ddp, optimizer, micro_batches, loss_fn) -> tuple[float, bool, float | None]:
    """One iteration in Megatron's order; (summed loss, step succeeded, grad norm)."""
    ddp.zero_grad_buffer()
    total = 0.0
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss = loss_fn(ddp, batch) / len(micro_batches)  # the mean over micro-batches
            optimizer.scale_loss(loss).backward()
        total += float(loss.detach())
    ddp.finish_grad_sync()  # the DP reduce-scatter must be complete before the step reads it
    ok, grad_norm, _ = optimizer.step()
    return total, ok, grad_norm

# %% [markdown]
# ## Demo 1: the ownership map of a small model at DP 4
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
# ## Demo 2: DP 2 gives the same model as the plain optimizer
#
# Two gloo ranks; each trains a small MLP through
# [chapter 05's DDP](../05_buffers/distributed_data_parallel.py) with the DistributedOptimizer on
# its half of every batch, one `data_parallel_step` per step, with gradient clipping and a
# dynamic loss scaler, and an inf injected into one step. Beside it, the plain
# mixed-precision optimizer trains the same MLP on the whole batch. After 6 steps the fp32
# params agree to rounding, the same step was skipped on both, and the state dict gathered
# from the shards equals the plain optimizer's.

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.optimizer import _workers

    out = run_on_ranks(_workers.distopt_parity, 2, "float32", 6, 0.5, True, (3,), timeout=120)
    for r, o in enumerate(out):
        print(f"rank {r}: max |distopt - plain| = {o['max_param_diff']:.1e}, "
              f"state dict diff {o['max_state_diff']:.1e}, steps ok {o['ok']}")
    assert all(o["max_param_diff"] < 1e-5 and o["max_state_diff"] < 1e-5 for o in out)
    assert all(o["ok"] == o["ref_ok"] and not o["ok"][3] for o in out)

# %% [markdown]
# ## Demo 3: whole parameters or bucket ranges, the same training
#
# The [naive version](#first-whole-parameters) and the real one side by side on two gloo ranks,
# fp32, no clipping, five AdamW steps on each rank's half of the same batches
# (`tinytron.optimizer._naive.naive_zero1_vs_distopt`). The weights agree to rounding. The
# state splits 512 against 360 elements in both: one weight is more than half of this model,
# and the 64-element alignment padding is as large as the small tensors, so the equal buffer
# ranges hold the same real elements as the greedy split. At the 7B scale the padding is below
# 0.01% of a bucket and the ranges are even where whole parameters are not.

# %%
if __name__ == "__main__":
    from tinytron.optimizer._naive import naive_zero1_vs_distopt

    out = run_on_ranks(naive_zero1_vs_distopt, 2, timeout=120)
    for o in out:
        print(f"rank {o['rank']}: max |naive - DistributedOptimizer| = {o['max_param_diff']:.1e};"
              f" state for {o['naive_owned']} (whole params) vs {o['real_owned']} (a bucket range"
              f" of {o['real_range']}) of {o['total']} elements")
    assert all(o["max_param_diff"] < 1e-6 for o in out)
    assert sorted(o["naive_owned"] for o in out) == [360, 512]
    assert sum(o["real_owned"] for o in out) == out[0]["total"]
    assert out[0]["real_range"] == out[1]["real_range"]   # even ranges, padding included
    assert owners_by_size([512, 32, 32, 32, 256, 8], 2) == [0, 1, 1, 1, 1, 1]

# %% [markdown]
# ## Summary
#
# - ZeRO-1 over whole parameters is three steps (all-reduce, step my params, broadcast) and
#   trains the same model; it is unbalanced, moves twice the gradient bytes it needs, and
#   issues two calls per parameter.
# - Each DP rank owns a contiguous range of every bucket; the fp32 master and Adam state exist
#   only for the pieces of params inside it: $12/dp$ instead of 12 bytes per param.
# - Grad in = slice of the reduce-scattered `main_grad`; param out = bf16 write into the param
#   buffer, then one all-gather per bucket.
# - Grad norm and `found_inf` are reduced over all ranks because the shards are disjoint.
# - The state dict is per-parameter and full-sized, so any DP size can reload it.
# - With virtual stages one optimizer spans every chunk's buffers; each chunk's all-gather is
#   its own, launched by the interleaved schedule when the gathers are aligned.
#
# ## How production does it
#
# - Megatron: `megatron/core/optimizer/distrib_optimizer.py`; the buffers and collectives in
#   `megatron/core/distributed/param_and_grad_buffer.py`.
#   <details><summary>Megatron detail: where each piece is</summary>
#
#   In `distrib_optimizer.py`: range maps `:123-323`, param groups `:324`, `__init__:609`,
#   grad/param copies `:2661/:2707`, `step_with_ready_grads:3013`.
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
# 3. Why is `found_inf` reduced over all ranks here, while the plain optimizer reduces it over
#    the model-parallel group only?
#
#    <details><summary>Hint</summary>
#
#    Compare `ShardedCopies.grad_stats_group` with
#    `MasterCopies.grad_stats_group`: after DDP's all-reduce every DP rank of the plain optimizer
#    holds the same full grads, while each DP rank here unscales only its own shard.
#
#    </details>
