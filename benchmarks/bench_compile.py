"""`[model] compile` against eager and against an independent plain-PyTorch Llama, side by side.

Four sides take the same training step on the same token batches (forward to the loss,
backward, ``clip_grad_norm_(foreach=True)``, ``AdamW(foreach=True)``, one host read of the
loss), the step of ``bench_model.py``:

- ``tinytron_eager``: GPTModel as the trainer builds it with ``compile = false``;
- ``tinytron_compiled``: the same model with every layer compiled in place
  (``tinytron.model._compile.compile_layers``, what ``--model.compile true`` calls);
- ``reference``: benchmarks/plain_llama.py, torch modules only, no tinytron code;
- ``reference_compiled``: the same plain model with each of its blocks compiled the same way,
  so that compiled is also held against compiled.

The compile happens in the warm-up steps, which are timed apart (``warmup_seconds``) and left out
of the rounds (a cold compile of the bench shape took ~90 s on a loaded 2-core machine; once
inductor's on-disk cache holds the graphs, a few seconds). The sides then alternate round by round; each ratio is the median of the per-round
ratios, in this process's CPU time (one thread: robust on a loaded machine) and in wall time.

Run: python benchmarks/bench_compile.py [--shape bench|tiny] [--rounds 5] [--steps 2]
Writes benchmarks/results/compile.json (compile_tiny.json for --shape tiny).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import (ReferenceSide, TinytronSide, batches_for, bench_args,  # noqa: E402
                         time_rounds)
from bench_train import SHAPES  # noqa: E402

RATIOS = {  # name -> (numerator side, denominator side)
    "compiled_over_eager": ("tinytron_compiled", "tinytron_eager"),
    "compiled_over_reference": ("tinytron_compiled", "reference"),
    "eager_over_reference": ("tinytron_eager", "reference"),
    "compiled_over_reference_compiled": ("tinytron_compiled", "reference_compiled"),
    "reference_compiled_over_reference": ("reference_compiled", "reference"),
}


def build_sides(model_kwargs: dict) -> dict:
    from tinytron.model._compile import compile_layers

    sides = {"tinytron_eager": TinytronSide(model_kwargs)}
    sides["tinytron_compiled"] = TinytronSide(model_kwargs)
    compile_layers(sides["tinytron_compiled"].model)
    for name in ("reference", "reference_compiled"):  # the same weights: its init reads torch's seed
        torch.manual_seed(0)
        sides[name] = ReferenceSide(model_kwargs)
    for block in sides["reference_compiled"].trainer.model.blocks:
        block.compile()
    return sides


def main() -> None:
    args = bench_args(__doc__.splitlines()[0], rounds=5, steps=2).parse_args()
    torch.set_num_threads(args.threads)
    model_kwargs, mbs, gbs = SHAPES[args.shape]
    m = gbs[1] // mbs
    load_before = os.getloadavg()
    torch.manual_seed(0)
    sides = build_sides(model_kwargs)
    batches = batches_for(model_kwargs, mbs, m)
    first, warmup = {}, {}
    for name, side in sides.items():  # warm-up: the compile, lazy init, the allocator
        w0 = time.perf_counter()
        first[name] = side.step(batches)
        side.step(batches)
        warmup[name] = time.perf_counter() - w0
    times = time_rounds(sides, batches, args.rounds, args.steps)
    ratios = {c: {r: statistics.median(a / b for a, b in zip(t[num], t[den]))
                  for r, (num, den) in RATIOS.items()} for c, t in times.items()}
    cmd = ("python benchmarks/bench_compile.py " + " ".join(sys.argv[1:])).strip()
    result = {"command": cmd, "torch": torch.__version__,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
              "inductor_backend": "C++ (CPU)", "threads": args.threads, "shape": args.shape,
              "model": model_kwargs, "micro_batch_size": mbs, "num_microbatches": m,
              "reference": "benchmarks/plain_llama.py (torch only, no tinytron code)",
              "seconds_per_step_median": {c: {k: statistics.median(v) for k, v in t.items()}
                                          for c, t in times.items()},
              "ratios": ratios, "warmup_seconds_two_steps": warmup,
              "first_loss": first, "per_round": times,
              "load_average_before_after": [load_before, os.getloadavg()]}
    out = Path(args.out or Path(__file__).resolve().parent / "results" /
               ("compile.json" if args.shape == "bench" else f"compile_{args.shape}.json"))
    out.write_text(json.dumps(result, indent=2))
    for r in RATIOS:
        print(f"{r:34s} {ratios['cpu'][r]:.3f} (CPU time)  {ratios['wall'][r]:.3f} (wall)")
    print("warm-up (two steps, the compile included), s: "
          + ", ".join(f"{k} {v:.1f}" for k, v in warmup.items()))
    print(f"first losses {first}")
    print(f"load average {load_before} -> {result['load_average_before_after'][1]}")
    print(f"command: {cmd}  -> {out}")


if __name__ == "__main__":
    main()
