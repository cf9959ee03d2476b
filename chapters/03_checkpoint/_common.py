"""Shared plumbing of the checkpoint pages: gloo groups for checkpoint traffic, the loaded-state
container both formats fill before anything is applied, and access to an optimizer's state."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CheckpointGroups", "LoadedState", "main_state", "set_main_state", "is_sharded_optimizer",
           "save_file"]


class CheckpointGroups:
    """Gloo groups for checkpoint traffic (CPU objects and tensors, also under NCCL training)."""

    def __init__(self, grid):
        self.grid = grid
        self.distributed = (dist.is_available() and dist.is_initialized()
                            and grid.world_size > 1)
        # dp: the optimizer's shards (DP x CP); dp_only: the RNG states (DP alone, as Megatron)
        self.world = self.dp = self.dp_only = None
        self.rank = grid.global_rank
        if not self.distributed:
            return
        if grid.backend == "gloo":
            self.world, self.dp = dist.new_group(backend="gloo"), grid.group("dp_cp")
            self.dp_only = grid.group("dp")
            return
        # NCCL training: the same groups again on gloo, so plans and shards stay on the CPU.
        self.world = dist.new_group(backend="gloo")
        for axis, attr in (("dp_cp", "dp"), ("dp", "dp_only")):
            for ranks in grid.layout.groups[axis]:
                handle = dist.new_group(ranks, backend="gloo")
                if self.rank in ranks:
                    setattr(self, attr, handle)

    def destroy(self) -> None:
        """Destroy the groups made here (the training grid's own dp groups stay the grid's)."""
        made = [self.world] + ([self.dp] if self.dp is not self.grid.group("dp_cp") else [])
        made += [self.dp_only] if self.dp_only is not self.grid.group("dp") else []
        for handle in made:
            if handle is not None:
                dist.destroy_process_group(handle)
        self.world = self.dp = self.dp_only = None
        self.distributed = False

    @property
    def world_size(self) -> int:
        return self.grid.world_size if self.distributed else 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.world)

    def all_gather_object(self, obj, group="world") -> list:
        """Every rank's obj (in rank order of the group: "world", "dp" = DP x CP, "dp_only")."""
        g = {"world": self.world, "dp": self.dp, "dp_only": self.dp_only}[group]
        size = {"world": self.world_size, "dp": self.grid.size("dp_cp"),
                "dp_only": self.grid.size("dp")}[group]
        if not self.distributed or size == 1:
            return [obj]
        out = [None] * size
        dist.all_gather_object(out, obj, group=g)
        return out

    def broadcast_object(self, obj, src: int = 0):
        """Global rank `src`'s obj on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.world)
        return box[0]

    def gather_object(self, obj) -> list | None:
        """Every rank's obj on global rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.world)
        return out

    def scatter_object(self, objs: list | None):
        """objs[r] to rank r, from global rank 0."""
        if not self.distributed:
            return objs[0]
        out = [None]
        dist.scatter_object_list(out, objs if self.rank == 0 else None, src=0, group=self.world)
        return out[0]

    def all_agree(self, ok: bool) -> bool:
        """True when `ok` holds on every rank."""
        if not self.distributed:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.world)
        return bool(flag.item())

    def first_error(self, error: str | None) -> str | None:
        """The error of the lowest rank that has one, on every rank (None if none)."""
        errors = self.all_gather_object(error)
        return next((e for e in errors if e), None)


@dataclass
class LoadedState:
    """Everything a load read and checked, held aside until all of it is known to be good."""

    common: dict
    model: list = field(default_factory=list)            # (destination tensor, loaded tensor)
    optimizer_pieces: list = field(default_factory=list)  # (main param, {"param"?, state...})
    optimizer_state_dict: dict | None = None             # a whole optimizer.state_dict()
    param_groups: list | None = None                     # hyperparameters of this position
    rng: dict | None = None
    rerun: dict | None = None                            # this rank's rerun-machine state

    @torch.no_grad()
    def apply_model(self) -> None:
        for dst, src in self.model:
            dst.copy_(src)


def _state_store(optimizer, main) -> dict:
    """The torch.optim state dict that holds `main`'s state."""
    owners = getattr(optimizer, "_state_of", None)
    if owners is not None:
        return owners[id(main)]
    return optimizer.state


def main_state(optimizer, main) -> dict:
    """The optimizer state of one main (fp32) param ({} before the first step)."""
    return _state_store(optimizer, main).get(main, {})


def set_main_state(optimizer, main, state: dict) -> None:
    """Replace the optimizer state of one main param."""
    _state_store(optimizer, main)[main] = state


def is_sharded_optimizer(optimizer) -> bool:
    """True when DP ranks hold disjoint parts of the optimizer state (ZeRO-1, layer-wise)."""
    return type(optimizer).__name__ in ("DistributedOptimizer", "LayerWiseDistributedOptimizer")


class _RecordingFile:
    """A write-only file that remembers the OSError behind a failed write (torch.save hides it)."""

    def __init__(self, raw):
        self.raw, self.error = raw, None

    def write(self, b):
        try:
            return self.raw.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.raw.flush()


def save_file(obj, path) -> str | None:
    """torch.save + fsync to `path`, or a one-line error naming the file and the real cause."""
    with open(path, "wb") as raw:
        f = _RecordingFile(raw)
        try:
            torch.save(obj, f)
            raw.flush()
            os.fsync(raw.fileno())
            return None
        except (OSError, RuntimeError) as e:
            cause = f.error or e
            return f"writing {path} failed: {type(cause).__name__}: {cause}"
