# %% [markdown]
# # 03 · Checkpoint: `torch_dist` with `torch.distributed.checkpoint`
#
# Writing and reading the sharded keys of the previous page with PyTorch's distributed
# checkpoint (DCP): each rank writes its chunks into its own `__R_0.distcp`, rank 0 writes the
# index `.metadata` and — last — Megatron's `metadata.json`; a reader on any
# layout asks DCP for exactly the boxes it needs. The result opens with PyTorch's own tools,
# without tinytron.
#
# You will build: `SaveRequest` (plan, write, finalize), `read_sharded`, `read_common`,
# `save_model_weights`, `load_model_weights`.

# %%
from __future__ import annotations

import io
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tinytron.checkpoint._checks import _check_request, _check_tiling
from tinytron.checkpoint._common import CheckpointGroups, save_file
from tinytron.checkpoint._dcp_files import (_check_files, _ChecksumFS, _file_crc,
                                            _layout_args, _model_dir, _root_cause,
                                            _verify_checksums, _write_json, read_dcp_index)
from tinytron.checkpoint.formats import (CHECKSUM_FILENAME, COMMON_FILENAME, DCP_METADATA_FILENAME,
                                         MEGATRON_METADATA, METADATA_FILENAME, CheckpointSaveError,
                                         detect_format, fault_point, unwrap_chunks)
from tinytron.checkpoint.sharded_keys import (ShardedObject, ShardedTensor, extra_state_objects,
                                              model_sharded_state_dict)

__all__ = ["SaveRequest", "distribute_main_replicas", "read_sharded", "read_common", "read_dcp_index", "save_model_weights",
           "load_model_weights"]

# %% [markdown]
# ## Writing: plan, write, finalize
#
# DCP's save (`torch/distributed/checkpoint/state_dict_saver.py`) has three phases, and
# Megatron runs them separately so that the middle one can run in the background
# (`strategies/state_dict_saver.py:41` and `:213`):
#
# 1. **plan** (collective): each rank lists its write items — one per chunk, with the global
#    shape and offset — the coordinator (rank 0) checks that the main replicas tile every
#    tensor exactly once (no overlap: DCP's `_validate_global_plan`; no gap: `_check_tiling`;
#    together Megatron's `validate_sharding_integrity`, `validation.py:369`) and assigns each
#    rank its file prefix `__R_`.
# 2. **write** (no communication): rank 0 writes `common.pt`, then each rank streams its
#    chunks into `__R_0.distcp` and fsyncs it.
# 3. **finalize** (collective): the write results (which file and offset holds each chunk) are
#    gathered on rank 0, which writes DCP's `.metadata`, then (with `crc_checksums`)
#    `checksums.json`, then `metadata.json` — last — and hands over to the commit of the
#    formats page.
#
# ```mermaid
# flowchart LR
#   subgraph plan["1 · plan (collective)"]
#     P0["rank 0: local plan"] --> C["rank 0: global plan<br/>tiling checked, prefixes __R_"]
#     P1["rank 1: local plan"] --> C
#   end
#   C --> W0["2 · rank 0 writes common.pt, __0_0.distcp"]
#   C --> W1["2 · rank 1 writes __1_0.distcp"]
#   W0 --> F["3 · rank 0: .metadata, (checksums.json),<br/>metadata.json, then the commit"]
#   W1 --> F
# ```
#
# <details><summary>Megatron detail: common.pt in the write phase, and optional checksums</summary>
#
# Megatron writes `common.pt` in the training process, before the sharded save starts
# (`megatron/core/dist_checkpointing/serialization.py:399`); tinytron moves it to the write
# phase, so that an async save writes it in the background with the rest. And with
# `crc_checksums` the write stream also computes a CRC-32 of every byte written: DCP stores no
# checksums, and `torch.load` does not notice a flipped byte inside a tensor. The option is
# tinytron's own and off by default, so that a default save is file for file Megatron-Core's.
#
# </details>
#
# Worked example, the tiny model at TP 1: 15 chunks (the untied model's 9 keys, 6 of them
# stacked with one chunk per layer) and 8 `_extra_state` objects become one `__0_0.distcp` of
# 592 KB — 139,584 fp32 parameters (558 KB) plus a small `torch.save` header per chunk — and
# `.metadata` maps each (key, offset) to (file, byte offset, length).
#
# The planners below are DCP's default ones with the state dict replaced by our list of
# `ShardedTensor`/`ShardedObject`: write items are built from global offsets directly, and a
# read asks DCP for exactly the boxes a rank needs (`create_read_items_for_chunk_list` does the
# overlap search against whatever chunks were saved).

# %%
class _SavePlanner(DefaultSavePlanner):
    """DCP's planner over explicit chunks: write items carry global shape and offset."""

    def __init__(self, tensors: list[ShardedTensor], objects: list[ShardedObject]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors, self.objects, self.data = tensors, objects, {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for t in self.tensors:
            index = MetadataIndex(t.key, torch.Size(t.global_offset))
            chunk = ChunkStorageMetadata(offsets=torch.Size(t.global_offset),
                                         sizes=torch.Size(t.data.shape))
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=chunk, properties=TensorProperties.create_from_tensor(t.data),
                size=torch.Size(t.global_shape))))
            self.data[index] = t.data
        for o in self.objects:
            index = MetadataIndex(o.unique_key)
            items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
            self.data[index] = [o.data]   # Megatron stores a one-element list
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.data[index]


# %% [markdown]
# The checksums ride on DCP's file-system object: DCP opens every file it writes through
# `FileSystem.create_stream`, so a wrapper around that stream sees every byte on its way to
# disk. Why there and not after the save, by reading the files back? Reading back doubles the
# I/O of a save and would checksum whatever the disk returns; the stream checksums the bytes
# as they leave the process. Two small classes do it, in the chapter's private module
# `tinytron.checkpoint._dcp_files` (`chapters/03_checkpoint/_dcp_files.py`):
#
# - `_CRCStream` keeps a running CRC-32 and byte count, holds on to an `OSError` that
#   `torch.save` would turn into an opaque `RuntimeError` (so that the error names the cause,
#   a full disk say), and is where the `mid_write` fault point of the [formats
#   page](formats.py) fires;
# - `_ChecksumFS`, DCP's `FileSystem` with `create_stream` wrapped, records `[size, crc]`
#   under the file's name when a stream closes, and remembers the path it opened last, which
#   is how a failed write or read names its file.
#
# The same module has `_file_crc` (the CRC of a file written outside DCP, `common.pt` and
# `.metadata`, read in 8 MiB blocks) and `_write_json` (a small JSON file, written and
# fsynced). A CRC-32 in numbers: `zlib.crc32(b"tinytron")` is one 32-bit integer, and
# flipping any single bit of the input changes it, so the demo below finds the one byte it
# flips in a 592 KB shard.
#
# One check DCP lacks is the gap check, `_check_tiling` in the chapter's private module
# `tinytron.checkpoint._checks` (`chapters/03_checkpoint/_checks.py`). DCP refuses overlapping
# chunks, so chunks whose element counts add up to the tensor's size cover it exactly once; a
# sum below the size means no rank wrote the rest, and the save is refused with the key and
# both counts, e.g. "key 'w': the written chunks cover 3 of 5 elements (no rank wrote the
# rest)".

# %% [markdown]
# ## Who writes a replicated tensor: the fully parallel save
#
# Every DP rank of a (TP, PP) position holds the same weights. Someone must write them once:
# Megatron-Core's plain `dist_checkpointing.save` lets DP rank 0 do it (`replica_id` 0), and then
# DP rank 0 of each position writes all the weights while the other DP ranks write only their
# DistributedOptimizer shard. Megatron's training loop does not save that way by default:
# `ckpt_fully_parallel_save` is on (`training_config.py:491`) and wraps the strategy in
# `FullyParallelSaveStrategyWrapper` (`checkpointing.py:665-671`,
# `megatron/core/dist_checkpointing/strategies/fully_parallel.py:46-58`), which spreads the
# replicated chunks over the DP group so that every rank writes a similar share. Only metadata is
# exchanged: each rank lists its chunks (key, offset, bytes, whether it is a main replica), the
# lists are gathered over the DP group, and every rank runs the same deterministic greedy
# assignment (`distribute_shards_to_ranks`,
# `megatron/core/dist_checkpointing/exchange_utils.py:117-170`): chunks held by fewer ranks first
# (a rank's own optimizer shard is held by it alone), then larger ones first, then by name; each
# goes to the least loaded rank that holds it. The chunks considered are those with a main replica
# in the group; a TP-replicated norm on TP rank 1 has none and stays unwritten there. As in
# Megatron, only tensors are distributed; the small objects (RNG, `_extra_state`) stay with DP
# rank 0.

# %%
def distribute_main_replicas(tensors: list[ShardedTensor], comm: CheckpointGroups) -> dict:
    """Set is_main so that the DP group's replicated chunks are written evenly; bytes per rank."""
    mine = [((t.key, tuple(t.global_offset)), t.data.numel() * t.data.element_size(), t.is_main)
            for t in tensors]
    everyone = comm.all_gather_object(mine, group="dp")
    holders, size, has_main = {}, {}, set()
    for rank, shards in enumerate(everyone):
        for shard, nbytes, main in shards:
            holders.setdefault(shard, []).append(rank)
            size[shard] = nbytes
            if main:
                has_main.add(shard)
    load = [0] * len(everyone)
    owner = {}
    for shard in sorted(has_main, key=lambda k: (len(holders[k]), -size[k], k)):
        rank = min(holders[shard], key=lambda r: (load[r], r))
        owner[shard], load[rank] = rank, load[rank] + size[shard]
    me = comm.grid.rank("dp_cp") if len(everyone) > 1 else 0
    for t in tensors:
        shard = (t.key, tuple(t.global_offset))
        if shard in owner:
            t.is_main = owner[shard] == me
    return {"bytes_per_dp_rank": load}


# %% [markdown]
# `SaveRequest` carries one save through its three phases, so that the asynchronous saver can
# run the middle one somewhere else. Each phase is a function below, and the class at the end
# strings them together. Only main replicas are kept: every global element is written once.
#
# `_plan` is the first collective: every rank's local plan goes to rank 0, which checks the
# tiling, builds the global plan and scatters each rank its part, or, when a check fails, the
# same error message to every rank, so that no rank is left waiting. Why scatter an error
# instead of raising it on rank 0? Rank 0 raising alone would leave ranks 1 … w-1 blocked in
# the scatter forever; a message in every rank's slot makes all of them raise the same
# `CheckpointSaveError`.

# %%
def _plan(request) -> None:
    """Collective: build and exchange the DCP plans (the coordinator checks the tiling)."""
    request.fs = _ChecksumFS(request.comm.rank, request.checksums)
    # per_thread_copy_ahead=0: DCP's overlapping loader would open CUDA streams, which a
    # forked writer must not touch; the chunks it writes are host copies already.
    request.writer = dcp.FileSystemWriter(request.directory, thread_count=request.thread_count,
                                          overwrite=True, per_thread_copy_ahead=0)
    request.writer.fs = request.fs
    request.planner = _SavePlanner(request.tensors, request.objects)
    coordinator = request.comm.rank == 0
    request.planner.set_up_planner({}, request.writer.storage_meta(), coordinator)
    request.writer.set_up_storage_writer(coordinator, rank=request.comm.rank)
    local = request.writer.prepare_local_plan(request.planner.create_local_plan())
    plans = request.comm.gather_object(local)
    central = None
    if coordinator:   # a failure here must reach every rank through the scatter
        try:
            _check_tiling(plans)
            plans, request.metadata = request.planner.create_global_plan(plans)
            central = request.writer.prepare_global_plan(plans)
        except (ValueError, OSError) as e:
            central = [f"{request.directory}: {e}"] * request.comm.world_size
    mine = request.comm.scatter_object(central)
    if isinstance(mine, str):
        raise CheckpointSaveError(mine)
    request.final_plan = request.planner.finish_plan(mine)


# %% [markdown]
# `_write` talks to no other rank, which is what lets it run in a forked process: it returns
# its outcome (the write results and checksums, or an error message naming the file) instead
# of raising, because a forked writer's exception would die with the process. Rank 0 writes
# `common.pt` first; then every rank streams its chunks, with the `mid_write` fault point live.
# One more check: DCP's writer threads report a result per item, so fewer results than plan
# items means a thread failed silently, and that is an error too.

# %%
def _write(request) -> dict:
    """No communication: common.pt (rank 0), this rank's .distcp; {'results', ...} or {'error'}."""
    t0 = time.perf_counter()
    sums = {}
    if request.comm.rank == 0 and request.common is not None:
        path = request.directory / COMMON_FILENAME
        error = save_file(request.common, path)
        if error:
            return {"error": error}
        sums[COMMON_FILENAME] = _file_crc(path) if request.checksums else None
    fault_point("before_write", request.comm.rank)
    try:
        request.fs.armed = True   # the mid_write fault point is live while shards are written
        results = request.writer.write_data(request.final_plan, request.planner).wait()
    except Exception as e:  # noqa: BLE001 - reported to every rank by finalize
        request.fs.armed = False
        where, cause = request.fs.current or request.directory, request.fs.error or e
        return {"error": f"writing {where} failed: {type(cause).__name__}: {cause}"}
    request.fs.armed = False
    if len(results) != len(request.final_plan.items):
        return {"error": f"writing {request.directory}: "
                         f"{len(request.final_plan.items) - len(results)}"
                         " items were not written (a writer thread failed)"}
    return {"results": results, "sums": {**sums, **request.fs.sums},
            "seconds": time.perf_counter() - t0}


# %% [markdown]
# `finalize` is the second collective: the outcomes meet on rank 0, which, if no rank
# reported an error, runs `_finish`: the index `.metadata`, then (with `crc_checksums`)
# `checksums.json`, then `metadata.json`, in that order, and then the caller's commit. The
# order is the point: `metadata.json` is what makes a directory a Megatron checkpoint, so it
# comes last, and a crash before it leaves a directory that no reader takes for complete.
# Every rank gets the same verdict back.

# %%
def _finish(request, outcomes: list[dict], on_complete) -> str | None:
    """Rank 0: the index, the checksums, then metadata.json; then the caller's commit."""
    try:
        request.writer.finish(request.metadata, [o["results"] for o in outcomes])
        sums = {name: s for o in outcomes for name, s in o["sums"].items()}
        if request.checksums:
            sums[DCP_METADATA_FILENAME] = _file_crc(request.directory / DCP_METADATA_FILENAME)
            _write_json(request.directory / CHECKSUM_FILENAME, {"algorithm": "crc32",
                                                                "files": sums})
        fault_point("before_metadata_json")
        _write_json(request.directory / METADATA_FILENAME, MEGATRON_METADATA)
        if on_complete is not None:
            on_complete()
    except OSError as e:
        return f"finalizing {request.directory} failed: {type(e).__name__}: {e}"
    return None


# %% [markdown]
# The request itself keeps what the three phases share (the directory, the groups, the
# main-replica tensors and objects, `common.pt`'s content) and calls them.

# %%
class SaveRequest:
    """One torch_dist save split in Megatron's three phases: plan, write, finalize."""

    def __init__(self, directory: Path, tensors: list, objects: list, comm: CheckpointGroups,
                 common: dict | None = None, thread_count: int = 1, checksums: bool = False):
        self.directory, self.comm, self.common = Path(directory), comm, common
        self.tensors = [t for t in tensors if t.is_main]
        self.objects = [o for o in objects if o.is_main]
        self.thread_count, self.metadata, self.checksums = thread_count, None, checksums

    def plan(self) -> None:
        """Collective: build and exchange the DCP plans (the coordinator checks the tiling)."""
        _plan(self)

    def write(self) -> dict:
        """No communication: common.pt (rank 0), this rank's .distcp; {'results', ...} or {'error'}."""
        return _write(self)

    def finalize(self, outcome: dict, on_complete=None) -> str | None:
        """Collective: rank 0 writes .metadata, checksums.json, metadata.json; same verdict everywhere."""
        fault_point("before_finalize", self.comm.rank)
        outcomes = self.comm.gather_object(outcome)
        error = None
        if self.comm.rank == 0:
            error = next((o["error"] for o in outcomes if o.get("error")), None)
            if error is None:
                error = _finish(self, outcomes, on_complete)
        return self.comm.broadcast_object(error)


# %% [markdown]
# ## Reading
#
# `read_sharded` fills a list of `ShardedTensor`s (their `data` are the destination buffers)
# and returns the requested objects. Before any byte is copied it checks what can be checked
# cheaply: `metadata.json` says `torch_dist`, `.metadata` unpickles, every requested key exists
# with the expected global shape (a `ValueError` names the key and both shapes), every file
# the index refers to exists and is long enough, and — when the save wrote `checksums.json`
# and `verify=True` — every file's CRC matches it (the files are split over the ranks, each
# rank reads its share).
# Then DCP's loader reads the chunks; an error inside it is reported with the file that was
# being read.
#
# The planner asks DCP for one box per `ShardedTensor`; each request is first checked against
# the index, by key and global shape.

# %%
def _tensor_meta(md: dict, t: ShardedTensor, where: Path) -> TensorStorageMetadata:
    """The index entry of one requested tensor; ValueError if its key or global shape differ."""
    meta = md.get(t.key)
    if not isinstance(meta, TensorStorageMetadata):
        raise ValueError(f"{where}: the checkpoint has no tensor {t.key!r}")
    if tuple(meta.size) != tuple(t.global_shape):
        raise ValueError(f"{where}: {t.key!r} has global shape {tuple(meta.size)} in "
                         f"the checkpoint, the model needs {tuple(t.global_shape)}")
    return meta


# %% [markdown]
# DCP's default load planner with our boxes: `resolve_tensor` hands DCP the destination view of
# each read, and objects are unpickled as they arrive.

# %%
class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner over explicit boxes: each ShardedTensor asks for its global box."""

    def __init__(self, tensors: list[ShardedTensor], objects: list[ShardedObject], where: Path):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors, self.objects, self.where = tensors, objects, where
        self.dest, self.loaded = {}, {}

    def create_local_plan(self) -> LoadPlan:
        md, items = self.metadata.state_dict_metadata, []
        for t in self.tensors:
            meta = _tensor_meta(md, t, self.where)
            self.dest[(t.key, tuple(t.global_offset))] = t.data
            box = ChunkStorageMetadata(torch.Size(t.global_offset), torch.Size(t.data.shape))
            items += create_read_items_for_chunk_list(t.key, meta, [box])
        for o in self.objects:
            if not isinstance(md.get(o.unique_key), BytesStorageMetadata):
                raise ValueError(f"{self.where}: the checkpoint has no object {o.unique_key!r}")
            index = MetadataIndex(o.unique_key)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index,
                                  dest_offsets=torch.Size((0,)), storage_index=index,
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dst = self.dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dst = dst.narrow(dim, start, length)
        return dst

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.loaded[read_item.dest_index.fqn] = torch.load(value, weights_only=True)[0]


# %% [markdown]
# The cheap checks come before DCP reads a byte, and they are file bookkeeping, in
# `_dcp_files.py`: `_check_files` checks that every file the index points into
# exists and is long enough (a truncated file would otherwise fail deep inside DCP's reader:
# the index says a chunk lies at bytes 4096 to 8192 of `__1_0.distcp`, a 6000-byte file is
# refused before the read with "truncated (6000 bytes, the index needs at least 8192)");
# `_verify_checksums` checks the files' CRCs against `checksums.json` when the save wrote one,
# each rank its share (rank r of w takes files r, r + w, r + 2w, … of the sorted list) with
# `first_error` telling all of them; `read_dcp_index` unpickles the index itself, naming the
# file when it cannot.
#
# What the model asks for is checked against the index on every rank *before* DCP starts,
# and the ranks agree on the first error (`first_error`): every rank raises the same one-line
# `ValueError` naming the key, the shape saved and the shape expected. Left to DCP, a
# planner's error would arrive as DCP's `CheckpointException` — a `BaseException`, not an
# `Exception`, with every failing rank's traceback in its text — on some ranks only.
# With `strict`, a model tensor the checkpoint has and no rank asks for is an error too
# (the optimizer's `optimizer.…` keys are not model tensors): the ranks first share the keys
# they ask for, since each pipeline stage asks only for its own. That check,
# `_check_request`, is in `_checks.py`.
#
# `read_sharded` runs those checks, then DCP's load with the planner above. A failure inside
# DCP's load is wrapped in a per-rank `CheckpointException`; `_root_cause` unwraps the
# lowest failing rank's exception (`_dcp_files.py`), so that the error a user sees names the
# file and not DCP's machinery. `read_common` reads the non-tensor part, with `weights_only=True` like every load
# of this book.

# %%
def read_sharded(directory: Path, tensors: list[ShardedTensor], objects: list[ShardedObject],
                 comm: CheckpointGroups, verify: bool = True, strict: bool = False) -> dict:
    """Fill every ShardedTensor's data from the checkpoint; return {unique_key: object}."""
    directory = Path(directory)
    error = None
    try:
        metadata = read_dcp_index(directory)
        _check_files(directory, metadata)
        error = _check_request(directory, metadata, tensors, objects)
    except ValueError as e:
        error = str(e)
    if strict:   # a key is unexpected only if no rank asks for it (each stage has its layers)
        asked = set().union(*comm.all_gather_object(sorted({t.key for t in tensors})))
        if error is None:
            error = _check_request(directory, metadata, [], [], asked)
    error = comm.first_error(error)   # every rank raises the same message, or none does
    if error:
        raise ValueError(error)
    if verify:
        _verify_checksums(directory, comm)
    reader = dcp.FileSystemReader(directory)
    reader.fs = _ChecksumFS(comm.rank)
    planner = _LoadPlanner(tensors, objects, directory)
    try:
        with warnings.catch_warnings():   # DCP warns that one process reads alone: intended
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
            dcp.load({}, storage_reader=reader, planner=planner, process_group=comm.world,
                     no_dist=not comm.distributed)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised, naming the file
        cause = _root_cause(e)
        if isinstance(cause, ValueError) and str(directory) in str(cause):
            raise ValueError(str(cause).splitlines()[0]) from None
        where = reader.fs.current or directory
        raise ValueError(f"{where}: reading failed ({type(cause).__name__}: "
                         f"{str(cause).splitlines()[0] if str(cause) else ''})") from None
    return planner.loaded


# %% [markdown]
# `read_common` reads the rest of the directory, `common.pt`, with the same care: a missing or
# unreadable file is a `ValueError` naming it.

# %%
def read_common(directory: Path) -> dict:
    """common.pt of a torch_dist directory (weights_only), or ValueError naming it."""
    path = Path(directory) / COMMON_FILENAME
    if not path.is_file():
        raise ValueError(f"{path}: missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise ValueError(f"{path}: cannot be read ({type(e).__name__}: {e})") from e


# %% [markdown]
# ## Weights alone: `save_model_weights`, `load_model_weights`
#
# The plain API for a model without optimizer or progress: `save_model_weights(model, path)`
# writes a `torch_dist` directory exactly like Megatron-Core's
# `dist_checkpointing.save(model.sharded_state_dict(), path)` — an empty `common.pt`, the tensors,
# `.metadata`, `metadata.json`, the same four file names (a test compares them with megatron-core
# 0.16.1's save) — or, with `format="torch"`, one
# legacy `model_optim_rng.pt` per (TP, PP) position. `load_model_weights(path, model)` reads
# either format (a root with a tracker or an iteration directory) into a model on **any** layout
# for `torch_dist`. Call both on every rank of the model. Two helpers are bookkeeping, in
# `_dcp_files.py`: `_model_dir` (the path itself when it is an iteration
# directory, else the one its tracker names) and `_layout_args` (the model config and the
# layout, the `args` a legacy file carries).
#
# <details><summary>Megatron detail: one or two files per rank</summary>
#
# megatron-core 0.16.1's default of two writer threads per rank, `__0_0.distcp` and
# `__0_1.distcp`, is `thread_count=2` here, while Megatron at e03878b5f writes one,
# `megatron/core/dist_checkpointing/strategies/torch.py:600`.
#
# </details>

# %%
def save_model_weights(model, path, grid=None, format: str = "torch_dist",
                       thread_count: int = 1, crc_checksums: bool = False) -> None:
    """Write the model's weights (any layout) as a torch_dist or legacy directory at `path`."""
    from tinytron.checkpoint.legacy import save_legacy

    chunks = unwrap_chunks(model)
    grid = grid or chunks[0].grid
    comm = CheckpointGroups(grid)
    path = Path(path)
    if comm.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    if format == "torch":
        error = save_legacy(path, grid, chunks, None, {"args": _layout_args(chunks, grid)}, None,
                            comm)
    elif format == "torch_dist":
        request = SaveRequest(path, model_sharded_state_dict(chunks, grid),
                              extra_state_objects(chunks, grid), comm, common={},
                              thread_count=thread_count, checksums=crc_checksums)
        request.plan()
        error = request.finalize(request.write())
    else:
        raise ValueError(f"format must be 'torch_dist' or 'torch', got {format!r}")
    error = comm.first_error(error)
    if error:
        raise RuntimeError(error)



# %% [markdown]
# `load_model_weights` reads a `torch_dist` directory into CPU staging copies of the
# parameters and copies them in only after the whole read succeeded; the legacy path does the
# same through `read_legacy(...).apply_model()`. It is strict by default, as PyTorch's
# `load_state_dict` is: a model tensor of the checkpoint that this model lacks (an untied
# `output_layer.weight` loaded into a tied model) is an error naming it. Megatron's loader
# ignores unexpected keys by default (`dist_ckpt_strictness = "assume_ok_unexpected"`,
# `megatron/training/config/training_config.py:554-563`); `strict=False` does the same here.

# %%
@torch.no_grad()
def load_model_weights(path, model, grid=None, verify: bool = True, strict: bool = True) -> None:
    """Load weights from either format into the model's chunks; nothing changes on error."""
    from tinytron.checkpoint.legacy import read_legacy

    chunks = unwrap_chunks(model)
    grid = grid or chunks[0].grid
    comm = CheckpointGroups(grid)
    directory = _model_dir(path)
    if detect_format(directory) == "torch":
        read_legacy(directory, grid, chunks, None, comm).apply_model()
        return
    staged = {p: torch.empty_like(p, device="cpu") for c in chunks for p in c.parameters()}
    read_sharded(directory, model_sharded_state_dict(chunks, grid, staged), [], comm, verify,
                 strict=strict)
    for p, t in staged.items():
        p.copy_(t)


# %% [markdown]
# ## Demo: what a save looks like from outside
#
# The tiny model (TP 1) is saved with `save_model_weights`. DCP's index lists each key with its
# global shape and number of chunks — the layers stacked on the leading axis. Then the directory
# is opened with PyTorch's own tools only (`dcp_to_torch_save` turns it into one plain
# `torch.save` file): every tensor equals the model's, re-stacked. Finally the model is saved
# again with `crc_checksums=True` and one byte inside a tensor of the shard file is flipped:
# `torch.load` alone would not notice, the checksums do, and the error names the file.

# %%
if __name__ == "__main__":
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tinytron.model import GPTModel, tiny_config

    config = tiny_config(tie_embeddings=False)
    model = GPTModel(config)

# %% [markdown]
# The save, the index, the plain `torch.save` copy, the reload into a fresh model and the
# flipped byte all happen in one temporary directory.

# %%
if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        save_model_weights(model, tmp)
        print("files:", sorted(os.listdir(tmp)))
        md = dcp.FileSystemReader(tmp).read_metadata().state_dict_metadata
        for key, meta in list(md.items())[:5]:
            print(f"  {key:<58} {tuple(meta.size)} {len(meta.chunks)} chunk(s)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "assuming the intent is to load in a single process"
            dcp_to_torch_save(tmp, f"{tmp}/plain.pt")
        plain = torch.load(f"{tmp}/plain.pt", weights_only=True)
        qkv = plain["decoder.layers.self_attention.linear_qkv.weight"]
        print("stacked qkv:", tuple(qkv.shape))
        fresh = GPTModel(config.replace(seed=5))
        load_model_weights(tmp, fresh)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
        print("reloaded into a fresh model, bit-identical:", same)
        save_model_weights(model, tmp, crc_checksums=True)
        shard = Path(tmp) / "__0_0.distcp"
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
        try:
            load_model_weights(tmp, fresh)
            message = "no error"
        except ValueError as e:
            message = str(e)
        print("after flipping one byte:", message)
    assert same and torch.equal(qkv[1], model.decoder.layers[1].self_attention.linear_qkv.weight)
    assert torch.equal(plain["decoder.layers.mlp.linear_fc1.layer_norm_weight"][0],
                       model.decoder.layers[0].pre_mlp_layernorm.weight)
    assert "__0_0.distcp" in message and "corrupted" in message

# %% [markdown]
# ## Summary
#
# - A save is plan (collective) → write (local I/O only) → finalize (collective: rank 0 writes
#   `.metadata`, then `metadata.json`), Megatron's split of DCP's save; the fully parallel
#   save spreads the DP-replicated chunks over the DP ranks, as Megatron's training save does.
# - A bad request (a key missing, another shape, an unexpected key) is one `ValueError` line,
#   the same on every rank.
# - A load checks the index, the files and (when written) their checksums first, then asks DCP for this
#   layout's boxes and reads them into staging buffers; the model changes only when all of it
#   was read.
# - The directory is standard DCP: `dcp_to_torch_save` or `dcp.load` open it without tinytron.
#
# ## How production does it
#
# - Megatron-Core: `megatron/core/dist_checkpointing/serialization.py` (`save:300`, `load:54`),
#   `strategies/torch.py` (`MCoreSavePlanner`, `MCoreLoadPlanner`, `TorchDistSaveShardedStrategy`),
#   `strategies/state_dict_saver.py` (`save_state_dict_async_plan:41`,
#   `save_state_dict_async_finalize:213`), `validation.py:369` (sharding integrity); an optional
#   integrity manifest of SHA-256 hashes (`validation.py:521`).
# - PyTorch: `torch/distributed/checkpoint/` (`state_dict_saver.py`, `default_planner.py`,
#   `filesystem.py`, `format_utils.py`).
#
# ## Exercises
#
# 1. Make two ranks both write TP rank 0's norm and read the error DCP's global-plan validation
#    gives. Which Megatron check corresponds to it?
#
#    <details><summary>Hint</summary>
#
#    `is_main` on a `ShardedTensor` decides who writes a chunk;
#    set it on two ranks for the same box and let DCP's global plan reject the overlap. On
#    Megatron's side, look at the sharding-integrity validation in `validation.py`, cited
#    above.
#
#    </details>
#
# 2. With `thread_count=2`, how are the chunks split between `__R_0.distcp` and `__R_1.distcp`?
#
#    <details><summary>Answer</summary>
#
#    `dcp.FileSystemWriter` splits the rank's write items with
#    `_split_by_size_and_type` (`torch/distributed/checkpoint/filesystem.py`): the objects go to the
#    two files in turn, and the tensors, largest first, each go to the file with fewer bytes so
#    far. The two files end up about the same size.
#
#    </details>

