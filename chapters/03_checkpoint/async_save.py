# %% [markdown]
# # 03 · Checkpoint: saving in the background
#
# [Resharding](resharding.py) made a checkpoint readable on any layout; writing it still stops
# training for as long as the slowest rank takes to write its bytes. An asynchronous save
# writes them in the background while training goes on, and the checkpoint becomes visible
# only once every rank has finished. What is left for training to wait for is the
# **snapshot**, a copy of the state as it was at the save's iteration. On this page the
# snapshot is taken before the save returns, as Megatron takes it (a device-to-host copy,
# then a fork); [the next page](staged_copy.py) moves that copy behind the next forward and
# backward. This page builds the writer, the queue and the collective finalize, and measures
# what training waits for.
#
# You will build: `stage_tensors`, the background writer (a forked process or a thread, every
# wait bounded), `AsyncSaver` (schedule, poll, finalize), `save_timeline`.

# %%
from __future__ import annotations

import logging
import os
import pickle
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch

from tinytron.checkpoint._common import CheckpointGroups
from tinytron.checkpoint._staging import HostStaging
from tinytron.checkpoint.formats import CheckpointSaveError, fault_point
from tinytron.checkpoint.sharded_keys import ShardedTensor
from tinytron.checkpoint.torch_dist import SaveRequest

__all__ = ["stage_tensors", "AsyncSaver", "save_timeline", "ASYNC_MODES", "WRITER_TIMEOUT_S"]

logger = logging.getLogger("tinytron.checkpoint")

ASYNC_MODES = ("process", "thread")
WRITER_TIMEOUT_S = 600.0   # Megatron's default collective timeout, 10 minutes


# %% [markdown]
# ## The stages, as Megatron runs them
#
# Megatron's async save (`--async-save`, `torch_dist` only, `checkpointing.py:598`) splits a
# save across time (`strategies/async_utils.py`, `training/async_utils.py`):
#
# ```mermaid
# sequenceDiagram
#   participant T as training process (every rank)
#   participant W as writer (background)
#   participant R0 as rank 0
#   T->>T: sharded state dict, DCP plan (collective, tiling validated)
#   T->>W: snapshot: D2H copy (GPU) / fork (CPU), start the writer
#   Note over T: back to training: iteration k+1, k+2, ...
#   W->>W: write common.pt (rank 0), __R_0.distcp, fsync
#   T->>T: start of every iteration: is my writer done? all-reduce(min) over ranks
#   T->>R0: all done: gather write results (collective)
#   R0->>R0: .metadata, (checksums.json if crc_checksums), metadata.json, rename iter_….tmp, tracker
# ```
#
# 1. **Synchronous part** (in the training step): build the sharded state dict and run the
#    DCP planning collective — the same as a synchronous save up to here. (Megatron also writes
#    `common.pt` here; with its fsync that can take a noticeable fraction of a second on a busy
#    disk, so tinytron leaves it to the writer.)
# 2. **Snapshot**: the training step will overwrite parameters and optimizer state in place,
#    so the writer needs a copy frozen at this moment. On a GPU Megatron copies device to host
#    into pinned memory (`preload_tensors`, `filesystem_async.py:227`) and blocks until the
#    copy is done (`torch.cuda.synchronize()` before the fork, `async_utils.py:273`; the
#    persistent caller waits on a queue instead, `:424`), and so does `stage_tensors` below
#    ([the next page](staged_copy.py) stages the copy behind the next forward and backward
#    instead). On a CPU the cheapest snapshot is `fork()`: the child process sees the
#    parent's memory as it was at the fork, copy-on-write, so nothing is copied unless
#    training writes to a page before the child has saved it — the technique Redis uses for
#    its background saves. Megatron's
#    `TemporalAsyncCaller` (`async_utils.py:237`) forks its writer for the same reason. The
#    `thread` mode copies every tensor instead and writes from a thread.
# 3. **Write** in the background: the child writes `common.pt` (rank 0), streams the chunks
#    into `__R_0.distcp` and fsyncs.
#    It runs no collective: all communication stays in the training process.
# 4. **Finalize**: at the start of each iteration the loop calls `finalize(blocking=False)`:
#    each rank checks its own writer, one integer all-reduce tells whether *all* are done
#    (Megatron's `sync_all_async_calls`, `async_utils.py:214`), and only then the results are
#    gathered, rank 0 writes the index and `metadata.json` and commits (rename, tracker). At
#    exit the loop calls `finalize(blocking=True)`.
#
# At most one save is in flight: scheduling a second one first finalizes the first, blocking.
#
# <details><summary>Megatron detail: several saves in flight</summary>
#
# Megatron's queue holds several saves in flight: `AsyncCallsQueue` keeps them in a deque
# (`megatron/core/dist_checkpointing/strategies/async_utils.py:612`, the deque `:622`),
# `schedule_async_request` appends a new one without waiting for the others (`:665`), and
# `maybe_finalize_async_calls` finalizes them oldest first, as many as are done (`:688-695`).
# tinytron's `AsyncSaver` holds one: a save scheduled while another is still writing first
# waits for that one to finish (`finalize(blocking=True)` at the top of `schedule`). With a
# save interval longer than a background write, as in this chapter's demos, the two behave the
# same; with saves closer together than a write takes, Megatron's training continues while
# tinytron's blocks until the earlier save is complete.
#
# </details>
#
# A writer that fails or dies (SIGKILL, a full disk) is a failed save on every rank: the
# staging directory is never renamed and the tracker keeps naming the previous checkpoint.
# The legacy format has no async path, in Megatron either (`checkpointing.py:598-600`).
#
# `stage_tensors` takes that snapshot: a pinned host copy of every CUDA chunk, a clone of
# every CPU chunk in `thread` mode, and nothing at all for a CPU `fork`.

# %%
def stage_tensors(tensors: list[ShardedTensor], mode: str) -> list[ShardedTensor]:
    """A frozen copy of the chunks for a background writer (no copy for a CPU fork)."""
    cuda = [t for t in tensors if t.data.is_cuda]
    out = []
    for t in tensors:
        if t.data.is_cuda:
            host = torch.empty(t.data.shape, dtype=t.data.dtype, pin_memory=True)
            host.copy_(t.data, non_blocking=True)
            data = host
        elif mode == "thread":
            data = t.data.clone()
        else:
            data = t.data   # fork() is the snapshot
        out.append(ShardedTensor(t.key, data, t.global_shape, t.global_offset, t.is_main))
    if cuda:
        torch.cuda.synchronize()
    return out


# %% [markdown]
# In `process` mode the child process runs `_forked_write`: it writes, leaves the outcome in a
# file for the parent, and exits without running any of the parent's exit handlers.

# %%
def _forked_write(request: SaveRequest, outcome_path: str) -> None:
    """Body of the forked writer: write, leave the outcome in a file, exit at once."""
    code = 0
    try:
        torch.set_num_threads(1)   # before any torch op: OpenMP's pool did not survive the fork
        outcome = request.write()
        with open(outcome_path, "wb") as f:
            pickle.dump(outcome, f)
    except BaseException:  # noqa: BLE001 - the parent reports a writer without an outcome
        code = 1
    finally:
        os._exit(code)   # no atexit handlers, no process-group teardown in the child


# %% [markdown]
# Two small helpers for the parent: wait a bounded time for the child's exit status, and the
# one-line error of a writer that did not finish in time.

# %%
def _reap_within(pid: int, timeout_s: float) -> int | None:
    """The child's exit status, or None if it still runs after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (reaped := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    return reaped[1] if reaped[0] else None


def _timed_out(request: SaveRequest, timeout_s: float, who: str) -> dict:
    return {"error": f"timed out: the background checkpoint writer ({who}) of "
                     f"{request.directory} did not finish within {timeout_s:g} s "
                     "(checkpoint.async_timeout_s)"}


# %% [markdown]
# `_Writer` owns one background write. In `process` mode it forks, and the child runs
# `_forked_write` above and never comes back. The parent polls it without blocking
# (`waitpid(WNOHANG)`), which is what lets `finalize(blocking=False)` cost nothing while the
# write goes on; the outcome travels back through a small file, since nothing the child
# changes in its memory is seen by the parent. A child that died before leaving one (SIGKILL,
# the out-of-memory killer) is reported with its exit code.
#
# **A fork copies memory, not threads.** PyTorch's CPU kernels split large loops (above
# 32,768 elements) over an OpenMP pool; the child inherits libgomp's record that the pool's
# threads exist, but only the forking thread was copied. Its first parallel loop hands work
# to threads that are not there and waits at a barrier forever. The writer has such loops:
# DCP clones every tensor that views a larger storage before writing it
# (`torch/distributed/checkpoint/filesystem.py`), as the distributed optimizer's shards do.
# So `configs/tiny.toml` with the distributed optimizer, `process` mode and
# `OMP_NUM_THREADS=2` printed "iteration 2 queued" and never wrote the checkpoint. The child
# now calls `torch.set_num_threads(1)` first: with one thread ATen runs every loop inline and
# never enters libgomp, and one thread copies as fast as the disk writes.
#
# <details><summary>Why not a <code>spawn</code> child</summary>
#
# A `spawn` child would start clean but see none of the parent's memory: every tensor copied
# into shared memory first (the copy this mode exists to avoid) and torch imported per save,
# unless the worker persists, as Megatron's `PersistentAsyncCaller` does
# (`async_utils.py:349`).
#
# </details>
#
# **Every wait on the writer is bounded.** Megatron's are not (`process.join()`,
# `async_utils.py:336`), and without a bound a stuck writer (a hung mount) hangs the exit
# path too: SIGTERM saves, then waits for the save in flight. `finalize` and the wait before
# the next step give up after `async_timeout_s` (600 s, Megatron's default collective
# timeout, `megatron/training/config/common_config.py:77`): a forked writer is killed, a
# thread abandoned, and the save fails on every rank in one line naming what timed out.
#
# In `thread` mode the writer's thread writes. When the copy was staged behind the next step
# ([next page](staged_copy.py)) it first waits for the copies; a staging that failed becomes
# the outcome.

# %%
def _thread_write(w: _Writer) -> None:
    """Body of the writer thread: wait for the host copies, then write."""
    if w.staging is not None:
        if not w.staging.error:   # a staging that timed out is not waited for again
            w.staging.wait()
        if w.staging.error:
            w.outcome = {"error": w.staging.error}
            return
    w.outcome = w.request.write()


# %% [markdown]
# In `process` mode, the parent's side of a forked write: reap the child within the bound (or
# kill it), then read the outcome it left, or report how it died.

# %%
def _process_outcome(w: _Writer, timeout_s: float) -> dict:
    """A forked writer's outcome; waits at most `timeout_s` for it (then an error outcome)."""
    if w.status is None:
        w.status = _reap_within(w.pid, timeout_s)
    if w.status is None:   # still writing: end it, or it writes on into the staging dir
        os.kill(w.pid, signal.SIGKILL)
        w.status = os.waitpid(w.pid, 0)[1]
        os.remove(w.outcome_path)
        return _timed_out(w.request, timeout_s, f"process {w.pid} (killed)")
    try:
        with open(w.outcome_path, "rb") as f:
            w.outcome = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        code = os.waitstatus_to_exitcode(w.status)
        w.outcome = {"error": f"writer process for {w.request.directory} died "
                              f"(exit code {code})"}
    finally:
        if os.path.exists(w.outcome_path):
            os.remove(w.outcome_path)
    return w.outcome


# %% [markdown]
# The writer: it forks or starts a thread, answers `done` without blocking, and gives its
# outcome with `result`.

# %%
class _Writer:
    """One background write, in a forked process or a thread (after its staging, if any)."""

    def __init__(self, request: SaveRequest, mode: str, staging: HostStaging | None = None):
        self.request, self.mode, self.outcome, self.staging = request, mode, None, staging
        if mode == "process":   # the host copies are complete: the child sees them as they are
            fd, self.outcome_path = tempfile.mkstemp(prefix="tinytron-ckpt-", suffix=".pkl")
            os.close(fd)
            self.pid, self.status = os.fork(), None
            if self.pid == 0:
                _forked_write(request, self.outcome_path)
        else:
            self.thread = threading.Thread(target=_thread_write, args=(self,), daemon=True)
            self.thread.start()

    def done(self) -> bool:
        """True when the write finished (or failed)."""
        if self.mode == "thread":
            return not self.thread.is_alive()
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
        return self.status is not None

    def result(self, timeout_s: float) -> dict:
        """The writer's outcome; waits at most `timeout_s` for it (then an error outcome)."""
        if self.mode == "thread":
            self.thread.join(timeout_s)
            alive = self.thread.is_alive()
            return _timed_out(self.request, timeout_s, "thread") if alive else self.outcome
        return _process_outcome(self, timeout_s)



# %% [markdown]
# ## The queue
#
# `AsyncSaver.schedule(request, on_complete)` runs the synchronous part and starts the writer;
# `finalize(blocking)` is the per-iteration poll. Every call is made on every rank (the
# decisions are collective), and `finalize` returns the statistics of a save it completed —
# the time training was blocked in `schedule`, how long the background write took — which
# the caller logs.
#
# `AsyncSaver` is put together from two whole classes, one per part of a save's life:
# `_SaveQueue` (the save in flight and `schedule`) and `AsyncSaver` itself, which adds the
# collective `finalize`. The snapshot, the start of the writer and the reading of its outcome
# are each one small method (`_snapshot`, `_writer`, `_outcome`), the three places where
# [the next page's](staged_copy.py) staged saver does something else.
# A save in numbers: scheduled at iteration 100 with a background write of 2.5 s and steps of
# 1 s, `finalize(blocking=False)` at the start of iterations 101, 102 and 103 finds a writer
# still running on some rank (the all-reduce of "done" gives 0) and returns `None`; at 104 all
# ranks are done, the results are gathered and the tracker says 100.
#
# What the queue remembers about the save in flight:

# %%
@dataclass
class _Pending:
    """The save in flight: its request, its host copies (if staged), its writer once started."""

    request: SaveRequest
    on_complete: object
    staging: HostStaging | None
    stats: dict = field(default_factory=dict)
    writer: _Writer | None = None


# %% [markdown]
# The queue: `schedule` finalizes a save still in flight, takes the snapshot, plans (the
# collective part), and starts the writer.

# %%
class _SaveQueue:
    """AsyncSaver's first part: the save in flight, and `schedule`, which starts one."""

    def __init__(self, comm: CheckpointGroups, mode: str = "process",
                 timeout_s: float = WRITER_TIMEOUT_S):
        if mode not in ASYNC_MODES:
            raise ValueError(f"async mode must be one of {ASYNC_MODES}, got {mode!r}")
        self.comm, self.mode, self.timeout_s = comm, mode, timeout_s
        self.pending: _Pending | None = None
        self.completed: list[dict] = []   # the stats of every save completed, in order

    def _snapshot(self, request: SaveRequest) -> HostStaging | None:
        """Freeze the request's chunks now (no background copy: None)."""
        request.tensors = stage_tensors(request.tensors, self.mode)
        return None

    def _writer(self, p: _Pending) -> _Writer | None:
        return _Writer(p.request, self.mode, p.staging)

    def schedule(self, request: SaveRequest, on_complete=None, label: str = "") -> dict:
        """Snapshot, plan (collective), start the writer; the stats, updated later."""
        if self.pending is not None:
            self.finalize(blocking=True)
        t0 = time.perf_counter()
        pending = _Pending(request, on_complete, self._snapshot(request))
        request.plan()
        pending.writer = self._writer(pending)
        fault_point("after_schedule", self.comm.rank)
        blocked = time.perf_counter() - t0
        pending.stats = {"label": label, "blocking_s": blocked, "schedule_s": blocked,
                         "staging_wait_s": 0.0, "staged": pending.staging is not None,
                         "scheduled_at": t0}
        self.pending = pending
        return pending.stats


# %% [markdown]
# ## The collective finalize
#
# `finalize` completes the save in flight. Not blocking, it asks first whether every rank's
# writer is done: one `all_agree` (an integer all-reduce) over the world, so that all ranks
# take the same branch, since the gather that follows is a collective. Then it takes the
# writer's outcome (`_outcome`, bounded by `async_timeout_s`) and hands it to the request's
# `finalize` (the [torch_dist](torch_dist.py) page's second collective), which commits on
# rank 0 or returns the same error on every rank.

# %%
class AsyncSaver(_SaveQueue):
    """At most one torch_dist save in flight: snapshot, background write, collective finalize."""

    def _outcome(self, p: _Pending) -> dict:
        return p.writer.result(self.timeout_s)

    def finalize(self, blocking: bool) -> dict | None:
        """Complete the pending save if every rank's writer is done (or wait, if blocking)."""
        p = self.pending
        if p is None:
            return None
        if not blocking and not self.comm.all_agree(p.writer is not None and p.writer.done()):
            return None
        t0 = time.perf_counter()
        outcome = self._outcome(p)
        self.pending = None
        error = p.request.finalize(outcome, p.on_complete)
        if error:
            raise CheckpointSaveError(error)
        p.stats.update(background_s=outcome.get("seconds", 0.0),
                       finalize_s=time.perf_counter() - t0,
                       visible_after_s=time.perf_counter() - p.stats["scheduled_at"])
        logger.info("checkpoint %s complete: blocked %.3f s, written in the background in %.3f s",
                    p.stats["label"], p.stats["blocking_s"], p.stats["background_s"])
        self.completed.append(p.stats)
        return p.stats

    @property
    def in_flight(self) -> bool:
        return self.pending is not None


# %% [markdown]
# ## Demo: a timeline of one async save
#
# One process trains a 5.5M-parameter GPT with AdamW (fp32: 66 MB of weights and optimizer
# state). It saves synchronously once, then asynchronously while the training steps continue,
# polling `finalize(blocking=False)` at the start of every step. The timeline shows the
# training steps, the short blocking part of the async save and the background write
# overlapping the next steps — the first of them slower than the others: it shares the CPU
# with the writer and pays for the pages that copy-on-write duplicates as the optimizer
# overwrites them. The assertions check that the async save blocks for less time than the sync
# one, and that both checkpoints hold bit-identical tensors of their iteration. The demo does
# not assert a ratio: on a shared CPU it varies from run to run, and the printed numbers are one
# run's. What was measured goes in `benchmarks/`.
#
# <details><summary>Megatron detail: the benchmark's numbers</summary>
#
# For a 100M-parameter model (a 1.2 GB
# checkpoint), `benchmarks/results/checkpoint.json` (`bench_checkpoint.py --repeats 3`, 2 CPUs
# under a load average of 13.7) records medians of 2.59 s blocked by a sync save and 0.11 s by
# an async save in `process` mode, about 24 times shorter, and 0.92 s in `thread` mode (which
# copies every tensor before it returns); `benchmarks/results/checkpoint_staging.json` (5 runs)
# records blocking / sync ratios of 0.053 for `process` mode and 0.008 for the staged `thread`
# mode of [the next page](staged_copy.py).
#
# </details>

# %%
def save_timeline(events: list[tuple], ax=None):
    """Draw (label, row, start_s, end_s) spans on a time axis."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.4))
    colors = {"train step": "#9ecae1", "forward + backward": "#9ecae1",
              "optimizer.step": "#3182bd", "sync save": "#de2d26", "async: blocking": "#fc9272",
              "async: schedule": "#fc9272", "wait before optimizer.step": "#a50f15",
              "copy to host": "#fdae6b", "async: background write": "#a1d99b",
              "finalize": "#31a354"}
    rows = sorted({row for _, row, _, _ in events})
    for label, row, s, e in events:
        ax.barh(rows.index(row), e - s, left=s, color=colors.get(label, "gray"),
                edgecolor="black", lw=0.4)
    for label in dict.fromkeys(label for label, *_ in events):
        ax.barh(0, 0, color=colors.get(label, "gray"), label=label)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("seconds")
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    return ax


# %% [markdown]
# The run itself is a worker of the package (`_workers.async_timeline_demo`); it returns the
# events the timeline draws and the numbers the assertions check.

# %%
if __name__ == "__main__":
    import tempfile

    import matplotlib.pyplot as plt

    from tinytron.checkpoint import _workers

    with tempfile.TemporaryDirectory() as root:
        out = _workers.async_timeline_demo(root)
    print(f"sync save blocked {out['sync_s']:.3f} s; async save blocked "
          f"{out['async_blocking_s']:.3f} s and wrote for {out['async_background_s']:.3f} s "
          f"in the background (visible after {out['visible_after_s']:.2f} s)")
    save_timeline(out["events"])
    plt.tight_layout()
    plt.show()
    assert out["async_blocking_s"] < out["sync_s"]   # the ratio varies with the load: see benchmarks/
    assert out["same_tensors"] and out["tracker"] == out["async_iteration"]

# %% [markdown]
# ## Summary
#
# - Async save = synchronous planning + a snapshot + a background writer + a collective
#   finalize at a later iteration; the tracker moves only when every rank's writer succeeded.
# - The snapshot, as Megatron takes it, blocks the save: a pinned D2H copy, then the fork. On a
#   CPU `fork()` needs no copy at all (copy-on-write); `thread` mode clones every tensor.
# - The forked writer runs no collective and sets one thread before any torch op; every wait on
#   it is bounded by `async_timeout_s`, after which the save fails on every rank in one line.
# - One save in flight at a time; `finalize(blocking=False)` costs one integer all-reduce per
#   iteration while a save is pending, and `finalize(blocking=True)` at exit.
#
# ## How production does it
#
# - Megatron-Core: `megatron/core/dist_checkpointing/strategies/async_utils.py` (`AsyncRequest:98`,
#   `TemporalAsyncCaller:237` forks after the D2H preload, `PersistentAsyncCaller:349` keeps one
#   worker process, `AsyncCallsQueue:612`), `filesystem_async.py` (`FileSystemWriterAsync`,
#   bucketed multi-threaded writes), `megatron/training/async_utils.py`
#   (`maybe_finalize_async_save:118`, called from `training.py:3416` every iteration); the
#   default strategy at e03878b5f is NVIDIA Resiliency Extension's implementation of the same
#   protocol.
# - PyTorch: `torch.distributed.checkpoint.async_save` (staging to CPU, then a thread or a
#   process with its own process group); torchtitan's `CheckpointManager`
#   (`torchtitan/components/checkpoint.py`) drives it, its pinned-memory mode on
#   [the next page](staged_copy.py).
#
# ## Exercises
#
# 1. In `process` mode, what does copy-on-write cost the *training* process while the writer is
#    still running? Measure the time of the first training step after `schedule` against a
#    step without a save in flight.
#
#    <details><summary>Hint</summary>
#
#    After `os.fork` parent and child share pages until one of
#    them writes. The optimizer step overwrites every parameter and moment page while the child
#    still reads them, so the kernel copies each page at that moment. The demo's timeline
#    already shows the first step after `schedule`; time it against a later one.
#
#    </details>
#
# 2. Why must the DCP planning collective run in the training process and not in the writer?
#
#    <details><summary>Hint</summary>
#
#    `_forked_write` runs no collective, and a forked child does not
#    share the parent's process groups in a usable state. Ask which process can take part in a
#    collective with the other ranks, and what `request.plan()` in `_SaveQueue.schedule` needs
#    from all of them.
#
#    </details>
#
# 3. Take the save in numbers above (a 2.5 s background write, 1 s steps, a save at the end of
#    iteration 100) with `save_interval = 2`. How long does the save at iteration 102 block
#    training in `schedule`, before its own snapshot? And with Megatron's queue?
#
#    <details><summary>Answer</summary>
#
#    The save of 100 is scheduled at t = 0 and its writer finishes at t = 2.5 s. The save of 102
#    is scheduled at the end of iteration 102, at t = 2 s, and `schedule` first calls
#    `finalize(blocking=True)` on the save still in flight: it waits 2.5 − 2 = 0.5 s, half a
#    step. Megatron's `AsyncCallsQueue` appends the second save without waiting: 0 s, with two
#    writers running at once for those 0.5 s.
#
#    </details>
