"""PP=2 on two gloo ranks (1F1B and interleaved v=2) vs PP=1 on one rank, same global batch.

Same Llama-style model (tinytron.model.GPTModel: hidden 256, 4 layers, 4 heads / 2 kv groups,
ffn 688, vocab 1024 so that the output layer does not make the last stage much heavier, seq
256, untied embeddings), same data (m micro-batches of mbs sequences per step), the same
initial weights and the same plain SGD update after `finalize_model_grads` (per-token loss).
PP1 runs on rank 0 of the same 2-rank world while rank 1 waits, and the variants alternate in
rounds (the order rotated each round) so machine load hits all of them alike. For each
pipelined step the schedule's recorder gives the measured bubble (1 - compute / span, averaged
over the stages), reported next to (p-1)/(v m + p-1). Reports step time (median and best
over rounds), tokens/s, the speed-up over PP1, and the largest loss difference to PP1 (they
must train identically). Writes benchmarks/results/pipeline.json.

    python benchmarks/bench_pipeline.py [--rounds 5] [--microbatches 8] [--micro-batch 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

LR = 0.05
PP1, ONE_F_ONE_B, INTERLEAVED = "PP1 (1 rank)", "PP2 1F1B", "PP2 interleaved v=2"


def _config():
    from tinytron.model import ModelConfig

    return ModelConfig(hidden_size=256, num_layers=4, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=688, vocab_size=1024, seq_length=256,
                       tie_embeddings=False)


def _forward_step(data_iterator, model):
    """First chunk reads tokens, last computes the per-token loss (chapter 00's contract)."""
    from tinytron.overview.loss import lm_loss_func

    batch = next(data_iterator)
    out = model(batch["tokens"] if model.pre_process else None,
                labels=batch["labels"] if model.post_process else None)
    return out, partial(lm_loss_func, batch["loss_mask"])


def _step(name, models, grid, batches, recorder) -> list:
    """One training step through the variant's schedule + SGD; returns the loss reports."""
    from tinytron.buffers import finalize_model_grads
    from tinytron.main_loop import ScheduleConfig, get_forward_backward_func

    vpp = 2 if name == INTERLEAVED else None
    for c in models:
        c.zero_grad(set_to_none=True)
    fb = get_forward_backward_func(grid.size("pp"), vpp)
    iters = [iter(batches) for _ in models]
    cfg = ScheduleConfig(finalize_model_grads_func=finalize_model_grads, recorder=recorder)
    reports = fb(forward_step_func=_forward_step, data_iterator=iters if vpp else iters[0],
                 model=models, num_microbatches=len(batches), seq_length=_config().seq_length,
                 micro_batch_size=batches[0]["tokens"].shape[0], grid=grid, config=cfg)
    with torch.no_grad():
        for c in models:
            for p in c.parameters():
                p.add_(p.grad, alpha=-LR)
    return [r["lm loss"] for r in reports]


def _batches(cfg, step: int, m: int, mbs: int) -> list[dict]:
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, cfg.vocab_size, (m, mbs, cfg.seq_length + 1), generator=g)
    return [{"tokens": s[:, :-1], "labels": s[:, 1:], "loss_mask": torch.ones(mbs, cfg.seq_length)}
            for s in seq]


def bench_rank(rounds: int, m: int, mbs: int) -> dict:
    """Rank function: alternate PP1 (rank 0 only), PP2 1F1B and PP2 interleaved."""
    from tinytron.main_loop import ScheduleRecorder
    from tinytron.model import GPTModel, build_stage_models
    from tinytron.parallel import ParallelGrid

    grid, single = ParallelGrid(pp=2), ParallelGrid.single()
    cfg = _config()
    models = {PP1: [GPTModel(cfg, single)] if grid.rank("pp") == 0 else [],
              ONE_F_ONE_B: build_stage_models(cfg, grid),
              INTERLEAVED: build_stage_models(cfg, grid, num_virtual_stages=2)}
    grids = {PP1: single, ONE_F_ONE_B: grid, INTERLEAVED: grid}
    names = list(models)
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    bubbles = {n: [] for n in names[1:]}
    for step in range(rounds + 1):  # step 0 is a warm-up (allocations, first messages)
        batches = _batches(cfg, step, m, mbs)
        for n in names[step % len(names):] + names[:step % len(names)]:
            rec = ScheduleRecorder()
            dist.barrier()
            t0 = time.perf_counter()
            if models[n]:
                losses[n] += _step(n, models[n], grids[n], batches, rec)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            events = [None, None]
            dist.all_gather_object(events, rec.events)
            if step > 0:
                times[n].append(elapsed.item())
                if n in bubbles:
                    bubbles[n].append(events[0] + events[1])
    everyone = [None, None]
    dist.all_gather_object(everyone, losses)
    return {"times": times, "bubble_events": bubbles, "losses": everyone}


def _summarize(res, m, mbs, seq) -> dict:
    from tinytron.main_loop.schedule_timeline import bubble_formula, measured_bubble

    tokens = m * mbs * seq
    ref = statistics.median(res["times"][PP1])
    rank0, rank1 = res["losses"]  # PP1's on rank 0, the pipelines' on their last stage
    loss = {n: torch.stack(rank0[n] or rank1[n]) for n in res["times"]}
    rows = {}
    for name, ts in res["times"].items():
        t = statistics.median(ts)
        row = {"step_s_median": t, "step_s_best": min(ts), "step_s_all": ts,
               "tokens_per_s_median": tokens / t, "speedup_vs_pp1_median": ref / t,
               "max_loss_diff_vs_pp1": float((loss[name] - loss[PP1]).abs().max())}
        if name in res["bubble_events"]:
            v = 2 if name == INTERLEAVED else 1
            measured = [measured_bubble(ev) for ev in res["bubble_events"][name]]
            busy = [[sum(e.end - e.start for e in ev if e.stage == s
                         and e.kind in ("forward", "backward")) for s in (0, 1)]
                    for ev in res["bubble_events"][name]]
            row.update(bubble_measured_median=statistics.median(measured),
                       bubble_measured_all=measured, bubble_formula=bubble_formula(2, m, v),
                       stage_compute_s_median=[statistics.median(b[s] for b in busy)
                                               for s in (0, 1)],
                       ideal_speedup_from_formula=2 * (1 - bubble_formula(2, m, v)))
        rows[name] = row
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline.json"))
    args = ap.parse_args()
    from tinytron.launch import run_on_ranks

    t0 = time.perf_counter()
    m, mbs, seq = args.microbatches, args.micro_batch, _config().seq_length
    res = run_on_ranks(bench_rank, 2, args.rounds, m, mbs, timeout=1800)[0]
    rows = _summarize(res, m, mbs, seq)
    load = os.getloadavg()[0]
    print(f"PP2 gloo vs PP1, m = {m} micro-batches of {mbs} x {seq} tokens, {args.rounds} rounds, "
          f"load average {load:.1f} (on {os.cpu_count()} cores)")
    print(f"{'variant':22s} {'median ms':>9s} {'tokens/s':>8s} {'vs PP1':>7s} {'bubble':>7s} "
          f"{'formula':>7s} {'stage s (0, 1)':>15s} {'max dloss':>9s}")
    for name, r in rows.items():
        bub = (f"{r['bubble_measured_median']:7.1%} {r['bubble_formula']:7.1%} "
               f"{r['stage_compute_s_median'][0]:7.3f},{r['stage_compute_s_median'][1]:7.3f}"
               if "bubble_formula" in r else f"{'':7s} {'':7s} {'':15s}")
        print(f"{name:22s} {r['step_s_median'] * 1e3:9.1f} {r['tokens_per_s_median']:8.0f} "
              f"{r['speedup_vs_pp1_median']:6.2f}x {bub} {r['max_loss_diff_vs_pp1']:9.2e}")
    out = {"command": f"python benchmarks/bench_pipeline.py --rounds {args.rounds} "
                      f"--microbatches {m} --micro-batch {mbs}",
           "model": {"hidden": 256, "layers": 4, "heads": 4, "kv_groups": 2, "ffn": 688,
                     "vocab": 1024, "seq": seq, "tie_embeddings": False, "dtype": "float32"},
           "num_microbatches": m, "micro_batch": mbs, "tokens_per_step": m * mbs * seq,
           "backend": "gloo", "machine": f"{platform.machine()} {os.cpu_count()} cores, "
                                         f"torch {torch.__version__}, 1 thread per rank",
           "load_average_1min_at_end": load, "wall_s": time.perf_counter() - t0,
           "reference": PP1, "variants": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    # A timing is only worth reporting if PP2 trained exactly like PP1 (same ops, same order).
    unequal = {n: r["max_loss_diff_vs_pp1"] for n, r in rows.items()
               if r["max_loss_diff_vs_pp1"] != 0.0}
    assert not unequal, f"losses differ from PP1: {unequal}"


if __name__ == "__main__":
    main()
