# %% [markdown]
# # 03 · Checkpoint: the legacy `torch` format
#
# Megatron's original format: one `torch.save` file per (TP, PP) position, written by that
# position's DP rank 0, with the DistributedOptimizer's state gathered over DP into a second
# file. Simple to read with `torch.load`, and tied to the layout it was written with.
#
# You will build: `save_legacy`, `read_legacy`, `distributed_optimizer_world_tensors`.

# %%
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tinytron.checkpoint._common import CheckpointGroups, LoadedState, main_state, save_file
from tinytron.checkpoint.formats import (LEGACY_MODEL_FILENAME, LEGACY_OPTIM_FILENAME, fault_point,
                                         legacy_rank_dir)

__all__ = ["save_legacy", "read_legacy", "distributed_optimizer_world_tensors",
           "CHECKPOINT_VERSION"]

CHECKPOINT_VERSION = 3.0
"""Megatron's `checkpoint_version` (`megatron/training/checkpointing.py:993`)."""

# %% [markdown]
# ## What `model_optim_rng.pt` holds
#
# Megatron's `generate_state_dict` (`checkpointing.py:993`) builds one dict per (TP, PP)
# position; DP rank 0 of the position saves it:
#
# | key | value |
# |---|---|
# | `args` | the run's arguments (here: the model config, the layout, the consumed samples) |
# | `checkpoint_version` | 3.0 |
# | `iteration` | the iteration just finished |
# | `model`, or `model0`, `model1`, … with virtual stages | this position's `state_dict()`: local names, TP shards |
# | `optimizer` | for the DistributedOptimizer Megatron's structure (`distrib_optimizer.py:779-838`): `{"optimizer": {"param_groups": [...]}, "grad_scaler": ...}`, each group's hyperparameters with the one `step`, plus tinytron's `steps`, each parameter's step count by name; other optimizers: chapter 02's `state_dict()` |
# | `opt_param_scheduler` | the scheduler's ten values |
# | `rng_state` | a list with the RNG states: DP rank 0's alone, or one per DP rank with `data_parallel_random_init` |
# | `num_floating_point_operations_so_far` | for MFU logging after a resume |
#
# Everything here is plain Python, lists and tensors, so `torch.load(..., weights_only=True)`
# reads it without unpickling arbitrary objects.
#
# <details><summary>Megatron detail: the optimizer entry for the other optimizers</summary>
#
# For the optimizers other than the DistributedOptimizer the entry is chapter 02's own
# `state_dict()`, not the one of Megatron's `Float16OptimizerWithFloat16Params` (`optimizer`,
# `grad_scaler`, `fp32_from_fp16_params`): tinytron's mixed-precision optimizer keeps its
# state in its own layout. `distrib_optim.pt` below is Megatron's structure.
#
# </details>
#
# <details><summary>Megatron detail: its safe globals</summary>
#
# Megatron reads with `weights_only=True` too (PyTorch's default since 2.6,
# `checkpointing.py:1381`), but its `args` is an `argparse.Namespace`, so it registers that and
# a few of its own classes as safe globals when `megatron.core` is imported
# (`megatron/core/safe_globals.py:26-52`,
# `megatron/core/__init__.py:54`); tinytron stores `args` as a dict and needs no allow-list.
#
# </details>
#
# ## `distrib_optim.pt`: the optimizer state, gathered over DP
#
# With the DistributedOptimizer DP rank $r$ holds master weights and moments only for range
# $[rS, (r+1)S)$ of every bucket (chapter 02). For the legacy file Megatron's
# `get_parameter_state_dp_zero` (`distrib_optimizer.py:1206`) fills, on every DP rank, one
# vector of the bucket's shard size per quantity, gathers the $dp$ vectors on DP rank 0 (over
# a gloo group), strips the padding at the end of each bucket and concatenates the buckets of
# a buffer into one **world tensor** per quantity:
#
# `{buffer_index: {(param_dtype, grad_dtype): {"param": …, "exp_avg": …, "exp_avg_sq": …,
# "numel_unpadded": n}}, "buckets_coalesced": True}` (`distrib_optimizer.py:1249-1353`).
#
# <details><summary>Megatron detail: one more key per world tensor</summary>
#
# tinytron adds one key to each entry, `bucket_numel_unpadded`, the unpadded size of every
# bucket, so that a load with another bucket size is refused by name instead of cutting the
# world tensor in the wrong places.
#
# </details>
#
# Worked example (chapter 05's buffer): params `c[30]` at 0, `b[100]` at 64, bucket of 164
# elements padded to 256 for $dp = 2$. Rank 0 owns `[0, 128)`, rank 1 `[128, 256)`; the gather
# gives the 256 elements and the world tensor keeps the first 164. Loading at $dp = 4$ pads
# the 164 to 256 again (`lcm(4, 128)` divides it) and hands each rank 64 elements. The padding
# *between* params (`c` ends at 30, `b` starts at 64) does not depend on $dp$; bucket
# boundaries do not either as long as the bucket size is fixed — which is why DP may change
# but TP and PP may not: they change the params themselves. A legacy checkpoint refuses
# another TP or PP size, as Megatron's `check_checkpoint_args` does (`checkpointing.py:137`).
#
# The worked example, for one quantity (the same happens to `param`, `exp_avg` and `exp_avg_sq`):
#
# ```mermaid
# flowchart TB
#   subgraph SAVE["save at dp = 2"]
#     R0["DP rank 0 shard<br/>elements 0..128"] --> G["gather on DP rank 0<br/>256 elements"]
#     R1["DP rank 1 shard<br/>elements 128..256"] --> G
#     G -->|"strip the end padding"| W["world tensor, 164 elements<br/>c 0..30, gap 30..64, b 64..164"]
#   end
#   W -->|"distrib_optim.pt"| L["DP rank 0 reads<br/>164 elements"]
#   subgraph LOAD["load at dp = 4"]
#     L -->|"pad to 256 again"| P["256 elements"]
#     P -->|"scatter"| Q["4 shards of 64<br/>0..64, 64..128, 128..192, 192..256"]
#   end
# ```
#
# Three pieces make one gather: the list of quantities (agreed over DP, since a rank that owns
# no element of any parameter's state still has to join every gather), one rank's shard vector
# of a bucket for one quantity, and the gather itself.

# %%
def _opt_keys(optimizer, comm: CheckpointGroups) -> list[str]:
    """'param' plus the tensor state keys, agreed by all DP ranks (a rank may own nothing)."""
    local = sorted({k for _, m in optimizer.pairs for k, v in main_state(optimizer, m).items()
                    if torch.is_tensor(v) and v.numel() == m.numel()})
    keys = set().union(*comm.all_gather_object(local, group="dp"))
    return ["param"] + sorted(keys)


def _shard_vector(optimizer, bucket, key: str) -> torch.Tensor:
    """This rank's shard of one bucket for one quantity (zeros where it owns padding)."""
    out = torch.zeros(bucket.shard_size, dtype=torch.float32)
    for (model, main), (piece, _) in zip(optimizer.pairs, optimizer.pieces):
        if piece.param not in bucket.param_to_index:
            continue
        src = main if key == "param" else main_state(optimizer, main).get(key)
        if src is not None:
            out[piece.shard_start:piece.shard_end] = src.detach().reshape(-1).float().cpu()
    return out


def _gather_to_dp0(vector: torch.Tensor, comm: CheckpointGroups, dp: int):
    """The dp shard vectors on DP rank 0 (None elsewhere)."""
    if dp == 1:
        return [vector]
    dst = dist.get_global_rank(comm.dp, 0)
    parts = [torch.empty_like(vector) for _ in range(dp)] if comm.grid.rank("dp_cp") == 0 else None
    dist.gather(vector, parts, dst=dst, group=comm.dp)
    return parts


# %% [markdown]
# `distributed_optimizer_world_tensors` runs that gather once per bucket and quantity, in
# buffer order, so DP rank 0 holds one bucket's $dp$ vectors at a time on top of the world
# tensors it builds. What is not a per-element tensor goes to `model_optim_rng.pt` instead
# (`_distopt_common`): the param groups' hyperparameters, the loss scaler, and each
# parameter's step count, gathered because each DP rank only knows the steps of the pieces
# it owns.

# %%
def distributed_optimizer_world_tensors(optimizer, comm: CheckpointGroups) -> dict | None:
    """Megatron's distrib_optim.pt dict on DP rank 0 (None elsewhere); every DP rank calls."""
    dp, keys = comm.grid.size("dp_cp"), _opt_keys(optimizer, comm)
    out: dict = {"buckets_coalesced": True}
    for gbuf_idx, buf in enumerate(optimizer.buffers):
        worlds = {k: [] for k in keys}
        for bucket in buf.buckets:
            for k in keys:
                parts = _gather_to_dp0(_shard_vector(optimizer, bucket, k), comm, dp)
                if parts is not None:
                    worlds[k].append(torch.cat(parts)[:bucket.numel_unpadded])
        entry = {k: torch.cat(v) for k, v in worlds.items() if v}
        entry["numel_unpadded"] = sum(b.numel_unpadded for b in buf.buckets)
        entry["bucket_numel_unpadded"] = [b.numel_unpadded for b in buf.buckets]
        out[gbuf_idx] = {(buf.param_dtype, buf.grad_dtype): entry}
    return out if comm.grid.rank("dp_cp") == 0 else None


# %% [markdown]
# The rest of the optimizer goes into `model_optim_rng.pt`: the hyperparameters in Megatron's
# nesting, the scaler, and the step counts merged over DP, with Megatron's single `step` being
# the largest.

# %%
def _distopt_common(optimizer, comm: CheckpointGroups) -> dict:
    """Megatron's entry ({'optimizer': {'param_groups'}, 'grad_scaler'}) and each param's step."""
    from tinytron.optimizer.mixed_precision import _group_hparams

    steps = {}
    for (model, main), name in zip(optimizer.pairs, optimizer.names):
        step = main_state(optimizer, main).get("step")
        if step is not None:
            steps[name] = int(step)
    merged = {}
    for part in comm.all_gather_object(steps, group="dp"):
        merged.update(part)
    step = max(merged.values(), default=0)   # Megatron's one step, in every group
    groups = [dict(g, step=step) for g in _group_hparams(optimizer.param_groups,
                                                           optimizer.group_names)]
    return {"optimizer": {"param_groups": groups},
            "grad_scaler": None if optimizer.grad_scaler is None
            else optimizer.grad_scaler.state_dict(),
            "steps": merged}


# %% [markdown]
# A reader for that entry, which accepts Megatron's nesting and the flat form of chapter 02.

# %%
def legacy_param_groups(entry: dict) -> list | None:
    """The param groups of a legacy `optimizer` entry (Megatron's nesting, or the flat one)."""
    return entry.get("optimizer", {}).get("param_groups", entry.get("param_groups"))


# %% [markdown]
# ## Saving
#
# `save_legacy` is called on every rank (the DP gather needs everyone) and writes into the
# staging directory of the previous page; the caller commits once every rank has reported.
# A failing write (full disk, a file-size limit) is caught and returned as a message naming
# the file, so that all ranks can agree that the save failed instead of leaving a rank blocked
# in the next collective. For one (TP, PP) position of the running example, in order:
#
# ```mermaid
# sequenceDiagram
#   participant D as DP ranks 1..63
#   participant Z as DP rank 0
#   participant FS as iter_0001000.tmp/
#   Note over D,Z: all_gather_object over DP:<br/>RNG states, step counts,<br/>state keys
#   loop every bucket, every quantity
#     D->>Z: gather the fp32 shard vectors
#   end
#   Note over D: done, nothing to write
#   Z->>FS: mkdir mp_rank_TT_PPP/
#   Z->>FS: model_optim_rng.pt:<br/>args, model, optimizer<br/>hyperparameters, rng_state
#   Z->>FS: distrib_optim.pt:<br/>the world tensors
#   Note over D,Z: every rank of the world: first_error<br/>then global rank 0 commits
# ```

# %%
def save_legacy(staging: Path, grid, chunks, optimizer, common: dict, rng_states,
                comm: CheckpointGroups) -> str | None:
    """Write this position's model_optim_rng.pt (+ distrib_optim.pt) if DP rank 0; error or None."""
    distopt = type(optimizer).__name__ == "DistributedOptimizer"
    if optimizer is None:
        opt_common, world = None, None
    elif distopt:
        opt_common = _distopt_common(optimizer, comm)
        world = distributed_optimizer_world_tensors(optimizer, comm)
    else:
        opt_common, world = optimizer.state_dict(), None   # collective for layer-wise: all call
    if grid.rank("dp_cp") != 0:
        return None
    rank_dir = Path(staging) / legacy_rank_dir(grid.rank("tp"), grid.rank("pp"), grid.size("pp"))
    rank_dir.mkdir(exist_ok=True)
    sd = dict(common)
    sd["checkpoint_version"] = CHECKPOINT_VERSION
    for i, chunk in enumerate(chunks):
        sd["model" if len(chunks) == 1 else f"model{i}"] = chunk.state_dict()
    if opt_common is not None:
        sd["optimizer"] = opt_common
    sd["rng_state"] = rng_states
    error = save_file(sd, rank_dir / LEGACY_MODEL_FILENAME)
    fault_point("mid_write", grid.global_rank)
    if error is None and world is not None:
        error = save_file(world, rank_dir / LEGACY_OPTIM_FILENAME)
    return error


# %% [markdown]
# ## Loading
#
# Every DP rank of a position reads the same `model_optim_rng.pt` (as in Megatron). Before
# anything is copied the reader checks: the file exists for this position (if not, the
# directory tells which layout wrote it), the saved TP and PP sizes equal this run's, every
# key and shape of the model's state dict matches. The DistributedOptimizer's world tensors
# are read by DP rank 0 only and scattered, bucket by bucket, in this run's DP layout.
# The result is a `LoadedState`; nothing touches the model until all of it has been read.

# %%
def _load_file(path: Path) -> dict:
    """torch.load(weights_only=True), or ValueError naming the file."""
    if not path.is_file():
        raise ValueError(f"{path}: missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise ValueError(f"{path}: cannot be read ({type(e).__name__}: {e})") from e


# %% [markdown]
# The legacy format stores whole TP and PP shards, so a run with other TP or PP sizes is
# refused with both sizes named.

# %%
def _check_layout(sd: dict, grid, path: Path) -> None:
    """The legacy format cannot reshard TP or PP: refuse with both sizes named."""
    args = sd.get("args", {})
    for key, axis in (("tensor_model_parallel_size", "tp"), ("pipeline_model_parallel_size", "pp")):
        saved = args.get(key)
        if saved is not None and saved != grid.size(axis):
            raise ValueError(
                f"{path}: written with {key}={saved}, this run has {grid.size(axis)}; the legacy "
                "'torch' format cannot reshard TP or PP (save with ckpt_format='torch_dist', or "
                "convert with tinytron-convert)")


# %% [markdown]
# Then the model: every chunk's keys and shapes are checked against the file, and the pairs to
# copy are collected, still without touching the model.

# %%
def _model_pairs(sd: dict, chunks, path: Path) -> list:
    """(param or buffer, saved tensor) for every entry of every chunk, keys and shapes checked."""
    pairs = []
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        saved, mine = sd.get(key), chunk.state_dict(keep_vars=True)
        if saved is None:
            raise ValueError(f"{path}: has no {key!r} entry (virtual stages differ?)")
        missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
        if missing or extra:
            raise ValueError(f"{path}: {key} keys differ: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, dst in mine.items():
            if tuple(saved[name].shape) != tuple(dst.shape):
                raise ValueError(f"{path}: {key}.{name} has shape {tuple(saved[name].shape)}, "
                                 f"the model has {tuple(dst.shape)}")
            pairs.append((dst.data if hasattr(dst, "data") else dst, saved[name]))
    return pairs


# %% [markdown]
# The optimizer file goes the way of the save backwards. DP rank 0 reads `distrib_optim.pt`
# and checks its bucket sizes against this run's; the verdict goes to every DP rank, so that
# all of them raise the same error rather than ranks 1.. waiting in a scatter that never
# comes. `_scatter_bucket` re-pads one bucket's unpadded slice to this run's padded size and
# hands each DP rank its shard.

# %%
def _scatter_bucket(world: torch.Tensor | None, bucket, comm, dp: int) -> torch.Tensor:
    """This rank's shard of one bucket from DP rank 0's unpadded world slice."""
    out = torch.empty(bucket.shard_size, dtype=torch.float32)
    parts = None
    if comm.grid.rank("dp_cp") == 0:
        full = torch.zeros(bucket.numel, dtype=torch.float32)
        full[:bucket.numel_unpadded] = world
        parts = list(full.chunk(dp))
        if dp == 1:
            return parts[0]
    dist.scatter(out, parts, src=dist.get_global_rank(comm.dp, 0), group=comm.dp)
    return out


def _read_world(directory: Path, optimizer, comm) -> tuple:
    """DP rank 0 reads distrib_optim.pt and checks the buckets; every DP rank learns the verdict."""
    world, verdict = None, None
    if comm.grid.rank("dp_cp") == 0:
        path = directory / LEGACY_OPTIM_FILENAME
        try:
            world = _load_file(path)
            for gbuf_idx, buf in enumerate(optimizer.buffers):
                entry = world[gbuf_idx][(buf.param_dtype, buf.grad_dtype)]
                if entry["bucket_numel_unpadded"] != [b.numel_unpadded for b in buf.buckets]:
                    raise ValueError(f"{path}: bucket sizes {entry['bucket_numel_unpadded']} "
                                     f"differ from this run's; keep ddp.bucket_size fixed")
            verdict = ("ok", sorted(k for k, v in entry.items() if torch.is_tensor(v)))
        except ValueError as e:
            verdict = ("error", str(e))
        except (KeyError, TypeError, IndexError) as e:
            verdict = ("error", f"{path}: not a distributed-optimizer state of this model ({e!r})")
    verdict = comm.all_gather_object(verdict, group="dp")[0]
    if verdict[0] == "error":
        raise ValueError(verdict[1])
    return world, verdict[1]


# %% [markdown]
# `_distopt_pieces` walks buffers and buckets in the save's order, with a running offset into
# each world tensor, and cuts every piece this rank owns out of the scattered shard. The step
# counts come from `model_optim_rng.pt`'s `optimizer` entry, by parameter name.

# %%
def _distopt_pieces(directory: Path, optimizer, common_opt: dict, comm) -> list:
    """(main, {"param": ..., state..., "step": n}) for every piece this DP rank owns."""
    world, keys = _read_world(directory, optimizer, comm)
    dp = comm.grid.size("dp_cp")
    pieces = {id(main): {} for _, main in optimizer.pairs}
    for gbuf_idx, buf in enumerate(optimizer.buffers):
        entry = None if world is None else world[gbuf_idx][(buf.param_dtype, buf.grad_dtype)]
        start = 0
        for bucket in buf.buckets:
            for k in keys:
                src = None if entry is None else entry[k][start:start + bucket.numel_unpadded]
                shard = _scatter_bucket(src, bucket, comm, dp)
                for (model, main), (piece, _) in zip(optimizer.pairs, optimizer.pieces):
                    if piece.param in bucket.param_to_index:
                        pieces[id(main)][k] = shard[piece.shard_start:piece.shard_end].clone()
            start += bucket.numel_unpadded
    out = []
    for (model, main), name in zip(optimizer.pairs, optimizer.names):
        state = pieces[id(main)]
        if name in common_opt.get("steps", {}):
            state["step"] = common_opt["steps"][name]
        elif "step" in ((legacy_param_groups(common_opt) or [{}])[0]):   # a Megatron file
            state["step"] = int(legacy_param_groups(common_opt)[0]["step"])
        out.append((main, state))
    return out


# %% [markdown]
# `read_legacy` is one rank's whole read: find this position's file (or say which layouts the
# directory holds), check the layout and the model's keys and shapes, pick this DP rank's RNG
# state, and read the optimizer state in whichever form the optimizer needs.

# %%
def read_legacy(directory: Path, grid, chunks, optimizer, comm: CheckpointGroups,
                load_optim: bool = True) -> LoadedState:
    """Read and check this rank's part of a legacy checkpoint; nothing is applied yet."""
    directory = Path(directory)
    rank_dir = directory / legacy_rank_dir(grid.rank("tp"), grid.rank("pp"), grid.size("pp"))
    path = rank_dir / LEGACY_MODEL_FILENAME
    if not path.is_file():
        written = sorted(p.name for p in directory.glob("mp_rank_*"))
        raise ValueError(f"{path}: missing; the checkpoint has {written}, this run needs "
                         f"tp={grid.size('tp')}, pp={grid.size('pp')}: the legacy 'torch' format "
                         "cannot reshard TP or PP")
    sd = _load_file(path)
    _check_layout(sd, grid, path)
    loaded = LoadedState(common=sd, model=_model_pairs(sd, chunks, path))
    rng = sd.get("rng_state")
    if rng:
        r = grid.rank("dp")   # one entry per DP rank (checkpointing.py:1993-1996)
        loaded.rng = rng[r] if len(rng) == grid.size("dp") else rng[0]
    if optimizer is None or not load_optim or "optimizer" not in sd:
        return loaded
    if type(optimizer).__name__ == "DistributedOptimizer":
        loaded.optimizer_pieces = _distopt_pieces(rank_dir, optimizer, sd["optimizer"], comm)
    else:
        loaded.optimizer_state_dict = sd["optimizer"]
    return loaded


# %% [markdown]
# ## Demo: the files of a TP 1 × DP 2 save, and a DP 2 → 1 reload
#
# The full save path (the resume page's `CheckpointManager`) runs with `ckpt_format="torch"`
# on two DP ranks with the DistributedOptimizer: only DP rank 0 writes. The world tensors in
# `distrib_optim.pt` hold the fp32 masters of the whole model in buffer order — the padding at
# the end of each bucket stripped, only the alignment gaps between parameters left — and this
# process loads the checkpoint at DP 1 and continues with the same loss as the two-rank run.

# %%
if __name__ == "__main__":
    import tempfile

    from tinytron.checkpoint import _workers
    from tinytron.launch import run_on_ranks

    with tempfile.TemporaryDirectory() as root:
        out = run_on_ranks(_workers.legacy_demo_save, 2, root, timeout=300)
        print("files:", out[0]["files"])
        world = torch.load(f"{root}/iter_0000003/mp_rank_00/distrib_optim.pt", weights_only=True)
        entry = next(iter(world[0].values()))
        print({k: (tuple(v.shape) if torch.is_tensor(v) else v) for k, v in entry.items()})
        torch.set_num_threads(1)
        reload = _workers.legacy_demo_load(root)   # this process, no process group: DP 1
        print(f"loss at step 4: DP 2 run {out[0]['next_loss']:.6f}, "
              f"reloaded at DP 1 {reload['next_loss']:.6f}")
    assert out[0]["files"] == ["iter_0000003/mp_rank_00/distrib_optim.pt",
                               "iter_0000003/mp_rank_00/model_optim_rng.pt",
                               "latest_checkpointed_iteration.txt"]
    n, gaps = out[0]["num_params"], 63 * out[0]["num_tensors"]   # 64-aligned param starts
    assert entry["param"].numel() == entry["numel_unpadded"] <= out[0]["buffer_numel"]
    assert n <= entry["numel_unpadded"] <= n + gaps
    assert abs(out[0]["next_loss"] - reload["next_loss"]) < 1e-6

# %% [markdown]
# ## Summary
#
# - One `model_optim_rng.pt` per (TP, PP) position, written by its DP rank 0; the
#   DistributedOptimizer's fp32 masters and moments gathered over DP into `distrib_optim.pt`
#   as unpadded per-buffer world tensors.
# - Readable with plain `torch.load(weights_only=True)`; DP may change on reload (the world
#   tensors are re-padded and scattered), TP and PP may not.
#
# ## How production does it
#
# - Megatron: `megatron/training/checkpointing.py` (`generate_state_dict:993`,
#   `check_checkpoint_args:137`, `_load_base_checkpoint:1290`),
#   `megatron/core/optimizer/distrib_optimizer.py` (`get_parameter_state_dp_zero:1206`,
#   `save_parameter_state:1355`, `load_parameter_state:2486`).
#
# ## Exercises
#
# 1. At DP 64 DP rank 0 receives 63 shard vectors per bucket and quantity. Which memory peak
#    does that cause on the 7B example, and how does Megatron's per-bucket loop bound it?
#
#    <details><summary>Hint</summary>
#
#    Count what `distributed_optimizer_world_tensors` holds on DP
#    rank 0 at once: the world tensors built so far (for a whole position, the 24.1 GB that
#    `checkpoint_sizes` gives as `legacy_optim_file`) plus the $dp$ shard vectors of the one bucket
#    and quantity being gathered. Compare with gathering every bucket before concatenating.
#
#    </details>
#
# 2. Change the DDP bucket size between save and load. Which check fires, and why must it?
#
#    <details><summary>Hint</summary>
#
#    Look for `bucket_numel_unpadded` in the loading cells: DP rank 0
#    compares the saved bucket sizes with this run's before any scatter. The world tensor has no
#    padding, so the bucket boundaries are the only way to cut it back into shards.
#
#    </details>
