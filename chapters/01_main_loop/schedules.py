# %% [markdown]
# # 01 · Schedules: no pipelining and 1F1B
#
# An iteration runs $m$ micro-batches through forward and backward before the optimizer steps
# once; *in which order*, and with pipeline parallelism *on which stage when*, is the
# schedule's job. This page builds Megatron's no-pipelining and **1F1B** schedules (and their
# forward-only evaluation) over appendix A's point-to-point sends; the next page interleaves.
#
# You will build: `ScheduleConfig`, `forward_step`, `backward_step`, `deallocate_output_tensor`,
# `custom_backward`, `forward_backward_no_pipelining`,
# `forward_backward_pipelining_without_interleaving`, `get_forward_backward_func`.

# %%
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tinytron.main_loop.schedule_timeline import ScheduleEvent, ScheduleRecorder
from tinytron.overview.loss import microbatch_objective
from tinytron.parallel import ParallelGrid
from tinytron.parallel import pipeline_p2p as p2p

__all__ = ["ScheduleConfig", "ScheduleEvent", "ScheduleRecorder", "tensor_shape",
           "forward_step", "backward_step", "deallocate_output_tensor", "custom_backward",
           "forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
           "get_forward_backward_func", "num_warmup_microbatches_1f1b"]

# %% [markdown]
# ## Why a schedule
#
# The global batch is cut into $m$ micro-batches whose gradients are **accumulated** into one
# buffer before one optimizer step. Without pipeline parallelism the order is obvious, and the
# only question is *when to average the gradients over data-parallel ranks*: once, during the
# last micro-batch's backward. Averaging after every micro-batch would move $m$ times the bytes
# for the same result, so Megatron runs micro-batches
# $0 \dots m-2$ inside the DDP wrapper's `no_sync()` (the bucket hooks only accumulate) and the
# last one outside it, where each bucket's collective fires as soon as its gradients are
# complete (`forward_backward_no_pipelining`, `megatron/core/pipeline_parallel/schedules.py:634`;
# chapter 05 builds `no_sync` and the buckets).
#
# With pipeline parallelism the model is cut into $p$ **stages**, one per rank of the `pp`
# group. Stage $r$ cannot start micro-batch $i$ before stage $r-1$ has sent it, and cannot run
# $i$'s backward before stage $r+1$ has sent the gradient back. The naive order (all forwards,
# then all backwards: "GPipe") keeps every stage idle for $p-1$ forward and $p-1$ backward
# slots — the **bubble** — and stores the activations of all $m$ micro-batches at once.
#
# **1F1B** (one forward, one backward; Narayanan et al., *PipeDream-Flush*, and Megatron's
# default) has the same bubble but bounds memory: stage $r$ runs
#
# 1. **warmup**: $w_r = \min(p - r - 1,\ m)$ forwards (`schedules.py:2227`), just enough to fill
#    the pipeline below it;
# 2. **steady state**: $m - w_r$ rounds of *one forward, then one backward* of the oldest
#    micro-batch still in flight;
# 3. **cooldown**: the last $w_r$ backwards.
#
# A micro-batch's activations live from its forward to its backward, so stage $r$ never holds
# more than $w_r + 1 = p - r$ micro-batches' activations, whatever $m$ is. GPipe holds $m$.
#
# ### The running example
#
# The book's 7B run has TP 2, PP 2, DP 64, micro-batch 2 and global batch 1024, so
# $m = 1024 / (2 \cdot 64) = 8$ micro-batches per iteration on each pipeline:
#
# | stage $r$ | warmup $w_r$ | steady rounds | cooldown | max in flight $p - r$ |
# |---|---|---|---|---|
# | 0 (embedding, layers 0-15) | 1 | 7 | 1 | 2 |
# | 1 (layers 16-31, head, loss) | 0 | 8 | 0 | 1 |
#
# Stage 0 runs `F0 | F1 B0 F2 B1 … F7 B6 | B7`, stage 1 runs `F0 B0 F1 B1 … F7 B7`.
# Each message between them is one activation $[s/t, b, h] = [2048, 2, 4096]$ in bf16
# (sequence parallelism splits $s$ over TP), 32 MiB, and the same for its gradient: 8 sends
# in each direction per iteration. The bubble is $(p-1)/(m+p-1) = 1/9 \approx 11\%$ of the
# iteration (Narayanan et al. 2021, arXiv:2104.04473 §2.2.1: bubble $= (p-1)/m$ of the ideal
# time).
#
# ```mermaid
# flowchart LR
#   subgraph S0["stage 0: warmup 1"]
#     a0["F0"] --> a1["F1"] --> a2["B0"] --> a3["F2"] --> a4["B1"] --> a5["… F7 B6"] --> a6["B7"]
#   end
#   subgraph S1["stage 1: warmup 0"]
#     b0["F0"] --> b1["B0"] --> b2["F1"] --> b3["B1"] --> b4["… F7 B7"]
#   end
#   a0 -. "send act 0" .-> b0
#   b1 -. "send grad 0" .-> a2
# ```
#
# ## The knobs, and a recorder
#
# `ScheduleConfig` carries the fields of Megatron's `ModelParallelConfig` that the schedules
# read, with the same names. The callbacks are set by the training loop
# (`megatron/training/training.py:3227-3245`): `no_sync_func` is the DDP wrapper's `no_sync`
# (one per chunk), `grad_sync_func` its `start_grad_sync`, `finalize_model_grads_func`
# chapter 05's `finalize_model_grads(model_chunks, grid, num_tokens)` (tinytron passes the grid
# where Megatron passes its process-group collection), `grad_scale_func` the optimizer's
# `scale_loss` (fp16 loss scaling). The `recorder` is tinytron's (`ScheduleRecorder`, defined
# with the pictures it feeds on the timeline page): every forward, backward, send and receive
# is stamped with `time.perf_counter()`, a clock shared by the processes of one machine.

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
    calculate_per_token_loss: bool = True
    """Back-propagate loss sums; finalize_model_grads divides by the global token count."""
    no_sync_func: Callable | list | None = None
    """Context manager (or one per chunk) that holds back the grad collectives."""
    grad_sync_func: Callable | list | None = None
    """Launches the grad collectives (or one per chunk); called with no arguments."""
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


@contextlib.contextmanager
def _span(config: ScheduleConfig, stage: int, chunk: int, microbatch: int, kind: str):
    """Record the enclosed work as one event when the config has a recorder."""
    if config.recorder is None:
        yield
        return
    start = time.perf_counter()
    yield
    config.recorder.record(stage, chunk, microbatch, kind, start, time.perf_counter())

# %% [markdown]
# ## One forward step and the loss contract
#
# `forward_step` hands the chunk the activation received from the previous stage
# (`set_input_tensor`, chapter B), calls the user's `forward_step_func(data_iterator, model)`
# and, **on the last stage only**, applies the returned `loss_func` — chapter 00's contract
# `(loss_sum, num_tokens, {"lm loss": [sum, count]})`. What is back-propagated is chapter 00's
# `microbatch_objective`: the raw sum with `calculate_per_token_loss` (the division by the
# global token count happens once, in `finalize_model_grads`), else
# $S_j / \max(N_j, 1) / m$ (`forward_step_calc_loss`, `schedules.py:251`). A legacy 2-tuple
# `(loss, report)` is scaled by $c/m$ for $c$ context-parallel ranks, as Megatron does. Every
# other stage returns its hidden states and a token count of 0.
#
# The message shape is fixed before anything arrives: $[s/c, b, h]$, and $[s/(c\,t), b, h]$
# with sequence parallelism (`get_tensor_shapes`, `schedules.py:2057`).

# %%
def _unwrap(chunk):
    """The module that owns set_input_tensor / config (through DDP's .module)."""
    while not hasattr(chunk, "set_input_tensor") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def tensor_shape(model_chunk, seq_length: int, micro_batch_size: int, grid: ParallelGrid,
                 config: ScheduleConfig) -> tuple[int, int, int]:
    """[s/cp (/tp under SP), b, h]: the activation a stage sends and the gradient it receives."""
    model_config = getattr(_unwrap(model_chunk), "config", None)
    hidden = config.hidden_size or getattr(model_config, "hidden_size", None)
    if hidden is None:
        raise ValueError("ScheduleConfig.hidden_size is None and the model chunk has no "
                         "config.hidden_size to read the pipeline message width from")
    sp = config.sequence_parallel
    sp = getattr(model_config, "sequence_parallel", False) if sp is None else sp
    split = grid.size("cp") * (grid.size("tp") if sp else 1)
    if seq_length % split:
        raise ValueError(f"seq_length ({seq_length}) must be divisible by cp*tp(SP) ({split})")
    return (seq_length // split, micro_batch_size, hidden)


def forward_step(forward_step_func, data_iterator, model_chunk, num_microbatches: int,
                 input_tensor, forward_data_store: list, config: ScheduleConfig,
                 is_last_stage: bool, cp_size: int = 1):
    """Run one micro-batch through one chunk; on the last stage turn it into the loss to backprop."""
    _unwrap(model_chunk).set_input_tensor(input_tensor)
    output, loss_func = forward_step_func(data_iterator, model_chunk)
    num_tokens = torch.zeros((), dtype=torch.int)
    if not is_last_stage:
        return output, num_tokens
    result = loss_func(output)
    if len(result) == 3:
        loss_sum, num_tokens, report = result
        output = microbatch_objective(loss_sum, num_tokens, num_microbatches,
                                      config.calculate_per_token_loss)
    elif len(result) == 2:  # legacy contract: an already averaged loss
        loss, report = result
        output = loss * cp_size / num_microbatches
    else:
        raise ValueError(f"loss_func must return 2 or 3 values, got {len(result)}")
    forward_data_store.append(report)
    return output, num_tokens.detach().reshape(()).to(torch.int)

# %% [markdown]
# ## Backward, and the output that is freed before its backward
#
# Once a stage has *sent* its output $y_i$, the tensor's values are no longer needed: the next
# stage has its own copy, and this stage's backward needs only $y_i$'s `grad_fn` (the graph
# behind it) and the incoming gradient $\partial L / \partial y_i$. Yet the list of stored
# outputs keeps $y_i$ alive until its backward — on stage 0 of the running example that is one
# extra 32 MiB tensor per in-flight micro-batch. Megatron's `deallocate_output_tensor`
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
# First four small helpers that all three schedules share: unwrap the single chunk and its
# iterator, check $m$, build one `no_sync` context from one factory or a list of them (one
# per chunk), and call `finalize_model_grads` with the token count when the loss is per token.

# %%
def _single_chunk(model, data_iterator, name: str):
    """The one chunk (and iterator) of a non-interleaved schedule."""
    model = model if isinstance(model, (list, tuple)) else [model]
    iters = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    if len(model) != 1 or len(iters) != 1:
        raise ValueError(f"the {name} schedule takes one model chunk and one data iterator, got "
                         f"{len(model)} chunks and {len(iters)} iterators (interleaving needs "
                         "vpp_size)")
    return model[0], iters[0]


def _check_num_microbatches(num_microbatches) -> None:
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")


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
# The schedule itself: `one(i)` is a forward and, when training, its backward right after;
# the loop runs all but the last inside `no_sync`, the last outside it.

# %%
def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model,
                                   num_microbatches: int, seq_length: int = 0,
                                   micro_batch_size: int = 0, grid: ParallelGrid | None = None,
                                   forward_only: bool = False,
                                   config: ScheduleConfig | None = None) -> list[dict]:
    """Gradient accumulation over m micro-batches; grad collectives only in the last backward."""
    chunk, data_iterator = _single_chunk(model, data_iterator, "no-pipelining")
    config, grid = config or ScheduleConfig(), grid or ParallelGrid.single()
    _check_num_microbatches(num_microbatches)
    store: list[dict] = []
    total_num_tokens = torch.zeros((), dtype=torch.int, device=grid.device)

    def one(i: int) -> None:
        with _span(config, 0, 0, i, "forward"):
            out, n = forward_step(forward_step_func, data_iterator, chunk, num_microbatches,
                                  None, store, config, True, grid.size("cp"))
        total_num_tokens.add_(n.to(total_num_tokens.device))
        if not forward_only:
            with _span(config, 0, 0, i, "backward"):
                backward_step(None, out, None, config)

    with _context_factory(config.no_sync_func)():
        for i in range(num_microbatches - 1):
            one(i)
    one(num_microbatches - 1)  # outside no_sync: the bucket collectives fire in this backward
    if not forward_only:
        _finalize(config, [chunk], grid, total_num_tokens)
    return store

# %% [markdown]
# ## 1F1B without interleaving
#
# `forward_backward_pipelining_without_interleaving` (`schedules.py:2089`), on stage $r$ of
# $p$. Two FIFO lists hold the (input, output) pair of every micro-batch whose backward is
# still to come; the backward always pops the oldest, so backwards run in forward order.
# The sends and receives are appendix A's helpers; in the steady state a stage posts its
# output *and* the receive of a gradient in one exchange (`send_forward_recv_backward`), then
# after the backward its input gradient and the receive of the next input
# (`send_backward_recv_forward`), which is what keeps two neighbors from waiting on each other.
#
# **When the grad collective may start.** All of it runs inside `no_sync`. The grad sync is
# enabled right before the stage's *last* backward — in the steady state when $w_r = 0$
# (the last stage), else in the cooldown. If the loop passes its own `grad_sync_func`, only
# stage 0 enables the hooks there; the other stages call `grad_sync_func` after their cooldown
# (their collectives then hide in the pipeline's drain, `schedules.py:2089`). Finally
# `finalize_model_grads` with the token count of the last stage (it broadcasts it to the
# others).

# %%
def num_warmup_microbatches_1f1b(pp_size: int, pp_rank: int, num_microbatches: int) -> int:
    """Forwards stage pp_rank runs before its first backward: min(p - r - 1, m)."""
    return min(pp_size - pp_rank - 1, num_microbatches)


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

# %% [markdown]
# Every message goes through appendix A's named helpers. `_Stage.p2p` calls one and records
# it — one event per tensor it moved, tagged with the (chunk, micro-batch) that tensor belongs
# to — unless the helper is a no-op at this end of the pipeline (nothing comes from before
# stage 0, nothing goes after the last stage).

# %%
_SIDE = {"recv_forward": "prev", "send_backward": "prev", "send_backward_recv_forward": "prev",
         "recv_backward": "next", "send_forward": "next", "send_forward_recv_backward": "next"}


class _Stage:
    """One pipeline rank as the schedules see it: position, message shape, recorded p2p."""

    def __init__(self, grid, config, shape):
        self.grid, self.config, self.shape = grid, config, shape
        self.rank, self.size = grid.rank("pp"), grid.size("pp")
        self.first, self.last = grid.is_first_stage(), grid.is_last_stage()
        self.dtype = config.pipeline_dtype

    def _timed(self, events, fn):
        """Run one exchange; record it as one event per (kind, chunk, micro-batch) it moved."""
        if self.config.recorder is None or not events:
            return fn()
        start = time.perf_counter()
        out = fn()
        for kind, chunk, mb in events:
            self.config.recorder.record(self.rank, chunk, mb, kind, start, time.perf_counter())
        return out

    def p2p(self, name: str, events, *tensors):
        """Appendix A's helper `name` on `tensors` (a no-op at the pipeline's end), recorded."""
        idle = self.first if _SIDE[name] == "prev" else self.last
        args = tensors + ((self.shape, self.grid, self.dtype) if "recv" in name else (self.grid,))
        return self._timed([] if idle else events, lambda: getattr(p2p, name)(*args))

# %% [markdown]
# `_Runner` holds one chunk's FIFO of (input, output) pairs. `keep` stores a pair *after* its
# output was sent, and pseudo-frees the output there; `backward` pops the oldest pair.

# %%
class _Runner:
    """Forward/backward of one chunk with the FIFO of (input, output) awaiting backward."""

    def __init__(self, forward_step_func, data_iterator, chunk, num_microbatches, stage,
                 config, forward_only):
        self.step_func, self.iterator, self.chunk = forward_step_func, data_iterator, chunk
        self.m, self.stage, self.config = num_microbatches, stage, config
        self.forward_only = forward_only
        self.inputs, self.outputs, self.store = [], [], []
        self.total_num_tokens = torch.zeros((), dtype=torch.int, device=stage.grid.device)

    def forward(self, mb: int, x):
        with _span(self.config, self.stage.rank, 0, mb, "forward"):
            y, n = forward_step(self.step_func, self.iterator, self.chunk, self.m, x, self.store,
                                self.config, self.stage.last, self.stage.grid.size("cp"))
        self.total_num_tokens.add_(n.to(self.total_num_tokens.device))
        return y

    def keep(self, x, y) -> None:
        """Store the pair for backward and pseudo-free the (already sent) output."""
        if self.forward_only:
            return
        self.inputs.append(x)
        self.outputs.append(y)
        deallocate_output_tensor(y, self.config.deallocate_pipeline_outputs)

    def backward(self, mb: int, dy):
        x, y = self.inputs.pop(0), self.outputs.pop(0)
        with _span(self.config, self.stage.rank, 0, mb, "backward"):
            return backward_step(x, y, dy, self.config)

# %% [markdown]
# The three phases. In a steady-state round, the forward of micro-batch $i + w_r$ is followed
# by the backward of micro-batch $i$ (the oldest in flight); forward-only evaluation sends and
# receives activations only.

# %%
def _call_all(funcs) -> None:
    for f in funcs if isinstance(funcs, (list, tuple)) else [funcs]:
        f()


def _check_pipeline(grid) -> None:
    if grid is None or grid.size("pp") < 2:
        raise ValueError("a pipelined schedule needs a grid with pp > 1, got "
                         f"{None if grid is None else grid.size('pp')}")


def _steady_round(i, x, run, st, warmup, remaining, sync, config):
    """One forward, then (training) the backward of the oldest micro-batch in flight."""
    fwd, last = i + warmup, i == remaining - 1
    y = run.forward(fwd, x)
    if run.forward_only:
        st.p2p("send_forward", [("send", 0, fwd)], y)
        return None if last else st.p2p("recv_forward", [("recv", 0, fwd + 1)])
    dy = st.p2p("send_forward_recv_backward", [("send", 0, fwd), ("recv", 0, i)], y)
    run.keep(x, y)
    if warmup == 0 and last and (config.grad_sync_func is None or st.rank == 0):
        sync.enable()  # the last stage's last backward runs in the steady state
    dx = run.backward(i, dy)
    if last:
        st.p2p("send_backward", [("send", 0, i)], dx)
        return None
    return st.p2p("send_backward_recv_forward", [("send", 0, i), ("recv", 0, fwd + 1)], dx)

# %% [markdown]
# The cooldown drains the last $w_r$ backwards, receiving each output gradient and sending the
# input gradient back; stages that kept their own `grad_sync_func` for the drain call it once
# the last backward is done. The schedule function strings the phases together: $w_r$ warmup
# forwards (receive, forward, send, keep), the steady rounds, the cooldown, then the finalize.

# %%
def _cooldown(run, st, warmup, remaining, sync, config) -> None:
    """The last `warmup` backwards; grad sync enabled before the very last one."""
    for i in range(warmup):
        mb = remaining + i
        if i == warmup - 1 and (config.grad_sync_func is None or st.rank == 0):
            sync.enable()
        dy = st.p2p("recv_backward", [("recv", 0, mb)])
        st.p2p("send_backward", [("send", 0, mb)], run.backward(mb, dy))
    if sync.context is not None:  # stages > 0 with a grad_sync_func: launch now
        sync.enable()
        if config.grad_sync_func is not None:
            _call_all(config.grad_sync_func)


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, grid: ParallelGrid, forward_only: bool = False,
        config: ScheduleConfig | None = None) -> list[dict]:
    """1F1B on this stage: min(p-r-1, m) warmup forwards, steady 1F1B, cooldown backwards."""
    chunk, data_iterator = _single_chunk(model, data_iterator, "1F1B")
    config = config or ScheduleConfig()
    _check_num_microbatches(num_microbatches)
    _check_pipeline(grid)
    st = _Stage(grid, config, tensor_shape(chunk, seq_length, micro_batch_size, grid, config))
    run = _Runner(forward_step_func, data_iterator, chunk, num_microbatches, st, config,
                  forward_only)
    warmup = num_warmup_microbatches_1f1b(st.size, st.rank, num_microbatches)
    remaining = num_microbatches - warmup
    sync = _GradSync(config)
    if not forward_only:
        sync.disable()
    for i in range(warmup):
        x = st.p2p("recv_forward", [("recv", 0, i)])
        y = run.forward(i, x)
        st.p2p("send_forward", [("send", 0, i)], y)
        run.keep(x, y)
    x = st.p2p("recv_forward", [("recv", 0, warmup)]) if remaining else None
    for i in range(remaining):
        x = _steady_round(i, x, run, st, warmup, remaining, sync, config)
    if not forward_only:
        _cooldown(run, st, warmup, remaining, sync, config)
        _finalize(config, [chunk], grid, run.total_num_tokens)
    return run.store

# %% [markdown]
# ## Choosing the schedule
#
# `get_forward_backward_func` (`schedules.py:48`): one pipeline stage → no pipelining; more
# than one with virtual stages → the interleaved schedule (next page); otherwise 1F1B. Every
# function takes the same keywords, so the training loop calls whichever it got the same way.

# %%
def get_forward_backward_func(pp_size: int = 1, vpp_size: int | None = None) -> Callable:
    """The schedule for this layout: no pipelining, 1F1B, or interleaved 1F1B."""
    if not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pp_size must be a positive int, got {pp_size!r}")
    if pp_size == 1:
        return forward_backward_no_pipelining
    if vpp_size is not None and vpp_size > 1:
        from tinytron.main_loop.interleaved import forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving

# %% [markdown]
# ## Demo: the running example's pipeline, on two gloo ranks
#
# The tiny GPT (4 layers, untied embeddings) cut into two stages, $m = 8$ micro-batches of one
# sequence each — the running example's PP 2 and $m$ at CPU size. One training step through
# `get_forward_backward_func(2)` with chapter 05's `finalize_model_grads`: each stage prints
# the order it executed (from the recorder), and every gradient is compared with one process
# running the 8 micro-batches one after the other. Then a step of 4 micro-batches through a
# 2-layer cut (the meter slows every operation down) runs under chapter 01's `LiveBytesMeter`,
# stamped after every forward and backward, with and without pseudo-freeing; a saved-tensor
# hook also counts the micro-batches whose activations autograd still holds.

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
# - 1F1B on stage $r$: $\min(p-r-1, m)$ warmup forwards, one-forward-one-backward rounds, then
#   the cooldown; backwards in forward order; at most $p - r$ micro-batches alive (measured).
# - Sent outputs are pseudo-freed; their backward goes straight to the autograd engine.
# - The loss lives on the last stage only (chapter 00's contract). The gradients equal one
#   process running the micro-batches in turn, bit for bit when the operations are the same
#   (tests: PP 2 and 4, TP 2 × PP 2, DP 2).
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/pipeline_parallel/schedules.py` (`get_forward_backward_func`
#   :48, `deallocate_output_tensor` :157, `custom_backward` :190, `forward_step_calc_loss` :251,
#   `backward_step` :494, `forward_backward_no_pipelining` :634,
#   `forward_backward_pipelining_without_interleaving` :2089) over
#   `megatron/core/pipeline_parallel/p2p_communication.py`; the callbacks are wired in
#   `megatron/training/training.py:3227-3245`. It also offers partial activation
#   checkpointing per micro-batch in the warmup window and MoE-specific overlapped variants.
# - PyTorch / torchtitan: `torch.distributed.pipelining` (`ScheduleGPipe`, `Schedule1F1B`,
#   `ScheduleInterleaved1F1B`, and zero-bubble schedules that split the backward into input-
#   and weight-gradient halves), chosen in `torchtitan/distributed/pipeline_parallel.py`.
#
# ## Exercises
#
# 1. Write the GPipe order (all forwards, then all backwards) with the same helpers and measure
#    stage 0's peak live bytes at $m = 8$. By what factor does it exceed 1F1B's?
# 2. Why does the last stage never need `deallocate_output_tensor` to save memory?
# 3. With a `grad_sync_func`, stages other than 0 launch their grad collectives after the
#    cooldown instead of during the last backward. When is that better?
