"""The model alone: GPTModel forward + backward + AdamW against an independent plain-PyTorch Llama.

The same step on both sides, on the same token batches: forward to the per-token loss
(GPTModel with ``labels=``; the reference's logits through ``F.cross_entropy``), the token-mean
loss, backward, ``clip_grad_norm_(foreach=True)``, ``torch.optim.AdamW(foreach=True)``, one
host read of the loss. The reference (benchmarks/plain_llama.py) imports nothing from tinytron.
The sides alternate round by round; the ratio is the median of per-round ratios, in this
process's CPU time (one thread: robust on a loaded machine) and in wall time.

``--profile`` adds a torch.profiler table of both sides (self CPU time per op, per step), to
see where a gap lies.

Run: python benchmarks/bench_model.py [--shape bench|tiny] [--rounds 7] [--steps 3] [--profile]
Writes benchmarks/results/model.json (model_tiny.json for --shape tiny).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plain_llama import PlainLlama, PlainTrainer  # noqa: E402

from bench_train import LR, WD, CLIP, SHAPES  # noqa: E402


class TinytronSide:
    """GPTModel with labels= (the loss the trainer uses), masked mean, the same optimizer."""

    def __init__(self, model_kwargs: dict):
        from tinytron.model import GPTModel, ModelConfig

        self.model = GPTModel(ModelConfig(**model_kwargs))
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, foreach=True)

    def step(self, batches) -> float:
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for tokens, labels in batches:
            loss = self.model(tokens, labels=labels).mean()
            (loss / len(batches)).backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP, foreach=True)
        self.opt.step()
        return float(total) / len(batches)


class ReferenceSide:
    def __init__(self, model_kwargs: dict):
        self.trainer = PlainTrainer(PlainLlama(**model_kwargs), LR, WD, CLIP)

    def step(self, batches) -> float:
        return float(self.trainer.step(batches))


def batches_for(model_kwargs: dict, mbs: int, m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        seq = torch.randint(0, 256, (mbs, model_kwargs["seq_length"] + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def bench_args(description: str, rounds: int, steps: int) -> argparse.ArgumentParser:
    """The options this benchmark and bench_compile.py share: shape, rounds, steps, threads, out."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steps", type=int, default=steps, help="timed steps per side and round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    return ap


def time_rounds(sides: dict, batches, rounds: int, steps: int) -> dict:
    """{"wall"|"cpu": {side: [seconds per step, one per round]}}; the sides alternate per round."""
    times = {c: {k: [] for k in sides} for c in ("wall", "cpu")}
    for _ in range(rounds):
        for name, side in sides.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                side.step(batches)
            times["wall"][name].append((time.perf_counter() - w0) / steps)
            times["cpu"][name].append((time.process_time() - c0) / steps)
    return times


def profile_table(side, batches, steps: int, rows: int = 15) -> list[dict]:
    """Top ops by self CPU time (ms per step) under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            side.step(batches)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
    return [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
             "calls_per_step": e.count / steps} for e in events]


def main() -> None:
    ap = bench_args(__doc__.splitlines()[0], rounds=7, steps=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_kwargs, mbs, gbs = SHAPES[args.shape]
    m = gbs[1] // mbs
    load_before = os.getloadavg()
    torch.manual_seed(0)
    sides = {"tinytron": TinytronSide(model_kwargs), "reference": ReferenceSide(model_kwargs)}
    batches = batches_for(model_kwargs, mbs, m)
    first = {k: s.step(batches) for k, s in sides.items()}   # warm-up: lazy init, allocator
    for s in sides.values():
        s.step(batches)
    times = time_rounds(sides, batches, args.rounds, args.steps)
    ratio = {c: statistics.median(a / b for a, b in zip(t["tinytron"], t["reference"]))
             for c, t in times.items()}
    cmd = "python benchmarks/bench_model.py " + " ".join(sys.argv[1:])
    result = {"command": cmd.strip(), "torch": torch.__version__,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
              "threads": args.threads, "shape": args.shape, "model": model_kwargs,
              "micro_batch_size": mbs, "num_microbatches": m,
              "reference": "benchmarks/plain_llama.py (torch only, no tinytron code)",
              "seconds_per_step_median": {c: {k: statistics.median(v) for k, v in t.items()}
                                          for c, t in times.items()},
              "ratio_tinytron_over_reference": ratio, "per_round": times, "first_loss": first}
    if args.profile:
        result["profile_top_ops"] = {k: profile_table(s, batches, args.steps)
                                     for k, s in sides.items()}
    result["load_average_before_after"] = [load_before, os.getloadavg()]
    out = Path(args.out or Path(__file__).resolve().parent / "results" /
               ("model.json" if args.shape == "bench" else f"model_{args.shape}.json"))
    out.write_text(json.dumps(result, indent=2))
    print(f"GPTModel fwd+bwd+AdamW / independent plain Llama: {ratio['cpu']:.3f} (CPU time), "
          f"{ratio['wall']:.3f} (wall); goal <= 1.00; first losses {first}")
    if args.profile:
        for k, rows in result["profile_top_ops"].items():
            print(f"-- {k}: top ops, self CPU ms per step")
            for r in rows[:12]:
                print(f"   {r['op']:<40} {r['self_ms_per_step']:8.1f}  x{r['calls_per_step']:.0f}")
    print(f"load average {load_before} -> {result['load_average_before_after'][1]}")
    print(f"command: {cmd.strip()}  -> {out}")


if __name__ == "__main__":
    main()
