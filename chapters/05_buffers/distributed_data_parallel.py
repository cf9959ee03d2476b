# %% [markdown]
# # 05 · Buffers: the DDP wrapper — hooks and the loop's calls
#
# [The previous page](bucket_group.py) built the bucket groups: each counts its grads, launches
# its collective and gathers its params. This page puts them on a model with Megatron's
# `DistributedDataParallel` wrapper: a hook on every parameter that feeds the groups, a
# pre-hook on every module that waits for its weights, the calls a training loop makes, and a
# flag that keeps an optimizer from stepping on unreduced grads. We check on two real ranks
# that each rank's shard of the grad buffer is the data-parallel mean;
# [the next page](overlap_timeline.py) records the timelines of real backward passes.

# %%
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tinytron._fields import document_fields
from tinytron.buffers._checks import check_ddp_config
from tinytron.buffers._comm import CommStream, CommTimeline, axis_info
from tinytron.buffers._ddp_surface import ModuleSurface
from tinytron.buffers.bucket_group import BucketGroup, default_bucket_size
from tinytron.buffers.param_and_grad_buffer import (ParamAndGradBuffer,
                                                    group_params_for_buffers)

__all__ = ["DistributedDataParallelConfig", "DistributedDataParallel", "GradSyncState"]

# %% [markdown]
# ## One step through the wrapper
#
# The wrapper owns three kinds of objects: the buffers of [05.2](param_and_grad_buffer.py),
# one bucket group per bucket, and the hooks that connect them to autograd and to the
# module's forward. A training step calls it four times, and autograd calls it in between:
#
# ```mermaid
# flowchart TB
#   Z["zero_grad_buffer()<br/>zero the buffers, reset the groups"] --> F
#   F["forward: a pre-hook per module<br/>waits for its params' all-gather"] --> B
#   B["backward: a hook per param<br/>main_grad += grad, report ready"] --> S
#   S["finish_grad_sync()<br/>every bucket's collective done"] --> O
#   O["optimizer.step()<br/>refused while grads are unreduced"] --> P
#   P["start_param_sync()<br/>all-gather, or left to the pre-hooks"] --> Z
# ```
#
# Worked example, `TinyNet` of [the naive page](naive_ddp.py) with buckets of 4,000 elements
# and three micro-batches, the first two under `no_sync()`: 19 parameters, so 19 hook calls per
# backward and 57 per step, all adding into `main_grad`; only the 19 of the last micro-batch
# are counted by the groups, and they launch 3 collectives.

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
# Like [the bucket group](bucket_group.py), the wrapper is its jobs plus the state they share.
# **The hooks**: after backward writes a grad, add it into `main_grad`, free it, report it
# ready; before a module's forward, wait for its params' all-gather. The pre-hooks can be
# removed (evaluation runs without them) and put back; removing them gathers every param at
# once by default, so the evaluation sees the newest weights.
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
# `zero_grad_buffer` before the next one. Each is a loop over the bucket groups;
# `set_grad_check` installs [the bucket check](bucket_group.py#checking-each-bucket-before-its-collective)
# on all of them.

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
# Every switch read here and by [the bucket groups](bucket_group.py) is a field of Megatron's
# `DistributedDataParallelConfig`, with its name and default
# (`megatron/core/distributed/distributed_data_parallel_config.py:12`).
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
# accumulation are the same. The worked example above: `TinyNet`, buckets of 4,000 elements
# with overlap on, three micro-batches, the first two inside `no_sync()`. `main_grad` must be
# the sum of the three gradients and every `param.grad` freed; a `CommTimeline` counts the
# hook calls and the launches.

# %%
if __name__ == "__main__":
    from tinytron.buffers._workers import TinyNet, lm_loss, make_batches
    from tinytron.parallel import ParallelGrid

    torch.manual_seed(0)
    net, plain = TinyNet(), TinyNet()
    plain.load_state_dict(net.state_dict())
    timeline = CommTimeline()
    ddp = DistributedDataParallel(net, ParallelGrid.single(), DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=4000), timeline=timeline)
    micro = make_batches(0, 1, 1, 3, micro_bs=2)[0, 0]
    ddp.zero_grad_buffer()
    for m in range(3):
        with ddp.no_sync() if m < 2 else contextlib.nullcontext():
            lm_loss(ddp, micro[m]).backward()
            lm_loss(plain, micro[m]).backward()  # plain autograd accumulates into .grad
    ddp.finish_grad_sync()
    hooks, starts = ([e for e in timeline.events if e[0] == kind] for kind in ("grad", "start"))
    counted = sum(sum(g.grad_ready_counts.values()) for g in ddp.bucket_groups)
    print(f"{len(ddp.bucket_groups)} bucket groups: {len(hooks)} hook calls, {counted} counted, "
          f"{len(starts)} collectives launched")
    w = net.output.weight
    print("output.weight: grad", w.grad, "| main_grad[0,:4]", w.main_grad[0, :4])
    assert (len(hooks), counted, len(starts)) == (57, 19, 3)
    assert all(p.grad is None for p in net.parameters())
    assert all(torch.allclose(p.main_grad, q.grad, atol=1e-6)
               for p, q in zip(net.parameters(), plain.parameters()))
    start = ddp.buffers[0].param_index_map[w][0]
    assert w.main_grad.data_ptr() == ddp.buffers[0].grad_data[start:].data_ptr()

# %% [markdown]
# ## Demo 2: two ranks — each shard is the data-parallel mean
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
#   frees `param.grad`, and (with overlap, on the last micro-batch) reports the parameter to
#   its bucket group; `no_sync()` marks the micro-batches that only accumulate.
# - With `overlap_param_gather` a forward pre-hook per module waits for its params' all-gather
#   and starts the next group's, unless `align_param_gather` leaves that to the interleaved
#   schedule; evaluation removes the pre-hooks and gathers everything first.
# - The loop's calls (`zero_grad_buffer`, `finish_grad_sync`, `start_param_sync`,
#   `set_grad_check`) each loop over the bucket groups; later pipeline stages get one bucket.
# - A flag shared by the params makes chapter 02's optimizers refuse to step before
#   `finish_grad_sync`.
# - Every switch is a field of Megatron's `DistributedDataParallelConfig`, with its name and
#   default; on two ranks each rank's shard is the data-parallel mean.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/distributed/distributed_data_parallel.py`, configured by
#   `megatron/core/distributed/distributed_data_parallel_config.py`.
#   <details><summary>Megatron detail: where each piece is</summary>
#
#   `distributed_data_parallel.py`: one bucket on later stages :95-106, hooks :345-373,
#   `_make_forward_pre_hook` :413, `_make_backward_post_hook` :449, `no_sync` :480,
#   `start_param_sync` :510, `finish_grad_sync` :544, `zero_grad_buffer` :566.
#
#   </details>
# - PyTorch DDP (`torch.nn.parallel.DistributedDataParallel`) has the same `no_sync()` context
#   for gradient accumulation; FSDP2's `fully_shard` all-gathers a module's params in a forward
#   pre-hook, as `overlap_param_gather` does here.
#
# ## Exercises
#
# 1. Run demo 1 with `bucket_size=2000` and four micro-batches. How many hook calls does the
#    step make, how many do the bucket groups count, and how many collectives are launched?
#    <details><summary>Answer</summary>
#
#    $19 \times 4 = 76$ hook calls, all adding into `main_grad`; 19 counted (the last
#    micro-batch only); 5 collectives, one per bucket: a bucket closes at the first parameter
#    boundary past 2,000 elements, and `TinyNet`'s 14,704 elements make five buckets (2,048,
#    2,624, 3,184, 3,184 and 3,664 elements with padding).
#
#    </details>
#
# 2. With `overlap_param_gather` at DP 2, an evaluation right after an optimizer step calls
#    `disable_forward_pre_hook(param_sync=False)`. Which weights does its forward see?
#    <details><summary>Hint</summary>
#
#    The step wrote each rank's new weights into its own shard of `param_data` and left the
#    all-gather to the next forward's pre-hooks, which are now gone. Each rank evaluates a
#    model that is new in its shard and one step old everywhere else, and the two ranks'
#    models differ. The default, `param_sync=True`, gathers first.
#
#    </details>
#
# 3. Why does the wrapper give pipeline stages after the first one bucket, however large the
#    model?
#    <details><summary>Hint</summary>
#
#    In 1F1B the first stage runs the step's last backward. A later stage finishes its
#    backward while stage 0 is still in its cooldown, so its data-parallel reduction can run
#    then without delaying the step: nothing is gained by overlapping it, and one bucket is
#    the fewest, largest calls.
#
#    </details>
