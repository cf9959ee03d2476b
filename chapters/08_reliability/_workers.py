"""Rank functions for the reliability chapter's demos and tests (not a page)."""

from __future__ import annotations

import time

import torch.distributed as dist


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
        dist.all_reduce(grad)            # the collective a healthy rank waits in
        time.sleep(0.05)
        monitor.on_training_step_end()
        done.append(it)
    monitor.shutdown()
    return done
