# %% [markdown]
# # 01 · The main loop: one iteration, `train_step`
#
# Every other chapter builds a part; this chapter is the loop that calls them, in Megatron's
# order. `pretrain` sets everything up once, `train` repeats iterations until one of its exit
# conditions holds, and `train_step` is one iteration: zero the gradient buffers, run the
# schedule, step the optimizer, agree on success, advance the learning rate by the samples
# just consumed. This page is the iteration; [01.2](run.py) is the run around it. The loop
# takes every part as an argument, so the same code runs the plain PyTorch demos and the full
# trainer.
#
# The page starts with the whole iteration on one screen, the way nanoGPT shows its training
# loop: one model chunk, no pipeline, no checkpoint, no evaluation. A demo at the end runs it
# against the production `train_step` on the same model and batches and finds the same losses
# and the same weights, bit for bit. In between is that loop again, with what a real step
# adds: pipeline schedules, skipped steps, the agreement of the model-parallel group, and the
# forward-only pass of evaluation. The pages after it open up the parts the loop calls —
# [the batch arithmetic](microbatches.py), [the pipeline schedules](pipeline_orders.py) and
# [their timelines](schedule_timeline.py), [the log line](training_log.py), and [what the
# iteration holds in memory](resident_flowing.py).

# %%
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from tinytron.main_loop._parts import (ExitSignal, TorchOptimizer, build_schedule_config,
                                       eval_batch, megatron_optimizer_provider,
                                       megatron_scheduler_provider, wrap_with_ddp)
from tinytron.main_loop.schedules import ScheduleConfig, get_forward_backward_func
from tinytron.overview.loss import lm_loss_func
from tinytron.parallel import ParallelGrid

__all__ = ["train_at_a_glance", "eval_batch", "TrainState", "StepResult", "ExitSignal",
           "TorchOptimizer", "gpt_forward_step", "sft_loss_func", "zero_grad_buffers",
           "logical_and_across_model_parallel_group",
           "reduce_max_stat_across_model_parallel_group", "reduce_losses", "train_step",
           "evaluate", "wrap_with_ddp", "build_schedule_config", "megatron_optimizer_provider",
           "megatron_scheduler_provider"]

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
# What the production loop adds to these lines:
#
# - **The schedule.** The inner loop over micro-batches is `forward_backward_func`: the loop
#   above is its no-pipelining case, and the 1F1B and interleaved schedules of the pages after
#   this one ([schedules](schedules.py), [interleaved](interleaved.py)) replace it when the
#   model is split into stages. The schedule also calls chapter 05's
#   `finalize_model_grads` after the last backward, which is `finish_grad_sync` plus the
#   tensor- and pipeline-parallel reductions that one chunk does not need.
# - **Skipped steps.** `ok` is False after an fp16 overflow or a rejected grad norm; the
#   learning rate stays, the samples still count as consumed ([`train`](run.py)).
# - **Around the step** ([01.2](run.py)): a changing number of micro-batches (a batch-size
#   schedule), the log record of [the log page](training_log.py), evaluation every
#   `eval_interval`, saving and exiting, and the hooks of chapters 03 and 08.
#
# ## The state that survives a restart
#
# Four counters and one running sum are all the loop itself must carry across a checkpoint
# (Megatron keeps them in `args` and writes them into every checkpoint,
# `megatron/training/checkpointing.py`): the iteration, the samples consumed (the sampler
# resumes there; the scheduler keeps its own count, which skipped steps do not advance), the samples skipped by
# `decrease_batch_size_if_needed`, the validation samples consumed, and the FLOPs done so far
# (so that a resumed run's TFLOP/s and MFU stay honest). `train` advances them
# ([01.2](run.py)); chapter 03 saves `state_dict()` and hands a `TrainState` back through
# `load_checkpoint_fn`.

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
# the book's parts that `pretrain` is handed ([01.2](run.py)) live in the chapter's private module
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
#    must finish it here (chapter 03, [the staged copy](../03_checkpoint/staged_copy.py)).
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
#
# ```mermaid
# flowchart TB
#   Z["zero_grad_buffer<br/>optimizer.zero_grad"] --> FB["forward_backward_func<br/>m micro-batches,<br/>finalize_model_grads"]
#   FB --> ST["optimizer.step<br/>(ok, grad_norm, num_zeros)"]
#   ST --> AG["AND ok, MAX grad_norm<br/>over the model-parallel group"]
#   AG -->|ok| LR["scheduler.step(m·b·d)"]
#   AG -->|not ok| SK["skipped: LR stays"]
#   LR --> RL["last stage: token-mean loss<br/>over DP×CP"]
#   SK --> RL
# ```

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
# `checkpoint_and_decide_exit` ([01.2](run.py)) saves and exits next. `eval_batch` (in
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
# ## Demo: the loop at a glance against `train_step`
#
# Two copies of the tiny GPT (chapter 05's DDP around it, chapter 02's optimizer and cosine
# scheduler), built from the same seed and reading the same synthetic batches (chapter 04's
# sampler over an in-memory dataset): one goes through `train_at_a_glance`, the other through
# `train_step` with the no-pipelining schedule. Three iterations of 4 micro-batches of 2
# samples each.

# %%
if __name__ == "__main__":
    from tinytron.buffers import DistributedDataParallelConfig
    from tinytron.main_loop._loop_workers import synthetic_iterators
    from tinytron.model import build_stage_models, tiny_config
    from tinytron.optimizer import OptimizerConfig, SchedulerConfig

    cfg = tiny_config(seq_length=32)
    opt_config = OptimizerConfig(lr=3e-3, weight_decay=0.0, clip_grad=1.0)

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

# %% [markdown]
# The two runs, and the claim: the same three losses and the same weights.

# %%
if __name__ == "__main__":
    grid, model, opt, sched, data = glance_parts()
    glance = train_at_a_glance(fwd, data, model[0], opt, sched, train_iters=3,
                               num_microbatches=4, micro_batch_size=2, grid=grid)
    grid, model2, opt2, sched2, data2 = glance_parts()
    config = build_schedule_config(model2, opt2, grid)
    steps = [float(train_step(fwd, data2, model2, opt2, sched2, get_forward_backward_func(1),
                              num_microbatches=4, micro_batch_size=2, seq_length=32, grid=grid,
                              config=config).loss_dict["lm loss"]) for _ in range(3)]
    print("at a glance:", glance, "\ntrain_step: ", steps)
    assert glance == steps
    assert all(torch.equal(a, b) for a, b in zip(model[0].parameters(), model2[0].parameters()))

# %% [markdown]
# The same losses and the same weights, bit for bit: the loop at the top of the page is
# `train_step` with one chunk and no pipeline.
#
# ## Summary
#
# - `train_step`: zero → forward-backward (finalize inside) → step → AND/MAX over the
#   model-parallel group → scheduler by samples, only on success.
# - The logged loss is the exact token mean of the global batch: `[sum, count]` reports summed
#   over micro-batches and DP×CP, divided once.
# - `evaluate` runs the same schedule forward only, on its own batch size, and copies each
#   call's reports before the next.
# - [01.2](run.py) repeats the step: `train`, its exits and saves, and `pretrain`.
#
# ## How production does it
#
# - Megatron: `megatron/training/training.py` — `train_step:2162`, `evaluate:3826`;
#   `pretrain_gpt.py:183` (`forward_step`).
# - torchtitan: `torchtitan/trainer.py` (`Trainer.train_step`) runs the same skeleton with a
#   fixed number of gradient-accumulation steps, `torch.optim` optimizers and an LR scheduler
#   stepped once per iteration rather than by samples.
#
# ## Exercises
#
# 1. Why must the scheduler advance by samples and not by 1 when a step schedule doubles the
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
# 2. On which ranks is `grad_norm` `None` before the MAX reduction, in a PP 4 run whose last
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
