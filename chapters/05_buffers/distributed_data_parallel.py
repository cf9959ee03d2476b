# %% [markdown]
# # 05 · Buffers: DDP hooks, bucket collectives and their overlap with backward
#
# How the grads in the flat buffer get averaged across data-parallel ranks while backward is
# still running, and how the distributed optimizer's new weights come back before the forward
# needs them. We build Megatron's `DistributedDataParallel` wrapper on the buffer of
# [the previous page](param_and_grad_buffer.py) and check on two real ranks that each rank's
# shard of the grad buffer is the data-parallel mean; [the next page](overlap_timeline.py)
# records the timelines of real backward passes.

# %%
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tinytron._fields import document_fields
from tinytron.buffers._checks import check_ddp_config
from tinytron.buffers._comm import (CommStream, CommTimeline, Handles, all_gather, all_reduce,
                                    axis_info, reduce_scatter)
from tinytron.buffers._ddp_surface import ModuleSurface
from tinytron.buffers.param_and_grad_buffer import (ParamAndGradBuffer,
                                                    group_params_for_buffers)

__all__ = ["DistributedDataParallelConfig", "BucketGroup", "DistributedDataParallel",
           "GradSyncState", "default_bucket_size"]

# %% [markdown]
# ## What changes from the naive version
#
# [The naive DDP](naive_ddp.py) all-reduced each parameter's `.grad` from its hook and waited
# for it there. Keep the hook, the pre-scale by $1/d$ and `no_sync`; change three things:
#
# 1. the grads accumulate into `main_grad`, views of [the flat buffer](param_and_grad_buffer.py),
#    so a *bucket* of parameters is one contiguous slice;
# 2. the hook only *counts*: the collective is launched once the last parameter of a bucket
#    has reported, one call per bucket;
# 3. the call is asynchronous, so the backward of the next layers runs while the bucket's
#    bytes move; `finish_grad_sync` waits for all of them at the end.
#
# Worked example, the demo model of the naive page at DP 2 with buckets of 4,000 elements: 19
# parameter tensors and 3 buckets, so 3 calls per step instead of 19, and the first bucket
# (the output head and final norm, whose grads come first in the backward) is already on the
# wire while the blocks' backward computes.
#
# **The bucket size.** Without overlap there is nothing to hide a collective behind, so one
# bucket (the fewest, largest calls) wins. With overlap Megatron's default is
# $\max(40\text{M}, 1\text{M} \cdot dp)$ elements: at large DP each rank's chunk of a ring
# collective is the bucket divided by $dp$, and the floor keeps that chunk big enough to stay
# bandwidth-bound. At DP 64 the default is 64M elements, 256 MB of fp32 grads, a chunk of 1M
# elements per rank.
#
# <details><summary>Megatron detail: the training script's dp</summary>
#
# The $dp$ in that formula is the data-parallel size *without* context parallelism, as in
# Megatron's DDP (`distributed_data_parallel.py:69`). Megatron's training
# script instead passes $\max(40\text{M}, 1\text{M} \cdot dp_{cp})$ in
# (`megatron/training/training.py:1772-1775`); tinytron follows the DDP class.
#
# </details>

# %%
def default_bucket_size(config: DistributedDataParallelConfig, dp_size: int) -> int | None:
    """Megatron's bucket size: the configured one, else max(40M, 1M*dp); None without overlap."""
    if not config.overlap_grad_reduce:
        return None  # one bucket: nothing to overlap with, so fewer, larger collectives win
    if config.bucket_size is not None:
        return config.bucket_size
    return max(40_000_000, 1_000_000 * dp_size)  # dp without CP (see the note above)


# %% [markdown]
# ## Hooks, readiness, and one collective per bucket
#
# Each trainable parameter gets a **backward post-hook** that fires after autograd has written
# `param.grad` (`distributed_data_parallel.py:449`). The hook adds `param.grad` into
# `param.main_grad` (fp32 accumulation across micro-batches) and sets `param.grad = None`, so
# only one copy of each gradient stays in memory. tinytron registers it with
# `Tensor.register_post_accumulate_grad_hook`.
#
# <details><summary>Megatron detail: the AccumulateGrad node</summary>
#
# Megatron registers the
# hook on the parameter's `AccumulateGrad` node (`distributed_data_parallel.py:368-373`);
# `register_post_accumulate_grad_hook` fires at the same moment and needs no reference to an
# autograd node.
#
# </details>
#
# With `overlap_grad_reduce` the hook also calls `register_grad_ready(param)` on the param's
# **bucket group** (`param_and_grad_buffer.py:800`), on the *last* micro-batch only (`no_sync()`
# clears `is_last_microbatch`, `distributed_data_parallel.py:480`). One call does not always make
# a parameter ready. For a weight used twice in one forward it does: autograd sums both uses and
# accumulates once (demo 1 counts it). But a reentrant activation checkpoint, like Megatron's
# `CheckpointFunction` (`tensor_parallel/random.py:555`) and chapter 06's, runs a backward of its
# own for the recomputed region, so a weight used inside and outside it accumulates twice. So the
# first step only *records* the counts and launches in `finish_grad_sync`; from the second step
# on, a bucket launches the moment its counts equal those "golden" counts.
#
# The collective itself (`start_grad_sync`, `param_and_grad_buffer.py:556`):
#
# - multiply the bucket by `gradient_scaling_factor` (below), then
# - plain DDP: `all_reduce(bucket.grad_data)`; distributed optimizer:
#   `reduce_scatter(out=my shard of the bucket, in=the whole bucket)` — rank `r` ends up with
#   the sum of everyone's `[r·S, (r+1)·S)`; the rest of its bucket is left stale;
# - asynchronously when overlapping; `finish_grad_sync` (`:724`) waits for the handle.
#
# **Scaling.** The goal is the mean over the $d$ DP×CP ranks,
# $\bar g = \frac{1}{d}\sum_{r=0}^{d-1} g_r$ (`distributed_data_parallel.py:169-204`).
# Default: factor `1/dp_cp` before a SUM, which works on every backend and keeps an fp16 sum in
# range: 64 ranks' grads of 2,000 sum to 128,000, past fp16's largest value 65,504 (bf16 has
# fp32's range; there the reason is the backend). `average_in_collective=True`: factor 1 and
# `ReduceOp.AVG`. `calculate_per_token_loss`: factor 1 and SUM; `finalize_model_grads` later
# divides by the global token count.
#
# <details><summary>Megatron detail: bucket groups</summary>
#
# Megatron issues collectives per *bucket group*, coalescing the buckets of a group into one
# NCCL call (`partition_buckets`, `param_and_grad_buffer.py:1512`). By default each group holds
# one bucket, the only grouping tinytron builds, with no coalescing manager; its `BucketGroup`
# keeps a list of buckets so that grouping more of them would change only how the groups are
# formed.
#
# </details>
#
# **Where the collective runs.** On GPU every launch happens on a CUDA side stream that first
# waits for the compute stream (to see the grads backward just wrote), and `wait()` makes the
# compute stream wait for it in turn; NCCL moves the bytes while backward kernels run. On CPU,
# gloo runs each async collective on a worker thread, with the same `Work.wait()` semantics.
#
# <details><summary>Megatron detail: reduce-scatter on gloo</summary>
#
# Torch emulates
# `reduce_scatter_tensor` on gloo with an all-reduce into a temporary copy, so on gloo tinytron
# all-reduces the bucket in place and keeps its shard: the shard is identical (the rest of the
# bucket then holds the mean too, but no code may rely on it), and the test suite also runs
# torch's emulation to prove it. On NCCL it is Megatron's reduce-scatter.
#
# </details>
#
# ```mermaid
# sequenceDiagram
#   participant BW as backward (compute)
#   participant H as grad hooks
#   participant C as collectives
#   BW->>H: grad of final_norm, fc2, fc1 ... (bucket 0 params)
#   H->>C: bucket 0 complete: reduce-scatter(bucket 0), async
#   BW->>H: grads of layer 0 (bucket 1 params)
#   H->>C: bucket 1 complete: reduce-scatter(bucket 1), async
#   Note over BW,C: bucket 0's collective ran while layer 0's backward computed
#   BW->>C: finish_grad_sync: wait(bucket 0), wait(bucket 1)
# ```

# %% [markdown]
# ## A bucket group, in three jobs
#
# A bucket group reduces its buckets' grads after the backward, checks them first, and
# gathers their params before the next forward. Each job is a small class below; `BucketGroup`
# combines them, and its `__init__` sets every attribute they share.
#
# **Reducing the grads.** `start_grad_sync` scales each bucket and launches its collective;
# `finish_grad_sync` waits for it at the end of the backward, or launches it there when no hook
# did: in the first step (the counts are still being learned) and whenever overlap is off.

# %%
class GradLaunch:
    """A bucket group's grad collectives: the launch (scaled, async with overlap)."""

    def start_grad_sync(self) -> None:
        """Scale each bucket and launch its all-reduce / reduce-scatter (async with overlap)."""
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return  # already launched by finish_grad_sync in the first step
        self.check_grads()  # local grads, before the scaling and the collective (below)
        average = self.config.average_in_collective
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        async_op = self.config.overlap_grad_reduce
        self._record("start")
        works = []
        with self.stream.launch():
            for b in self.buckets:
                if b.gradient_scaling_factor != 1.0:
                    b.grad_data.mul_(b.gradient_scaling_factor)
                if self.group_size == 1:
                    continue
                if self.config.use_distributed_optimizer:
                    works.append(reduce_scatter(b.grad_shard(), b.grad_data, op, self.group,
                                                async_op))
                else:
                    works.append(all_reduce(b.grad_data, op, self.group, async_op))
        self.grad_reduce_handle = Handles(works if async_op else [], self.stream)
        if not async_op:
            self.stream.join()  # synchronous: the compute stream may read the result right away
            self._record("done")
        elif self.timeline is not None:
            for b in self.buckets:
                self.timeline.watch(b.bucket_id, self.grad_reduce_handle)


# %% [markdown]
# The wait, with the launch when no hook did it; a group that never got all its grads is an
# error that says how many parameters reported.

# %%
class GradReduction(GradLaunch):
    """A bucket group's grad collectives: launch (scaled, async with overlap) and wait."""

    def finish_grad_sync(self) -> None:
        """Make this step's grad collectives complete (launch them first if nothing did)."""
        self.param_gather_dispatched = False
        if not self.config.overlap_grad_reduce:
            self.start_grad_sync()
            self.grad_reduce_handle = None
            return
        if self.grad_reduce_finished:
            return
        if self.is_first_batch:
            self.start_grad_sync()
        if self.grad_reduce_handle is None:
            ready, ids = len(self.grad_ready_counts), [b.bucket_id for b in self.buckets]
            raise RuntimeError(f"grad collective was never launched for buckets {ids}: {ready}/"
                               f"{len(self.params)} params reported a grad (one got no grad?)")
        if self.timeline is not None:
            self.timeline.poll()
        self.grad_reduce_handle.wait()
        self._record("waited")
        self.grad_reduce_handle = None
        self.grad_reduce_finished = True


# %% [markdown]
# ### Checking each bucket before its collective
#
# A NaN or Inf in a gradient usually comes from one rank: its batch, or its GPU's bad memory or
# arithmetic. After the collective *every* rank holds the NaN, and a check there cannot say which
# rank produced it. So Megatron checks each bucket's **local** gradient norm in `start_grad_sync`,
# *before* the scaling and the collective (`_ParamAndGradBucketGroup.check_grads`,
# `param_and_grad_buffer.py:313-348`, called at `:599-603`). Two DP ranks, one bucket each, rank
# 1's grads corrupted:
#
# | | rank 0's bucket norm | rank 1's bucket norm | who reports |
# |---|---|---|---|
# | before the collective (the check here) | 3.1 | NaN | rank 1 only: its GPU, its batch |
# | after the all-reduce | NaN | NaN | both: the fault is no longer attributable |
#
# With `check_for_nan_in_grad`, `check_grads` raises a `RuntimeError` naming the bucket and the DP
# rank. Megatron routes the same norms through its rerun state machine (a later chapter), so the
# check is pluggable: `ddp.set_grad_check(fn)` makes every bucket group call `fn(buckets)` here,
# on this rank's local, unscaled grads (`bucket.grad_data`, `bucket.bucket_id`, `bucket.dp_rank`);
# `set_grad_check(None)` restores the default. [Chapter 08's
# `Reliability`](../08_reliability/loop_hooks.py) installs the rerun machine's checks this way.

# %%
class GradCheck:
    """A bucket group's check of its local grads, run before the scaling and the collective."""

    def check_grads(self) -> None:
        """Check each bucket's local grads: the installed check, else check_for_nan_in_grad."""
        if self.grad_check is not None:
            self.grad_check(self.buckets)
            return
        if not self.config.check_for_nan_in_grad:
            return
        for b in self.buckets:
            norm = b.grad_data.float().norm()
            if not torch.isfinite(norm):
                raise RuntimeError(f"non-finite local grad norm {norm.item()} in bucket "
                                   f"{b.bucket_id} (dp rank {b.dp_rank}) before the grad "
                                   "collective")


# %% [markdown]
# ### The param all-gather and the forward pre-hook
#
# With the distributed optimizer each rank updates only its shard of each bucket, writing the
# new (bf16) weights into `param_data` — the storage that `param.data` already points to.
# One `all_gather_into_tensor(out=bucket.param_data, in=my shard)` per bucket then gives every
# rank the full new weights (`param_and_grad_buffer.py:351`), at the end of the optimizer step.
# With `overlap_param_gather` it is deferred: a **forward pre-hook** on every module
# (`distributed_data_parallel.py:413`) calls `finish_param_sync` on the bucket groups of that
# module's own parameters, which dispatches the group's gather if nobody did, waits for it, and
# dispatches the *next* group's, so gathering bucket `i+1` overlaps the forward that uses `i`.
# Buckets are stored in backward order, so "next in forward order" is the previous bucket group
# (`distributed_data_parallel.py:300-306`).
#
# Example: three buckets, stored as 0 = head, 1 = middle layers, 2 = embedding and first
# layers. The forward needs bucket 2 first: its pre-hook gathers 2 (nobody has), waits, and
# starts gathering 1; the middle layers' pre-hooks then find 1 under way or done and start 0.

# %%
class ParamDispatch:
    """A bucket group's param all-gather: the dispatch."""

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather each bucket's param shards into its param buffer (async with overlap)."""
        assert self.config.use_distributed_optimizer
        async_op = self.config.overlap_param_gather and not force_sync
        if self.param_gather_dispatched and async_op:
            return
        if self.param_gather_handle is not None:  # a forced sync gather after an async one
            self.param_gather_handle.wait()
            self.param_gather_handle = None
        self._record("gather_start")
        works = []
        with self.stream.launch():
            for b in self.buckets:
                if self.group_size > 1:
                    works.append(all_gather(b.param_data, b.param_shard(), self.group, async_op))
        self.param_gather_handle = Handles(works, self.stream) if async_op else None
        if not async_op:
            self.stream.join()
        elif self.timeline is not None:
            for b in self.buckets:
                self.timeline.watch(b.bucket_id, self.param_gather_handle, "gather_complete")
        self.param_gather_dispatched = True


# %% [markdown]
# The wait, from the forward pre-hook: dispatch if nobody did, wait, then start the next
# group's gather (unless the schedule dispatches the gathers itself).

# %%
class ParamGather(ParamDispatch):
    """A bucket group's param all-gather: dispatch it, and wait for it before the forward."""

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        """Wait for this group's all-gather (dispatching it if needed), then start the next one."""
        assert self.config.overlap_param_gather
        if not self.param_gather_dispatched:
            self.start_param_sync()
        if self.param_gather_handle is None:
            return
        self.param_gather_handle.wait()
        self.param_gather_handle = None
        self._record("gather_waited")
        nxt = self.next_param_gather_bucket_group
        if nxt is not None and not skip_next_bucket_dispatch and not nxt.param_gather_dispatched:
            nxt.start_param_sync()


# %% [markdown]
# ### The bucket group: shared state and the readiness count
#
# What is left is the state the three jobs share, the reset at the start of a step (which
# turns the first step's counts into the golden ones), and the count itself: on the last
# micro-batch each hook call adds one for its parameter, and the call that makes the counts
# equal the golden ones launches the collective.

# %%
class ReadyCount:
    """A bucket group's grad-ready counting, and the reset that learns the golden counts."""

    def reset(self) -> None:
        """Prepare for the next step; after the first step, keep its counts as the golden ones."""
        if self.is_first_batch and self.grad_ready_counts:
            assert len(self.grad_ready_counts) == len(self.params)
            self.golden_grad_ready_counts = self.grad_ready_counts
            self.is_first_batch = False
        self.grad_ready_counts = {}
        self.is_last_microbatch = True
        self.grad_reduce_finished = False

    def register_grad_ready(self, param) -> None:
        """Count ``param`` as ready (last micro-batch only); launch once all counts are golden."""
        assert self.config.overlap_grad_reduce
        if not self.is_last_microbatch:
            return
        self.grad_ready_counts[param] = self.grad_ready_counts.get(param, 0) + 1
        if not self.is_first_batch and self.grad_ready_counts == self.golden_grad_ready_counts:
            self.start_grad_sync()


# %% [markdown]
# The group itself: the four jobs, and every attribute they share, set in one place.

# %%
class BucketGroup(ReadyCount, GradReduction, GradCheck, ParamGather):
    """Buckets whose collectives are launched together, with grad-ready counting."""

    def __init__(self, buckets, config: DistributedDataParallelConfig, group, group_size: int,
                 stream: CommStream, timeline: CommTimeline | None = None):
        self.buckets = list(buckets)
        self.config, self.group, self.group_size = config, group, group_size
        self.stream, self.timeline = stream, timeline
        self.params = [p for b in self.buckets for p in b.params]
        self.param_to_bucket = {p: b for b in self.buckets for p in b.params}
        self.golden_grad_ready_counts: dict = {}
        self.grad_ready_counts: dict = {}
        self.is_last_microbatch = True
        self.is_first_batch = True
        self.grad_reduce_handle: Handles | None = None
        self.grad_reduce_finished = False
        self.param_gather_handle: Handles | None = None
        self.param_gather_dispatched = False
        self.next_param_gather_bucket_group: BucketGroup | None = None
        self.grad_check = None  # fn(buckets) run before the collective (set_grad_check)

    def _record(self, event: str) -> None:
        if self.timeline is not None:
            for b in self.buckets:
                self.timeline.record(event, b.bucket_id)


# %% [markdown]
# ## Reduced before stepped
#
# Between the backward and the optimizer step each rank holds only its *local* gradients; they
# are the data-parallel mean only once `finish_grad_sync` has run (Megatron's
# `finalize_model_grads` calls it before `optimizer.step()`,
# `megatron/core/distributed/finalize_model_grads.py:445`). A hand-written loop that forgets it
# still trains, every rank its own way, and nothing complains. So the wrapper keeps one flag,
# shared with all its params as `param.grad_sync`: set by the backward hook when a grad lands
# in the buffer, cleared by `finish_grad_sync` and `zero_grad_buffer`.
# [Chapter 02's optimizers](../02_optimizer/mixed_precision.py) refuse to step while it is set.
#
# <details><summary>Megatron detail: no such flag</summary>
#
# Megatron's `train_step` always calls
# `finalize_model_grads` before the step, so the mistake cannot happen there. tinytron's pages
# and tests write loops by hand, so the optimizer checks.
#
# </details>

# %%
class GradSyncState:
    """Whether grads reached the buffer since the last finished grad sync (shared by the params)."""

    def __init__(self):
        self.pending = False

    def __repr__(self) -> str:
        return f"GradSyncState(pending={self.pending})"


# %% [markdown]
# ## The wrapper
#
# Like the bucket group, the wrapper is its jobs plus the state they share. **The hooks**:
# after backward writes a grad, add it into `main_grad`, free it, report it ready; before a
# module's forward, wait for its params' all-gather. The pre-hooks can be removed (evaluation
# runs without them) and put back; removing them gathers every param at once by default, so
# the evaluation sees the newest weights.
#
# **Aligned gathers.** A pre-hook's `finish_param_sync` normally dispatches the next bucket
# group's gather. With `align_param_gather` it does not (`skip_next_bucket_dispatch`,
# `distributed_data_parallel.py:439-444`): the interleaved schedule launches each model chunk's
# gathers itself, at the same moment on every pipeline rank
# ([chapter 01](../01_main_loop/interleaved.py)), and the hooks only wait. Without virtual
# stages nothing would launch them and the prefetch would be lost, so Megatron turns the switch
# off there (`arguments.py:990-992`), as does `tinytron.config` when it resolves a run
# (`tests/test_config.py`); this class, like megatron-core's, does what its config says.

# %%
class SyncHooks:
    """DistributedDataParallel's autograd and forward hooks."""

    def _backward_hook(self, param) -> None:
        """Accumulate param.grad into main_grad, free it, and report the param as ready."""
        if param.grad is not None:
            param.main_grad.add_(param.grad)
            self.grad_sync.pending = True
        param.grad = None
        if self.timeline is not None:
            self.timeline.record("grad", self.param_to_bucket_group[param].buckets[0].bucket_id)
        if self.ddp_config.overlap_grad_reduce:
            self.param_to_bucket_group[param].register_grad_ready(param)

    def enable_forward_pre_hook(self) -> None:
        """Register the pre-hooks that wait for a module's param all-gather before it runs."""
        if not self.ddp_config.overlap_param_gather:
            raise ValueError("forward pre-hooks need overlap_param_gather=True")
        for m in self.module.modules():
            if m not in self._pre_hooks:
                self._pre_hooks[m] = m.register_forward_pre_hook(self._forward_pre_hook)

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove the pre-hooks (e.g. for evaluation); by default gather all params now."""
        for handle in self._pre_hooks.values():
            handle.remove()
        self._pre_hooks.clear()
        if param_sync:
            self.start_param_sync(force_sync=True)

    def _forward_pre_hook(self, module, args) -> None:
        """Before ``module`` runs: its parameters' all-gathers must have finished."""
        skip_next = self.ddp_config.align_param_gather
        for p in module.parameters(recurse=False):
            group = self.param_to_bucket_group.get(p)
            if group is not None:
                group.finish_param_sync(skip_next_bucket_dispatch=skip_next)


# %% [markdown]
# **What a training loop calls**: `no_sync` around all micro-batches but the last,
# `finish_grad_sync` after the backward, `start_param_sync` after the optimizer step,
# `zero_grad_buffer` before the next one. Each is a loop over the bucket groups; `set_grad_check`
# installs [the bucket check](#checking-each-bucket-before-its-collective) on all of them.

# %%
class GradLoopCalls:
    """The grad side of what a training loop calls on DistributedDataParallel."""

    @contextlib.contextmanager
    def no_sync(self):
        """Inside: accumulate grads only (not the last micro-batch), launch no collective."""
        for g in self.bucket_groups:
            g.is_last_microbatch = False
        try:
            yield
        finally:
            for g in self.bucket_groups:
                g.is_last_microbatch = True

    def start_grad_sync(self) -> None:
        """Launch every bucket group's grad collective now (normally the hooks do this)."""
        for g in self.bucket_groups:
            g.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Wait for (or run) every bucket group's grad collective."""
        for g in self.bucket_groups:
            g.finish_grad_sync()
        self.grad_sync.pending = False


# %% [markdown]
# Then the param side and the step boundary: the all-gather after the optimizer step, the
# zeroing before the next step, and the hook for the bucket check.

# %%
class LoopCalls(GradLoopCalls):
    """What a training loop calls on DistributedDataParallel, each over every bucket group."""

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather the updated params of every bucket (async with overlap_param_gather)."""
        if not self.ddp_config.use_distributed_optimizer:
            raise ValueError("start_param_sync needs use_distributed_optimizer=True")
        for g in self.bucket_groups:
            g.start_param_sync(force_sync=force_sync)

    def zero_grad_buffer(self) -> None:
        """Zero every grad buffer and reset the bucket groups for a new step."""
        for p in self.params_with_grad:
            p.grad = None
        for buf in self.buffers:
            buf.reset()
        for g in self.bucket_groups:
            g.reset()
        self.grad_sync.pending = False

    def set_grad_check(self, fn) -> None:
        """Run ``fn(buckets)`` on each group's local grads before its collective (None: default)."""
        for g in self.bucket_groups:
            g.grad_check = fn


# %% [markdown]
# **The state.** The constructor builds one buffer per `(param dtype, grad dtype)` with the
# grads' scaling factor, one bucket group per bucket, and a hook on every trainable parameter,
# with the plain functions below. Later pipeline stages get one bucket: their data-parallel
# traffic is off the critical path. The methods other chapters need besides the sync (the
# loss-scale multiply, the rank-0 broadcast, the state dicts) are a mixin in
# `chapters/05_buffers/_ddp_surface.py`.

# %%
def _trainable_params(module) -> tuple[list, dict]:
    """The module's trainable params and every param's name; ValueError when there are none."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("DistributedDataParallel: the module has no trainable parameters")
    return params, {p: n for n, p in module.named_parameters()}


def _make_buffers(params, config, dp_size: int, dp_rank: int, bucket_size,
                  names: dict) -> list[ParamAndGradBuffer]:
    """One ParamAndGradBuffer per (param dtype, grad dtype) of ``params``."""
    # 1/dp_cp before a SUM (default); 1 with AVG or per-token normalization
    scaling = 1.0 if config.calculate_per_token_loss or config.average_in_collective \
        else 1.0 / dp_size
    buffers: list[ParamAndGradBuffer] = []
    for key, group_params in group_params_for_buffers(params, config.grad_reduce_in_fp32).items():
        buffers.append(ParamAndGradBuffer(
            group_params, param_dtype=key.param_dtype, grad_dtype=key.grad_dtype,
            dp_size=dp_size, dp_rank=dp_rank, bucket_size=bucket_size,
            use_distributed_optimizer=config.use_distributed_optimizer,
            pad_for_high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
            gradient_scaling_factor=scaling, param_names=names))
    return buffers

# %% [markdown]
# Then the bucket groups, chained in forward order, and the hooks.

# %%
def _make_bucket_groups(buffers, config, group, group_size: int, stream,
                        timeline) -> list[BucketGroup]:
    """One BucketGroup per bucket, each pointing at the next one in forward order."""
    groups = [BucketGroup([b], config, group, group_size, stream, timeline)
              for buf in buffers for b in buf.buckets]
    for i in range(1, len(groups)):  # forward order = reverse bucket order
        groups[i].next_param_gather_bucket_group = groups[i - 1]
    return groups


def _hook_params(ddp, params) -> None:
    """Share one GradSyncState with every param and register their backward hooks."""
    # Shared with every param, so that any optimizer over them can refuse unreduced grads.
    ddp.grad_sync = GradSyncState()
    for p in params:
        p.grad_sync = ddp.grad_sync
    ddp._grad_hooks = [p.register_post_accumulate_grad_hook(ddp._backward_hook) for p in params]


# %% [markdown]
# The wrapper:

# %%
class DistributedDataParallel(SyncHooks, LoopCalls, ModuleSurface, torch.nn.Module):
    """Megatron-style DDP: contiguous grad/param buffers, bucketed async collectives, hooks.

    Example::

        ddp = DistributedDataParallel(model, grid, DistributedDataParallelConfig(
            use_distributed_optimizer=True))
        ddp.zero_grad_buffer()
        model(input_ids, labels=labels).mean().backward()
        ddp.finish_grad_sync()        # grads are now the DP mean; the optimizer may step
    """

    def __init__(self, module: torch.nn.Module, grid, config: DistributedDataParallelConfig | None
                 = None, *, disable_bucketing: bool = False, timeline: CommTimeline | None = None):
        super().__init__()
        self.module, self.grid = module, grid
        self.ddp_config = config = config or DistributedDataParallelConfig()
        self.dp_group, self.dp_size, self.dp_rank = axis_info(grid, "dp_cp")
        _, _, pp_rank = axis_info(grid, "pp")
        self.bucket_size = default_bucket_size(config, grid.size("dp"))  # dp without CP
        if disable_bucketing or pp_rank > 0:  # DP comm of later stages is off the critical path
            self.bucket_size = None
        self.timeline = timeline
        params, names = _trainable_params(module)
        self.params_with_grad = params
        # Megatron keeps the list under the name `buffers` (shadowing nn.Module.buffers()).
        self.buffers = _make_buffers(params, config, self.dp_size, self.dp_rank, self.bucket_size,
                                     names)
        self.comm_stream = CommStream(params[0].device)
        self.bucket_groups = _make_bucket_groups(self.buffers, config, self.dp_group, self.dp_size,
                                                 self.comm_stream, timeline)
        self.param_to_bucket_group = {p: g for g in self.bucket_groups for p in g.params}
        _hook_params(self, params)
        self._pre_hooks: dict = {}
        if config.overlap_param_gather:
            self.enable_forward_pre_hook()

    def forward(self, *args, **kwargs):
        """Run the wrapped module."""
        return self.module(*args, **kwargs)


# %% [markdown]
# ## The configuration
#
# Every switch read above is a field of Megatron's `DistributedDataParallelConfig`, with its
# name and default (`megatron/core/distributed/distributed_data_parallel_config.py:12`).
# `grad_reduce_in_fp32` defaults to `False` there; Megatron's training script turns it on for
# bf16 models unless `--grad-reduce-in-bf16` is given (`megatron/training/arguments.py:1181`).
#
# <details><summary>Megatron detail: calculate_per_token_loss</summary>
#
# It lives on Megatron's
# `TransformerConfig`; tinytron puts it here because it only changes how DDP scales
# gradients.
#
# </details>
#
# The checks that refuse what tinytron cannot run (a second optimizer instance,
# `overlap_param_gather` without the distributed optimizer, …) are in
# `chapters/05_buffers/_checks.py`; each names the field it refuses.

# %%
@document_fields
@dataclass
class DistributedDataParallelConfig:
    """Megatron's DDP options that tinytron implements (same names, same defaults)."""

    grad_reduce_in_fp32: bool = False
    """Accumulate and reduce grads in fp32 (main_grad is fp32 even for bf16 params)."""
    overlap_grad_reduce: bool = False
    """Launch each bucket's grad collective from the backward hooks as soon as it is complete."""
    align_grad_reduce: bool = True
    """With overlap_grad_reduce and PP > 1, stages after the first launch after the cooldown."""
    overlap_param_gather: bool = False
    """Defer the param all-gather to forward pre-hooks (distributed optimizer only)."""
    align_param_gather: bool = False
    """The schedule dispatches all param all-gathers itself; pre-hooks only wait."""
    use_distributed_optimizer: bool = False
    """Reduce-scatter grads (each DP rank owns one shard) and keep a param buffer to all-gather."""
    num_distributed_optimizer_instances: int = 1
    """Number of distributed-optimizer replicas; tinytron supports 1."""
    check_for_nan_in_grad: bool = False
    """Raise before the collective if a bucket's local grad norm is NaN or Inf."""
    bucket_size: int | None = None
    """Elements per bucket; None -> max(40M, 1M*dp) with overlap, one bucket without."""
    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad bucket ends to lcm(dp, 128, 2**16) instead of lcm(dp, 128)."""
    average_in_collective: bool = False
    """Average with ReduceOp.AVG instead of pre-scaling grads by 1/dp_cp and summing."""
    calculate_per_token_loss: bool = False
    """Grads are neither pre-scaled nor averaged; finalize_model_grads divides by the token count."""

    def __post_init__(self):
        check_ddp_config(self)  # a clear one-line ValueError naming the field (_checks.py)


# %% [markdown]
# ## What the distributed optimizer (chapter 02) uses
#
# Everything [the DistributedOptimizer](../02_optimizer/distributed.py) needs is on the wrapper, read after `finalize_model_grads`:
#
# | what | where |
# |---|---|
# | buffers, one per `(param dtype, grad dtype)` | `ddp.buffers` (`ParamAndGradBuffer`) |
# | the buckets of a buffer, in layout order | `buffer.buckets` |
# | this rank's DP-mean fp32 grads of a bucket | `bucket.grad_shard()` |
# | where this rank writes its updated (bf16) weights | `bucket.param_shard()` (a view of `param_data`, i.e. of `param.data`) |
# | which parameter elements those shard elements are | `bucket.shard_param_ranges()` → `ShardRange(param, param_start, param_end, shard_start, shard_end, …)` |
# | give every rank the new weights | `ddp.start_param_sync()` (with `overlap_param_gather`: left to the next forward's pre-hooks) |
# | start the next step | `ddp.zero_grad_buffer()` |
#
# Its fp32 master weights and Adam moments are then three fp32 tensors of `shard_size` elements
# per bucket: `2 + 4 + 12/dp` bytes per parameter in total (bf16 param buffer, fp32 grad buffer,
# sharded optimizer state).

# %% [markdown]
# ## Demo 1: one process — hooks, `main_grad` and micro-batch accumulation
#
# On `ParallelGrid.single()` there is nobody to talk to, but the buffer, the hooks and the
# accumulation are the same. Three micro-batches, the first two inside `no_sync()`: `main_grad`
# must be the sum of the three gradients, and every `param.grad` freed.

# %%
if __name__ == "__main__":
    from tinytron.buffers._workers import TinyNet, lm_loss, make_batches
    from tinytron.parallel import ParallelGrid

    torch.manual_seed(0)
    net = TinyNet()
    plain = TinyNet()
    plain.load_state_dict(net.state_dict())
    ddp = DistributedDataParallel(net, ParallelGrid.single(),
                                  DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    micro = make_batches(0, 1, 1, 3, micro_bs=2)[0, 0]
    ddp.zero_grad_buffer()
    for m in range(3):
        with ddp.no_sync() if m < 2 else contextlib.nullcontext():
            lm_loss(ddp, micro[m]).backward()
            lm_loss(plain, micro[m]).backward()  # plain autograd accumulates into .grad
    ddp.finish_grad_sync()
    print(ddp.buffers[0], ddp.buffers[0].buckets)
    w = net.output.weight
    print("output.weight: grad", w.grad, "| main_grad[0,:4]", w.main_grad[0, :4])
    assert all(p.grad is None for p in net.parameters())
    assert all(torch.allclose(p.main_grad, q.grad, atol=1e-6)
               for p, q in zip(net.parameters(), plain.parameters()))
    start = ddp.buffers[0].param_index_map[w][0]
    assert w.main_grad.data_ptr() == ddp.buffers[0].grad_data[start:].data_ptr()

# %% [markdown]
# How often does a hook fire? `TinyNet` applies its `shared` layer twice in one forward: one
# call. Put its first use inside PyTorch's reentrant checkpoint (a nested backward, as in
# Megatron's) and the weight is accumulated twice: two calls, what golden counts are for.

# %%
if __name__ == "__main__":
    from torch.utils.checkpoint import checkpoint

    calls = []
    net.shared.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p))
    x = torch.randn(2, net.shared.in_features, requires_grad=True)
    (net.shared(torch.tanh(net.shared(x)))).sum().backward()  # TinyNet's use: twice, one graph
    once = len(calls)
    y = checkpoint(net.shared, x, use_reentrant=True)  # the first use recomputed
    net.shared(torch.tanh(y)).sum().backward()
    print(f"hook calls of the shared weight: {once} in one graph, "
          f"{len(calls) - once} with a reentrant checkpoint")
    assert (once, len(calls) - once) == (1, 2)

# %% [markdown]
# ## Demo 2: a NaN stopped before the collective
#
# The same model with `check_for_nan_in_grad=True`, and one NaN written into this rank's
# `main_grad` after the backward, as a bad GPU would. A check installed by `set_grad_check`
# receives the bucket with the NaN still local; after `set_grad_check(None)` the default check
# raises before any collective and names the bucket. (On two ranks,
# [chapter 08's tests](../08_reliability/loop_hooks.py) show that only the faulty rank reports it.)

# %%
if __name__ == "__main__":
    import math

    ddp = DistributedDataParallel(TinyNet(), ParallelGrid.single(),
                                  DistributedDataParallelConfig(check_for_nan_in_grad=True))

    def backward_with_a_bad_element():
        ddp.zero_grad_buffer()
        lm_loss(ddp, micro[0]).backward()
        ddp.module.output.weight.main_grad[0, 0] = float("nan")  # corrupted after accumulation

    seen = []
    backward_with_a_bad_element()
    ddp.set_grad_check(lambda buckets: seen.extend(
        (b.bucket_id, b.dp_rank, b.grad_data.norm().item()) for b in buckets))
    ddp.finish_grad_sync()
    print("installed check saw (bucket, dp rank, local norm):", seen)
    assert len(seen) == 1 and seen[0][:2] == (0, 0) and math.isnan(seen[0][2])
    ddp.set_grad_check(None)
    backward_with_a_bad_element()
    try:
        ddp.finish_grad_sync()
        raise AssertionError("the default check let a NaN through")
    except RuntimeError as err:
        print("default check:", err)
        assert "bucket 0 (dp rank 0) before the grad collective" in str(err)

# %% [markdown]
# ## Demo 3: two ranks — each shard is the data-parallel mean
#
# Two gloo ranks, the distributed optimizer's layout (reduce-scatter), overlap on, buckets of
# 4000 elements, two micro-batches per step and two steps, so that the second step launches
# from the hooks (`tinytron.buffers._workers.grad_shard_vs_mean`). Beside each rank, a plain
# copy of the model back-propagates *both* ranks' micro-batches, scaled to their mean; every
# element of each rank's shard of every bucket must equal that mean.

# %%
if __name__ == "__main__":
    from tinytron.buffers._workers import grad_shard_vs_mean
    from tinytron.launch import run_on_ranks

    out = run_on_ranks(grad_shard_vs_mean, 2, timeout=120)
    for o in out:
        print(f"rank {o['rank']}: {o['num_buckets']} buckets, owns {o['owned']} of {o['total']} "
              f"grad elements, max |shard - single-process mean| = {o['max_abs_diff']:.1e}")
    assert all(o["max_abs_diff"] < 1e-6 for o in out)
    assert sum(o["owned"] for o in out) == out[0]["total"]  # the shards cover every element once
    assert out[0]["num_buckets"] > 1

# %% [markdown]
# ## Summary
#
# - A post-accumulate-grad hook per parameter adds `param.grad` into the fp32 `main_grad`,
#   frees `param.grad`, and (with overlap, on the last micro-batch) counts the parameter ready.
# - A bucket whose parameters have all reported launches its collective at once: all-reduce
#   for plain DDP, reduce-scatter for the distributed optimizer; `finish_grad_sync` waits. The
#   first step learns the golden counts; the hooks launch from the second step on.
# - Grads are pre-scaled by `1/dp_cp` and summed (default), or averaged in the collective;
#   before that, each bucket's *local* grads are checked, so the faulty rank is the one that
#   reports.
# - With the distributed optimizer, `start_param_sync` all-gathers the new weights per bucket;
#   with `overlap_param_gather` each forward pre-hook waits for its bucket and starts the next.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/distributed/distributed_data_parallel.py` and
#   `param_and_grad_buffer.py`. On GPU the collectives are NCCL calls grouped by
#   `_coalescing_manager`; here each bucket is one gloo (or NCCL) call on a side stream.
#   <details><summary>Megatron detail: where each piece is</summary>
#
#   `distributed_data_parallel.py`: hooks :345-373, `_make_forward_pre_hook` :413,
#   `_make_backward_post_hook` :449, `no_sync` :480, `start_param_sync` :510,
#   `finish_grad_sync` :544, `zero_grad_buffer` :566. `param_and_grad_buffer.py`:
#   `_ParamAndGradBucketGroup` :159, `check_grads` :313-348 (called in `start_grad_sync` :556 at
#   :599-603, before the scaling and the collective), `finish_grad_sync` :724,
#   `register_grad_ready` :800, `start_param_sync` :351, `finish_param_sync` :494.
#
#   </details>
# - PyTorch DDP's C++ `Reducer` (`torch/csrc/distributed/c10d/reducer.cpp`) does the same
#   bucket-ready counting, with buckets rebuilt after the first iteration in the order grads
#   actually arrived; FSDP2 (`torch.distributed.fsdp.fully_shard`) reduce-scatters per module
#   group and prefetches the next group's all-gather, like `overlap_param_gather`.
#
# ## Exercises
#
# 1. Wrap the first use of `TinyNet`'s `shared` layer in a reentrant checkpoint and count
#    its hook calls on the last micro-batch. Why would launching its bucket on the first call
#    be wrong, and which mechanism prevents it? (Hint: demo 1's second count.)
#    <details><summary>Hint</summary>
#
#    Demo 1 counts two calls. After the first, `main_grad`
#    holds only one of the two contributions, and a collective launched then reduces half a
#    gradient. Look at `ReadyCount`: the first step records the counts, `reset` keeps them as
#    the golden ones, and `register_grad_ready` launches only when all counts match.
#
#    </details>
#
# 2. Shrink `bucket_size` to 20k in the timeline demo. What happens to the gap between
#    backward's end and the synced grads, and why does it not shrink forever?
#    <details><summary>Hint</summary>
#
#    Only the last bucket's collective is left after the
#    backward ends, and a smaller bucket is a shorter one. But every call pays the latency
#    term $2(d-1)\alpha$ of [the naive page](naive_ddp.py)'s cost formula: with many tiny
#    buckets the calls queue up on the one side stream and the latency dominates.
#
#    </details>
#
# 3. Set `average_in_collective=True` and check that the grads do not change. When could
#    pre-scaling by `1/dp` be better than averaging in bf16?
#    <details><summary>Hint</summary>
#
#    See the **Scaling** paragraph: the sum of unscaled grads
#    can overflow a narrow format before the collective divides (fp16's 65,504), and
#    `ReduceOp.AVG` is not offered by every backend. Compare the two with
#    `grad_reduce_in_fp32=False` and large grads.
#
#    </details>
