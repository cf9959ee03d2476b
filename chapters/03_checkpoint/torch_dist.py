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

import contextlib
import io
import json
import os
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tinytron.checkpoint._common import CheckpointGroups, save_file
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
# 2. **write** (no communication): rank 0 writes `common.pt` (Megatron writes it during the
#    planning, in the training process; here it moves to the background writer with the rest),
#    then each rank streams its chunks into `__R_0.distcp` and fsyncs it.
#    Here the stream also computes a CRC-32 of every byte written: DCP stores no checksums, and
#    `torch.load` does not notice a flipped byte inside a tensor. Writing them down is
#    tinytron's own option (`crc_checksums`, off by default, so that a default save is file
#    for file Megatron-Core's).
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
# disk. `_CRCStream` keeps a running CRC-32 and byte count, holds on to an `OSError` that
# `torch.save` would turn into an opaque `RuntimeError`, and is where the `mid_write` fault
# point fires.

# %%
class _CRCStream(io.RawIOBase):
    """A write-only file wrapper that keeps a running CRC-32 and byte count."""

    def __init__(self, raw, rank: int, armed: bool, fs_error, checksum: bool = True):
        self.raw, self.crc, self.size, self.rank, self.armed = raw, 0, 0, rank, armed
        self.fs_error, self.checksum = fs_error, checksum

    def writable(self):
        return True

    def write(self, b):
        view = memoryview(b).cast("B")
        try:
            n = self.raw.write(view)
        except OSError as e:   # torch.save turns it into an opaque RuntimeError: keep the cause
            self.fs_error(e)
            raise
        if self.checksum:
            self.crc = zlib.crc32(view[:n], self.crc)
        self.size += n
        if self.armed:
            fault_point("mid_write", self.rank)
        return n

    def tell(self):
        return self.raw.tell()

    def flush(self):
        self.raw.flush()

    def fileno(self):
        return self.raw.fileno()


# %% [markdown]
# `_ChecksumFS` wraps each stream opened for writing and records `[size, crc]` under the file's
# name when it closes. It also remembers the path it opened last, which is how a failed write
# or read names its file.

# %%
class _ChecksumFS(FileSystem):
    """DCP's file system with a CRC on every written file and the open path remembered."""

    def __init__(self, rank: int = 0, checksums: bool = True):
        super().__init__()
        self.sums, self.current, self.rank, self.armed, self.error = {}, None, rank, False, None
        self.checksums = checksums

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        self.current = Path(path)
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            wrapped = _CRCStream(stream, self.rank, self.armed, self._record, self.checksums)
            yield wrapped
            self.sums[Path(path).name] = [wrapped.size, wrapped.crc]

    def _record(self, error: OSError) -> None:
        self.error = error


# %% [markdown]
# Three helpers of the save: the CRC of a file written outside DCP (`common.pt`, `.metadata`),
# a small JSON file written durably, and the gap check that DCP lacks. DCP already refuses
# overlapping chunks, so chunks that add up to the tensor's size cover it exactly once.

# %%
def _file_crc(path: Path) -> list[int]:
    """[size, crc32] of a file, read in 8 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return [size, crc]


def _write_json(path: Path, obj) -> None:
    """Write and fsync a small JSON file."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _check_tiling(plans: list[SavePlan]) -> None:
    """Every tensor fully covered by its written chunks (DCP itself checks only overlaps)."""
    covered, size = {}, {}
    for plan in plans:
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                covered[item.index.fqn] = covered.get(item.index.fqn, 0) + \
                    item.tensor_data.chunk.sizes.numel()
                size[item.index.fqn] = item.tensor_data.size.numel()
    for key, n in covered.items():
        if n < size[key]:
            raise ValueError(f"key {key!r}: the written chunks cover {n} of {size[key]} elements "
                             "(no rank wrote the rest)")


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
# run the middle one somewhere else. Only main replicas are kept: every global element is
# written once. `plan` is the first collective: every rank's local plan goes to rank 0, which
# checks the tiling, builds the global plan and scatters each rank its part, or, when a check
# fails, the same error message to every rank, so that no rank is left waiting.

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
        self.fs = _ChecksumFS(self.comm.rank, self.checksums)
        # per_thread_copy_ahead=0: DCP's overlapping loader would open CUDA streams, which a
        # forked writer must not touch; the chunks it writes are host copies already.
        self.writer = dcp.FileSystemWriter(self.directory, thread_count=self.thread_count,
                                           overwrite=True, per_thread_copy_ahead=0)
        self.writer.fs = self.fs
        self.planner = _SavePlanner(self.tensors, self.objects)
        coordinator = self.comm.rank == 0
        self.planner.set_up_planner({}, self.writer.storage_meta(), coordinator)
        self.writer.set_up_storage_writer(coordinator, rank=self.comm.rank)
        local = self.writer.prepare_local_plan(self.planner.create_local_plan())
        plans = self.comm.gather_object(local)
        central = None
        if coordinator:   # a failure here must reach every rank through the scatter
            try:
                _check_tiling(plans)
                plans, self.metadata = self.planner.create_global_plan(plans)
                central = self.writer.prepare_global_plan(plans)
            except (ValueError, OSError) as e:
                central = [f"{self.directory}: {e}"] * self.comm.world_size
        mine = self.comm.scatter_object(central)
        if isinstance(mine, str):
            raise CheckpointSaveError(mine)
        self.final_plan = self.planner.finish_plan(mine)


# %% [markdown]
# `write` talks to no other rank, which is what lets it run in a forked process: it returns
# its outcome (the write results and checksums, or an error message naming the file) instead
# of raising. `finalize` is the second collective: the outcomes meet on rank 0, which writes
# the index, the checksums and `metadata.json`, in that order, and then calls the commit; every
# rank gets the same verdict back.

# %%
class SaveRequest(SaveRequest):  # the same class, continued
    __doc__ = SaveRequest.__doc__  # help() keeps the first cell's docstring

    def write(self) -> dict:
        """No communication: common.pt (rank 0), this rank's .distcp; {'results', ...} or {'error'}."""
        t0 = time.perf_counter()
        sums = {}
        if self.comm.rank == 0 and self.common is not None:
            path = self.directory / COMMON_FILENAME
            error = save_file(self.common, path)
            if error:
                return {"error": error}
            sums[COMMON_FILENAME] = _file_crc(path) if self.checksums else None
        fault_point("before_write", self.comm.rank)
        try:
            self.fs.armed = True   # the mid_write fault point is live while shards are written
            results = self.writer.write_data(self.final_plan, self.planner).wait()
        except Exception as e:  # noqa: BLE001 - reported to every rank by finalize
            self.fs.armed = False
            where, cause = self.fs.current or self.directory, self.fs.error or e
            return {"error": f"writing {where} failed: {type(cause).__name__}: {cause}"}
        self.fs.armed = False
        if len(results) != len(self.final_plan.items):
            return {"error": f"writing {self.directory}: {len(self.final_plan.items) - len(results)}"
                             " items were not written (a writer thread failed)"}
        return {"results": results, "sums": {**sums, **self.fs.sums},
                "seconds": time.perf_counter() - t0}

    def finalize(self, outcome: dict, on_complete=None) -> str | None:
        """Collective: rank 0 writes .metadata, checksums.json, metadata.json; same verdict everywhere."""
        fault_point("before_finalize", self.comm.rank)
        outcomes = self.comm.gather_object(outcome)
        error = None
        if self.comm.rank == 0:
            error = next((o["error"] for o in outcomes if o.get("error")), None)
            if error is None:
                error = self._finish(outcomes, on_complete)
        return self.comm.broadcast_object(error)

    def _finish(self, outcomes: list[dict], on_complete) -> str | None:
        """Rank 0: the index, the checksums, then metadata.json; then the caller's commit."""
        try:
            self.writer.finish(self.metadata, [o["results"] for o in outcomes])
            sums = {name: s for o in outcomes for name, s in o["sums"].items()}
            if self.checksums:
                sums[DCP_METADATA_FILENAME] = _file_crc(self.directory / DCP_METADATA_FILENAME)
                _write_json(self.directory / CHECKSUM_FILENAME, {"algorithm": "crc32",
                                                                 "files": sums})
            fault_point("before_metadata_json")
            _write_json(self.directory / METADATA_FILENAME, MEGATRON_METADATA)
            if on_complete is not None:
                on_complete()
        except OSError as e:
            return f"finalizing {self.directory} failed: {type(e).__name__}: {e}"
        return None


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
            meta = md.get(t.key)
            if not isinstance(meta, TensorStorageMetadata):
                raise ValueError(f"{self.where}: the checkpoint has no tensor {t.key!r}")
            if tuple(meta.size) != tuple(t.global_shape):
                raise ValueError(f"{self.where}: {t.key!r} has global shape {tuple(meta.size)} in "
                                 f"the checkpoint, the model needs {tuple(t.global_shape)}")
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
# The cheap checks come before DCP reads a byte: every file the index points into exists and
# is long enough (a truncated file would otherwise fail deep inside DCP's reader), the files'
# CRCs match (each rank verifies its share, and `first_error` tells all of them), and the
# index itself unpickles.

# %%
def _check_files(directory: Path, metadata) -> None:
    """Every file the index refers to exists and holds at least the bytes it should."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{path}: missing")
        if path.stat().st_size < size:
            raise ValueError(f"{path}: truncated ({path.stat().st_size} bytes, the index needs "
                             f"at least {size})")


def _verify_checksums(directory: Path, comm: CheckpointGroups) -> None:
    """CRC of every file listed in checksums.json (files split over ranks); ValueError on a mismatch."""
    path = directory / CHECKSUM_FILENAME
    if not path.is_file():
        return
    files = sorted(json.loads(path.read_text())["files"].items())
    error = None
    for name, (size, crc) in files[comm.rank::comm.world_size]:
        got = _file_crc(directory / name) if (directory / name).is_file() else None
        if got != [size, crc]:
            error = (f"{directory / name}: content does not match {CHECKSUM_FILENAME} "
                     f"(corrupted or truncated)")
            break
    error = comm.first_error(error)
    if error:
        raise ValueError(error)


def read_dcp_index(directory: Path):
    """DCP's index of a torch_dist directory, or ValueError naming the file."""
    detect_format(directory)
    path = directory / DCP_METADATA_FILENAME
    if not path.is_file():
        raise ValueError(f"{path}: missing")
    try:
        return dcp.FileSystemReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001 - an unreadable index is a bad checkpoint
        raise ValueError(f"{path}: cannot be read ({type(e).__name__}: {e})") from e


# %% [markdown]
# What the model asks for is checked against the index on every rank *before* DCP starts,
# and the ranks agree on the first error (`first_error`): every rank raises the same one-line
# `ValueError` naming the key, the shape saved and the shape expected. Left to DCP, a
# planner's error would arrive as DCP's `CheckpointException` — a `BaseException`, not an
# `Exception`, with every failing rank's traceback in its text — on some ranks only.
# With `strict`, a model tensor the checkpoint has and no rank asks for is an error too
# (the optimizer's `optimizer.…` keys are not model tensors): the ranks first share the keys
# they ask for, since each pipeline stage asks only for its own.

# %%
def _check_request(directory: Path, metadata, tensors, objects,
                   asked_anywhere: set | None = None) -> str | None:
    """The first key that is missing, has another global shape, or (given the keys every rank
    asks for) that no rank asks for."""
    md = metadata.state_dict_metadata
    for t in tensors:
        meta = md.get(t.key)
        if not isinstance(meta, TensorStorageMetadata):
            return (f"{directory}: the checkpoint has no tensor {t.key!r} (the model needs "
                    f"global shape {tuple(t.global_shape)})")
        if tuple(meta.size) != tuple(t.global_shape):
            return (f"{directory}: {t.key!r} has global shape {tuple(meta.size)} in the "
                    f"checkpoint, the model needs {tuple(t.global_shape)}")
    for o in objects:
        if not isinstance(md.get(o.unique_key), BytesStorageMetadata):
            return f"{directory}: the checkpoint has no object {o.unique_key!r}"
    if asked_anywhere is not None:
        for key, meta in sorted(md.items()):
            if (isinstance(meta, TensorStorageMetadata) and key not in asked_anywhere
                    and not key.startswith("optimizer.")):
                return (f"{directory}: the checkpoint has tensor {key!r} of global shape "
                        f"{tuple(meta.size)}, which the model does not have")
    return None


# %% [markdown]
# `read_sharded` runs those checks, then DCP's load with the planner above. A failure inside
# DCP's load is wrapped in a per-rank `CheckpointException`; `_root_cause` unwraps the
# lowest failing rank's exception, so that the error a user sees names the file and not DCP's
# machinery. `read_common` reads the non-tensor part, with `weights_only=True` like every load
# of this book.

# %%
def _root_cause(e: BaseException) -> BaseException:
    """The exception a rank raised inside DCP (DCP wraps it per rank as (exception, trace))."""
    failures = getattr(e, "failures", None) or {}
    for rank in sorted(failures):
        failure = failures[rank]
        return failure[0] if isinstance(failure, tuple) else failure
    return e.__cause__ if isinstance(e.__cause__, ValueError) else e


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
# 0.16.1's save; its default of two writer threads per rank, `__0_0.distcp` and `__0_1.distcp`, is
# `thread_count=2` here, while Megatron at e03878b5f writes one,
# `megatron/core/dist_checkpointing/strategies/torch.py:600`) — or, with `format="torch"`, one
# legacy `model_optim_rng.pt` per (TP, PP) position. `load_model_weights(path, model)` reads
# either format (a root with a tracker or an iteration directory) into a model on **any** layout
# for `torch_dist`. Call both on every rank of the model.

# %%
def _model_dir(path: Path) -> Path:
    """An iteration directory: `path` itself, or the one its tracker names."""
    from tinytron.checkpoint.formats import resolve_checkpoint_dir

    path = Path(path)
    if (path / METADATA_FILENAME).is_file() or any(path.glob("mp_rank_0*")):
        return path
    found = resolve_checkpoint_dir(path)
    if found is None:
        raise ValueError(f"{path}: neither a checkpoint directory nor a root with a tracker")
    return found[0]


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


def _layout_args(chunks, grid) -> dict:
    """The `args` a legacy file carries: the model config and the layout."""
    import dataclasses

    return {"model_config": dataclasses.asdict(chunks[0].config),
            "tensor_model_parallel_size": grid.size("tp"),
            "pipeline_model_parallel_size": grid.size("pp")}


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
# 2. With `thread_count=2`, how are the chunks split between `__R_0.distcp` and `__R_1.distcp`?
