"""Helpers and per-rank workers for the loop pages' demos (importable by name for spawned ranks)."""

from __future__ import annotations

from functools import partial

import torch

__all__ = ["SyntheticTokens", "synthetic_iterators", "memory_timeline", "memory_timelines_pp2"]


class SyntheticTokens(torch.utils.data.Dataset):
    """Sequences t, t+7, t+14, ... (mod V) from a per-index random start: learnable, deterministic."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234,
                 stride: int = 7):
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed, self.stride = seed, stride

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(idx))
        start = int(torch.randint(0, self.vocab_size, (1,), generator=g))
        seq = (start + self.stride * torch.arange(self.seq_length + 1)) % self.vocab_size
        return {"tokens": seq[:-1], "labels": seq[1:],
                "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
                "position_ids": torch.arange(self.seq_length)}


def synthetic_iterators(model_config, grid, state, *, micro_batch_size: int,
                        num_samples: int = 100_000, seed: int = 1234):
    """(train, valid) iterators over SyntheticTokens through chapter 04's sampler, resumed."""
    from tinytron.data.samplers import build_pretraining_data_loader

    dp_rank, dp = max(grid.rank("dp"), 0), grid.size("dp")
    out = []
    for ds_seed, consumed in ((seed, state.consumed_train_samples),
                              (seed + 1, state.consumed_valid_samples)):
        ds = SyntheticTokens(num_samples, model_config.seq_length, model_config.vocab_size, ds_seed)
        out.append(iter(build_pretraining_data_loader(ds, consumed, micro_batch_size, dp_rank, dp)))
    return out[0], out[1]


# -- resident vs flowing memory over one iteration (resident_flowing page) ---------------------
def _resident_tensors(model, optimizer) -> dict:
    """{kind: tensors} of what lives all run: params, grad buffers, optimizer state."""
    params = [p for chunk in model for p in chunk.parameters()]
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    state = [v for s in optimizer.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    return {"params": params, "grads": grads, "optimizer state": state}


def memory_timeline(pp: int, vpp: int | None = None, num_microbatches: int = 4,
                    seq_length: int = 128, micro_batch_size: int = 2, num_layers: int = 4) -> dict:
    """One measured train_step on this rank: resident bytes, flowing bytes over time, events."""
    import time

    from tinytron.buffers import DistributedDataParallelConfig
    from tinytron.main_loop.loop import (TrainState, build_schedule_config, gpt_forward_step,
                                         train_step, wrap_with_ddp)
    from tinytron.main_loop.memory_meter import LiveBytesMeter, storage_bytes
    from tinytron.main_loop.schedules import ScheduleRecorder, get_forward_backward_func
    from tinytron.model import build_stage_models, tiny_config
    from tinytron.optimizer import OptimizerConfig, get_megatron_optimizer
    from tinytron.parallel import ParallelGrid

    grid = ParallelGrid(pp=pp) if pp > 1 else ParallelGrid.single()  # pp 1: this rank alone
    cfg = tiny_config(seq_length=seq_length, num_layers=num_layers)
    model = wrap_with_ddp(build_stage_models(cfg, grid, vpp or 1), grid,
                          DistributedDataParallelConfig())
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3),
                                 torch.nn.ModuleList([c.module for c in model]), grid)
    config = build_schedule_config(model, opt, grid, recorder=ScheduleRecorder())
    iters = [synthetic_iterators(cfg, grid, TrainState(), micro_batch_size=micro_batch_size)[0]
             for _ in model]
    step = lambda: train_step(  # noqa: E731 - the same call twice
        partial(gpt_forward_step, micro_batch_size=micro_batch_size, seq_length=seq_length),
        iters if vpp else iters[0], model, opt, None, get_forward_backward_func(pp, vpp),
        num_microbatches=num_microbatches, micro_batch_size=micro_batch_size,
        seq_length=seq_length, grid=grid, config=config)
    step()  # warm-up: the optimizer state exists from here on, as in every later iteration
    resident = _resident_tensors(model, opt)
    config.recorder.events.clear()
    with LiveBytesMeter() as meter:
        t0 = time.perf_counter()
        meter.track(t for ts in resident.values() for t in ts)
        start = meter.mark("start")
        step()
        end = meter.mark("end")
    events = [(e.chunk, e.microbatch, e.kind, e.start - t0, e.end - t0)
              for e in config.recorder.events if e.kind in ("forward", "backward")]
    return {"stage": grid.rank("pp"), "resident": {k: storage_bytes(v) for k, v in resident.items()},
            "num_params": sum(p.numel() for c in model for p in c.parameters()),
            "timeline": [(t, b) for t, b, _ in meter.timeline], "start": start, "end": end,
            "peak": meter.peak, "events": events, "t0": t0,
            "held_inputs": sum(not c.module.pre_process for c in model)}


def memory_timelines_pp2(num_microbatches: int = 4) -> dict:
    """On a 2-rank world: 1F1B and interleaved (v = 2) per rank; no pipelining on rank 0 alone."""
    import torch.distributed as dist

    out = {"1F1B": memory_timeline(2, None, num_microbatches),
           "interleaved": memory_timeline(2, 2, num_microbatches)}
    out["none"] = memory_timeline(1, None, num_microbatches) if dist.get_rank() == 0 else None
    return out
