"""Rank functions for the reliability chapter's demos and tests (not a page)."""

from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist

from tinytron.reliability.rerun_diagnoses import RerunStateMachine
from tinytron.reliability.rerun_state_machine import RerunDataIterator


# -- the rerun page's demo: a miniature train loop driven by the machine ------------------
def _demo_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1))


def _demo_batches():
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _demo_run(rsm, model, opt, data, num_iters, corrupt, ckpt=None, log=None):
    """A miniature train loop: 2 micro-batches per step; returns (exit code, checkpoint)."""
    for _ in range(num_iters):
        while rsm.should_run_forward_backward(data):
            opt.zero_grad()
            for _mb in range(2):
                x, y = next(data)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss = corrupt(loss, rsm)
                rsm.validate_result(loss, torch.isnan, "loss is NaN", fatal=True)
                if log is not None:
                    log.append((rsm.current_iteration, rsm.state.name, loss.item()))
                loss.backward()
        save, leave, code = rsm.should_checkpoint_and_exit()
        if save:
            ckpt = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                    "rsm": rsm.state_dict(), "iteration": rsm.current_iteration - 1}
        if leave:
            return code, ckpt
        opt.step()
    return 0, ckpt


def demo_launch(node, tracker, corrupt, ckpt=None, num_iters=4, mode="validate_results"):
    """One job launch on `node`: fresh, or relaunched from `ckpt`."""
    model = _demo_model()
    rsm = RerunStateMachine(mode, tracker_path=tracker, identity_func=lambda: (node, -1))
    start = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        rsm.load_state_dict(ckpt["rsm"])
        torch.set_rng_state(ckpt["rng"])
        start = rsm.current_iteration = ckpt["iteration"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = RerunDataIterator(itertools.islice(_demo_batches(), 2 * start, None))
    log: list = []
    code, new_ckpt = _demo_run(rsm, model, opt, data, num_iters - start, corrupt, None, log)
    if new_ckpt is not None:
        new_ckpt["rng"] = torch.get_rng_state()
    return code, new_ckpt, log, rsm


# -- the timers page -----------------------------------------------------------------------
def straggler_timers(num_iters: int, forward_sleep: dict) -> dict:
    """Run `num_iters` fake iterations with per-rank forward sleeps; report the timers."""
    from tinytron.reliability.timers import Timers

    rank = dist.get_rank()
    timers = Timers(log_level=2)
    names = ["interval-time", "forward-backward", "forward-compute", "backward-compute",
             "embedding-grads-all-reduce", "optimizer"]
    for _ in range(num_iters):
        timers("interval-time").start(barrier=True)
        timers("forward-backward").start()
        timers("forward-compute").start()
        time.sleep(forward_sleep[rank])
        timers("forward-compute").stop()
        timers("backward-compute").start()
        time.sleep(0.02)
        timers("backward-compute").stop()
        if rank == 1:  # like a last pipeline stage: only it holds the tied embedding copy
            timers("embedding-grads-all-reduce").start()
            time.sleep(0.005)
            timers("embedding-grads-all-reduce").stop()
        timers("forward-backward").stop()
        timers("optimizer").start(barrier=True)
        time.sleep(0.005)
        timers("optimizer").stop()
        timers("interval-time").stop()
    table = timers.all_ranks_seconds(names, reset=False) * 1000.0 / num_iters
    min_max = timers.get_min_max(names, normalizer=num_iters, reset=False)
    stragglers = timers.stragglers(names, normalizer=num_iters, reset=False)
    log = timers.log_string(names, normalizer=num_iters, reset=True)
    return {"names": names, "table": table, "min_max": min_max, "stragglers": stragglers,
            "log": log}


def hang_job(num_iters: int, faults: list, ft_kwargs: dict) -> list:
    """A tiny data-parallel loop under a RankMonitor; `faults` may make a rank hang."""
    import torch

    from tinytron.reliability.fault_injection import FaultInjector
    from tinytron.reliability.fault_tolerance import FaultToleranceConfig, RankMonitor

    rank, world = dist.get_rank(), dist.get_world_size()
    monitor = RankMonitor(FaultToleranceConfig(**ft_kwargs), rank, world).start()
    injector = FaultInjector(faults, rank=rank)
    done = []
    for it in range(1, num_iters + 1):
        monitor.on_training_step_start(it)
        injector.at_step_start(it)
        grad = torch.full((4,), float(rank))
        try:
            dist.all_reduce(grad)        # the collective a healthy rank waits in
        except RuntimeError:             # the hung rank's process ended first: the verdict
            monitor.wait_for_verdict()   # ends this one too, with the hang code
            raise
        time.sleep(0.05)
        monitor.on_training_step_end()
        done.append(it)
    monitor.shutdown()
    return done
