"""The trainer's step-time reports, from 07.13's model: at the start of a run, and at its end.

Not a page. `step_report_at_start` predicts the step of the run it is called for, with every
overlap switch that run uses, and with rates that describe the machine it runs on:

- on a GPU, appendix C's kernel law of that GPU (H100, H200 or A100 by its name; others are
  reported against the H100's law, and the line says so) and 07.10's default links;
- on a CPU, this CPU's own rates, measured in a fraction of a second before the first
  iteration with every rank timing at once (as they will train): the FLOP rate of one
  micro-batch of the model, forward and backward (of its fc1 GEMM alone for a model too
  large to run twice here), the memory bandwidth of an add, and, with more than one rank,
  gloo's latency and bandwidth from all-reduces of two sizes — each the slowest rank's,
  which sets the pace. Every rank takes part, so every rank calls this function.

`step_report_at_end` puts the prediction beside the run's measured step: the median of the
`ms_per_iteration` its log wrote, leaving out the first interval (it holds the warm-up).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tinytron.memory.step_time import Links, StepOptions, StepTime, estimate_step


@dataclass
class StepReport:
    """What the start-of-run report predicted, kept for the end-of-run comparison."""

    text: str
    step: StepTime | None = None


def run_options(cfg) -> StepOptions:
    """The overlap switches and checkpoint schedule of a trainer config (tinytron.config)."""
    from tinytron.checkpoint import CheckpointConfig

    ckpt = cfg.extra.get("checkpoint") or CheckpointConfig()
    every = cfg.training.save_interval
    return StepOptions(
        overlap_grad_reduce=cfg.ddp.overlap_grad_reduce,
        overlap_param_gather=cfg.ddp.overlap_param_gather,
        overlap_p2p_comm=cfg.parallel.p2p_schedule_options()["overlap_p2p_comm"],  # as run
        checkpoint="none" if not every else ("staged" if ckpt.async_save else "blocking"),
        save_interval=every or 1)


def _seconds(fn, repeats: int = 5) -> float:
    """The median of `repeats` timings of fn(), every rank timing at once (as they train)."""
    together = dist.is_initialized() and dist.get_world_size() > 1
    times = []
    for _ in range(repeats):
        if together:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


MICROBATCH_LIMIT = 2e10
"""Model FLOPs of one micro-batch up to which the CPU rate is taken from a real one."""


def _compute_rate(cfg, dtype: torch.dtype) -> tuple[float, str]:
    """FLOP/s of this CPU on the run's own work, and how it was measured."""
    from tinytron.main_loop.training_log import num_floating_point_operations
    from tinytron.model import GPTModel

    m, b = cfg.model, cfg.training.micro_batch_size
    flops = num_floating_point_operations(m, b)
    if flops <= MICROBATCH_LIMIT:  # one micro-batch of the whole model, forward and backward
        model = GPTModel(m.replace(recompute_granularity=None)).to(dtype)
        tokens = torch.randint(0, m.vocab_size, (b, m.seq_length))
        step = lambda: model(tokens, labels=torch.roll(tokens, -1, 1)).mean().backward()  # noqa
        step()  # the first call allocates
        return flops / _seconds(step), "a micro-batch of the model"
    rows = b * m.seq_length  # too large to run twice here: the fc1 GEMM alone
    x = torch.randn(rows, m.hidden_size, dtype=dtype)
    w = torch.randn(m.hidden_size, m.ffn_hidden_size, dtype=dtype)
    return 2 * rows * m.hidden_size * m.ffn_hidden_size / _seconds(lambda: x @ w), \
        "the model's fc1 GEMM"


def measure_cpu_links(cfg, dtype: torch.dtype = torch.float32) -> tuple[Links, str]:
    """This CPU's compute rate, memory bandwidth and gloo link (and how the rate was found)."""
    rate, how = _compute_rate(cfg, dtype)
    x, y = torch.ones(2**22), torch.ones(2**22)
    memory = 3 * 4 * x.numel() / _seconds(lambda: torch.add(x, y, out=x))
    bandwidth, latency = 1e12, 0.0  # one rank: no link is used
    if dist.is_initialized() and dist.get_world_size() > 1:
        slowest = torch.tensor([rate, memory], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MIN)  # one prediction, the slowest rank's pace
        rate, memory = slowest.tolist()
        small, large = torch.ones(2**12), torch.ones(2**20)
        dist.barrier()
        t_small = _seconds(lambda: dist.all_reduce(small))
        t_large = _seconds(lambda: dist.all_reduce(large))
        slope = max((t_large - t_small) / (4 * (large.numel() - small.numel())), 1e-15)
        n = dist.get_world_size()
        link = torch.tensor([2 * (n - 1) / n / slope,  # a ring all-reduce moves 2 (n-1)/n
                             -max(0.0, t_small - 4 * small.numel() * slope)], dtype=torch.float64)
        dist.all_reduce(link, op=dist.ReduceOp.MIN)  # the slowest rank's, on every rank
        bandwidth, latency = link[0].item(), -link[1].item()
    return Links(peak_flops=rate, mfu=1.0, law=None, nvlink=bandwidth, network=bandwidth,
                 pcie=memory, disk=memory, memory=memory, latency=latency,
                 reduce_scatter_as_all_reduce=True, interference=0.0), how


def gpu_links(device: torch.device) -> tuple[Links, str]:
    """07.10's links with appendix C's law of this GPU, and the words that name it."""
    return links_for_gpu(torch.cuda.get_device_name(device))


def links_for_gpu(name: str) -> tuple[Links, str]:
    """07.10's links with the law of the GPU called `name` (H100's law when none matches)."""
    from tinytron.kernels.roofline import LAWS

    key = next((k for k in LAWS if k in name.upper()), None)
    law = LAWS[key or "H100"]
    words = f"{law.gpu.name} (appendix C's kernel law)" if key else \
        f"{name}, reported with the H100 SXM's kernel law (no law for this GPU)"
    return Links(peak_flops=law.gpu.bf16_flops, law=law,
                 memory=law.gpu.hbm_bytes_per_s), words


def step_report_at_start(cfg, world_size: int, device: torch.device) -> StepReport:
    """Predict this run's step; every rank calls it (a CPU run measures its gloo link)."""
    from tinytron.memory import memory_config_from

    options = run_options(cfg)
    try:
        mem = memory_config_from(cfg, world_size, device=device.type)
        if device.type == "cuda":
            links, rates = gpu_links(device)
        else:
            links, how = measure_cpu_links(cfg, torch.bfloat16 if mem.bf16 else torch.float32)
            rates = (f"this CPU, measured now: {links.flops / 1e9:.1f} GFLOP/s on {how}, "
                     f"memory {links.memory / 1e9:.1f} GB/s"
                     + (f", gloo {links.network / 1e9:.2f} GB/s + {links.latency * 1e3:.2f} ms"
                        if world_size > 1 else ""))
        step = estimate_step(mem, links, options)
    except Exception as e:  # noqa: BLE001 - a report: it must never stop a training run
        return StepReport(f"step time (chapter 07): not predicted for this layout "
                          f"({type(e).__name__}: {e})")
    lines = [f"step time per iteration, predicted by chapter 07 for {rates}:",
             f"  options: overlap_grad_reduce {options.overlap_grad_reduce}, overlap_param_gather "
             f"{options.overlap_param_gather}, overlap_p2p_comm {options.overlap_p2p_comm}, "
             f"tp_comm_overlap {options.tp_comm_overlap}, checkpoint {options.checkpoint}",
             f"  step time {_ms(step.total)} = compute {_ms(step.compute)} + bubble "
             f"{_ms(step.bubble)} + optimizer {_ms(step.optimizer)} + exposed {_ms(step.exposed)}"]
    lines += [f"  exposed: {i.item} {_ms(i.exposed)} of {_ms(i.seconds)}"
              for i in step.items if i.seconds > 0]
    return StepReport("\n".join(lines), step)


def _ms(x: float) -> str:
    return f"{x * 1e3:.3g} ms"


def measured_step_seconds(jsonl_path: str | None) -> tuple[float, int] | None:
    """(median seconds per iteration, intervals) from a run's JSONL log, the first left out."""
    if not jsonl_path or not os.path.isfile(jsonl_path):
        return None
    with open(jsonl_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    times = [r["ms_per_iteration"] / 1e3 for r in records if "ms_per_iteration" in r]
    times = times[1:] or times
    return (statistics.median(times), len(times)) if times else None


def step_report_at_end(report: StepReport, jsonl_path: str | None) -> str | None:
    """One line: the predicted step beside the measured one, or None without both."""
    measured = measured_step_seconds(jsonl_path)
    if report.step is None or measured is None:
        return None
    seconds, n = measured
    return (f"step time: predicted {_ms(report.step.total)} at the start, measured "
            f"{_ms(seconds)} (median of {n} logged interval{'s' if n > 1 else ''}): "
            f"{report.step.total / seconds - 1:+.0%}")
