"""What chapter 08's safety nets cost on a healthy run, and what a restart costs.

1. Overhead. The chapter's job (`tinytron.reliability._run`: chapter 01's loop, chapter 03's
   checkpoints, the GPT of appendix B) under torchrun with 2 gloo ranks, everything on — the
   rerun machine validating every micro-batch loss and every gradient bucket (one extra
   all-reduce per step), heartbeats every 0.25 s through the TCPStore, timers at level 1 — vs
   `--no-safety-nets` (machine disabled, no monitor, no timers). Variants alternate round by
   round (on, off, on, off, ...) so that machine load hits both alike; the per-iteration time is
   the loop's own `ms_per_iteration` (log_interval 1) over iterations 3.., no saves in between;
   the ratio is median(on) / median(off) over all timed iterations of all rounds, and the
   ratio of the least disturbed rounds (the smallest per-round median of each variant).
2. Recovery. The same job with SIGKILL on rank 1 at the start of iteration K, under
   `torchrun --max-restarts 1`: seconds from the kill (its timestamp, printed by the fault
   injector just before the signal) to the end of the first iteration after the restart, and to
   the moment iteration K-1 is done again (progress recovered); iterations lost = completed
   iterations since the last checkpoint, computed twice.
3. `--device cuda`: the full-iteration CUDA graph vs eager forward-backward on the tiny GPT
   (same data, same weights), side by side; losses must match.

    python benchmarks/bench_reliability.py [--model tiny|small] [--rounds 3] [--iters 24]
    python benchmarks/bench_reliability.py --device cuda

Writes benchmarks/results/reliability.json (reliability_small.json for --model small,
reliability_cuda.json for --device cuda).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.reliability_workers import run_job  # noqa: E402 - the same launcher as the tests


def _records(save) -> list[dict]:
    path = Path(save) / "losses.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if '"losses"' in x]


def overhead(model: str, rounds: int, iters: int) -> dict:
    """Per-iteration ms with the safety nets on and off, alternating rounds."""
    times, rounds_median = {"on": [], "off": []}, {"on": [], "off": []}
    for r in range(rounds):
        for variant in (("on", "off") if r % 2 == 0 else ("off", "on")):
            save = tempfile.mkdtemp(prefix=f"bench_rel_{variant}_")
            args = ["--model", model, "--train-iters", iters, "--save-interval", 0]
            if variant == "off":
                args.append("--no-safety-nets")
            code, out, _ = run_job(save, args, timeout=900)
            if code != 0:
                raise RuntimeError(f"{variant} run failed:\n{out[-3000:]}")
            ms = [rec["ms_per_iteration"] for rec in _records(save) if rec["iteration"] >= 3]
            times[variant] += ms
            rounds_median[variant].append(statistics.median(ms))
            print(f"round {r} {variant:3s}: median {statistics.median(ms):8.2f} ms/iteration "
                  f"over {len(ms)} iterations", flush=True)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    best_on, best_off = min(rounds_median["on"]), min(rounds_median["off"])
    return {"model": model, "rounds": rounds, "iterations_per_run": iters,
            "median_ms_on": on, "median_ms_off": off, "ratio_on_over_off": on / off,
            "best_round_ms_on": best_on, "best_round_ms_off": best_off,
            "best_round_ratio": best_on / best_off, "goal": 1.02}


def recovery(model: str, kill_at: int, save_interval: int) -> dict:
    """Seconds from a SIGKILL to the first iteration after the automatic restart."""
    save = tempfile.mkdtemp(prefix="bench_rel_kill_")
    args = ["--model", model, "--train-iters", kill_at + 3, "--save-interval", save_interval,
            "--fault", f"kill@{kill_at}:rank=1:attempt=0"]
    code, out, wall = run_job(save, args, max_restarts=1, timeout=900)
    if code != 0:
        raise RuntimeError(f"the killed job did not finish:\n{out[-3000:]}")
    t_kill = float(re.search(r"\[fault\] rank 1: kill at iteration \d+ \(attempt 0\) t=([\d.]+)",
                             out)[1])
    after = [r for r in _records(save) if r["time"] > t_kill]
    last_ckpt = (kill_at - 1) // save_interval * save_interval
    lost = (kill_at - 1) - last_ckpt
    back = next(r for r in after if r["iteration"] == kill_at - 1) if lost else after[0]
    return {"model": model, "kill_at_iteration": kill_at, "save_interval": save_interval,
            "resumed_from_iteration": after[0]["iteration"] - 1,
            "seconds_to_first_iteration_after_restart": after[0]["time"] - t_kill,
            "seconds_to_progress_recovered": back["time"] - t_kill,
            "iterations_lost": lost, "job_wall_seconds": wall}


def cuda_graph(iters: int = 30) -> dict:
    """Eager vs full-iteration CUDA graph on the tiny GPT (CUDA only)."""
    import torch

    from tests.test_reliability_gpu import _train

    eager, t_eager, _ = _train(graphed=False, iters=iters)
    graphed, t_graph, _ = _train(graphed=True, iters=iters)
    e, g = statistics.median(t_eager[5:]), statistics.median(t_graph[5:])
    return {"device": torch.cuda.get_device_name(), "iterations": iters,
            "median_ms_eager": 1e3 * e, "median_ms_graphed": 1e3 * g, "speedup": e / g,
            "max_abs_loss_diff": (eager - graphed).abs().max().item()}


def main() -> None:
    """Run, print the ratios, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["tiny", "small"], default="tiny")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=24)
    p.add_argument("--kill-at", type=int, default=7)
    p.add_argument("--save-interval", type=int, default=4)
    args = p.parse_args()
    meta = {"command": "python " + " ".join(sys.argv), "platform": platform.platform(),
            "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()}
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        result = {**meta, "cuda_graph": cuda_graph()}
        (out_dir / "reliability_cuda.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"full-iteration CUDA graph speed-up: {result['cuda_graph']['speedup']:.2f}x")
        return
    over = overhead(args.model, args.rounds, args.iters)
    rec = recovery(args.model, args.kill_at, args.save_interval)
    result = {**meta, "load_average_at_end": os.getloadavg(), "overhead": over, "recovery": rec}
    name = "reliability.json" if args.model == "tiny" else f"reliability_{args.model}.json"
    (out_dir / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"safety nets on/off: {over['median_ms_on']:.2f} / {over['median_ms_off']:.2f} ms per "
          f"iteration = {over['ratio_on_over_off']:.3f}x; least disturbed rounds "
          f"{over['best_round_ms_on']:.2f} / {over['best_round_ms_off']:.2f} ms = "
          f"{over['best_round_ratio']:.3f}x (goal <= 1.02x)")
    print(f"SIGKILL at iteration {rec['kill_at_iteration']} (checkpoint every "
          f"{rec['save_interval']}): first iteration after restart "
          f"{rec['seconds_to_first_iteration_after_restart']:.1f} s after the kill, progress "
          f"recovered after {rec['seconds_to_progress_recovered']:.1f} s, "
          f"{rec['iterations_lost']} iterations lost")


if __name__ == "__main__":
    main()
