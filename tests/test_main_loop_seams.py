"""Chapter 01's loop at its seams, against Megatron-LM's training.py at e03878b5f.

Schedule callbacks (training.py:3227-3245) and which backward launches each bucket's grad
collective (schedules.py:2380-2430); forward pre-hooks off for the first iteration
(training.py:3371-3380, 3558-3574); the exit duration from the program's start, MIN over ranks
(training.py:1132-1137, 3017-3024), checked in evaluate too (:3957-3967); the evaluation batch
(training.py:3854-3856, 3955); skipped iterations (training.py:3474-3485); the MAX of num_zeros
only with log_num_zeros_in_grad (training.py:2307-2308).
"""

from __future__ import annotations

import itertools
import time
from functools import partial

import pytest
import torch

from tests import main_loop_workers as workers
from tinytron.buffers import DistributedDataParallelConfig
from tinytron.launch import run_on_ranks
from tinytron.main_loop._loop_workers import synthetic_iterators
from tinytron.main_loop.loop import (TrainState, build_schedule_config,
                                     megatron_optimizer_provider, megatron_scheduler_provider,
                                     train_step, wrap_with_ddp)
from tinytron.main_loop.run import pretrain
from tinytron.main_loop.schedule_timeline import ScheduleRecorder
from tinytron.main_loop.schedules import get_forward_backward_func
from tinytron.model import build_stage_models
from tinytron.optimizer import OptimizerConfig, SchedulerConfig
from tinytron.parallel import ParallelGrid

CFG, MBS, FORWARD_STEP, training = workers.CFG, workers.MBS, workers.FORWARD_STEP, workers.training
M = 4  # micro-batches per step: global batch 8 = 4 x 2 on one DP rank


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _run(train, opt_config=None, ddp_config=None, **kw):
    """pretrain the tiny GPT on synthetic tokens with the book's parts; (run, log records)."""
    opt_config = opt_config or OptimizerConfig(lr=1e-3, weight_decay=0.0)
    logs = []
    run = pretrain(
        train, model_provider=lambda grid: build_stage_models(CFG, grid),
        forward_step_func=kw.pop("forward_step_func", FORWARD_STEP),
        data_iterators_provider=partial(synthetic_iterators, CFG, micro_batch_size=MBS),
        optimizer_provider=megatron_optimizer_provider(opt_config),
        scheduler_provider=megatron_scheduler_provider(SchedulerConfig(lr_decay_style="cosine"),
                                                       opt_config),
        ddp_config=ddp_config or DistributedDataParallelConfig(), seq_length=CFG.seq_length,
        log_fn=logs.append, **kw)
    return run, logs


# -- the schedule's callbacks ------------------------------------------------------------------
def test_schedule_callbacks_follow_megatrons_conditions():
    grid = ParallelGrid.single()

    def config_for(**ddp):
        model = wrap_with_ddp(build_stage_models(CFG, grid), grid,
                              DistributedDataParallelConfig(**ddp))
        opt = megatron_optimizer_provider(OptimizerConfig(lr=1e-3))(model, grid)
        return model[0], build_schedule_config(model, opt, grid)
    chunk, cfg = config_for()                        # no overlap: nothing to hold back
    assert cfg.no_sync_func is None and cfg.grad_sync_func is None
    assert cfg.finalize_model_grads_func is not None
    chunk, cfg = config_for(overlap_grad_reduce=True)  # align_grad_reduce is on by default
    assert DistributedDataParallelConfig().align_grad_reduce is True
    assert cfg.no_sync_func == chunk.no_sync and cfg.grad_sync_func == chunk.start_grad_sync
    chunk, cfg = config_for(overlap_grad_reduce=True, align_grad_reduce=False)
    assert cfg.no_sync_func == chunk.no_sync and cfg.grad_sync_func is None


def _launches(grid, align_grad_reduce: bool) -> dict:
    """Two 1F1B steps (m = 4) with overlapped grad reduce; where the second one launched."""
    from tinytron.buffers import DistributedDataParallelConfig as DDPConfig
    ddp = DDPConfig(overlap_grad_reduce=True, align_grad_reduce=align_grad_reduce,
                    bucket_size=20_000)
    model = wrap_with_ddp(build_stage_models(CFG, grid), grid, ddp)
    opt = megatron_optimizer_provider(OptimizerConfig(lr=1e-3))(model, grid)
    config = build_schedule_config(model, opt, grid, recorder=ScheduleRecorder())
    launched = []
    for i, group in enumerate(model[0].bucket_groups):
        def record(start=group.start_grad_sync, group=group, i=i):
            t, before = time.perf_counter(), group.grad_reduce_handle
            start()
            if group.grad_reduce_handle is not before:  # a call that launched (others return)
                launched.append((i, t))
        group.start_grad_sync = record
    data, _ = synthetic_iterators(CFG, grid, TrainState(), micro_batch_size=MBS)
    for _ in range(2):  # the first step learns the hooks' order; the second one overlaps
        config.recorder.events.clear()
        launched.clear()
        train_step(FORWARD_STEP, data, model, opt, None, get_forward_backward_func(2),
                   num_microbatches=M, micro_batch_size=MBS, seq_length=CFG.seq_length,
                   grid=grid, config=config)
    backwards = [(e.start, e.end, e.microbatch) for e in config.recorder.events
                 if e.kind == "backward"]

    def during(t):
        inside = [mb for start, end, mb in backwards if start <= t <= end]
        return inside[0] if inside else ("after the last backward"
                                         if t > max(end for _, end, _ in backwards) else "before")
    return {"launches": [(i, during(t)) for i, t in launched],
            "groups": len(model[0].bucket_groups),
            "params": [p.detach().clone() for p in model[0].module.parameters()]}


def _mp_all_reduces(grid, log_num_zeros_in_grad: bool) -> int:
    """All-reduces over the model-parallel group in one train_step."""
    model = wrap_with_ddp(build_stage_models(CFG, grid), grid, DistributedDataParallelConfig())
    opt = megatron_optimizer_provider(OptimizerConfig(lr=1e-3, log_num_zeros_in_grad=True))(
        model, grid)
    config = build_schedule_config(model, opt, grid)
    data, _ = synthetic_iterators(CFG, grid, TrainState(), micro_batch_size=MBS)
    calls, real = [], grid.all_reduce
    grid.all_reduce = lambda t, axis, *a, **k: (calls.append(axis), real(t, axis, *a, **k))[1]
    try:
        train_step(FORWARD_STEP, data, model, opt, None, get_forward_backward_func(2),
                   num_microbatches=M, micro_batch_size=MBS, seq_length=CFG.seq_length,
                   grid=grid, config=config, log_num_zeros_in_grad=log_num_zeros_in_grad)
    finally:
        del grid.all_reduce
    return calls.count("mp")


def _exit_with_skewed_clocks(grid) -> tuple[int, str]:
    """pretrain with a clock that starts 1 minute later on every further rank."""
    ticks = itertools.count()
    rank = torch.distributed.get_rank()
    clock = lambda: 60.0 * (rank + next(ticks))  # noqa: E731 - one call per check
    run = pretrain(training(train_iters=8, exit_duration_in_mins=3.5),
                   model_provider=lambda g: build_stage_models(CFG, g),
                   forward_step_func=FORWARD_STEP,
                   data_iterators_provider=partial(synthetic_iterators, CFG, micro_batch_size=MBS),
                   optimizer_provider=megatron_optimizer_provider(OptimizerConfig(lr=1e-3)),
                   grid_provider=lambda: grid, ddp_config=DistributedDataParallelConfig(),
                   seq_length=CFG.seq_length, log_fn=lambda record: None, clock=clock)
    return run.state.iteration, run.exit_reason


def pp2_dp2_seams() -> dict:
    """On a 4-rank world, PP 2 x DP 2: bucket launches, mp all-reduces, the exit duration."""
    grid = ParallelGrid(pp=2)
    assert grid.size("dp") == 2
    aligned, unaligned = _launches(grid, True), _launches(grid, False)
    return {"stage": grid.rank("pp"), "aligned": aligned["launches"],
            "unaligned": unaligned["launches"], "groups": aligned["groups"],
            "same_params": all(torch.equal(a, b) for a, b in zip(aligned["params"],
                                                                 unaligned["params"])),
            "mp_all_reduces": (_mp_all_reduces(grid, False), _mp_all_reduces(grid, True)),
            "exit": _exit_with_skewed_clocks(grid)}


def test_pp2_dp2_grad_launches_num_zeros_and_exit_duration_as_megatron():
    ranks = run_on_ranks(pp2_dp2_seams, 4, timeout=600)
    # stage 0 is bucketed; later stages have one bucket (their DP collective is off the
    # critical path, megatron/training/training.py:1788-1791)
    assert [r["groups"] > 1 for r in ranks] == [r["stage"] == 0 for r in ranks]
    for r in ranks:
        groups = r["groups"]
        if r["stage"] == 0:  # the first stage: its hooks launch each bucket in its last backward
            assert r["aligned"] == [(i, M - 1) for i in range(groups)]
        else:                # the others: all at once after the cooldown (grad_sync_func)
            assert r["aligned"] == [(i, "after the last backward") for i in range(groups)]
        # without align_grad_reduce every stage launches from the hooks of its last backward
        assert r["unaligned"] == [(i, M - 1) for i in range(groups)]
        assert r["same_params"]            # the timing changes, the numbers do not
        # AND of success and MAX of grad_norm; the MAX of num_zeros only when it is logged
        assert r["mp_all_reduces"] == (2, 3)
        # the last rank's clock says 3 + 1 minutes after the earliest start at iteration 1
        assert r["exit"] == (1, "duration")


# -- forward pre-hooks off for the first iteration ----------------------------------------------
def _pre_hooks_per_forward():
    """A forward_step_func that records, per training forward, whether the pre-hooks are on."""
    seen = []

    def step(data_iterator, model):
        if model.training:
            seen.append(bool(model._pre_hooks))
        return FORWARD_STEP(data_iterator, model)
    return step, seen


def test_forward_pre_hooks_are_off_until_the_first_successful_step():
    dist_opt = dict(lr=1e-3, weight_decay=0.0, use_distributed_optimizer=True)
    overlap = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                            overlap_param_gather=True)
    step, seen = _pre_hooks_per_forward()
    run, _ = _run(training(train_iters=3), OptimizerConfig(**dist_opt), overlap,
                  forward_step_func=step)
    assert seen == [False] * M + [True] * M + [True] * M
    plain, _ = _run(training(train_iters=3), OptimizerConfig(**dist_opt),
                    DistributedDataParallelConfig(use_distributed_optimizer=True))
    for a, b in zip(run.model[0].module.parameters(), plain.model[0].module.parameters()):
        assert torch.equal(a, b)           # the same weights as without the overlap
    # every step skipped (grad_norm_skip_threshold 0): no successful step, no pre-hooks
    step, seen = _pre_hooks_per_forward()
    _run(training(train_iters=2), OptimizerConfig(**dist_opt, grad_norm_skip_threshold=0.0),
         overlap, forward_step_func=step)
    assert seen == [False] * 2 * M


# -- the exit duration and the evaluation batch ------------------------------------------------
def _timed(minutes_per_forward: float):
    """(clock, forward_step_func) where every forward takes that many minutes of the clock."""
    now = [0.0]

    def step(data_iterator, model):
        now[0] += 60.0 * minutes_per_forward
        return FORWARD_STEP(data_iterator, model)
    return (lambda: now[0]), step, now


def test_exit_duration_counts_from_the_programs_start_not_from_train():
    clock, step, now = _timed(0.25)         # one iteration (4 forwards) is one minute

    def slow_load(model, optimizer, scheduler):
        now[0] += 120.0                     # loading took two minutes
        return None
    saves = []
    run, _ = _run(training(train_iters=8, exit_duration_in_mins=2.5), forward_step_func=step,
                  clock=clock, load_checkpoint_fn=slow_load,
                  save_checkpoint_fn=lambda s, *parts: saves.append(s.iteration))
    assert (run.state.iteration, run.exit_reason, saves) == (1, "duration", [1])


def test_evaluation_stops_at_the_time_limit_and_counts_what_it_ran():
    clock, step, _ = _timed(0.25)
    train = training(train_iters=8, eval_interval=1, eval_iters=3, exit_duration_in_mins=2.5)
    saves = []
    run, logs = _run(train, forward_step_func=step, clock=clock,
                     save_checkpoint_fn=lambda s, *parts: saves.append(s.iteration))
    # iteration 1 ends at minute 1; evaluation batch 1 at 2, batch 2 at 3 > 2.5: stop there
    assert run.state.consumed_valid_samples == 2 * 8
    assert not [r for r in logs if "validation" in r]
    assert (run.state.iteration, run.exit_reason, saves) == (1, "duration", [1])


def _eval_forwards():
    calls = []

    def step(data_iterator, model):
        calls.append(model.training)
        return FORWARD_STEP(data_iterator, model)
    return step, calls


def test_evaluation_batch_is_eval_global_batch_size():
    step, calls = _eval_forwards()
    run, logs = _run(training(train_iters=2, eval_interval=2, eval_iters=3,
                              eval_global_batch_size=4), forward_step_func=step)
    assert calls.count(False) == 3 * 2      # 4 samples = 2 micro-batches of 2, 3 times
    assert run.state.consumed_valid_samples == 3 * 4
    assert [r["iteration"] for r in logs if "validation" in r] == [2]
    # by default the configured global batch (8 = 4 micro-batches), not the running one
    step, calls = _eval_forwards()
    run, _ = _run(training(train_iters=1, eval_interval=1, eval_iters=1), forward_step_func=step)
    assert calls.count(True) == 4 and calls.count(False) == 4
    assert run.state.consumed_valid_samples == 8
    with pytest.raises(ValueError, match=r"eval_global_batch_size \(7\) must be divisible"):
        _run(training(train_iters=1, global_batch_size=7, decrease_batch_size_if_needed=True,
                      eval_interval=1, eval_iters=1))


# -- skipped iterations ------------------------------------------------------------------------
def test_a_skipped_iteration_counts_its_batch_once():
    # global batch 7 runs as 6 (decrease_batch_size_if_needed): 1 sample short per iteration
    run, _ = _run(training(train_iters=3, global_batch_size=7, decrease_batch_size_if_needed=True),
                  iterations_to_skip=(2,))
    assert run.state.consumed_train_samples == 3 * 6
    assert run.state.skipped_train_samples == 1 + 6 + 1     # training.py:3484 and :3628
    assert run.scheduler.num_steps == 2 * 6
