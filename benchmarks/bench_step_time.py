"""Chapter 07.8: the overlap-aware step-time model against a traced run of the trainer on CPU.

Two runs of tinytron.train on 2 gloo ranks, each recorded with chapter 08's tracer
(torch.profiler, one `iteration-N` range per train_step):

- dp2: DP2, distributed optimizer, overlap_grad_reduce + overlap_param_gather, 1 M-element
  buckets (4 buckets of the 3.2 M-parameter model);
- pp2: PP2 (1F1B), 4 micro-batches per step.

Between two traced iterations the same two ranks sample the model's inputs: one
micro-batch's forward + backward of the same model alone, gloo's bucket collective at three
sizes (latency and bandwidth by least squares), the memory bandwidth of an elementwise add;
their medians over iterations 3..N are the inputs (the same load and profiler as the run). The page's model
(`tinytron.memory.step_time`) predicts the step and its exposed communication from them;
the measured step is the median over the traced iterations 3..N (iteration 1 allocates,
iteration 2 is the first with warm caches), the measured idle time is the step minus the
main thread's busy time (the union of its operators): the model's bubble + exposed.

Writes benchmarks/results/step_time.json and chapters/assets/step_time_cpu.json (the inputs
and one iteration's lanes, which the page draws and re-predicts from).

    OMP_NUM_THREADS=1 python benchmarks/bench_step_time.py [--iters 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from tinytron.launch import run_on_ranks
from tinytron.memory._step_trace import calibrate_and_trace
from tinytron.memory._step_time_io import predict_cpu_case

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--model.hidden_size", "256", "--model.num_layers", "4",
         "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
         "--model.ffn_hidden_size", "704", "--model.vocab_size", "512",
         "--model.seq_length", "64", "--training.micro_batch_size", "2",
         "--training.global_batch_size", "8", "--training.log_interval", "100",
         "--training.eval_interval", "none", "--training.save_interval", "none",
         "--data.split", '"98,2,0"', "--data.num_workers", "0", "--optimizer.lr", "1e-3",
         "--logging.progress_bar", "false", "--ddp.overlap_grad_reduce", "true",
         "--optimizer.use_distributed_optimizer", "true"]
CASES = {"dp2": ["--ddp.bucket_size", "1000000", "--ddp.overlap_param_gather", "true"],
         "pp2": ["--parallel.pipeline_model_parallel_size", "2"]}
BUCKET = 1_000_000


def _median(values):
    return statistics.median(values)


def measure_case(name: str, iters: int, root: str) -> dict:
    """Calibrate, trace, predict one case; the summary the page and the results file keep."""
    argv = MODEL + CASES[name] + ["--training.train_iters", str(iters)]
    save = ["--checkpoint.save", os.path.join(root, name)]
    ranks = run_on_ranks(calibrate_and_trace, 2, argv + save, root, BUCKET, timeout=1800)
    slow = max(ranks, key=lambda r: r["calibration"]["microbatch_s"])  # the pace of the step
    calibration = dict(slow["calibration"])
    calibration["microbatch_s_per_rank"] = [r["calibration"]["microbatch_s"] for r in ranks]
    timed = [it for it in ranks[0]["iterations"] if it["iteration"] >= 3]
    step = _median([it["step_ms"] for it in timed]) / 1e3
    idle = _median([it["step_ms"] - it["busy_ms"] for it in timed]) / 1e3
    shown = min(timed, key=lambda it: abs(it["step_ms"] / 1e3 - step))
    case = {"argv": argv, "calibration": calibration, "measured_step_s": step,
            "measured_idle_s": idle,
            "measured_steps_s": [it["step_ms"] / 1e3 for it in timed],
            "lanes": {"rank0": shown, "rank1": next(it for it in ranks[1]["iterations"]
                                                  if it["iteration"] == shown["iteration"])}}
    predicted = predict_cpu_case(case)
    case["predicted"] = {"step_s": predicted.total, "compute_s": predicted.compute,
                         "bubble_s": predicted.bubble, "optimizer_s": predicted.optimizer,
                         "exposed_s": predicted.exposed,
                         "idle_s": predicted.bubble + predicted.exposed,
                         "items": {i.item: i.exposed for i in predicted.items if i.seconds}}
    case["step_error"] = predicted.total / step - 1
    return case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=16)
    args = ap.parse_args()
    out = {"command": "OMP_NUM_THREADS=1 python benchmarks/bench_step_time.py "
                      f"--iters {args.iters}",
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average "
                      f"{os.getloadavg()[0]:.1f} at the start", "cases": {}}
    with tempfile.TemporaryDirectory() as root:
        for name in CASES:
            case = measure_case(name, args.iters, root)
            out["cases"][name] = case
            p = case["predicted"]
            print(f"{name}: measured step {case['measured_step_s'] * 1e3:.1f} ms (idle "
                  f"{case['measured_idle_s'] * 1e3:.1f}), predicted {p['step_s'] * 1e3:.1f} ms "
                  f"(bubble + exposed {p['idle_s'] * 1e3:.1f}): error {case['step_error']:+.1%}",
                  flush=True)
    results = {k: v for k, v in out.items()}
    results["cases"] = {n: {k: v for k, v in c.items() if k != "lanes"}
                        for n, c in out["cases"].items()}
    (ROOT / "benchmarks" / "results" / "step_time.json").write_text(
        json.dumps(results, indent=1) + "\n")
    (ROOT / "chapters" / "assets" / "step_time_cpu.json").write_text(json.dumps(out) + "\n")
    print("wrote benchmarks/results/step_time.json and chapters/assets/step_time_cpu.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
