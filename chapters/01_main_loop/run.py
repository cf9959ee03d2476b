# %% [markdown]
# # 01 · The main loop: the run, `train` and `pretrain`
#
# [01.1](loop.py) took one iteration apart: `train_step` zeroes the gradient buffers, runs the
# schedule, steps the optimizer, has the model-parallel group agree on success, and advances
# the learning rate by the samples consumed; `evaluate` runs the same schedule forward only.
# This page is what repeats them and what surrounds them. `train` runs iterations until one of
# its exit conditions holds, keeping the counters of `TrainState` that a checkpoint carries;
# `pretrain` sets every part up once, in Megatron's order, and hands them to `train`.
#
# Most of what a real run adds lives here: when to stop and when to save, a number of
# micro-batches that grows during the run, evaluation every `eval_interval` iterations, and the
# hooks through which chapters 03 (checkpoints) and 08 (reliability) plug in. The page ends
# with the tiny GPT run through `pretrain` twice, once with plain PyTorch parts and once with
# the book's.

# %%
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from tinytron.main_loop._parts import (ExitSignal, TorchOptimizer, _duration_exceeded,
                                       _earliest_over_ranks, _logs_num_zeros, any_rank,
                                       build_schedule_config, eval_batch, hooked, log_step,
                                       megatron_optimizer_provider, megatron_scheduler_provider,
                                       no_op, print_on_last_rank, wrap_with_ddp)
from tinytron.main_loop.loop import (StepResult, TrainState, _set_pre_hooks, evaluate,
                                     gpt_forward_step, train_step)
from tinytron.main_loop.microbatches import (build_num_microbatches_calculator,
                                             samples_in_iterations, train_iters_from_samples)
from tinytron.main_loop.schedules import ScheduleConfig, get_forward_backward_func
from tinytron.main_loop.training_log import LogState
from tinytron.parallel import ParallelGrid, set_random_seed

# Megatron starts its clock when training.py is imported (`_TRAIN_START_TIME`,
# megatron/training/training.py:10); `exit_duration_in_mins` counts from there.
_TRAIN_START_TIME = time.time()

__all__ = ["checkpoint_and_decide_exit", "LoopHooks", "train", "save_with_param_sync",
           "TrainingRun", "pretrain"]

# %% [markdown]
# ## When to stop, and when to save
#
# After each iteration `checkpoint_and_decide_exit` (`training.py:2953`) checks, in this order:
#
# 1. **a signal** (with `exit_signal_handler`): SIGTERM from the cluster scheduler, seen by any
#    rank, is shared by an all-reduce; save, exit;
# 2. **`save_interval`**: save when `iteration % save_interval == 0`;
# 3. **`exit_duration_in_mins`**: the wall time since the *program* started, MAX-reduced over
#    all ranks so that every rank decides alike; save (unless just saved), exit. Megatron's
#    clock starts when `training.py` is imported (`_TRAIN_START_TIME`), and `pretrain` takes
#    the earliest start over all ranks (a MIN all-reduce, `training.py:1132-1137`); the
#    check is `training.py:3017-3024`. So the setup — building the model, loading a
#    checkpoint — counts against the limit, and a run that is given 4 hours by its cluster
#    stops in time even when its load took 20 minutes;
# 4. **`exit_interval`**: exit when `iteration % exit_interval == 0`, after a save.
#
# The loop itself ends when `iteration == train_iters` (`train_samples` is converted to
# iterations first); `pretrain` then saves a final checkpoint unless the last iteration was
# just saved. A signal handler only records the signal: the iteration in flight finishes, so
# the saved state is always a consistent end-of-step state. An *evaluation* in flight is
# different: it changes no training state, so a signal (like the time limit, which Megatron
# checks between evaluation batches, `training.py:3957-3967`) abandons it after the current
# batch, and the save follows at once — a launcher that kills its ranks some seconds after
# forwarding a Ctrl-C (`torchrun`: 30 s) would otherwise cut a long evaluation's save short.
#
# The three collectives these checks need are plumbing and live in the chapter's private
# module `chapters/01_main_loop/_parts.py`: `ExitSignal`, the handler whose `received(grid)` is
# a MAX over all ranks of "this rank saw the signal"; `_duration_exceeded`, the MAX over all ranks of
# "my clock says the time is up"; and `_earliest_over_ranks`, the MIN of the start times
# that `pretrain` takes once. The MAX matters because clocks and signals differ between
# hosts: if one rank stopped and the others did not, the next collective would hang.

# %%
def _signal_or_time_up(exit_signal, grid: ParallelGrid, time_is_up) -> bool:
    """Whether to abandon an evaluation: a signal on any rank, or the duration limit."""
    return exit_signal.received(grid) or (time_is_up is not None and time_is_up())


def checkpoint_and_decide_exit(state: TrainState, training, save, *, start_time: float,
                               clock, grid: ParallelGrid, exit_signal=None) -> str | None:
    """Save when due; return why to stop ('signal', 'duration', 'exit_interval') or None."""
    it = state.iteration
    if exit_signal is not None and exit_signal.received(grid):
        save()
        return "signal"
    saved = bool(training.save_interval) and it % training.save_interval == 0
    if saved:
        save()
    if training.exit_duration_in_mins and _duration_exceeded(
            training.exit_duration_in_mins, start_time, clock, grid):
        if not saved:
            save()
        return "duration"
    if training.exit_interval and it % training.exit_interval == 0:
        if not saved:
            save()
        return "exit_interval"
    return None

# %% [markdown]
# ## `train`: the iteration loop
#
# Per iteration (`training.py:3401-3792`), in order:
#
# 1. `finalize_async_save_fn(blocking=False)`: complete a background checkpoint whose write
#    has finished (chapter 03); collective, so every rank calls it.
# 2. Update the micro-batch calculator with the consumed samples. If $m$ changed (a step
#    schedule), it must have grown (`training.py:3443-3446`) — and a checkpoint is saved at
#    the change.
# 3. `train_step`.
# 4. `iteration += 1`; `consumed_train_samples += m·b·d` (skipped or not);
#    `skipped_train_samples +=` what `decrease_batch_size_if_needed` dropped; the FLOPs of the
#    batch are added to the running sum (`training.py:3585-3628`).
# 5. `training_log` ([its page](training_log.py)): accumulate, and hand a record to `log_fn` every `log_interval`.
# 6. Evaluate every `eval_interval` iterations.
# 7. `checkpoint_and_decide_exit`.
#
# At the end: `finalize_async_save_fn(blocking=True)` drains any save still in flight.
#
# ```mermaid
# flowchart TB
#   P["pretrain: seeds, model, optimizer,<br/>scheduler, load_checkpoint, data"] --> A["finalize_async_save_fn<br/>(non-blocking)"]
#   A --> M["update m from<br/>consumed samples"] --> S["train_step"]
#   S --> C["iteration += 1<br/>consumed += m·b·d"] --> G["training_log"]
#   G --> E["evaluate every<br/>eval_interval"] --> K["checkpoint_and_decide_exit"]
#   K -->|continue| A
#   K -->|exit| F["finalize_async_save_fn<br/>(blocking)"]
# ```
#
# One more rule comes from chapter 05's overlapped parameter all-gather. Its forward
# pre-hooks stay **off for the first iteration** and come on after the first step that
# succeeds (`training.py:3371-3380`, `:3561-3574`): the parameters a run starts from are
# complete on every rank already, and a rank whose checkpoint load or initialization went
# wrong must not spread its shard to the others in a first all-gather. After a skipped step
# (an fp16 overflow) they stay off, since that step wrote no parameter.
#
# `train` takes the parts, the `[training]` section and the run's counters as arguments;
# what other chapters plug in travels in one `LoopHooks`, whose every field defaults to
# "nothing plugged in". The fields are told where they are used: chapter 03's after the
# loop, chapter 08's after that.

# %%
@dataclass
class LoopHooks:
    """What the other chapters plug into train(); each default means nothing is plugged in."""

    save_checkpoint_fn: object = None
    """Chapter 03: save(state, model, optimizer, scheduler)."""
    finalize_async_save_fn: object = None
    """Chapter 03: finish background saves, f(blocking=...)."""
    before_optimizer_step_fn: object = None
    """Chapter 03: a staged save's copies must end before the step writes the params."""
    rerun_state_machine: object = None
    """Chapter 08: may run a forward-backward again and stop the run."""
    step_hooks: object = None
    """Chapter 08: on_step_start(state) / on_step_end(state) around every train_step."""
    iterations_to_skip: tuple = ()
    """Chapter 08: 1-based iterations whose data was found bad: read, not trained on."""
    exit_signal: object = None
    """Chapter 08 or ExitSignal: received(grid) is True once SIGTERM arrived on any rank."""
    log_fn: object = None
    """Receives each log record (default: print the line on the last rank)."""
    flops_fn: object = None
    """Model FLOPs of a batch of that many samples (for TFLOP/s and MFU)."""
    peak_flops: float | None = None
    """Per-device peak FLOP/s; None logs no MFU."""
    clock: object = time.time
    """The wall clock of exit_duration_in_mins."""
    start_time: float | None = None
    """When the program started by that clock (pretrain: MIN over ranks); None: now."""


# %% [markdown]
# Two helpers keep the loop body short: step 2 (a new $m$ may only be larger, and is saved at)
# and step 4 (the counters of one more iteration, skipped or not).

# %%
def _advance_microbatches(calculator, state: TrainState, previous: int, save) -> int:
    """Update m for the consumed samples; it may only grow; save when it changes."""
    calculator.update(state.consumed_train_samples, consistency_check=False)
    m = calculator.get()
    if previous and m != previous and state.iteration > 0:
        if m < previous:
            raise ValueError(f"the number of micro-batches may not decrease: {previous} -> {m} "
                             f"at {state.consumed_train_samples} consumed samples")
        save()
    calculator.update(state.consumed_train_samples, consistency_check=True)
    return m


def _account(state: TrainState, calculator, batch: int, flops_fn) -> tuple[int, int]:
    """One more iteration: its samples consumed (skipped or not), skipped samples, FLOPs."""
    flops = flops_fn(batch) if flops_fn is not None else 0
    state.iteration += 1
    state.consumed_train_samples += batch
    state.skipped_train_samples += calculator.skipped_samples_per_iteration
    state.num_floating_point_operations_so_far += flops
    return batch, flops


# %%
def _maybe_evaluate(forward_step_func, valid_data_iterator, model, forward_backward_func,
                    state: TrainState, training, *, eval_shape, seq_length: int,
                    grid: ParallelGrid, config: ScheduleConfig, log_fn, time_is_up) -> None:
    """Evaluate every eval_interval iterations on the evaluation batch; log the losses."""
    if eval_shape is None or state.iteration % training.eval_interval:
        return
    m, samples = eval_shape
    mbs = getattr(training, "eval_micro_batch_size", None) or training.micro_batch_size
    losses = evaluate(forward_step_func, valid_data_iterator, model, forward_backward_func,
                      num_microbatches=m, micro_batch_size=mbs, seq_length=seq_length,
                      eval_iters=training.eval_iters, grid=grid, config=config, state=state,
                      eval_batch_size=samples, time_is_up=time_is_up)
    if losses:
        log_fn({"iteration": state.iteration, "validation": losses})

# %% [markdown]
# Before its first iteration `train` fixes what stays the same for the whole run: the start of
# the clock that `exit_duration_in_mins` counts from, and the collective "stop now" that an
# evaluation asks between its batches (the time limit, or a signal on any rank).

# %%
def _exit_clock(training, h: LoopHooks, grid: ParallelGrid):
    """(start time, the collective 'stop now' an evaluation checks between batches, or None)."""
    start_time = h.clock() if h.start_time is None else h.start_time
    time_is_up = (partial(_duration_exceeded, training.exit_duration_in_mins, start_time,
                          h.clock, grid) if training.exit_duration_in_mins else None)
    if h.exit_signal is not None:  # a signal abandons an evaluation too (every rank agrees)
        time_is_up = partial(_signal_or_time_up, h.exit_signal, grid, time_is_up)
    return start_time, time_is_up


class _Prepared(NamedTuple):
    """What train binds once, before its first iteration."""

    log_state: LogState
    save: object
    finalize: object
    log_fn: object
    evaluate: object
    start_time: float
    pre_hooks_off: object
    step: object

# %% [markdown]
# `_prepare` binds them: a save and an evaluation that stop the log's interval clock (so that
# ms/iteration and tokens/s time training only), the evaluation batch, the chunks in train
# mode with the pre-hooks off, and `train_step` with everything but $m$.

# %%
def _prepare(forward_step_func, model, optimizer, scheduler, train_data_iterator,
             valid_data_iterator, *, training, state, seq_length, grid, forward_backward_func,
             config, do_valid, h: LoopHooks) -> _Prepared:
    """The run's save, evaluation and step, bound in the order Megatron sets them up."""
    log_state = LogState()
    save = log_state.paused(partial(save_with_param_sync, h.save_checkpoint_fn, state, model,
                                    optimizer, scheduler))
    finalize, log_fn = h.finalize_async_save_fn or no_op, h.log_fn or print_on_last_rank
    do_valid = valid_data_iterator is not None if do_valid is None else do_valid
    start_time, time_is_up = _exit_clock(training, h, grid)
    evaluates = do_valid and training.eval_interval and training.eval_iters > 0
    eval_shape = eval_batch(training, grid.size("dp")) if evaluates else None  # checked now
    evaluate_when_due = log_state.paused(partial(
        _maybe_evaluate, forward_step_func, valid_data_iterator, model, forward_backward_func,
        state, training, eval_shape=eval_shape, seq_length=seq_length, grid=grid,
        config=config, log_fn=log_fn, time_is_up=time_is_up))
    for chunk in model:
        chunk.train()
    pre_hooks_off = _first_iteration_without_pre_hooks(model, config)
    step = partial(train_step, forward_step_func, train_data_iterator, model, optimizer,
                   scheduler, forward_backward_func, micro_batch_size=training.micro_batch_size,
                   seq_length=seq_length, grid=grid, config=config,
                   rerun_state_machine=h.rerun_state_machine,
                   before_optimizer_step=h.before_optimizer_step_fn,
                   log_num_zeros_in_grad=_logs_num_zeros(training, optimizer))
    return _Prepared(log_state, save, finalize, log_fn, evaluate_when_due, start_time,
                     pre_hooks_off, step)

# %% [markdown]
# The loop itself. Each line of the body is one of the steps listed above; the two lines
# marked "chapter 08" and the `save` and `finalize` calls are told in the next two sections.

# %%
def train(forward_step_func, model: list, optimizer, scheduler, train_data_iterator,
          valid_data_iterator=None, *, training, train_iters: int, state: TrainState,
          calculator, seq_length: int, grid: ParallelGrid, forward_backward_func,
          config: ScheduleConfig, do_valid: bool | None = None,
          hooks: LoopHooks | None = None) -> str | None:
    """Run iterations until train_iters or an exit condition; return the exit reason or None."""
    h = hooks or LoopHooks()
    run = _prepare(forward_step_func, model, optimizer, scheduler, train_data_iterator,
                   valid_data_iterator, training=training, state=state, seq_length=seq_length,
                   grid=grid, forward_backward_func=forward_backward_func, config=config,
                   do_valid=do_valid, h=h)
    m, reason, pre_hooks_off = 0, None, run.pre_hooks_off
    while state.iteration < train_iters:
        run.finalize(blocking=False)
        m = _advance_microbatches(calculator, state, m, run.save)
        batch = m * training.micro_batch_size * grid.size("dp")
        if _skip_iteration(state, h.iterations_to_skip, train_data_iterator, m, batch):
            continue  # chapter 08: its data was found bad
        result = hooked(h.step_hooks, state, partial(run.step, num_microbatches=m))
        if _rerun_stops(result, run.save):  # chapter 08
            reason = "rerun"
            break
        if pre_hooks_off and not result.skipped_iter:  # the first successful step
            pre_hooks_off = _restore_pre_hooks(model, config, pre_hooks_off)
        batch, flops = _account(state, calculator, batch, h.flops_fn)
        log_step(result, run.log_state, state, optimizer, training=training,
                 train_iters=train_iters, batch_size=batch, seq_length=seq_length, flops=flops,
                 peak_flops=h.peak_flops, log_fn=run.log_fn)
        run.evaluate()
        reason = checkpoint_and_decide_exit(state, training, run.save, start_time=run.start_time,
                                            clock=h.clock, grid=grid, exit_signal=h.exit_signal)
        if reason is not None:
            break
    run.finalize(blocking=True)
    return reason

# %% [markdown]
# Two details of the body. The batch, $m \cdot b \cdot d$, is fixed before the step: $m$
# changes only between iterations, when the calculator sees the consumed samples, so the
# samples counted after the step are the ones the step read. And the evaluation batch is
# computed (and checked) once, before the first iteration, so that a batch that does not
# divide over the DP ranks stops the run at its start, not after `eval_interval` iterations.
#
# The pre-hooks are taken off with `param_sync=False` (the parameters are complete already,
# so no all-gather is needed), and the schedule's `param_sync_func`, when it has one, is
# held back with them so that the schedule dispatches no all-gather either.

# %%
def _first_iteration_without_pre_hooks(model: list, config: ScheduleConfig):
    """Take the overlapped-gather pre-hooks off; return what to restore (False if none)."""
    if not _set_pre_hooks(model, False, param_sync=False):
        return False
    held = {"param_sync_func": config.param_sync_func}
    if held["param_sync_func"] is not None:
        config.param_sync_func = None
    return held


def _restore_pre_hooks(model: list, config: ScheduleConfig, held) -> bool:
    """Put the pre-hooks (and the schedule's param_sync_func) back; returns False."""
    _set_pre_hooks(model, True)
    if held["param_sync_func"] is not None:
        config.param_sync_func = held["param_sync_func"]
    return False

# %% [markdown]
# ## What chapter 03 adds here
#
# Checkpoints enter the loop at four places, all through `LoopHooks`:
#
# - `save_checkpoint_fn` is called by `checkpoint_and_decide_exit` and at a change of $m$,
#   always through `save_with_param_sync` (below);
# - `finalize_async_save_fn(blocking=False)` at the top of each iteration completes a
#   background save whose write has finished, and `blocking=True` after the loop drains
#   the rest ([saving in the background](../03_checkpoint/async_save.py));
# - `before_optimizer_step_fn`, which `train_step` calls just before `optimizer.step()`: the
#   step is the first write to the parameters since the last save, so a save whose copy to
#   host is still running must finish it there ([the staged copy](../03_checkpoint/staged_copy.py);
#   Megatron needs no such hook, see the Megatron detail under `train_step` on [01.1](loop.py));
# - `load_checkpoint_fn`, called once by `pretrain` before the data iterators are built.
#
# Every save goes through `save_with_param_sync`: with the distributed optimizer's
# `overlap_param_gather`, the step has updated only each rank's own shard of the parameters,
# and the all-gather of the rest waits for the next forward's pre-hooks (chapter 05). Megatron
# finishes that all-gather before saving (`force_param_sync`, `training.py:2764, 2788-2789`),
# so the saved weights are the updated ones — and nothing is left for the next forward to
# write while a staged save still copies the parameters (chapter 03).

# %%
def save_with_param_sync(save_checkpoint_fn, state, model: list, optimizer, scheduler) -> None:
    """Finish an overlapped param all-gather (Megatron's force_param_sync), then save."""
    if save_checkpoint_fn is None:
        return
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
    save_checkpoint_fn(state, model, optimizer, scheduler)

# %% [markdown]
# ## What chapter 08 adds here
#
# Chapter 08's reliability parts plug in at three places:
#
# - **`step_hooks`** bracket every `train_step` with `on_step_start(state)` and
#   `on_step_end(state)` (heartbeats, fault injection); `hooked`, in the chapter's private
#   module `chapters/01_main_loop/_parts.py`, calls them.
# - **The rerun state machine** may run one iteration's forward-backward again on the same
#   data and RNG state to tell a transient fault from a real one (`train_step`'s `while`);
#   when it decides to stop, `train_step` returns without a step, and the loop saves if
#   asked and stops (`training.py:3545-3555`).
# - **`iterations_to_skip`**: an iteration whose data was found bad is not run. Its
#   micro-batches are read and dropped so that the next iteration reads the samples it would
#   have read (`dummy_train_step`, `training.py:2115`), and the whole batch counts as
#   consumed *and* skipped — the batch, and nothing on top of it: the shortfall of
#   `decrease_batch_size_if_needed` belongs to the batches that ran (`training.py:3474-3485`).
#   No FLOPs are counted for it, and it does not count as the first step for the pre-hooks.

# %%
def _dummy_train_step(data_iterator, num_microbatches: int) -> None:
    """Consume a skipped iteration's micro-batches without computing them."""
    for it in data_iterator if isinstance(data_iterator, list) else [data_iterator]:
        for _ in range(num_microbatches if it is not None else 0):
            next(it)


def _skip_iteration(state: TrainState, iterations_to_skip, data_iterator, m: int,
                    batch: int) -> bool:
    """If the next iteration is to be skipped: read its data, count it, return True."""
    if state.iteration + 1 not in iterations_to_skip:
        return False
    _dummy_train_step(data_iterator, m)
    state.iteration += 1
    state.consumed_train_samples += batch
    state.skipped_train_samples += batch
    return True


def _rerun_stops(result: StepResult, save) -> bool:
    """The rerun machine asked to stop: save first if it asked for that too."""
    if result.should_exit and result.should_checkpoint:
        save()
    return result.should_exit

# %% [markdown]
# ## `pretrain`: everything set up once
#
# `megatron/training/training.py:1029`, in order:
#
# 1. **Grid and seeds**: the process groups (appendix A's `ParallelGrid`) and Megatron's seeds
#    (`set_random_seed`: offset by the pipeline rank, the TP-parallel RNG stream).
# 2. **Model chunks**: one per virtual stage (appendix B's `build_stage_models`).
# 3. **DDP**: each chunk wrapped over its contiguous grad buffer (chapter 05); only the first
#    chunk is bucketed (`training.py:1783-1787`).
# 4. **Optimizer and scheduler** (chapter 02), the scheduler's lengths in samples.
# 5. **Load a checkpoint** through `load_checkpoint_fn(model, optimizer, scheduler)` (chapter 03):
#    it restores the parts in place and returns the `TrainState`, or `None` for a fresh start.
# 6. **Data iterators**, built *after* the load so they start at `consumed_train_samples`
#    (chapter 04).
# 7. **`train()`**, then a **final save** unless the last iteration was just saved, then a
#    blocking drain of asynchronous saves.
#
# The schedule's callbacks are set by `build_schedule_config`, with Megatron's conditions
# (`training.py:3227-3245`): `grad_scale_func` is the optimizer's `scale_loss` and
# `finalize_model_grads_func` chapter 05's `finalize_model_grads`, always; `no_sync_func`, each
# DDP chunk's `no_sync`, only with `overlap_grad_reduce` — without it no backward hook
# launches a collective, so there is nothing to hold back; `grad_sync_func`, each chunk's
# `start_grad_sync`, when `align_grad_reduce` (on by default) is on as well: then only the
# first pipeline stage launches its grad collectives from the hooks of its last backward,
# the others all at once after their cooldown, where the pipeline drains anyway
# (`schedules.py:2380-2430`); `param_sync_func`, each chunk's `start_param_sync`, with
# `overlap_param_gather` and `align_param_gather`. `calculate_per_token_loss` follows the
# DDP config, so the schedule and the buffers agree on who divides by what.
#
# Only the interleaved schedule calls `param_sync_func`, as in Megatron. There, with the
# distributed optimizer's overlapped, aligned gather, every chunk's all-gather is launched by
# the schedule, chunk $c + 1$ as chunk $c$ starts ([interleaved](interleaved.py)), and the
# forward pre-hooks only wait. `megatron_optimizer_provider` builds one optimizer over all the
# chunks, as Megatron's `get_megatron_optimizer` takes the whole model list
# (`training.py:1979`): the DistributedOptimizer shards the buffers of every chunk's DDP
# wrapper. With one chunk `param_sync_func` is the bare callable, handed to 1F1B or no
# pipelining, which never call it; and without virtual stages `tinytron.config` turns
# `align_param_gather` off, as Megatron does (`arguments.py:990-992`), so that the pre-hooks
# prefetch the next bucket themselves.
#
# The builders — `wrap_with_ddp` (only the first chunk bucketed,
# `training.py:1783-1787`), `megatron_optimizer_provider`, `megatron_scheduler_provider` — are
# passed in, so the loop imports none of chapters 02 and 05 itself.
#
# With `skip_train` (Megatron's `--skip-train`, `megatron/training/training.py:1376`) `pretrain`
# sets everything up and loads the checkpoint, then runs no iteration and saves nothing
# (`:1401`): the caller evaluates what was loaded, as Megatron's `do_valid` and `do_test` blocks
# do right after (`:1421-1466`). The schedule built for it is one iteration long; it is never
# stepped.

# %%
class TrainingRun(NamedTuple):
    """What pretrain built and ran (for the caller to inspect or keep using)."""

    grid: ParallelGrid
    model: list
    optimizer: object
    scheduler: object
    state: TrainState
    exit_reason: str | None


def _setup(training, grid_provider, model_provider, ddp_config, optimizer_provider,
           scheduler_provider, load_checkpoint_fn, seq_length=None):
    """Steps 1-5 of pretrain: grid, seeds, chunks, DDP, optimizer, scheduler, load."""
    grid = grid_provider()
    set_random_seed(training.seed, grid)
    model = model_provider(grid)
    model = list(model) if isinstance(model, (list, tuple)) else [model]
    if ddp_config is not None:
        model = wrap_with_ddp(model, grid, ddp_config)
    calc = build_num_microbatches_calculator(
        training.global_batch_size, training.micro_batch_size, grid.size("dp"),
        training.decrease_batch_size_if_needed, training.step_batch_size_schedule, seq_length)
    iters = (training.train_iters if training.train_iters is not None
             else train_iters_from_samples(calc, training.train_samples))
    optimizer = optimizer_provider(model, grid)
    # --skip-train steps nothing: a one-iteration schedule only holds what the load restores
    sched_iters = max(iters, 1) if getattr(training, "skip_train", False) else iters
    scheduler = (scheduler_provider(optimizer, train_iters=sched_iters,  # lengths in samples
                                    global_batch_size=calc.current_global_batch_size,
                                    samples_of=partial(samples_in_iterations, calc),
                                    train_samples=training.train_samples)
                 if scheduler_provider is not None else None)
    loaded = load_checkpoint_fn(model, optimizer, scheduler) if load_checkpoint_fn else None
    state = loaded if loaded is not None else TrainState()
    calc.update(state.consumed_train_samples, consistency_check=True)
    return grid, model, optimizer, scheduler, calc, iters, state


# %% [markdown]
# Two more helpers: the schedule with its config (and chapter 08's wrapper around it, when
# given), and step 7's final save, skipped after an exit or a save of the same iteration.

# %%
def _forward_backward(model, optimizer, grid, ddp_config, vpp_size, schedule_overrides,
                      wrap_forward_backward_func):
    """The schedule's config (build_schedule_config) and the schedule itself, maybe wrapped."""
    per_token = bool(getattr(ddp_config, "calculate_per_token_loss", False))
    config = build_schedule_config(model, optimizer, grid, calculate_per_token_loss=per_token,
                                   **(schedule_overrides or {}))
    fb = get_forward_backward_func(grid.size("pp"), vpp_size)
    if wrap_forward_backward_func is not None:  # chapter 08: timers, checks, a CUDA graph
        fb = wrap_forward_backward_func(fb)
    return config, fb


def _final_save(training, state: TrainState, reason, save_checkpoint_fn, model, optimizer,
                scheduler, finalize_async_save_fn) -> None:
    """Save unless an exit or save_interval just saved (or --skip-train); drain async saves."""
    just_saved = bool(training.save_interval) and state.iteration % training.save_interval == 0
    skip_train = getattr(training, "skip_train", False)
    if (save_checkpoint_fn is not None and reason is None and state.iteration and not just_saved
            and not skip_train):
        save_with_param_sync(save_checkpoint_fn, state, model, optimizer, scheduler)
    if finalize_async_save_fn is not None:
        finalize_async_save_fn(blocking=True)

# %% [markdown]
# `pretrain` itself: the clock's start, steps 1-5, the data, the schedule, then `train` inside
# the signal handler (when the run asks for one), and the final save. Only ranks that read data
# hold a validation iterator (TP rank 0 of the first and last stage), but every rank must run
# the evaluation's collectives, so the ranks agree on it first, as Megatron broadcasts its
# `do_valid` flag (`training.py:4248`).

# %%
def pretrain(training, *, model_provider, forward_step_func, data_iterators_provider,
             optimizer_provider, scheduler_provider=None, grid_provider=ParallelGrid.single,
             ddp_config=None, seq_length: int, vpp_size: int | None = None,
             schedule_overrides: dict | None = None, load_checkpoint_fn=None,
             save_checkpoint_fn=None, finalize_async_save_fn=None,
             before_optimizer_step_fn=None, flops_fn=None, peak_flops=None, log_fn=None,
             exit_signal=None, clock=time.time,
             rerun_state_machine=None, step_hooks=None,
             wrap_forward_backward_func=None, iterations_to_skip=(),
             start_time: float | None = None) -> TrainingRun:
    """Grid+seeds -> chunks -> DDP -> optimizer+scheduler -> load -> data -> train -> save."""
    if start_time is None:  # the program's start; with another clock, pretrain's entry
        start_time = _TRAIN_START_TIME if clock is time.time else clock()
    grid, model, optimizer, scheduler, calc, iters, state = _setup(
        training, grid_provider, model_provider, ddp_config, optimizer_provider,
        scheduler_provider, load_checkpoint_fn, seq_length)
    train_it, valid_it = data_iterators_provider(grid, state)
    do_valid = any_rank(valid_it is not None, grid)  # every rank runs the evaluation
    config, fb = _forward_backward(model, optimizer, grid, ddp_config, vpp_size,
                                   schedule_overrides, wrap_forward_backward_func)
    start_time = _earliest_over_ranks(start_time, grid)
    use_handler = exit_signal is None and getattr(training, "exit_signal_handler", False)
    reason = None
    with (ExitSignal() if use_handler else contextlib.nullcontext(exit_signal)) as sig:
        if state.iteration < iters and not getattr(training, "skip_train", False):  # :1376
            hooks = LoopHooks(
                save_checkpoint_fn=save_checkpoint_fn,
                finalize_async_save_fn=finalize_async_save_fn,
                before_optimizer_step_fn=before_optimizer_step_fn,
                rerun_state_machine=rerun_state_machine, step_hooks=step_hooks,
                iterations_to_skip=tuple(iterations_to_skip), exit_signal=sig, log_fn=log_fn,
                flops_fn=flops_fn, peak_flops=peak_flops, clock=clock, start_time=start_time)
            reason = train(forward_step_func, model, optimizer, scheduler, train_it, valid_it,
                           do_valid=do_valid, training=training, train_iters=iters, state=state,
                           calculator=calc, seq_length=seq_length, grid=grid,
                           forward_backward_func=fb, config=config, hooks=hooks)
    _final_save(training, state, reason, save_checkpoint_fn, model, optimizer, scheduler,
                finalize_async_save_fn)
    return TrainingRun(grid, model, optimizer, scheduler, state, reason)

# %% [markdown]
# ## Demo: the tiny GPT through `pretrain`, twice — plain PyTorch parts and the book's parts
#
# The same loop runs the tiny model on a synthetic token stream (chapter 04's sampler over an
# in-memory dataset), first with a plain `torch.optim.AdamW` and no DDP, then with chapter
# 05's DDP, chapter 02's optimizer and its sample-based cosine scheduler. Both start from the
# same weights and read the same batches, so their first losses agree; after that the book's
# run follows its decaying learning rate. Both go down. The run with the book's parts also
# saves a checkpoint every 4 iterations through the hook, evaluates every 4, and logs every 2.

# %%
if __name__ == "__main__":
    from types import SimpleNamespace

    import torch

    from tinytron.buffers import DistributedDataParallelConfig
    from tinytron.main_loop._loop_workers import synthetic_iterators
    from tinytron.model import build_stage_models, tiny_config
    from tinytron.optimizer import OptimizerConfig, SchedulerConfig

    cfg = tiny_config(seq_length=32)
    training = SimpleNamespace(  # the [training] section's names (tinytron.config.TrainingConfig)
        micro_batch_size=2, global_batch_size=8, step_batch_size_schedule=None,
        decrease_batch_size_if_needed=False, train_iters=8, train_samples=None,
        eval_interval=4, eval_iters=1, save_interval=4, exit_interval=None,
        exit_duration_in_mins=None, exit_signal_handler=False, log_interval=2, seed=1234)
    common = dict(model_provider=lambda grid: build_stage_models(cfg, grid),
                  forward_step_func=partial(gpt_forward_step, micro_batch_size=2, seq_length=32),
                  data_iterators_provider=partial(synthetic_iterators, cfg, micro_batch_size=2),
                  seq_length=32)

# %% [markdown]
# The two runs: plain AdamW without DDP, then the book's DDP, optimizer and cosine scheduler,
# with a save hook that only records the iteration it was called at.

# %%
if __name__ == "__main__":
    plain_logs, book_logs, saves = [], [], []
    plain = pretrain(training, optimizer_provider=lambda model, grid: TorchOptimizer(
        torch.optim.AdamW(model[0].parameters(), lr=3e-3, weight_decay=0.0, foreach=True)),
        log_fn=plain_logs.append, **common)
    opt_config = OptimizerConfig(lr=3e-3, weight_decay=0.0, clip_grad=1.0)
    book = pretrain(training, ddp_config=DistributedDataParallelConfig(),
                    optimizer_provider=megatron_optimizer_provider(opt_config),
                    scheduler_provider=megatron_scheduler_provider(
                        SchedulerConfig(lr_decay_style="cosine"), opt_config),
                    save_checkpoint_fn=lambda s, *parts: saves.append(s.iteration),
                    log_fn=book_logs.append, **common)

# %% [markdown]
# Their logs side by side, and the checks: eight iterations of 8 samples, saves at 4 and 8,
# a falling loss, and the same first loss in both runs.

# %%
if __name__ == "__main__":
    plain_by_iter = {p["iteration"]: p for p in plain_logs if "losses" in p}
    for b in book_logs:
        if "validation" in b:
            print(f"iter {b['iteration']:3d}  validation lm loss {b['validation']['lm loss']:.4f}")
        else:
            p = plain_by_iter[b["iteration"]]
            print(f"iter {b['iteration']:3d}  lm loss plain {p['losses']['lm loss']:.4f}  "
                  f"book {b['losses']['lm loss']:.4f}  lr {b['learning_rate']:.2e}  "
                  f"consumed {b['consumed_train_samples']}")
    train_losses = [b["losses"]["lm loss"] for b in book_logs if "losses" in b]
    assert book.state.iteration == 8 and book.state.consumed_train_samples == 8 * 8
    assert saves == [4, 8] and book.exit_reason is None
    assert train_losses[-1] < train_losses[0]
    assert abs(plain_logs[0]["losses"]["lm loss"] - book_logs[0]["losses"]["lm loss"]) < 1e-5

# %% [markdown]
# The first logged losses of the two runs agree (same weights, same batches; from there the
# two Adams diverge by rounding and the book's run follows a cosine learning rate). Iteration 8
# was saved by `save_interval`, so `pretrain` did not save it twice.
#
# ## Summary
#
# - `pretrain` builds in Megatron's order and loads before it builds the data iterators, so a
#   resumed run reads the next unseen sample.
# - `train` repeats `train_step`; consumed samples advance on every iteration, skipped or not,
#   the learning rate only on successful ones.
# - Exits happen between iterations, after a save: signal, duration, exit interval; the run
#   ends at `train_iters`. A signal or the time limit abandons an evaluation in flight.
# - Chapters 03 and 08 plug in through `LoopHooks`; every save goes through
#   `save_with_param_sync`.
#
# ## How production does it
#
# - Megatron: `megatron/training/training.py` — `pretrain:1029`, `setup_model_and_optimizer:1938`,
#   `checkpoint_and_decide_exit:2953`, `train:3065` (loop body `:3401-3792`).
# - torchtitan: `torchtitan/trainer.py` (`Trainer.train`) runs the same skeleton with a fixed
#   number of gradient-accumulation steps and checkpoints through `torch.distributed.checkpoint`.
#
# ## Exercises
#
# 1. A run with `exit_interval = 100` and `save_interval = 250` is stopped at iteration 100.
#    Which checkpoints exist, and at which iteration does the resumed run save next?
#
#    <details><summary>Answer</summary>
#
#    One, at iteration 100: `checkpoint_and_decide_exit`
#    finds $100 \bmod 250 \ne 0$ (no interval save), then $100 \bmod 100 = 0$, so it saves and
#    returns `"exit_interval"`; `pretrain` adds no final save after an exit. The resumed run
#    saves next at 200, where `exit_interval` fires again (save, exit); the first save by
#    `save_interval` comes at 250, in the run after that.
#
#    </details>
#
# 2. A step schedule raises $m$ from 4 to 8 at 1,000 consumed samples. Which iteration saves
#    a checkpoint although no interval asks for one, and why?
#
#    <details><summary>Hint</summary>
#
#    Look at `_advance_microbatches`: it runs at the top of the iteration that first sees the
#    new $m$, before its `train_step`, and calls `save` when $m$ changed, as Megatron's loop
#    does at the same place.
#
#    </details>
