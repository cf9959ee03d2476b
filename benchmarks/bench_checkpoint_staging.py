"""Staged async save against the synchronous save, side by side: the ~100M-parameter GPT of
benchmarks/bench_checkpoint.py (fp32, AdamW state; 1.2 GB per checkpoint) on CPU.

Per repeat (interleaved, so all share the machine's noise), each save followed by one training
step as chapter 01's loop runs it (forward+backward, the loop's `before_optimizer_step` hook,
optimizer step):
1. a training step with no save in flight (the reference step time);
2. a synchronous torch_dist save: the time training is blocked is the whole save;
3. an async save in `thread` mode, staged: blocked = `schedule` + the wait before the optimizer
   step (the copy to host runs beside the forward and backward);
4. an async save in `thread` mode, not staged (no wait point: the copy is taken before `save`
   returns, as without the loop's hook);
5. an async save in `process` mode (fork: no copy).
Also: each async step's forward+backward time against the reference (what the background copy
and write cost the compute beside them). Goal: blocked / sync <= 0.05, in thread mode too.

Run: python benchmarks/bench_checkpoint_staging.py [--repeats N] [--batch B] [--dir DIR] [--out F]
Writes benchmarks/results/checkpoint_staging.json (or F).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoint import build, dir_bytes  # noqa: E402 - the same 100M model and optimizer

from tinytron.checkpoint import CheckpointConfig, CheckpointManager, read_tracker  # noqa: E402
from tinytron.checkpoint.resume import TrainStateFallback  # noqa: E402
from tinytron.model import count_parameters  # noqa: E402
from tinytron.parallel import ParallelGrid  # noqa: E402


class Trainer:
    """One training step of the 100M model, split where the loop calls the checkpoint's hook."""

    def __init__(self, model, opt, tokens):
        self.model, self.opt, self.tokens = model, opt, tokens

    def forward_backward(self) -> float:
        t0 = time.perf_counter()
        self.model(self.tokens[:, :-1], labels=self.tokens[:, 1:]).mean().backward()
        return time.perf_counter() - t0

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


def _manager(work: Path, name: str, **options) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(save=str(work / name), **options),
                             ParallelGrid.single())


def sync_save(work: Path, trainer: Trainer, state) -> dict:
    t0 = time.perf_counter()
    _manager(work, "sync").save(state, trainer.model, trainer.opt)
    blocked = time.perf_counter() - t0
    trainer.forward_backward()
    trainer.optimizer_step()
    return {"sync_s": blocked}


def async_save(work: Path, trainer: Trainer, state, name: str, mode: str, staged: bool) -> dict:
    """One async save followed by one training step; blocked = save + the wait before the step."""
    manager = _manager(work, name, async_save=True, async_mode=mode)
    if staged:
        manager.saver.before_optimizer_step()   # the loop's hook has run before: a wait point
    t0 = time.perf_counter()
    stats = manager.save(state, trainer.model, trainer.opt)
    scheduled = time.perf_counter() - t0
    fb = trainer.forward_backward()
    t1 = time.perf_counter()
    manager.saver.before_optimizer_step()
    waited = time.perf_counter() - t1
    trainer.optimizer_step()
    done = manager.finalize(blocking=True)
    assert stats["staged"] == (staged and mode == "thread")
    assert read_tracker(work / name)[0] == state.iteration
    return {f"{name}_blocking_s": scheduled + waited, f"{name}_schedule_s": scheduled,
            f"{name}_wait_s": waited, f"{name}_forward_backward_s": fb,
            f"{name}_background_s": done["background_s"],
            f"{name}_visible_s": done["visible_after_s"],
            **({f"{name}_copy_s": done["staging_s"]} if "staging_s" in done else {})}


def one_repeat(work: Path, trainer: Trainer, rep: int) -> dict:
    state = TrainStateFallback(iteration=rep + 1)
    out = {"reference_forward_backward_s": trainer.forward_backward()}
    trainer.optimizer_step()
    runs = [lambda: sync_save(work, trainer, state),
            lambda: async_save(work, trainer, state, "thread_staged", "thread", True),
            lambda: async_save(work, trainer, state, "thread_unstaged", "thread", False),
            lambda: async_save(work, trainer, state, "process", "process", False)]
    for i in range(len(runs)):   # rotate the order per repeat
        out.update(runs[(i + rep) % len(runs)]())
    for name in ("sync", "thread_staged", "thread_unstaged", "process"):
        shutil.rmtree(work / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="sequences per training step")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "checkpoint_staging.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    config, model, opt = build()
    tokens = torch.randint(0, config.vocab_size, (args.batch, config.seq_length + 1),
                           generator=torch.Generator().manual_seed(0))
    trainer = Trainer(model, opt, tokens)
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_staging_"))
    work.mkdir(parents=True, exist_ok=True)
    _manager(work, "warmup").save(TrainStateFallback(), model, opt)   # untimed: warm imports
    num_bytes = dir_bytes(work / "warmup")
    shutil.rmtree(work / "warmup")
    runs = [one_repeat(work, trainer, r) for r in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratios = {f"{n}_blocking_over_sync": med[f"{n}_blocking_s"] / med["sync_s"]
              for n in ("thread_staged", "thread_unstaged", "process")}
    ratios.update({f"{n}_forward_backward_over_reference":
                   med[f"{n}_forward_backward_s"] / med["reference_forward_backward_s"]
                   for n in ("thread_staged", "thread_unstaged", "process")})
    per_run = {f"{n}_blocking_over_sync": [r[f"{n}_blocking_s"] / r["sync_s"] for r in runs]
               for n in ("thread_staged", "thread_unstaged", "process")}
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
        "torch_threads": args.threads, "load_average_at_start": load_start,
        "load_average_at_end": os.getloadavg(), "parameters": count_parameters(config),
        "checkpoint_bytes": num_bytes, "tokens_per_step": args.batch * config.seq_length,
        "goal": "blocking / sync <= 0.05", "ratios_of_medians": ratios,
        "ratios_per_run": per_run,
        "median_of_ratios_per_run": {k: statistics.median(v) for k, v in per_run.items()},
        "median_seconds": med, "runs": runs,
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['parameters'] / 1e6:.0f}M params, {num_bytes / 1e9:.2f} GB per checkpoint; "
          f"load average {load_start[0]:.1f} at start, {result['load_average_at_end'][0]:.1f} "
          f"at end; {args.repeats} repeats, medians")
    print(f"sync save {med['sync_s']:.3f} s; reference forward+backward "
          f"{med['reference_forward_backward_s']:.3f} s")
    for n in ("thread_staged", "thread_unstaged", "process"):
        extra = (f" (schedule {med[f'{n}_schedule_s']:.3f} + wait {med[f'{n}_wait_s']:.3f}; "
                 f"copy {med[f'{n}_copy_s']:.3f} s behind the forward+backward)"
                 if n == "thread_staged" else "")
        print(f"{n:16s} blocked {med[f'{n}_blocking_s']:.3f} s = "
              f"{ratios[f'{n}_blocking_over_sync']:.3f} of sync{extra}; forward+backward "
              f"x{ratios[f'{n}_forward_backward_over_reference']:.2f}")
    worst = max(per_run["thread_staged_blocking_over_sync"])
    print(f"thread_staged blocked / sync, worst repeat: {worst:.3f} (goal <= 0.05)")
    print(f"wrote {out}")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
