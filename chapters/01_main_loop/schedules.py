# %% [markdown]
# # 01 · Schedules: no pipelining and 1F1B, as the trainer runs them
#
# [01.4](pipeline_orders.py) built the pipeline orders bare: GPipe, and 1F1B, which holds at
# most $p - r$ micro-batches on stage $r$. The trainer needs more than the order. This page
# builds Megatron's two schedules for one model chunk per rank — no pipelining (gradient
# accumulation) and the 1F1B the trainer runs — with what they add around the order: a sent
# output freed before its backward, the data-parallel gradient collectives held back until the
# last backward, a forward-only pass for evaluation, the knobs, a recorder, and the choice
# among the schedules. [01.6](virtual_stages.py) and [01.7](interleaved.py) interleave.

# %%
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from tinytron.main_loop import _schedule_checks as checks
from tinytron.main_loop._schedule_recording import instrument
from tinytron.main_loop.pipeline_orders import _unwrap, forward_step, num_warmup_microbatches_1f1b
from tinytron.main_loop.schedule_timeline import ScheduleEvent, ScheduleRecorder
from tinytron.parallel import ParallelGrid
from tinytron.parallel import pipeline_p2p as p2p

__all__ = ["ScheduleConfig", "ScheduleEvent", "ScheduleRecorder", "tensor_shape",
           "backward_step", "deallocate_output_tensor", "custom_backward",
           "forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
           "get_forward_backward_func"]

# %% [markdown]
# ## What the trainer adds to the order
#
# Without pipeline parallelism the order is obvious: each micro-batch's forward, then its
# backward, gradients accumulating in one buffer. The only question is when to average the
# gradients over data-parallel ranks: once, during the last micro-batch's backward
# (`forward_backward_no_pipelining`, `megatron/core/pipeline_parallel/schedules.py:634`), not
# $m$ times. The 1F1B schedule asks the same question, and three more: what a stage keeps of
# an output it has sent, how evaluation runs without a backward, and how a recorder watches it
# all without a line of the schedule changing.
#
# ## The message shape
#
# A stage must post a receive before anything arrives, so the shape of every message is fixed
# in advance: $[s/c, b, h]$ for $c$ context-parallel ranks, and $[s/(c\,t), b, h]$ with
# sequence parallelism (`get_tensor_shapes`, `schedules.py:2057`); in the running example
# $[2048, 2, 4096]$. What the schedules refuse (a missing width, a sequence that does not
# split, a wrong number of chunks or micro-batches) is checked in
# `chapters/01_main_loop/_schedule_checks.py`. Every schedule reads its switches from a
# `ScheduleConfig`, listed after the schedules; [01.4](pipeline_orders.py)'s `forward_step`
# runs each micro-batch.

# %%
def tensor_shape(model_chunk, seq_length: int, micro_batch_size: int, grid: ParallelGrid,
                 config: ScheduleConfig) -> tuple[int, int, int]:
    """[s/cp (/tp under SP), b, h]: the activation a stage sends and the gradient it receives."""
    model_config = getattr(_unwrap(model_chunk), "config", None)
    hidden = checks.message_width(config.hidden_size, model_config)
    sp = config.sequence_parallel
    sp = getattr(model_config, "sequence_parallel", False) if sp is None else sp
    split = grid.size("cp") * (grid.size("tp") if sp else 1)
    checks.check_sequence_split(seq_length, split)
    return (seq_length // split, micro_batch_size, hidden)


# %% [markdown]
# ## Backward, and the output that is freed before its backward
#
# Once a stage has *sent* its output $y_i$, its values are no longer needed: the next stage
# has its own copy, and this stage's backward needs only $y_i$'s `grad_fn` and the incoming
# gradient. Yet the list of stored outputs keeps $y_i$ alive until its backward: on stage 0
# of the running example, 32 MiB per in-flight micro-batch. Megatron's `deallocate_output_tensor`
# (`schedules.py:157`) replaces `y.data` by a 1-element tensor right after the send. PyTorch's
# `torch.autograd.backward(y, dy)` would then refuse the gradient (its shape no longer matches
# `y`), so `custom_backward` (`schedules.py:190`) calls the autograd engine directly, which
# checks `dy` against the shape recorded in the graph, not against `y.data`.
# This only works if $y$ is not a view (its `.data` would be someone else's storage) and
# nothing saved $y$ itself for backward — true of a residual add, the last op of every stage.
#
# `backward_step` (`schedules.py:494`): on the last stage the "output" is the loss (scaled by
# `grad_scale_func` for fp16), anywhere else it is $y_i$ with the received gradient; the
# return value is the gradient of the stage's input, which goes to the previous stage.

# %%
def deallocate_output_tensor(out, deallocate_pipeline_outputs: bool = False) -> None:
    """Pseudo-free a sent output: keep the tensor (and its grad_fn), drop its values."""
    if out is None or not deallocate_pipeline_outputs:
        return
    if out._base is not None:
        raise ValueError("cannot pseudo-free a view: the stage output must own its storage "
                         f"(shape {tuple(out.shape)}); end the stage with a fresh tensor")
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Backward from `output` without PyTorch's output/grad shape check (output may be freed)."""
    if grad_output is None:  # the loss: a scalar
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


def backward_step(input_tensor, output_tensor, output_tensor_grad, config: ScheduleConfig):
    """Backward of one micro-batch through one chunk; returns the gradient of its input."""
    if output_tensor_grad is None and config.grad_scale_func is not None:
        output_tensor = config.grad_scale_func(output_tensor)
    if output_tensor.requires_grad:
        if config.deallocate_pipeline_outputs:
            custom_backward(output_tensor, output_tensor_grad)
        else:
            torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    return None if input_tensor is None else input_tensor.grad

# %% [markdown]
# ## No pipelining: gradient accumulation
#
# `forward_backward_no_pipelining` (`schedules.py:634`): micro-batches $0 \dots m-2$ run inside
# `no_sync_func()`, each forward immediately followed by its backward (so only one
# micro-batch's activations are ever alive); the last runs outside it, so the DDP buckets
# launch their collectives during its backward; then `finalize_model_grads` waits for them,
# reduces what TP and the tied embedding need, and (per-token loss) divides by the total number
# of tokens the last stage counted. The return value is the list of loss reports, one per
# micro-batch. With `forward_only` there is no backward and no finalize: evaluation.
#
# Every schedule of this chapter calls its micro-batches through `_Steps`: `forward(c, x)`
# runs `forward_step` on chunk $c$ and adds the token count to the total, `backward(c, x, y,
# dy)` runs `backward_step`. Two helpers build one `no_sync` context from one factory or one
# per chunk, and call `finalize_model_grads` with the token count.

# %%
class _Steps:
    """forward_step / backward_step bound to one schedule call; sums the last stage's tokens."""

    def __init__(self, forward_step_func, data_iterators, chunks, num_microbatches, grid,
                 config):
        self.func, self.iterators, self.chunks = forward_step_func, data_iterators, chunks
        self.m, self.grid, self.config, self.store = num_microbatches, grid, config, []
        self.total_num_tokens = torch.zeros((), dtype=torch.int, device=grid.device)

    def forward(self, c: int, x):
        last = c == len(self.chunks) - 1 and self.grid.is_last_stage()
        y, n = forward_step(self.func, self.iterators[c], self.chunks[c], self.m, x, self.store,
                            last, self.config.calculate_per_token_loss, self.grid.size("cp"))
        self.total_num_tokens.add_(n.to(self.total_num_tokens.device))
        return y

    def backward(self, c: int, x, y, dy):
        return backward_step(x, y, dy, self.config)


def _context_factory(funcs) -> Callable:
    """One context-manager factory from None, a factory, or a list of them (one per chunk)."""
    if funcs is None:
        return contextlib.nullcontext
    if isinstance(funcs, (list, tuple)):
        def entered_all():
            stack = contextlib.ExitStack()
            for f in funcs:
                stack.enter_context(f())
            return stack
        return entered_all
    return funcs


def _finalize(config: ScheduleConfig, model: list, grid, total_num_tokens) -> None:
    if config.finalize_model_grads_func is not None:
        num_tokens = total_num_tokens if config.calculate_per_token_loss else None
        config.finalize_model_grads_func(model, grid, num_tokens)

# %% [markdown]
# The schedule itself: `one()` is a forward and, when training, its backward right after;
# the loop runs all but the last inside `no_sync`, the last outside it.

# %%
def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model,
                                   num_microbatches: int, seq_length: int = 0,
                                   micro_batch_size: int = 0, grid: ParallelGrid | None = None,
                                   forward_only: bool = False,
                                   config: ScheduleConfig | None = None) -> list[dict]:
    """Gradient accumulation over m micro-batches; grad collectives only in the last backward."""
    chunk, data_iterator = checks.single_chunk(model, data_iterator, "no-pipelining")
    config, grid = config or ScheduleConfig(), grid or ParallelGrid.single()
    checks.check_num_microbatches(num_microbatches)
    steps = _Steps(forward_step_func, [data_iterator], [chunk], num_microbatches, grid, config)
    _, steps = instrument(None, steps, config.recorder, stage=0)

    def one() -> None:
        out = steps.forward(0, None)
        if not forward_only:
            steps.backward(0, None, out, None)

    with _context_factory(config.no_sync_func)():
        for _ in range(num_microbatches - 1):
            one()
    one()  # outside no_sync: the bucket collectives fire in this backward
    if not forward_only:
        _finalize(config, [chunk], grid, steps.total_num_tokens)
    return steps.store

# %% [markdown]
# ## 1F1B as the trainer runs it
#
# The trainer's 1F1B is [01.4](pipeline_orders.py)'s bare function with four additions, each
# a few lines:
#
# 1. **Pseudo-freeing.** A pair is stored only after its output was sent, and the output is
#    shrunk to one element there (`deallocate_output_tensor`); its backward goes through
#    `custom_backward`, inside `backward_step`.
# 2. **When the grad collective may start.** All of it runs inside `no_sync`. The grad sync
#    is enabled right before the stage's *last* backward — in the steady state when $w_r = 0$
#    (the last stage), else in the cooldown. If the loop passes its own `grad_sync_func`, only
#    stage 0 enables the hooks there; the other stages call `grad_sync_func` after their
#    cooldown (their collectives then hide in the pipeline's drain, `schedules.py:2405-2430`).
# 3. **Forward only** (evaluation): no pairs, no backward, no gradient messages.
# 4. **Callbacks and a communicator.** `finalize_model_grads_func` from the config, with the
#    last stage's token count. The messages go through `_StageP2P`, appendix A's helpers bound
#    to this stage's message shape and dtype, and the micro-batches through `_Steps`: two
#    objects a recorder can wrap (see below).

# %%
class _GradSync:
    """Enter no_sync once, leave it once (Megatron's disable_grad_sync / enable_grad_sync)."""

    def __init__(self, config: ScheduleConfig):
        self.factory, self.context = _context_factory(config.no_sync_func), None

    def disable(self) -> None:
        if self.context is None:
            self.context = self.factory()
            self.context.__enter__()

    def enable(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None


def _call_all(funcs) -> None:
    for f in funcs if isinstance(funcs, (list, tuple)) else [funcs]:
        f()

# %% [markdown]
# The communicator: one method per helper the schedules call, the stage's message shape and
# dtype filled in; each is a no-op at the pipeline's end on its side. `exchange` is the
# interleaved schedule's four-way message.

# %%
class _StageP2P:
    """Appendix A's point-to-point helpers bound to one stage's message shape and dtype."""

    def __init__(self, grid: ParallelGrid, shape, dtype: torch.dtype, batched: bool = True):
        self.grid, self.shape, self.dtype, self.batched = grid, shape, dtype, batched
        self.rank, self.size = grid.rank("pp"), grid.size("pp")
        self.first, self.last = grid.is_first_stage(), grid.is_last_stage()
        self.method = {"batch_p2p_comm": batched}  # one method for every message

    def recv_forward(self):
        return p2p.recv_forward(self.shape, self.grid, self.dtype, **self.method)

    def recv_backward(self):
        return p2p.recv_backward(self.shape, self.grid, self.dtype, **self.method)

    def send_forward(self, y) -> None:
        p2p.send_forward(y, self.grid, **self.method)

    def send_backward(self, dx) -> None:
        p2p.send_backward(dx, self.grid, **self.method)

    def send_forward_recv_backward(self, y):
        return p2p.send_forward_recv_backward(y, self.shape, self.grid, self.dtype, **self.method)

    def send_backward_recv_forward(self, dx):
        return p2p.send_backward_recv_forward(dx, self.shape, self.grid, self.dtype, **self.method)

    def exchange(self, y, dx, recv_prev: bool, recv_next: bool):
        return p2p.send_forward_backward_recv_forward_backward(
            y, dx, recv_prev, recv_next, self.shape, self.grid, self.dtype, **self.method)


# %% [markdown]
# One schedule call builds its communicator from the message shape and its steps, and lets
# the recorder wrap both.

# %%
def _comm_and_steps(forward_step_func, iterators, chunks, num_microbatches, seq_length,
                    micro_batch_size, grid, config):
    """The stage's communicator and steps, both wrapped when the config has a recorder."""
    shape = tensor_shape(chunks[0], seq_length, micro_batch_size, grid, config)
    comm = _StageP2P(grid, shape, config.pipeline_dtype, checks.batch_p2p(config))
    return instrument(comm,
                      _Steps(forward_step_func, iterators, chunks, num_microbatches, grid, config),
                      config.recorder, stage=grid.rank("pp"))

# %% [markdown]
# One call keeps its state in `_Run1F1B`. `own_sync` says whether this stage's hooks launch
# the grad collectives in its last backward (addition 2); `keep` stores a pair once its output
# was sent and pseudo-frees the output (addition 1).

# %%
class _Run1F1B:
    """One 1F1B call: communicator and steps, the pairs in flight, the grad sync."""

    def __init__(self, comm, steps, config: ScheduleConfig, m: int, forward_only: bool):
        self.comm, self.steps, self.config, self.m = comm, steps, config, m
        self.forward_only, self.x = forward_only, None  # x: the input of the next forward
        self.warmup = num_warmup_microbatches_1f1b(comm.size, comm.rank, m)
        self.own_sync = config.grad_sync_func is None or comm.rank == 0
        self.inputs, self.outputs, self.sync = [], [], _GradSync(config)

    def keep(self, x, y) -> None:
        """After y was sent: store the pair, pseudo-free y (training only)."""
        if not self.forward_only:
            self.inputs.append(x)
            self.outputs.append(y)
            deallocate_output_tensor(y, self.config.deallocate_pipeline_outputs)

    def backward(self, dy):
        """Backward of the oldest micro-batch in flight; returns its input's gradient."""
        return self.steps.backward(0, self.inputs.pop(0), self.outputs.pop(0), dy)

# %% [markdown]
# The warmup is the bare one with `keep`. The steady state adds forward-only rounds (send the
# output, receive the next input, nothing back) and enables the grad sync before the last
# stage's last backward, which falls in the steady state since its warmup is empty.

# %%
def _warmup_1f1b(run: _Run1F1B) -> None:
    """w_r forwards, each output sent on before the next input is received."""
    for _ in range(run.warmup):
        x = run.comm.recv_forward()
        y = run.steps.forward(0, x)
        run.comm.send_forward(y)
        run.keep(x, y)


def _steady_1f1b(run: _Run1F1B) -> None:
    """m - w_r rounds: forward the next micro-batch, then backward the oldest in flight."""
    comm, steps, m, warmup = run.comm, run.steps, run.m, run.warmup
    run.x = comm.recv_forward() if warmup < m else None
    for i in range(m - warmup):
        last = i == m - warmup - 1
        y = steps.forward(0, run.x)
        if run.forward_only:
            comm.send_forward(y)
            run.x = None if last else comm.recv_forward()
            continue
        dy = comm.send_forward_recv_backward(y)
        run.keep(run.x, y)
        if last and warmup == 0 and run.own_sync:
            run.sync.enable()  # the last stage's last backward runs in the steady state
        dx = run.backward(dy)
        if last:
            comm.send_backward(dx)
        else:
            run.x = comm.send_backward_recv_forward(dx)
        y = dy = dx = None  # sent and done: not held through the next round

# %% [markdown]
# The cooldown enables the grad sync before this stage's last backward, or, on a stage that
# leaves it to `grad_sync_func`, launches the collectives after it; then `finalize_model_grads`.

# %%
def _cooldown_1f1b(run: _Run1F1B, chunk, grid: ParallelGrid) -> list[dict]:
    """The warmup's micro-batches, backward; the grad sync; finalize. Returns the reports."""
    for i in range(run.warmup):
        if i == run.warmup - 1 and run.own_sync:
            run.sync.enable()
        dy = run.comm.recv_backward()
        run.comm.send_backward(run.backward(dy))
    if run.sync.context is not None:  # stages > 0 with a grad_sync_func: launch now
        run.sync.enable()
        _call_all(run.config.grad_sync_func)
    _finalize(run.config, [chunk], grid, run.steps.total_num_tokens)
    return run.steps.store

# %% [markdown]
# The schedule: check, build the communicator and the run, hold the grad sync back, and the
# three phases; evaluation stops after the steady state.

# %%
def forward_backward_pipelining_without_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, grid: ParallelGrid, forward_only: bool = False,
        config: ScheduleConfig | None = None) -> list[dict]:
    """1F1B on this stage: min(p-r-1, m) warmup forwards, steady 1F1B, cooldown backwards."""
    chunk, data_iterator = checks.single_chunk(model, data_iterator, "1F1B")
    config, m = config or ScheduleConfig(), num_microbatches
    checks.check_pipeline(grid, m)
    comm, steps = _comm_and_steps(forward_step_func, [data_iterator], [chunk], m, seq_length,
                                  micro_batch_size, grid, config)
    run = _Run1F1B(comm, steps, config, m, forward_only)
    if not forward_only:
        run.sync.disable()
    _warmup_1f1b(run)
    _steady_1f1b(run)
    if forward_only:
        return steps.store
    return _cooldown_1f1b(run, chunk, grid)

# %% [markdown]
# ## The knobs
#
# `ScheduleConfig` carries the fields of Megatron's `ModelParallelConfig` that the schedules
# read, with the same names. The callbacks are set by the training loop
# (`megatron/training/training.py:3227-3245`): `grad_scale_func` is the optimizer's
# `scale_loss` (fp16 loss scaling); with `overlap_grad_reduce`, `no_sync_func` is the DDP
# wrapper's `no_sync` (one per chunk) and, with `align_grad_reduce` (on by default), also
# `grad_sync_func` its `start_grad_sync`; `finalize_model_grads_func` is chapter 05's
# `finalize_model_grads(model_chunks, grid, num_tokens)`. With `overlap_param_gather` and
# `align_param_gather`, `param_sync_func` is each chunk's `start_param_sync`: only the
# interleaved schedule calls it ([01.7](interleaved.py)); with one chunk the forward
# pre-hooks of chapter 05 dispatch its all-gathers.
#
# <details><summary>Megatron detail: the grid, and who reads param_sync_func</summary>
#
# tinytron
# passes the grid where Megatron passes its process-group collection. This page's schedules
# never call `param_sync_func`, as Megatron's do not: every read of `config.param_sync_func` in
# `schedules.py` lies inside `forward_backward_pipelining_with_interleaving` (`:1059-1067,
# 1161-1163, 1283-1296, 2043-2045`), none in `forward_backward_no_pipelining` (`:634`) or
# `forward_backward_pipelining_without_interleaving` (`:2089`).
#
# </details>
#
# `batch_p2p_comm` says how every message of a schedule call is posted: one
# `batch_isend_irecv` per exchange or single `isend`/`irecv`, never a mix, since under NCCL
# they travel on different communicators ([appendix A](../parallel/pipeline_p2p.py)); `None`
# is `not overlap_p2p_comm`, as Megatron sets it (`megatron/training/argument_utils.py:302`).
# The `recorder` is tinytron's (`ScheduleRecorder`, of the timeline page).

# %%
@dataclass
class ScheduleConfig:
    """What the schedules read (Megatron's ModelParallelConfig names) plus a recorder."""

    pipeline_dtype: torch.dtype = torch.float32
    """dtype of the activations and gradients sent between stages."""
    deallocate_pipeline_outputs: bool = True
    """Shrink a stage's output to one element once it is sent (only its grad_fn is needed)."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Interleaved schedule: micro-batches per chunk before moving to the next; None means p."""
    overlap_p2p_comm: bool = False
    """Interleaved schedule: post the p2p messages async, wait where needed (its page)."""
    batch_p2p_comm: bool | None = None
    """Post each exchange as one batch_isend_irecv (True) or as single isend/irecv (False), for
    every message of the schedule; None: `not overlap_p2p_comm`. Both True is a ValueError."""
    calculate_per_token_loss: bool = True
    """Back-propagate loss sums; finalize_model_grads divides by the global token count."""
    no_sync_func: Callable | list | None = None
    """Context manager (or one per chunk) that holds back the grad collectives."""
    grad_sync_func: Callable | list | None = None
    """Launches the grad collectives (or one per chunk); called with no arguments."""
    param_sync_func: Callable | list | None = None
    """Launches the param all-gathers (or one per chunk); interleaved schedule only; no args."""
    finalize_model_grads_func: Callable | None = None
    """Called as f(model_chunks, grid, num_tokens or None) after the last backward."""
    grad_scale_func: Callable | None = None
    """Scales the loss before backward (fp16 loss scaling)."""
    recorder: ScheduleRecorder | None = None
    """When given, every forward/backward/send/recv is recorded in it."""
    hidden_size: int | None = None
    """Width of the pipeline messages; None reads it from the model chunk's config."""
    sequence_parallel: bool | None = None
    """Messages are split over TP along the sequence; None reads it from the chunk's config."""

    def __post_init__(self):
        checks.batch_p2p(self)  # the combination Megatron forbids fails here, and again per call

# %% [markdown]
# ## Recording, beside the schedule
#
# The timeline page draws these schedules from what they did, yet no line above records
# anything. `instrument(comm, steps, recorder, stage)` returns the two objects unchanged
# without a recorder; with one it wraps both (in
# `chapters/01_main_loop/_schedule_recording.py`), so that every call of `steps.forward`,
# `steps.backward` and of each communicator method becomes a `ScheduleEvent`, stamped with
# `time.perf_counter()`.
#
# <details><summary>How an event is named</summary>
#
# The wrappers name each event's (chunk, micro-batch) from what the schedule hands them: the
# $n$-th forward (or backward) of a chunk is micro-batch $n$, since every schedule runs a
# chunk's micro-batches in order; a sent tensor belongs to the step that produced it; a
# received one to the step that consumes it. A combined exchange is one event per tensor it
# moved, and a helper that is a no-op at this end of the pipeline records nothing.
#
# </details>
#
# ## Choosing the schedule
#
# `get_forward_backward_func` (`schedules.py:48`): one pipeline stage → no pipelining; more
# than one with virtual stages → the interleaved schedule ([01.7](interleaved.py)); otherwise
# 1F1B, all with the same keywords. The naive schedules of [01.4](pipeline_orders.py) are never
# picked.

# %%
def get_forward_backward_func(pp_size: int = 1, vpp_size: int | None = None) -> Callable:
    """The schedule for this layout: no pipelining, 1F1B, or interleaved 1F1B."""
    checks.check_pp_size(pp_size)
    if pp_size == 1:
        return forward_backward_no_pipelining
    if vpp_size is not None and vpp_size > 1:
        from tinytron.main_loop.interleaved import forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving

# %% [markdown]
# ## Demo: the running example's pipeline, on two gloo ranks
#
# The tiny GPT cut into two stages, $m = 8$ micro-batches of one sequence each: the running
# example's PP 2 and $m$ at CPU size. One training step through `get_forward_backward_func(2)`:
# each stage prints the order it executed (from the recorder), and every gradient is compared
# with one process running the 8 micro-batches in turn. Then a step of 4 micro-batches
# through a 2-layer cut runs under chapter 01's `LiveBytesMeter`, stamped after every forward
# and backward, with and without pseudo-freeing; a saved-tensor hook counts the micro-batches
# whose activations autograd still holds.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.launch import run_on_ranks
    from tinytron.main_loop._workers import schedules_demo

    stages = run_on_ranks(schedules_demo, 2, timeout=180)
    orders = [" ".join(f"{k[0].upper()}{mb}" for k, _, mb in r["case"]["orders"][0])
              for r in stages]
    for r, order in enumerate(orders):
        print(f"stage {r} (warmup {num_warmup_microbatches_1f1b(2, r, 8)}): {order}")
    print("grads bitwise equal to one process:", [r["case"]["bitwise"][0] for r in stages])
    for r, res in enumerate(stages):
        on, off = res["on"], res["off"]
        print(f"stage {r}: at most {on['max_in_flight_saved']} micro-batches alive "
              f"(= p - r = {2 - r}); peak {on['peak_at_marks'] / 2**20:.2f} MiB pseudo-freed, "
              f"{off['peak_at_marks'] / 2**20:.2f} MiB kept "
              f"(one message = {on['message_bytes'] / 2**10:.0f} KiB)")

# %% [markdown]
# The live bytes of the $m = 4$ step, after each forward and backward: dotted with the sent
# outputs kept, solid with them pseudo-freed.

# %%
if __name__ == "__main__":
    fig, axes = plt.subplots(2, 1, figsize=(8, 3.6), sharey=True)
    for r, (res, ax) in enumerate(zip(stages, axes)):
        for key, style in (("off", ":"), ("on", "-")):
            marks = res[key]["marks"]
            ax.step(range(len(marks)), [live / 2**10 for *_, live, _ in marks], style,
                    where="post", color=f"C{r}",
                    label="outputs kept" if key == "off" else "outputs pseudo-freed")
        ax.set_xticks(range(len(marks)), [f"{k[0].upper()}{mb}" for k, _, mb, *_ in marks],
                      fontsize=7)
        ax.set_ylabel(f"stage {r}\nlive KiB")
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_title("1F1B, p = 2, m = 4: live bytes after each forward / backward (measured)")
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The claims: the orders of [01.4](pipeline_orders.py)'s table, the same bits as one process,
# at most $p - r$ micro-batches alive, and at least one message saved on stage 0.

# %%
if __name__ == "__main__":
    assert orders[0] == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    assert orders[1] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    assert all(r["case"]["bitwise"][0] for r in stages)  # same op order: same bits
    assert [r["on"]["max_in_flight_saved"] for r in stages] == [2, 1]
    # pseudo-freeing saves (at least) the one stored output stage 0 has already sent
    saved = stages[0]["off"]["peak_at_marks"] - stages[0]["on"]["peak_at_marks"]
    assert saved >= stages[0]["on"]["message_bytes"] - 64, saved

# %% [markdown]
# ## Summary
#
# - No pipelining = gradient accumulation, with the DDP collectives held back (`no_sync`)
#   until the last micro-batch's backward.
# - The trainer's 1F1B is the bare order plus four things: sent outputs pseudo-freed (their
#   backward goes straight to the autograd engine), the grad sync enabled for the last
#   backward only, a forward-only pass, and callbacks and a communicator a recorder can wrap.
# - Its gradients equal one process running the micro-batches in turn: bit for bit with
#   pipelining alone; within $10^{-6}$ with TP 2 × PP 2 and DP 2 × PP 2, whose sums are split
#   differently.
#
#   <details><summary>Megatron detail: the measured gaps</summary>
#
#   The largest gaps measured
#   over the tests' cases (2-3 steps each) are $8.3 \cdot 10^{-8}$ (TP 2 × PP 2) and
#   $2 \cdot 10^{-8}$ (DP 2 × PP 2, with and without interleaving).
#
#   </details>
#
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/pipeline_parallel/schedules.py` (`get_forward_backward_func`
#   :48, `deallocate_output_tensor` :157, `custom_backward` :190, `backward_step` :494,
#   `forward_backward_no_pipelining` :634, `forward_backward_pipelining_without_interleaving`
#   :2089) over `megatron/core/pipeline_parallel/p2p_communication.py`; the callbacks are wired
#   in `megatron/training/training.py:3227-3245`. It also offers partial activation
#   checkpointing per micro-batch in the warmup window and MoE-specific overlapped variants.
# - PyTorch / torchtitan: `torch.distributed.pipelining` (`ScheduleGPipe`, `Schedule1F1B`,
#   `ScheduleInterleaved1F1B`, and zero-bubble schedules that split the backward into input-
#   and weight-gradient halves), chosen in `torchtitan/distributed/pipeline_parallel.py`.
#
# ## Exercises
#
# 1. The running example with PP 4: how many bytes of sent outputs does stage 0 keep at its
#    1F1B peak without pseudo-freeing, and how many with it?
#
#    <details><summary>Answer</summary>
#
#    Stage 0 holds up to $p - 0 = 4$ micro-batches' pairs,
#    and each stored output is one message, $2048 \cdot 2 \cdot 4096$ bf16 values = 32 MiB:
#    128 MiB kept. Pseudo-freed, each is one element: 4 × 2 bytes.
#
#    </details>
#
# 2. Why does the last stage never need `deallocate_output_tensor` to save memory?
#
#    <details><summary>Hint</summary>
#
#    Look at what the last stage's `forward_step` returns and
#    whether it is ever sent: its output is the loss, a one-element scalar, and with $w_r = 0$
#    its backward follows its forward in the same round.
#
#    </details>
#
# 3. With a `grad_sync_func`, stages other than 0 launch their grad collectives after the
#    cooldown instead of during the last backward. When is that better?
#
#    <details><summary>Hint</summary>
#
#    Compare what else the stage does during its last backward
#    and after its cooldown: the first is on the critical path of the pipeline, the second is
#    the drain, where the stage waits for stage 0 anyway. See `schedules.py:2405-2430` and ask
#    when a collective is slow enough to delay the backward it overlaps.
#
#    </details>
