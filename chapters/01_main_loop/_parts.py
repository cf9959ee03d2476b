"""The parts chapter 01's loop is handed: an adapter for torch.optim, and builders of the book's parts.

`pretrain` takes builders (providers) so that the loop itself imports no optimizer, DDP or
scheduler; these are the ones that build chapter 02's and 05's parts, and the adapter that lets
a plain `torch.optim` optimizer stand in (the loop page's demo, the benchmark).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import signal

import torch
import torch.distributed as dist

from tinytron.main_loop.schedules import ScheduleConfig
from tinytron.main_loop.training_log import LogState, format_log_line, training_log
from tinytron.parallel import ParallelGrid

__all__ = ["TorchOptimizer", "ExitSignal", "any_rank", "eval_batch", "wrap_with_ddp", "build_schedule_config",
           "megatron_optimizer_provider", "megatron_scheduler_provider", "log_step", "hooked",
           "no_op", "print_on_last_rank"]


class TorchOptimizer:
    """A torch.optim optimizer with Megatron's step contract: clip, step, (True, norm, None)."""

    def __init__(self, optimizer: torch.optim.Optimizer, clip_grad: float = 1.0):
        self.optimizer, self.clip_grad = optimizer, clip_grad
        self.params = [p for g in optimizer.param_groups for p in g["params"]]

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's groups."""
        return self.optimizer.param_groups

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """No loss scaling."""
        return loss

    def zero_grad(self) -> None:
        """Drop every .grad."""
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        """Clip by the global L2 norm (0 = no clip), step; never skips."""
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        self.optimizer.step()
        return True, float(norm), None


def wrap_with_ddp(model: list, grid: ParallelGrid, ddp_config) -> list:
    """Chapter 05's DDP around each chunk; only the first chunk is bucketed."""
    from tinytron.buffers import DistributedDataParallel  # chapter 05
    return [DistributedDataParallel(c, grid, ddp_config, disable_bucketing=i > 0)
            for i, c in enumerate(model)]


def build_schedule_config(model: list, optimizer, grid: ParallelGrid, *,
                          calculate_per_token_loss: bool = False, **overrides) -> ScheduleConfig:
    """ScheduleConfig with the loop's callbacks, set as megatron/training/training.py:3227-3245.

    `no_sync_func` only with `overlap_grad_reduce` (without it no hook launches a collective, so
    there is nothing to hold back); `grad_sync_func` (each chunk's `start_grad_sync`) when
    `align_grad_reduce` is on as well; `param_sync_func` (each chunk's `start_param_sync`) with
    `overlap_param_gather` and `align_param_gather`. One chunk gets the bare callable, several a
    list, as Megatron does.
    """
    from tinytron.buffers import finalize_model_grads  # chapter 05
    ddp = [c for c in model if hasattr(c, "no_sync")]
    ddp_config = getattr(ddp[0], "ddp_config", None) if ddp else None
    one = (lambda fs: fs[0] if len(fs) == 1 else fs)  # noqa: E731 - Megatron's len(model) == 1
    scaler = getattr(optimizer, "grad_scaler", None)
    kw = dict(calculate_per_token_loss=calculate_per_token_loss,
              finalize_model_grads_func=finalize_model_grads if ddp else None,
              grad_scale_func=optimizer.scale_loss if scaler is not None else None)
    if ddp_config is not None and ddp_config.overlap_grad_reduce:
        kw["no_sync_func"] = one([c.no_sync for c in ddp])
        if getattr(ddp_config, "align_grad_reduce", True):
            kw["grad_sync_func"] = one([c.start_grad_sync for c in ddp])
    if (ddp_config is not None and ddp_config.overlap_param_gather
            and ddp_config.align_param_gather):
        kw["param_sync_func"] = one([c.start_param_sync for c in ddp])
    kw.update(overrides)
    return ScheduleConfig(**kw)


def megatron_optimizer_provider(opt_config) -> Callable:
    """(model, grid) -> chapter 02's optimizer over the model chunks (DDP-wrapped or not)."""
    from tinytron.optimizer import get_megatron_optimizer  # chapter 02

    def build(model: list, grid: ParallelGrid):
        modules = [c.module if hasattr(c, "module") else c for c in model]
        if len(model) == 1:
            ddp = model[0] if hasattr(model[0], "module") else None
            return get_megatron_optimizer(opt_config, modules[0], grid, ddp=ddp)
        # several chunks (virtual stages): one optimizer over all, named "<chunk>.<param>"; the
        # distributed one shards every chunk's buffers (Megatron's get_megatron_optimizer over
        # the model list, training.py:1979; distrib_optimizer.py:685)
        ddp = list(model) if all(hasattr(c, "module") for c in model) else None
        return get_megatron_optimizer(opt_config, torch.nn.ModuleList(modules), grid, ddp=ddp)
    return build


def megatron_scheduler_provider(sched_config, opt_config) -> Callable:
    """(optimizer, train_iters, global_batch_size) -> chapter 02's scheduler (in samples)."""
    from tinytron.optimizer import get_optimizer_param_scheduler  # chapter 02
    return partial(get_optimizer_param_scheduler, sched_config, opt_config=opt_config)


# -- plumbing of train(): hooks and the log record --------------------------------------------
def hooked(step_hooks, state, step):
    """step(), bracketed by step_hooks.on_step_start/on_step_end(state) when given."""
    if step_hooks is not None:
        step_hooks.on_step_start(state)
    result = step()
    if step_hooks is not None:
        step_hooks.on_step_end(state)
    return result


def no_op(*args, **kwargs) -> None:
    """Default hook."""


def print_on_last_rank(record: dict) -> None:
    """Print the formatted line on the last global rank (Megatron's print_rank_last)."""
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(format_log_line(record), flush=True)


def log_step(result, log_state: LogState, state, optimizer, *,
              training, train_iters: int, batch_size: int, seq_length: int, flops: int,
              peak_flops, log_fn) -> None:
    """Feed one iteration to training_log; hand a record to log_fn when it prints."""
    scaler = getattr(optimizer, "grad_scaler", None)
    groups = [g for g in optimizer.param_groups if not g.get("is_decoupled_lr")]
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    record = training_log(
        result.loss_dict, log_state, iteration=state.iteration, train_iters=train_iters,
        skipped_iter=result.skipped_iter, learning_rate=(groups or optimizer.param_groups)[0]["lr"],
        loss_scale=1.0 if scaler is None else float(scaler.scale), grad_norm=result.grad_norm,
        num_zeros_in_grad=result.num_zeros_in_grad,
        consumed_train_samples=state.consumed_train_samples,
        skipped_train_samples=state.skipped_train_samples, batch_size=batch_size,
        seq_length=seq_length, flops=flops, world_size=world_size, peak_flops=peak_flops,
        log_interval=training.log_interval)
    if record is not None:
        log_fn(record)


# -- plumbing of train(): the exit signal, the clocks, the evaluation batch, num_zeros --------
class ExitSignal:
    """Records a signal (default SIGTERM) so the loop can save and stop between iterations."""

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig, self._received, self._previous = sig, False, None

    def __enter__(self):
        self._previous = signal.signal(self.sig, self._handler)
        return self

    def __exit__(self, *exc):
        signal.signal(self.sig, self._previous)
        return False

    def _handler(self, signum, frame) -> None:
        self._received = True

    def received(self, grid: ParallelGrid) -> bool:
        """True if any rank of the world has received the signal."""
        return any_rank(self._received, grid)


def _duration_exceeded(limit_mins, start_time: float, clock, grid: ParallelGrid) -> bool:
    """Wall time since start > limit on any rank (MAX all-reduce, as Megatron)."""
    return any_rank((clock() - start_time) / 60.0 > limit_mins, grid)


def any_rank(flag: bool, grid: ParallelGrid) -> bool:
    """True if `flag` is true on any rank of the world (a MAX all-reduce; alone, the flag)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return bool(flag)
    t = torch.tensor([int(flag)], dtype=torch.int, device=grid.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _earliest_over_ranks(t: float, grid: ParallelGrid) -> float:
    """MIN over all ranks: the run started when its first process did (training.py:1132-1137)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return t
    x = torch.tensor([t], dtype=torch.float64, device=grid.device)
    dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return float(x.item())


def eval_batch(training, data_parallel_size: int) -> tuple[int, int]:
    """(micro-batches, samples) of one evaluation batch; Megatron's defaults and check."""
    mbs = getattr(training, "eval_micro_batch_size", None) or training.micro_batch_size
    gbs = (getattr(training, "eval_global_batch_size", None) or training.global_batch_size
           or training.micro_batch_size * data_parallel_size)
    if gbs % (mbs * data_parallel_size):
        raise ValueError(f"eval_global_batch_size ({gbs}) must be divisible by "
                         f"eval_micro_batch_size ({mbs}) * data_parallel_size "
                         f"({data_parallel_size})")
    return gbs // (mbs * data_parallel_size), gbs


def _logs_num_zeros(training, optimizer) -> bool:
    """Megatron's log_num_zeros_in_grad: the [training] key, else the optimizer's setting."""
    if getattr(training, "log_num_zeros_in_grad", None) is not None:
        return bool(training.log_num_zeros_in_grad)
    parts = [optimizer, *getattr(optimizer, "chained_optimizers", [])]
    return any(getattr(o, "log_num_zeros_in_grad", False) for o in parts)
