"""Rank functions for the naive-DDP page's demo and its test (importable by name; not a page)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from tinytron.buffers._workers import TinyNet, lm_loss, make_batches


def naive_vs_ddp(steps: int = 2, num_micro: int = 2) -> dict:
    """Per-parameter all-reduce vs the bucketed DDP on the same data: grads and collective counts."""
    from tinytron.buffers.distributed_data_parallel import (DistributedDataParallel,
                                                            DistributedDataParallelConfig)
    from tinytron.buffers.naive_ddp import NaiveDataParallel
    from tinytron.parallel import ParallelGrid

    grid = ParallelGrid()
    world, rank = grid.size("dp"), grid.rank("dp")
    torch.manual_seed(0)
    net, ref = TinyNet(), TinyNet()
    ref.load_state_dict(net.state_dict())
    naive = NaiveDataParallel(ref)
    ddp = DistributedDataParallel(net, grid, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=4000))
    batches = make_batches(7, steps, world, num_micro, micro_bs=2)
    worst = 0.0
    for step in range(steps):
        ddp.zero_grad_buffer()
        ref.zero_grad()
        naive.num_collectives = 0
        for m in range(num_micro):
            last = m == num_micro - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                (lm_loss(ddp, batches[step, rank, m]) / num_micro).backward()
            with contextlib.nullcontext() if last else naive.no_sync():
                (lm_loss(naive, batches[step, rank, m]) / num_micro).backward()
        ddp.finish_grad_sync()
        worst = max(worst, max(float((p.main_grad - q.grad).abs().max())
                               for p, q in zip(net.parameters(), ref.parameters())))
    same_on_all = torch.cat([q.grad.reshape(-1) for q in ref.parameters()])
    gathered = [torch.empty_like(same_on_all) for _ in range(world)]
    dist.all_gather(gathered, same_on_all)
    return {"rank": rank, "max_abs_diff": worst, "naive_collectives": naive.num_collectives,
            "ddp_collectives": sum(len(g.buckets) for g in ddp.bucket_groups),
            "num_params": len(list(net.parameters())),
            "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered)}
