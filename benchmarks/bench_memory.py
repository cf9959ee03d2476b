"""Chapter 07: the memory ledger against measurement, and the speed of `tinytron-memory --search`.

1. Prediction error: the 42 cases of `tinytron.memory.measured.VALIDATION_GRID` (tiny model,
   two 4-rank gloo worlds) plus LARGER_GRID (hidden 256, sequence 256, vocab 4096: the same
   mechanisms at a size where activations dwarf the per-op transients), measured with chapter
   01's LiveBytesMeter and storage_bytes; per term, the max and median relative error of the
   ledger and of Megatron's estimate.
2. Search time: `search_layouts` over the book's 7B example on 256 GPUs with 80 GiB (median
   of --repeats in-process runs), and the wall time of the console command (one process:
   Python start, `import torch`, the search, the printout).

Writes benchmarks/results/memory.json.

    python benchmarks/bench_memory.py [--repeats 5] [--skip-grid]

--skip-grid only re-times the search and updates that entry of an existing results file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

_MID = dict(hidden_size=256, seq_length=256, ffn_hidden_size=512, vocab_size=4096,
            num_attention_heads=8, num_query_groups=4)
LARGER_GRID = [
    {"num_layers": 4, "distopt": True, **_MID},
    {"num_layers": 4, "tp": 2, "sp": True, "pp": 2, "m": 4, **_MID},
    {"num_layers": 4, "pp": 4, "m": 8, **_MID},
    {"num_layers": 8, "pp": 2, "vpp": 2, "m": 4, "distopt": True, **_MID},
    {"num_layers": 4, "cp": 2, "tp": 2, "sp": True, "mbs": 2, **_MID},
    {"num_layers": 4, "recompute": "full", "method": "uniform", "recompute_layers": 2,
     "pp": 2, "m": 4, **_MID},
]


def _grid_errors(skip: bool) -> dict:
    """Run both grids; the per-term error table of the ledger and Megatron, and counts."""
    from tinytron.memory.measured import VALIDATION_GRID, compare, error_table, run_grid

    if skip:
        return {}
    half = len(VALIDATION_GRID) // 2
    t0 = time.perf_counter()
    tiny = compare(run_grid(VALIDATION_GRID[:half]) + run_grid(VALIDATION_GRID[half:]))
    larger = compare(run_grid(LARGER_GRID))
    kept = [r for r in tiny + larger if r["term"] == "kept_activations"]
    return {"tiny_grid": {"cases": len(VALIDATION_GRID), "errors": error_table(tiny)},
            "larger_grid": {"cases": len(LARGER_GRID), "errors": error_table(larger)},
            "kept_activations_exact": [sum(r["measured"] == r["predicted"] for r in kept),
                                       len(kept)],
            "grid_wall_s": round(time.perf_counter() - t0, 1)}


def _search_times(repeats: int) -> dict:
    """In-process search time (median, best) and the console command's wall time."""
    from tinytron.memory.calculator import parse_bytes, running_example, search_layouts

    times, found = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        found = search_layouts(running_example(), 256, parse_bytes("80GiB"), 1024)
        times.append(time.perf_counter() - t0)
    exe = shutil.which("tinytron-memory")
    cmd = [exe] if exe else [sys.executable, "-c", "import sys; from tinytron.memory.calculator "
                                                    "import main; sys.exit(main())"]
    t0 = time.perf_counter()
    subprocess.run([*cmd, "--example", "--search", "--gpus", "256", "--gpu-memory", "80GiB"],
                   check=True, capture_output=True)
    command_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    torch_import_s = time.perf_counter() - t0
    return {"search_median_s": round(statistics.median(times), 3),
            "search_best_s": round(min(times), 3), "repeats": repeats,
            "command_wall_s": round(command_s, 2),
            "python_import_torch_s": round(torch_import_s, 2),
            "best_layouts": [f["layout"] for f in found[:3]]}


def _print(out: dict) -> None:
    for grid in ("tiny_grid", "larger_grid"):
        if grid not in out:
            continue
        print(f"\n{grid}: {out[grid]['cases']} cases x 4 ranks")
        print(f"{'term':<22}{'n':>5}{'ledger max':>12}{'median':>10}{'Megatron max':>14}"
              f"{'median':>10}")
        for term, e in out[grid]["errors"].items():
            meg = (f"{e['megatron_max']:>14.1%}{e['megatron_median']:>10.1%}"
                   if e["megatron_max"] is not None else "")
            print(f"{term:<22}{e['n']:>5}{e['ledger_max']:>12.3%}{e['ledger_median']:>10.3%}{meg}")
    if "kept_activations_exact" in out:
        exact, n = out["kept_activations_exact"]
        print(f"kept activations exact to the byte: {exact} of {n}")
    s = out["search"]
    print(f"\nsearch (7B, 256 GPUs, 80 GiB): median {s['search_median_s']} s, best "
          f"{s['search_best_s']} s in-process; the command {s['command_wall_s']} s wall "
          f"(of which `import torch` alone: {s['python_import_torch_s']} s)")
    print(f"command: {out['command']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-grid", action="store_true", help="only time the search")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = {"command": "python benchmarks/bench_memory.py" + (" --skip-grid" if args.skip_grid
                                                             else ""),
           **_grid_errors(args.skip_grid), "search": _search_times(args.repeats),
           "machine": f"{platform.machine()} {platform.processor() or ''} "
                      f"{os.cpu_count()} cpus, python {platform.python_version()}".strip(),
           "load_average_1min_at_end": round(os.getloadavg()[0], 2),
           "wall_s": round(time.perf_counter() - t0, 1)}
    _print(out)
    path = Path(args.out)
    if args.skip_grid and path.exists():  # keep the grid's table, refresh the timing
        out = {**json.loads(path.read_text()), "search": out["search"],
               "search_load_average_1min": out["load_average_1min_at_end"]}
    path.write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
