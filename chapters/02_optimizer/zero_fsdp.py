# %% [markdown]
# # 02 · Optimizer: the DistributedOptimizer beside ZeRO-2, ZeRO-3 and FSDP2
#
# A question every reader of [the DistributedOptimizer page](distributed.py) asks: "is this
# ZeRO? which stage? and what would FSDP change?" This page answers it with the bytes one rank
# of the running example holds under each scheme, and with what each scheme makes the
# iteration communicate. Nothing here is implemented; the ledger of the two schemes this book
# runs comes from [chapter 07's `state_ledger`](../07_memory/states.py), and the others from
# the same parameter count and the rule of the paper that named them.
#
# You will build: `sharding_ledger`.

# %%
from __future__ import annotations

__all__ = ["SCHEMES", "sharding_ledger"]

# %% [markdown]
# ## Four things per parameter, and who shards which
#
# Under bf16 training with fp32 gradients and Adam, a rank that holds $N$ parameters keeps
# four things for them: the bf16 weights the forward reads (2 bytes each), the fp32
# gradients the backward accumulates (4), the fp32 master weights (4) and Adam's two
# moments (8). Rajbhandari et al. (*ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models*, SC'20, arXiv:1910.02054, §5) shard them among the $d$ data-parallel
# ranks in three stages: the optimizer state (stage 1, "$P_{os}$"), then the gradients too
# (stage 2, "$P_{os+g}$"), then the weights too (stage 3, "$P_{os+g+p}$"). With this book's
# dtypes (the paper's gradients are 2-byte; ours are fp32, as on the running example):
#
# | scheme | weights | gradients | master + moments | bytes per parameter |
# |---|---|---|---|---|
# | DDP + Adam (no sharding) | $2$ | $4$ | $12$ | $18$ |
# | Megatron's DistributedOptimizer | $2$ | $4$ | $12/d$ | $6 + 12/d$ |
# | ZeRO-2 | $2$ | $4/d$ | $12/d$ | $2 + 16/d$ |
# | ZeRO-3 | $2/d$ | $4/d$ | $12/d$ | $18/d$ |
# | FSDP2 (fp32 shards, bf16 compute) | — | $4/d$ | $4/d$ + $8/d$ | $16/d$ |
#
# **Megatron's DistributedOptimizer is ZeRO-1 in memory**: every rank keeps the whole bf16
# param buffer and the whole fp32 grad buffer of [chapter 05](../05_buffers/param_and_grad_buffer.py),
# and only the fp32 state is split. In communication it already looks like ZeRO-2: the
# gradients are reduce-scattered, so each rank receives only the sum of its own range, and
# the new weights come back by all-gather.
#
# **FSDP2** (`torch.distributed.fsdp.fully_shard`) has no row for the bf16 weights: the
# sharded parameter itself is kept in fp32 and is the master, so with a mixed-precision
# policy of bf16 compute it casts its shard to bf16 at all-gather time. Its resident bytes
# are the fp32 shard, its gradient shard and the moments: $16/d$.

# %%
SCHEMES = {  # bytes per parameter: (weights, gradients, master + moments); "d" divides
    "DDP + Adam": ((2, 1), (4, 1), (12, 1)),
    "DistributedOptimizer": ((2, 1), (4, 1), (12, "d")),
    "ZeRO-2": ((2, 1), (4, "d"), (12, "d")),
    "ZeRO-3": ((2, "d"), (4, "d"), (12, "d")),
    "FSDP2": ((0, 1), (4, "d"), (12, "d")),  # no bf16 copy: the fp32 shard is the master
}


def sharding_ledger(num_params: int, dp: int) -> dict[str, dict[str, int]]:
    """Resident bytes of one rank holding num_params, per scheme: weights, grads, state."""
    out = {}
    for scheme, terms in SCHEMES.items():
        row = {}
        for name, (nbytes, split) in zip(("weights", "gradients", "master + moments"), terms):
            share = dp if split == "d" else 1
            row[name] = nbytes * -(-num_params // share)  # a ceil: the last range is padded
        out[scheme] = row
    return out

# %% [markdown]
# ## Demo: one rank of the running example
#
# Stage 0 of TP 2 · PP 2 at DP 64 holds 2,007,629,824 parameters. Chapter 07's `state_ledger`
# walks the real buffer layout of that rank, with and without the distributed optimizer; the
# asserts say its bytes are this page's rule for those two rows, to the byte (the buffers need
# no padding at DP 64 here). The other three rows are the rule alone.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.memory import running_example, state_ledger
    from tinytron.model.config import count_parameters_per_rank

    cfg = running_example()  # TP2 (SP) · PP2 · DP64, micro-batch 2, DistOpt (chapter 07)
    n = count_parameters_per_rank(cfg.model, tp=2, pp=2, pp_rank=0)
    ledger = sharding_ledger(n, 64)
    for scheme, row in ledger.items():
        print(f"{scheme:>22}: " + ", ".join(f"{k} {v / 2**30:6.2f} GiB" for k, v in row.items())
              + f" | total {sum(row.values()) / 2**30:6.2f} GiB")
    for dist_opt, scheme in ((True, "DistributedOptimizer"), (False, "DDP + Adam")):
        real = state_ledger(cfg.replace(use_distributed_optimizer=dist_opt), pp_rank=0)
        assert sum(real.values()) == sum(ledger[scheme].values())  # chapter 07's walk
    totals = {s: sum(r.values()) for s, r in ledger.items()}
    assert n == 2_007_629_824 and totals["DistributedOptimizer"] == 12_422_209_536
    assert totals["ZeRO-2"] == 2 * n + 16 * n // 64 and totals["FSDP2"] == 16 * n // 64
    assert [f"{totals[s] / 2**30:.2f}" for s in ledger] == ["33.66", "11.57", "4.21", "0.53",
                                                              "0.47"]  # the summary's numbers

# %% [markdown]
# The picture puts the five totals side by side; the dashed line is the 22.01 GiB of
# activations the same rank holds at its peak ([07.5](../07_memory/ledger.py)), which no
# scheme on this page touches. The last assert is the transient of ZeRO-3 and FSDP2 named
# below: one of this rank's layers, gathered in bf16.

# %%
if __name__ == "__main__":
    from tinytron.memory.ledger import stage_ledgers
    from tinytron.model.config import parameter_breakdown

    peak = stage_ledgers(cfg)[0].device["activations"] / 2**30
    parts = parameter_breakdown(cfg.model)
    layer = sum(parts[k] for k in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")) // 2
    layer += parts["layer_norms"]
    assert f"{peak:.2f}" == "22.01" and (layer, round(2 * layer / 2**20)) == (109_060_096, 208)
    fig, ax = plt.subplots(figsize=(8, 2.8), dpi=150)
    left = [0.0] * len(ledger)
    for term, color in (("weights", "#4c72b0"), ("gradients", "#64b5cd"),
                        ("master + moments", "#8172b3")):
        widths = [ledger[s][term] / 2**30 for s in ledger]
        ax.barh(list(ledger), widths, left=left, color=color, label=term)
        left = [a + w for a, w in zip(left, widths)]
    ax.axvline(peak, color="black", ls="--", lw=1, label="activations at the peak")
    ax.invert_yaxis()
    ax.set_xlabel("GiB on one rank (stage 0, TP 2, PP 2, DP 64)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Shard the state, then the grads, then the weights: the activations (dashed) "
                 "become the rank's bulk", fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## Why Megatron keeps the whole grad buffer
#
# ZeRO-2 saves another $4N(1 - 1/d)$ bytes, 7.4 GiB here. Megatron does not take them by
# default because of the micro-batches: this rank runs $m = 8$ of them per step, and the
# gradients must add up over all eight before they are reduced. A whole fp32 buffer
# accumulates them locally, and one reduce-scatter per bucket per *step* follows, overlapped
# with the last backward (chapter 05). A rank that keeps only its gradient shard cannot
# accumulate the other ranks' ranges, so it must reduce-scatter after *every* micro-batch:
# $m$ times the gradient traffic. FSDP2 offers the same choice
# (`set_requires_gradient_sync(False)` on all but the last micro-batch keeps unsharded
# gradients, and their memory, until then). With PP already cutting the rank to 2B
# parameters, 6.2 bytes each is the cheaper side of that trade.
#
# ## What changes in the iteration
#
# - **DDP**: one all-reduce of the gradients per step ($2N$ elements over the ring).
# - **DistributedOptimizer**: a reduce-scatter of the gradients and an all-gather of the new
#   weights, the same volume as the all-reduce split in two; the all-gather can overlap the
#   next forward (`overlap_param_gather`, chapter 05).
# - **ZeRO-3 / FSDP2**: the weights exist whole only while a layer runs. Each layer is
#   all-gathered before its forward and again before its backward, and its gradient
#   reduce-scattered after: 1.5 times DDP's volume, on the critical path unless prefetched.
#   The transient is the gathered layer(s): one layer of this rank is 109,060,096 parameters,
#   208 MiB in bf16, two with prefetch.
#
# ## Summary
#
# - Megatron's DistributedOptimizer shards the fp32 master and Adam state (ZeRO-1 memory) and
#   reduce-scatters the gradients (ZeRO-2 traffic): $6 + 12/d$ bytes per parameter, 11.57 GiB
#   on one rank of the running example against 33.66 GiB unsharded.
# - ZeRO-2 would bring it to 4.21 GiB, ZeRO-3 to 0.53 GiB and FSDP2 to 0.47 GiB, each paying in
#   communication: per micro-batch reduce-scatters, or per layer all-gathers.
#
# ## How production does it
#
# - Megatron's own sharded data parallelism, Megatron-FSDP, names the same three stages
#   `optim`, `optim_grads` and `optim_grads_params` (`data_parallel_sharding_strategy`,
#   `megatron/core/distributed/distributed_data_parallel_config.py:100-102`); the
#   DistributedOptimizer is `megatron/core/optimizer/distrib_optimizer.py:102`.
# - Megatron can also wrap the model with PyTorch's FSDP2: `TorchFullyShardedDataParallel`
#   calls `fully_shard` on each submodule and then on the whole model
#   (`megatron/core/distributed/torch_fully_sharded_data_parallel.py:134-146`).
# - DeepSpeed implements the ZeRO stages of the paper, with 2-byte gradients.
#
# ## Exercises
#
# 1. At what DP size does ZeRO-2 save more than 1 GiB over the DistributedOptimizer on this
#    rank? (Hint: the saving is $4N(1 - 1/d)$.)
#
#    <details><summary>Answer</summary>
#
#    At every $d \ge 2$: $4N/2$ is already 3.7 GiB; the
#    saving only grows toward $4N$ = 7.48 GiB.
#
#    </details>
#
# 2. With $m = 8$ micro-batches, how many bytes of gradients does one rank send per step
#    under the DistributedOptimizer, and under ZeRO-2 reduced every micro-batch?
#
#    <details><summary>Answer</summary>
#
#    A ring reduce-scatter sends $(d-1)/d$ of the buffer:
#    $4N \cdot 63/64 \approx 7.9$ GB once per step; eight times that, about 63 GB, with
#    ZeRO-2.
#
#    </details>
