# %% [markdown]
# # 02 · Optimizer: the DistributedOptimizer (ZeRO-1)
#
# [The previous page](zero1.py) gave every data-parallel rank an equal range of every bucket of
# [chapter 05's contiguous buffer](../05_buffers/param_and_grad_buffer.py) and counted the
# bytes that saves. This page builds the optimizer that steps those ranges: it keeps fp32
# master + Adam state only for its range, takes each piece's gradient from the reduce-scattered
# grad buffer, writes the new bf16 values into the param buffer, and one all-gather per bucket
# gives every rank the full model again. Its state dict is full-sized per parameter, so any DP
# size can reload it, and on two ranks it trains the same model as the plain optimizer.

# %%
from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.distributed as dist

from tinytron.kernels import FlatAdamW
from tinytron.optimizer._checks import check_distopt_inner
from tinytron.optimizer.mixed_precision import (MixedPrecisionOptimizer, _group_hparams,
                                                _load_group_hparams, copy_param_attributes)

__all__ = ["DistributedOptimizer", "merge_sharded_state_dicts", "data_parallel_step"]

# %% [markdown]
# ## The step
#
# After chapter 05's reduce-scatter, rank $r$ holds the data-parallel mean of the gradient only
# inside its range of each bucket. The step works on that range alone, from the grad buffer to
# the param buffer (`DistributedOptimizer`, `distrib_optimizer.py:102`; copies `:2661`, `:2707`;
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

# %% [markdown]
# ## The optimizer
#
# It is the mixed-precision optimizer of [the mixed-precision page](mixed_precision.py) with
# three parts replaced:
# the master params are fp32 copies of the **owned pieces** (1-D slices) and replace the model
# params in the inner optimizer's groups (a piece of an fp32 param is its own master, a view,
# as Megatron's `shard_model_param` is, `distrib_optimizer.py:442-446`); the grad of a piece
# is the matching slice of `main_grad`; the write-back goes into the bf16 `param_data` at the
# piece's buffer range, followed by the all-gather (synchronous here, or left to the next
# forward's pre-hooks with `overlap_param_gather`). Megatron accepts only Adam as the inner
# optimizer (`distrib_optimizer.py:663-669`); any *elementwise* rule works the same way, but
# Muon needs whole matrices and has its own distribution
# ([layer-wise Muon](layer_wise.py)): a [cut parameter](zero1.py#who-owns-what) is no matrix.
#
# **Fused AdamW.** With `fused_adamw=True` (config `kernels = "triton"`) the pieces' masters and
# moments become views of flat fp32 buffers, and the AdamW step plus the bf16 write-back into
# `param_data` run as one Triton launch that reads the gradients straight from the grad buffer
# ([appendix C](../kernels/fused_adamw.py), `FlatAdamW`); the state dict and the all-gather are
# unchanged.
#
#
# **State dict.** The saved form is [the mixed-precision page's](mixed_precision.py)
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
# refuses to step until this iteration's grad sync has finished. Demo 1 runs this function on
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
# ## Demo 1: DP 2 gives the same model as the plain optimizer
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
# ## Demo 2: whole parameters or bucket ranges, the same training
#
# [The previous page's naive version](zero1.py#first-whole-parameters) and the real one side by
# side on two gloo ranks, fp32, no clipping, five AdamW steps on each rank's half of the same
# batches (`tinytron.optimizer._naive.naive_zero1_vs_distopt`). The weights agree to rounding. The
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

# %% [markdown]
# ## Summary
#
# - Each DP rank's fp32 masters are the pieces of its bucket ranges (views, for fp32 params); a
#   parameter with no piece there is absent from its inner optimizer.
# - Grad in = slice of the reduce-scattered `main_grad`; param out = bf16 write into the param
#   buffer, then one all-gather per bucket.
# - Grad norm and `found_inf` are reduced over all ranks because the shards are disjoint.
# - The state dict is per-parameter and full-sized, so any DP size can reload it; the sharded
#   form saves each rank's pieces without communication.
# - With virtual stages one optimizer spans every chunk's buffers; each chunk's all-gather is
#   its own, launched by the interleaved schedule when the gathers are aligned.
# - On two ranks it trains the plain optimizer's model, and the whole-parameter ZeRO-1 of
#   [the previous page](zero1.py) trains the same one.
#
# ## How production does it
#
# - Megatron: `megatron/core/optimizer/distrib_optimizer.py`; the buffers and collectives in
#   `megatron/core/distributed/param_and_grad_buffer.py`.
#   <details><summary>Megatron detail: where each piece is</summary>
#
#   In `distrib_optimizer.py`: param groups `:324`, `__init__:609`, the sharded state-dict
#   formats `:1601-1946`, grad/param copies `:2661/:2707`, `step_with_ready_grads:3013`.
#
#   </details>
# - PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) shards per parameter (dim-0 DTensor
#   shards) instead of per bucket range, and also shards the params themselves (ZeRO-3);
#   torchtitan uses it.
#
# ## Exercises
#
# 1. Why is `found_inf` reduced over all ranks here, while the plain optimizer reduces it over
#    the model-parallel group only?
#
#    <details><summary>Hint</summary>
#
#    Compare `ShardedCopies.grad_stats_group` with
#    `MasterCopies.grad_stats_group`: after DDP's all-reduce every DP rank of the plain optimizer
#    holds the same full grads, while each DP rank here unscales only its own shard.
#
#    </details>
#
# 2. At DP 2, with AdamW, a model whose buffer has 3 buckets: how many collectives does
#    `state_dict()` issue, and how many does `sharded_state_dict()`?
#
#    <details><summary>Answer</summary>
#
#    `state_dict()`: one `all_gather_object` to agree on the state keys (`_state_keys`), then
#    per bucket one all-gather for each of `fp32_param`, `exp_avg` and `exp_avg_sq` and one MAX
#    all-reduce for the integer `step` counters: $1 + 3 \times (3 + 1) = 13$.
#    `sharded_state_dict()`: 0, each rank returns its own pieces; the reassembly
#    (`merge_sharded_state_dicts`) happens wherever the pieces are read back.
#
#    </details>
#
# 3. Remove `ddp.finish_grad_sync()` from `data_parallel_step`. What does the optimizer do,
#    and what would each rank step on if it did not check?
#
#    <details><summary>Hint</summary>
#
#    Look at the training-loop section: the backward hook sets the shared grad-sync flag and
#    only `finish_grad_sync` clears it, so `step()` raises a `RuntimeError`. Without the check
#    the step would read shards whose reduce-scatter never ran (overlap off, or the first step)
#    or has not finished: each rank would step on its own local gradient, and the ranks'
#    copies of the model would drift apart.
#
#    </details>
