# %% [markdown]
# # 03 · Checkpoint: sharded keys, one global tensor per name
#
# The `torch_dist` format stores every tensor under a layout-free key with its **global** shape;
# each rank writes only the chunk it owns, at its global offset, and a reader on any layout asks
# for the chunks it needs. This page gives every parameter of `tinytron.model.GPTModel` the key
# and the layout Megatron-Core gives it, so that a model checkpoint written by Megatron-Core
# loads into tinytron and the reverse; the next page writes and reads them with
# `torch.distributed.checkpoint`.
#
# You will build: `ShardedTensor`, `ShardedObject`, `sharded_key`, `TensorLayout`,
# `param_layouts`, `model_sharded_state_dict`, `extra_state_objects`, `plot_key_layout`.

# %%
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from tinytron.checkpoint.formats import unwrap_chunks
from tinytron.model.gpt import global_parameter_name

__all__ = ["ShardedTensor", "ShardedObject", "sharded_key", "TensorLayout", "param_layouts",
           "model_sharded_state_dict", "extra_state_objects", "plot_key_layout"]

# %% [markdown]
# ## Keys that do not depend on the layout
#
# Megatron-Core names each tensor by what it is, not by who holds it
# (`megatron/core/dist_checkpointing/mapping.py:52`, `ShardedTensor`):
#
# - **TP** cuts a tensor along one axis; the key is the same on every TP rank and the chunk
#   sits at offset `tp_rank · local_size` of that axis (`make_tp_sharded_tensor_for_checkpoint`,
#   `megatron/core/utils.py:910`). Tensors every TP rank holds whole (the norms) are written
#   by TP rank 0 only.
# - **PP**: the layers of a homogeneous stack are stacked on a new leading axis of size $L$:
#   `decoder.layers.self_attention.linear_qkv.weight` has shape $[L, (a + 2g)d, h]$ and layer
#   $i$ is the slice at offset $i$ of that axis, whichever stage holds it
#   (`transformer_block.py:760-780`). A checkpoint written with PP 4 loads with PP 2.
# - **DP** ranks hold replicas, and one copy is written (`replica_id`): here DP rank 0's is
#   marked main, as in Megatron-Core's `dist_checkpointing.save`; a training save then
#   spreads the chunks over the DP ranks (Megatron's default fully parallel save,
#   [torch_dist](torch_dist.py)).
#
# The names follow Megatron's checkpoints, which are those of its Transformer Engine layers:
# the input norm is stored as `…self_attention.linear_qkv.layer_norm_weight` and the pre-MLP
# norm as `…mlp.linear_fc1.layer_norm_weight` (the local spec maps its separate norm modules to
# these names, `gpt_layer_specs.py`, `sharded_state_dict_keys_map`). `linear_fc1` holds gate and
# up stacked, and each TP rank holds its slice of *both*: its chunk is two pieces, at offsets
# $r f/t$ and $f + r f/t$ (Megatron's `apply_swiglu_sharded_factory`, `mlp.py`). The QKV rows
# are grouped per KV group ([B.3](../model/transformer_layer.py)), which is Megatron's order, so a TP rank's rows are one
# contiguous chunk.
#
# With tied embeddings and PP > 1 the last stage's output layer is a replica of
# `embedding.word_embeddings.weight` (`language_module.py`, `tie_embeddings_and_output_weights_state_dict`):
# it is read from that key and never written. Megatron also stores an `_extra_state` object
# per linear layer and layer — the slot in which Transformer Engine layers keep their FP8
# metadata, `None` for the local layers — as `decoder.layers.mlp.linear_fc1._extra_state/shard_3_4`
# (layer 3 of 4); tinytron writes the same `None` objects so that Megatron's default loader
# finds every key it asks for.
#
# | tinytron parameter (global name) | sharded key | global shape | TP axis |
# |---|---|---|---|
# | `embedding.word_embeddings.weight` | same | $[V, h]$ | 0 |
# | `decoder.layers.{i}.input_layernorm.weight` | `decoder.layers.self_attention.linear_qkv.layer_norm_weight` | $[L, h]$ | – |
# | `decoder.layers.{i}.self_attention.linear_qkv.weight` | `decoder.layers.self_attention.linear_qkv.weight` | $[L, (a+2g)d, h]$ | 1 |
# | `decoder.layers.{i}.self_attention.linear_proj.weight` | `decoder.layers.self_attention.linear_proj.weight` | $[L, h, ad]$ | 2 |
# | `decoder.layers.{i}.pre_mlp_layernorm.weight` | `decoder.layers.mlp.linear_fc1.layer_norm_weight` | $[L, h]$ | – |
# | `decoder.layers.{i}.mlp.linear_fc1.weight` | `decoder.layers.mlp.linear_fc1.weight` | $[L, 2f, h]$ | 1 (two pieces) |
# | `decoder.layers.{i}.mlp.linear_fc2.weight` | `decoder.layers.mlp.linear_fc2.weight` | $[L, h, f]$ | 2 |
# | `decoder.final_layernorm.weight` | same | $[h]$ | – |
# | `output_layer.weight` (untied) | same | $[V, h]$ | 0 |

# %%
@dataclass
class ShardedTensor:
    """One chunk of a global tensor: local data at `global_offset` of `global_shape`."""

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    is_main: bool = True
    """Only main replicas are written; every replica is read."""


# %% [markdown]
# Small objects that are not tensors (the RNG states, Megatron's `_extra_state`) are stored
# once per offset of a small grid, under a key that spells out the offset and the shape.

# %%
@dataclass
class ShardedObject:
    """A picklable object stored once per offset of a small grid (e.g. RNG per (pp, tp))."""

    key: str
    data: Any
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    is_main: bool = True

    @property
    def unique_key(self) -> str:
        """Megatron's `{key}/shard_{offsets}_{shape}` (`mapping.py:397`)."""
        return (f"{self.key}/shard_{'.'.join(map(str, self.global_offset))}_"
                f"{'.'.join(map(str, self.global_shape))}")


# %% [markdown]
# The key of a parameter: layer parameters lose their layer index (it becomes the offset on the
# stacked layer axis), and the two layer norms take the names of the TE layers that hold them
# in Megatron.

# %%
_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
            "mlp.linear_fc2")


def sharded_key(global_name: str) -> tuple[str, int | None]:
    """(sharded key, layer index or None) for a tinytron global parameter name."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", global_name)
    if m is None:
        return global_name, None
    return f"decoder.layers.{_RENAMES.get(m.group(2), m.group(2))}", int(m.group(1))


# %% [markdown]
# ## From a local box to global boxes
#
# A `TensorLayout` knows where a rank's local tensor sits in the global one: the layer offset,
# the TP axis and this rank's offset on it, and — for `linear_fc1` — the two pieces. Its
# `boxes(offset, size)` maps any rectangular part of the local tensor (given by offset and
# size in local coordinates) to rectangles in global coordinates. The model's own chunks are
# the whole local tensor; the next page feeds it the pieces of the DistributedOptimizer.
#
# Worked example, `linear_fc1` of layer 3 with $f = 128$, $h = 64$, $t = 2$, TP rank 1: the
# local tensor is $[128, 64]$ (64 gate rows, 64 up rows); `boxes((0, 0), (128, 64))` gives
# `(0, 0), (64, 64)` → global `(3, 64, 0)` and `(64, 0), (64, 64)` → global `(3, 192, 0)`,
# both of global shape $[L, 256, 64]$.
#
# The part that needs care is the TP axis: a local box is cut where the local tensor passes
# from one piece (gate, up) to the next, and each part is moved to where this TP rank's rows of
# that piece sit in the global tensor.

# %%
def _tp_parts(layout: TensorLayout, offset: tuple, size: tuple) -> list[tuple]:
    """[(local_offset, size, global_offset)] of a local box, cut at the pieces of the TP axis."""
    d, c = layout.dim, layout.chunks
    block = layout.full_shape[d] // (layout.tp * c)   # local rows of one piece
    start, end, parts = offset[d], offset[d] + size[d], []
    while start < end:
        k = start // block
        stop = min(end, (k + 1) * block)
        g = k * (layout.full_shape[d] // c) + layout.tp_rank * block + (start - k * block)
        lo = offset[:d] + (start,) + offset[d + 1:]
        sz = size[:d] + (stop - start,) + size[d + 1:]
        go = offset[:d] + (g,) + offset[d + 1:]
        parts.append((lo, sz, go))
        start = stop
    return parts


# %% [markdown]
# The layout itself: what it knows about one parameter, and `boxes`, which adds the layer axis
# to the parts.

# %%
@dataclass
class TensorLayout:
    """How one rank's local tensor maps into its global tensor."""

    key: str
    global_shape: tuple[int, ...]  # with the layer axis first when layer is not None
    layer: int | None
    full_shape: tuple[int, ...]    # the unstacked global shape (ShardSpec.full_shape)
    dim: int | None                # TP axis of the unstacked tensor
    chunks: int
    tp_rank: int
    tp: int
    replica: bool                  # True on copies that are never written (TP > 0, tied copy)

    def boxes(self, offset, size) -> list[tuple[tuple, tuple, tuple]]:
        """[(local_offset, size, global_offset)] covering the local box exactly."""
        offset, size = tuple(offset), tuple(size)
        if self.dim is None or self.tp == 1:
            parts = [(offset, size, offset)]
        else:
            parts = _tp_parts(self, offset, size)
        if self.layer is not None:
            parts = [(lo, (1,) + sz, (self.layer,) + go) for lo, sz, go in parts]
        return parts


# %% [markdown]
# `param_layouts` builds one `TensorLayout` per parameter of this rank's chunks from what the
# model already knows: the global name gives the key and the layer, the `ShardSpec` the TP
# axis and the pieces, the grid the TP rank. A copy that is never written (a TP rank > 0
# holding a replicated norm weight, or the tied output layer) is marked `replica`.
# `model_sharded_state_dict` then turns each parameter into `ShardedTensor`s, one view of the
# local tensor per box, with the layer axis added; only DP rank 0's non-replicas are main, so
# every global element is written exactly once (the fully parallel save then moves the main
# mark of replicated chunks to other DP ranks, still once per element). `extra_state_objects` adds Megatron's empty
# `_extra_state` of each linear layer.

# %%
def param_layouts(model, grid) -> dict:
    """{param: TensorLayout} for every parameter of this rank's model chunks."""
    out = {}
    for chunk in unwrap_chunks(model):
        config = chunk.config
        for name, p in chunk.named_parameters():
            full = global_parameter_name(name, chunk.layer_offset)
            tied_copy = full == "output_layer.weight" and config.tie_embeddings
            key, layer = sharded_key("embedding.word_embeddings.weight" if tied_copy else full)
            spec = p.shard_spec
            gshape = tuple(spec.full_shape)
            if layer is not None:
                gshape = (config.num_layers,) + gshape
            tp_rank = grid.rank("tp")
            out[p] = TensorLayout(key, gshape, layer, tuple(spec.full_shape), spec.dim,
                                  spec.chunks, tp_rank, grid.size("tp"),
                                  replica=tied_copy or (spec.dim is None and tp_rank > 0))
    return out


# %% [markdown]
# Each layout then cuts the parameter (or any tensor of the same shape, such as an Adam moment)
# into `ShardedTensor` views, one per box, marked main on DP rank 0 unless the copy is a replica.

# %%
def model_sharded_state_dict(model, grid, tensors=None) -> list[ShardedTensor]:
    """The model's chunks as ShardedTensors (views of `tensors[p]`, default the params)."""
    dp_main = grid.rank("dp_cp") == 0
    items = []
    for p, layout in param_layouts(model, grid).items():
        data = p.detach() if tensors is None else tensors[p]
        for lo, sz, go in layout.boxes((0,) * data.dim(), tuple(data.shape)):
            view = data[tuple(slice(o, o + s) for o, s in zip(lo, sz[-data.dim():]))]
            if len(sz) > data.dim():
                view = view.unsqueeze(0)   # the stacked layer axis
            items.append(ShardedTensor(layout.key, view, layout.global_shape, go,
                                       is_main=dp_main and not layout.replica))
    return items


# %% [markdown]
# And Megatron's `_extra_state` entries, one `None` per linear layer and layer, written by
# DP rank 0 of TP rank 0.

# %%
def extra_state_objects(model, grid) -> list[ShardedObject]:
    """Megatron's empty `_extra_state` object of each linear layer, one per layer."""
    main = grid.rank("dp_cp") == 0 and grid.rank("tp") == 0
    items = []
    for chunk in unwrap_chunks(model):
        num_layers = chunk.config.num_layers
        for i in range(len(chunk.decoder.layers)):
            layer = chunk.layer_offset + i
            items += [ShardedObject(f"decoder.layers.{m}._extra_state", None, (num_layers,),
                                    (layer,), is_main=main) for m in _LINEARS]
    return items


# %% [markdown]
# The demo's picture calls the same `TensorLayout.boxes` for every (PP, TP) rank of a layout,
# without any process group: a layout can be drawn for a cluster one does not have.

# %% tags=["hide-input"]
def plot_key_layout(config, tp: int, pp: int, name: str = "mlp.linear_fc1.weight", ax=None):
    """Draw the global [L, rows] plane of one stacked key, colored by the (pp, tp) rank writing it."""
    import matplotlib.pyplot as plt

    from tinytron.model.config import stage_layer_ranges
    from tinytron.model.gpt import TransformerLayer
    from tinytron.parallel import ParallelGrid

    layer = TransformerLayer(config, ParallelGrid.single(), 0)
    spec = dict(layer.named_parameters())[name].shard_spec
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.6))
    colors = plt.get_cmap("tab10")
    for pp_rank in range(pp):
        (start, end), = stage_layer_ranges(config.num_layers, pp, 1, pp_rank)
        for tp_rank in range(tp):
            local = list(spec.full_shape)
            if spec.dim is not None:
                local[spec.dim] //= tp
            for i in range(start, end):
                lay = TensorLayout("k", (config.num_layers,) + tuple(spec.full_shape), i,
                                   tuple(spec.full_shape), spec.dim, spec.chunks, tp_rank, tp, False)
                for _, sz, go in lay.boxes((0,) * len(local), tuple(local)):
                    ax.add_patch(plt.Rectangle((go[1], go[0]), sz[1], 1, lw=0.8, ec="black",
                                               color=colors(pp_rank * tp + tp_rank), alpha=0.85))
            ax.plot([], [], color=colors(pp_rank * tp + tp_rank), lw=6,
                    label=f"pp {pp_rank}, tp {tp_rank}")
    ax.set_xlim(0, spec.full_shape[0])
    ax.set_ylim(config.num_layers, 0)
    ax.set(xlabel=f"row of {name} (gate rows, then up rows)", ylabel="layer (stacked axis)",
           title=f"{name}: chunks at TP {tp} x PP {pp}")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    return ax



# %% [markdown]
# ## Demo: the keys of the tiny model, and one key's chunks at TP 2 × PP 2
#
# The table printed below comes from `param_layouts` of the tiny model built at TP 1. The
# picture shows where the chunks of `decoder.layers.mlp.linear_fc1.weight` of a 4-layer model
# land for TP 2 × PP 2, computed with the same `TensorLayout.boxes` a save uses: rows are the
# stacked layer axis, the four colors the four (PP, TP) ranks, and each TP rank's two pieces
# are its gate rows and its up rows.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.model import GPTModel, tiny_config
    from tinytron.parallel import ParallelGrid

    model = GPTModel(tiny_config(tie_embeddings=False))
    grid = ParallelGrid.single()
    layouts = param_layouts(model, grid)
    seen = {}
    for name, p in model.named_parameters():
        lay = layouts[p]
        seen.setdefault(lay.key, (name, lay.global_shape))
    for key, (name, shape) in seen.items():
        print(f"{name:<48} -> {key:<55} {shape}")
    chunks = model_sharded_state_dict(model, grid)
    print(f"{len(chunks)} chunks, {len(extra_state_objects(model, grid))} _extra_state objects")
    plot_key_layout(tiny_config(num_layers=4), tp=2, pp=2)
    plt.tight_layout()
    plt.show()
    lay = TensorLayout("k", (4, 256, 64), 3, (256, 64), 0, 2, 1, 2, False)
    assert lay.boxes((0, 0), (128, 64)) == [((0, 0), (1, 64, 64), (3, 64, 0)),
                                            ((64, 0), (1, 64, 64), (3, 192, 0))]
    assert seen["decoder.layers.mlp.linear_fc1.layer_norm_weight"][1] == (2, 64)
    assert len(seen) == 9 and all(c.is_main for c in chunks)

# %% [markdown]
# ## Summary
#
# - A key names what a tensor is; its global shape stacks the layers on a leading axis; a rank's
#   chunk sits at its TP offset and layer offset, so the same key and shape serve every layout.
# - `TensorLayout.boxes` maps any rectangle of a local tensor to global rectangles; the model's
#   chunks are whole local tensors, the optimizer's ([resharding](resharding.py)) are pieces of them.
# - Replicas (TP-replicated norms, the tied output layer, DP copies) are marked, read, never written.
#
# ## How production does it
#
# - Megatron-Core: `megatron/core/dist_checkpointing/mapping.py` (`ShardedTensor:52`,
#   `from_rank_offsets:190`, `ShardedObject:360`), `megatron/core/utils.py:910`
#   (`make_tp_sharded_tensor_for_checkpoint`), `transformer_block.py:760-780` (the stacked layer
#   axis), `mlp.py` (`apply_swiglu_sharded_factory`), `models/common/language_module/language_module.py`
#   (the tied output layer).
# - PyTorch DTensor expresses the same information as a device mesh plus placements; torchtitan
#   saves DTensors and lets DCP compute the chunks.
#
# ## Exercises
#
# 1. Which key would a Mixture-of-Experts layer need for its expert weights so that the expert
#    parallel size can change between save and load?
#
#    <details><summary>Hint</summary>
#
#    Follow what `sharded_key` and `TensorLayout` do with the layer
#    index: it leaves the key and becomes an offset on a stacked axis. Ask what plays that part for
#    an expert when each EP rank holds a different subset of the experts, and look at how
#    Megatron's MoE layers build their sharded state dict in `megatron/core/transformer/moe/`.
#
#    </details>
#
# 2. Why can `linear_fc1`'s TP chunk not be stored as one contiguous chunk of $[2f, h]$?
#
#    <details><summary>Answer</summary>
#
#    The global rows are all gate rows, then all up rows. TP rank
#    $r$ of $t$ holds gate rows $[rf/t, (r+1)f/t)$ and up rows $[f + rf/t, f + (r+1)f/t)$. In the
#    worked example ($f = 128$, $t = 2$, rank 1) that is rows 64–128 and 192–256: two boxes with
#    rows of rank 0 between them, which is why `boxes` returns two.
#
#    </details>

