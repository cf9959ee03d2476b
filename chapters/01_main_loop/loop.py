# %% [markdown]
# # 01 · The main loop: `pretrain` → `train` → `train_step`
#
# Every other chapter builds a part; this page is the loop that calls them, in Megatron's
# order. `pretrain` sets everything up once, `train` repeats iterations until one of its exit
# conditions holds, and `train_step` is one iteration: zero the gradient buffers, run the
# schedule, step the optimizer, agree on success, advance the learning rate by the samples
# just consumed. The loop takes every part as an argument, so the same code runs the plain
# PyTorch demo below and the full trainer.

# %%
from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from tinytron.main_loop._parts import (TorchOptimizer, build_schedule_config, hooked, log_step,
                                       megatron_optimizer_provider, megatron_scheduler_provider,
                                       no_op, print_on_last_rank, wrap_with_ddp)
from tinytron.main_loop.microbatches import (build_num_microbatches_calculator,
                                             train_iters_from_samples)
from tinytron.main_loop.schedules import ScheduleConfig, get_forward_backward_func
from tinytron.main_loop.training_log import LogState
from tinytron.overview.loss import lm_loss_func
from tinytron.parallel import ParallelGrid, set_random_seed

__all__ = ["TrainState", "StepResult", "ExitSignal", "TorchOptimizer", "gpt_forward_step",
           "zero_grad_buffers", "logical_and_across_model_parallel_group",
           "reduce_max_stat_across_model_parallel_group", "reduce_losses", "train_step",
           "evaluate", "save_with_param_sync", "checkpoint_and_decide_exit", "train",
           "wrap_with_ddp", "build_schedule_config", "megatron_optimizer_provider",
           "megatron_scheduler_provider", "TrainingRun", "pretrain"]

# %% [markdown]
# ## The state that survives a restart
#
# Four counters and one running sum are all the loop itself must carry across a checkpoint
# (Megatron keeps them in `args` and writes them into every checkpoint,
# `megatron/training/checkpointing.py`): the iteration, the samples consumed (the sampler
# resumes there and the scheduler's position derives from it), the samples skipped by
# `decrease_batch_size_if_needed`, the validation samples consumed, and the FLOPs done so far
# (so that a resumed run's TFLOP/s and MFU stay honest). Chapter 03 saves `state_dict()` and
# hands a `TrainState` back through `load_checkpoint_fn`.

# %%
@dataclass
class TrainState:
    """The loop's progress counters (what a checkpoint must restore besides model/optimizer)."""

    iteration: int = 0
    """Optimizer iterations done (skipped ones included)."""
    consumed_train_samples: int = 0
    """Training samples consumed, skipped steps included (the sampler resumes here)."""
    skipped_train_samples: int = 0
    """Samples of nominal global batches that were not run (decrease_batch_size_if_needed)."""
    consumed_valid_samples: int = 0
    """Validation samples consumed (the validation sampler resumes here)."""
    num_floating_point_operations_so_far: int = 0
    """Model FLOPs of every iteration so far."""

    def state_dict(self) -> dict:
        """The five counters as a plain dict."""
        return dataclasses.asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Restore the counters; a missing or unknown key is a ValueError naming it."""
        names = {f.name for f in dataclasses.fields(self)}
        if set(sd) != names:
            raise ValueError(f"TrainState keys differ: missing {sorted(names - set(sd))}, "
                             f"unknown {sorted(set(sd) - names)}")
        for k, v in sd.items():
            setattr(self, k, int(v))

# %% [markdown]
# ## What one step needs from its parts
#
# The loop speaks to its parts through Megatron's contracts, nothing more:
#
# | part | called as | returns |
# |---|---|---|
# | model chunk | `zero_grad_buffer()` (chapter 05's DDP), else `zero_grad()` | |
# | optimizer | `zero_grad()`, `step()`, `scale_loss(loss)`, `param_groups` | `step()` → `(success, grad_norm, num_zeros)` |
# | scheduler | `step(increment=samples)` | |
# | schedule | `forward_backward_func(forward_step_func=…, …)` (previous pages) | one loss report per micro-batch on the last stage |
# | `forward_step_func` | `(data_iterator, model_chunk)` | `(output, loss_func)`, chapter 00's contract |
#
# Chapter 02's optimizers already return the triple. A plain `torch.optim` optimizer does not
# clip and returns nothing, so `TorchOptimizer` adapts it: clip by the global norm with
# `torch.nn.utils.clip_grad_norm_`, step, report `(True, norm, None)`. It and the builders of
# the book's parts that `pretrain` is handed below live in `tinytron/main_loop/_parts.py`
# (glue, not mechanism; the loop page imports them).
#
# `gpt_forward_step` is Megatron's `forward_step` of `pretrain_gpt.py:197` over the book's
# model: `get_batch` (chapter 04: read on TP rank 0, broadcast, CP slice, only the keys this
# stage needs), the model with labels (the last stage returns per-token losses), and chapter
# 00's `lm_loss_func` bound to the batch's loss mask.

# %%
def gpt_forward_step(data_iterator, model, *, micro_batch_size: int, seq_length: int):
    """Megatron's pretrain_gpt forward_step: get_batch, the model with labels, the loss func."""
    from tinytron.data.distribute import get_batch  # chapter 04; imported on use only

    grid = getattr(model, "grid", None) or ParallelGrid.single()  # GPTModel and DDP carry it
    batch = get_batch(data_iterator, grid, micro_batch_size=micro_batch_size,
                      seq_length=seq_length, create_attention_mask=False,
                      vocab_size=getattr(model, "module", model).config.vocab_size)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    return output, partial(lm_loss_func, batch["loss_mask"])

# %% [markdown]
# ## `train_step`, in Megatron's exact order
#
# `megatron/training/training.py:2162`:
#
# 1. `zero_grad_buffer()` on every model chunk, then `optimizer.zero_grad()`. The buffer is
#    *zeroed*, not freed: gradients are resident memory.
# 2. `forward_backward_func(...)` runs the $m$ micro-batches. The schedule itself calls
#    `finalize_model_grads` after the last backward (chapter 05: finish the DP collectives,
#    TP- and embedding-group reductions, per-token scaling), so the grads are final here.
# 3. `optimizer.step()`: unscale, check for inf/NaN, clip, update, write back
#    (chapter 02) → `(update_successful, grad_norm, num_zeros)`. Just before it the loop calls
#    the checkpoint's `before_optimizer_step` hook: it is the first write to the parameters
#    since the last save, so a save whose copy to host is still running in the background
#    must finish it here (chapter 03, [saving in the background](../03_checkpoint/async_save.py)).
#    Megatron has no such hook: its async save copies to host before the save returns.
# 4. `update_successful` is **ANDed** and `grad_norm`, `num_zeros` are **MAXed** over the
#    model-parallel group (`training.py:2297-2303`): a pipeline stage without trainable
#    parameters reports `None`, and every rank must take the same branch next.
# 5. If successful, the scheduler advances by the samples of this step,
#    $m \cdot b \cdot d$ (`training.py:2309`); otherwise the iteration is **skipped**: the
#    learning rate stays where it was. The samples still count as consumed — the loop adds them
#    either way — because they were read and must not be read again.
# 6. The last stage reduces the loss reports: each `{"lm loss": [sum, count]}` is summed over
#    micro-batches and all-reduced over DP×CP, and the mean is `sum / count`
#    (`training.py:2319-2345`): the exact token mean over the whole global batch.
#
# In the running example one `train_step` on a DP rank runs 8 micro-batches of 2 × 4096
# tokens; the scheduler then advances by $8 \cdot 2 \cdot 64 = 1024$ samples.

# %%
class StepResult(NamedTuple):
    """What train_step reports (Megatron's tuple; the last three come from the rerun machine)."""

    loss_dict: dict
    skipped_iter: int
    grad_norm: float | None
    num_zeros_in_grad: int | None
    should_checkpoint: bool = False
    should_exit: bool = False
    exit_code: int = 0


def zero_grad_buffers(model: list) -> None:
    """zero_grad_buffer() on DDP chunks; drop .grad on plain modules."""
    for chunk in model:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        else:
            chunk.zero_grad(set_to_none=True)


def logical_and_across_model_parallel_group(value: bool, grid: ParallelGrid) -> bool:
    """True only if every rank of my model-parallel group says True."""
    if grid.size("mp") == 1:
        return bool(value)
    flag = torch.tensor([1 if value else 0], dtype=torch.int, device=grid.device)
    grid.all_reduce(flag, "mp", dist.ReduceOp.MIN)
    return bool(flag.item())


def reduce_max_stat_across_model_parallel_group(value, grid: ParallelGrid):
    """MAX over the model-parallel group; None (a rank without params) counts as missing."""
    if grid.size("mp") == 1:
        return value
    t = torch.tensor([-1.0 if value is None else float(value)], dtype=torch.float64,
                     device=grid.device)
    grid.all_reduce(t, "mp", dist.ReduceOp.MAX)
    return None if t.item() == -1.0 else t.item()


def reduce_losses(losses_reduced: list[dict], grid: ParallelGrid) -> dict:
    """{key: global token mean} from per-micro-batch [sum, count] reports (legacy: mean)."""
    out = {}
    for key in losses_reduced[0] if losses_reduced else ():
        vals = [torch.as_tensor(r[key]).detach().reshape(-1).float() for r in losses_reduced]
        if vals[0].numel() == 2:
            pair = torch.stack(vals).sum(dim=0).to(grid.device)
            grid.all_reduce(pair, "dp_cp")
            out[key] = pair[0] / pair[1]
        elif vals[0].numel() == 1:
            out[key] = torch.cat(vals).mean()
        else:
            raise ValueError(f"loss report {key!r} has {vals[0].numel()} values; expected "
                             "[sum, count] or one value")
    return out

# %%
def train_step(forward_step_func, data_iterator, model: list, optimizer, scheduler,
               forward_backward_func, *, num_microbatches: int, micro_batch_size: int,
               seq_length: int, grid: ParallelGrid, config: ScheduleConfig,
               rerun_state_machine=None, before_optimizer_step=None) -> StepResult:
    """One iteration: zero grads, forward-backward (+finalize), step, agree, advance the LR."""
    # With chapter 08's rerun state machine the pass may run again (same data, same RNG) to
    # diagnose a rejected loss or gradient; the optimizer then steps on the last pass's grads.
    rsm, first = rerun_state_machine, True
    while rsm.should_run_forward_backward(data_iterator) if rsm is not None else first:
        first = False
        zero_grad_buffers(model)
        optimizer.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, grid=grid, forward_only=False, config=config)
    if rsm is not None:
        should_checkpoint, should_exit, exit_code = rsm.should_checkpoint_and_exit()
        if should_exit:  # no optimizer step (training.py:2271)
            return StepResult({}, 0, None, None, should_checkpoint, should_exit, exit_code)
    if before_optimizer_step is not None:  # chapter 03: a staged save's copies end here
        before_optimizer_step()
    update_successful, grad_norm, num_zeros = optimizer.step()
    update_successful = logical_and_across_model_parallel_group(update_successful, grid)
    grad_norm = reduce_max_stat_across_model_parallel_group(grad_norm, grid)
    num_zeros = reduce_max_stat_across_model_parallel_group(num_zeros, grid)
    if update_successful:
        if scheduler is not None:
            scheduler.step(increment=num_microbatches * micro_batch_size * grid.size("dp"))
        skipped_iter = 0
    else:
        skipped_iter = 1
    loss_dict = reduce_losses(losses_reduced, grid) if grid.is_last_stage() else {}
    return StepResult(loss_dict, skipped_iter, grad_norm,
                      None if num_zeros is None else int(num_zeros))

# %% [markdown]
# ## Evaluation: the same schedule, forward only
#
# `evaluate` (`training.py:3826`) puts every chunk in eval mode (no dropout), runs
# `eval_iters` global batches through the *same* `forward_backward_func` with
# `forward_only=True` under `torch.no_grad()` — no backward, no finalize, no optimizer, no
# scheduler — reduces the reports exactly like `train_step`, and puts the chunks back in train
# mode. With the distributed optimizer's overlapped parameter all-gather, the forward
# pre-hooks are switched off around it (`training.py:3660-3700`) so that evaluation uses
# complete parameters.

# %%
def _set_pre_hooks(model: list, enabled: bool) -> None:
    """Disable (with a param sync) or re-enable DDP's overlapped-all-gather pre-hooks."""
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.overlap_param_gather:
            chunk.enable_forward_pre_hook() if enabled else chunk.disable_forward_pre_hook()


def evaluate(forward_step_func, data_iterator, model: list, forward_backward_func, *,
             num_microbatches: int, micro_batch_size: int, seq_length: int, eval_iters: int,
             grid: ParallelGrid, config: ScheduleConfig) -> dict:
    """Mean of each loss key over eval_iters forward-only global batches (last stage; {} else)."""
    for chunk in model:
        chunk.eval()
    _set_pre_hooks(model, False)
    reports = []
    with torch.no_grad():
        for _ in range(eval_iters):
            reports += forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, seq_length=seq_length,
                micro_batch_size=micro_batch_size, grid=grid, forward_only=True, config=config)
    _set_pre_hooks(model, True)
    for chunk in model:
        chunk.train()
    if not grid.is_last_stage():
        return {}
    return {k: float(v) for k, v in reduce_losses(reports, grid).items()}

# %% [markdown]
# ## When to stop, and when to save
#
# After each iteration `checkpoint_and_decide_exit` (`training.py:2953`) checks, in this order:
#
# 1. **a signal** (with `exit_signal_handler`): SIGTERM from the cluster scheduler, seen by any
#    rank, is shared by an all-reduce; save, exit;
# 2. **`save_interval`**: save when `iteration % save_interval == 0`;
# 3. **`exit_duration_in_mins`**: the wall time since training started, MAX-reduced over all
#    ranks so that every rank decides alike; save (unless just saved), exit;
# 4. **`exit_interval`**: exit when `iteration % exit_interval == 0`, after a save.
#
# The loop itself ends when `iteration == train_iters` (`train_samples` is converted to
# iterations first); `pretrain` then saves a final checkpoint unless the last iteration was
# just saved. A signal handler only records the signal: the iteration in flight finishes, so
# the saved state is always a consistent end-of-step state.
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

# %%
class ExitSignal:
    """Records a signal (default SIGTERM) so the loop can save and stop between iterations."""

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig, self._received, self._previous = sig, False, None

    def __enter__(self):
        self._previous = signal.signal(self.sig, self._handler)
        return self

    def __exit__(self, *exc):
        signal.signal(self.sig, self._previous)
        return False

    def _handler(self, signum, frame) -> None:
        self._received = True

    def received(self, grid: ParallelGrid) -> bool:
        """True if any rank of the world has received the signal."""
        flag = torch.tensor([int(self._received)], dtype=torch.int, device=grid.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _duration_exceeded(limit_mins, start_time: float, clock, grid: ParallelGrid) -> bool:
    """Wall time since start > limit on any rank (MAX all-reduce, as Megatron)."""
    done = torch.tensor([int((clock() - start_time) / 60.0 > limit_mins)], dtype=torch.int,
                        device=grid.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
    return bool(done.item())


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
# Per iteration (`training.py:3397-3800`), in order:
#
# 1. `finalize_async_save_fn(blocking=False)`: complete a background checkpoint whose write
#    has finished (chapter 03); collective, so every rank calls it.
# 2. Update the micro-batch calculator with the consumed samples. If $m$ changed (a step
#    schedule), it must have grown — and a checkpoint is saved at the change.
# 3. `train_step`, which calls `before_optimizer_step_fn()` (chapter 03's wait for a staged
#    save's copy to host) just before `optimizer.step()`.
# 4. `iteration += 1`; `consumed_train_samples += m·b·d` (skipped or not);
#    `skipped_train_samples +=` what `decrease_batch_size_if_needed` dropped; the FLOPs of the
#    batch are added to the running sum.
# 5. `training_log` (next page): accumulate, and hand a record to `log_fn` every `log_interval`.
# 6. Evaluate every `eval_interval` iterations.
# 7. `checkpoint_and_decide_exit`.
#
# At the end: `finalize_async_save_fn(blocking=True)` drains any save still in flight.
#
# ```mermaid
# flowchart LR
#   P["pretrain: seeds, model, optimizer,<br/>scheduler, load_checkpoint, data"] --> A["finalize_async_save_fn<br/>(non-blocking)"]
#   A --> M["update m from<br/>consumed samples"] --> S["train_step"]
#   S --> C["iteration += 1<br/>consumed += m·b·d"] --> G["training_log"]
#   G --> E["evaluate every<br/>eval_interval"] --> K["checkpoint_and_decide_exit"]
#   K -->|continue| A
#   K -->|exit| F["finalize_async_save_fn<br/>(blocking)"]
# ```

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


def _dummy_train_step(data_iterator, num_microbatches: int) -> None:
    """Consume a skipped iteration's micro-batches without computing them."""
    for it in data_iterator if isinstance(data_iterator, list) else [data_iterator]:
        for _ in range(num_microbatches if it is not None else 0):
            next(it)


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
                    state: TrainState, training, calculator, *, do_valid: bool, seq_length: int,
                    grid: ParallelGrid, config: ScheduleConfig, log_fn) -> None:
    """Evaluate every eval_interval iterations; count the validation samples."""
    if not (do_valid and training.eval_interval and training.eval_iters > 0
            and state.iteration % training.eval_interval == 0):
        return
    losses = evaluate(forward_step_func, valid_data_iterator, model, forward_backward_func,
                      num_microbatches=calculator.get(), micro_batch_size=training.micro_batch_size,
                      seq_length=seq_length, eval_iters=training.eval_iters, grid=grid,
                      config=config)
    state.consumed_valid_samples += training.eval_iters * calculator.current_running_global_batch_size
    if losses:
        log_fn({"iteration": state.iteration, "validation": losses})

# %%
def train(forward_step_func, model: list, optimizer, scheduler, train_data_iterator,
          valid_data_iterator=None, *, training, train_iters: int, state: TrainState,
          calculator, seq_length: int, grid: ParallelGrid, forward_backward_func,
          config: ScheduleConfig, do_valid: bool | None = None, save_checkpoint_fn=None,
          finalize_async_save_fn=None, before_optimizer_step_fn=None, flops_fn=None,
          peak_flops=None, log_fn=None, exit_signal=None, clock=time.time,
          rerun_state_machine=None, step_hooks=None, iterations_to_skip=()) -> str | None:
    """Run iterations until train_iters or an exit condition; return the exit reason or None."""
    # Chapter 08 passes `rerun_state_machine` (see train_step) and `step_hooks`, an object whose
    # `on_step_start(state)` / `on_step_end(state)` bracket every train_step (heartbeats, faults).
    save = partial(save_with_param_sync, save_checkpoint_fn, state, model, optimizer, scheduler)
    finalize = finalize_async_save_fn or no_op
    log_fn = log_fn or print_on_last_rank
    do_valid = valid_data_iterator is not None if do_valid is None else do_valid
    log_state, start_time, m, reason = LogState(), clock(), 0, None
    for chunk in model:
        chunk.train()
    step = partial(train_step, forward_step_func, train_data_iterator, model, optimizer,
                   scheduler, forward_backward_func, micro_batch_size=training.micro_batch_size,
                   seq_length=seq_length, grid=grid, config=config,
                   rerun_state_machine=rerun_state_machine,
                   before_optimizer_step=before_optimizer_step_fn)
    while state.iteration < train_iters:
        finalize(blocking=False)
        m = _advance_microbatches(calculator, state, m, save)
        if state.iteration + 1 in iterations_to_skip:  # chapter 08: its data was found bad
            _dummy_train_step(train_data_iterator, m)  # training.py:2115, 3473-3485
            batch, _ = _account(state, calculator, m * training.micro_batch_size *
                                grid.size("dp"), None)
            state.skipped_train_samples += batch
            continue
        result = hooked(step_hooks, state, partial(step, num_microbatches=m))
        if result.should_exit:  # the rerun machine: save if asked, stop (training.py:3545)
            if result.should_checkpoint:
                save()
            reason = "rerun"
            break
        batch, flops = _account(state, calculator, m * training.micro_batch_size *
                                grid.size("dp"), flops_fn)
        log_step(result, log_state, state, optimizer, training=training, train_iters=train_iters,
                  batch_size=batch, seq_length=seq_length, flops=flops, peak_flops=peak_flops,
                  log_fn=log_fn)
        _maybe_evaluate(forward_step_func, valid_data_iterator, model, forward_backward_func,
                        state, training, calculator, do_valid=do_valid, seq_length=seq_length,
                        grid=grid, config=config, log_fn=log_fn)
        reason = checkpoint_and_decide_exit(state, training, save, start_time=start_time,
                                            clock=clock, grid=grid, exit_signal=exit_signal)
        if reason is not None:
            break
    finalize(blocking=True)
    return reason

# %% [markdown]
# ## `pretrain`: everything set up once
#
# `megatron/training/training.py:1029`, in order:
#
# 1. **Grid and seeds**: the process groups (appendix A's `ParallelGrid`) and Megatron's seeds
#    (`set_random_seed`: offset by the pipeline rank, the TP-parallel RNG stream).
# 2. **Model chunks**: one per virtual stage (appendix B's `build_stage_models`).
# 3. **DDP**: each chunk wrapped over its contiguous grad buffer (chapter 05); only the first
#    chunk is bucketed (`training.py:1784`).
# 4. **Optimizer and scheduler** (chapter 02), the scheduler's lengths in samples.
# 5. **Load a checkpoint** through `load_checkpoint_fn(model, optimizer, scheduler)` (chapter 03):
#    it restores the parts in place and returns the `TrainState`, or `None` for a fresh start.
# 6. **Data iterators**, built *after* the load so they start at `consumed_train_samples`
#    (chapter 04).
# 7. **`train()`**, then a **final save** unless the last iteration was just saved, then a
#    blocking drain of asynchronous saves.
#
# The schedule's callbacks are set as in `training.py:3227-3245` (`build_schedule_config`):
# `no_sync_func` is each DDP chunk's `no_sync`, `finalize_model_grads_func` chapter 05's
# `finalize_model_grads`, `grad_scale_func` the optimizer's `scale_loss`;
# `calculate_per_token_loss` follows the DDP config, so the schedule and the buffers agree on
# who divides by what. The builders — `wrap_with_ddp` (only the first chunk bucketed,
# `training.py:1784`), `megatron_optimizer_provider`, `megatron_scheduler_provider` — are
# passed in, so the loop imports none of chapters 02 and 05 itself.

# %%
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
    iters = training.train_iters or train_iters_from_samples(calc, training.train_samples)
    optimizer = optimizer_provider(model, grid)
    scheduler = (scheduler_provider(optimizer, train_iters=iters,
                                    global_batch_size=calc.current_global_batch_size)
                 if scheduler_provider is not None else None)
    loaded = load_checkpoint_fn(model, optimizer, scheduler) if load_checkpoint_fn else None
    state = loaded if loaded is not None else TrainState()
    calc.update(state.consumed_train_samples, consistency_check=True)
    return grid, model, optimizer, scheduler, calc, iters, state

# %%
def pretrain(training, *, model_provider, forward_step_func, data_iterators_provider,
             optimizer_provider, scheduler_provider=None, grid_provider=ParallelGrid.single,
             ddp_config=None, seq_length: int, vpp_size: int | None = None,
             schedule_overrides: dict | None = None, load_checkpoint_fn=None,
             save_checkpoint_fn=None, finalize_async_save_fn=None,
             before_optimizer_step_fn=None, flops_fn=None, peak_flops=None, log_fn=None,
             exit_signal=None, clock=time.time,
             rerun_state_machine=None, step_hooks=None,
             wrap_forward_backward_func=None, iterations_to_skip=()) -> TrainingRun:
    """Grid+seeds -> chunks -> DDP -> optimizer+scheduler -> load -> data -> train -> save."""
    grid, model, optimizer, scheduler, calc, iters, state = _setup(
        training, grid_provider, model_provider, ddp_config, optimizer_provider,
        scheduler_provider, load_checkpoint_fn, seq_length)
    train_it, valid_it = data_iterators_provider(grid, state)
    # Only ranks that read data hold a validation iterator (TP rank 0 of the first and last
    # stage), but every rank must run the evaluation's collectives: agree on it, as Megatron
    # broadcasts its do_valid flag (training.py:4256).
    do_valid = valid_it is not None
    if dist.is_initialized():
        flag = torch.tensor([int(do_valid)], device=grid.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        do_valid = bool(flag.item())
    per_token = bool(getattr(ddp_config, "calculate_per_token_loss", False))
    config = build_schedule_config(model, optimizer, grid, calculate_per_token_loss=per_token,
                                   **(schedule_overrides or {}))
    fb = get_forward_backward_func(grid.size("pp"), vpp_size)
    if wrap_forward_backward_func is not None:  # chapter 08: timers, checks, a CUDA graph
        fb = wrap_forward_backward_func(fb)
    use_handler = exit_signal is None and getattr(training, "exit_signal_handler", False)
    reason = None
    with (ExitSignal() if use_handler else contextlib.nullcontext(exit_signal)) as sig:
        if state.iteration < iters:
            reason = train(forward_step_func, model, optimizer, scheduler, train_it, valid_it,
                           do_valid=do_valid, training=training, train_iters=iters, state=state, calculator=calc,
                           seq_length=seq_length, grid=grid, forward_backward_func=fb,
                           config=config, save_checkpoint_fn=save_checkpoint_fn,
                           finalize_async_save_fn=finalize_async_save_fn,
                           before_optimizer_step_fn=before_optimizer_step_fn, flops_fn=flops_fn,
                           peak_flops=peak_flops, log_fn=log_fn, exit_signal=sig, clock=clock,
                           rerun_state_machine=rerun_state_machine, step_hooks=step_hooks,
                           iterations_to_skip=iterations_to_skip)
    just_saved = bool(training.save_interval) and state.iteration % training.save_interval == 0
    if save_checkpoint_fn is not None and reason is None and state.iteration and not just_saved:
        save_with_param_sync(save_checkpoint_fn, state, model, optimizer, scheduler)
    if finalize_async_save_fn is not None:
        finalize_async_save_fn(blocking=True)
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
    for p, b in zip(plain_logs, book_logs):
        if "validation" in b:
            print(f"iter {b['iteration']:3d}  validation lm loss {b['validation']['lm loss']:.4f}")
        else:
            print(f"iter {b['iteration']:3d}  lm loss plain {p['losses']['lm loss']:.4f}  "
                  f"book {b['losses']['lm loss']:.4f}  lr {b['learning_rate']:.2e}  "
                  f"consumed {b['consumed_train_samples']}")
    train_losses = [b["losses"]["lm loss"] for b in book_logs if "losses" in b]
    assert book.state.iteration == 8 and book.state.consumed_train_samples == 8 * 8
    assert saves == [4, 8] and book.exit_reason is None
    assert train_losses[-1] < train_losses[0]
    assert abs(plain_logs[0]["losses"]["lm loss"] - book_logs[0]["losses"]["lm loss"]) < 1e-5

# %% [markdown]
# The first logged losses agree (same weights, same batches; from there the two Adams
# diverge by rounding and the book's run follows a cosine learning rate). Iteration 8 was
# saved by `save_interval`, so `pretrain` did not save it twice.
#
# ## Summary
#
# - `pretrain` builds in Megatron's order and loads before it builds the data iterators, so a
#   resumed run reads the next unseen sample.
# - `train_step`: zero → forward-backward (finalize inside) → step → AND/MAX over the
#   model-parallel group → scheduler by samples, only on success.
# - Consumed samples advance on every iteration, skipped or not; the learning rate only on
#   successful ones.
# - Exits happen between iterations, after a save: signal, duration, exit interval; the run
#   ends at `train_iters`.
#
# ## How production does it
#
# - Megatron: `megatron/training/training.py` — `pretrain:1029`, `setup_model_and_optimizer:1938`,
#   `train_step:2162`, `checkpoint_and_decide_exit:2953`, `train:3065` (loop body `:3397-3800`),
#   `evaluate:3826`; `pretrain_gpt.py:197` (`forward_step`).
# - torchtitan: `torchtitan/train.py` (`Trainer.train_step`, `Trainer.train`) runs the same
#   skeleton with a fixed number of gradient-accumulation steps, `torch.optim` optimizers and
#   an LR scheduler stepped once per iteration rather than by samples.
#
# ## Exercises
#
# 1. A run with `exit_interval = 100` and `save_interval = 250` is stopped at iteration 100.
#    Which checkpoints exist, and at which iteration does the resumed run save next?
# 2. Why must the scheduler advance by samples and not by 1 when a step schedule doubles the
#    global batch at some point?
# 3. On which ranks is `grad_norm` `None` before the MAX reduction, in a PP 4 run whose last
#    stage holds only the output layer and that layer is frozen?
