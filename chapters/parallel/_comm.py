"""Collectives along any tensor dim over one grid axis; each is a no-op on a 1-rank group."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives (and warns on the old names); torch 2.11 has only the
# old ones. Same (output, input, ..., group=) signature either way.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x: torch.Tensor, grid, axis: str) -> torch.Tensor:
    """Sum `x` over `axis` into a new tensor (the input is left untouched)."""
    if grid.size(axis) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=grid.group(axis))
    return out


def split_dim(x: torch.Tensor, grid, axis: str, dim: int) -> torch.Tensor:
    """This rank's equal slice of `x` along `dim` (contiguous copy)."""
    size = grid.size(axis)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} is not divisible by {axis} size {size}")
    return x.chunk(size, dim=dim)[grid.rank(axis)].contiguous()


def all_gather_dim(x: torch.Tensor, grid, axis: str, dim: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in group-rank order."""
    size = grid.size(axis)
    if size == 1:
        return x
    x0 = x.movedim(dim, 0).contiguous()  # the flat collective gathers along dim 0
    out = torch.empty((size * x0.shape[0], *x0.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_flat(out, x0, group=grid.group(axis))
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, grid, axis: str, dim: int) -> torch.Tensor:
    """Sum over ranks, then keep this rank's equal slice along `dim`."""
    size = grid.size(axis)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} is not divisible by {axis} size {size}")
    x0 = x.movedim(dim, 0).contiguous()
    out = torch.empty((x0.shape[0] // size, *x0.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, x0, group=grid.group(axis))
    return out.movedim(0, dim)


def all_gather_dim_async(x: torch.Tensor, grid, axis: str, dim: int):
    """Start `all_gather_dim` without waiting; returns wait(), which gives the gathered tensor."""
    size = grid.size(axis)
    if size == 1:
        return lambda: x
    x0 = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * x0.shape[0], *x0.shape[1:]), dtype=x.dtype, device=x.device)
    handle = _all_gather_flat(out, x0, group=grid.group(axis), async_op=True)

    def wait() -> torch.Tensor:
        handle.wait()
        return out.movedim(0, dim)
    return wait


def reduce_scatter_dim_async(x: torch.Tensor, grid, axis: str, dim: int):
    """Start `reduce_scatter_dim` without waiting; returns wait(), which gives my summed slice."""
    size = grid.size(axis)
    if size == 1:
        return lambda: x
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} is not divisible by {axis} size {size}")
    x0 = x.movedim(dim, 0).contiguous()
    out = torch.empty((x0.shape[0] // size, *x0.shape[1:]), dtype=x.dtype, device=x.device)
    handle = _reduce_scatter_flat(out, x0, group=grid.group(axis), async_op=True)

    def wait() -> torch.Tensor:
        handle.wait()
        return out.movedim(0, dim)
    return wait
