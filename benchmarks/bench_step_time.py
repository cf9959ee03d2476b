"""Chapter 07.14: the overlap-aware step-time model against a traced run of the trainer on CPU.

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
and one iteration's lanes, which the page draws and re-predicts from); with --out, only the
results file, there.

`--device cuda` runs the same two cases on 2 GPUs with NCCL (the trainer with
`--training.device cuda`): one micro-batch timed with CUDA events, NCCL's all-reduce and
send/recv between the two GPUs at three sizes (latency and bandwidth by least squares, the
all-reduce's for dp2, the send/recv's for pp2), every step bracketed by a synchronize so that
the traced `iteration-N` range is the step on the GPU; the measured idle time is the step minus
the union of the compute kernels (NCCL's left out). It needs 2 GPUs: with fewer it prints one
line saying so and exits 0. Its results go to benchmarks/results/step_time_cuda.json unless
--out says otherwise.

`--published` runs no trainer: it predicts every row of Megatron-LM's published H100
weak-scaling table (README at e03878b5f) with the model's default H100 constants (page 07.14)
and writes published, predicted and their ratio to benchmarks/results/step_time_published.json.

    OMP_NUM_THREADS=1 python benchmarks/bench_step_time.py [--iters 16] [--out FILE]
    python benchmarks/bench_step_time.py --device cuda [--summary FILE.md]
    python benchmarks/bench_step_time.py --published
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
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


def measure_case(name: str, iters: int, root: str, device: str = "cpu") -> dict:
    """Calibrate, trace, predict one case; the summary the page and the results file keep."""
    argv = MODEL + CASES[name] + ["--training.train_iters", str(iters)]
    if device == "cuda":
        argv += ["--training.device", "cuda"]
    save = ["--checkpoint.save", os.path.join(root, name)]
    if device == "cuda":
        ranks = run_on_ranks(calibrate_and_trace_cuda, 2, argv + save, root, BUCKET,
                             backend="nccl", timeout=600)
    else:
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
    predicted = predict_cuda_case(case, name) if device == "cuda" else predict_cpu_case(case)
    case["predicted"] = {"step_s": predicted.total, "compute_s": predicted.compute,
                         "bubble_s": predicted.bubble, "optimizer_s": predicted.optimizer,
                         "exposed_s": predicted.exposed,
                         "idle_s": predicted.bubble + predicted.exposed,
                         "items": {i.item: i.exposed for i in predicted.items if i.seconds}}
    case["step_error"] = predicted.total / step - 1
    return case


# -- the same comparison on 2 GPUs with NCCL --------------------------------------------------

def _cuda_seconds(fn, repeats: int = 3) -> float:
    """Median wall seconds of fn() between two synchronizes, after a barrier (both ranks)."""
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return _median(times)


def _event_seconds(fn, repeats: int = 3) -> float:
    """Median seconds of fn() on the current stream, timed with CUDA events."""
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return _median(times)


class CudaCalibration:
    """The model's inputs on a GPU: a micro-batch (CUDA events), NCCL all-reduce and send/recv."""

    def __init__(self, model_config, micro_batch_size: int, sizes: list[int], bf16: bool):
        import torch
        import torch.distributed as dist
        from tinytron.model import GPTModel

        torch.manual_seed(0)
        device = torch.device("cuda", torch.cuda.current_device())
        model = GPTModel(model_config).to(device, torch.bfloat16 if bf16 else torch.float32)
        tokens = torch.randint(0, model_config.vocab_size,
                               (micro_batch_size, model_config.seq_length), device=device)
        self.microbatch = lambda: model(tokens, labels=torch.roll(tokens, -1, 1)).mean().backward()
        self.rank, self.sizes = dist.get_rank(), sizes
        self.buffers = {n: torch.ones(n, device=device) for n in sizes}
        self.memory = [torch.ones(4 * 2**20, device=device) for _ in range(3)]
        self.samples: list[dict] = []

    def _p2p(self, buf):
        import torch.distributed as dist

        return lambda: dist.send(buf, 1) if self.rank == 0 else dist.recv(buf, 0)

    def sample(self) -> None:
        import torch
        import torch.distributed as dist

        a, b, c = self.memory
        row = {"microbatch_s": _event_seconds(self.microbatch),
               "memory_bandwidth": 12 * a.numel() / _event_seconds(
                   lambda: torch.add(a, b, out=c))}
        background = self.buffers[self.sizes[-1]]
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # the compute stream's time with NCCL's stream busy beside it
        work = dist.all_reduce(background, async_op=True)
        self.microbatch()
        end.record()
        work.wait()
        torch.cuda.synchronize()
        row["microbatch_with_comm_s"] = start.elapsed_time(end) / 1e3
        for n, buf in self.buffers.items():
            row[f"all_reduce@{n}"] = _cuda_seconds(lambda: dist.all_reduce(buf))
            row[f"p2p@{n}"] = _cuda_seconds(self._p2p(buf))
        self.samples.append(row)

    def summary(self, skip: int) -> dict:
        rows = self.samples[skip:] or self.samples
        med = {k: _median([r[k] for r in rows]) for k in rows[0]}
        return {"microbatch_s": med["microbatch_s"], "memory_bandwidth": med["memory_bandwidth"],
                "microbatch_with_comm_s": med["microbatch_with_comm_s"],
                "background_numel": self.sizes[-1],
                "collectives": [{"numel": n, "all_reduce": med[f"all_reduce@{n}"],
                                 "p2p": med[f"p2p@{n}"]} for n in self.sizes],
                "samples": len(rows)}


def _synchronized_reliability(original, steps: dict, between):
    """tinytron.train._reliability with every train_step inside `iteration-N`, synchronized."""
    import torch
    from torch.profiler import record_function

    def make(cfg, out_dir):
        rel = original(cfg, out_dir)
        start, end = rel.on_step_start, rel.on_step_end
        open_ranges = []

        def on_step_start(state):
            torch.cuda.synchronize()
            steps[state.iteration + 1] = time.perf_counter()
            open_ranges.append(record_function(f"iteration-{state.iteration + 1}"))
            open_ranges[-1].__enter__()
            start(state)

        def on_step_end(state):
            end(state)
            torch.cuda.synchronize()
            open_ranges.pop().__exit__(None, None, None)
            it = max(steps)
            steps[it] = time.perf_counter() - steps[it]
            with record_function("calibration"):
                between()

        rel.on_step_start, rel.on_step_end = on_step_start, on_step_end
        return rel
    return make


def _kernel_lanes(trace_path: str, steps: dict) -> list[dict]:
    """Per traced iteration: its step and the union of its compute kernels (NCCL's left out)."""
    from tinytron.memory._step_trace import _merge

    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    out = []
    for it in sorted(steps):
        rng = next((e for e in events if e["name"] == f"iteration-{it}"
                    and e.get("cat") != "gpu_user_annotation"), None)
        if rng is None:
            continue
        t0, t1 = float(rng["ts"]), float(rng["ts"]) + float(rng["dur"])
        kernels = [e for e in events if e.get("cat") == "kernel"
                   and t0 <= float(e["ts"]) <= t1]
        compute = [((float(e["ts"]) - t0) / 1e3, (float(e["ts"]) + float(e["dur"]) - t0) / 1e3)
                   for e in kernels if "nccl" not in e["name"].lower()]
        comm = [{"name": e["name"], "start": (float(e["ts"]) - t0) / 1e3,
                 "end": (float(e["ts"]) + float(e["dur"]) - t0) / 1e3}
                for e in kernels if "nccl" in e["name"].lower()]
        busy = _merge(compute, 0.0)
        out.append({"iteration": it, "step_ms": steps[it] * 1e3,
                    "busy_ms": sum(b - a for a, b in busy), "compute": [list(x) for x in busy],
                    "comm": sorted(comm, key=lambda c: c["start"])})
    return out


def calibrate_and_trace_cuda(argv: list[str], out_dir: str, bucket_numel: int) -> dict:
    """Per GPU rank: the trainer under torch.profiler (CPU + CUDA), the inputs in between."""
    import torch
    import torch.distributed as dist
    import tinytron.train as train
    from torch.profiler import ProfilerActivity, profile

    cfg = train.resolve_config(argv, dist.get_world_size())
    small = cfg.model.seq_length * cfg.training.micro_batch_size * cfg.model.hidden_size
    calibration = CudaCalibration(cfg.model, cfg.training.micro_batch_size,
                                  [small, bucket_numel, 4 * bucket_numel], cfg.training.bf16)
    calibration.sample()  # warm NCCL's channels and the kernels' caches before the run
    calibration.samples.clear()
    steps: dict[int, float] = {}
    original = train._reliability
    train._reliability = _synchronized_reliability(original, steps, calibration.sample)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            code = train.run(cfg, argv, "step_time")
    finally:
        train._reliability = original
    path = os.path.join(out_dir, f"trace_rank{dist.get_rank()}.json")
    prof.export_chrome_trace(path)
    return {"rank": dist.get_rank(), "code": code, "calibration": calibration.summary(skip=2),
            "iterations": _kernel_lanes(path, {i: s for i, s in steps.items() if i >= 2})}


def cuda_links(calibration: dict, flops_per_microbatch: float, kind: str):
    """Links from the GPU measurements: latency + bytes / bandwidth fitted to `kind`'s times.

    On 2 ranks a ring all-reduce moves 2 (g - 1) / g = 1 times its bytes per link, a send 1
    time, so both fits give the link's bandwidth directly.
    """
    from tinytron.memory.step_published import cpu_links  # the same fit, on NCCL's timings

    return cpu_links(calibration, flops_per_microbatch, kind, reduce_scatter_as_all_reduce=False)


def predict_cuda_case(case: dict, name: str):
    """The model's step for one recorded GPU case: dp2 on the all-reduce fit, pp2 on send/recv."""
    from tinytron.config import load_config
    from tinytron.main_loop.training_log import num_floating_point_operations
    from tinytron.memory.calculator import memory_config_from
    from tinytron.memory.step_time import StepOptions, estimate_step

    train = load_config(None, case["argv"])
    cfg = memory_config_from(train, 2, device="cuda")
    options = StepOptions(overlap_grad_reduce=train.ddp.overlap_grad_reduce,
                          overlap_param_gather=train.ddp.overlap_param_gather,
                          checkpoint="none")
    flops = num_floating_point_operations(cfg.model, cfg.micro_batch_size)
    kind = "p2p" if name == "pp2" else "all_reduce"
    return estimate_step(cfg, cuda_links(case["calibration"], flops, kind), options)


def gpus_missing() -> str | None:
    """None when 2 GPUs are visible, else the one line that says what was found."""
    try:
        import torch
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        found = 0
    if found >= 2:
        return None
    return (f"bench_step_time --device cuda needs 2 GPUs (DP2 and PP2 over NCCL), found {found}:"
            " skipped")


def summary_markdown(out: dict) -> str:
    """Predicted vs measured step time and the error per layout, as a Markdown table."""
    lines = [f"{out['device']} ({out['machine']}), `{out['command']}`:", "",
             "| layout | measured step | predicted step | error | measured idle "
             "| predicted bubble + exposed |", "|---|---:|---:|---:|---:|---:|"]
    for name, c in out["cases"].items():
        p = c["predicted"]
        lines.append(f"| {name} | {c['measured_step_s'] * 1e3:.2f} ms | {p['step_s'] * 1e3:.2f} ms "
                     f"| {c['step_error']:+.1%} | {c['measured_idle_s'] * 1e3:.2f} ms "
                     f"| {p['idle_s'] * 1e3:.2f} ms |")
    return "\n".join(lines) + "\n"


def published(path: Path) -> int:
    """Predict every row of Megatron's published table; write the comparison to `path`."""
    from tinytron.kernels.roofline import KernelLaw
    from tinytron.memory.step_published import (PUBLISHED, finest_virtual_stages,
                                                predict_published)
    from tinytron.memory.step_time import Links

    links = Links()
    rows = []
    for run in PUBLISHED:
        row = predict_published(run, finest_virtual_stages(run), links)
        if run.pp > 1:
            plain = predict_published(run, None, links)
            row["without_interleaving"] = {k: plain[k] for k in ("step_s", "predicted_tflops",
                                                                 "ratio")}
        rows.append(row)
        print(f"{run.name:>5}: published {run.tflops:.1f}, predicted "
              f"{row['predicted_tflops']:.1f} TFLOP/s per GPU, ratio {row['ratio']:.3f}")
    law = KernelLaw()
    out = {"command": "python benchmarks/bench_step_time.py --published",
           "source": "Megatron-LM README at e03878b5f, images/model_table.png (H100)",
           "constants": {"law": {"gpu": law.gpu.name, "peak_flops": law.gpu.bf16_flops,
                                 "hbm_bytes_per_s": law.gpu.hbm_bytes_per_s, "sms": law.gpu.sms,
                                 "tensor_fraction": law.tensor_fraction,
                                 "memory_fraction": law.memory_fraction,
                                 "attention_fraction": law.attention_fraction,
                                 "tiles": law.tiles},
                         "nvlink": links.nvlink, "network": links.network,
                         "gpus_per_node": links.gpus_per_node,
                         "interference": links.interference},
           "assumptions": {"micro_batch_size": 1, "recompute": None,
                           "virtual_stages": "one layer each (the finest); 1F1B beside it",
                           "grad_reduce": "bf16", "mlp": "SwiGLU with f = 8h/3 (GeLU 4h FLOPs)",
                           "options": ["overlap_grad_reduce", "overlap_param_gather",
                                       "tp_comm_overlap", "overlap_p2p_comm (interleaved)"]},
           "within_10_percent": sum(abs(r["ratio"] - 1) <= 0.10 for r in rows), "rows": rows}
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--published", action="store_true",
                    help="predict Megatron's published H100 table (no run) and write "
                    "benchmarks/results/step_time_published.json (or --out)")
    ap.add_argument("--iters", type=int, default=16,
                    help="trainer iterations per case (>= 3: iterations 3..N are timed)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", help="the results JSON (default benchmarks/results/step_time.json, "
                    "or step_time_cuda.json with --device cuda); with --out the page's asset "
                    "chapters/assets/step_time_cpu.json is left alone")
    ap.add_argument("--summary", help="also write the Markdown table of predicted vs measured "
                    "step time per layout here")
    args = ap.parse_args()
    if args.published:
        return published(Path(args.out) if args.out else
                         ROOT / "benchmarks" / "results" / "step_time_published.json")
    if args.iters < 3:
        ap.error(f"--iters must be >= 3 (iterations 3..N are timed), got {args.iters}")
    if args.device == "cuda" and (missing := gpus_missing()):
        print(missing, flush=True)
        if args.summary:
            Path(args.summary).write_text(missing + "\n")
        return 0
    command = (f"python benchmarks/bench_step_time.py --device cuda --iters {args.iters}"
               if args.device == "cuda" else
               f"OMP_NUM_THREADS=1 python benchmarks/bench_step_time.py --iters {args.iters}")
    if args.device == "cuda":
        import torch
        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, NCCL"
    else:
        device = "CPU, gloo"
    out = {"command": command, "device": device,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average "
                      f"{os.getloadavg()[0]:.1f} at the start", "cases": {}}
    with tempfile.TemporaryDirectory() as root:
        for name in CASES:
            case = measure_case(name, args.iters, root, args.device)
            out["cases"][name] = case
            p = case["predicted"]
            print(f"{name}: measured step {case['measured_step_s'] * 1e3:.1f} ms (idle "
                  f"{case['measured_idle_s'] * 1e3:.1f}), predicted {p['step_s'] * 1e3:.1f} ms "
                  f"(bubble + exposed {p['idle_s'] * 1e3:.1f}): error {case['step_error']:+.1%}",
                  flush=True)
    results = {k: v for k, v in out.items()}
    results["cases"] = {n: {k: v for k, v in c.items() if k != "lanes"}
                        for n, c in out["cases"].items()}
    default = "step_time_cuda.json" if args.device == "cuda" else "step_time.json"
    path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / default
    path.write_text(json.dumps(results, indent=1) + "\n")
    wrote = [str(path)]
    if args.device == "cpu" and not args.out:
        (ROOT / "chapters" / "assets" / "step_time_cpu.json").write_text(json.dumps(out) + "\n")
        wrote.append("chapters/assets/step_time_cpu.json")
    if args.summary:
        Path(args.summary).write_text(summary_markdown(results))
        wrote.append(args.summary)
    print("wrote " + " and ".join(wrote))
    return 0


if __name__ == "__main__":
    sys.exit(main())
