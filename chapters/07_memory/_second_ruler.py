"""A second instrument for chapter 07: PyTorch's own `MemTracker` on the same layouts.

Not a page: [07.6](measured.py) names it and reports its numbers. Chapter 01's `LiveBytesMeter`
is this project's meter, and the ledger was checked against it; a shared mistake in the two
(a storage counted twice, a class of tensor never seen) would pass. This module measures the
same cases with `torch.distributed._tools.mem_tracker.MemTracker`, which PyTorch ships and
which shares no code with the meter: it is its own dispatch mode and keeps a weak reference
to every storage it sees allocated, summing their sizes per category. The tracker's numbers
come from no call into the meter or `storage_bytes`; the meter's own numbers for the same
chunk (`measure_chunk`, run after the tracker) come back beside them for the report.

One tracker runs from before the model is built, so it has seen every storage. Per case and
rank it records, in bytes of the device:
  resident       its total after the model, the DDP buffers and the optimizer (one step);
  kept           what one micro-batch's forward adds to that (second pass: caches built);
  forward_peak   the chunk's peak during forward, above the total before the micro-batch;
  backward_peak  the same for the backward;
  after          what is still alive after the backward (0 if everything was freed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinytron.memory._workers import _build, _microbatch, case_on_this_rank, measure_chunk
from tinytron.optimizer import OptimizerConfig, get_megatron_optimizer


def _device_snapshot(tracker, device: torch.device, which: str) -> dict:
    """The tracker's snapshot of `device` ('cuda' matches the current 'cuda:N')."""
    for dev, snap in tracker.get_tracker_snapshot(which).items():
        if dev.type == device.type and (device.index is None or dev.index == device.index):
            return snap
    return {}


def _total(tracker, device: torch.device, which: str = "current") -> int:
    return int(_device_snapshot(tracker, device, which).get("Total", 0))


def _one_microbatch(cfg, grid, chunk, tracker, dev) -> dict[str, int]:
    """Kept bytes and the forward and backward peaks of one micro-batch on `chunk`.

    The tracker has seen every storage since the model was built, so its totals are absolute;
    the micro-batch's numbers are differences from the total before it. The peaks are the
    tracker's own per-module peaks of the chunk (its Peak-Forward and Peak-Backward snapshots).
    """
    from torch.distributed._tools.mem_tracker import _ModState

    tracker.reset_mod_stats()
    before = _total(tracker, dev)
    batch = _microbatch(cfg, grid, seed=0)
    if not chunk.pre_process:
        s_r = (cfg.model.seq_length // cfg.context_parallel_size
               // (cfg.tensor_model_parallel_size if cfg.model.sequence_parallel else 1))
        chunk.set_input_tensor(torch.randn(
            s_r, cfg.micro_batch_size, cfg.model.hidden_size, device=dev,
            dtype=torch.bfloat16 if cfg.bf16 else torch.float32, requires_grad=True))
    out = chunk(batch["tokens"] if chunk.pre_process else None,
                labels=batch["labels"] if chunk.post_process else None)
    del batch
    dist.barrier()
    kept = _total(tracker, dev) - before
    out.backward(torch.ones_like(out) if chunk.post_process else torch.randn_like(out))
    del out
    chunk.set_input_tensor(None)
    dist.barrier()
    stats = tracker.memory_tracking[chunk].snapshots
    peak = {state: next(snap["Total"] for d, snap in stats[state][-1].items()
                        if d.type == dev.type) - before
            for state in (_ModState.PEAK_FW, _ModState.PEAK_BW)}
    return {"kept": kept, "forward_peak": peak[_ModState.PEAK_FW],
            "backward_peak": peak[_ModState.PEAK_BW], "after": _total(tracker, dev) - before}


def tracked_case(case: dict) -> dict:
    """MemTracker's resident, kept and peak bytes of one case on this rank."""
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg, grid = case_on_this_rank(case)
    dev = torch.device(grid.device)
    tracker = MemTracker()
    with tracker:
        chunks, ddps = _build(cfg, grid)
        opt_cfg = OptimizerConfig(lr=1e-3, bf16=cfg.bf16, optimizer=cfg.optimizer,
                                  use_distributed_optimizer=cfg.use_distributed_optimizer,
                                  optimizer_cpu_offload=cfg.optimizer_cpu_offload,
                                  optimizer_offload_fraction=cfg.optimizer_offload_fraction)
        opts = [get_megatron_optimizer(opt_cfg, d.module, grid, d) for d in ddps]
        for o in opts:
            o.step()
        dist.barrier()
        resident = _total(tracker, dev)
        for _ in range(2):  # the first pass also builds lazy caches (RoPE): keep the second
            tracked = _one_microbatch(cfg, grid, chunks[0], tracker, dev)
    meter = min((measure_chunk(cfg, grid, chunks[0], 0) for _ in range(2)),
                key=lambda m: m["kept"])  # chapter 01's meter on the same chunk, for the report
    meter = {"kept": meter["kept"], "forward_peak": meter["kept"] + meter["forward_peak"],
             "backward_peak": meter["kept"] + meter["backward_peak"]}  # from the same zero
    return {"case": case, "world_size": dist.get_world_size(), "device": cfg.device,
            "rank": dist.get_rank(),
            "pp_rank": grid.rank("pp"), "dp_cp_rank": grid.rank("dp_cp"),
            "resident": resident, "tracked": tracked, "meter": meter}


def tracked_cases(cases: list[dict]) -> list[dict]:
    """tracked_case for every case (all ranks run them in the same order)."""
    return [tracked_case(c) for c in cases]


def run_tracked(cases: list[dict], world_size: int = 4, backend: str = "gloo",
                timeout: float = 600.0) -> list[dict]:
    """MemTracker's numbers for every case on every rank of one world, flat."""
    from tinytron.launch import run_on_ranks

    per_rank = run_on_ranks(tracked_cases, world_size, cases, backend=backend, timeout=timeout)
    return [r for rank_results in per_rank for r in rank_results]
