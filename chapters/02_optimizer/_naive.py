"""Rank functions: ZeRO-1 by whole parameters against the DistributedOptimizer (not a page)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
from tinytron.optimizer._workers import batch, small_mlp
from tinytron.optimizer.algorithms import AdamW
from tinytron.optimizer.distributed import DistributedOptimizer, data_parallel_step
from tinytron.optimizer.zero1 import NaiveZeRO1
from tinytron.parallel import ParallelGrid


def naive_zero1_vs_distopt(steps: int = 5, lr: float = 1e-2) -> dict:
    """Whole-parameter ZeRO-1 vs the bucket-range DistributedOptimizer, fp32, same data."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = small_mlp(torch.float32)
    naive_model = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, ParallelGrid(dp=world), DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, bucket_size=300))
    real = DistributedOptimizer(AdamW(model.parameters(), lr=lr, weight_decay=0.1), ddp,
                                clip_grad=0.0)
    naive = NaiveZeRO1(naive_model.parameters(),
                       lambda ps: AdamW(ps, lr=lr, weight_decay=0.1))
    for step in range(steps):
        x, y = batch(step, 4 * world)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        data_parallel_step(ddp, real, [(x, y)], lambda m, b: F.mse_loss(m(b[0]), b[1]))
        F.mse_loss(naive_model(x), y).backward()
        naive.step()
        naive.zero_grad()
    diff = max(float((p.detach() - q.detach()).abs().max())
               for p, q in zip(model.parameters(), naive_model.parameters()))
    naive_state = sum(p.numel() for g in (naive.optimizer.param_groups if naive.optimizer else [])
                      for p in g["params"])
    real_state = sum(m.numel() for _, m in real.pairs)
    real_range = sum(b.shard_size for buf in ddp.buffers for b in buf.buckets)
    return {"rank": rank, "max_param_diff": diff, "naive_owned": naive_state,
            "real_owned": real_state, "real_range": real_range, "total": sum(p.numel() for p in model.parameters())}
