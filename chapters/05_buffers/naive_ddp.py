# %% [markdown]
# # 05 · Buffers: data parallelism the naive way, one all-reduce per parameter
#
# Before the buffers and the buckets, the simplest data parallelism that is correct: every
# rank runs the same model on its own slice of the batch, and after the backward each
# parameter's gradient is averaged over the ranks with its own all-reduce. We build it in one
# short class, check on two real ranks that it gives exactly the gradients of the bucketed
# [`DistributedDataParallel`](distributed_data_parallel.py), and count what it costs: that
# count is the reason for the rest of this chapter.

# %%
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = ["NaiveDataParallel", "collective_counts"]

# %% [markdown]
# ## Why an average, and why it must happen every step
#
# Data parallelism splits a global batch of $B$ samples over $d$ ranks, $B/d$ each. The loss of
# the step is the mean over the global batch, so its gradient is the mean of the ranks' local
# gradients:
#
# $$\nabla L = \frac{1}{d} \sum_{r=0}^{d-1} \nabla L_r .$$
#
# Two ranks, one weight $w$: rank 0's slice gives $\nabla L_0 = 0.6$, rank 1's gives
# $\nabla L_1 = 0.2$. Both must step with $0.4$. If each stepped with its own gradient, the two
# copies of $w$ would move apart after the first step and never meet again: the ranks would be
# training two different models. Averaging is an all-reduce: every rank sends its $g_r$ and
# receives $\sum_r g_r$. We divide by $d$ first and then sum, which is what Megatron does by
# default (`gradient_scaling_factor = 1/dp`,
# `megatron/core/distributed/distributed_data_parallel.py:169-204`).
#
# ## When: after the last micro-batch's backward
#
# A step of $m$ micro-batches accumulates $m$ backwards into `.grad` before it averages. The
# collective only needs to run once, on the accumulated sum, so the first $m-1$ backwards run
# under `no_sync()` and send nothing: the same contract as Megatron's `no_sync`
# (`distributed_data_parallel.py:480`) and PyTorch DDP's.
#
# The natural place to launch the average is a **hook** that autograd calls once a parameter's
# gradient has been accumulated: `Tensor.register_post_accumulate_grad_hook`. It fires once per
# backward per parameter, even for a weight that the forward uses twice (autograd sums the two
# contributions before it accumulates).
#
# ```mermaid
# sequenceDiagram
#   participant BW as backward
#   participant H as hook of param i
#   participant N as all ranks
#   BW->>H: grad of the last layer's weight is accumulated
#   H->>N: all_reduce(grad / d), blocking
#   N-->>H: mean gradient
#   H-->>BW: backward continues with the next parameter
#   Note over BW,N: one collective per parameter, each waits for the whole ring
# ```

# %% [markdown]
# ## The whole thing
#
# A wrapper that registers one hook per trainable parameter. The hook pre-scales the gradient
# by $1/d$ and all-reduces it in place with a SUM. The collective is **blocking**: the backward
# waits for each parameter's all-reduce before it computes the next gradient. The counter is
# there only so that the demo can show how many collectives a step issues.

# %%
class NaiveDataParallel(torch.nn.Module):
    """Data parallelism without buffers: one blocking all-reduce per parameter, from its hook."""

    def __init__(self, module: torch.nn.Module, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.sync = True            # False inside no_sync(): accumulate, send nothing
        self.num_collectives = 0    # collectives issued so far (for the demo)
        for p in module.parameters():
            if p.requires_grad:     # fires after autograd has added this backward into p.grad
                p.register_post_accumulate_grad_hook(self._average_grad)

    def forward(self, *args, **kwargs):
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    def _average_grad(self, param: torch.Tensor) -> None:
        if not self.sync or self.world == 1:
            return
        param.grad.div_(self.world)                      # pre-scale: SUM of g/d is the mean
        dist.all_reduce(param.grad, group=self.group)    # blocks this backward until done
        self.num_collectives += 1

    @contextlib.contextmanager
    def no_sync(self):
        """Inside: the backward only accumulates into .grad (every micro-batch but the last)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


# %% [markdown]
# ## What it costs
#
# The class is correct, and for a small model it is all one needs. It has three costs, and
# each is one of the next pages' mechanisms:
#
# | cost | where it comes from | what the real DDP does instead |
# |---|---|---|
# | one collective per parameter: 97 on a rank of the running example | each call pays a fixed launch and ring latency $\alpha$, however small the tensor (a norm weight is 8 KB) | [one flat buffer cut into buckets](param_and_grad_buffer.py): a handful of large collectives |
# | the backward waits for every all-reduce | the call blocks inside the hook | [async collectives on a side stream](bucket_group.py), waited for once in `finish_grad_sync` |
# | `.grad` is a separate tensor per parameter, in the param's dtype | autograd allocates it | `main_grad`, an fp32 view of the buffer, where the grads of all micro-batches accumulate |
#
# A ring all-reduce of $n$ bytes over $d$ ranks takes about $2(d-1)\alpha + 2\frac{d-1}{d}
# \frac{n}{\beta}$ for a per-step latency $\alpha$ and bandwidth $\beta$. The bandwidth term
# depends only on the total bytes, however many calls carry them; the latency term is paid
# once per call. One rank of the running example (stage 0 of TP 2, PP 2, at DP 64) holds 97
# weight tensors; naively that is $97 \cdot 2 \cdot 63 = 12{,}222$ latency steps per
# iteration, against $17 \cdot 126 = 2{,}142$ for the 17 buckets of Megatron's default size
# (the demo below computes both).
#
# `collective_counts` below states that arithmetic for any list of parameter sizes: naive
# DDP issues one call per parameter; a bucketed one issues one per bucket of `bucket_size`
# elements (the buffer's exact bucket rule is on [the next page](param_and_grad_buffer.py);
# here, a simple greedy fill stands in for it).

# %%
def collective_counts(numels: list[int], bucket_size: int) -> tuple[int, int]:
    """(per-parameter calls, bucketed calls): buckets filled greedily up to bucket_size elements."""
    buckets, filled = 0, 0
    for n in numels:
        if filled == 0:
            buckets += 1
        filled += n
        if filled >= bucket_size:
            filled = 0
    return len(numels), buckets


# %% [markdown]
# ## Demo: two ranks, naive and bucketed, the same gradients
#
# A real two-rank gloo world. On each rank the same small model (embedding, three MLP blocks,
# a weight used twice, a head) is wrapped twice: by `NaiveDataParallel` and by the bucketed
# [`DistributedDataParallel`](distributed_data_parallel.py) with buckets of 4000 elements and
# overlap on. Both see the same two micro-batches per step, for two steps
# (`tinytron.buffers._naive.naive_vs_ddp`). The naive `.grad` must equal the real `main_grad`
# to rounding, be identical on both ranks, and have cost one collective per parameter.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.buffers._naive import naive_vs_ddp
    from tinytron.launch import run_on_ranks

    out = run_on_ranks(naive_vs_ddp, 2, timeout=120)
    for o in out:
        print(f"rank {o['rank']}: max |naive .grad - DDP main_grad| = {o['max_abs_diff']:.1e}; "
              f"collectives per step: naive {o['naive_collectives']}, bucketed "
              f"{o['ddp_collectives']}")
    assert all(o["max_abs_diff"] < 1e-6 and o["ranks_agree"] for o in out)
    assert all(o["naive_collectives"] == o["num_params"] > o["ddp_collectives"] for o in out)

# %% [markdown]
# And the count at scale, on the book's running example: the model of appendix B's
# `llama_7b_config` (32 layers, $h = 4096$, a fused QKV with 8 query groups, a fused SwiGLU
# fc1 of $2 \cdot 14{,}336$ rows, a 128,256-word vocabulary), one rank of stage 0 at TP 2
# and PP 2: the embedding shard and 16 layers of two norms and four matrices, each matrix
# halved by TP. One call each, against buckets of Megatron's default size at DP 64,
# $\max(40\text{M}, 1\text{M} \cdot d) = 64\text{M}$ elements
# (`distributed_data_parallel.py:69`), filled from the last layer back as backward produces
# the gradients.

# %%
if __name__ == "__main__":
    from tinytron.model.config import llama_7b_config, parameter_breakdown

    cfg, tp, dp = llama_7b_config(), 2, 64
    parts, h = parameter_breakdown(cfg), cfg.hidden_size
    layer = [h, parts["linear_qkv"] // tp, parts["linear_proj"] // tp, h,
             parts["linear_fc1"] // tp, parts["linear_fc2"] // tp]
    numels = [parts["embedding"] // tp] + layer * (cfg.num_layers // 2)  # stage 0 of PP 2
    naive_calls, bucket_calls = collective_counts(numels[::-1], max(40_000_000, 1_000_000 * dp))
    steps = {"naive": naive_calls * 2 * (dp - 1), "bucketed": bucket_calls * 2 * (dp - 1)}
    print(f"{len(numels)} tensors, {sum(numels) / 1e9:.2f}B params on the rank: "
          f"{naive_calls} per-parameter all-reduces ({steps['naive']:,} latency steps at "
          f"DP {dp}), {bucket_calls} bucketed ones ({steps['bucketed']:,})")
    sizes = sorted(numels)
    plt.figure(figsize=(7, 2.6), dpi=150)
    plt.semilogy(range(len(sizes)), sizes, ".", ms=3)
    plt.axhline(64_000_000, color="red", lw=1, label="one bucket (64M elements at DP 64)")
    plt.xlabel("weight tensor on the rank (sorted by size)")
    plt.ylabel("elements")
    plt.title("A third of the rank's tensors are 4,096-element norms: one call each pays "
              "latency for almost no bytes", fontsize=8)
    plt.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    assert (naive_calls, bucket_calls) == (97, 17)  # the numbers in the cost section above
    assert (steps["naive"], steps["bucketed"]) == (12_222, 2_142)
    assert sizes.count(h) == 32 and len(sizes) == 97  # 32 norms of 97 tensors

# %% [markdown]
# ## Summary
#
# - Data parallelism is correct as soon as every rank steps with the mean gradient; one
#   all-reduce per parameter, pre-scaled by $1/d$, after the last micro-batch, gives it.
# - Its costs are the call count (one per tensor), the blocking wait inside the backward, and a
#   gradient tensor per parameter. The buffer, the buckets and the async collectives of the next
#   pages remove them, and change no gradient: the demo checks the two against each other.
#
# ## How production does it
#
# - Megatron-LM never issues per-parameter collectives: its DDP allocates the contiguous
#   buffer first (`megatron/core/distributed/distributed_data_parallel.py`, buffers built from
#   `:345`; `param_and_grad_buffer.py`).
# - PyTorch DDP (`torch.nn.parallel.DistributedDataParallel`) buckets too (25 MB by default);
#   picotron keeps a `DataParallelNaive` beside its bucketed version, the same pairing as
#   this page and the next.
#
# ## Exercises
#
# 1. Move the all-reduce out of the hook into a loop over the parameters after `backward()`.
#    Is it still correct? What did the hook version offer that the loop does not (think of a
#    non-blocking call)?
#    <details><summary>Hint</summary>
#
#    The average is the same whenever it is taken, as long as
#    it follows the last micro-batch's backward. What changes is *when* each collective can
#    start: the hook fires as soon as one parameter's gradient is final, while most of the
#    backward is still to run; a loop afterwards can only start when all of it is done.
#
#    </details>
#
# 2. Make the all-reduce non-blocking (`async_op=True`) and wait for all handles after the
#    backward. What is now missing to overlap communication with the backward, and why do
#    small tensors still hurt?
#    <details><summary>Hint</summary>
#
#    Compare with `start_grad_sync` and `finish_grad_sync` on
#    the [bucket-group page](bucket_group.py): the buffer gives each bucket one contiguous
#    tensor to reduce, and the wait happens once, before the optimizer. Small tensors still
#    pay the latency term $2(d-1)\alpha$ of the cost formula above, once per call.
#
#    </details>
#
# 3. With bf16 `.grad`, why is dividing by $d$ before the SUM not enough to make the result
#    exact, and where does the real DDP accumulate instead?
#    <details><summary>Hint</summary>
#
#    Scaling avoids overflow, not rounding: every addition of the
#    ring's sum, and of the micro-batches accumulated into `.grad`, rounds to bf16's 8-bit
#    mantissa. Look at `main_grad` in the cost table: an fp32 view of the grad buffer
#    ([next page](param_and_grad_buffer.py)) where the micro-batches accumulate.
#
#    </details>
