"""Rank functions for tests/test_main_loop_schedules.py: one 4-rank gloo world runs every case."""

from __future__ import annotations

import torch

from tinytron.main_loop import _workers as w
from tinytron.main_loop.schedules import ScheduleConfig, get_forward_backward_func
from tinytron.model.gpt import build_stage_models


def _reports(fb, models, grid, config, batches, vpp, forward_only):
    iters = [iter(batches) for _ in models]
    return fb(forward_step_func=w.forward_step_func, data_iterator=iters if vpp else iters[0],
              model=models, num_microbatches=len(batches), seq_length=config.seq_length,
              micro_batch_size=1, grid=grid, forward_only=forward_only, config=ScheduleConfig())


def forward_only_check(pp: int, vpp: int | None = None, m: int = 4) -> dict:
    """Evaluation through the schedule: no parameter or grad changes; losses = training's."""
    grid = w.grid_for(1, pp)
    config = w.tiny_config(num_layers=4, tie_embeddings=False)
    models = build_stage_models(config, grid, num_virtual_stages=vpp or 1)
    batches = w.make_microbatches(config, m, seed=7)
    fb = get_forward_backward_func(pp, vpp)
    before = [p.detach().clone() for c in models for p in c.parameters()]
    evaluated = _reports(fb, models, grid, config, batches, vpp, True)
    params_same = all(torch.equal(a, p) for a, p in
                      zip(before, (p for c in models for p in c.parameters())))
    no_grads = all(p.grad is None for c in models for p in c.parameters())
    trained = _reports(fb, models, grid, config, batches, vpp, False)
    same_losses = all(torch.equal(a["lm loss"], b["lm loss"]) for a, b in zip(evaluated, trained))
    return {"params_same": params_same, "no_grads": no_grads, "num": len(evaluated),
            "same_losses": same_losses and len(evaluated) == len(trained)}


def error_checks() -> list[str]:
    """Bad layouts on a pp=2 grid: each raises ValueError before any message is sent."""
    grid = w.grid_for(1, 2)
    config = w.tiny_config(num_layers=4, tie_embeddings=False)
    models = build_stage_models(config, grid, num_virtual_stages=2)
    batches = w.make_microbatches(config, 5)
    cases = [dict(m=3, g=None, iters=2, chunks=2), dict(m=4, g=1, iters=2, chunks=2),
             dict(m=4, g=5, iters=2, chunks=2), dict(m=5, g=4, iters=2, chunks=2),
             dict(m=4, g=None, iters=1, chunks=2), dict(m=4, g=None, iters=1, chunks=2, vpp=None)]
    messages = []
    for c in cases:
        vpp = c.get("vpp", 2)
        fb = get_forward_backward_func(2, vpp)
        cfg = ScheduleConfig(microbatch_group_size_per_vp_stage=c["g"])
        iters = [iter(batches) for _ in range(c["iters"])]
        try:
            fb(forward_step_func=w.forward_step_func, data_iterator=iters, model=models,
               num_microbatches=c["m"], seq_length=config.seq_length, micro_batch_size=1,
               grid=grid, config=cfg)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def world_checks() -> dict:
    """Every multi-rank case of the schedule tests, in one world of 4 ranks."""
    return {
        "pp4": w.run_case(pp=4, num_microbatches=8, num_steps=3, record=True),
        "pp4_m2": w.run_case(pp=4, num_microbatches=2, num_steps=1, record=True),
        "inflight": w.inflight_case(8, deallocate=True),
        "forward_only_pp4": forward_only_check(4),
        "forward_only_vpp": forward_only_check(2, vpp=2),
        "tp2pp2": w.run_case(tp=2, pp=2, num_microbatches=4, num_steps=2, tie=True),
        "dp2pp2": w.run_case(pp=2, num_microbatches=4, num_steps=3, ddp=True, record=True,
                             comm=True),
        "dp2pp2_sync": w.run_case(pp=2, num_microbatches=4, num_steps=2, ddp=True, record=True,
                                  comm=True, grad_sync=True),
        "dp2pp2_vpp_sync": w.run_case(pp=2, vpp=2, num_microbatches=4, num_steps=2, ddp=True,
                                      record=True, comm=True, grad_sync=True),
        "dp2pp2_vpp": w.run_case(pp=2, vpp=2, num_microbatches=4, num_steps=3, ddp=True,
                                 tie=True, record=True, comm=True),
        "megatron_example": w.run_case(pp=2, vpp=2, num_microbatches=5, num_steps=1, ddp=True,
                                       group_size=3, record=True),
        "vpp_all_warmup": w.run_case(pp=2, vpp=2, num_microbatches=2, num_steps=1, ddp=True,
                                     record=True),
        "dp4": w.run_case(pp=1, num_microbatches=4, num_steps=3, ddp=True, record=True,
                          comm=True),
        "errors": error_checks(),
    }
