"""Collective helpers for the buffers chapter: async launches, a CUDA side stream, a timeline.

Not a book page. The pages call these so that the same bucket code runs on CPU/gloo (the
collective runs in gloo's worker thread) and on CUDA/NCCL (the collective runs on a side
stream that first waits for the compute stream, as Megatron's communication stream does).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["axis_info", "Handles", "CommStream", "CommTimeline", "reduce_scatter", "all_gather",
           "all_reduce"]


def axis_info(grid, axis: str):
    """(group, size, rank) of ``axis`` on ``grid``; a missing grid or group means one rank."""
    if grid is None:
        return None, 1, 0
    size = grid.size(axis)
    if size <= 1:
        return None, max(size, 1), 0
    return grid.group(axis), size, grid.rank(axis)


@contextlib.contextmanager
def _quiet():
    # torch 2.13 renamed reduce_scatter_tensor/all_gather_into_tensor; 2.11 has only the old
    # names, so we keep them and silence the rename notice here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)
        yield


# gloo has no reduce-scatter of its own: torch emulates `reduce_scatter_tensor` with an
# all-reduce into a temporary copy of the whole input and copies my chunk out only inside
# `wait()` (so `is_completed()` stays False until then). When the output is my chunk of the
# input (always the case for the buckets), reducing the input in place gives the same chunk
# without the temporary, and a completion we can observe. Set to True to use torch's emulation.
native_gloo_reduce_scatter = False


def _is_my_chunk(output: torch.Tensor, input_: torch.Tensor, group) -> bool:
    n = output.numel()
    rank = dist.get_rank(group)
    return (input_.is_contiguous() and output.numel() * dist.get_world_size(group) == input_.numel()
            and output.data_ptr() == input_.data_ptr() + rank * n * input_.element_size())


def reduce_scatter(output: torch.Tensor, input_: torch.Tensor, op, group, async_op: bool):
    """Reduce ``input_`` over ``group`` and keep my chunk in ``output`` (may alias input)."""
    if (not native_gloo_reduce_scatter and dist.get_backend(group) == "gloo"
            and _is_my_chunk(output, input_, group)):
        return dist.all_reduce(input_, op=op, group=group, async_op=async_op)
    with _quiet():
        return dist.reduce_scatter_tensor(output, input_, op=op, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input_: torch.Tensor, group, async_op: bool):
    """Gather every rank's ``input_`` into ``output`` (``input_`` may be my chunk of it)."""
    with _quiet():
        return dist.all_gather_into_tensor(output, input_, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, op, group, async_op: bool):
    """In-place all-reduce of ``tensor`` over ``group``."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


class CommStream:
    """Where collectives are issued: a CUDA side stream on GPU, the calling thread on CPU."""

    def __init__(self, device: torch.device):
        self.stream = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)

    @contextlib.contextmanager
    def launch(self):
        """Run the enclosed launches after everything already queued on the compute stream."""
        if self.stream is None:
            yield
            return
        # The side stream must see the grads the backward kernels just wrote.
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def join(self):
        """Make the compute stream wait for the side stream (after the works were waited)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


@dataclass
class Handles:
    """The async works of one bucket group's collective; ``wait`` waits for all of them."""

    works: list
    stream: CommStream | None = None
    on_done: list = field(default_factory=list)

    def is_completed(self) -> bool:
        """True once every work has finished (never blocks)."""
        return all(w is None or w.is_completed() for w in self.works)

    def wait(self) -> None:
        """Block until every work is done; then the compute stream may read the results."""
        for w in self.works:
            if w is not None:
                w.wait()
        if self.stream is not None:
            self.stream.join()
        for fn in self.on_done:
            fn()


class CommTimeline:
    """Records (event, bucket_id, seconds) while a step runs; the pages draw it."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.events: list[tuple[str, int, float]] = []
        self._pending: dict[tuple[str, int], Handles] = {}

    def record(self, event: str, bucket_id: int) -> None:
        """Note that ``event`` happened to ``bucket_id`` now (and poll pending collectives)."""
        now = time.perf_counter() - self.t0
        self.events.append((event, bucket_id, now))
        self.poll()

    def watch(self, bucket_id: int, handles: Handles, event: str = "done") -> None:
        """Record ``event`` when a launched collective completes: by a future, else by polling."""
        try:
            futures = [w.get_future() for w in handles.works if w is not None]
        except RuntimeError:  # this work type has no future: poll at every later event
            self._pending[(event, bucket_id)] = handles
            self.poll()
            return
        if not futures:
            return
        remaining = [len(futures)]

        def one_done(_):
            remaining[0] -= 1  # callbacks run in the backend's thread, one at a time per work
            if remaining[0] == 0:
                self.events.append((event, bucket_id, time.perf_counter() - self.t0))

        for f in futures:
            f.then(one_done)

    def poll(self) -> None:
        """Record "done" for every watched collective that has completed since the last poll."""
        now = time.perf_counter() - self.t0
        for (event, bucket_id), handles in list(self._pending.items()):
            if handles.is_completed():
                self.events.append((event, bucket_id, now))
                del self._pending[(event, bucket_id)]

    def reset(self) -> None:
        """Forget all events and restart the clock."""
        self.t0 = time.perf_counter()
        self.events.clear()
        self._pending.clear()
