"""The learning rate of the first resumed step, against megatron-core 0.16.1's
OptimizerParamScheduler driven in Megatron-LM's restore order (checkpointing.py:1919-1952):
model, then optimizer (its saved param groups' lr and wd), then the scheduler, whose
load_state_dict ends in step(num_steps) and writes lr and wd into every group. Under
no_load_optim the scheduler is not loaded and restarts at step 0. Both formats, one process."""

from __future__ import annotations

import importlib.util

import pytest

from tests.checkpoint_workers import tiny_training
from tinytron.checkpoint import load_checkpoint, save_checkpoint
from tinytron.checkpoint.resume import TrainStateFallback
from tinytron.optimizer.scheduler import OptimizerParamScheduler

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (pip install tinytron[oracles])")

BATCH, STEPS = 2, 6
SAVED = dict(init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=4, lr_decay_steps=40,
             lr_decay_style="cosine", start_wd=0.01, end_wd=0.1, wd_incr_steps=40,
             wd_incr_style="linear")
CASES = {   # the resumed run's scheduler arguments and checkpoint options
    "same": (dict(SAVED, use_checkpoint_opt_param_scheduler=False), {}),
    "override": (dict(SAVED, max_lr=5e-2, end_wd=0.2, override_opt_param_scheduler=True,
                      use_checkpoint_opt_param_scheduler=False), {}),
    "use_checkpoint": (dict(SAVED, max_lr=5e-2, use_checkpoint_opt_param_scheduler=True), {}),
    "no_load_optim": (dict(SAVED, use_checkpoint_opt_param_scheduler=False),
                      {"no_load_optim": True}),
}


class _Groups:
    def __init__(self, groups):
        self.param_groups = groups


def _megatron_lr(resumed: dict, options: dict, saved_groups: list[dict]) -> tuple[float, float]:
    """(lr, wd) of megatron-core's first resumed step, in Megatron-LM's restore order."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as MCore

    first = _Groups([{"lr": 0.0, "weight_decay": 0.0}])
    before = MCore(first, **dict(SAVED, use_checkpoint_opt_param_scheduler=False))
    for _ in range(STEPS):
        before.step(BATCH)
    groups = _Groups([{"lr": 1.0, "weight_decay": 1.0}])   # a fresh optimizer's constructor lr
    after = MCore(groups, **resumed)                        # its constructor runs step(0)
    if not options.get("no_load_optim"):
        groups.param_groups[0].update(lr=saved_groups[0]["lr"],           # optimizer.load_state_dict
                                      weight_decay=saved_groups[0]["weight_decay"])
        after.load_state_dict(before.state_dict())         # then the scheduler (:1948-1952)
    return groups.param_groups[0]["lr"], groups.param_groups[0]["weight_decay"]


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_first_resumed_lr_is_megatron_cores(tmp_path, fmt, case):
    resumed, options = CASES[case]
    _, model, opt, step = tiny_training()
    sched = OptimizerParamScheduler(opt, **dict(SAVED, use_checkpoint_opt_param_scheduler=False))
    for i in range(STEPS):
        step(i)
        sched.step(BATCH)
    saved_groups = [dict(lr=g["lr"], weight_decay=g["weight_decay"]) for g in opt.param_groups]
    state = TrainStateFallback(iteration=STEPS, consumed_train_samples=BATCH * STEPS)
    save_checkpoint(tmp_path, state, model, opt, sched, ckpt_format=fmt)

    _, model2, opt2, _ = tiny_training(seed=1)
    sched2 = OptimizerParamScheduler(opt2, **resumed)
    got = load_checkpoint(tmp_path, model2, opt2, sched2, ckpt_format=fmt, **options)
    assert got.iteration == STEPS
    lr, wd = _megatron_lr(resumed, options, saved_groups)
    assert sched2.num_steps == (0 if options.get("no_load_optim") else BATCH * STEPS)
    for g in opt2.param_groups:   # what the optimizer's next step uses
        wd_mult = g.get("wd_mult", 1.0)
        assert g["lr"] == pytest.approx(lr, rel=1e-12, abs=1e-15), (case, g["lr"], lr)
        assert g["weight_decay"] == pytest.approx(wd * wd_mult, rel=1e-12, abs=1e-15)
    if case == "override":   # the reproduction of the bug: a new max lr is used at once
        assert lr > 2 * saved_groups[0]["lr"]


def test_a_refused_scheduler_changes_nothing(tmp_path):
    """A changed max_lr without override or use_checkpoint is refused before anything is applied."""
    import torch

    _, model, opt, step = tiny_training()
    sched = OptimizerParamScheduler(opt, **dict(SAVED, use_checkpoint_opt_param_scheduler=False))
    step(0)
    sched.step(BATCH)
    save_checkpoint(tmp_path, TrainStateFallback(iteration=1), model, opt, sched)
    _, model2, opt2, _ = tiny_training(seed=1)
    sched2 = OptimizerParamScheduler(opt2, **dict(SAVED, max_lr=5e-2,
                                                  use_checkpoint_opt_param_scheduler=False))
    before = [p.detach().clone() for p in model2.parameters()]
    lr_before = opt2.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="scheduler state does not fit.*max_lr"):
        load_checkpoint(tmp_path, model2, opt2, sched2)
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))
    assert opt2.param_groups[0]["lr"] == lr_before and sched2.num_steps == 0
