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


def _overlap_run(overlap: bool, pp: int, vpp: int, m: int, steps: int, group_size, ddp: bool,
                 grad_sync: bool, deallocate: bool, forward_only: bool) -> dict:
    """`steps` iterations of the interleaved schedule, plain or overlapped, from seed 0."""
    from tinytron.buffers import finalize_model_grads
    from tinytron.main_loop.schedules import ScheduleRecorder

    grid = w.grid_for(1, pp)
    dp, dp_rank = grid.size("dp"), grid.rank("dp")
    config = w.tiny_config(num_layers=2 * pp, tie_embeddings=False)
    torch.manual_seed(0)
    models = build_stage_models(config, grid, num_virtual_stages=vpp)
    opt = w.make_optimizer([p for c in models for p in c.parameters()])
    models = w.wrap_ddp(models, grid) if ddp else models
    out = {"grads": [], "losses": [], "events": [], "orders": []}
    for k in range(steps):
        for c in models:
            c.zero_grad_buffer() if ddp else c.zero_grad(set_to_none=True)
        batches = w.make_microbatches(config, dp * m, seed=100 * k)[dp_rank * m:(dp_rank + 1) * m]
        rec = ScheduleRecorder()
        cfg = ScheduleConfig(finalize_model_grads_func=finalize_model_grads, recorder=rec,
                             no_sync_func=[c.no_sync for c in models] if ddp else None,
                             grad_sync_func=[c.start_grad_sync for c in models] if grad_sync
                             else None, microbatch_group_size_per_vp_stage=group_size,
                             deallocate_pipeline_outputs=deallocate, overlap_p2p_comm=overlap)
        fb = get_forward_backward_func(pp, vpp)
        reports = fb(forward_step_func=w.forward_step_func,
                     data_iterator=[iter(batches) for _ in models], model=models,
                     num_microbatches=m, seq_length=config.seq_length, micro_batch_size=1,
                     grid=grid, forward_only=forward_only, config=cfg)
        out["losses"].append([r["lm loss"].clone() for r in reports])
        out["events"].append(sorted((e.stage, e.chunk, e.microbatch, e.kind) for e in rec.events))
        out["orders"].append(rec.order())
        if not forward_only:
            out["grads"].append(w.full_grads(models, grid))
            w._step_with_grads(models, opt)
    return out


def overlap_p2p_case(pp: int = 2, vpp: int = 2, m: int = 4, steps: int = 2, group_size=None,
                     ddp: bool = False, grad_sync: bool = False, deallocate: bool = True,
                     forward_only: bool = False) -> dict:
    """overlap_p2p_comm vs the plain interleaved schedule: bitwise, and the same events."""
    args = (pp, vpp, m, steps, group_size, ddp, grad_sync, deallocate, forward_only)
    plain, over = _overlap_run(False, *args), _overlap_run(True, *args)
    same_grads = all(g.keys() == h.keys() and all(torch.equal(g[n], h[n]) for n in g)
                     for g, h in zip(plain["grads"], over["grads"]))
    same_losses = all(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
                      for a, b in zip(plain["losses"], over["losses"]))
    kinds = sorted({e[3] for ev in over["events"] for e in ev})
    unnamed = sum(1 for ev in over["events"] for e in ev if e[3] == "recv" and e[1] < 0)
    return dict(same_grads=same_grads and len(plain["grads"]) == len(over["grads"]),
                same_losses=same_losses, num_losses=len(over["losses"][0]),
                same_events=plain["events"] == over["events"],
                same_orders=plain["orders"] == over["orders"], kinds=kinds,
                unnamed_recvs=unnamed, num_events=len(over["events"][0]))


def overlap_world_checks() -> dict:
    """The overlapped interleaved schedule in one 4-rank world (dp2·pp2 and pp4)."""
    return {
        "dp2pp2": overlap_p2p_case(ddp=True, steps=3),
        "dp2pp2_sync_keep": overlap_p2p_case(ddp=True, grad_sync=True, deallocate=False),
        "example": overlap_p2p_case(m=5, group_size=3, ddp=True, steps=1),
        "all_warmup": overlap_p2p_case(m=2, ddp=True, steps=1),
        "forward_only": overlap_p2p_case(ddp=True, steps=1, forward_only=True),
        "pp4": overlap_p2p_case(pp=4, m=8, steps=2),
    }


def param_sync_case(pp: int, vpp: int | None, m: int, group_size: int | None = None,
                    overlap: bool = False, forward_only: bool = False) -> dict:
    """One schedule call with a recording param_sync_func per chunk.

    Each call is recorded as (chunk, forwards this rank had run when it came): the virtual
    micro-batch step it was called before. The forward step also notes whether the config
    still held the callbacks while it ran.
    """
    grid = w.grid_for(1, pp)
    chunks = vpp or 1
    config = w.tiny_config(num_layers=pp * chunks, tie_embeddings=False)
    torch.manual_seed(0)
    models = build_stage_models(config, grid, num_virtual_stages=chunks)
    batches = w.make_microbatches(config, m, seed=3)
    state = {"forwards": 0, "calls": [], "held": []}

    def recording(c):
        def start_param_sync(*args):
            state["calls"].append((c, state["forwards"], len(args)))
        return start_param_sync

    param_funcs = [recording(c) for c in range(chunks)]
    grad_funcs = [lambda: None for _ in range(chunks)]
    cfg = ScheduleConfig(microbatch_group_size_per_vp_stage=group_size, overlap_p2p_comm=overlap,
                         param_sync_func=param_funcs if vpp else param_funcs[0],
                         grad_sync_func=grad_funcs if vpp else None)

    def forward_step_func(data_iterator, model):
        state["held"].append(cfg.param_sync_func is not None or cfg.grad_sync_func is not None)
        state["forwards"] += 1
        return w.forward_step_func(data_iterator, model)

    iters = [iter(batches) for _ in models]
    get_forward_backward_func(pp, vpp)(
        forward_step_func=forward_step_func, data_iterator=iters if vpp else iters[0],
        model=models if vpp else models[0], num_microbatches=m, seq_length=config.seq_length,
        micro_batch_size=1, grid=grid, forward_only=forward_only, config=cfg)
    restored = (cfg.param_sync_func is (param_funcs if vpp else param_funcs[0])
                and cfg.grad_sync_func is (grad_funcs if vpp else None))
    return {"rank": grid.rank("pp"), "calls": state["calls"], "forwards": state["forwards"],
            "held_during_forwards": state["held"], "restored": restored}


PARAM_SYNC_CASES = {  # name: (pp, vpp, m, group_size, overlap, forward_only)
    "pp2_v4_m4": (2, 4, 4, None, False, False),
    "pp2_v4_m4_overlap": (2, 4, 4, None, True, False),
    "pp2_v3_m5_g3": (2, 3, 5, 3, False, False),
    "pp2_v3_m5_g3_overlap": (2, 3, 5, 3, True, False),
    "pp4_v3_m8": (4, 3, 8, None, True, False),
    "pp4_v3_m4_all_warmup": (4, 3, 4, None, True, False),
    "pp2_v3_m4_forward_only": (2, 3, 4, None, False, True),
    "pp2_v3_m4_forward_only_overlap": (2, 3, 4, None, True, True),
    "pp4_v3_m8_forward_only": (4, 3, 8, None, True, True),
    "1f1b_pp2": (2, None, 4, None, False, False),
    "1f1b_pp4": (4, None, 4, None, False, False),
    "no_pipelining": (1, None, 3, None, False, False),
}


def loop_callbacks_case(pp: int, vpp: int | None, m: int = 4) -> dict:
    """The loop's own callbacks through the real schedule, with and without param_sync_func.

    build_schedule_config over chapter 05's DDP (distributed optimizer, overlap_param_gather,
    align_param_gather): which callables it hands the schedule, and one training call's
    gradients with its param_sync_func and with param_sync_func=None.
    """
    from tinytron.buffers.distributed_data_parallel import DistributedDataParallelConfig
    from tinytron.main_loop.loop import build_schedule_config, wrap_with_ddp

    grid, chunks = w.grid_for(1, pp), vpp or 1
    config = w.tiny_config(num_layers=pp * chunks, tie_embeddings=False)
    ddp_config = DistributedDataParallelConfig(
        calculate_per_token_loss=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
        overlap_param_gather=True, align_param_gather=True, bucket_size=20_000)
    dp, dp_rank = grid.size("dp"), grid.rank("dp")
    batches = w.make_microbatches(config, dp * m, seed=5)[dp_rank * m:(dp_rank + 1) * m]
    out, grads = {}, []
    for handed in (True, False):
        torch.manual_seed(0)
        models = wrap_with_ddp(build_stage_models(config, grid, num_virtual_stages=chunks), grid,
                               ddp_config)
        cfg = build_schedule_config(models, None, grid, calculate_per_token_loss=True,
                                    **({} if handed else {"param_sync_func": None}))
        if handed:
            expected = [c.start_param_sync for c in models]
            out["handed"] = cfg.param_sync_func == (expected if vpp else expected[0])
        iters = [iter(batches) for _ in models]
        get_forward_backward_func(pp, vpp)(
            forward_step_func=w.forward_step_func, data_iterator=iters if vpp else iters[0],
            model=models if vpp else models[0], num_microbatches=m,
            seq_length=config.seq_length, micro_batch_size=1, grid=grid, config=cfg)
        grads.append(w.full_grads(models, grid))
    out["same_grads"] = grads[0].keys() == grads[1].keys() and all(
        torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    return out


def _record_gathers(models, log: list, inside: dict) -> None:
    """Wrap every bucket group's start_param_sync: (iteration, chunk, async, from the schedule)."""
    for c, chunk in enumerate(models):
        for group in chunk.bucket_groups:
            def recorded(force_sync=False, _orig=group.start_param_sync, _c=c):
                log.append((inside["iteration"], _c, not force_sync, inside["schedule"]))
                return _orig(force_sync=force_sync)
            group.start_param_sync = recorded


def _schedule_dispatch(funcs: list, inside: dict) -> list:
    """Each chunk's param_sync_func, marked as called by the schedule while it runs."""
    def marked(f):
        def call(*args):
            inside["schedule"] = True
            try:
                return f(*args)
            finally:
                inside["schedule"] = False
        return call
    return [marked(f) for f in funcs]


def _distopt_run(grid, config, batches, pp, vpp, m, distributed: bool) -> dict:
    """Three training steps over virtual stages with the loop's own optimizer provider."""
    from tinytron.buffers.distributed_data_parallel import DistributedDataParallelConfig
    from tinytron.main_loop.loop import (build_schedule_config, megatron_optimizer_provider,
                                         wrap_with_ddp)
    from tinytron.main_loop.run import _first_iteration_without_pre_hooks, _restore_pre_hooks
    from tinytron.optimizer import OptimizerConfig

    torch.manual_seed(0)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=distributed,
        overlap_param_gather=distributed, align_param_gather=distributed, bucket_size=20_000)
    models = wrap_with_ddp(build_stage_models(config, grid, num_virtual_stages=vpp), grid,
                           ddp_config)
    opt = megatron_optimizer_provider(OptimizerConfig(
        lr=1e-2, clip_grad=0.0, use_distributed_optimizer=distributed))(models, grid)
    cfg = build_schedule_config(models, opt, grid)
    log, inside = [], {"iteration": 0, "schedule": False}
    if distributed:
        _record_gathers(models, log, inside)
        cfg.param_sync_func = _schedule_dispatch(cfg.param_sync_func, inside)
    for it in range(3):
        inside["iteration"] = it
        for c in models:
            c.zero_grad_buffer()
        held = _first_iteration_without_pre_hooks(models, cfg) if it == 0 else False
        get_forward_backward_func(pp, vpp)(
            forward_step_func=w.forward_step_func, data_iterator=[iter(batches) for _ in models],
            model=models, num_microbatches=m, seq_length=config.seq_length, micro_batch_size=1,
            grid=grid, config=cfg)
        opt.step()
        if held:
            _restore_pre_hooks(models, cfg, held)
    for c in models:  # the last step's gather (the next forward would have waited for it)
        if distributed:
            c.start_param_sync(force_sync=True)
    params = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(models)
              for n, p in c.module.named_parameters()}
    return {"params": params, "gathers": log, "type": type(opt).__name__,
            "groups": [len(c.bucket_groups) for c in models]}


def loop_distopt_case(pp: int = 2, vpp: int = 3, m: int = 4) -> dict:
    """The DistributedOptimizer over every chunk, its gathers dispatched by the schedule.

    Three steps with chapter 02's DistributedOptimizer over the v DDP chunks (overlapped,
    aligned gathers) against the plain optimizer over the same chunks, on the same batches.
    """
    grid = w.grid_for(1, pp)
    config = w.tiny_config(num_layers=pp * vpp, tie_embeddings=False)
    dp, dp_rank = grid.size("dp"), grid.rank("dp")
    batches = w.make_microbatches(config, dp * m, seed=11)[dp_rank * m:(dp_rank + 1) * m]
    sharded = _distopt_run(grid, config, batches, pp, vpp, m, True)
    plain = _distopt_run(grid, config, batches, pp, vpp, m, False)
    return {"type": sharded["type"], "plain_type": plain["type"], "rank": grid.rank("pp"),
            "gathers": sharded["gathers"], "groups": sharded["groups"],
            "same_params": sharded["params"].keys() == plain["params"].keys() and all(
                torch.equal(sharded["params"][n], plain["params"][n]) for n in plain["params"]),
            "max_diff": max(float((sharded["params"][n] - plain["params"][n]).abs().max())
                            for n in plain["params"])}


def param_sync_world_checks() -> dict:
    """Every case of tests/test_main_loop_param_sync.py in one 4-rank world."""
    out = {name: param_sync_case(*args) for name, args in PARAM_SYNC_CASES.items()}
    out["loop_interleaved"] = loop_callbacks_case(2, 3)
    out["loop_1f1b"] = loop_callbacks_case(2, None)
    out["loop_distopt"] = loop_distopt_case()
    return out
