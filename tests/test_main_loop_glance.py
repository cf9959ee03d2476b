"""Chapter 01's loop at a glance equals the production train_step: same losses, same weights."""

from __future__ import annotations

import pytest
import torch

from tests import main_loop_workers as workers
from tinytron.buffers import DistributedDataParallelConfig
from tinytron.main_loop._loop_workers import synthetic_iterators
from tinytron.main_loop.loop import (TrainState, build_schedule_config,
                                     megatron_optimizer_provider, megatron_scheduler_provider,
                                     train_at_a_glance, train_step, wrap_with_ddp)
from tinytron.main_loop.schedules import get_forward_backward_func
from tinytron.model import build_stage_models
from tinytron.optimizer import OptimizerConfig, SchedulerConfig
from tinytron.parallel import ParallelGrid

CFG, MBS, FORWARD_STEP = workers.CFG, workers.MBS, workers.FORWARD_STEP
ITERS, M = 4, 4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _parts(opt_config, ddp_config):
    """A fresh DDP-wrapped tiny GPT, chapter 02's optimizer and scheduler, the data iterator."""
    grid = ParallelGrid.single()
    model = wrap_with_ddp(build_stage_models(CFG, grid), grid, ddp_config)
    opt = megatron_optimizer_provider(opt_config)(model, grid)
    sched = megatron_scheduler_provider(SchedulerConfig(lr_decay_style="cosine",
                                                        lr_warmup_iters=1), opt_config)(
        opt, train_iters=ITERS, global_batch_size=M * MBS)
    data, _ = synthetic_iterators(CFG, grid, TrainState(), micro_batch_size=MBS)
    return grid, model, opt, sched, data


@pytest.mark.parametrize("opt_config, ddp_config", [
    (OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5), DistributedDataParallelConfig()),
    (OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5, use_distributed_optimizer=True),
     DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)),
], ids=["adam", "distributed_optimizer_overlap"])
def test_the_loop_at_a_glance_is_train_step_bit_for_bit(opt_config, ddp_config):
    grid, model, opt, sched, data = _parts(opt_config, ddp_config)
    lines = []
    glance = train_at_a_glance(FORWARD_STEP, data, model[0], opt, sched, train_iters=ITERS,
                               num_microbatches=M, micro_batch_size=MBS, grid=grid,
                               log=lines.append)
    grid, model2, opt2, sched2, data2 = _parts(opt_config, ddp_config)
    fresh = list(model2[0].parameters())
    assert not all(torch.equal(a, b) for a, b in zip(model[0].parameters(), fresh))  # it trained
    config = build_schedule_config(model2, opt2, grid)
    steps = []
    for _ in range(ITERS):
        result = train_step(FORWARD_STEP, data2, model2, opt2, sched2, get_forward_backward_func(1),
                            num_microbatches=M, micro_batch_size=MBS, seq_length=CFG.seq_length,
                            grid=grid, config=config)
        assert result.skipped_iter == 0
        steps.append(float(result.loss_dict["lm loss"]))
    assert glance == steps                                        # bitwise, every iteration
    assert steps[-1] < steps[0]
    for a, b in zip(model[0].module.parameters(), model2[0].module.parameters()):
        assert torch.equal(a, b)
    assert sched.num_steps == sched2.num_steps == ITERS * M * MBS
    assert len(lines) == ITERS and lines[0].startswith("iteration   1 | lm loss ")
