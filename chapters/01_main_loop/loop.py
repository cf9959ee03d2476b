# %% [markdown]
# # 01 · The main loop: `pretrain` → `train` → `train_step`
#
# Every other chapter builds a part; this page is the loop that calls them, in Megatron's
# order. `pretrain` sets everything up once, `train` repeats iterations until one of its exit
# conditions holds, and `train_step` is one iteration: zero the gradient buffers, run the
# schedule, step the optimizer, agree on success, advance the learning rate by the samples
# just consumed. The loop takes every part as an argument, so the same code runs the plain
# PyTorch demo below and the full trainer.
#
# The page starts with the whole loop on one screen, the way nanoGPT shows its training
# loop: one model chunk, no pipeline, no checkpoint, no evaluation. A test runs it against
# the production `train_step` on the same model and batches and finds the same losses and
# the same weights, bit for bit. Everything after it is that loop again, with what a real
# run adds: pipeline schedules, skipped steps, evaluation, exits, and the hooks through which
# chapters 03 and 08 plug in. This is the chapter's first page on purpose: the pages after
# it open up the parts the loop calls — [the batch arithmetic](microbatches.py), [the
# pipeline schedules](schedules.py) and [their timelines](schedule_timeline.py), [the log
# line](training_log.py), and [what the iteration holds in memory](resident_flowing.py).

# %%
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from tinytron.main_loop._parts import (ExitSignal, TorchOptimizer, _duration_exceeded,
                                       _earliest_over_ranks, _logs_num_zeros, any_rank,
                                       build_schedule_config, eval_batch, hooked, log_step,
                                       megatron_optimizer_provider, megatron_scheduler_provider,
                                       no_op, print_on_last_rank, wrap_with_ddp)
from tinytron.main_loop.microbatches import (build_num_microbatches_calculator,
                                             samples_in_iterations, train_iters_from_samples)
from tinytron.main_loop.schedules import ScheduleConfig, get_forward_backward_func
from tinytron.main_loop.training_log import LogState
from tinytron.overview.loss import lm_loss_func
from tinytron.parallel import ParallelGrid, set_random_seed

# Megatron starts its clock when training.py is imported (`_TRAIN_START_TIME`,
# megatron/training/training.py:10); `exit_duration_in_mins` counts from there.
_TRAIN_START_TIME = time.time()

__all__ = ["train_at_a_glance", "LoopHooks", "eval_batch", "TrainState", "StepResult", "ExitSignal", "TorchOptimizer", "gpt_forward_step",
           "sft_loss_func",
           "zero_grad_buffers", "logical_and_across_model_parallel_group",
           "reduce_max_stat_across_model_parallel_group", "reduce_losses", "train_step",
           "evaluate", "save_with_param_sync", "checkpoint_and_decide_exit", "train",
           "wrap_with_ddp", "build_schedule_config", "megatron_optimizer_provider",
           "megatron_scheduler_provider", "TrainingRun", "pretrain"]

# %% [markdown]
# ## The iteration at a glance
#
# One DP-wrapped model chunk (chapter 05's `DistributedDataParallel`), chapter 02's optimizer
# and scheduler, and an iterator of micro-batches. Each line is one of the steps that
# `train_step` below takes through its parts; the comments say why the step is there.

# %%
def train_at_a_glance(forward_step_func, data_iterator, model, optimizer, scheduler, *,
                      train_iters: int, num_microbatches: int, micro_batch_size: int,
                      grid: ParallelGrid, log=print) -> list[float]:
    """The whole loop on one screen: one DDP chunk, no pipeline, no checkpoint, no eval."""
    m, losses = num_microbatches, []
    for iteration in range(1, train_iters + 1):
        model.zero_grad_buffer()  # zeroed, not freed: the grad buffer is resident memory
        optimizer.zero_grad()
        reports = []
        for i in range(m):
            # All micro-batches but the last only accumulate into the buffer: a DP
            # collective may start only once every gradient of the step is in it.
            with model.no_sync() if i < m - 1 else contextlib.nullcontext():
                output, loss_func = forward_step_func(data_iterator, model)
                loss_sum, num_tokens, report = loss_func(output)
                # Chapter 00's objective: this micro-batch's token mean, 1/m of the step.
                objective = loss_sum / torch.clamp(num_tokens, min=1) / m
                optimizer.scale_loss(objective).backward()  # x loss scale under fp16
            reports.append(report)  # [loss sum, token count]: averaged exactly below
        model.finish_grad_sync()  # wait for the DP collectives: the grads are the DP mean
        ok, grad_norm, _ = optimizer.step()  # unscale, inf/NaN check, clip, update
        # A pipeline stage or TP rank may see an overflow the others do not: every rank
        # of the model-parallel group must take the same branch, so AND the verdicts.
        ok = logical_and_across_model_parallel_group(ok, grid)
        grad_norm = reduce_max_stat_across_model_parallel_group(grad_norm, grid)
        if ok:  # by samples (m·b·d), not by 1: a growing batch keeps the LR schedule right
            scheduler.step(increment=m * micro_batch_size * grid.size("dp"))
        loss = float(reduce_losses(reports, grid)["lm loss"])  # token mean over DP ranks
        losses.append(loss)
        log(f"iteration {iteration:3d} | lm loss {loss:.4f} | grad norm {grad_norm:.3f} | "
            f"lr {optimizer.param_groups[0]['lr']:.3e}" + ("" if ok else " | skipped"))
    return losses

# %% [markdown]
# Three lines carry most of the meaning. The division by $m$ makes the sum of the $m$
# backward passes the gradient of the *mean* loss of the step, so the learning rate does not
# depend on how the global batch is cut into micro-batches. `no_sync` around all but the
# last micro-batch is what lets chapter 05's buckets launch their all-reduce from inside the
# last backward pass, overlapped with the rest of it, and not $m$ times. And the scheduler
# steps by samples: with a batch-size schedule one iteration is worth more samples later in
# the run, and Megatron's warm-up and decay lengths are counted in samples.
#
# What the production loop adds to these lines, and where on this page:
#
# - **The schedule.** The inner loop over micro-batches is `forward_backward_func`: the loop
#   above is its no-pipelining case, and the 1F1B and interleaved schedules of the pages after
#   this one ([schedules](schedules.py), [interleaved](interleaved.py)) replace it when the
#   model is split into stages. The schedule also calls chapter 05's
#   `finalize_model_grads` after the last backward, which is `finish_grad_sync` plus the
#   tensor- and pipeline-parallel reductions that one chunk does not need.
# - **Skipped steps.** `ok` is False after an fp16 overflow or a rejected grad norm; the
#   learning rate stays, the samples still count as consumed (`train`, below).
# - **Around the step**: a changing number of micro-batches (a batch-size schedule), the
#   log record of [the log page](training_log.py), evaluation every `eval_interval`, saving and exiting
#   (`checkpoint_and_decide_exit`), and the hooks of chapters 03 and 08, each told in a
#   section of its own once the loop itself is understood.
#
# ## The state that survives a restart
#
# Four counters and one running sum are all the loop itself must carry across a checkpoint
# (Megatron keeps them in `args` and writes them into every checkpoint,
# `megatron/training/checkpointing.py`): the iteration, the samples consumed (the sampler
# resumes there; the scheduler keeps its own count, which skipped steps do not advance), the samples skipped by
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
# | schedule | `forward_backward_func(forward_step_func=…, …)` ([schedules](schedules.py)) | one loss report per micro-batch on the last stage |
# | `forward_step_func` | `(data_iterator, model_chunk)` | `(output, loss_func)`, chapter 00's contract |
#
# Chapter 02's optimizers already return the triple. A plain `torch.optim` optimizer does not
# clip and returns nothing, so `TorchOptimizer` adapts it: clip by the global norm with
# `torch.nn.utils.clip_grad_norm_`, step, report `(True, norm, None)`. It and the builders of
# the book's parts that `pretrain` is handed below live in the chapter's private module
# `chapters/01_main_loop/_parts.py` (glue, not mechanism; the loop page imports them).
#
# `gpt_forward_step` is Megatron's `forward_step` of `pretrain_gpt.py:183` over the book's
# model: `get_batch` (chapter 04: read on TP rank 0, broadcast, CP slice, only the keys this
# stage needs), the model with labels (the last stage returns per-token losses), and chapter
# 00's `lm_loss_func` bound to the batch's loss mask. With `sft=True` (the trainer's `[data] sft`,
# Megatron's `--sft`) the batch is a packed chat row ([04 · SFT](../04_data/sft.py)): it carries
# its block-causal attention mask and `cu_seqlens`, and `sft_loss_func` adds one more report,
# the tokens that carried a loss per sample — the assistant's tokens only, which is how a run's
# own log shows that no prompt token was trained on.

# %%
def gpt_forward_step(data_iterator, model, *, micro_batch_size: int, seq_length: int,
                     sft: bool = False):
    """Megatron's pretrain_gpt forward_step: get_batch, the model with labels, the loss func."""
    from tinytron.data.distribute import get_batch  # chapter 04; imported on use only

    grid = getattr(model, "grid", None) or ParallelGrid.single()  # GPTModel and DDP carry it
    batch = get_batch(data_iterator, grid, micro_batch_size=micro_batch_size,
                      seq_length=seq_length, create_attention_mask=sft, is_sft=sft,
                      vocab_size=getattr(model, "module", model).config.vocab_size)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(sft_loss_func if sft else lm_loss_func, batch["loss_mask"])


def sft_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Chapter 00's lm_loss_func, also reporting the tokens that carried a loss, per sample."""
    loss_sum, num_tokens, report = lm_loss_func(loss_mask, output_tensor)
    samples = torch.tensor(float(loss_mask.shape[0]), device=num_tokens.device)
    report["loss tokens per sample"] = torch.stack([num_tokens.float(), samples])
    return loss_sum, num_tokens, report

# %% [markdown]
# ## `train_step`, in Megatron's exact order
#
# `megatron/training/training.py:2162`; the zeroing at `:2179-2184`, the schedule at `:2227`,
# the step at `:2287`:
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
#
#    <details><summary>Megatron detail: no such hook</summary>
#
#    Megatron has no such hook: its
#    async save copies to host before the save returns.
#
#    </details>
#
# 4. `update_successful` is **ANDed** and `grad_norm`, `num_zeros` are **MAXed** over the
#    model-parallel group (`training.py:2303-2306`): a pipeline stage without trainable
#    parameters reports `None`, and every rank must take the same branch next. The MAX of
#    `num_zeros` runs only with `log_num_zeros_in_grad` (`training.py:2307-2308`), one
#    collective less per step otherwise.
# 5. If successful, the scheduler advances by the samples of this step,
#    $m \cdot b \cdot d$ (`training.py:2316-2318`); otherwise the iteration is **skipped**: the
#    learning rate stays where it was. The samples still count as consumed — the loop adds them
#    either way — because they were read and must not be read again.
# 6. The last stage reduces the loss reports: each `{"lm loss": [sum, count]}` is summed over
#    micro-batches and all-reduced over DP×CP, and the mean is `sum / count`
#    (`training.py:2327-2347`): the exact token mean over the whole global batch.
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


# %% [markdown]
# Steps 3-4 need every rank of the model-parallel group to agree. Two small collectives do it:
# a MIN over "my step succeeded" (an AND), and a MAX over a statistic in which a rank without
# parameters reports nothing.

# %%
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


# %% [markdown]
# Step 6 turns the last stage's `[sum, count]` reports into the logged loss: sum over the
# micro-batches, all-reduce over DP×CP, divide once.

# %%
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
               rerun_state_machine=None, before_optimizer_step=None,
               log_num_zeros_in_grad: bool = False) -> StepResult:
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
        if should_exit:  # no optimizer step (training.py:2271-2273)
            return StepResult({}, 0, None, None, should_checkpoint, should_exit, exit_code)
    if before_optimizer_step is not None:  # chapter 03: a staged save's copies end here
        before_optimizer_step()
    update_successful, grad_norm, num_zeros = optimizer.step()
    update_successful = logical_and_across_model_parallel_group(update_successful, grid)
    grad_norm = reduce_max_stat_across_model_parallel_group(grad_norm, grid)
    if log_num_zeros_in_grad:  # training.py:2307-2308: only then is it MAXed (and logged)
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
# pre-hooks are switched off before it (`training.py:3692-3694`, which gathers every
# parameter at once) and back on after it (`:3736-3738`), so that evaluation uses complete
# parameters.
#
# The evaluation batch does not follow the training batch: it is `eval_global_batch_size`
# samples, `eval_global_batch_size / (eval_micro_batch_size · d)` micro-batches, both
# defaulting to the training values as configured (`arguments.py:706-709`), not to the
# number of micro-batches a batch-size schedule runs now (`training.py:3854-3856`). After
# each evaluation batch the validation sampler's position advances by that many samples
# (`:3955`), and the time limit is checked (`:3957-3967`): a run that reaches
# `exit_duration_in_mins` during a long evaluation stops it there, logs nothing for it, and
# `checkpoint_and_decide_exit` saves and exits next. `eval_batch` (in
# `chapters/01_main_loop/_parts.py`) computes the batch and refuses one that does not divide into
# micro-batches over the DP ranks, with Megatron's message.
#
# Each batch's reports are copied out (`_own_reports`) before the next call. The schedule
# hands back fresh tensors when it runs eagerly, but chapter 08's full-iteration CUDA graph
# returns, at every replay, the *same* tensors it produced at capture, overwritten in place:
# keeping references and averaging at the end would average the last batch `eval_iters`
# times (losses 1, 2, 3, 4 read back as 4.0 instead of 2.5).
#
# <details><summary>Megatron detail: running totals instead of copies</summary>
#
# Megatron
# consumes each call at once too: it all-reduces and adds every batch into running totals
# inside the loop (`megatron/training/training.py:3919-3953`). The copy keeps the single
# all-reduce at the end, so an eager evaluation adds the same numbers in the same order as
# before.
#
# </details>

# %%
def _set_pre_hooks(model: list, enabled: bool, param_sync: bool = True) -> bool:
    """Disable (with a param sync unless told not to) or re-enable the overlapped-gather
    pre-hooks; True if any chunk has them (the distributed optimizer's overlap_param_gather)."""
    found = False
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.overlap_param_gather:
            found = True
            if enabled:
                chunk.enable_forward_pre_hook()
            else:
                chunk.disable_forward_pre_hook(param_sync=param_sync)
    return found


def _own_reports(reports: list[dict]) -> list[dict]:
    """Copies of one call's report tensors: a replayed graph overwrites its own next call."""
    return [{k: v.detach().clone() if torch.is_tensor(v) else v for k, v in r.items()}
            for r in reports]


# %% [markdown]
# `evaluate` itself: eval mode and the pre-hooks off around a `torch.no_grad()` loop of
# forward-only schedules, a copy of each call's reports, and one reduction at the end.

# %%
def evaluate(forward_step_func, data_iterator, model: list, forward_backward_func, *,
             num_microbatches: int, micro_batch_size: int, seq_length: int, eval_iters: int,
             grid: ParallelGrid, config: ScheduleConfig, state: TrainState | None = None,
             eval_batch_size: int = 0, time_is_up=None) -> dict | None:
    """Mean of each loss key over eval_iters forward-only global batches (last stage; {} else).

    With `state`, each batch adds `eval_batch_size` to `state.consumed_valid_samples`; with
    `time_is_up` (a collective callable), a True after a batch stops here and returns None.
    """
    for chunk in model:
        chunk.eval()
    _set_pre_hooks(model, False)
    reports, timed_out = [], False
    with torch.no_grad():
        for _ in range(eval_iters):
            reports += _own_reports(forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, seq_length=seq_length,
                micro_batch_size=micro_batch_size, grid=grid, forward_only=True, config=config))
            if state is not None:
                state.consumed_valid_samples += eval_batch_size
            if time_is_up is not None and time_is_up():
                timed_out = True
                break
    _set_pre_hooks(model, True)
    for chunk in model:
        chunk.train()
    if timed_out:
        return None
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
    log_state, m, reason = LogState(), 0, None
    # saves and evaluations stop the interval clock: ms/iteration and tokens/s time training only
    save = log_state.paused(partial(save_with_param_sync, h.save_checkpoint_fn, state, model,
                                    optimizer, scheduler))
    evaluate_when_due = log_state.paused(_maybe_evaluate)
    finalize, log_fn = h.finalize_async_save_fn or no_op, h.log_fn or print_on_last_rank
    do_valid = valid_data_iterator is not None if do_valid is None else do_valid
    start_time = h.clock() if h.start_time is None else h.start_time
    time_is_up = (partial(_duration_exceeded, training.exit_duration_in_mins, start_time,
                          h.clock, grid) if training.exit_duration_in_mins else None)
    if h.exit_signal is not None:  # a signal abandons an evaluation too (every rank agrees)
        time_is_up = partial(_signal_or_time_up, h.exit_signal, grid, time_is_up)
    evaluates = do_valid and training.eval_interval and training.eval_iters > 0
    eval_shape = eval_batch(training, grid.size("dp")) if evaluates else None  # checked now
    for chunk in model:
        chunk.train()
    pre_hooks_off = _first_iteration_without_pre_hooks(model, config)
    step = partial(train_step, forward_step_func, train_data_iterator, model, optimizer,
                   scheduler, forward_backward_func, micro_batch_size=training.micro_batch_size,
                   seq_length=seq_length, grid=grid, config=config,
                   rerun_state_machine=h.rerun_state_machine,
                   before_optimizer_step=h.before_optimizer_step_fn,
                   log_num_zeros_in_grad=_logs_num_zeros(training, optimizer))
    while state.iteration < train_iters:
        finalize(blocking=False)
        m = _advance_microbatches(calculator, state, m, save)
        batch = m * training.micro_batch_size * grid.size("dp")
        if _skip_iteration(state, h.iterations_to_skip, train_data_iterator, m, batch):
            continue  # chapter 08: its data was found bad
        result = hooked(h.step_hooks, state, partial(step, num_microbatches=m))
        if _rerun_stops(result, save):  # chapter 08
            reason = "rerun"
            break
        if pre_hooks_off and not result.skipped_iter:  # the first successful step
            pre_hooks_off = _restore_pre_hooks(model, config, pre_hooks_off)
        batch, flops = _account(state, calculator, batch, h.flops_fn)
        log_step(result, log_state, state, optimizer, training=training, train_iters=train_iters,
                 batch_size=batch, seq_length=seq_length, flops=flops, peak_flops=h.peak_flops,
                 log_fn=log_fn)
        evaluate_when_due(forward_step_func, valid_data_iterator, model, forward_backward_func,
                          state, training, eval_shape=eval_shape, seq_length=seq_length,
                          grid=grid, config=config, log_fn=log_fn, time_is_up=time_is_up)
        reason = checkpoint_and_decide_exit(state, training, save, start_time=start_time,
                                            clock=h.clock, grid=grid, exit_signal=h.exit_signal)
        if reason is not None:
            break
    finalize(blocking=True)
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
#   host is still running must finish it there (Megatron needs no such hook, see the
#   Megatron detail under `train_step` above);
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
    # Only ranks that read data hold a validation iterator (TP rank 0 of the first and last
    # stage), but every rank must run the evaluation's collectives: agree on it, as Megatron
    # broadcasts its do_valid flag (training.py:4248).
    do_valid = any_rank(valid_it is not None, grid)
    per_token = bool(getattr(ddp_config, "calculate_per_token_loss", False))
    config = build_schedule_config(model, optimizer, grid, calculate_per_token_loss=per_token,
                                   **(schedule_overrides or {}))
    start_time = _earliest_over_ranks(start_time, grid)
    fb = get_forward_backward_func(grid.size("pp"), vpp_size)
    if wrap_forward_backward_func is not None:  # chapter 08: timers, checks, a CUDA graph
        fb = wrap_forward_backward_func(fb)
    use_handler = exit_signal is None and getattr(training, "exit_signal_handler", False)
    reason = None
    skip_train = getattr(training, "skip_train", False)  # Megatron's --skip-train (:1376)
    with (ExitSignal() if use_handler else contextlib.nullcontext(exit_signal)) as sig:
        if state.iteration < iters and not skip_train:
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
    just_saved = bool(training.save_interval) and state.iteration % training.save_interval == 0
    if (save_checkpoint_fn is not None and reason is None and state.iteration and not just_saved
            and not skip_train):
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
# And the loop at a glance against `train_step`: two copies of one model, the same optimizer
# and scheduler settings, the same batches; three iterations each.

# %%
if __name__ == "__main__":
    from tinytron.main_loop.schedules import get_forward_backward_func as _fb

    def glance_parts():
        grid = ParallelGrid.single()
        torch.manual_seed(7)
        model = wrap_with_ddp(build_stage_models(cfg, grid), grid, DistributedDataParallelConfig())
        opt = megatron_optimizer_provider(opt_config)(model, grid)
        sched = megatron_scheduler_provider(SchedulerConfig(lr_decay_style="cosine"), opt_config)(
            opt, train_iters=3, global_batch_size=8)
        data = synthetic_iterators(cfg, grid, TrainState(), micro_batch_size=2)[0]
        return grid, model, opt, sched, data
    fwd = partial(gpt_forward_step, micro_batch_size=2, seq_length=32)
    grid, model, opt, sched, data = glance_parts()
    glance = train_at_a_glance(fwd, data, model[0], opt, sched, train_iters=3,
                               num_microbatches=4, micro_batch_size=2, grid=grid)
    grid, model2, opt2, sched2, data2 = glance_parts()
    config = build_schedule_config(model2, opt2, grid)
    steps = [float(train_step(fwd, data2, model2, opt2, sched2, _fb(1), num_microbatches=4,
                              micro_batch_size=2, seq_length=32, grid=grid,
                              config=config).loss_dict["lm loss"]) for _ in range(3)]
    print("at a glance:", glance, "\ntrain_step: ", steps)
    assert glance == steps
    assert all(torch.equal(a, b) for a, b in zip(model[0].parameters(), model2[0].parameters()))

# %% [markdown]
# The same losses and the same weights, bit for bit: the loop at the top of the page is
# `train_step` with one chunk and no pipeline.
#
# The first logged losses of the two `pretrain` runs agree (same weights, same batches; from there the two Adams
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
#   `train_step:2162`, `checkpoint_and_decide_exit:2953`, `train:3065` (loop body `:3401-3792`),
#   `evaluate:3826`; `pretrain_gpt.py:183` (`forward_step`).
# - torchtitan: `torchtitan/trainer.py` (`Trainer.train_step`, `Trainer.train`) runs the same
#   skeleton with a fixed number of gradient-accumulation steps, `torch.optim` optimizers and
#   an LR scheduler stepped once per iteration rather than by samples.
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
# 2. Why must the scheduler advance by samples and not by 1 when a step schedule doubles the
#    global batch at some point?
#
#    <details><summary>Hint</summary>
#
#    The warm-up and decay lengths are counted in samples.
#    After the doubling one iteration reads twice the samples; look at
#    `scheduler.step(increment=num_microbatches * micro_batch_size * grid.size("dp"))` in
#    `train_step` and ask where the learning rate would be, in samples, if it advanced by 1.
#
#    </details>
#
# 3. On which ranks is `grad_norm` `None` before the MAX reduction, in a PP 4 run whose last
#    stage holds only the output layer and that layer is frozen?
#
#    <details><summary>Hint</summary>
#
#    A rank whose optimizer has no trainable parameter has no
#    norm to report: that is every rank of the last stage (each of its TP and DP ranks). See
#    how `reduce_max_stat_across_model_parallel_group` sends $-1$ for `None`, so that after the
#    MAX every rank holds the largest norm the other stages reported.
#
#    </details>
