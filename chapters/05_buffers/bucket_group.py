# %% [markdown]
# # 05 · Buffers: bucket groups — when a bucket's collective runs
#
# [The previous page](param_and_grad_buffer.py) cut the flat grad buffer into buckets, each
# one contiguous slice. This page builds what launches a bucket's collective while backward is
# still running: the count that says all of a bucket's grads are in, the scaled all-reduce or
# reduce-scatter, the check of the local grads before it, and the param all-gather that brings
# the distributed optimizer's new weights back before the forward needs them.
# [The next page](distributed_data_parallel.py) puts these bucket groups on a model, inside
# Megatron's `DistributedDataParallel` wrapper.
#
# You will build: `default_bucket_size` and `BucketGroup`, from its jobs `GradReduction`,
# `GradCheck`, `ParamGather` and `ReadyCount`.

# %%
from __future__ import annotations

import torch
import torch.distributed as dist

from tinytron.buffers._comm import (CommStream, CommTimeline, Handles, all_gather, all_reduce,
                                    reduce_scatter)

__all__ = ["default_bucket_size", "GradLaunch", "GradReduction", "GradCheck", "ParamDispatch",
           "ParamGather", "ReadyCount", "BucketGroup"]


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
# `Tensor.register_post_accumulate_grad_hook` ([the wrapper](distributed_data_parallel.py)
# does; demo 2 below does it by hand).
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
# check is pluggable: a group whose `grad_check` is a function calls `fn(buckets)` here, on this
# rank's local, unscaled grads (`bucket.grad_data`, `bucket.bucket_id`, `bucket.dp_rank`);
# `None` restores the default. The wrapper's `set_grad_check(fn)` sets it on every group, and
# [chapter 08's `Reliability`](../08_reliability/loop_hooks.py) installs the rerun machine's
# checks this way.

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
# ## Demo 1: how often a hook fires
#
# `TinyNet` (the model of [the naive page](naive_ddp.py)) applies its `shared` layer twice in
# one forward: autograd sums both uses and the hook fires once. Put the first use inside
# PyTorch's reentrant checkpoint (a nested backward, as in Megatron's) and the weight is
# accumulated twice: two calls, which is what the golden counts are for.

# %%
if __name__ == "__main__":
    from torch.utils.checkpoint import checkpoint

    from tinytron.buffers._workers import TinyNet, lm_loss, make_batches

    torch.manual_seed(0)
    net = TinyNet()
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
    net.zero_grad(set_to_none=True)

# %% [markdown]
# ## Demo 2: the first step learns, the second launches from the hooks
#
# One process, `TinyNet`'s 19 parameters in [the buffer](param_and_grad_buffer.py) with buckets
# of 4,000 elements (3 buckets), one bucket group each. A bucket group reads five switches of
# its config; [the next page's](distributed_data_parallel.py) `DistributedDataParallelConfig`
# holds them with the rest, and a plain namespace stands in for it here. The demo's hook does
# what the wrapper's will: add the grad into `main_grad` and report the parameter to its group.
# With one rank the collective moves nothing, but the launch happens where it would: in step 1
# only in `finish_grad_sync`, in step 2 at the last grad of each bucket.

# %%
if __name__ == "__main__":
    from types import SimpleNamespace

    from tinytron.buffers.param_and_grad_buffer import ParamAndGradBuffer

    names = {p: n for n, p in net.named_parameters()}
    buf = ParamAndGradBuffer(list(net.parameters()), param_dtype=torch.float32,
                             grad_dtype=torch.float32, dp_size=1, bucket_size=4000,
                             param_names=names)
    switches = SimpleNamespace(overlap_grad_reduce=True, use_distributed_optimizer=False,
                               average_in_collective=False, check_for_nan_in_grad=False,
                               overlap_param_gather=False)
    cpu = CommStream(torch.device("cpu"))
    groups = [BucketGroup([b], switches, None, 1, cpu) for b in buf.buckets]
    group_of = {p: g for g in groups for p in g.params}
    hook_log = []  # per hook call: its bucket, and which groups have launched so far

    def report(p):
        p.main_grad.add_(p.grad)
        p.grad = None
        group_of[p].register_grad_ready(p)
        hook_log.append((groups.index(group_of[p]),
                         [g.grad_reduce_handle is not None for g in groups]))

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(report)

# %% [markdown]
# Two steps of one micro-batch each; for every bucket, the hook call after which its
# collective was launched (none: `finish_grad_sync` launched it).

# %%
if __name__ == "__main__":
    micro = make_batches(0, 1, 1, 2, micro_bs=2)[0, 0]
    launched, logs = [], []
    for step in range(2):
        buf.reset()
        for g in groups:
            g.reset()  # after step 1: its counts become the golden ones
        hook_log.clear()
        lm_loss(net, micro[step]).backward()
        launched.append([next((i + 1 for i, (_, done) in enumerate(hook_log) if done[k]), None)
                         for k in range(len(groups))])
        logs.append(list(hook_log))
        for g in groups:
            g.finish_grad_sync()
        print(f"step {step + 1}: {len(hook_log)} hook calls, buckets launched after call",
              launched[-1])
    assert launched[0] == [None, None, None]  # step 1 only records the counts
    assert launched[1] == [5, 12, 19]         # step 2: at the last grad of each bucket
    assert all(g.golden_grad_ready_counts[p] == 1 for g in groups for p in g.params)

# %% [markdown]
# The picture of those two backward passes: one dot per hook call, colored by its bucket, and a
# star where each bucket's collective was launched.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 2.2))
    for row, (log, when) in enumerate(zip(logs, launched)):
        for i, (bucket, _) in enumerate(log):
            ax.scatter(i + 1, row, color=f"C{bucket}", s=30)
        for bucket, call in enumerate(when):
            x = call if call is not None else len(log) + 1 + 0.25 * bucket
            ax.scatter(x, row + 0.25, marker="*", s=160, color=f"C{bucket}", edgecolor="black")
    ax.axvline(len(logs[0]) + 0.5, color="gray", ls=":")
    ax.text(len(logs[0]) + 0.7, 1.45, "finish_grad_sync", fontsize=8, color="gray")
    ax.set_xticks(range(1, len(logs[0]) + 1, 2))
    ax.set_yticks([0, 1], ["step 1", "step 2"])
    ax.set(xlim=(0, len(logs[0]) + 4), ylim=(-0.5, 1.7))
    ax.set_xlabel("backward hook call (dots: bucket 0, 1, 2 by color; stars: collective launched)")
    plt.tight_layout()
    plt.show()

# %% [markdown]
# ## Demo 3: a NaN stopped before the collective
#
# Bucket 0 again, its group now with `check_for_nan_in_grad` and without overlap (so
# `finish_grad_sync` launches), and one NaN written into its grads after the backward, as a bad
# GPU would. A function set as the group's `grad_check` receives the bucket with the NaN still
# local; with `grad_check = None` the default check raises before any collective and names the
# bucket. (On two ranks, [chapter 08's tests](../08_reliability/loop_hooks.py) show that only the
# faulty rank reports it.)

# %%
if __name__ == "__main__":
    import math

    strict = SimpleNamespace(**{**vars(switches), "overlap_grad_reduce": False,
                                "check_for_nan_in_grad": True})
    group = BucketGroup([buf.buckets[0]], strict, None, 1, cpu)
    buf.buckets[0].grad_data[0] = float("nan")  # corrupted after accumulation
    seen = []
    group.grad_check = lambda buckets: seen.extend(
        (b.bucket_id, b.dp_rank, b.grad_data.norm().item()) for b in buckets)
    group.finish_grad_sync()
    print("installed check saw (bucket, dp rank, local norm):", seen)
    assert len(seen) == 1 and seen[0][:2] == (0, 0) and math.isnan(seen[0][2])
    group.grad_check = None
    try:
        group.finish_grad_sync()
        raise AssertionError("the default check let a NaN through")
    except RuntimeError as err:
        print("default check:", err)
        assert "bucket 0 (dp rank 0) before the grad collective" in str(err)

# %% [markdown]
# ## Summary
#
# - One collective per bucket, asynchronous, launched by the hook call that completes the
#   bucket: all-reduce for plain DDP, reduce-scatter for the distributed optimizer;
#   `finish_grad_sync` waits for it, or launches it when nothing did.
# - Completion is a count per parameter on the last micro-batch. The first step only records
#   the counts (a reentrant checkpoint makes two calls); from the second step on a bucket
#   launches when its counts equal those golden ones.
# - Grads are pre-scaled by `1/dp_cp` and summed (default), or averaged in the collective;
#   before that, each bucket's *local* grads are checked, so the faulty rank is the one that
#   reports.
# - With the distributed optimizer, `start_param_sync` all-gathers the new weights per bucket;
#   with `overlap_param_gather` each forward pre-hook waits for its bucket and starts the next.
#
# ## How production does it
#
# - Megatron-LM: `_ParamAndGradBucketGroup` in `megatron/core/distributed/param_and_grad_buffer.py`.
#   On GPU the collectives are NCCL calls grouped by `_coalescing_manager`; here each bucket is
#   one gloo (or NCCL) call on a side stream.
#   <details><summary>Megatron detail: where each piece is</summary>
#
#   `param_and_grad_buffer.py`: `_ParamAndGradBucketGroup` :159, `check_grads` :313-348
#   (called in `start_grad_sync` :556 at :599-603, before the scaling and the collective),
#   `start_param_sync` :351, `finish_param_sync` :494, `finish_grad_sync` :724,
#   `register_grad_ready` :800, `partition_buckets` :1512. The default bucket size is set in
#   `megatron/core/distributed/distributed_data_parallel.py:69`.
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
# 2. Shrink `bucket_size` to 20k in [the timeline demo](overlap_timeline.py). What happens to
#    the gap between backward's end and the synced grads, and why does it not shrink forever?
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
