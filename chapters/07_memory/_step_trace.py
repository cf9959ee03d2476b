"""Calibrate and trace a run of tinytron.train on gloo ranks, for the step-time check (07.14).

Not a page: `benchmarks/bench_step_time.py` launches `calibrate_and_trace` on every rank of a
gloo world. It runs the real trainer under torch.profiler (chapter 08's trace) with every
train_step bracketed by an `iteration-N` range, and between two iterations it samples what
the step-time model takes as inputs (one micro-batch's forward + backward of the same model
alone, gloo's bucket collective at three sizes and a p2p send, the memory bandwidth of an
elementwise add), so that the inputs see the same load, and the same profiler, as the
iterations they predict. It reduces the trace to the lanes the page draws.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from tinytron.buffers import _comm


def _microbatch_step(model_config, micro_batch_size: int):
    """A function running one micro-batch's forward + backward of the whole model, no comm."""
    from tinytron.model import GPTModel

    torch.manual_seed(0)
    model = GPTModel(model_config)
    tokens = torch.randint(0, model_config.vocab_size,
                           (micro_batch_size, model_config.seq_length))

    def step():
        model(tokens, labels=torch.roll(tokens, -1, 1)).mean().backward()
    return step


def _collective_fns(numel: int) -> dict:
    """gloo's bucket collectives (chapter 05's _comm) and a p2p on numel fp32 elements."""
    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.ones(numel)
    shard = full.narrow(0, rank * (numel // world), numel // world)  # aliased, as DDP's is

    def rs():
        _comm.reduce_scatter(shard, full, dist.ReduceOp.SUM, None, async_op=False)

    def ag():
        _comm.all_gather(full, shard, None, async_op=False)

    def p2p():
        if rank == 0:
            dist.send(full, 1)
        else:
            dist.recv(full, 0)
    return {"reduce_scatter": rs, "all_gather": ag, "p2p": p2p}


class Calibration:
    """The model's inputs, sampled between the traced iterations (the same load as the run)."""

    def __init__(self, model_config, micro_batch_size: int, sizes: list[int]):
        self.microbatch = _microbatch_step(model_config, micro_batch_size)
        self.collectives = {n: _collective_fns(n) for n in sizes}
        self.background = torch.ones(sizes[-1])  # a bucket collective behind the micro-batch
        self.samples: list[dict] = []

    def sample(self) -> None:
        """One timing of each input (all ranks call it at the same point)."""
        row = {"microbatch_s": _seconds(self.microbatch),
               "memory_bandwidth": _memory_bandwidth(4 * 2**20)}
        dist.barrier()
        t0 = time.perf_counter()
        work = _comm.all_reduce(self.background, dist.ReduceOp.SUM, None, async_op=True)
        self.microbatch()
        row["microbatch_with_comm_s"] = time.perf_counter() - t0
        work.wait()
        dist.barrier()
        for n, fns in self.collectives.items():
            for kind, fn in fns.items():
                row[f"{kind}@{n}"] = _seconds(fn)
        self.samples.append(row)

    def summary(self, skip: int) -> dict:
        """Medians over the samples after the first `skip`, in the form cpu_links reads."""
        rows = self.samples[skip:] or self.samples
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        return {"microbatch_s": med["microbatch_s"], "memory_bandwidth": med["memory_bandwidth"],
                "microbatch_with_comm_s": med["microbatch_with_comm_s"],
                "background_numel": self.background.numel(),
                "collectives": [{"numel": n, **{k: med[f"{k}@{n}"] for k in fns}}
                                for n, fns in self.collectives.items()],
                "samples": len(rows)}


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _memory_bandwidth(numel: int) -> float:
    """Bytes per second of c = a + b on fp32 arrays (two reads, one write per element)."""
    a, b, c = torch.ones(numel), torch.ones(numel), torch.empty(numel)
    torch.add(a, b, out=c)
    return 12 * numel / _seconds(lambda: torch.add(a, b, out=c))


def _traced_reliability(original, open_ranges: list, between=None):
    """Wrap tinytron.train._reliability: each train_step inside `iteration-N`, `between()` after."""
    def make(cfg, out_dir):
        rel = original(cfg, out_dir)
        start, end = rel.on_step_start, rel.on_step_end

        def on_step_start(state):
            open_ranges.append(record_function(f"iteration-{state.iteration + 1}"))
            open_ranges[-1].__enter__()
            start(state)

        def on_step_end(state):
            end(state)
            open_ranges.pop().__exit__(None, None, None)
            if between is not None:
                with record_function("calibration"):
                    between()

        rel.on_step_start, rel.on_step_end = on_step_start, on_step_end
        return rel
    return make


def traced_train(argv: list[str], trace_path: str, between=None) -> int:
    """tinytron.train.run(argv) on this rank under torch.profiler; writes the Chrome trace."""
    import tinytron.train as train

    cfg = train.resolve_config(argv, dist.get_world_size())
    original, open_ranges = train._reliability, []
    train._reliability = _traced_reliability(original, open_ranges, between)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            code = train.run(cfg, argv, "step_time")
    finally:
        train._reliability = original
    prof.export_chrome_trace(trace_path)
    return code


def _merge(intervals: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """Union of [start, end) intervals, joining those less than `gap` apart."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def iteration_lanes(trace_path: str, iteration: int, gap_ms: float = 0.3) -> dict:
    """One traced iteration as lanes (ms from its start): main-thread compute, gloo collectives."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    it = next(e for e in events if e["name"] == f"iteration-{iteration}")
    t0, t1 = float(it["ts"]), float(it["ts"]) + float(it["dur"])
    inside = [e for e in events if t0 <= float(e["ts"]) <= t1 and e is not it]
    main = [((float(e["ts"]) - t0) / 1e3, (float(e["ts"]) + float(e["dur"]) - t0) / 1e3)
            for e in inside if e["tid"] == it["tid"] and e.get("cat") == "cpu_op"
            and not e["name"].startswith("c10d::")]
    comm = [{"name": e["name"].removeprefix("gloo:"), "start": (float(e["ts"]) - t0) / 1e3,
             "end": (float(e["ts"]) + float(e["dur"]) - t0) / 1e3}
            for e in inside if e["tid"] != it["tid"] and e["name"].startswith("gloo:")]
    busy = _merge(main, gap_ms)
    return {"iteration": iteration, "step_ms": float(it["dur"]) / 1e3,
            "busy_ms": sum(b - a for a, b in busy), "compute": [list(x) for x in busy],
            "comm": sorted(comm, key=lambda c: c["start"])}


def calibrate_and_trace(argv: list[str], out_dir: str, bucket_numel: int) -> dict:
    """Per rank: a traced trainer run, its lanes, and the model's inputs sampled in between."""
    from tinytron.train import resolve_config

    cfg = resolve_config(argv, dist.get_world_size())
    torch.set_num_threads(1)
    small = cfg.model.seq_length * cfg.training.micro_batch_size * cfg.model.hidden_size
    calibration = Calibration(cfg.model, cfg.training.micro_batch_size,
                              [small, bucket_numel, 4 * bucket_numel])
    path = os.path.join(out_dir, f"trace_rank{dist.get_rank()}.json")
    code = traced_train(argv, path, between=calibration.sample)
    iters = cfg.training.train_iters
    lanes = [iteration_lanes(path, i) for i in range(2, iters + 1)]
    return {"rank": dist.get_rank(), "code": code, "calibration": calibration.summary(skip=2),
            "iterations": lanes}
