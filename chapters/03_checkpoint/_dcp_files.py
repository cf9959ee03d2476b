"""File bookkeeping behind the torch_dist page (chapters/03_checkpoint/torch_dist.py).

The stream and file-system wrappers that count and checksum every byte DCP writes (and fire
the `mid_write` fault point), the CRC of a file written outside DCP, a durable small JSON file,
the checks that every file the index refers to exists and is long enough and that its CRC
matches `checksums.json`, reading DCP's index, unwrapping DCP's per-rank exception, and
finding the iteration directory of a weights-only load. The page explains each of them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import zlib
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from tinytron.checkpoint._common import CheckpointGroups
from tinytron.checkpoint.formats import (CHECKSUM_FILENAME, DCP_METADATA_FILENAME,
                                         METADATA_FILENAME, detect_format, fault_point)


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



def _root_cause(e: BaseException) -> BaseException:
    """The exception a rank raised inside DCP (DCP wraps it per rank as (exception, trace))."""
    failures = getattr(e, "failures", None) or {}
    for rank in sorted(failures):
        failure = failures[rank]
        return failure[0] if isinstance(failure, tuple) else failure
    return e.__cause__ if isinstance(e.__cause__, ValueError) else e



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



def _layout_args(chunks, grid) -> dict:
    """The `args` a legacy file carries: the model config and the layout."""
    import dataclasses

    return {"model_config": dataclasses.asdict(chunks[0].config),
            "tensor_model_parallel_size": grid.size("tp"),
            "pipeline_model_parallel_size": grid.size("pp")}
