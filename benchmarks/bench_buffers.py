"""DP=2 training step: tinytron.buffers DDP vs torch.nn.parallel.DistributedDataParallel.

Same Llama-style model (tinytron.model.GPTModel: hidden 256, 4 layers, 4 heads / 2 kv groups,
ffn 688, vocab 8192, seq 256), same data (micro-batch 8 per rank, one micro-batch per step), same
initial weights and the same plain SGD update, in one 2-rank world; variants run in alternating
rounds (the order rotated each round) so machine load hits all of them alike. Reports step time
(max over ranks; median and best over rounds: on a shared machine the best round is the least
disturbed one), tokens/s over the global batch, the ratios to torch DDP, and the largest loss
difference to torch DDP (they must train identically). Writes benchmarks/results/buffers.json.

    python benchmarks/bench_buffers.py [--rounds 4] [--steps 3] [--backend gloo]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

LR = 1e-3
VARIANTS = {
    "tinytron DDP (overlap, Megatron default bucket 40M)": dict(overlap_grad_reduce=True),
    "tinytron DDP (overlap, bucket 1M elements)": dict(overlap_grad_reduce=True,
                                                       bucket_size=1_000_000),
    "tinytron DDP (no overlap, one bucket)": dict(),
    "tinytron DDP + distributed-optimizer buffers (overlap, bucket 1M)": dict(
        overlap_grad_reduce=True, bucket_size=1_000_000, use_distributed_optimizer=True),
}
REFERENCE = "torch DDP (default: 25 MB buckets)"


def _config():
    from tinytron.model import ModelConfig

    return ModelConfig(hidden_size=256, num_layers=4, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=688, vocab_size=8192, seq_length=256)


def _build(name, grid, device):
    """One model per variant, wrapped; all start from the same layout-free init."""
    from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
    from tinytron.model import GPTModel

    model = GPTModel(_config(), grid, device=device)
    if name == REFERENCE:
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return DistributedDataParallel(model, grid, DistributedDataParallelConfig(**VARIANTS[name]))


def _step(name, wrapped, tokens, labels, grid) -> float:
    """Forward, backward, grad sync, SGD; returns the loss."""
    from tinytron.buffers import finalize_model_grads

    if name == REFERENCE:
        wrapped.zero_grad(set_to_none=True)
        loss = wrapped(tokens, labels=labels).mean()
        loss.backward()  # torch DDP all-reduces (averages) inside backward
        with torch.no_grad():
            for p in wrapped.parameters():
                p.add_(p.grad, alpha=-LR)
        return loss.item()
    wrapped.zero_grad_buffer()
    loss = wrapped(tokens, labels=labels).mean()
    loss.backward()
    finalize_model_grads([wrapped], grid)
    with torch.no_grad():
        if wrapped.ddp_config.use_distributed_optimizer:  # update my shard, all-gather params
            for buf in wrapped.buffers:
                for b in buf.buckets:
                    b.param_shard().add_(b.grad_shard(), alpha=-LR)
            wrapped.start_param_sync()
        else:
            for p in wrapped.params_with_grad:
                p.add_(p.main_grad, alpha=-LR)
    return loss.item()


def bench_rank(rounds: int, steps: int, micro_bs: int) -> dict:
    """Rank function: alternate the variants for ``rounds`` rounds of ``steps`` timed steps."""
    from tinytron.parallel import ParallelGrid

    grid = ParallelGrid()
    device = grid.device
    cfg = _config()
    names = [REFERENCE] + list(VARIANTS)
    models = {n: _build(n, grid, device) for n in names}
    g = torch.Generator().manual_seed(1234 + grid.rank("dp"))  # different data per DP rank
    num_batches = steps * rounds + 1
    data = torch.randint(0, cfg.vocab_size, (num_batches, micro_bs, cfg.seq_length + 1),
                         generator=g).to(device)
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    for n in names:  # warm-up step (allocations, first-step golden counts); batch 0
        losses[n].append(_step(n, models[n], data[0, :, :-1], data[0, :, 1:], grid))
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:  # rotate: no position bias
            dist.barrier()
            t0 = time.perf_counter()
            for s in range(steps):
                i = 1 + r * steps + s
                losses[n].append(_step(n, models[n], data[i, :, :-1], data[i, :, 1:], grid))
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([(time.perf_counter() - t0) / steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[n].append(elapsed.item())
    return {"times": times, "losses": losses}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "buffers.json"))
    args = ap.parse_args()
    from tinytron.launch import run_on_ranks

    t0 = time.perf_counter()
    res = run_on_ranks(bench_rank, 2, args.rounds, args.steps, args.micro_batch,
                       backend=args.backend, timeout=1800)[0]
    tokens = 2 * args.micro_batch * _config().seq_length
    ref_t = statistics.median(res["times"][REFERENCE])
    ref_best = min(res["times"][REFERENCE])
    rows = {}
    print(f"DP=2 {args.backend}, global batch {tokens} tokens/step, {args.rounds} rounds x "
          f"{args.steps} steps, load average {os.getloadavg()[0]:.1f}")
    print(f"{'variant':66s} {'median ms':>9s} {'tokens/s':>8s} {'vs torch':>8s} "
          f"{'best ms':>8s} {'vs torch':>8s} {'max dloss':>9s}")
    for name, ts in res["times"].items():
        t, best = statistics.median(ts), min(ts)
        dloss = max(abs(a - b) for a, b in zip(res["losses"][name], res["losses"][REFERENCE]))
        rows[name] = {"step_s_median": t, "step_s_best": best, "step_s_all": ts,
                      "tokens_per_s_median": tokens / t, "tokens_per_s_best": tokens / best,
                      "speed_vs_torch_ddp_median": ref_t / t,
                      "speed_vs_torch_ddp_best": ref_best / best,
                      "max_loss_diff_vs_torch_ddp": dloss}
        print(f"{name:66s} {t * 1e3:9.1f} {tokens / t:8.0f} {ref_t / t:7.3f}x "
              f"{best * 1e3:8.1f} {ref_best / best:7.3f}x {dloss:9.2e}")
    out = {"command": "python benchmarks/bench_buffers.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
           "model": {"hidden": 256, "layers": 4, "heads": 4, "kv_groups": 2, "ffn": 688,
                     "vocab": 8192, "seq": 256, "micro_batch_per_rank": args.micro_batch,
                     "dtype": "float32"},
           "dp": 2, "backend": args.backend, "tokens_per_step": tokens,
           "machine": f"{platform.machine()} {platform.processor() or ''} "
                      f"torch {torch.__version__}, 1 thread per rank".strip(),
           "load_average_1min_at_end": os.getloadavg()[0],
           "wall_s": time.perf_counter() - t0, "reference": REFERENCE, "variants": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    # A timing is only worth reporting if every variant trained exactly like torch DDP: same
    # data, same fp32 reductions, so the losses are bit-identical, step by step.
    unequal = {n: r["max_loss_diff_vs_torch_ddp"] for n, r in rows.items()
               if r["max_loss_diff_vs_torch_ddp"] != 0.0}
    assert not unequal, f"losses differ from torch DDP: {unequal}"


if __name__ == "__main__":
    main()
