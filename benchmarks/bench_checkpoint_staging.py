"""Staged async save against the synchronous save, side by side: the ~100M-parameter GPT of
benchmarks/bench_checkpoint.py (fp32, AdamW state; 1.2 GB per checkpoint) on the CPU, or with
`--device cuda` on the GPU (model, optimizer state and batch in GPU memory: the staged copy is
a device-to-host copy on a side stream into pinned buffers).

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
On CUDA the kernels run asynchronously, so each step is also timed whole, from the save to the
optimizer step's completion (`torch.cuda.synchronize`): `<mode>_step_s` against the reference
step is what the save costs the GPU's timeline.

Run: python benchmarks/bench_checkpoint_staging.py [--device cpu|cuda] [--repeats N] [--batch B]
     [--modes sync,thread_staged,...] [--small] [--dir DIR] [--out F]
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
        self.cuda = tokens.is_cuda

    def sync(self) -> None:
        """On CUDA, wait for the queued kernels: a host clock then times the GPU's work."""
        if self.cuda:
            torch.cuda.synchronize()

    def forward_backward(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.model(self.tokens[:, :-1], labels=self.tokens[:, 1:]).mean().backward()
        self.sync()
        return time.perf_counter() - t0

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()
        self.sync()


def _manager(work: Path, name: str, **options) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(save=str(work / name), **options),
                             ParallelGrid.single())


def sync_save(work: Path, trainer: Trainer, state) -> dict:
    trainer.sync()
    t0 = time.perf_counter()
    _manager(work, "sync").save(state, trainer.model, trainer.opt)
    blocked = time.perf_counter() - t0
    trainer.forward_backward()
    trainer.optimizer_step()
    return {"sync_s": blocked, "sync_step_s": time.perf_counter() - t0}


def async_save(work: Path, trainer: Trainer, state, name: str, mode: str, staged: bool) -> dict:
    """One async save followed by one training step; blocked = save + the wait before the step."""
    manager = _manager(work, name, async_save=True, async_mode=mode)
    if staged:
        manager.saver.before_optimizer_step()   # the loop's hook has run before: a wait point
    trainer.sync()
    t0 = time.perf_counter()
    stats = manager.save(state, trainer.model, trainer.opt)
    scheduled = time.perf_counter() - t0
    fb = trainer.forward_backward()
    t1 = time.perf_counter()
    manager.saver.before_optimizer_step()
    waited = time.perf_counter() - t1
    trainer.optimizer_step()
    step = time.perf_counter() - t0
    done = manager.finalize(blocking=True)
    assert stats["staged"] == (staged and mode == "thread")
    assert read_tracker(work / name)[0] == state.iteration
    return {f"{name}_blocking_s": scheduled + waited, f"{name}_schedule_s": scheduled,
            f"{name}_wait_s": waited, f"{name}_forward_backward_s": fb, f"{name}_step_s": step,
            f"{name}_background_s": done["background_s"],
            f"{name}_visible_s": done["visible_after_s"],
            **({f"{name}_copy_s": done["staging_s"]} if "staging_s" in done else {})}


ASYNC = {"thread_staged": ("thread", True), "thread_unstaged": ("thread", False),
         "process": ("process", False)}


def one_repeat(work: Path, trainer: Trainer, rep: int, modes: list[str]) -> dict:
    state = TrainStateFallback(iteration=rep + 1)
    trainer.sync()
    t0 = time.perf_counter()
    out = {"reference_forward_backward_s": trainer.forward_backward()}
    trainer.optimizer_step()
    out["reference_step_s"] = time.perf_counter() - t0
    runs = [(lambda: sync_save(work, trainer, state)) if m == "sync" else
            (lambda m=m: async_save(work, trainer, state, m, *ASYNC[m])) for m in modes]
    for i in range(len(runs)):   # rotate the order per repeat
        out.update(runs[(i + rep) % len(runs)]())
    for name in modes:
        shutil.rmtree(work / name)
    return out


def _ratios(runs: list[dict], med: dict, modes: list[str]) -> tuple[dict, dict]:
    """Ratios of the medians, and blocked / sync per repeat, for the async modes measured."""
    names = [m for m in modes if m != "sync"]
    ratios = {f"{n}_blocking_over_sync": med[f"{n}_blocking_s"] / med["sync_s"] for n in names}
    ratios.update({f"{n}_forward_backward_over_reference":
                   med[f"{n}_forward_backward_s"] / med["reference_forward_backward_s"]
                   for n in names})
    ratios.update({f"{n}_step_over_reference": med[f"{n}_step_s"] / med["reference_step_s"]
                   for n in modes})
    per_run = {f"{n}_blocking_over_sync": [r[f"{n}_blocking_s"] / r["sync_s"] for r in runs]
               for n in names}
    return ratios, per_run


def _args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="sequences per training step")
    parser.add_argument("--modes", default="sync,thread_staged,thread_unstaged,process",
                        help="comma-separated; sync is always measured (the ratios' base)")
    parser.add_argument("--small", action="store_true", help="a ~3M model: a plumbing run")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "checkpoint_staging.json"))
    args = parser.parse_args()
    modes = ["sync"] + [m for m in dict.fromkeys(args.modes.split(",")) if m and m != "sync"]
    if unknown := [m for m in modes if m != "sync" and m not in ASYNC]:
        parser.error(f"--modes: unknown mode {unknown[0]!r} (known: sync, {', '.join(ASYNC)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    return args, modes


def _print(result: dict, med: dict, modes: list[str], repeats: int) -> None:
    ratios, per_run = result["ratios_of_medians"], result["ratios_per_run"]
    print(f"{result['parameters'] / 1e6:.0f}M params on {result['device']}, "
          f"{result['checkpoint_bytes'] / 1e9:.2f} GB per checkpoint; load average "
          f"{result['load_average_at_start'][0]:.1f} at start, "
          f"{result['load_average_at_end'][0]:.1f} at end; {repeats} repeats, medians")
    print(f"sync save {med['sync_s']:.3f} s; reference forward+backward "
          f"{med['reference_forward_backward_s']:.3f} s, whole step {med['reference_step_s']:.3f} s")
    for n in modes[1:]:
        extra = (f" (schedule {med[f'{n}_schedule_s']:.3f} + wait {med[f'{n}_wait_s']:.3f}; "
                 f"copy {med[f'{n}_copy_s']:.3f} s behind the forward+backward)"
                 if n == "thread_staged" else "")
        print(f"{n:16s} blocked {med[f'{n}_blocking_s']:.3f} s = "
              f"{ratios[f'{n}_blocking_over_sync']:.3f} of sync{extra}; forward+backward "
              f"x{ratios[f'{n}_forward_backward_over_reference']:.2f}; whole step "
              f"x{ratios[f'{n}_step_over_reference']:.2f}")
    if "thread_staged" in modes:
        worst = max(per_run["thread_staged_blocking_over_sync"])
        print(f"thread_staged blocked / sync, worst repeat: {worst:.3f} (goal <= 0.05)")


def main() -> None:
    args, modes = _args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    config, model, opt = build(device=args.device, small=args.small)
    tokens = torch.randint(0, config.vocab_size, (args.batch, config.seq_length + 1),
                           generator=torch.Generator().manual_seed(0)).to(args.device)
    trainer = Trainer(model, opt, tokens)
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_staging_"))
    work.mkdir(parents=True, exist_ok=True)
    _manager(work, "warmup").save(TrainStateFallback(), model, opt)   # untimed: warm imports
    num_bytes = dir_bytes(work / "warmup")
    shutil.rmtree(work / "warmup")
    runs = [one_repeat(work, trainer, r, modes) for r in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratios, per_run = _ratios(runs, med, modes)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
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
    _print(result, med, modes, args.repeats)
    print(f"wrote {out}")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
