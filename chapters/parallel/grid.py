# %% [markdown]
# # A.1 · The process-group grid: which rank does what
#
# Every parallel dimension (tensor, context, data, pipeline) is a way of cutting the world of
# ranks into groups. This page builds that cut as one explicit object, `ParallelGrid`, in the
# same rank order Megatron-LM uses, and prints the "16 ranks" example from the real code.

# %%
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from tinytron.parallel._checks import _check_sizes, _parse_order

__all__ = ["AXES", "DEFAULT_ORDER", "RankLayout", "rank_layout", "ParallelGrid"]

# %% [markdown]
# ## Why a grid
#
# With $N$ ranks and sizes `tp`, `cp`, `dp`, `pp` with $tp \cdot cp \cdot dp \cdot pp = N$, each
# rank gets one coordinate per axis. Megatron lays the coordinates out so that the **first**
# axis in the order string varies fastest across consecutive global ranks. Its default order
# is `"tp-cp-ep-dp-pp"` (`megatron/core/parallel_state.py:561`), so
#
# $$\text{rank} = t + tp\,(c + cp\,(d + dp\cdot p))$$
#
# for tensor rank $t$, context rank $c$, data rank $d$, pipeline rank $p$ (expert parallelism is
# size 1 here and drops out). Tensor parallelism comes first because its all-reduces run inside
# every layer: consecutive ranks share a node and its NVLink. Pipeline comes last because it
# only moves one activation per micro-batch between stages, which tolerates the slower
# inter-node links.
#
# A **group along an axis** is the set of ranks that agree on every *other* coordinate. The
# general rule (`RankGenerator.get_ranks`, `megatron/core/parallel_state.py:505`, built on
# `generate_masked_orthogonal_rank_groups`, `:250`): pick the axes of the group (the "mask"),
# fix the remaining coordinates, and enumerate the masked ones with the first axis fastest.
# Composite groups use several axes at once:
#
# | axis | Megatron token | used for | `parallel_state.py` |
# |---|---|---|---|
# | `tp` | `tp` | the all-reduces inside each layer | `:1003` |
# | `cp` | `cp` | K/V exchange in attention | `:957` |
# | `dp` | `dp` | which samples a rank reads; gradient reduction when cp is 1 | `:935` |
# | `pp` | `pp` | activations between stages | `:1079` |
# | `dp_cp` | `dp-cp` | gradient reduction (CP ranks see different tokens of the same sample) | `:845` |
# | `tp_cp` | `tp-cp` | sums over all shards of one sequence (MoE router statistics) | `:1159` |
# | `mp` | `tp-pp` | model-parallel: grad-norm and inf checks across one model replica | `:986` |
# | `embd` | first + last of each `pp` group | tied word-embedding gradient all-reduce | `:1108`, `:524` |
#
# Megatron's model-parallel group is `tp-pp` (no `cp`): CP ranks hold the same weights.
#
# ## Worked example: 16 ranks, tp 2, pp 4 (so dp 2)
#
# The docstring of `initialize_model_parallel` (`megatron/core/parallel_state.py:683-693`) uses
# exactly this case. For rank 13, $13 = 1 + 2\,(d + 2p)$ gives $d + 2p = 6$, so $t = 1$, $d = 0$,
# $p = 3$: tensor rank 1, data rank 0, last pipeline stage. Its groups: `tp` $=[12, 13]$, `dp` $=[13, 15]$,
# `pp` $=[1, 5, 9, 13]$, and the embedding group of its pipeline is $[1, 13]$. The demo below
# prints every group, computed by `rank_layout`, the same function `ParallelGrid` uses.
#
# ```mermaid
# flowchart LR
#   subgraph pp0["stage 0 (ranks 0-3)"]
#     a0["0 1"] --- a1["2 3"]
#   end
#   subgraph pp1["stage 1 (ranks 4-7)"]
#     b0["4 5"] --- b1["6 7"]
#   end
#   subgraph pp2["stage 2 (ranks 8-11)"]
#     c0["8 9"] --- c1["10 11"]
#   end
#   subgraph pp3["stage 3 (ranks 12-15)"]
#     d0["12 13"] --- d1["14 15"]
#   end
#   pp0 --> pp1 --> pp2 --> pp3
# ```
#
# Each box is one TP pair; the two boxes of a stage are its two DP replicas.

# %%
AXES = ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "mp", "embd")
"""Every axis a grid answers for; `embd` is the first + last pipeline stage."""

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
"""Megatron's default rank order (`megatron/core/parallel_state.py:561`): first varies fastest."""

# Which base axes make up each (possibly composite) axis.
_AXIS_TOKENS = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",),
                "dp_cp": ("dp", "cp"), "tp_cp": ("tp", "cp"), "mp": ("tp", "pp")}

# %% [markdown]
# `rank_layout` is the pure part: no process group, just lists of global ranks. It is what the
# worked example prints and what the tests compare against Megatron's documented groups.

# %%
@dataclass(frozen=True)
class RankLayout:
    """All groups of a world: `groups[axis]` is a list of rank lists; `coords[r][base_axis]` an int."""

    world_size: int
    sizes: dict
    order: tuple
    groups: dict = field(repr=False)
    coords: tuple = field(repr=False)

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The rank list of `axis` that contains `rank` ([] for `embd` on a middle stage)."""
        if axis not in self.groups:
            raise ValueError(f"unknown axis {axis!r}; expected one of {AXES}")
        for ranks in self.groups[axis]:
            if rank in ranks:
                return list(ranks)
        return []


# %% [markdown]
# Every group comes from one rule. Ranks count through the axes in `order`, the first fastest; a
# group of some axes fixes the coordinates of all the others and lets these run.

# %%
def _groups_for(tokens: Sequence[str], order: list[str], sizes: dict) -> list[list[int]]:
    """Groups spanning the axes in `tokens`: fix the other coordinates, enumerate these (first fastest)."""
    strides, s = {}, 1
    for axis in order:
        strides[axis] = s
        s *= sizes[axis]
    inner = [a for a in order if a in tokens]
    outer = [a for a in order if a not in tokens]

    def ranks_of(axes, coord):  # coord is in `axes` order
        return sum(c * strides[a] for a, c in zip(axes, coord))

    # itertools.product varies the LAST element fastest; reverse so the first axis is fastest.
    def enumerate_axes(axes):
        return [tuple(reversed(c)) for c in itertools.product(*(range(sizes[a]) for a in reversed(axes)))]

    return [[ranks_of(outer, oc) + ranks_of(inner, ic) for ic in enumerate_axes(inner)]
            for oc in enumerate_axes(outer)]


# %% [markdown]
# `rank_layout` applies that rule to every axis, adds the embedding group, and records each rank's
# coordinates.

# %%
def rank_layout(world_size: int, tp: int = 1, cp: int = 1, pp: int = 1, dp: int | None = None,
                order: str = DEFAULT_ORDER) -> RankLayout:
    """Compute every group of every axis for a world, without creating any process group."""
    dp = _check_sizes(world_size, tp, cp, pp, dp)
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    axes = _parse_order(order, sizes)
    groups = {name: _groups_for(tokens, axes, sizes) for name, tokens in _AXIS_TOKENS.items()}
    # Embedding group: first and last rank of each pipeline group (one rank when pp == 1),
    # as Megatron's default_embedding_ranks (`parallel_state.py:524`).
    groups["embd"] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in groups["pp"]]
    strides, s = {}, 1
    for axis in axes:
        strides[axis] = s
        s *= sizes[axis]
    coords = tuple({a: (r // strides[a]) % sizes[a] for a in axes} for r in range(world_size))
    return RankLayout(world_size, sizes, tuple(axes), groups, coords)

# %% [markdown]
# ## The grid object, in three parts
#
# `ParallelGrid` is assembled from two small whole classes and a constructor. The first part is
# what the rest of the book asks the grid: for an axis, my group's ranks, its size, my index in
# it and its process-group handle; and which pipeline stage I am. It reads only two
# dictionaries the constructor fills, `_ranks` (axis to rank list) and `_groups` (axis to
# handle), so it works the same on the one-rank grid and on a real world.
#
# Rank 13 of the worked example asks: `ranks("pp")` is $[1, 5, 9, 13]$, `rank("pp")` is 3, so
# `is_last_stage()` holds; `size("embd")` is 2 and `rank("embd")` 1. Rank 5 of the same world
# is a middle stage: `ranks("embd")` is $[]$, `size` 0 and `rank` $-1$, the three values
# that let a caller skip the tied-embedding all-reduce without a special case.

# %%
class GridQueries:
    """The questions a rank asks its grid; reads `_ranks`, `_groups` and `global_rank`."""

    def _check_axis(self, axis: str) -> None:
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; expected one of {AXES}")

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of my group on `axis` ([] for `embd` on a middle pipeline stage)."""
        self._check_axis(axis)
        return list(self._ranks[axis])

    def size(self, axis: str) -> int:
        """Number of ranks in my group on `axis` (0 for `embd` on a middle stage)."""
        self._check_axis(axis)
        return len(self._ranks[axis])

    def rank(self, axis: str) -> int:
        """My index inside my group on `axis` (-1 for `embd` on a middle stage)."""
        ranks = self.ranks(axis)
        return ranks.index(self.global_rank) if ranks else -1

    def group(self, axis: str):
        """The process group of `axis` (None on the single grid or outside the `embd` group)."""
        self._check_axis(axis)
        return self._groups[axis]

    def is_first_stage(self) -> bool:
        """True on pipeline stage 0 (it owns the embedding)."""
        return self.rank("pp") == 0

    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (it owns the output layer and the loss)."""
        return self.rank("pp") == self.size("pp") - 1

    def in_embedding_group(self) -> bool:
        """True on the ranks that hold a copy of the word embedding (first/last stage)."""
        return bool(self._ranks["embd"])


# %% [markdown]
# The second part: the device the grid's collectives run on, one convenience collective, the
# groups' end, and two ways to print where a rank sits. The device follows the backend: NCCL
# groups only move CUDA tensors, gloo groups here move CPU tensors, so a layer that builds a
# buffer for a collective asks `grid.device` instead of guessing.

# %%
class GridServices:
    """Device, a convenience all-reduce, teardown and printing; needs `backend` and `layout`."""

    @property
    def device(self) -> torch.device:
        """The device collectives on this grid use: the current CUDA device under NCCL, else CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce(self, tensor: torch.Tensor, axis: str, op=None) -> torch.Tensor:
        """In-place all-reduce (sum by default) over `axis`; a no-op when that group has 1 rank."""
        if self.size(axis) > 1:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=self.group(axis))
        return tensor

    def destroy(self) -> None:
        """Destroy my process groups (a gloo group keeps threads and sockets until then)."""
        for handle in self._groups.values():
            if handle is not None:
                dist.destroy_process_group(handle)
        self._groups = {axis: None for axis in AXES}

    def describe(self) -> str:
        """One line: my global rank and my coordinate on each base axis."""
        c = self.layout.coords[self.global_rank]
        return (f"rank {self.global_rank}/{self.world_size}: "
                + " ".join(f"{a}={c[a]}/{self.layout.sizes[a]}" for a in ("tp", "cp", "dp", "pp")))

    def __repr__(self) -> str:
        s = self.layout.sizes
        return (f"ParallelGrid(tp={s['tp']}, cp={s['cp']}, dp={s['dp']}, pp={s['pp']}, "
                f"rank={self.global_rank}/{self.world_size})")

# %% [markdown]
# The third part, the constructor, wraps a `RankLayout` around real process groups. Every rank must create every
# group, in the same order, even groups it is not in (that is how `torch.distributed.new_group`
# works), so the constructor walks all axes and all their groups and keeps the handle of the
# group that contains this rank. Groups of size 1 are real groups too: a `None` group would
# silently mean "the whole world" to `torch.distributed`.
#
# `ParallelGrid.single()` is the one-rank grid of a plain script: no process group exists, every
# group handle is `None`, every size is 1, and the collectives of the layers built on top of it
# skip communication when the size is 1.
#
# How many groups that walk creates, for the worked example (16 ranks, tp 2, pp 4, dp 2): 8 `tp`
# groups, 16 `cp` groups of one rank, 8 `dp`, 4 `pp`, 8 `dp_cp`, 8 `tp_cp`, 2 `mp` and 4
# `embd`: 58 `new_group` calls on every rank (the demo below counts them). Each rank keeps one
# handle per axis it belongs to: 8 on a first or last stage, 7 on a middle one (no `embd`).

# %%
class ParallelGrid(GridQueries, GridServices):
    """Process groups of one rank for tp/cp/dp/pp and the composite axes (see `AXES`)."""

    def __init__(self, tp: int = 1, cp: int = 1, pp: int = 1, dp: int | None = None,
                 backend: str | None = None, order: str = DEFAULT_ORDER, *, _single: bool = False):
        if _single:
            world_size, rank = 1, 0
        else:
            if not dist.is_available() or not dist.is_initialized():
                raise ValueError("ParallelGrid needs torch.distributed.init_process_group first; "
                                 "use ParallelGrid.single() for one process")
            world_size, rank = dist.get_world_size(), dist.get_rank()
        self.layout = rank_layout(world_size, tp, cp, pp, dp, order)
        self.world_size, self.global_rank = world_size, rank
        self.backend = None if _single else (backend or dist.get_backend())
        self._ranks = {axis: self.layout.group_of(axis, rank) for axis in AXES}
        self._groups = {axis: None for axis in AXES}
        if not _single:
            for axis in AXES:
                for ranks in self.layout.groups[axis]:
                    handle = dist.new_group(ranks, backend=backend)
                    if rank in ranks:
                        self._groups[axis] = handle
            if self.backend == "nccl":
                self._warm_up_p2p_groups()

    def _warm_up_p2p_groups(self) -> None:
        """NCCL: run one collective on the pp and cp groups so a later batched p2p is not their first call."""
        for axis in ("pp", "cp"):  # torch requires all ranks in a group's first batch_isend_irecv
            if self.size(axis) > 1:
                dist.all_reduce(torch.zeros(1, device=self.device), group=self.group(axis))

    @classmethod
    def single(cls) -> "ParallelGrid":
        """The one-rank grid: all sizes 1, all groups None, no process group needed."""
        return cls(_single=True)


# %% [markdown]
# <details><summary>Megatron detail: groups in module globals</summary>
#
# <p>Megatron's <code>initialize_model_parallel</code> keeps every group in module globals
# (<code>_TENSOR_MODEL_PARALLEL_GROUP</code> and the rest, <code>parallel_state.py:547</code>)
# and skips none; tinytron keeps them in one object, so two layouts can live in one process,
# and it has no expert axes (<code>ep</code> is dropped from the order string, size 1). The
# size checks and the order-string parser live in <code>tinytron.parallel._checks</code>, with
# the same messages.</p>
#
# </details>

# %% [markdown]
# ## Demo: the 16-rank example, printed by the code

# %%
if __name__ == "__main__":
    layout = rank_layout(16, tp=2, pp=4)
    for axis in ("tp", "dp", "pp", "embd", "mp"):
        print(f"{axis:>5}: {layout.groups[axis]}")
    print("rank 13 coordinates:", layout.coords[13])
    # The groups Megatron documents for this case (parallel_state.py:686-691).
    assert layout.groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11],
                                   [12, 14], [13, 15]]
    assert layout.groups["tp"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert layout.groups["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout.coords[13] == {"tp": 1, "cp": 0, "dp": 0, "pp": 3}
    assert layout.group_of("embd", 13) == [1, 13]
    print("new_group calls per rank:", sum(len(layout.groups[axis]) for axis in AXES))
    assert sum(len(layout.groups[axis]) for axis in AXES) == 58

# %% [markdown]
# Adding context parallelism changes who sits next to whom. With tp 2, cp 2, pp 2 on 16 ranks
# (dp 2), the two CP halves of a sequence are neighbors right after the TP pair, and the
# gradient group `dp_cp` joins the 2 CP ranks and the 2 DP replicas into one group of 4.

# %%
if __name__ == "__main__":
    layout = rank_layout(16, tp=2, cp=2, pp=2)
    for axis in ("tp", "cp", "dp", "dp_cp", "tp_cp", "mp", "pp"):
        print(f"{axis:>5}: {layout.groups[axis]}")
    assert layout.group_of("cp", 0) == [0, 2] and layout.group_of("dp", 0) == [0, 4]
    assert layout.group_of("dp_cp", 0) == [0, 2, 4, 6]
    assert layout.group_of("mp", 0) == [0, 1, 8, 9]
    try:
        rank_layout(16, tp=3)
    except ValueError as err:
        print("bad sizes ->", err)
    else:
        raise AssertionError("tp=3 on 16 ranks must be rejected")

# %% [markdown]
# And the same object on real processes: 4 gloo ranks with tp 2, pp 2, each reporting its own
# view. `run_on_ranks` starts the world; the worker builds a `ParallelGrid` and all-reduces its
# global rank over the `tp` group.

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.parallel._workers import grid_views

    views = run_on_ranks(grid_views, 4, 2, 2)
    for v in views:
        print(v["describe"], "| tp sum", v["tp_sum"], "| embd", v["embd"])
    expected = rank_layout(4, tp=2, pp=2)
    for r, v in enumerate(views):
        assert v["tp_sum"] == sum(expected.group_of("tp", r))
        assert v["embd"] == expected.group_of("embd", r)
    assert [v["first"] for v in views] == [True, True, False, False]

# %% [markdown]
# ## Summary
#
# - One explicit object answers "which rank am I on which axis"; nothing lives in module
#   globals, so two grids (say, a training and an evaluation layout) can coexist.
# - The rank order `tp-cp-ep-dp-pp` puts the chattiest axis (TP) on neighboring ranks.
# - Composite groups are just masks over the same coordinates: `dp_cp` for gradients, `mp`
#   (`tp-pp`) for grad norms, `embd` for tied embeddings.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/parallel_state.py` — `RankGenerator` (`:446`),
#   `initialize_model_parallel` (`:547`) stores every group in module globals
#   (`_TENSOR_MODEL_PARALLEL_GROUP`, ...); newer code passes a `ProcessGroupCollection`
#   (`megatron/core/process_groups_config.py`) instead, the same idea as this object.
# - torchtitan: `torch.distributed.device_mesh.init_device_mesh` with named dims
#   (`torchtitan/distributed/parallel_dims.py`), the mesh order `pp, dp, cp, tp` (TP innermost).
#
# ## Exercises
#
# 1. Build the layout for `order="tp-pp-dp-cp"` on 16 ranks and find which group changed.
#
#    <details><summary>Answer</summary>
#
#    On the worked example (tp 2, pp 4, dp 2),
#    <code>rank_layout(16, tp=2, pp=4, order="tp-pp-dp-cp")</code>: <code>tp</code> stays
#    $[0, 1], [2, 3], \dots$, but pp now runs second fastest, so the <code>pp</code> groups become
#    $[0, 2, 4, 6], [1, 3, 5, 7], \dots$ instead of $[0, 4, 8, 12], \dots$, and <code>dp</code>
#    becomes $[0, 8], [1, 9], \dots$ instead of $[0, 2], \dots$. With them change
#    <code>dp_cp</code> (cp is 1), <code>mp</code> ($[0, \dots, 7]$ and $[8, \dots, 15]$) and
#    <code>embd</code> ($[0, 6]$ instead of $[0, 12]$).
#
#    </details>
#
# 2. Why must every rank call `new_group` for groups it is not part of?
#
#    <details><summary>Hint</summary>
#
#    <code>torch.distributed.new_group</code> is itself a
#    collective over the default group: every process must call it, with the same ranks, in the
#    same order, or the processes disagree on which group is which and hang. Look at the loop that
#    walks every group of every axis in <code>ParallelGrid</code>'s constructor, and at Megatron's
#    <code>parallel_state.py</code>, which does the same.
#
#    </details>
#
# 3. Give the `dp_cp` group of rank 5 for tp 2, cp 2, dp 2, pp 2 by hand, then check it.
#
#    <details><summary>Answer</summary>
#
#    In the default order tp-cp-ep-dp-pp the strides are tp 1,
#    cp 2, dp 4, pp 8, so rank $5 = 1 + 0 \cdot 2 + 1 \cdot 4 + 0 \cdot 8$ has tp 1, cp 0, dp 1,
#    pp 0. The <code>dp_cp</code> group fixes tp = 1 and pp = 0 and lets cp and dp run:
#    $1 + 2\,\text{cp} + 4\,\text{dp}$ = $[1, 3, 5, 7]$, which <code>rank_layout(16, tp=2, cp=2,
#    pp=2).group_of("dp_cp", 5)</code> returns.
#
#    </details>
