# %% [markdown]
# # 02 · Optimizer: layer-wise distributed Muon
#
# Muon's Newton–Schulz needs the *whole* matrix, so the byte ranges of the DistributedOptimizer
# (which cut parameters anywhere) do not work for it. Megatron's answer is to distribute whole
# parameters: every data-parallel rank owns a set of complete matrices, steps only those, and
# an all-gather shares the results.

# %%
from __future__ import annotations

import warnings
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from tinytron.optimizer.mixed_precision import MixedPrecisionOptimizer

__all__ = ["ping_pong_owners", "LayerWiseDistributedOptimizer"]

# %% [markdown]
# ## Dealing out whole parameters
#
# `LayerWiseDistributedOptimizer` (`megatron/core/optimizer/layer_wise_optimizer.py:87`) has two
# layouts. With its own DDP buffer layout, parameters are bin-packed into per-rank shards that
# never split a parameter (`_compute_per_buffer_param_layout`, `:116`), so the bucket
# reduce-scatter hands each rank complete gradients for what it owns. Without it (the legacy
# path, `_shard_params_ping_pong`, `:529`) gradients are all-reduced as in plain DDP, parameters
# are sorted by size in a rank-independent order and dealt out **ping-pong**: ranks
# $0,1,\dots,d-1,d-1,\dots,0,0,1,\dots$ — the largest params go one to each rank, the next ones
# come back the other way, which evens out memory. After the step each rank's updated params are
# all-gathered (`allgather_params`, `:630`).
#
# We build the legacy path on [chapter 05's](../05_buffers/distributed_data_parallel.py) non-distributed DDP (its all-reduced `main_grad`),
# which needs no special buffer layout. Example with 4 ranks and 10 params sorted
# $p_0 \ge \dots \ge p_9$: owners are `[0, 1, 2, 3, 3, 2, 1, 0, 0, 1]`, i.e. rank 0 gets
# $p_0, p_7, p_8$ and rank 3 gets $p_3, p_4$.
#
# The grad norm and `found_inf` are reduced over all ranks (each rank sees only its own
# params); embeddings, norms and biases are owned the same way and stepped by the AdamW half of
# the chained optimizer.
#
# ```mermaid
# flowchart LR
#   G["all-reduce grads (DDP)"] --> O["step my whole params<br/>(Muon: NS on full matrices)"]
#   O --> A["all-gather: every rank's<br/>updated params, flattened"]
#   A --> M[identical model on all ranks]
# ```

# %%
def ping_pong_owners(numels: list[int], dp: int) -> list[int]:
    """Owner rank of each param: sort by size (ties by position), deal 0..d-1, d-1..0, ..."""
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    order = sorted(range(len(numels)), key=lambda i: (-numels[i], i))
    loop = list(range(dp)) + list(range(dp))[::-1]
    owners = [0] * len(numels)
    for k, i in enumerate(order):
        owners[i] = loop[k % len(loop)]
    return owners


# %% [markdown]
# The all-gather sends each rank's owned params flattened into one vector per dtype, padded to
# the longest rank's length (an all-gather needs equal sizes), and every rank copies the others'
# slices back into its params.
#
# Example: 4 ranks owning 300, 120, 0 and 50 fp32 elements. Each sends a vector of 300 (the
# longest), zero-padded; the all-gather returns 1,200 elements, and rank 2 reads rank 0's
# params from `[0, 300)`, rank 1's from `[300, 420)`, rank 3's from `[900, 950)`. The padding
# costs $4 \cdot 300 - 470 = 730$ elements of traffic here; with many params per rank the
# ping-pong deal keeps the ranks' totals, and so the padding, small.

# %%
class AllGatherOwned:
    """Mixin for LayerWiseDistributedOptimizer: share every rank's updated whole params."""

    @torch.no_grad()
    def allgather_params(self) -> None:
        """One padded all-gather per dtype of the flattened params each rank owns."""
        if self.dp_size == 1:
            return
        for dtype in sorted({p.dtype for _, p in self.all_named}, key=str):
            by_rank = [[p for (_, p), o in zip(self.all_named, self.owners)
                        if o == r and p.dtype == dtype] for r in range(self.dp_size)]
            sizes = [sum(p.numel() for p in ps) for ps in by_rank]
            width = max(sizes)
            if width == 0:
                continue
            local = torch.zeros(width, dtype=dtype, device=self.all_named[0][1].device)
            if by_rank[self.dp_rank]:
                local[: sizes[self.dp_rank]] = torch.cat([p.view(-1) for p in by_rank[self.dp_rank]])
            full = torch.empty(width * self.dp_size, dtype=dtype, device=local.device)
            with warnings.catch_warnings():   # renamed in torch 2.13; 2.11 has only this name
                warnings.filterwarnings("ignore", category=FutureWarning)
                dist.all_gather_into_tensor(full, local, group=self.dp_group)
            for r, ps in enumerate(by_rank):
                offset = r * width
                for p in ps:
                    p.copy_(full[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()


# %% [markdown]
# The state dict is the layout-independent one of the mixed-precision page, merged over the
# ranks, so it loads into any optimizer of this chapter. On load every model param is refreshed
# from the saved fp32 values, owned or not, before each rank takes its own entries.

# %%
class OwnedStateDict:
    """Mixin for LayerWiseDistributedOptimizer: every rank's owned entries, merged by name."""

    def state_dict(self) -> dict:
        """Layout-independent: every rank's owned entries, merged (full tensors by name)."""
        sd = super().state_dict()
        if self.dp_size > 1:
            parts = [None] * self.dp_size
            dist.all_gather_object(parts, sd["params"], group=self.dp_group)
            sd["params"] = {k: v for part in parts for k, v in part.items()}
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Take my owned entries; refresh every model param from the saved fp32 values."""
        for name, p in self.all_named:
            if name not in sd["params"]:
                raise ValueError(f"optimizer state has no entry for param {name!r}")
            p.copy_(sd["params"][name]["fp32_param"])
        super().load_state_dict(sd)


# %% [markdown]
# The optimizer is [the mixed-precision wrapper](mixed_precision.py) over only the params this
# rank owns; the norm is reduced over every rank, and the step ends by sharing the results.

# %%
class LayerWiseDistributedOptimizer(AllGatherOwned, OwnedStateDict, MixedPrecisionOptimizer):
    """Each DP rank steps the whole params it owns (ping-pong by size), then all-gathers them."""

    def __init__(self, build_optimizer: Callable, named_params: Iterable, grid, *,
                 clip_grad: float = 1.0, grad_scaler=None):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.dp_size = 1 if grid is None else grid.size("dp_cp")
        self.dp_rank = 0 if grid is None else grid.rank("dp_cp")
        self.dp_group = None if self.dp_size == 1 else grid.group("dp_cp")
        self.all_named = named
        self.owners = ping_pong_owners([p.numel() for _, p in named], self.dp_size)
        mine = [(n, p) for (n, p), o in zip(named, self.owners) if o == self.dp_rank]
        super().__init__(build_optimizer(mine), clip_grad=clip_grad, grad_scaler=grad_scaler,
                         grid=grid)

    def grad_stats_group(self):
        """Each rank holds different params: reduce over every rank."""
        return None

    def _reduce(self) -> bool:
        """Reduce whenever there is more than one rank."""
        return dist.is_initialized() and dist.get_world_size() > 1

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Step my params, write them back, then share every rank's results."""
        super().step_with_ready_grads()
        self.allgather_params()


# %% [markdown]
# ## Demo 1: who owns what
#
# The ping-pong deal for the worked example, then for a small MLP at DP 2 and 4.

# %%
if __name__ == "__main__":
    from tinytron.optimizer._workers import small_mlp

    owners = ping_pong_owners([100 - i for i in range(10)], 4)
    print("10 params sorted by size, dp=4 ->", owners)
    assert owners == [0, 1, 2, 3, 3, 2, 1, 0, 0, 1]
    named = list(small_mlp().named_parameters())
    for dp in (2, 4):
        own = ping_pong_owners([p.numel() for _, p in named], dp)
        load = [sum(p.numel() for (_, p), o in zip(named, own) if o == r) for r in range(dp)]
        print(f"dp={dp}: " + ", ".join(f"{n}->{o}" for (n, _), o in zip(named, own)),
              f"| elements per rank {load}")

# %% [markdown]
# ## Demo 2: DP 2 layer-wise Muon equals single-process Muon
#
# Two gloo ranks train the MLP with Muon (hidden matrices) + AdamW (biases, norm) through chapter
# 05's all-reduce DDP, each on half of every batch; the same process also trains a copy on the
# full batch with the plain optimizer. Newton–Schulz runs in fp32 here so the comparison is
# tight.

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.optimizer import _workers

    out = run_on_ranks(_workers.layer_wise_parity, 2, 5, timeout=120)
    for r, o in enumerate(out):
        print(f"rank {r}: owns {o['owned']}, max |layer-wise - plain| = {o['max_param_diff']:.1e}, "
              f"state dict diff {o['max_state_diff']:.1e}")
    assert all(o["max_param_diff"] < 1e-5 and o["max_state_diff"] < 1e-5 for o in out)

# %% [markdown]
# ## Summary
#
# - Whole parameters per DP rank, dealt ping-pong by size; each rank runs Muon (or AdamW) on
#   complete matrices and the results are all-gathered.
# - Memory: the optimizer state is divided by `dp` (unevenly: by whole params), the gradients
#   are not (they are all-reduced in this legacy layout).
#
# ## How production does it
#
# - Megatron: `megatron/core/optimizer/layer_wise_optimizer.py` (class `:87`, shard-aligned
#   layout `:116` with LPT bin-packing (*longest processing time first*: take the params from
#   largest to smallest and give each to the rank with the least so far, which keeps the ranks'
#   totals within one param of each other) and 64-aligned starts, ping-pong `:529`, all-gather `:630`,
#   `step_with_ready_grads:740`).
# - Moonlight / Kimi's distributed Muon gathers the ZeRO-1 shards of each matrix for NS and
#   scatters the result back: same goal, communication per step instead of per layout.
#
# ## Exercises
#
# 1. With 4 ranks and a model whose embedding is 10× larger than any other matrix, how uneven is
#    the ping-pong deal? How does Megatron's LPT packing with a shared-embedding bucket help?
#
#    <details><summary>Hint</summary>
#
#    Run `ping_pong_owners` on sizes like $[10, 1, 1, \dots]$ at
#    `dp=4` and sum each rank's share: the rank dealt the embedding carries it alone, whatever
#    follows. LPT can only balance the rest around it; see the shard-aligned layout in
#    `layer_wise_optimizer.py` cited above.
#
#    </details>
#
# 2. Why must the sort order be identical on every rank (Megatron breaks numel ties by buffer
#    position)? What happens on the first step if two ranks disagree?
#
#    <details><summary>Hint</summary>
#
#    Every rank computes `owners` on its own, with no message.
#    Follow `AllGatherOwned.allgather_params`: each rank packs what it thinks it owns and reads
#    the others' slices by the owners it computed.
#
#    </details>
