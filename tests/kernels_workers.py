"""Rank functions for the appendix C multi-rank tests: all checks of a world in one launch."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tinytron.kernels._workers import vocab_parallel_parity
from tinytron.parallel import ParallelGrid


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def distopt_fused_vs_foreach(steps: int = 4) -> dict:
    """DP = world, bf16 params: DistributedOptimizer with the fused AdamW vs with _foreach_."""
    from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
    from tinytron.optimizer import OptimizerConfig, get_megatron_optimizer
    from tinytron.optimizer._workers import batch, small_mlp

    world, rank = dist.get_world_size(), dist.get_rank()
    grid = ParallelGrid(dp=world)
    base = small_mlp(torch.bfloat16)
    runs = {}
    for kernels in ("triton", "torch"):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, grid, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, bucket_size=300,
            overlap_grad_reduce=True))
        opt = get_megatron_optimizer(OptimizerConfig(
            lr=1e-2, bf16=True, clip_grad=0.5, use_distributed_optimizer=True, kernels=kernels),
            model, grid, ddp=ddp)
        for step in range(steps):
            x, y = batch(step, 4 * world)
            ddp.zero_grad_buffer()
            F.mse_loss(ddp(x.chunk(world)[rank].bfloat16()).float(), y.chunk(world)[rank]).backward()
            ddp.finish_grad_sync()
            opt.step()
        runs[kernels] = (model, opt)
    (model_f, opt_f), (model_t, opt_t) = runs["triton"], runs["torch"]
    sd_f, sd_t = opt_f.state_dict(), opt_t.state_dict()
    state_gap = max(_relative_gap(sd_f["params"][n][k], v) for n, e in sd_t["params"].items()
                    for k, v in e.items() if torch.is_tensor(v))
    param_gap = max(_relative_gap(p, q) for p, q in zip(model_f.parameters(), model_t.parameters()))
    return {"fused": opt_f.fused_adamw is not None, "state_gap": state_gap, "param_gap": param_gap,
            "steps_equal": all(sd_f["params"][n]["step"] == e["step"]
                               for n, e in sd_t["params"].items())}


def model_tp_triton_vs_single_torch(seq_length: int = 32) -> dict:
    """TP = world with SP, kernels='triton': loss and grads vs the one-process torch model."""
    from tinytron.model import GPTModel, tiny_config
    from tinytron.model._workers import _max_grad_gap, packed_batch, reference

    config = tiny_config(seq_length=seq_length, sequence_parallel=True)
    tokens, labels, _, _ = packed_batch(config)
    _, ref_loss, ref_grads = reference(config, tokens, labels)
    grid = ParallelGrid(tp=dist.get_world_size())
    model = GPTModel(config.replace(kernels="triton"), grid)
    loss = model(tokens, labels=labels)
    loss.sum().backward()
    return {"loss_gap": float((loss.detach() - ref_loss).abs().max()),
            "grad_gap": _max_grad_gap([model], grid, ref_grads, True)}


def world_of_2() -> dict:
    """Every two-rank check of appendix C, in one world."""
    return {"ce_fp32": vocab_parallel_parity("float32"),
            "ce_bf16": vocab_parallel_parity("bfloat16", seed=1),
            "distopt": distopt_fused_vs_foreach(),
            "model_tp": model_tp_triton_vs_single_torch()}
