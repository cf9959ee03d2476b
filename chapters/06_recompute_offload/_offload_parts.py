"""Chapter 06's offload plumbing: layout-keeping copies, the side streams, the slot records (not a page).

The page `offload.py` keeps the mechanism (the buffer pool, the groups, the pack/unpack
hooks, the handler and the manager); what is here copies bytes, hides the CUDA streams behind
no-ops on a CPU, and names the records a slot holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch


def _memory_order(t: torch.Tensor) -> list[int]:
    """t's dims from outermost to innermost in memory (a transposed view is not contiguous)."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def _to_host(buffer, t: torch.Tensor) -> None:
    """Copy t, laid out in its own memory order, into a host buffer (asynchronous on CUDA)."""
    dense = t.detach().permute(_memory_order(t)).contiguous()
    if isinstance(buffer, torch.Tensor):
        buffer.copy_(dense, non_blocking=True)
    else:
        np.copyto(buffer, dense.view(torch.uint8).reshape(-1).numpy())


def _to_device(buffer, shape, dtype, device, order: list[int]) -> torch.Tensor:
    """A device tensor with the host data, given back t's strides (so kernels, and rounding, match)."""
    permuted_shape = [shape[d] for d in order]
    if isinstance(buffer, torch.Tensor):
        out = torch.empty(permuted_shape, dtype=dtype, device=device)
        out.copy_(buffer, non_blocking=True)
    else:
        out = torch.from_numpy(buffer).clone().view(dtype).view(permuted_shape)
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    return out.permute(inverse)


class _Streams:
    """The D2H and H2D side streams on CUDA; on CPU, nothing (every copy is synchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None

    def on(self, stream):
        """Context that makes `stream` current (CUDA) or does nothing (CPU)."""
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def follow_compute(self, stream) -> None:
        """Make a side stream wait for the work queued so far on the compute stream."""
        if self.cuda:
            stream.wait_stream(torch.cuda.current_stream())

    def record(self, stream):
        """An event marking the work queued so far on `stream` (None on CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event, stream=None) -> None:
        """Make `stream` (default: the current one) wait for `event`."""
        if event is not None:
            (stream or torch.cuda.current_stream()).wait_event(event)


@dataclass(frozen=True)
class _Tag:
    group: OffloadGroup
    slot: int


@dataclass
class _HostRecord:
    buffer: object
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    order: list


def _identity(t: torch.Tensor) -> tuple:
    """Two saved tensors with this key are the same data (one copy serves both)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def _is_parameter_data(t: torch.Tensor) -> bool:
    """A parameter or a view of one (e.g. the transposed weight a linear layer saves)."""
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)
