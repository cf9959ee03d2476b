# %% [markdown]
# # 01 · Schedules: interleaved 1F1B with virtual stages
#
# [01.6](virtual_stages.py) planned interleaving: every rank walks the same table of $m\,v$
# (micro-batch, chunk) pairs, and rank $r$ runs $w_r = 2(p-r-1) + (v-1)\,g$ forwards before its
# first backward. This page runs that plan with [01.5](schedules.py)'s pieces: the bookkeeping
# of $v$ chunks per rank, the parameter all-gathers launched one chunk ahead, the schedule in
# its three phases, and its overlapped variant, which posts each message as soon as it can and
# waits for it only where it is needed.

# %%
from __future__ import annotations

import contextlib
import time

import torch

from tinytron.main_loop import _schedule_checks as checks
from tinytron.main_loop._schedule_recording import recorded_handles
from tinytron.main_loop.schedules import (ScheduleConfig, _comm_and_steps, _finalize, _GradSync,
                                          deallocate_output_tensor)
from tinytron.main_loop.virtual_stages import (check_interleaving, get_pp_rank_microbatches,
                                               get_schedule_table)
from tinytron.parallel import ParallelGrid
from tinytron.parallel import pipeline_p2p as p2p

__all__ = ["forward_backward_pipelining_with_interleaving"]

# %% [markdown]
# ## The bookkeeping
#
# Each chunk keeps three FIFO lists: received inputs, outputs awaiting backward, received
# output gradients. Two things differ from 1F1B:
#
# - **Where a received tensor goes.** A message from the previous rank feeds the chunk of the
#   *next* virtual micro-batch — except on the "leading" rank (rank 0 in forward, rank $p-1$
#   in backward): what arrives there was sent by the other end of the pipeline $p - 1$ slots
#   ago, from chunk $c$, and feeds chunk $c + 1$ (forward) or $c - 1$ (backward); nothing
#   arrives in the first $p - 1$ slots or from the last chunk (Megatron's
#   `recv_tensor_from_previous_stage`, inside the interleaved function).
# - **Which input a forward reads.** Rank 0 can receive chunk 1's inputs before it needs
#   them, so a forward of micro-batch $i$ reads entry $i - (\text{entries already released by
#   backward})$ of its chunk's list rather than the newest one.
#
# Grad sync: everything runs in `no_sync`; the hooks are let through for the backward of each
# chunk's last micro-batch, so each chunk's buckets launch as soon as that chunk is done. With
# a `grad_sync_func`, rank $r$ calls it for a chunk $r$ virtual steps after that chunk's last
# backward: rank $r$ runs each backward step $r$ slots before rank 0 does, so waiting $r$
# steps lines the launches up across the ranks (`schedules.py:1387-1398`; 1F1B's way is
# `schedules.py:2409-2430`).

# %%
class _TableWalk:
    """Reading one rank's schedule table: which micro-batch and chunk virtual step k runs.

    Needs `table`, `total`, `m`, `v`, `warmup` and `forward_only`, set by `_Interleaved`."""

    def microbatch(self, k: int) -> int:
        return self.table[k % self.total][0]

    def chunk(self, k: int, forward: bool) -> int:
        c = self.table[k % self.total][1]
        return c if forward else self.v - 1 - c

    def is_last_microbatch_of_chunk(self, k: int) -> bool:
        return k < self.total and self.table[k][0] == self.m - 1

    def is_first_microbatch_of_chunk(self, k: int) -> bool:
        return k < self.total and self.table[k][0] == 0

    def released(self, k: int, c: int) -> int:
        """How many entries of chunk c's input list backward (or forward-only) already popped."""
        chunks = [row[1] for row in self.table]
        if self.forward_only:
            return chunks[:k].count(c)
        if k < self.warmup:
            return 0
        return chunks[:k - self.warmup].count(self.v - 1 - c)


# %% [markdown]
# The run itself holds the table, the three FIFO lists per chunk and the grad-sync state, and
# answers the two questions of the first bullet: does a message arrive after step $k$, and
# for which chunk.

# %%
class _Interleaved(_TableWalk):
    """Tables, per-chunk FIFOs and the forward/backward helpers of one rank's interleaved run."""

    def __init__(self, steps, comm, num_chunks, m, config, forward_only, g):
        self.steps, self.comm, self.m, self.v = steps, comm, m, num_chunks
        self.config, self.forward_only = config, forward_only
        self.table = get_schedule_table(m, self.v, g)
        self.total, self.all_warmup, self.warmup, self.remaining = get_pp_rank_microbatches(
            m, self.v, g, comm.size, comm.rank, forward_only)
        self.inputs = [[] for _ in range(num_chunks)]
        self.outputs = [[] for _ in range(num_chunks)]
        self.grads = [[] for _ in range(num_chunks)]
        self.synced = set()
        self.sync = _GradSync(config)

    def recv_source(self, k: int, forward: bool) -> tuple[bool, int]:
        """(receive?, chunk it feeds) for the message after virtual step k."""
        comm, p = self.comm, self.comm.size
        leading = comm.first if forward else comm.last
        if not leading:
            return True, self.chunk(k + 1, forward)
        src = k - (p - 1)  # the other end of the pipeline is p-1 slots behind
        c = self.chunk(max(src, 0), forward)
        recv = src >= 0 and c != (self.v - 1 if forward else 0)
        return recv, c + (1 if forward else -1)

    def is_last_chunk(self, c: int) -> bool:
        return c == self.v - 1 and self.comm.last

    def is_first_chunk(self, c: int) -> bool:
        return c == 0 and self.comm.first


# %% [markdown]
# ## Parameter all-gathers, one chunk ahead
#
# With the distributed optimizer's `overlap_param_gather`, a rank holds only its shard of the
# updated parameters after the step, and each chunk must all-gather the rest before its first
# forward (chapter 05). The forward pre-hooks would do it on demand; with `align_param_gather`
# the loop also hands the schedule each chunk's `start_param_sync` as `param_sync_func`, and
# the schedule launches them ahead of need (`schedules.py:1161-1163, 1283-1296`):
#
# - chunks 0 and 1 before the warmup: chunk 0 runs at once, chunk 1 after one group of $g$
#   forwards;
# - chunk $c + 1$ (for $2 \le c + 1 < v$) as chunk $c$ starts: before its forward step $k$,
#   rank $r$ looks at step $j = k + r$ and, if $j$ is the first micro-batch of its chunk $c$
#   (micro-batch 0 in the table, $j = c\,g$), launches chunk $c + 1$.
#
# Why $k + r$: rank $r$'s step $k$ runs when rank 0's step $k + r$ does, so every rank
# launches chunk $c + 1$'s all-gather at the moment rank 0 starts chunk $c$, together rather
# than staggered by the pipeline (unaligned asynchronous communication slows the compute
# down, says Megatron's comment). With a single chunk only chunk 0 is launched.
#
# <details><summary>Megatron detail: the callable's arguments</summary>
#
# Megatron passes chunk
# $c$'s `model[c].parameters()` to its callable, and its `start_param_sync(*unused, ...)`
# ignores them; chapter 05's takes none, so tinytron passes none. With a single chunk Megatron
# indexes chunk 1 anyway.
#
# </details>

# %%
def _launch_first_param_syncs(run: _Interleaved) -> None:
    """Chunks 0 and 1, before the warmup (schedules.py:1161-1163)."""
    if run.config.param_sync_func is not None:
        for c in range(min(2, run.v)):
            _chunk_func(run.config.param_sync_func, c)()


def _param_sync(run: _Interleaved, k: int) -> None:
    """Before forward k: launch chunk c+1 when step k + r is chunk c's first (:1283-1296)."""
    funcs = run.config.param_sync_func
    j = k + run.comm.rank  # rank r's step k runs when rank 0's step k + r does
    if funcs is not None and run.is_first_microbatch_of_chunk(j):
        c = run.chunk(j, True) + 1
        if 1 < c < run.v:  # chunks 0 and 1 were launched before the warmup
            _chunk_func(funcs, c)()

# %% [markdown]
# A forward launches what `_param_sync` says, then reads its chunk's input at the
# released-adjusted index and stores the output; a backward pops the oldest (input, output,
# gradient) of its chunk, opening `no_sync` for the chunk's last micro-batch. Both go through
# [01.5](schedules.py)'s `_Steps`, and every message through its communicator's `exchange`,
# which moves up to four tensors at once.

# %%
def _forward(run: _Interleaved, k: int):
    """Forward of virtual micro-batch k (its chunk and micro-batch from the table)."""
    _param_sync(run, k)
    c, mb = run.chunk(k, True), run.microbatch(k)
    if run.is_first_chunk(c) and len(run.inputs[c]) == len(run.outputs[c]):
        run.inputs[c].append(None)  # the first chunk of rank 0 reads tokens, not a message
    y = run.steps.forward(c, run.inputs[c][mb - run.released(k, c)])
    run.outputs[c].append(y)
    if run.forward_only:  # nothing to keep for a backward
        run.inputs[c].pop(0)
        run.outputs[c].pop()
    return y


def _backward(run: _Interleaved, k: int):
    """Backward of virtual micro-batch k: chunk reversed, oldest stored pair of that chunk."""
    c, cfg = run.chunk(k, False), run.config
    if cfg.grad_sync_func is None and run.is_last_microbatch_of_chunk(k):
        run.sync.enable()  # this chunk is done after this backward: let its buckets go
        run.synced.add(c)
    if run.is_last_chunk(c) and not run.grads[c]:
        run.grads[c].append(None)  # the loss needs no incoming gradient
    dx = run.steps.backward(c, run.inputs[c].pop(0), run.outputs[c].pop(0), run.grads[c].pop(0))
    j = k - run.comm.rank  # custom grad sync: r virtual steps later on rank r
    if cfg.grad_sync_func is not None and j >= 0 and run.is_last_microbatch_of_chunk(j):
        cj = run.chunk(j, False)
        run.sync.enable()
        _chunk_func(cfg.grad_sync_func, cj)()
        run.synced.add(cj)
    run.sync.disable()
    return dx


def _chunk_func(funcs, c: int):
    return funcs[c] if isinstance(funcs, (list, tuple)) else funcs

# %% [markdown]
# ## The schedule
#
# The same three phases as 1F1B, over virtual micro-batches (`schedules.py:946`). This is the
# plain variant, every exchange posted and waited at once; the overlapped one, Megatron's
# default for training, follows it and moves the same messages:
#
# 1. **warmup**, $k < w_r$: forward $k$, then one exchange that sends its output and receives
#    the next input; the last warmup exchange also receives the first output gradient;
# 2. **steady**: forward $k + w_r$ and backward $k$, then one exchange in all four
#    directions;
# 3. **cooldown**: the remaining backwards, each followed by sending its input gradient and
#    receiving the next output gradient; then the grad syncs not launched yet, and
#    `finalize_model_grads` over all chunks.
#
# Outputs are pseudo-freed after their send exactly as in 1F1B. The loss exists only on the
# last chunk of the last rank.
#
# The warmup first. Nothing is sent after the last chunk of the last rank (its output is the
# loss), and nothing is received after the very last virtual micro-batch; a received input
# goes to the list of the chunk the table says it belongs to.

# %%
def _warmup(run: _Interleaved) -> None:
    for k in range(run.warmup):
        c = run.chunk(k, True)
        recv_prev, next_c = run.recv_source(k, True)
        recv_prev = recv_prev and k != run.total - 1
        y = _forward(run, k)
        y = None if run.is_last_chunk(c) else y
        last = k == run.warmup - 1 and not run.forward_only and not run.all_warmup
        recv_next = last and not run.comm.last
        x, dy = run.comm.exchange(y, None, recv_prev, recv_next)
        if last:
            run.grads[run.v - 1].append(dy)
        if recv_prev:
            run.inputs[next_c].append(x)
        deallocate_output_tensor(y, run.config.deallocate_pipeline_outputs)

# %% [markdown]
# The steady state pairs forward $k + w_r$ with backward $k$. The two may belong to different
# chunks, so what arrives from each side goes to its own chunk's list; the first chunk of
# rank 0 has no input gradient to send.

# %%
def _steady(run: _Interleaved) -> None:
    for k in range(run.remaining):
        fk = k + run.warmup
        y, dx = _forward(run, fk), _backward(run, k)
        fc, bc = run.chunk(fk, True), run.chunk(k, False)
        y = None if run.is_last_chunk(fc) else y
        dx = None if run.is_first_chunk(bc) else dx
        recv_prev, next_fc = run.recv_source(fk, True)
        recv_next, next_bc = run.recv_source(k, False)
        recv_prev = recv_prev and k != run.remaining - 1
        x, dy = run.comm.exchange(y, dx, recv_prev, recv_next)
        deallocate_output_tensor(y, run.config.deallocate_pipeline_outputs)
        if recv_prev:
            run.inputs[next_fc].append(x)
        if recv_next:
            run.grads[next_bc].append(dy)

# %% [markdown]
# The cooldown runs the backwards left. When every forward fit in the warmup, the first output
# gradient has not arrived yet, so it starts with a plain receive. At the end the grad sync is
# opened for good and a custom `grad_sync_func` runs for every chunk that has not had it.

# %%
def _cooldown(run: _Interleaved) -> None:
    if run.all_warmup:
        run.grads[run.v - 1].append(run.comm.recv_backward())
    for k in range(run.remaining, run.total):
        c = run.chunk(k, False)
        recv_next, next_c = run.recv_source(k, False)
        recv_next = recv_next and k != run.total - 1
        dx = _backward(run, k)
        dx = None if run.is_first_chunk(c) else dx
        _, dy = run.comm.exchange(None, dx, False, recv_next)
        if recv_next:
            run.grads[next_c].append(dy)
    _sync_remaining_grads(run)


def _sync_remaining_grads(run: _Interleaved) -> None:
    """The end of a backward pass: grad sync on for good, the custom func for chunks not synced."""
    run.sync.enable()
    if run.config.grad_sync_func is not None:
        for c in range(run.v):
            if c not in run.synced:
                _chunk_func(run.config.grad_sync_func, c)()

# %% [markdown]
# ## The overlapped variant: post now, wait when needed
#
# With `overlap_p2p_comm` (Megatron's default for this schedule, `arguments.py:2756-2758`)
# the steady state posts each exchange as soon as its tensor exists and waits for each piece
# only where it is needed, as Megatron's interleaved function does with
# `overlap_p2p_comm_warmup_flush` off (`schedules.py:1575-1672, 1689-1830, 1896-2011`):
#
# - after a forward, post *send output, receive the next input*; the previous send is waited
#   first, and with `deallocate_pipeline_outputs` this one at once too, so that the output
#   can be shrunk (an `isend` may still be reading it);
# - before the next forward, wait for the oldest posted receive of an input; the backward
#   does the same with gradients (post after the backward, wait before the next one);
# - the warmup's forwards exchange blocking as before; its last step posts the receive of
#   the first output gradient, waited before the first backward of the steady state;
# - the cooldown's backwards wait for the gradient posted in the steady state and then
#   exchange blocking, as in the plain variant.
#
# A receive buffer goes into its chunk's list when it is posted; nothing reads it before its
# wait. The messages, their order on each rank and so every tensor computed are the plain
# variant's, which a test checks bit for bit; only when the waits happen changes.
#
# **One method for every message.** A posted exchange cannot be a batch, so
# `overlap_p2p_comm` requires `batch_p2p_comm = False` (`model_parallel_config.py:304-312`;
# `ScheduleConfig` refuses both true), and the communicator posts *every* message as single
# `isend`/`irecv`, the warmup's and cooldown's blocking ones included: Megatron's
# `_communicate` reads one method from its config (`p2p_communication.py:374-378`).
#
# <details><summary>Megatron detail: what gloo hid</summary>
#
# Under NCCL a batch and a single operation travel on different communicators
# ([appendix A](../parallel/pipeline_p2p.py)), so a gradient sent by a batch of the warmup
# and received by a posted `irecv` would never arrive. Gloo matches both by peer and hides
# the mix. With batched warmup and cooldown
# around a posted steady state, 6 of the 48 messages of one PP 2 iteration (two pipelines, 4
# micro-batches) went out one way and in the other while every CPU test passed.
# `tests/test_main_loop_p2p_methods.py` records each message's method at both ends through
# torch's own functions.
#
# </details>
#
# <details><summary>Megatron detail: the plain variant on two ranks</summary>
#
# Megatron refuses
# the plain variant with two pipeline ranks, where the batch of one exchange holds two
# messages between the same two ranks (`arguments.py:984-988`); tinytron's config refuses it
# too unless `parallel.batch_p2p_comm = false`, though the fixed posting order of appendix A
# makes the batch safe over gloo, which is why the plain variant runs on this page's
# examples.
#
# </details>

# %%
class _Pending:
    """The overlapped variant's handles: FIFO receives, the one send in flight each way."""

    def __init__(self):
        self.recv_prev, self.recv_next = [], []
        self.send_next = self.send_prev = None
        self.output = None   # the last forward's output, shrunk before the next forward


def _post(run: _Interleaved, pending: _Pending, forward: bool, t, recv: bool):
    """Post send(t) and, if asked, a receive, in one direction; file the handles."""
    comm, start = run.comm, time.perf_counter()
    fn = p2p.send_forward_recv_forward if forward else p2p.send_backward_recv_backward
    buf, handles = fn(t, recv, comm.shape, comm.grid, comm.dtype, overlap_p2p_comm=True,
                      batch_p2p_comm=comm.batched)
    send, recv_name = ("send_next", "recv_prev") if forward else ("send_prev", "recv_next")
    handles = recorded_handles(comm, handles, {send: t}, buf, start)
    previous = getattr(pending, send)
    if previous is not None:
        previous.wait()
    setattr(pending, send, handles.get(send))
    if recv_name in handles:
        getattr(pending, recv_name).append(handles[recv_name])
    return buf


def _wait_oldest(handles: list) -> None:
    if handles:
        handles.pop(0).wait()

# %% [markdown]
# The warmup differs from the plain one only in its last step, the steady state in where it
# communicates: after each half of the step instead of once after both.

# %%
def _warmup_overlapped(run: _Interleaved, pending: _Pending) -> None:
    for k in range(run.warmup):
        c = run.chunk(k, True)
        recv_prev, next_c = run.recv_source(k, True)
        recv_prev = recv_prev and k != run.total - 1
        y = _forward(run, k)
        y = None if run.is_last_chunk(c) else y
        x, _ = run.comm.exchange(y, None, recv_prev, False)
        if recv_prev:
            run.inputs[next_c].append(x)
        deallocate_output_tensor(y, run.config.deallocate_pipeline_outputs)
        if k == run.warmup - 1 and not run.forward_only and not run.all_warmup:
            recv_next = not run.comm.last
            dy = _post(run, pending, False, None, recv_next)
            if recv_next:
                run.grads[run.v - 1].append(dy)


# %% [markdown]
# In the steady state each virtual step posts twice: after its forward (the output forward,
# the next input's receive) and after its backward (the input gradient back, the next
# gradient's receive), each time waiting only for the receive the next half reads.

# %%
def _steady_overlapped(run: _Interleaved, pending: _Pending) -> None:
    dealloc = run.config.deallocate_pipeline_outputs
    for k in range(run.remaining):
        fk = k + run.warmup
        fc, bc = run.chunk(fk, True), run.chunk(k, False)
        if not run.is_first_chunk(fc):
            _wait_oldest(pending.recv_prev)
        deallocate_output_tensor(pending.output, dealloc)
        y = _forward(run, fk)
        y = None if run.is_last_chunk(fc) else y
        recv_prev, next_fc = run.recv_source(fk, True)
        recv_prev = recv_prev and k != run.remaining - 1
        x = _post(run, pending, True, y, recv_prev)
        if pending.send_next is not None and dealloc:
            pending.send_next.wait()
            pending.send_next = None
        if recv_prev:
            run.inputs[next_fc].append(x)
        pending.output = y
        if not run.is_last_chunk(bc):
            _wait_oldest(pending.recv_next)
        dx = _backward(run, k)
        dx = None if run.is_first_chunk(bc) else dx
        recv_next, next_bc = run.recv_source(k, False)
        dy = _post(run, pending, False, dx, recv_next)
        if recv_next:
            run.grads[next_bc].append(dy)
    deallocate_output_tensor(pending.output, dealloc)

# %% [markdown]
# The cooldown waits for the gradient its first backward reads, then runs as the plain one;
# at the end every handle still open is waited, so nothing is in flight when the schedule
# returns (Megatron asserts the same of its receive lists, `schedules.py:2015-2020`).

# %%
def _cooldown_overlapped(run: _Interleaved, pending: _Pending) -> None:
    if run.all_warmup:
        run.grads[run.v - 1].append(run.comm.recv_backward())
    for k in range(run.remaining, run.total):
        c = run.chunk(k, False)
        if not run.is_last_chunk(c) and k != 0:
            _wait_oldest(pending.recv_next)
        recv_next, next_c = run.recv_source(k, False)
        recv_next = recv_next and k != run.total - 1
        dx = _backward(run, k)
        dx = None if run.is_first_chunk(c) else dx
        _, dy = run.comm.exchange(None, dx, False, recv_next)
        if recv_next:
            run.grads[next_c].append(dy)
    _finish_pending(pending)
    _sync_remaining_grads(run)


def _finish_pending(pending: _Pending) -> None:
    """Wait every handle still open; a receive left over would be a schedule bug."""
    if pending.recv_prev or pending.recv_next:
        raise RuntimeError(f"overlapped interleaved schedule ended with {len(pending.recv_prev)} "
                           f"input and {len(pending.recv_next)} gradient receives not waited")
    for h in (pending.send_next, pending.send_prev):
        if h is not None:
            h.wait()
    pending.send_next = pending.send_prev = None

# %% [markdown]
# The entry point checks what the table needs (one data iterator per chunk, a valid $m$, a
# pipeline, and $m$ compatible with the group size $g$). A forward-only call (evaluation)
# sets `grad_sync_func` and `param_sync_func` to `None` for its duration and puts them back
# at the end, as Megatron does (`schedules.py:1062-1067, 2043-2045`; here also when the call
# raises): the forward pre-hooks gather what evaluation reads. Then it launches chunks 0 and
# 1's all-gathers, receives rank 0's first input, and runs the three phases, plain or
# overlapped.

# %%
@contextlib.contextmanager
def _sync_funcs_off(config: ScheduleConfig, forward_only: bool):
    """Forward only: no grad_sync_func / param_sync_func during the call, restored after."""
    held = config.grad_sync_func, config.param_sync_func
    if forward_only:
        config.grad_sync_func = config.param_sync_func = None
    try:
        yield
    finally:
        if forward_only:
            config.grad_sync_func, config.param_sync_func = held


# %% [markdown]
# The schedule itself, in the order just told.

# %%
def forward_backward_pipelining_with_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, grid: ParallelGrid, forward_only: bool = False,
        config: ScheduleConfig | None = None) -> list[dict]:
    """Interleaved 1F1B over this rank's v model chunks (one data iterator per chunk)."""
    config = config or ScheduleConfig()
    model, iterators = checks.chunks_and_iterators(model, data_iterator)
    checks.check_pipeline(grid, num_microbatches)
    g = config.microbatch_group_size_per_vp_stage or grid.size("pp")
    check_interleaving(grid.size("pp"), num_microbatches, g)
    comm, steps = _comm_and_steps(forward_step_func, iterators, model, num_microbatches,
                                  seq_length, micro_batch_size, grid, config)
    run = _Interleaved(steps, comm, len(model), num_microbatches, config, forward_only, g)
    with _sync_funcs_off(config, forward_only):
        if not forward_only:
            run.sync.disable()
        _launch_first_param_syncs(run)
        run.inputs[0].append(comm.recv_forward())  # None on rank 0
        if config.overlap_p2p_comm:
            pending = _Pending()
            _warmup_overlapped(run, pending)
            _steady_overlapped(run, pending)
            if forward_only:
                _finish_pending(pending)
        else:
            _warmup(run)
            _steady(run)
        if not forward_only:
            (_cooldown_overlapped(run, pending) if config.overlap_p2p_comm else _cooldown(run))
            _finalize(config, model, grid, steps.total_num_tokens)
    return steps.store

# %% [markdown]
# ## Demo: Megatron's example on two gloo ranks, and what interleaving costs in memory
#
# The tiny GPT with 4 layers cut into $p\,v = 4$ chunks of one layer (rank 0: layers 0 and 2,
# rank 1: layers 1 and 3), run on Megatron's documented example $p = 2$, $g = 3$, $m = 5$,
# $v = 2$. Each rank prints what it executed, as (chunk, micro-batch), and the gradients are
# compared with one process. Then $m = 4$ micro-batches ($g = p = 2$) run under the
# `LiveBytesMeter`, interleaved and plain 1F1B on the same layers, counting the chunk
# activations autograd holds and the live bytes.

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.main_loop._workers import interleaved_demo

    ranks = run_on_ranks(interleaved_demo, 2, timeout=180)
    table = get_schedule_table(5, 2, 3)  # 01.6's table of Megatron's example
    for r, res in enumerate(ranks):
        warmup = get_pp_rank_microbatches(5, 2, 3, 2, r)[2]
        order = " ".join(f"{k[0].upper()}{c}.{mb}" for k, c, mb in res["example"]["orders"][0])
        print(f"rank {r} (warmup {warmup}): {order}")
    print("grads bitwise equal to one process:", [r["example"]["bitwise"][0] for r in ranks])
    for r, res in enumerate(ranks):
        inter, plain = res["interleaved"], res["1f1b"]
        ratio = inter["peak_at_marks"] / plain["peak_at_marks"]
        print(f"rank {r}: chunk activations alive at most {inter['max_in_flight_saved']} "
              f"(1F1B: {plain['max_in_flight_saved']} stage activations); peak live bytes "
              f"{ratio:.2f}x 1F1B's")

# %% [markdown]
# The live bytes of the $m = 4$ step on each rank, after every forward and backward, against
# the share of the iteration's work done: interleaved runs twice as many steps of half the
# size, and rank 0 climbs higher before its first backward.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 2.8), sharey=True)
    for r, (res, ax) in enumerate(zip(ranks, axes)):
        for key, label, style in (("1f1b", "1F1B", ":"),
                                  ("interleaved", "interleaved, v = 2", "-")):
            lives = [live / 2**10 for *_, live, _ in res[key]["marks"]]
            ax.step([(k + 1) / len(lives) for k in range(len(lives))], lives, style,
                    where="post", label=label)
        ax.set_title(f"rank {r}", fontsize=9)
        ax.set_xlabel("share of the step's forwards and backwards done")
    axes[0].set_ylabel("live KiB (measured)")
    axes[0].legend(fontsize=7)
    fig.suptitle("p = 2, m = 4: live bytes after each forward / backward", fontsize=10)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The claims: Megatron's table in order, forwards first for $w_r$ steps, the same bits as one
# process, $w_r + 1$ chunk activations at most, and rank 0's memory factor.

# %%
if __name__ == "__main__":
    for r, res in enumerate(ranks):
        fwd = [(c, mb) for k, c, mb in res["example"]["orders"][0] if k == "forward"]
        bwd = [(c, mb) for k, c, mb in res["example"]["orders"][0] if k == "backward"]
        assert fwd == [(c, mb) for mb, c in table]  # Megatron's table, in order
        assert bwd == [(1 - c, mb) for mb, c in table]  # same walk, chunks reversed
        warmup = get_pp_rank_microbatches(5, 2, 3, 2, r)[2]
        assert [k for k, *_ in res["example"]["orders"][0][:warmup]] == ["forward"] * warmup
        assert res["example"]["bitwise"][0]
    # at most w_r + 1 chunk-micro-batches in flight: 2(p-r-1) + (v-1)g + 1 with g = p = 2
    assert [r["interleaved"]["max_in_flight_saved"] for r in ranks] == [5, 3]
    ratio0 = ranks[0]["interleaved"]["peak_at_marks"] / ranks[0]["1f1b"]["peak_at_marks"]
    assert 1.1 < ratio0 < 1.45  # Megatron's memory factor 1 + (p-1)/(p v) = 1.25 on rank 0

# %% [markdown]
# Which method a schedule uses is decided once, from the config: the plain variant batches
# (Megatron's default), the overlapped one posts single operations everywhere, and asking for
# both is refused before any message is sent.

# %%
if __name__ == "__main__":
    from tinytron.main_loop._schedule_checks import batch_p2p

    assert batch_p2p(ScheduleConfig()) is True                         # plain: one batch
    assert batch_p2p(ScheduleConfig(overlap_p2p_comm=True)) is False   # overlapped: single ops
    try:
        ScheduleConfig(overlap_p2p_comm=True, batch_p2p_comm=True)
        raise AssertionError("batched and overlapped p2p was accepted")
    except ValueError as e:
        print("refused:", e)

# %% [markdown]
# ## Summary
#
# - Each chunk keeps FIFO lists of inputs, outputs and gradients; a message goes to the chunk
#   the table names, and on the leading rank to the next (or previous) chunk of what the other
#   end sent $p - 1$ slots before.
# - The three phases of 1F1B run over virtual micro-batches, each exchange moving up to four
#   tensors; each chunk's gradient buckets launch after its own last backward. Measured on rank
#   0, the activations in flight grow by about $1 + \frac{p-1}{p v}$ over 1F1B, as
#   [01.6](virtual_stages.py) planned.
# - `overlap_p2p_comm` (Megatron's default) posts the same messages asynchronously, every one
#   as a single `isend`/`irecv`, and waits for each where it is needed: bit for bit the plain
#   variant's results.
# - With `param_sync_func`, chunks 0 and 1 gather their parameters before the warmup and
#   chunk $c + 1$ when chunk $c$ starts, each rank $r$ looking $r$ steps ahead so that every
#   rank launches at once; forward-only calls launch none.
#
# ## How production does it
#
# - Megatron-LM: `forward_backward_pipelining_with_interleaving`
#   (`megatron/core/pipeline_parallel/schedules.py:946`). Its `overlap_p2p_comm_warmup_flush`
#   also posts the warmup's and cooldown's receives ahead (not built here).
# - PyTorch: `torch.distributed.pipelining.ScheduleInterleaved1F1B` (and
#   `ScheduleInterleavedZeroBubble`), which run a per-rank action list built from a similar
#   table.
#
# ## Exercises
#
# 1. Why does the leading rank receive nothing during its first $p - 1$ virtual steps?
#
#    <details><summary>Hint</summary>
#
#    What arrives at the leading rank was sent by the other end
#    of the pipeline, and a micro-batch needs $p - 1$ slots to cross it. Read `recv_source`:
#    `src = k - (p - 1)` is negative for the first $p - 1$ steps.
#
#    </details>
#
# 2. With $p = 4$, $v = 3$ and $m = 8$, when does rank 2 launch chunk 2's parameter
#    all-gather, and which step of rank 0 runs at the same moment?
#
#    <details><summary>Answer</summary>
#
#    With the default $g = p = 4$, chunk 1 starts at table
#    index $j = c\,g = 4$, the first micro-batch of chunk 1. Rank 2 launches chunk 2 before its
#    forward step $k$ with $k + r = 4$, so $k = 2$; rank 0 runs its step $k + r = 4$, chunk 1's
#    first forward, at the same moment. Chunks 0 and 1 were launched before the warmup.
#
#    </details>
#
# 3. In the overlapped variant, why must a send be waited before its output is pseudo-freed,
#    when the plain variant can shrink the output right after its exchange?
#
#    <details><summary>Hint</summary>
#
#    A posted `isend` may still be reading the tensor's storage
#    when the call returns; replacing `.data` then would hand the receiver garbage or free
#    memory in use. The plain exchange returns only when every message it posted is done.
#
#    </details>
