"""Loop overhead: chapter 01's train_step (PP1/DP1, the book's parts) vs a plain PyTorch loop.

Both run the same GPTModel weights on the same micro-batches, interleaved repeat by repeat so
that machine noise hits both alike; the ratios are medians of per-repeat ratios, in wall time
and (CPU, one thread) in this process's CPU time, which a loaded machine disturbs far less:

- ``tinytron``: ``train_step`` with chapter 05's DDP (contiguous grad buffer), the no-pipelining
  schedule, chapter 00's loss contract through ``gpt_forward_step`` / ``get_batch`` (chapter 04),
  ``finalize_model_grads``, chapter 02's optimizer (fp32 Adam with decoupled weight decay,
  global-norm clip) and its scheduler;
- ``plain``: forward to logits, ``F.cross_entropy``, backward, ``clip_grad_norm_(foreach=True)``,
  ``torch.optim.AdamW(foreach=True)`` — the loop the issue names as the reference;
- ``plain_model_loss``: the plain loop, but the loss computed by the model (``labels=``, the
  vocab-parallel cross entropy the book's model always uses), so that the ratio against it is
  the loop's own overhead with the model held fixed;
- ``independent``: benchmarks/plain_llama.py, a Llama of the same shape and init scheme written
  with torch modules only (no tinytron code), the same step (``F.cross_entropy``,
  ``clip_grad_norm_(foreach=True)``, ``AdamW(foreach=True)``): the ratio against it includes
  whatever the book's model costs.

Run: python benchmarks/bench_main_loop.py [--device cpu|cuda] [--repeats N] [--threads T]
Writes benchmarks/results/main_loop.json.
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

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_llama import PlainLlama, PlainTrainer  # noqa: E402

from tinytron.buffers import DistributedDataParallelConfig
from tinytron.main_loop.loop import (build_schedule_config, gpt_forward_step,
                                     megatron_optimizer_provider, megatron_scheduler_provider,
                                     train_step, wrap_with_ddp)
from tinytron.main_loop.schedules import get_forward_backward_func
from tinytron.model import GPTModel, tiny_config
from tinytron.optimizer import OptimizerConfig, SchedulerConfig
from tinytron.parallel import ParallelGrid

LR, WD, CLIP = 1e-3, 0.1, 1.0


def _config():
    """A small Llama-style shape where per-step Python overhead is visible (GQA 8/2, SwiGLU)."""
    return tiny_config(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2,
                       ffn_hidden_size=688, vocab_size=1024, seq_length=256)


def _microbatches(cfg, m: int, mbs: int, device, seed: int = 0) -> list[dict]:
    """m micro-batches of mbs random sequences, the keys get_batch reads."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        seq = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_length + 1), generator=g)
        out.append({"tokens": seq[:, :-1].to(device), "labels": seq[:, 1:].to(device),
                    "loss_mask": torch.ones(mbs, cfg.seq_length, device=device),
                    "position_ids": torch.arange(cfg.seq_length, device=device).expand(mbs, -1)})
    return out


class _Tinytron:
    """train_step with the book's parts."""

    def __init__(self, cfg, mbs, m, device):
        self.grid, self.m, self.mbs, self.cfg = ParallelGrid.single(), m, mbs, cfg
        self.model = wrap_with_ddp([GPTModel(cfg, device=device)], self.grid,
                                   DistributedDataParallelConfig())
        oc = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP)
        self.opt = megatron_optimizer_provider(oc)(self.model, self.grid)
        self.sched = megatron_scheduler_provider(SchedulerConfig(lr_decay_style="constant"), oc)(
            self.opt, train_iters=10 ** 6, global_batch_size=m * mbs)
        self.config = build_schedule_config(self.model, self.opt, self.grid)
        self.fb = get_forward_backward_func(1)
        self.fwd = partial(gpt_forward_step, micro_batch_size=mbs, seq_length=cfg.seq_length)

    def step(self, batches) -> float:
        r = train_step(self.fwd, iter(batches), self.model, self.opt, self.sched, self.fb,
                       num_microbatches=self.m, micro_batch_size=self.mbs,
                       seq_length=self.cfg.seq_length, grid=self.grid, config=self.config)
        return float(r.loss_dict["lm loss"])


class _Plain:
    """The plain PyTorch loop; model_loss=True takes the loss from the model instead of F.cross_entropy."""

    def __init__(self, cfg, device, model_loss: bool):
        self.model, self.model_loss = GPTModel(cfg, device=device), model_loss
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, foreach=True)

    def step(self, batches) -> float:
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for b in batches:
            if self.model_loss:
                loss = self.model(b["tokens"], b["position_ids"], labels=b["labels"]).mean()
            else:
                logits = self.model(b["tokens"], b["position_ids"])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       b["labels"].reshape(-1))
            (loss / len(batches)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP, foreach=True)
        self.opt.step()
        return float(total) / len(batches)


class _Independent:
    """benchmarks/plain_llama.py: no tinytron code in the model, the loss or the step."""

    def __init__(self, cfg, device):
        shape = {k: getattr(cfg, k) for k in ("hidden_size", "num_layers", "num_attention_heads",
                                               "num_query_groups", "ffn_hidden_size",
                                               "vocab_size", "seq_length")}
        self.trainer = PlainTrainer(PlainLlama(**shape).to(device), LR, WD, CLIP)

    def step(self, batches) -> float:
        return float(self.trainer.step([(b["tokens"], b["labels"]) for b in batches]))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _time_loops(loops: dict, batches, repeats: int, steps: int, device) -> dict:
    """{clock: {loop: [ms per iteration per repeat]}} for wall time and this process's CPU time."""
    times = {"wall": {k: [] for k in loops}, "cpu": {k: [] for k in loops}}
    for _ in range(repeats):
        for name, loop in loops.items():
            _sync(device)
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                loop.step(batches)
            _sync(device)
            times["wall"][name].append((time.perf_counter() - w0) / steps * 1e3)
            times["cpu"][name].append((time.process_time() - c0) / steps * 1e3)
    return times


def _ratios(times: dict) -> dict:
    """Median over repeats of tinytron / reference within the same repeat (cancels drift)."""
    return {ref: statistics.median(a / b for a, b in zip(times["tinytron"], times[ref]))
            for ref in ("plain", "plain_model_loss", "independent")}


def run(device: str, repeats: int, steps: int, mbs: int, m: int) -> dict:
    """ms per iteration of each loop, interleaved; paired ratios; the first losses (sanity)."""
    cfg = _config()
    batches = _microbatches(cfg, m, mbs, device)
    loops = {"tinytron": _Tinytron(cfg, mbs, m, device),
             "plain": _Plain(cfg, device, model_loss=False),
             "plain_model_loss": _Plain(cfg, device, model_loss=True),
             "independent": _Independent(cfg, device)}
    first = {k: loop.step(batches) for k, loop in loops.items()}   # warm-up, creates state
    times = _time_loops(loops, batches, repeats, steps, device)
    # with one intra-op thread, CPU time is this process's own work: robust on a shared machine
    primary = "cpu" if torch.device(device).type == "cpu" and torch.get_num_threads() == 1 \
        else "wall"
    return {"clock": primary,
            "ms_per_iteration": {c: {k: statistics.median(v) for k, v in t.items()}
                                 for c, t in times.items()},
            "ratios": {c: _ratios(t) for c, t in times.items()},
            "ratio_tinytron_over_plain": _ratios(times[primary])["plain"],
            "ratio_tinytron_over_plain_model_loss": _ratios(times[primary])["plain_model_loss"],
            "ratio_tinytron_over_independent": _ratios(times[primary])["independent"],
            "all_ms": times, "first_loss": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--num-microbatches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" /
                                          "main_loop.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    res = run(args.device, args.repeats, args.steps, args.micro_batch_size, args.num_microbatches)
    cfg = _config()
    result = {
        "command": (f"python benchmarks/bench_main_loop.py --device {args.device} --repeats "
                    f"{args.repeats} --steps {args.steps} --micro-batch-size "
                    f"{args.micro_batch_size} --num-microbatches {args.num_microbatches} "
                    f"--threads {args.threads}"),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "torch": torch.__version__, "machine": platform.machine(), "threads": args.threads,
        "load_average_before_after": [load_before, os.getloadavg()],
        "model": {k: getattr(cfg, k) for k in ("hidden_size", "num_layers", "num_attention_heads",
                                               "num_query_groups", "ffn_hidden_size",
                                               "vocab_size", "seq_length")},
        "micro_batch_size": args.micro_batch_size, "num_microbatches": args.num_microbatches,
        **res}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    med = res["ms_per_iteration"][res["clock"]]
    print(f"ms/iteration ({res['clock']} time): tinytron {med['tinytron']:.1f}, plain "
          f"{med['plain']:.1f}, plain with the model's loss {med['plain_model_loss']:.1f}")
    for clock, r in res["ratios"].items():
        print(f"{clock:>4} time: tinytron / plain = {r['plain']:.3f} (goal <= 1.03); "
              f"tinytron / plain with the model's loss = {r['plain_model_loss']:.3f}; "
              f"tinytron / independent plain-PyTorch Llama = {r['independent']:.3f}")
    print(f"first losses {res['first_loss']}; load average {load_before} -> {os.getloadavg()}")
    print(f"command: {result['command']}  -> {out}")


if __name__ == "__main__":
    main()
