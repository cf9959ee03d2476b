"""Staging a save's chunks into host memory while training goes on (chapter 03, async save).

`HostStaging` owns one save's host copies: it allocates them, starts the copies in the
background (a worker thread for CPU tensors, a side CUDA stream into pinned buffers for device
tensors) and answers the two questions the saver asks: are the copies complete (`wait`, for the
writer), and may the optimizer overwrite the sources now (`fence`, for the training loop).
`PinnedPool` keeps pinned buffers from one save to the next: pinning a gigabyte costs far more
than copying into it.
"""

from __future__ import annotations

import threading
import time

import torch

from tinytron.checkpoint.formats import CheckpointSaveError, fault_point
from tinytron.checkpoint.sharded_keys import ShardedTensor

__all__ = ["HostStaging", "PinnedPool"]


def _host_strides(src: torch.Tensor) -> tuple[int, ...]:
    """The strides a host copy of `src` gets (src's own when dense, else contiguous), as clone()."""
    return torch.empty_like(src, device="meta").stride()


class PinnedPool:
    """Pinned host buffers by (shape, strides, dtype), reused across saves of one run."""

    def __init__(self):
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, src: torch.Tensor) -> torch.Tensor:
        key = (tuple(src.shape), _host_strides(src), src.dtype)
        bucket = self.free.get(key)
        if bucket:
            return bucket.pop()
        return torch.empty_strided(key[0], key[1], dtype=key[2], device="cpu", pin_memory=True)

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        for b in buffers:
            if b.is_pinned():
                self.free.setdefault((tuple(b.shape), b.stride(), b.dtype), []).append(b)


class HostStaging:
    """Host copies of a save's chunks, filled in the background; the writer writes `staged`."""

    def __init__(self, tensors: list[ShardedTensor], rank: int, pool: PinnedPool | None = None):
        self.rank, self.pool, self.error = rank, pool, None
        self.sources = [t.data for t in tensors]
        self.buffers = []
        for src in self.sources:
            if src.is_cuda:
                self.buffers.append((pool or PinnedPool()).take(src))
            else:   # not touched yet: the worker thread pays for the page faults
                self.buffers.append(torch.empty_strided(src.shape, _host_strides(src),
                                                        dtype=src.dtype, device="cpu"))
        self.staged = [ShardedTensor(t.key, b, t.global_shape, t.global_offset, t.is_main)
                       for t, b in zip(tensors, self.buffers)]
        cuda = [s for s in self.sources if s.is_cuda]
        self.device = cuda[0].device if cuda else None
        self.thread = self.event = None
        self.started_at = self.complete_at = None
        self.fenced = False

    def start(self) -> None:
        """Start every copy; return at once."""
        self.started_at = time.perf_counter()
        cuda = [(b, s) for b, s in zip(self.buffers, self.sources) if s.is_cuda]
        if cuda:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))   # after the step's kernels
            with torch.cuda.stream(stream):
                for dst, src in cuda:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(stream)   # a temporary source is not reused too early
            self.event = torch.cuda.Event()
            self.event.record(stream)
        self.thread = threading.Thread(target=self._copy_cpu, daemon=True,
                                       name="tinytron-ckpt-staging")
        self.thread.start()

    def _copy_cpu(self) -> None:
        pairs = [(b, s) for b, s in zip(self.buffers, self.sources) if not s.is_cuda]
        try:
            with torch.no_grad():
                for i, (dst, src) in enumerate(pairs):
                    if i == len(pairs) // 2:
                        fault_point("during_staging", self.rank)
                    dst.copy_(src)
        except Exception as e:  # noqa: BLE001 - becomes the writer's outcome, on every rank
            self.error = f"staging the checkpoint in host memory failed: {type(e).__name__}: {e}"

    def done(self) -> bool:
        """True when every copy is complete (never blocks)."""
        return (not self.thread.is_alive()) and (self.event is None or self.event.query())

    def wait(self, timeout_s: float | None = None) -> None:
        """Block this thread until every copy is complete (the writer's wait), or set `error`
        after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._join(deadline, timeout_s)
        if self.event is not None and deadline is None:
            self.event.synchronize()
        while self.event is not None and not self.event.query() and self.error is None:
            if time.monotonic() >= deadline:
                self.error = self._late("the device-to-host copies", timeout_s)
            time.sleep(0.001)
        if self.complete_at is None and self.error is None:
            self.complete_at = time.perf_counter()

    def _join(self, deadline: float | None, timeout_s: float | None) -> None:
        self.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            self.error = self._late("the staging thread", timeout_s)

    def _late(self, what: str, timeout_s: float | None) -> str:
        return (f"timed out: {what} of a checkpoint did not finish within {timeout_s:g} s "
                "(checkpoint.async_timeout_s)")

    def fence(self, timeout_s: float | None = None) -> None:
        """Make it safe for the training step to overwrite the sources.

        CPU copies: wait for the worker thread. CUDA copies: the current stream waits for the
        side stream's event (the host does not block; the optimizer's kernels queue behind the
        copies). A stream of the step's own that writes a source must first wait for the
        current stream, as the CPU-offload optimizer's upload stream does (chapter 02)."""
        self._join(None if timeout_s is None else time.monotonic() + timeout_s, timeout_s)
        if self.error is not None and self.thread.is_alive():
            raise CheckpointSaveError(self.error)   # the optimizer must not overwrite a source
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        self.fenced = True

    def seconds(self) -> float:
        """From the start of the copies until a `wait` saw them complete."""
        return (self.complete_at or self.started_at) - self.started_at

    def release(self) -> None:
        """After the write: pinned buffers go back to the pool; nothing else is kept."""
        if self.pool is not None:
            self.pool.give_back(self.buffers)
        self.sources = self.buffers = self.staged = []


def staged_timeline_demo(root: str) -> dict:
    """One process: a sync save, then a staged thread-mode save behind a forward and backward.

    Returns the spans of a timeline, the seconds, and whether the staged checkpoint's shard file
    and common.pt are byte for byte the synchronous save's."""
    from pathlib import Path

    from tinytron.checkpoint._workers import _timeline_model
    from tinytron.checkpoint.resume import CheckpointConfig, CheckpointManager
    from tinytron.parallel import ParallelGrid

    config, model, opt, state, step = _timeline_model()
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_length + 1),
                           generator=torch.Generator().manual_seed(1))
    step()
    grid, t0, events = ParallelGrid.single(), time.perf_counter(), []

    def span(label, row, fn):
        start = time.perf_counter() - t0
        out = fn()
        events.append((label, row, start, time.perf_counter() - t0))
        return out

    span("sync save", "training", lambda: CheckpointManager(
        CheckpointConfig(save=f"{root}/sync"), grid).save(state, model, opt))
    manager = CheckpointManager(CheckpointConfig(save=f"{root}/staged", async_save=True,
                                                 async_mode="thread"), grid)
    manager.saver.before_optimizer_step()   # as the loop has done before every step
    stats = span("async: schedule", "training", lambda: manager.save(state, model, opt))
    staging = manager.saver.pending.staging
    span("forward + backward", "training",
         lambda: model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward())
    span("wait before optimizer.step", "training", manager.saver.before_optimizer_step)
    span("optimizer.step", "training", opt.step)
    start = staging.started_at - t0
    events.append(("copy to host", "staging thread", start, start + staging.seconds()))
    done = manager.finalize(blocking=True)
    begin = staging.complete_at - t0
    events.append(("async: background write", "staging thread", begin,
                   begin + done["background_s"]))
    same = all((Path(root, "sync", "iter_0000001", f).read_bytes() ==
                Path(root, "staged", "iter_0000001", f).read_bytes())
               for f in ("__0_0.distcp", "common.pt"))
    sync_s = events[0][3] - events[0][2]
    return {"events": events, "sync_s": sync_s, "stats": stats, "same_files": same}
