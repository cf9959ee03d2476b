"""The model alone: GPTModel forward + backward + AdamW against an independent plain-PyTorch Llama.

The same step on both sides, on the same token batches: forward to the per-token loss
(GPTModel with ``labels=``; the reference's logits through ``F.cross_entropy``), the token-mean
loss, backward, ``clip_grad_norm_(foreach=True)``, ``torch.optim.AdamW(foreach=True)``, one
host read of the loss. The reference (benchmarks/plain_llama.py) imports nothing from tinytron.
The sides alternate round by round; the ratio is the median of per-round ratios, in this
process's CPU time (one thread: robust on a loaded machine) and in wall time.

``--profile`` adds a torch.profiler table of both sides (self CPU time per op, per step), to
see where a gap lies. ``--parts`` times the pieces of one micro-batch side by side, forward and
backward each: the embedding, one attention block (norm, QKV, RoPE, attention, output
projection), one MLP block (norm, SwiGLU), one whole layer, and the head (final norm, output
layer, loss); each side gets the same values in its own layout ([s, b, h] for tinytron,
[b, s, h] for the reference).

Run: python benchmarks/bench_model.py [--shape bench|tiny] [--rounds 7] [--steps 3] [--profile]
                                      [--parts] [--keep-freed-memory]
Writes benchmarks/results/model.json (model_tiny.json for --shape tiny; a _keep suffix with
--keep-freed-memory).
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

from bench_train import LR, WD, CLIP, SHAPES, keep_freed_memory  # noqa: E402


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


def part_pairs(t_side: TinytronSide, r_side: ReferenceSide, tokens, labels) -> dict:
    """{part: (tinytron fn, reference fn)}: one micro-batch's piece, forward and backward."""
    import torch.nn.functional as F

    t, r = t_side.model, r_side.trainer.model
    b, s = tokens.shape
    xb = torch.randn(b, s, t.config.hidden_size, requires_grad=True)   # the reference's layout
    xs = xb.detach().transpose(0, 1).contiguous().requires_grad_()     # tinytron's [s, b, h]
    cos, sin = t._rope_tables(xs.detach(), None)
    rc, rs = r.cos[:s], r.sin[:s]
    tl, rl = t.decoder.layers[0], r.blocks[0]

    def back(y):
        y.backward(torch.ones_like(y))

    def reference_head():
        logits = F.linear(r.norm(xb), r.tok.weight)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)).backward()

    return {
        "embedding": (lambda: back(t._stage_input(tokens)), lambda: back(r.tok(tokens))),
        "attention block": (lambda: back(tl.self_attention(tl.input_layernorm(xs), cos, sin)),
                            lambda: back(rl.attn(rl.attn_norm(xb), rc, rs))),
        "MLP block": (lambda: back(tl.mlp(tl.pre_mlp_layernorm(xs))),
                      lambda: back(rl.mlp(rl.mlp_norm(xb)))),
        "layer": (lambda: back(tl(xs, cos, sin)), lambda: back(rl(xb, rc, rs))),
        "head and loss": (lambda: t._head(xs, labels).mean().backward(), reference_head),
    }


def time_parts(pairs: dict, rounds: int, repeats: int = 5) -> dict:
    """{part: {"tinytron_ms", "reference_ms", "ratio"}}: CPU time, medians over rounds."""
    out = {}
    for name, (a, c) in pairs.items():
        for f in (a, c):   # warm-up: lazy tables, allocator
            f(), f()
        times = {"tinytron": [], "reference": []}
        for _ in range(rounds):
            for side, f in (("tinytron", a), ("reference", c)):
                c0 = time.process_time()
                for _ in range(repeats):
                    f()
                times[side].append((time.process_time() - c0) / repeats)
        out[name] = {"tinytron_ms": 1e3 * statistics.median(times["tinytron"]),
                     "reference_ms": 1e3 * statistics.median(times["reference"]),
                     "ratio": statistics.median(x / y for x, y in
                                                zip(times["tinytron"], times["reference"]))}
    return out


def main() -> None:
    ap = bench_args(__doc__.splitlines()[0], rounds=7, steps=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--parts", action="store_true", help="also time each piece side by side")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="glibc keeps freed memory mapped, for both sides (bench_train's note)")
    args = ap.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()
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
              "keep_freed_memory": args.keep_freed_memory,
              "micro_batch_size": mbs, "num_microbatches": m,
              "reference": "benchmarks/plain_llama.py (torch only, no tinytron code)",
              "seconds_per_step_median": {c: {k: statistics.median(v) for k, v in t.items()}
                                          for c, t in times.items()},
              "ratio_tinytron_over_reference": ratio, "per_round": times, "first_loss": first}
    if args.profile:
        result["profile_top_ops"] = {k: profile_table(s, batches, args.steps)
                                     for k, s in sides.items()}
    if args.parts:
        result["parts_of_one_micro_batch_fwd_bwd"] = time_parts(
            part_pairs(sides["tinytron"], sides["reference"], *batches[0]), args.rounds)
    result["load_average_before_after"] = [load_before, os.getloadavg()]
    name = "model" + ("" if args.shape == "bench" else f"_{args.shape}") + (
        "_keep" if args.keep_freed_memory else "")
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"{name}.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"GPTModel fwd+bwd+AdamW / independent plain Llama: {ratio['cpu']:.3f} (CPU time), "
          f"{ratio['wall']:.3f} (wall); goal <= 1.00; first losses {first}")
    if args.profile:
        for k, rows in result["profile_top_ops"].items():
            print(f"-- {k}: top ops, self CPU ms per step")
            for r in rows[:12]:
                print(f"   {r['op']:<40} {r['self_ms_per_step']:8.1f}  x{r['calls_per_step']:.0f}")
    if args.parts:
        print("-- one micro-batch, forward + backward, CPU ms (tinytron / reference = ratio)")
        for name, r in result["parts_of_one_micro_batch_fwd_bwd"].items():
            print(f"   {name:<16} {r['tinytron_ms']:7.2f} / {r['reference_ms']:7.2f} = "
                  f"{r['ratio']:.3f}")
    print(f"load average {load_before} -> {result['load_average_before_after'][1]}")
    print(f"command: {cmd.strip()}  -> {out}")


if __name__ == "__main__":
    main()
