"""Optimizer step benchmarks, side by side in one run.

1. tinytron AdamW vs torch.optim.AdamW(foreach=True) on the same ~4M parameters (goal: <= 1.1x).
2. DistributedOptimizer step at DP 2 vs the non-distributed mixed-precision optimizer, both on
   chapter 05's DDP buffers (bf16 params, fp32 grads), timed on each rank.

Run: python benchmarks/bench_optimizer.py [--device cpu|cuda] [--repeats N]
Writes benchmarks/results/optimizer.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tinytron.optimizer.algorithms import AdamW

# a small transformer's tensor list: 4 layers of (qkv, proj, fc1, fc2, 2 norms) + embedding
SHAPES = [(8192, 256)] + [s for _ in range(4) for s in
                          [(768, 256), (256, 256), (1024, 256), (256, 1024), (256,), (256,)]]


def _params(device: str, seed: int = 0) -> list[torch.Tensor]:
    """Fresh params with grads, same values for every call."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(device)
    return ps


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_adamw(device: str, repeats: int, steps: int = 10) -> dict:
    """Median time per step of ours vs torch's foreach AdamW, interleaved to share the noise."""
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opts = {"tinytron": AdamW(_params(device), **kw),
            "torch_foreach": torch.optim.AdamW(_params(device), foreach=True, **kw)}
    for opt in opts.values():   # warm-up (creates the state)
        opt.step()
    times = {k: [] for k in opts}
    for _ in range(repeats):
        for name, opt in opts.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.step()
            _sync(device)
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    numel = sum(p.numel() for p in opts["tinytron"].param_groups[0]["params"])
    a, b = opts["tinytron"].param_groups[0]["params"], opts["torch_foreach"].param_groups[0]["params"]
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    return dict(numel=numel, tensors=len(SHAPES), ms_per_step=med,
                ratio_ours_over_torch=med["tinytron"] / med["torch_foreach"],
                params_bitwise_equal=same)


def _build(name: str, grid):
    """A bf16 MLP on chapter 05's DDP with the plain or the distributed optimizer."""
    from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
    from tinytron.optimizer.distributed import DistributedOptimizer
    from tinytron.optimizer.mixed_precision import MixedPrecisionOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).bfloat16()
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                        use_distributed_optimizer=name == "distributed")
    ddp = DistributedDataParallel(model, grid, cfg)
    inner = AdamW(model.parameters(), lr=1e-3)
    opt = DistributedOptimizer(inner, ddp) if name == "distributed" else \
        MixedPrecisionOptimizer(inner, grid=grid)
    for p in model.parameters():
        p.main_grad.normal_()
    opt.step()   # warm-up: creates the state
    return model, opt


def _state_bytes(opt) -> int:
    """Bytes of fp32 master params + optimizer state this rank holds."""
    return sum(t.numel() * t.element_size() for m in opt.main_params()
               for t in [m] + [v for v in opt._state_of[id(m)][m].values() if torch.is_tensor(v)])


def bench_distopt_rank(repeats: int, steps: int = 5) -> dict:
    """On each of 2 ranks: DistributedOptimizer vs plain optimizer step time, interleaved."""
    from tinytron.parallel import ParallelGrid

    grid = ParallelGrid(dp=torch.distributed.get_world_size())
    built = {name: _build(name, grid) for name in ("plain", "distributed")}
    times = {name: [] for name in built}
    for _ in range(repeats):
        for name, (_, opt) in built.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.step()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    result = {name: dict(ms_per_step=statistics.median(times[name]),
                         optimizer_state_bytes=_state_bytes(opt)) for name, (_, opt) in built.items()}
    result["numel"] = sum(p.numel() for p in built["plain"][0].parameters())
    return result


def bench_distopt(repeats: int) -> dict:
    """Launch the 2-rank comparison; report rank 0's numbers and both ranks' ratios."""
    from tinytron.launch import run_on_ranks

    out = run_on_ranks(bench_distopt_rank, 2, repeats, timeout=600)
    ratios = [o["distributed"]["ms_per_step"] / o["plain"]["ms_per_step"] for o in out]
    return dict(dp=2, per_rank=out, ratio_distributed_over_plain=ratios,
                state_bytes_ratio=out[0]["distributed"]["optimizer_state_bytes"]
                / out[0]["plain"]["optimizer_state_bytes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable on a shared box)")
    ap.add_argument("--skip-distopt", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    adamw = bench_adamw(args.device, args.repeats)
    print(f"AdamW step, {adamw['numel'] / 1e6:.1f}M params in {adamw['tensors']} tensors on "
          f"{args.device}: tinytron {adamw['ms_per_step']['tinytron']:.2f} ms | torch foreach "
          f"{adamw['ms_per_step']['torch_foreach']:.2f} ms | ratio "
          f"{adamw['ratio_ours_over_torch']:.3f} (goal <= 1.10), bitwise equal: "
          f"{adamw['params_bitwise_equal']}")
    result = dict(command="python benchmarks/bench_optimizer.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "skip_distopt"),
        device=args.device, torch=torch.__version__, machine=platform.machine(), adamw=adamw)
    if not args.skip_distopt:
        d = bench_distopt(args.repeats)
        r0 = d["per_rank"][0]
        print(f"DP 2, {r0['numel'] / 1e6:.1f}M bf16 params, CPU/gloo: plain step "
              f"{r0['plain']['ms_per_step']:.1f} ms | DistributedOptimizer step (incl. all-gather) "
              f"{r0['distributed']['ms_per_step']:.1f} ms | ratio per rank "
              f"{[round(x, 3) for x in d['ratio_distributed_over_plain']]} | optimizer state "
              f"{d['state_bytes_ratio']:.2f}x of plain")
        result["distopt"] = d
    out = Path(__file__).resolve().parent / "results" / "optimizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
