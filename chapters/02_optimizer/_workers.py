"""Functions the chapter's multi-rank demos and tests run on spawned ranks (importable by name)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
from tinytron.optimizer.algorithms import AdamW, build_param_groups
from tinytron.optimizer.distributed import (DistributedOptimizer, data_parallel_step,
                                            merge_sharded_state_dicts)
from tinytron.optimizer.mixed_precision import DynamicGradScaler, MixedPrecisionOptimizer
from tinytron.parallel import ParallelGrid


def small_mlp(dtype=torch.float32, seed: int = 0) -> torch.nn.Module:
    """Linear(16,32)+bias, GELU, LayerNorm(32), Linear(32,8)+bias: weights, biases and a norm."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                            torch.nn.Linear(32, 8))
    return m.to(dtype)


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic regression batch for `step`."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)


def _scaler(use: bool):
    """A lively dynamic scaler (short window, hysteresis 1) or None."""
    return DynamicGradScaler(initial_scale=2.0 ** 12, growth_interval=2, hysteresis=1) if use else None


def _adamw(model, lr: float = 1e-2):
    """Megatron-style groups (no decay on biases / norms) under our AdamW."""
    return AdamW(build_param_groups(model.named_parameters(), lr=lr, weight_decay=0.1), lr=lr)


def _build_distopt(model, grid, clip: float, use_scaler: bool, bucket_size: int,
                   overlap_param_gather: bool = False):
    """DDP over chapter 05's buffers + the DistributedOptimizer on it."""
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                        overlap_grad_reduce=True, bucket_size=bucket_size,
                                        overlap_param_gather=overlap_param_gather)
    ddp = DistributedDataParallel(model, grid, cfg)
    return ddp, DistributedOptimizer(_adamw(model), ddp, clip_grad=clip,
                                     grad_scaler=_scaler(use_scaler))


def _ddp_step(ddp, opt, x, y, dtype, poison: bool):
    """One DP step (the page's loop) on this rank's half of the batch; `poison`: inf/NaN grads."""
    def loss_fn(model, batch):
        loss = F.mse_loss(model(batch[0].to(dtype)).float(), batch[1])
        return loss * float("inf") if poison else loss

    _, ok, grad_norm = data_parallel_step(ddp, opt, [(x, y)], loss_fn)
    return ok, grad_norm, None


def _ref_step(model, opt, x, y, dtype, poison: bool):
    """One step of the plain optimizer on the whole batch."""
    loss = F.mse_loss(model(x.to(dtype)).float(), y)
    if poison:
        loss = loss * float("inf")
    opt.scale_loss(loss).backward()
    out = opt.step()
    opt.zero_grad()
    return out


def _max_diff(a: dict, b: dict) -> float:
    """Largest |difference| between two layout-free optimizer state dicts (same names/keys)."""
    worst = 0.0
    if set(a["params"]) != set(b["params"]):
        return float("inf")  # a param missing on either side is a mismatch, not a skip
    for name, entry in a["params"].items():
        if set(entry) != set(b["params"][name]):
            return float("inf")
        for k, v in entry.items():
            w = b["params"][name][k]
            if torch.is_tensor(v):
                worst = max(worst, (v.float() - w.float()).abs().max().item())
            elif v != w:
                return float("inf")
    return worst


def distopt_parity(dtype_name: str, steps: int, clip: float, use_scaler: bool,
                   poison_steps=(), bucket_size: int = 300, reload_steps: int = 2,
                   overlap_param_gather: bool = False) -> dict:
    """DistributedOptimizer over DP=world vs the plain optimizer on the full batch, in one rank."""
    dtype = getattr(torch, dtype_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = ParallelGrid(dp=world)
    model = small_mlp(dtype)
    ref = copy.deepcopy(model)
    ddp, opt = _build_distopt(model, grid, clip, use_scaler, bucket_size, overlap_param_gather)
    ref_opt = MixedPrecisionOptimizer(_adamw(ref), clip_grad=clip, grad_scaler=_scaler(use_scaler))
    ok, ref_ok, norms, ref_norms = [], [], [], []
    for step in range(steps):
        x, y = batch(step, 4 * world)
        poison = step in poison_steps
        o = _ddp_step(ddp, opt, x.chunk(world)[rank], y.chunk(world)[rank], dtype,
                      poison and rank == 0)
        r = _ref_step(ref, ref_opt, x, y, dtype, poison)
        ok.append(o[0]), ref_ok.append(r[0]), norms.append(o[1]), ref_norms.append(r[1])
    if overlap_param_gather:   # the last gather would happen in the next forward's pre-hooks
        ddp.start_param_sync(force_sync=True)
    param_diff = max((p.float() - q.float()).abs().max().item()
                     for p, q in zip(model.parameters(), ref.parameters()))
    state_diff = _max_diff(opt.state_dict(), ref_opt.state_dict())
    parts = [None] * world
    dist.all_gather_object(parts, opt.sharded_state_dict())
    merged = merge_sharded_state_dicts(parts)
    state_diff = max(state_diff, _max_diff(merged, ref_opt.state_dict()))
    # every rank's model params must be exactly its gathered fp32 master cast to the model dtype
    # (a stale or missing all-gather leaves an old value, which a loose tolerance would hide)
    names = dict(model.named_parameters())
    params_equal_master = all(
        torch.equal(names[n], merged["params"][n]["fp32_param"].view(names[n].shape).to(dtype))
        for n in names)
    out = dict(max_param_diff=param_diff, max_state_diff=state_diff, ok=ok, ref_ok=ref_ok,
               params_equal_master=params_equal_master,
               norms=norms, ref_norms=ref_norms,
               scale=None if opt.grad_scaler is None else opt.grad_scaler.scale,
               ref_scale=None if ref_opt.grad_scaler is None else ref_opt.grad_scaler.scale)
    out["reload_param_diff"] = _reload_and_continue(ref, ref_opt, dtype, clip, use_scaler,
                                                    bucket_size, grid, steps, reload_steps)
    return out


def _reload_and_continue(ref, ref_opt, dtype, clip, use_scaler, bucket_size, grid, start,
                         steps) -> float:
    """Load the plain optimizer's state into a fresh DistributedOptimizer; train both on."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = small_mlp(dtype, seed=123)   # different init: everything must come from the state
    ddp, opt = _build_distopt(model, grid, clip, use_scaler, bucket_size)
    opt.load_state_dict(ref_opt.state_dict())
    for step in range(start, start + steps):
        x, y = batch(step, 4 * world)
        _ddp_step(ddp, opt, x.chunk(world)[rank], y.chunk(world)[rank], dtype, False)
        _ref_step(ref, ref_opt, x, y, dtype, False)
    return max((p.float() - q.float()).abs().max().item()
               for p, q in zip(model.parameters(), ref.parameters()))


def layer_wise_parity(steps: int, lr: float = 2e-2) -> dict:
    """Layer-wise distributed Muon(+AdamW) over DP=world vs plain Muon(+AdamW) on the full batch."""
    from tinytron.optimizer.layer_wise import LayerWiseDistributedOptimizer
    from tinytron.optimizer.muon import build_muon_adamw

    world, rank = dist.get_world_size(), dist.get_rank()
    grid = ParallelGrid(dp=world)
    model = small_mlp()
    ref = copy.deepcopy(model)

    def build(named):
        return build_muon_adamw(named, lr=lr, weight_decay=0.1, fp32_matmul_prec="highest")

    ddp = DistributedDataParallel(model, grid, DistributedDataParallelConfig())
    opt = LayerWiseDistributedOptimizer(build, model.named_parameters(), grid, clip_grad=1.0)
    ref_opt = MixedPrecisionOptimizer(build(list(ref.named_parameters())), clip_grad=1.0)
    for step in range(steps):
        x, y = batch(step, 4 * world)
        _ddp_step(ddp, opt, x.chunk(world)[rank], y.chunk(world)[rank], torch.float32, False)
        _ref_step(ref, ref_opt, x, y, torch.float32, False)
    return dict(owned=opt.names, all_names=[n for n, _ in model.named_parameters()],
                max_param_diff=max((p - q).abs().max().item()
                                   for p, q in zip(model.parameters(), ref.parameters())),
                max_state_diff=_max_diff(opt.state_dict(), ref_opt.state_dict()))
