# %% [markdown]
# # 03 · Checkpoint: resharding the optimizer state
#
# The model's weights reshard for free: a TP rank or a pipeline stage of the new layout simply
# asks for other global boxes. The DistributedOptimizer's fp32 master weights and Adam moments
# are harder: a DP rank owns a flat **range** of a bucket, which cuts parameters at arbitrary
# elements. This page stores that state in model space — under the model's own keys, with the
# model's global shapes — without any communication, so that it reshards across TP, PP and DP
# like the weights.
#
# You will build: `flat_range_boxes`, `OptimizerPiece`, `optimizer_pieces`,
# `optimizer_sharded_state_dict`, `plot_reshard`.

# %%
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tinytron.checkpoint._common import CheckpointGroups, is_sharded_optimizer, main_state
from tinytron.checkpoint.sharded_keys import ShardedTensor, TensorLayout
from tinytron.checkpoint.torch_dist import read_dcp_index

__all__ = ["flat_range_boxes", "OptimizerPiece", "optimizer_pieces", "optimizer_state_keys",
           "optimizer_sharded_state_dict", "optimizer_steps", "OPTIMIZER_PREFIX",
           "checkpoint_quantities", "wanted_quantities", "piece_states", "rederive_masters",
           "chunks_by_rank", "plot_reshard"]

OPTIMIZER_PREFIX = "optimizer.state"
"""Megatron's prefix for model-space optimizer state (`fully_reshardable`): `optimizer.state.exp_avg.<key>`."""

# %% [markdown]
# ## Megatron's choice, and the one here
#
# Megatron-Core offers two ways to put DistributedOptimizer state in a `torch_dist` checkpoint
# (`distrib_optimizer.py:1404`):
#
# - `dp_reshardable` (its default): one 1-D tensor per bucket and quantity, under a key that
#   embeds the model-parallel rank and the bucket index. No communication, but only DP may
#   change: a different TP or PP size changes the buckets. Loading such a checkpoint with
#   another (TP, PP) raises (`checkpointing.py:1728-1737`).
# - `fully_reshardable` (`--dist-ckpt-optim-fully-reshardable`, `:1634`): all-gather the DP
#   shards, unflatten them into model-shaped tensors and save them like the model under
#   `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`. Reshardable along every axis, at
#   the price of a gather over DP at every save (or a gather to one rank with the
#   memory-efficient variant).
#
# The observation used here: a contiguous range of a row-major tensor is a union of at most
# $2(n-1) + 1$ **rectangles** for an $n$-dimensional tensor — a partial first row, a block of
# full rows, a partial last row (recursively in higher dimensions) — and each rectangle is
# itself contiguous in the range. So a DP rank can write its own range directly in model
# space, as up to three chunks per 2-D parameter, at their global offsets: Megatron's
# `fully_reshardable` keys and layout with `dp_reshardable`'s zero communication.
#
# Worked example: a $[5, 4]$ tensor and the flat range $[6, 17)$ (11 elements):
#
# | rectangle | offset | size | flat elements |
# |---|---|---|---|
# | rest of row 1 | (1, 2) | (1, 2) | 6, 7 |
# | rows 2–3 | (2, 0) | (2, 4) | 8 … 15 |
# | start of row 4 | (4, 0) | (1, 1) | 16 |
#
# <details><summary>Megatron detail: no gather on DP rank 0</summary>
#
# Megatron's `fully_reshardable` save gathers the DistributedOptimizer's buffers on DP rank 0
# and writes them from there (`distrib_optimizer.py:1421-1426`, the docstring of
# `sharded_state_dict`). tinytron writes the same keys and global shapes, but every DP rank
# writes its own range as rectangles, with no gather: at DP 64 no rank holds 64 ranges at
# once. A reader asks for boxes, as every DCP reader does, and reads both the same way; only
# the chunk list in `.metadata` differs.
#
# </details>

# %%
def flat_range_boxes(shape, start: int, end: int) -> list[tuple[tuple, tuple]]:
    """Rectangles (offset, size), in order, tiling the row-major flat range [start, end) of `shape`."""
    shape = tuple(shape)
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"range [{start}, {end}) is outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    lo, hi = start - first * inner, end - last * inner   # offsets inside the first / last row

    def row(r, a, b):
        return [((r,) + o, (1,) + s) for o, s in flat_range_boxes(shape[1:], a, b)]

    if first == last:
        return row(first, lo, hi)
    boxes = row(first, lo, inner) if lo else []
    full_from, full_to = first + (1 if lo else 0), last + (1 if hi == inner else 0)
    if full_to > full_from:
        boxes.append(((full_from,) + (0,) * (len(shape) - 1), (full_to - full_from,) + shape[1:]))
    if hi < inner:
        boxes += row(last, 0, hi)
    return boxes


# %% [markdown]
# ## What an optimizer holds, whatever its kind
#
# `optimizer_pieces` lists, for every tensor the optimizer steps, which model parameter it
# belongs to and which flat range of that parameter (its local TP shard) it covers:
#
# - the DistributedOptimizer: its pieces (chapter 02's `ShardRange.param_start/param_end`),
#   disjoint across DP ranks;
# - the layer-wise distributed optimizer: whole parameters, each on the one DP rank that owns it;
# - the mixed-precision optimizer (and a plain `torch.optim` optimizer): whole parameters,
#   replicated on every DP rank, so DP rank 0 writes them.
#
# Every state tensor of the same size as the piece (`exp_avg`, `exp_avg_sq`, Muon's and SGD's
# `momentum_buffer`, …) is stored; the master weight under `param`. All ranks agree on the
# list of state names first, so that a parameter that has not been stepped yet is written as
# zeros with step 0 — exactly the state Adam would create for it — and every global tensor is
# covered.

# %%
@dataclass
class OptimizerPiece:
    """The part of one model parameter that one optimizer tensor steps."""

    model_param: torch.Tensor
    main: torch.Tensor
    start: int
    end: int


# %% [markdown]
# `optimizer_pieces` lists them for each kind of optimizer, and says whether the optimizer is
# sharded over DP (then every rank writes its own pieces) or replicated (then DP rank 0 does).

# %%
def optimizer_pieces(optimizer) -> tuple[list[OptimizerPiece], bool]:
    """(pieces, sharded over DP) for tinytron's optimizers or a plain torch.optim optimizer."""
    kind = type(optimizer).__name__
    if kind == "DistributedOptimizer":
        return [OptimizerPiece(model, main, piece.param_start, piece.param_end)
                for (model, main), (piece, _) in zip(optimizer.pairs, optimizer.pieces)], True
    if hasattr(optimizer, "pairs"):
        return ([OptimizerPiece(model, main, 0, model.numel()) for model, main in optimizer.pairs],
                is_sharded_optimizer(optimizer))
    if isinstance(optimizer, torch.optim.Optimizer):
        return [OptimizerPiece(p, p, 0, p.numel()) for g in optimizer.param_groups
                for p in g["params"]], False
    raise ValueError(f"cannot checkpoint an optimizer of type {kind}: expected tinytron's "
                     "optimizers or a torch.optim.Optimizer")


# %% [markdown]
# The names of the state tensors, gathered from every rank: a rank whose parameters have not
# been stepped has none, and must still write zeros under the same names.

# %%
def optimizer_state_keys(optimizer, pieces, comm: CheckpointGroups) -> list[str]:
    """Names of the per-element state tensors (all but `step`), agreed by every rank."""
    local = set()
    for piece in pieces:
        for k, v in main_state(optimizer, piece.main).items():
            if k == "step" or not torch.is_tensor(v):
                continue
            if v.numel() != piece.main.numel():
                raise ValueError(f"optimizer state {k!r} has {v.numel()} elements for a "
                                 f"{piece.main.numel()}-element param: not element-wise")
            local.add(k)
    return sorted(set().union(*comm.all_gather_object(sorted(local))))


# %% [markdown]
# The integer step counts travel beside the tensors, one per model key, the largest over the
# ranks.

# %%
def optimizer_steps(optimizer, pieces, layouts, comm: CheckpointGroups) -> dict:
    """{sharded key: step count} merged over all ranks (a piece's step is its param's)."""
    steps = {}
    for piece in pieces:
        step = main_state(optimizer, piece.main).get("step")
        if step is not None:
            key = layouts[piece.model_param].key
            steps[key] = max(steps.get(key, 0), int(step))
    merged = {}
    for part in comm.all_gather_object(steps):
        for k, v in part.items():
            merged[k] = max(merged.get(k, 0), v)
    return merged


# %% [markdown]
# ## Pieces in model space
#
# For every piece and quantity: cut the piece's flat range into rectangles of the local
# parameter (`flat_range_boxes`), map each rectangle to global coordinates with the
# parameter's `TensorLayout` (the TP offset, the layer axis, `linear_fc1`'s two halves), and
# emit a `ShardedTensor` whose data is the matching contiguous slice of the 1-D state tensor.
# Loading uses the same function with staging buffers in place of the state: each rank of the
# new layout asks for the rectangles of *its* pieces, and DCP reads them out of whatever
# rectangles the old layout wrote.

# %%
def _local_flat_start(offset, shape) -> int:
    """Flat index of `offset` in a row-major tensor of `shape`."""
    flat, stride = 0, 1
    for o, n in zip(reversed(offset), reversed(shape)):
        flat, stride = flat + o * stride, stride * n
    return flat


# %% [markdown]
# One piece of one quantity: each rectangle of its flat range, mapped through the layout, is a
# contiguous slice of the piece's 1-D tensor, viewed in the rectangle's shape.

# %%
def _piece_tensors(piece: OptimizerPiece, layout: TensorLayout, key: str, data: torch.Tensor,
                   is_main: bool) -> list[ShardedTensor]:
    """The model-space chunks of one piece's 1-D `data` for optimizer quantity `key`."""
    shape, out = tuple(piece.model_param.shape), []
    flat = data.reshape(-1)
    for lo, sz in flat_range_boxes(shape, piece.start, piece.end):
        for lo2, sz2, go in layout.boxes(lo, sz):
            local_sz = sz2[-len(shape):]
            begin = _local_flat_start(lo2, shape) - piece.start
            view = flat[begin:begin + math.prod(local_sz)].view(sz2)
            out.append(ShardedTensor(f"{OPTIMIZER_PREFIX}.{key}.{layout.key}", view,
                                     layout.global_shape, go, is_main=is_main))
    return out


# %% [markdown]
# Every piece and every quantity: the live state when saving (zeros for a parameter not yet
# stepped), the staging buffers when loading.

# %%
def optimizer_sharded_state_dict(optimizer, layouts: dict, grid, keys: list[str],
                                 staging: dict | None = None) -> list[ShardedTensor]:
    """ShardedTensors of every piece for `keys` (+ 'param' for separate masters); no communication.

    Saving passes the live state; loading passes `staging`, {(id(main), key): 1-D buffer}.
    """
    pieces, sharded = optimizer_pieces(optimizer)
    writer = sharded or grid.rank("dp_cp") == 0
    items = []
    for piece in pieces:
        layout = layouts[piece.model_param]
        state = main_state(optimizer, piece.main)
        names = [k for k in keys if k != "param"]
        if piece.main is not piece.model_param and "param" in keys:
            names.append("param")
        for k in names:
            if staging is not None:
                data = staging[(id(piece.main), k)]
            elif k == "param":
                data = piece.main.detach()
            else:
                data = state.get(k)
                data = torch.zeros_like(piece.main) if data is None else data.detach()
            items += _piece_tensors(piece, layout, k, data, writer and not layout.replica)
    return items


# %% [markdown]
# ## Reading it back
#
# On load every rank lists its pieces in *its* layout, allocates one staging buffer per piece
# and quantity found in the checkpoint, and passes them to `optimizer_sharded_state_dict` in
# place of the live state: the rectangles asked for are those of the new layout. `piece_states`
# turns the filled buffers into the state each main parameter gets. A master weight missing
# from the checkpoint (it was saved by an fp32 optimizer whose weights are their own masters)
# is taken from the loaded weights, as is every master when no optimizer state is loaded at
# all (Megatron's `reload_model_params`).

# %%
def checkpoint_quantities(directory) -> set[str]:
    """Optimizer quantities present in a torch_dist checkpoint (param, exp_avg, …)."""
    md = read_dcp_index(directory).state_dict_metadata
    prefix = OPTIMIZER_PREFIX + "."
    return {k[len(prefix):].split(".")[0] for k in md if k.startswith(prefix)}


def wanted_quantities(pc, quantities) -> list[str]:
    """The quantities to read for one piece (a model weight that is its own master: no 'param')."""
    return [q for q in quantities if not (q == "param" and pc.main is pc.model_param)]


def piece_states(pieces, quantities, staging, staged, layouts, steps) -> list:
    """(main, state) for every optimizer piece from the staging buffers."""
    out = []
    for pc in pieces:
        state = {"step": steps.get(layouts[pc.model_param].key, 0)}
        for q in wanted_quantities(pc, quantities):
            buf = staging[(id(pc.main), q)]
            state[q] = buf if q == "param" else buf.view(pc.main.shape)
        if "param" not in quantities and pc.main is not pc.model_param:
            state["param"] = staged[pc.model_param].reshape(-1)[pc.start:pc.end].float()
        out.append((pc.main, state))
    return out


def rederive_masters(optimizer) -> None:
    """Without optimizer state, the fp32 masters start from the loaded weights (Megatron's reload)."""
    for pc in optimizer_pieces(optimizer)[0]:
        if pc.main is not pc.model_param:
            pc.main.data.copy_(pc.model_param.detach().reshape(-1)[pc.start:pc.end]
                               .view(pc.main.shape).float())


# %% [markdown]
# ## Demo: TP 2 × DP 2 saved, TP 1 × DP 4 loaded
#
# Four ranks train the tiny GPT with the DistributedOptimizer at TP 2 × DP 2 for three steps
# and save. The same four ranks rebuild everything at TP 1 × DP 4, load, and save again at
# once. The two checkpoints, read back as plain full tensors, must be **bitwise** equal: the
# masters, both moments and the steps of every parameter (Megatron's
# `test_optimizer_resharding` makes the same check).
#
# The picture is drawn from the two real checkpoints: the `exp_avg` of `linear_qkv`,
# $[4, 96, 48]$, its four layers drawn one under the other (thick lines). Each rectangle is one
# chunk in `.metadata`, colored by the rank whose `__R_0.distcp` holds it. At TP 2 × DP 2 each
# layer is two TP halves of 48 rows; at TP 1 × DP 4 the DP ranges of the new buckets cut
# through layers and through rows (a partial row where one rank's range ends and the next
# begins). The bytes are the same; only the cuts moved.
#
# Everything the picture needs is in `.metadata`: `chunks_by_rank` lists a key's chunks with
# the file (hence the rank) holding each, and `plot_reshard` draws two such lists side by side.

# %%
def chunks_by_rank(directory, key: str) -> tuple[list, tuple]:
    """([(writer rank, (row, col), (rows, cols))], plane shape) of `key`'s chunks in .metadata.

    A stacked key [L, r, c] is drawn as one [L·r, c] plane, layer after layer.
    """
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(directory).read_metadata()
    shape = tuple(md.state_dict_metadata[key].size)
    sizes = {tuple(c.offsets): tuple(c.sizes) for c in md.state_dict_metadata[key].chunks}
    out = []
    for index, info in md.storage_data.items():
        if index.fqn != key:
            continue
        rank = int(info.relative_path.split("_")[2])   # __R_I.distcp
        offset, size = tuple(index.offset), sizes[tuple(index.offset)]
        if len(shape) == 3:
            offset, size = (offset[0] * shape[1] + offset[1], offset[2]), size[1:]
        out.append((rank, offset, size))
    plane = (shape[0] * shape[1], shape[2]) if len(shape) == 3 else shape
    return out, plane


# %% [markdown]
# `plot_reshard` draws two such lists on the same plane, one color per writing rank, and
# labels the rows that two ranks share.

# %%
def plot_reshard(before, after, shape, titles=("before", "after"), layers: int = 1):
    """Two panels of the same 2-D plane, rectangles colored by the writing rank."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    colors = plt.get_cmap("tab10")
    for ax, chunks, title in zip(axes, (before, after), titles):
        for rank, (r, c), (h, w) in chunks:
            ax.add_patch(plt.Rectangle((c, r), w, h, color=colors(rank), ec="black", lw=0.6,
                                       alpha=0.8))
        partial = [(rank, r, c, w) for rank, (r, c), (h, w) in chunks if h == 1 and w < shape[1]]
        for i, (rank, r, c, w) in enumerate(partial):   # rows cut between two ranks
            ax.annotate(f"row {r}: cols {c}-{c + w} on rank {rank}", xy=(c + w / 2, r),
                        xytext=(shape[1] * 0.06, r + shape[0] * (0.14 + 0.08 * i)), fontsize=7,
                        arrowprops=dict(arrowstyle="->", lw=0.8))
        for rank in sorted({c[0] for c in chunks}):
            ax.plot([], [], color=colors(rank), lw=6, label=f"rank {rank}")
        ax.set_xlim(0, shape[1])
        ax.set_ylim(shape[0], 0)
        for layer in range(1, layers):
            ax.axhline(layer * shape[0] // layers, color="black", lw=2)
        ax.set(title=title, xlabel="column", ylabel="row (layers stacked)")
        ax.legend(fontsize=7, loc="lower right")
    return fig


# %% [markdown]
# The run: save at TP 2 × DP 2 (directory `a`), rebuild at TP 1 × DP 4, load and save again
# (directory `b`), compare the two as full tensors, then draw `linear_qkv`'s `exp_avg` from
# both.

# %%
if __name__ == "__main__":
    import tempfile

    import matplotlib.pyplot as plt

    from tinytron.checkpoint import _workers
    from tinytron.launch import run_on_ranks

    print("flat range [6, 17) of a [5, 4] tensor:", flat_range_boxes((5, 4), 6, 17))
    with tempfile.TemporaryDirectory() as root:
        out = run_on_ranks(_workers.reshard_roundtrip, 4, root, (2, 1), (1, 1), timeout=300)[0]
        print(f"re-saved at TP1 x DP4 == saved at TP2 x DP2 (bitwise, {out['num_tensors']} "
              f"tensors incl. masters, moments, steps): {out['equal']}")
        key = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"
        before, shape = chunks_by_rank(f"{root}/a/iter_0000003", key)
        after, _ = chunks_by_rank(f"{root}/b/iter_0000003", key)
        print(f"{key} as a {shape} plane: {len(before)} chunks written at TP2 x DP2, "
              f"{len(after)} at TP1 x DP4")
        plot_reshard(before, after, shape, ("written at TP 2 x DP 2", "written at TP 1 x DP 4"),
                     layers=4)
        plt.tight_layout()
        plt.show()
    assert out["equal"] and out["num_tensors"] > 20
    assert sum(h * w for _, _, (h, w) in before) == sum(h * w for _, _, (h, w) in after) == math.prod(shape)

# %% [markdown]
# ## Summary
#
# - A DP rank's flat range of a parameter is at most $2(n-1)+1$ rectangles of it; written at
#   their global offsets under `optimizer.state.<quantity>.<model key>`, the DistributedOptimizer's
#   state needs no gather and reshards across TP, PP and DP like the weights.
# - One adapter covers the DistributedOptimizer, the layer-wise optimizer, the mixed-precision
#   optimizer and plain `torch.optim`; replicated copies (TP-replicated norms, the tied output
#   layer, DP replicas of an unsharded optimizer) are read but never written.
# - Re-saving right after a resharded load reproduces the original checkpoint bit for bit.
#   `tests/test_checkpoint_dist.py` proves it, with the next losses within $10^{-6}$ of
#   continuing on the old layout, for TP 2 ↔ 1, PP 2 ↔ 1, virtual stages (PP 2 × VPP 2 → PP 2
#   and → PP 1, PP 1 → PP 2 × VPP 2: a chunk's layers are stored under their global layer
#   numbers, so chunks are invisible in the file), context parallelism (CP 2 ↔ 1; state is
#   replicated over CP like DP, and the DistributedOptimizer shards over dp·cp, so
#   PP 2 × CP 2 → DP 4 takes it from 2 shards to 4) and the DP shard count alone (DP 1 → 4 → 1).
#
# ## How production does it
#
# - Megatron-Core: `megatron/core/optimizer/distrib_optimizer.py` (`sharded_state_dict:1404`,
#   `sharded_param_state_fully_reshardable:1634`, `sharded_param_state_dp_reshardable:1772`);
#   its older `fully_sharded_model_space` format used 1-D `flattened_range` views of the model
#   tensors for the same purpose (no longer supported at e03878b5f, `mapping.py:52`).
# - PyTorch FSDP2 shards parameters on dim 0 (`Shard(0)` DTensors), so each rank's optimizer
#   state is already one rectangle and DCP reshards it directly.
#
# ## Exercises
#
# 1. Prove the bound: how many rectangles can a flat range of a 3-D tensor need, and which
#    range attains it?
#
#    <details><summary>Answer</summary>
#
#    At most $2(n-1)+1 = 5$ for $n = 3$: a partial row and a
#    partial plane on the way up to a plane boundary, whole planes, then a partial plane and a
#    partial row on the way down. On a $[3, 3, 3]$ tensor, `flat_range_boxes((3, 3, 3), 1, 22)`
#    returns five: sizes $(1,1,2)$, $(1,2,3)$, $(1,3,3)$, $(1,1,3)$, $(1,1,1)$.
#
#    </details>
#
# 2. Megatron's `dp_reshardable` keys embed the bucket index. Construct a DP change that moves a
#    bucket boundary (hint: the default bucket size depends on DP above 40 ranks).
#
#    <details><summary>Hint</summary>
#
#    In Megatron the default bucket holds $\max(40\text{M}, 1\text{M} \cdot dp)$
#    elements (see the DDP config on chapter 05's pages). Take a model of a few hundred million
#    parameters and compare the bucket boundaries at DP 32 and DP 64.
#
#    </details>

