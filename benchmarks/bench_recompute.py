"""Iteration time and activation memory per recompute/offload mode, against no recompute.

One process, one model (tinytron.model.GPTModel: hidden 256, 4 layers, 8 heads / 2 kv groups,
ffn 688, vocab 4096, seq 256, dropout 0.1 as in Megatron's defaults), micro-batch 4, one
training step = forward, backward, SGD. Every mode starts from the same weights and the same
RNG seeds; the modes run in alternating rounds (order rotated each round) so machine load hits
them alike. Reports step time (wall: median and best round, on a shared machine the best round is
the least disturbed; and the process's CPU time, which other jobs disturb less when the
benchmark runs on one thread), the ratio to no recompute, the goals (full <= 1.40x, selective <= 1.05x,
offload on a GPU <= 1.10x), and per mode the activation bytes one micro-batch holds after its
forward and at its peak (measured by chapter 01's LiveBytesMeter in a separate, untimed step).
Writes benchmarks/results/recompute.json (recompute_cuda.json with --device cuda).
The model runs in bf16 on CUDA and fp32 on a CPU (--dtype): on CUDA, fp32 with grouped queries
would time PyTorch's math attention kernel (its fused kernels refuse that combination), not the
flash kernel a bf16 run uses. The JSON records the kernel torch picked (chapter 07's `_sdpa`).

    python benchmarks/bench_recompute.py [--rounds 5] [--steps 3] [--threads 1] [--device cpu]
                                         [--dtype auto|fp32|bf16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ALL_FIVE = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
MODES = {
    "none": {},
    "selective core_attn": dict(recompute_granularity="selective"),
    "full uniform k=1": dict(recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=1),
    "full block k=2": dict(recompute_granularity="full", recompute_method="block",
                           recompute_num_layers=2),
    "offload (5 regions)": dict(fine_grained_activation_offloading=True, offload_modules=ALL_FIVE,
                                min_offloaded_tensor_size=1024),
}
GOALS = {"selective core_attn": 1.05, "full uniform k=1": 1.40, "offload (5 regions)": 1.10}
MICRO_BATCH = 4
SMALL = False


def _config(**fields):
    from tinytron.model import ModelConfig

    return ModelConfig(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2,
                       ffn_hidden_size=688, vocab_size=4096, seq_length=256, dropout=0.1, **fields)


def _build(name, device, dtype=torch.float32):
    """Model, optimizer and batch for one mode, from the same seeds as every other mode."""
    from tinytron.model.gpt import GPTModel
    from tinytron.parallel import ParallelGrid
    from tinytron.parallel.rng import RNGStatesTracker, model_parallel_seed
    from tinytron.recompute import apply_recompute

    config = _config(**MODES[name])
    if SMALL:  # --small: the same modes on 2 layers of 64 tokens, a quick plumbing run
        config = dataclasses.replace(config, num_layers=2, seq_length=64)
    tracker = model_parallel_seed(1234, ParallelGrid.single(), RNGStatesTracker(device.type))
    model = GPTModel(config, device=device, dtype=dtype, rng_tracker=tracker)
    apply_recompute(model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (MICRO_BATCH, config.seq_length), generator=g)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), tokens.to(device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, opt, tokens) -> float:
    opt.zero_grad(set_to_none=False)
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    opt.step()
    return loss.item()


def _time_mode(setup, steps, device) -> tuple[float, float]:
    """Wall seconds and process CPU seconds per step over `steps` steps."""
    model, opt, tokens = setup
    _sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        _step(model, opt, tokens)
    _sync(device)
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu_start) / steps


def _memory(name, device, dtype) -> dict:
    """Bytes one micro-batch holds after its forward and at its peak (parameters excluded)."""
    from tinytron.main_loop.memory_meter import LiveBytesMeter

    model, opt, tokens = _build(name, device, dtype)
    _step(model, opt, tokens)  # grads exist: the measured step allocates no new .grad tensors
    opt.zero_grad(set_to_none=False)
    with LiveBytesMeter(device, record_every_op=False) as meter:
        meter.track(list(model.parameters()) + [p.grad for p in model.parameters()])
        base = meter.current
        loss = model(tokens, labels=tokens).mean()
        held = meter.current - base
        loss.backward()
        peak = meter.peak - base
    return {"held_bytes": held, "peak_bytes": peak}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                        help="auto: bf16 on CUDA, fp32 on a CPU")
    parser.add_argument("--small", action="store_true",
                        help="2 layers of 64 tokens: checks the plumbing, measures nothing")
    parser.add_argument("--out", default=None,
                        help="default benchmarks/results/recompute.json (_cuda with --device cuda)")
    args = parser.parse_args(argv)
    global SMALL
    SMALL = args.small
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    setups, losses = {}, {}
    for name in MODES:  # build, then one warm-up step right after the seeding: equal losses
        setups[name] = _build(name, device, dtype)
        losses[name] = _step(*setups[name])
    times = {name: [] for name in MODES}
    cpu_times = {name: [] for name in MODES}
    names = list(MODES)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            wall, cpu = _time_mode(setups[name], args.steps, device)
            times[name].append(wall)
            cpu_times[name].append(cpu)
    memory = {name: _memory(name, device, dtype) for name in MODES}
    return _report(args, device, dtype, times, cpu_times, losses, memory)


def _attention_kernel(device, dtype) -> str:
    """The SDPA kernel torch picks for this model's attention call (and why)."""
    from tinytron.memory._sdpa import SdpaCall, sdpa_choice

    c = _config()
    call = SdpaCall(device.type, dtype, MICRO_BATCH, c.num_attention_heads, c.num_query_groups,
                    c.seq_length, c.seq_length, c.head_dim, c.dropout, masked=False)
    return "%s (%s)" % sdpa_choice(call)


def _report(args, device, dtype, times, cpu_times, losses, memory) -> dict:
    """Print the table and write the JSON."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    ref_med, ref_best = statistics.median(times["none"]), min(times["none"])
    ref_cpu = statistics.median(cpu_times["none"])
    rows = {}
    print(f"{'mode':<22}{'wall med s':>11}{'x none':>8}{'best s':>8}{'x none':>8}{'cpu med s':>10}"
          f"{'x none':>8}{'goal':>6}{'held MiB':>9}{'peak MiB':>9}")
    for name, ts in times.items():
        med, best, cpu = statistics.median(ts), min(ts), statistics.median(cpu_times[name])
        row = {"median_s": med, "best_s": best, "cpu_median_s": cpu,
               "ratio_median": med / ref_med, "ratio_best": best / ref_best,
               "ratio_cpu_median": cpu / ref_cpu, "goal": GOALS.get(name),
               "loss_after_warmup": losses[name], **memory[name]}
        rows[name] = row
        goal = f"{GOALS[name]:.2f}" if name in GOALS else ""
        print(f"{name:<22}{med:>11.3f}{med / ref_med:>8.3f}{best:>8.3f}{best / ref_best:>8.3f}"
              f"{cpu:>10.3f}{cpu / ref_cpu:>8.3f}{goal:>6}"
              f"{memory[name]['held_bytes'] / 2**20:>9.1f}{memory[name]['peak_bytes'] / 2**20:>9.1f}")
    same = len({round(v, 6) for v in losses.values()}) == 1
    print(f"every mode gave the same loss after its warm-up step: {same}")
    print(f"load average at the end: {load}")
    kernel = _attention_kernel(device, dtype)
    print(f"attention kernel: {kernel}")
    result = {
        "command": "python benchmarks/bench_recompute.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items()),
        "model": ("GPTModel h256 L2 a8 g2 f688 V4096 s64 (--small)" if SMALL else
                  "GPTModel h256 L4 a8 g2 f688 V4096 s256") + f", dropout 0.1, {str(dtype)[6:]}",
        "micro_batch": MICRO_BATCH, "attention_kernel": kernel,
        "device": str(device), "torch": torch.__version__, "threads": args.threads,
        "machine": platform.platform(), "cpu_count": os.cpu_count(), "load_average_1min": load,
        "modes": rows, "losses_identical": same,
    }
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    out = (Path(args.out) if args.out else
           Path(__file__).resolve().parent / "results" / f"recompute{suffix}.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
