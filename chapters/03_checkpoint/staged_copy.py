# %% [markdown]
# # 03 · Checkpoint: the staged copy behind the next step
#
# [Saving in the background](async_save.py) moved the write out of the training step, and
# left one wait in it: the snapshot, the copy of the state taken before `schedule` returns.
# This page moves that copy too. It starts when the save is scheduled, runs beside the next
# forward and backward, and training waits only for what is left of it just before the next
# `optimizer.step`, the first thing that writes the parameters again.
#
# Why it is worth a page: a copy that training waits for costs its full time. In the running
# example a rank's share of a fully parallel save is ≈ 2.0e9 × 14 B / 64 ≈ 0.44 GB (its 1/64
# of the bf16 weights, the fp32 masters and both Adam moments), ≈ 9 ms at PCIe Gen5's
# ≈ 50 GB/s: small next to a 1.94 s step, but paid by every rank at every save. On a CPU the
# copy is a full pass over the state in memory. And nothing needs the copy finished before
# the next `optimizer.step`: the forward and backward in between write activations and
# gradients, never a parameter or an optimizer state.
#
# In numbers, for one save (the GPU row is the running example's arithmetic, not a
# measurement; the CPU row was measured for the 100M-parameter model,
# `benchmarks/results/checkpoint_staging.json`, medians of 5):
#
# | | copy before `schedule` returns | staged |
# |---|---|---|
# | GPU, ideal: a rank's 0.44 GB at 50 GB/s | training waits 9 ms | 9 ms beside a forward and backward of most of 1.94 s: waits 0 |
# | CPU: 1.2 GB, `thread` mode | training blocked 0.31 s | blocked 0.055 s |
#
# You will build: `StagedAsyncSaver` (the copies started in `schedule`, the loop's
# `before_optimizer_step`, the finalize of a save that never met a next step).

# %%
from __future__ import annotations

import time

from tinytron.checkpoint._staging import HostStaging, PinnedPool
from tinytron.checkpoint.async_save import (WRITER_TIMEOUT_S, AsyncSaver, _Pending, _Writer,
                                            save_timeline)
from tinytron.checkpoint.torch_dist import SaveRequest

__all__ = ["StagedAsyncSaver"]

# %% [markdown]
# ## The copy, behind the next step
#
# tinytron starts the copies when the save is scheduled and lets them run behind the next
# iteration's compute:
#
# ```mermaid
# sequenceDiagram
#   participant T as training (iteration k+1)
#   participant S as staging (side stream / worker thread)
#   participant W as writer
#   T->>S: save at k: allocate host buffers, start the copies, plan (collective)
#   T->>T: forward, backward (reads the parameters, writes gradients)
#   S->>S: copy chunk by chunk into host (pinned) buffers
#   T->>S: before_optimizer_step: wait for what is left
#   T->>T: optimizer.step overwrites the parameters
#   S->>W: copies complete: write (thread), or fork the writer (process, GPU)
# ```
#
# On a GPU the copies run on a side CUDA stream, on the copy engine beside the kernels, into
# pinned buffers that the saver keeps from one save to the next (allocating pinned memory is
# much slower than an ordinary allocation, so each buffer is pinned once); on a CPU a worker
# thread copies (PyTorch releases the GIL inside the copy, so the thread runs beside the
# forward). A CPU `fork` needs no copy at all and is left as it is. The buffers are allocated
# before the planning collective, so the plan describes exactly the tensors the writer will
# write, and the copies overlap the plan too. The host buffers, the copies and their waits are
# `HostStaging` and `PinnedPool` in the chapter's private module `tinytron.checkpoint._staging`
# (`chapters/03_checkpoint/_staging.py`).
#
# <details><summary>One precondition: no parameter all-gather in flight</summary>
#
# With `overlap_param_gather` the next forward's pre-hooks write gathered parameters (chapter
# 05). Megatron finishes that all-gather before every save (`force_param_sync`,
# `training/training.py:2788-2789`), and so does chapter 01's loop (`save_with_param_sync`):
# after it the forward has nothing left to write.
#
# </details>
#
# <details><summary>Megatron detail: the staged copy, measured on this book's CPU</summary>
#
# Measured on this book's 2-core machine, shared and loaded when it ran (load average 15–27;
# `benchmarks/results/checkpoint_staging.json`, medians of 5): for the 100M-parameter model a
# staged `thread`-mode save blocked training 0.055 s, against 0.31 s when the copy is taken
# before `save` returns, 0.37 s with `fork`, and 7.0 s for a synchronous save (0.008, 0.044,
# 0.053 of it). Hidden is not free on a CPU: the 1.2 GB copy and then the write share the two
# cores with the forward and backward, which ran 2.0× slower beside them (1.6× beside the
# write alone, 2.3× beside a forked writer and its copy-on-write faults).
#
# </details>
#
# `_start_copy` points the request at the host buffers, empty yet (planning reads only their
# shapes), and starts the copies into them.

# %%
def _start_copy(request: SaveRequest, rank: int, pool: PinnedPool) -> HostStaging:
    """Point the request at its host copies and start them; return at once."""
    staging = HostStaging(request.tensors, rank, pool)
    request.tensors = staging.staged   # empty yet: planning reads only shapes
    staging.start()
    return staging


# %% [markdown]
# ## The wait before the next optimizer step
#
# A staged save leaves `schedule` with its copies still running, and the first thing that
# writes what they copy is the next `optimizer.step`. So the loop calls
# `before_optimizer_step()` just before it, and only there does training wait for what is left
# of the copies — torchtitan's `maybe_wait_for_staging` has this place in its loop. On a CPU
# the wait joins the staging thread. On a GPU the host does not block at all: the current
# stream waits for the side stream's event, so the optimizer's kernels queue behind the
# copies; a step that writes from a stream of its own waits for the current stream first
# (chapter 02's offload optimizer uploads that way). In `process` mode the writer can only fork
# once the host copies are complete, so the wait synchronizes and forks (a forked child copies
# no CUDA state; it writes from the pinned buffers).
#
# The loop's first call also tells the saver that a wait point exists: until then (a script
# that calls `save` and steps without the hook), `schedule` takes the snapshot before it
# returns, as on the previous page, and nothing can overwrite a tensor while it is being
# copied. A process killed while it stages (fault point `during_staging`, halfway through the
# copies) leaves an `iter_….tmp` directory and nothing else: the tracker still names the
# previous checkpoint.

# %%
class _StagingWait(AsyncSaver):
    """The staged saver's first part: the pinned pool, and the loop's wait for the copies."""

    def __init__(self, comm, mode: str = "process", timeout_s: float = WRITER_TIMEOUT_S):
        super().__init__(comm, mode, timeout_s)
        self.wait_point = False    # set by the loop's first before_optimizer_step()
        self.pool = PinnedPool()

    def before_optimizer_step(self) -> float:
        """The loop's hook: wait for a staged save's copies; the seconds training was blocked."""
        self.wait_point = True
        p = self.pending
        if p is None or p.staging is None or p.staging.fenced:
            return 0.0
        t0 = time.perf_counter()
        self._fence(p)
        waited = time.perf_counter() - t0
        p.stats["staging_wait_s"] = waited
        p.stats["blocking_s"] += waited
        return waited

    def _fence(self, p: _Pending) -> None:
        if p.writer is None:   # process mode, CUDA tensors: fork once the host copies are complete
            p.staging.wait(self.timeout_s)
            p.staging.fenced = True
            p.writer = _Writer(p.request, "thread" if p.staging.error else self.mode, p.staging)
        else:
            p.staging.fence(self.timeout_s)


# %% [markdown]
# ## The staged saver
#
# `StagedAsyncSaver` changes the three places the previous page left open. `_snapshot` stages
# only with a wait point, and only where a copy is needed: CUDA tensors, or `thread` mode (a
# CPU `fork` stays the copy-free snapshot it was). `_writer` does not fork a `process`-mode
# writer at `schedule`: the child would see host buffers still filling, so the fork waits for
# `_fence`. `_outcome` fences a staged save that was never fenced — a save at the last
# iteration has no next optimizer step — before it takes the writer's outcome, then records how
# long the copies took and gives the pinned buffers back to the pool.
#
# A save's life in the order the calls come, `thread` mode, the wait point armed: `schedule`
# at the end of iteration k returns once the copies are started and the plan is made;
# `before_optimizer_step` in iteration k + 1 waits for what is left of the copies (nothing,
# when they took less than the forward and backward); the writer thread writes while the next
# iterations run; `finalize(blocking=False)` at the start of a later iteration commits.

# %%
class StagedAsyncSaver(_StagingWait):
    """AsyncSaver whose snapshot copies run behind the next forward and backward."""

    def _snapshot(self, request: SaveRequest) -> HostStaging | None:
        cuda = any(t.data.is_cuda for t in request.tensors)
        if self.wait_point and (cuda or self.mode == "thread"):
            return _start_copy(request, self.comm.rank, self.pool)
        return super()._snapshot(request)

    def _writer(self, p: _Pending) -> _Writer | None:
        if p.staging is not None and self.mode == "process":
            return None   # forked in _fence, once the host copies are complete
        return super()._writer(p)

    def _outcome(self, p: _Pending) -> dict:
        if p.staging is not None and not p.staging.fenced:
            self._fence(p)   # a save at the last iteration met no next optimizer step
        outcome = super()._outcome(p)
        if p.staging is not None:
            p.stats["staging_s"] = p.staging.seconds()
            p.staging.release()
        return outcome


# %% [markdown]
# ## Demo: the staged copy, behind the next forward and backward
#
# One process trains the 5.5M-parameter GPT of the previous page's demo. It saves once
# synchronously and once in `thread` mode with the wait point armed (as chapter 01's loop arms
# it), through the checkpoint manager of [the resume page](resume.py), which holds a
# `StagedAsyncSaver`. The timeline splits the next training step where the loop calls the
# hook: the save's schedule, the forward and backward, the wait before `optimizer.step`, the
# step. The staging thread's copy runs beside the forward and backward, then the same thread
# writes. The assertions check that the copy was staged, and that the staged checkpoint's shard
# file and `common.pt` are byte for byte the synchronous save's although the optimizer stepped
# while the write went on.

# %%
if __name__ == "__main__":
    import tempfile

    import matplotlib.pyplot as plt

    from tinytron.checkpoint._staging import staged_timeline_demo

    with tempfile.TemporaryDirectory() as root:
        out = staged_timeline_demo(root)
    st = out["stats"]
    print(f"sync save blocked {out['sync_s']:.3f} s; staged save blocked {st['blocking_s']:.3f} s "
          f"(schedule {st['schedule_s']:.3f} s + wait {st['staging_wait_s']:.3f} s); the copy "
          f"took {st['staging_s']:.3f} s beside the forward and backward")
    save_timeline(out["events"])
    plt.tight_layout()
    plt.show()
    assert st["staged"] and out["same_files"]

# %% [markdown]
# ## Measured on a GPU
#
# On a GPU the staged copy is a device-to-host copy on a side stream into pinned buffers, and
# the optimizer's kernels queue behind it. `bash scripts/gpu_check.sh 2` runs
# `benchmarks/bench_checkpoint_staging.py --device cuda` (the 100M model, its optimizer state
# and its batch in GPU memory): the time training is blocked against a synchronous save, and
# the whole step, timed to the GPU's completion, against a step with no save.
# `chapters/_gpu_results.py` renders the table from `benchmarks/results/gpu/<device>.json`.

# %%
if __name__ == "__main__":
    from tinytron._gpu_results import gpu_table

    print(gpu_table("async_save"))

# %% [markdown]
# ## Summary
#
# - The snapshot's copy needs to be complete only before the next `optimizer.step`: the
#   forward and backward in between never write a parameter or an optimizer state.
# - tinytron stages it there — a side stream into pinned buffers on a GPU, a worker thread on
#   a CPU (`fork()` needs no copy: copy-on-write) — and waits for it only in
#   `before_optimizer_step`, which chapter 01's loop calls just before `optimizer.step`; on a
#   GPU that wait is a stream wait, not a host block.
# - Without the hook (no wait point) the saver copies before `schedule` returns, as on the
#   previous page; a `process`-mode writer forks only once the copies are complete.
#
# ## How production does it
#
# - Megatron-Core copies before it returns: `preload_tensors`
#   (`megatron/core/dist_checkpointing/strategies/filesystem_async.py:227`) into pinned
#   memory, then `torch.cuda.synchronize()` and the fork
#   (`megatron/core/dist_checkpointing/strategies/async_utils.py:273`).
# - torchtitan's `CheckpointManager` (`torchtitan/components/checkpoint.py`, async mode
#   `async_with_pinned_mem`) copies into pinned memory on a staging stream, and
#   `Trainer.train_step` (`torchtitan/train.py`) calls `maybe_wait_for_staging()` just before
#   `optimizers.step()`: the place of tinytron's `before_optimizer_step` (torchtitan's wait
#   synchronizes the host; tinytron's CUDA path only makes the current stream wait).
#
# ## Exercises
#
# 1. Suppose the running example's 0.44 GB share copies at only 0.2 GB/s, behind a forward
#    and backward of 1.9 s. How long does training wait in `before_optimizer_step`, and how
#    long would it wait with the copy taken before `schedule` returns?
#
#    <details><summary>Answer</summary>
#
#    The copy takes 0.44 / 0.2 = 2.2 s. Staged, 1.9 s of it runs beside the forward and
#    backward and the hook waits for the rest: 2.2 − 1.9 = 0.3 s. Taken before `schedule`
#    returns, all 2.2 s block training. Staging hides min(copy, forward + backward).
#
#    </details>
#
# 2. Why does `StagedAsyncSaver` not stage anything until the loop's first
#    `before_optimizer_step`?
#
#    <details><summary>Hint</summary>
#
#    Without that call nothing tells the saver where the next write to the parameters happens.
#    Ask what a script that calls `save` and then `optimizer.step()` without the hook would do
#    to a tensor whose copy is still running.
#
#    </details>
#
# 3. In `process` mode on a GPU, why is the writer forked in `_fence` and not in `schedule`?
#
#    <details><summary>Hint</summary>
#
#    A forked child sees the parent's memory as it was at the fork, and inherits no CUDA
#    stream. Ask what the child would find in the pinned buffers if it forked while the side
#    stream was still filling them.
#
#    </details>
