# %% [markdown]
# # 03 · Checkpoint: the files on disk
#
# A checkpoint is a directory of files that several hundred processes write at once and that
# one process, maybe on another layout, must read back. This page fixes the names Megatron
# uses (the tracker file, `iter_0001000/`, `mp_rank_01_001/`, `common.pt`, `.metadata`,
# `__3_0.distcp`, `metadata.json`), works out what the running example writes and how big it
# is, and builds the one rule every later page relies on: **a checkpoint directory is either
# complete or invisible**.
#
# You will build: `checkpoint_dir_name`, `read_tracker`, `write_tracker`, `legacy_rank_dir`,
# `detect_format`, `prepare_staging`, `commit_checkpoint`, `checkpoint_sizes`,
# `files_written`.

# %%
from __future__ import annotations

import math
import os
import re
import shutil
import signal
from pathlib import Path

import torch

__all__ = ["TRACKER_FILENAME", "COMMON_FILENAME", "METADATA_FILENAME", "DCP_METADATA_FILENAME",
           "LEGACY_MODEL_FILENAME", "LEGACY_OPTIM_FILENAME", "CHECKSUM_FILENAME",
           "MEGATRON_METADATA", "CheckpointSaveError", "checkpoint_dir_name", "read_tracker",
           "write_tracker", "legacy_rank_dir", "detect_format", "resolve_checkpoint_dir",
           "staging_dir", "prepare_staging", "commit_checkpoint", "rotate_checkpoints",
           "atomic_write_bytes",
           "fsync_dir", "fault_point", "FAULT_ENV", "unwrap_chunks", "checkpoint_sizes",
           "files_written"]

# %% [markdown]
# ## Megatron's names
#
# Everything lives under one root, `--save` (`megatron/training/checkpointing.py`):
#
# | file | what | who writes it |
# |---|---|---|
# | `latest_checkpointed_iteration.txt` | the newest complete iteration as a decimal, or `release` (`:312`, read by `read_metadata` `:326`) | global rank 0, last |
# | `iter_0001000/` | one directory per saved iteration, 7 digits (`get_checkpoint_name`, `:197`); `release/` for a released model | — |
# | legacy `torch` format: `iter_…/mp_rank_TT/model_optim_rng.pt`, with `_PPP` appended when PP > 1 | model shard, optimizer hyperparameters, scheduler, RNG, progress | DP rank 0 of each (TP, PP) rank (`:611-614`) |
# | legacy: `iter_…/mp_rank_TT_PPP/distrib_optim.pt` | the DistributedOptimizer's fp32 master and Adam moments, gathered over DP (`:256`) | DP rank 0 |
# | `torch_dist`: `iter_…/common.pt` | everything that is not a sharded tensor (`strategies/common.py:16`) | global rank 0 |
# | `torch_dist`: `iter_…/__R_I.distcp` | tensor bytes: rank R's I-th file (`filesystem_async.py:140`) | every rank with something to write |
# | `torch_dist`: `iter_…/.metadata` | PyTorch DCP's index: every tensor's global shape and which file holds which chunk | rank 0 |
# | `torch_dist`: `iter_…/metadata.json` | `{"sharded_backend": "torch_dist", …}` (`dist_checkpointing/core.py:22`): **written last**, its presence means "complete" (`:38`) | rank 0 |
#
# The tracker is read as an integer or `release`; anything else is an error (Megatron's
# `read_metadata` prints an error and exits). Here a bad tracker raises `ValueError` naming
# the file.

# %%
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
COMMON_FILENAME = "common.pt"
METADATA_FILENAME = "metadata.json"
DCP_METADATA_FILENAME = ".metadata"
LEGACY_MODEL_FILENAME = "model_optim_rng.pt"
LEGACY_OPTIM_FILENAME = "distrib_optim.pt"
CHECKSUM_FILENAME = "checksums.json"
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}


class CheckpointSaveError(RuntimeError):
    """A save that did not complete; the message names the path and the cause."""


# %% [markdown]
# The names: a directory per iteration, the tracker read back as an iteration or `release`,
# and the legacy per-rank folder.

# %%
def checkpoint_dir_name(iteration: int, release: bool = False) -> str:
    """`iter_0001000`, or `release`."""
    if release:
        return "release"
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    return f"iter_{iteration:07d}"


def read_tracker(root: str | os.PathLike) -> tuple[int, bool] | None:
    """(iteration, release) from the tracker file; None when there is no tracker."""
    path = Path(root) / TRACKER_FILENAME
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if text == "release":
        return 0, True
    if not text.isdigit():
        raise ValueError(f"{path}: expected an iteration number or 'release', got {text!r}")
    return int(text), False


def legacy_rank_dir(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """`mp_rank_TT` (PP = 1) or `mp_rank_TT_PPP`."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")


# %% [markdown]
# A loader is handed a root, not a directory. `resolve_checkpoint_dir` follows the tracker to
# one iteration directory, and `detect_format` recognizes its format the way Megatron's
# `_get_checkpoint_format` does (`:1264`): a valid `metadata.json` means `torch_dist`, an
# entry starting with `mp_rank_0` means the legacy `torch` format, a bare `.metadata` means
# plain DCP. Both fail with the path in the message: a tracker naming a directory that is gone
# is an error, not an empty start.

# %%
def detect_format(directory: str | os.PathLike) -> str:
    """'torch_dist', 'torch' (legacy) or 'torch_dcp', from the files in one iteration directory."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"{d}: no such checkpoint directory")
    meta = d / METADATA_FILENAME
    if meta.is_file():
        import json

        try:
            backend = json.loads(meta.read_text()).get("sharded_backend")
        except ValueError as e:
            raise ValueError(f"{meta}: not valid JSON ({e})") from e
        if backend != "torch_dist":
            raise ValueError(f"{meta}: sharded_backend {backend!r} is not supported")
        return "torch_dist"
    if any(p.name.startswith("mp_rank_0") for p in d.iterdir()):
        return "torch"
    if (d / DCP_METADATA_FILENAME).is_file():
        return "torch_dcp"
    raise ValueError(f"{d}: neither metadata.json nor mp_rank_* nor .metadata: not a checkpoint "
                     "(an interrupted save never gets this far)")


# %% [markdown]
# `resolve_checkpoint_dir` follows the tracker (or an explicit iteration) to the directory,
# and refuses a tracker that names a directory that is gone.

# %%
def resolve_checkpoint_dir(root: str | os.PathLike, iteration: int | None = None
                           ) -> tuple[Path, int, bool] | None:
    """(directory, iteration, release) to load: the tracker's, or `iteration`; None if empty."""
    root = Path(root)
    if iteration is None:
        found = read_tracker(root)
        if found is None:
            return None
        iteration, release = found
    else:
        release = False
    directory = root / checkpoint_dir_name(iteration, release)
    if not directory.is_dir():
        raise ValueError(f"{root / TRACKER_FILENAME} names iteration "
                         f"{'release' if release else iteration}, but {directory} does not exist")
    return directory, iteration, release


# %% [markdown]
# ## Complete or invisible
#
# A job can die at any moment of a save: SIGKILL from the scheduler, a node failure, a full
# disk. Megatron's answer has two parts: the tracker is rewritten only after every rank has
# finished, and `metadata.json` is the last file of a `torch_dist` directory. A directory
# without `metadata.json` is then recognizably partial — but it still sits at the final
# name, and the previous save of the same iteration (if any) has been overwritten in place.
#
# Here every save writes into a **staging directory** `iter_0001000.tmp` next to the final one,
# and only after all ranks reported success does rank 0
#
# 1. `fsync` the files' directory, `rename` `iter_0001000.tmp` → `iter_0001000`
#    (a rename inside one file system is atomic), `fsync` the root;
# 2. write the tracker to `latest_checkpointed_iteration.txt.tmp`, `fsync`, `rename` over the
#    old tracker, `fsync` the root.
#
# A crash before step 1 leaves a `.tmp` directory nobody reads (the next save of that iteration
# removes it); a crash between 1 and 2 leaves a complete new directory and a tracker that still
# names the previous one. Either way the tracker names a complete checkpoint. If the iteration
# directory already exists (a second save of the same iteration), it is moved aside to
# `iter_….old` just before the rename and removed after it. In order, with the two points where
# a kill is survivable by construction:
#
# ```mermaid
# sequenceDiagram
#   participant R as every rank
#   participant Z as global rank 0
#   participant FS as file system under --save
#   Z->>FS: prepare_staging: empty iter_0001000.tmp/
#   Note over R,Z: barrier
#   R->>FS: each rank writes its own files into iter_0001000.tmp/
#   R->>Z: every rank reports success
#   Z->>FS: fsync iter_0001000.tmp/
#   Note over FS: killed here (before_rename)<br/>a .tmp nobody reads<br/>tracker names the previous save
#   Z->>FS: rename an existing iter_0001000/ to iter_0001000.old/
#   Z->>FS: rename iter_0001000.tmp/ to iter_0001000/, fsync the root
#   Note over FS: killed here (before_tracker)<br/>new directory complete<br/>tracker still names the previous save
#   Z->>FS: tracker.tmp, fsync, rename over the tracker, fsync the root
#   Z->>FS: remove iter_0001000.old/
# ```
#
# The code comes in the other order: first the primitive under step 2 (write a file aside,
# `fsync` it, rename it over the old one, `fsync` the directory), which `write_tracker` applies
# to the tracker and which serves any small file a reader must see whole.

# %%
def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file inside `path` durable."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `path` so that a reader sees the old content or the new one, never a mix."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_tracker(root: str | os.PathLike, iteration: int, release: bool = False) -> None:
    """Point the tracker at `iteration` (atomic)."""
    atomic_write_bytes(Path(root) / TRACKER_FILENAME,
                       ("release" if release else str(iteration)).encode() + b"\n")


# %% [markdown]
# Step 1 is the staging directory and its commit. `fault_point(name)` marks the moments in
# it where the tests kill a real process: with `TINYTRON_CHECKPOINT_FAULT=name` (or
# `name@rank`) in the environment, the process sends itself SIGKILL there. Nothing is mocked:
# the writer is the real one, the kill is the real signal, and the next process loads from
# what is really on disk.

# %%
FAULT_ENV = "TINYTRON_CHECKPOINT_FAULT"


def fault_point(name: str, rank: int | None = None) -> None:
    """SIGKILL this process here when TINYTRON_CHECKPOINT_FAULT names this point (and rank)."""
    want = os.environ.get(FAULT_ENV)
    if not want:
        return
    point, _, who = want.partition("@")
    if point == name and (not who or rank is None or int(who) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


# %% [markdown]
# The staging directory sits next to the final one, with `.tmp` appended; rank 0 empties it
# before a save, since a killed save may have left one behind.

# %%
def staging_dir(root: str | os.PathLike, iteration: int, release: bool = False) -> Path:
    """Where a save of `iteration` is written before it becomes visible."""
    return Path(root) / (checkpoint_dir_name(iteration, release) + ".tmp")


def prepare_staging(root: str | os.PathLike, iteration: int, release: bool = False) -> Path:
    """An empty staging directory (a stale one from a killed save is removed). Rank 0 only."""
    staging = staging_dir(root, iteration, release)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


# %% [markdown]
# The commit: sync the staging directory, move a previous save of the same iteration aside,
# rename staging into place, sync the root, and only then rewrite the tracker.

# %%
def commit_checkpoint(root: str | os.PathLike, iteration: int, release: bool = False) -> Path:
    """Rename the staging directory into place, then move the tracker. Rank 0, after all ranks."""
    root = Path(root)
    staging = staging_dir(root, iteration, release)
    final = root / checkpoint_dir_name(iteration, release)
    fsync_dir(staging)
    fault_point("before_rename")
    old = None
    if final.exists():
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(staging, final)
    fsync_dir(root)
    fault_point("before_tracker")
    write_tracker(root, iteration, release)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


# %% [markdown]
# Saves accumulate: each is a full copy of the weights and the optimizer state, so three saves
# of a run fill three times its size. `[checkpoint] keep_latest_k` (torchtitan's name; Megatron
# keeps every save) removes the oldest `iter_NNNNNNN` directories after a save, keeping the `k`
# newest. It runs only after the commit above has moved the tracker to the new directory, so at
# every moment the tracker names a complete checkpoint that is kept; a kill during the removal
# leaves an extra old directory, never a missing one. Only names of the `iter_` + 7 digits form
# are touched (no `release`, no `.tmp` staging directory, nothing else a user put there), and
# the tracker's own iteration is kept whatever `k` says.

# %%
def rotate_checkpoints(root: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the `keep` newest iter_NNNNNNN directories (never the tracker's)."""
    root = Path(root)
    found = read_tracker(root)
    saved = sorted(p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"iter_\d{7}", p.name))
    removed = []
    for path in saved[:-keep] if keep > 0 else []:
        if found is not None and not found[1] and path.name == checkpoint_dir_name(found[0]):
            continue
        shutil.rmtree(path)
        removed.append(path)
    if removed:
        fsync_dir(root)
    return removed


# %% [markdown]
# Every saver of this chapter is handed "the model" the way the training loop holds it: one
# chunk, a list of virtual-pipeline chunks, or DDP wrappers around them. `unwrap_chunks` gives
# back the `GPTModel` chunks, and refuses anything else by name.

# %%
def unwrap_chunks(model) -> list:
    """The GPTModel chunks inside a model, a list of chunks, or DDP wrappers of them."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out = []
    for chunk in chunks:
        while not hasattr(chunk, "layer_offset") and hasattr(chunk, "module"):
            chunk = chunk.module
        if not hasattr(chunk, "layer_offset"):
            raise ValueError(f"expected tinytron GPTModel chunks (or DDP around them), "
                             f"got {type(chunk).__name__}")
        out.append(chunk)
    return out



# %% [markdown]
# ## How big is the running example's checkpoint?
#
# The 7B model ($h = 4096$, $L = 32$, 32 heads in 8 KV groups, $f = 14336$, $V = 128256$,
# tied embeddings) has $P = 7.50$ B parameters. A resumable checkpoint holds, per parameter,
# the bf16 weight (2 bytes), the fp32 master weight (4) and Adam's two fp32 moments (4 + 4):
# 14 bytes, about **105 GB**. A weights-only export is 2 bytes per parameter, 15 GB.
#
# On TP2·PP2·DP64 (256 ranks) each (TP, PP) position holds about 2.0 B parameters: 16 layers'
# TP halves (1.74 B) plus half of the vocabulary-parallel embedding (0.26 B) on the first stage,
# or of the tied output-layer copy on the last. The two formats distribute the writing very
# differently:
#
# - **legacy**: only the 4 DP-rank-0 processes write. Each gathers its 64 DP shards of master
#   and moments over DP (2.0 B × 12 bytes = 24.1 GB pass through one process) and writes
#   `model_optim_rng.pt` (4.0 GB of bf16 weights) plus `distrib_optim.pt` (24.1 GB): 4 writers,
#   8 files.
# - **torch_dist**: every rank writes its own DistributedOptimizer shard (24.1 GB / 64 ≈
#   0.38 GB) and, with Megatron's default fully parallel save (`ckpt_fully_parallel_save`,
#   `training_config.py:491`; [torch_dist](torch_dist.py)), a 64th of its position's bf16
#   weights (4.0 GB / 64 ≈ 0.06 GB): 256 writers of about 0.44 GB each, one `__R_0.distcp`
#   per rank, plus `common.pt`, `.metadata` and `metadata.json` from rank 0. No gather, and
#   the write bandwidth of the whole cluster is used. With the fully parallel save turned off
#   (Megatron-Core's plain `dist_checkpointing.save` does the same), DP rank 0 of each
#   position writes all 4.0 GB of weights too: 4.4 GB on 4 ranks, 0.38 GB on the rest, so the
#   slowest rank writes about 11× as much.
#
# The same iteration of the running example in each format (the `.tmp` suffix dropped, as after
# the commit):
#
# ```mermaid
# flowchart LR
#   subgraph D["--ckpt-format torch_dist: 256 writers, 259 files"]
#     DI["iter_0001000/"] --> D0["common.pt<br/>rank 0"]
#     DI --> D1["__0_0.distcp ... __255_0.distcp<br/>one per rank, 0.38 GB of optimizer state<br/>+ 0.06 GB of weights (fully parallel save)"]
#     DI --> D2[".metadata<br/>rank 0, the index"]
#     DI --> D3["metadata.json<br/>rank 0, written last"]
#   end
#   subgraph L["--ckpt-format torch: 4 writers, 8 files"]
#     LI["iter_0001000/"] --> L0["mp_rank_00_000/<br/>model_optim_rng.pt 4.0 GB<br/>distrib_optim.pt 24.1 GB"]
#     LI --> L1["mp_rank_01_000/<br/>same two files"]
#     LI --> L2["mp_rank_00_001/<br/>same two files"]
#     LI --> L3["mp_rank_01_001/<br/>same two files"]
#     G["DP ranks 1..63 of each position"] -.->|"gather master + moments"| L0
#   end
# ```
#
# `checkpoint_sizes` computes these numbers from the config, `files_written` lists the files.

# %%
def _position_params(config, tp: int, pp: int) -> list[int]:
    """Parameters held by each pipeline stage's TP rank (tied copies counted where they live)."""
    from tinytron.model.config import count_parameters_per_rank

    return [count_parameters_per_rank(config, tp=tp, pp=pp, pp_rank=r) for r in range(pp)]


def checkpoint_sizes(config, tp: int, pp: int, dp: int, param_bytes: int = 2) -> dict:
    """Bytes of weights, fp32 master and moments: total, and per writer in both formats."""
    from tinytron.model.config import count_parameters

    total_params = count_parameters(config)
    per_pos = _position_params(config, tp, pp)
    biggest = max(per_pos)
    state = 12  # fp32 master + exp_avg + exp_avg_sq
    return {
        "parameters": total_params,
        "weights": total_params * param_bytes,
        "fp32_master": total_params * 4, "exp_avg": total_params * 4, "exp_avg_sq": total_params * 4,
        "total": total_params * (param_bytes + state),
        "legacy_writers": tp * pp,
        "legacy_model_file": biggest * param_bytes,
        "legacy_optim_file": biggest * state,
        "torch_dist_writers": tp * pp * dp,
        "torch_dist_optim_per_rank": math.ceil(biggest / dp) * state,
        "torch_dist_weights_per_dp0_rank": biggest * param_bytes,
    }


# %% [markdown]
# Which files a rank writes: in the legacy format only DP rank 0 of each (TP, PP) position
# writes, two files; in `torch_dist` every rank writes one `.distcp`, and global rank 0 adds the
# common and metadata files.

# %%
def files_written(tp: int, pp: int, dp: int, fmt: str, tp_rank: int = 0, pp_rank: int = 0,
                  dp_rank: int = 0) -> list[str]:
    """The files one rank writes into the iteration directory, in either format."""
    if fmt == "torch":
        if dp_rank != 0:
            return []
        d = legacy_rank_dir(tp_rank, pp_rank, pp)
        return [f"{d}/{LEGACY_MODEL_FILENAME}", f"{d}/{LEGACY_OPTIM_FILENAME}"]
    if fmt != "torch_dist":
        raise ValueError(f"format must be 'torch' or 'torch_dist', got {fmt!r}")
    # Megatron's default rank order is tp-cp-ep-dp-pp: tp fastest, pp slowest.
    rank = tp_rank + tp * (dp_rank + dp * pp_rank)
    files = [f"__{rank}_0.distcp"]
    if rank == 0:
        files = [COMMON_FILENAME] + files + [DCP_METADATA_FILENAME, METADATA_FILENAME]
    return files


# %% [markdown]
# ## Demo: the running example, and a save that dies half-way
#
# First the sizes and file lists for TP2·PP2·DP64. Then a toy "save" (two files into a staging
# directory) is committed once, and a second save is interrupted before its commit: the
# tracker still names the first, whose directory is intact, and the half-written one is only
# visible as `iter_0000002.tmp`.

# %%
if __name__ == "__main__":
    import tempfile

    from tinytron.model import llama_7b_config

    cfg = llama_7b_config()
    sizes = checkpoint_sizes(cfg, tp=2, pp=2, dp=64)
    gb = 1e9
    print(f"{sizes['parameters'] / 1e9:.2f} B params: weights {sizes['weights'] / gb:.1f} GB, "
          f"fp32 master {sizes['fp32_master'] / gb:.1f} GB, moments "
          f"{(sizes['exp_avg'] + sizes['exp_avg_sq']) / gb:.1f} GB, total {sizes['total'] / gb:.1f} GB")
    print(f"legacy: {sizes['legacy_writers']} writers, each model_optim_rng.pt "
          f"{sizes['legacy_model_file'] / gb:.1f} GB + distrib_optim.pt "
          f"{sizes['legacy_optim_file'] / gb:.1f} GB")
    print(f"torch_dist: {sizes['torch_dist_writers']} writers, each "
          f"{sizes['torch_dist_optim_per_rank'] / gb:.2f} GB of optimizer state "
          f"(+{sizes['torch_dist_weights_per_dp0_rank'] / gb:.1f} GB weights on DP rank 0)")
    for fmt in ("torch", "torch_dist"):
        for who in [(0, 0, 0), (1, 1, 0), (0, 0, 1), (1, 1, 63)]:
            print(f"  {fmt:10s} tp={who[0]} pp={who[1]} dp={who[2]:2d}: "
                  f"{files_written(2, 2, 64, fmt, *who) or '(nothing)'}")

    with tempfile.TemporaryDirectory() as root:
        for it in (1, 2):
            staging = prepare_staging(root, it)
            torch.save({"iteration": it}, staging / COMMON_FILENAME)
            (staging / METADATA_FILENAME).write_text(__import__("json").dumps(MEGATRON_METADATA))
            if it == 1:
                commit_checkpoint(root, it)   # iteration 2 "dies" before its commit
        print("on disk:", sorted(os.listdir(root)), "tracker ->", read_tracker(root))
        directory, iteration, _ = resolve_checkpoint_dir(root)
        assert iteration == 1 and detect_format(directory) == "torch_dist"
        assert torch.load(directory / COMMON_FILENAME, weights_only=True)["iteration"] == 1

    assert 100e9 < sizes["total"] < 110e9 and sizes["legacy_writers"] == 4
    assert legacy_rank_dir(1, 1, 2) == "mp_rank_01_001" and legacy_rank_dir(3, 0, 1) == "mp_rank_03"
    assert checkpoint_dir_name(1000) == "iter_0001000"

# %% [markdown]
# ## Summary
#
# - One root, one tracker, one directory per iteration; `mp_rank_TT[_PPP]` folders in the
#   legacy format, `common.pt` + `__R_I.distcp` + `.metadata` + `metadata.json` in `torch_dist`.
# - The 7B running example's resumable checkpoint is about 105 GB; the legacy format funnels it
#   through 4 writers, `torch_dist` through all 256.
# - Staging directory + rename + tracker last: the tracker only ever names a complete
#   checkpoint, whatever moment the job dies.
#
# ## How production does it
#
# - Megatron: `megatron/training/checkpointing.py` (names `:197-312`, `read_metadata:326`,
#   `_get_checkpoint_format:1264`, `save_checkpoint:495` with the tracker update registered as
#   a finalize function `:780-870`), `megatron/core/dist_checkpointing/core.py` (`metadata.json`).
#   Megatron writes into the final directory and relies on `metadata.json` + the tracker; the
#   staging rename here also protects the previous save of the same iteration.
# - torchtitan (`torchtitan/components/checkpoint.py`) saves plain DCP directories `step-N/`
#   and finds the newest by listing them, using the presence of `.metadata` as "complete".
#
# ## Exercises
#
# 1. Where in `commit_checkpoint` would a crash leave *two* complete directories and a tracker
#    naming the older one? Is that a problem?
#
#    <details><summary>Hint</summary>
#
#    Follow `commit_checkpoint` line by line and stop at
#    `fault_point("before_tracker")`: the rename has happened, the tracker has not moved. Then
#    ask what `resolve_checkpoint_dir` loads, and what the next save of that iteration does to
#    the directory already at its name.
#
#    </details>
#
# 2. With DP 64 the legacy format moves 24.1 GB through one process per position. How long is
#    that at 2 GB/s of gloo bandwidth, and what does `torch_dist` replace it with?
#
#    <details><summary>Answer</summary>
#
#    `checkpoint_sizes` gives 24,091,607,040 bytes per
#    `distrib_optim.pt`: 12.0 s at 2 GB/s, on each of the 4 writers. In `torch_dist` all 256
#    ranks write their own shard in parallel, 376,431,360 bytes each (0.38 GB): 0.19 s at the
#    same rate, with no gather over DP.
#
#    </details>
