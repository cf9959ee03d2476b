"""Checkpoint benchmark, side by side in one run: a ~100M-parameter GPT with AdamW state on CPU.

Per repeat (interleaved, so all share the machine's noise):
1. `dd` writing the same number of bytes to the same disk, with fsync (the reference);
2. a synchronous torch_dist save (write throughput = bytes / time, goal >= 0.7x dd), with and
   without the CRC-32 checksums;
3. an async torch_dist save in `process` mode (fork) and in `thread` mode: the time training is
   blocked (goal <= 5% of the sync save), and the background write time;
4. a load of the torch_dist checkpoint (with and without the CRC check);
5. a synchronous legacy save.

Then, once, the bytes each rank writes on 4 gloo ranks (DP 4, and TP 2 x DP 2), with the
DistributedOptimizer, with and without the fully parallel save: a count of bytes on disk, not a
timing.

Run: python benchmarks/bench_checkpoint.py [--repeats N] [--dir DIR] [--bytes-only]
Writes benchmarks/results/checkpoint.json.
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
import tempfile
import time
from pathlib import Path

import torch

from tinytron.checkpoint import CheckpointConfig, CheckpointManager, load_checkpoint
from tinytron.checkpoint.resume import TrainStateFallback
from tinytron.model import GPTModel, count_parameters, tiny_config
from tinytron.optimizer import AdamW
from tinytron.optimizer.mixed_precision import MixedPrecisionOptimizer
from tinytron.parallel import ParallelGrid


def build(seed: int = 0, device: str = "cpu", small: bool = False):
    """~100M-parameter GPT (fp32) + AdamW with its state created by one real step, on `device`.

    small: a 2-layer, h 256 model of the same kind (~3M parameters), for a quick plumbing run."""
    torch.manual_seed(seed)
    size = (dict(hidden_size=256, num_layers=2, num_attention_heads=4, ffn_hidden_size=704,
                 vocab_size=4096) if small else
            dict(hidden_size=768, num_layers=12, num_attention_heads=12, ffn_hidden_size=2048,
                 vocab_size=32000))
    config = tiny_config(num_query_groups=4, seq_length=32, **size)
    model = GPTModel(config).to(device)
    opt = MixedPrecisionOptimizer(AdamW(model.parameters(), lr=1e-4), clip_grad=1.0)
    tokens = torch.randint(0, config.vocab_size, (1, config.seq_length + 1), device=device)
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    opt.step()
    opt.zero_grad()
    return config, model, opt


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def run_dd(path: Path, num_bytes: int) -> float:
    """Seconds for dd to write num_bytes (16 MiB blocks) and fsync."""
    count = max(1, num_bytes // (16 << 20))
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}",
                    "conv=fsync"], check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    os.remove(path)
    return seconds * num_bytes / (count * (16 << 20))


def _save(work: Path, name: str, state, model, opt, **options) -> float:
    """Seconds of one synchronous save into work/name."""
    t0 = time.perf_counter()
    CheckpointManager(CheckpointConfig(save=str(work / name), **options),
                      ParallelGrid.single()).save(state, model, opt)
    return time.perf_counter() - t0


def _async(work: Path, mode: str, state, model, opt) -> dict:
    """Blocking, background and until-visible seconds of one async save."""
    manager = CheckpointManager(CheckpointConfig(save=str(work / mode), async_save=True,
                                                 async_mode=mode), ParallelGrid.single())
    t0 = time.perf_counter()
    manager.save(state, model, opt)
    blocking = time.perf_counter() - t0
    done = manager.finalize(blocking=True)
    return {f"async_{mode}_blocking_s": blocking, f"async_{mode}_background_s": done["background_s"],
            f"async_{mode}_visible_s": done["visible_after_s"]}


def one_repeat(work: Path, model, opt, rep: int, num_bytes: int) -> dict:
    """Every measurement once, on fresh directories; dd and load orders alternate per repeat."""
    state, out = TrainStateFallback(iteration=rep + 1), {"bytes": num_bytes}
    if rep % 2:
        out["dd_s"] = run_dd(work / "dd.bin", num_bytes)
    out["sync_s"] = _save(work, "sync", state, model, opt)
    if not rep % 2:
        out["dd_s"] = run_dd(work / "dd.bin", num_bytes)
    out["sync_with_checksums_s"] = _save(work, "crc", state, model, opt, crc_checksums=True)
    for mode in ("process", "thread"):
        out.update(_async(work, mode, state, model, opt))
    for verify in ((True, False) if rep % 2 else (False, True)):   # CRC checked when present
        t0 = time.perf_counter()
        load_checkpoint(work / ("crc" if verify else "sync"), model, opt)
        out[f"load_{'verified' if verify else 'unverified'}_s"] = time.perf_counter() - t0
    out["legacy_sync_s"] = _save(work, "legacy", state, model, opt, ckpt_format="torch")
    for name in ("sync", "crc", "process", "thread", "legacy"):
        shutil.rmtree(work / name)
    return out


def per_rank_bytes(work: Path) -> dict:
    """Bytes in each rank's __R_0.distcp, fully parallel save on and off, on 4 gloo ranks."""
    from tinytron.checkpoint import _workers
    from tinytron.launch import run_on_ranks

    config = tiny_config(num_layers=8, hidden_size=256, ffn_hidden_size=704, seq_length=32,
                         dropout=0.0)
    out = {}
    for tp in (1, 2):
        root = work / f"per_rank_tp{tp}"
        run_on_ranks(_workers.fully_parallel_both, 4, str(root), tp, config, timeout=600)
        for name in ("on", "off"):
            sizes = [(root / name / "iter_0000001" / f"__{r}_0.distcp").stat().st_size
                     for r in range(4)]
            out[f"tp{tp}_dp{4 // tp}_fully_parallel_{name}"] = {
                "bytes_per_rank": sizes, "max_over_mean": max(sizes) / (sum(sizes) / 4)}
        shutil.rmtree(root)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bytes-only", action="store_true",
                        help="only the per-rank bytes; keep the timings already in the results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(__file__).parent / "results" / "checkpoint.json"
    if args.bytes_only:
        work = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
        result = json.loads(out.read_text()) if out.exists() else {}
        if "sync_no_checksums_s" in result.get("median_seconds", {}):
            result["timings_note"] = ("timings measured when checksums.json was written by "
                                      "default: sync_s is with the CRC, sync_no_checksums_s without")
        result["fully_parallel_bytes"] = per_rank_bytes(work)
        result["fully_parallel_bytes_command"] = " ".join([Path(sys.executable).name, *sys.argv])
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["fully_parallel_bytes"], indent=1))
        shutil.rmtree(work, ignore_errors=True)
        return
    config, model, opt = build()
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    work.mkdir(parents=True, exist_ok=True)
    _save(work, "warmup", TrainStateFallback(), model, opt)   # untimed: the byte count, warm imports
    num_bytes = dir_bytes(work / "warmup")
    shutil.rmtree(work / "warmup")
    runs = [one_repeat(work, model, opt, r, num_bytes) for r in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    gb = med["bytes"] / 1e9
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__, "machine": platform.machine(),
        "load_average_at_start_1m": os.getloadavg()[0],
        "parameters": count_parameters(config), "checkpoint_bytes": med["bytes"],
        "median_seconds": med, "runs": runs,
        "write_gbps": {"dd": gb / med["dd_s"], "torch_dist_sync": gb / med["sync_s"]},
        "ratio_sync_throughput_over_dd": med["dd_s"] / med["sync_s"],
        "ratio_sync_with_checksums_throughput_over_dd": med["dd_s"] / med["sync_with_checksums_s"],
        "ratio_async_process_blocking_over_sync": med["async_process_blocking_s"] / med["sync_s"],
        "ratio_async_thread_blocking_over_sync": med["async_thread_blocking_s"] / med["sync_s"],
        "ratio_legacy_over_torch_dist_sync": med["legacy_sync_s"] / med["sync_s"],
        "fully_parallel_bytes": per_rank_bytes(work),
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['parameters'] / 1e6:.0f}M params, {gb:.2f} GB per checkpoint; "
          f"load average {result['load_average_at_start_1m']:.1f}")
    print(f"dd {result['write_gbps']['dd']:.2f} GB/s, torch_dist sync save "
          f"{result['write_gbps']['torch_dist_sync']:.2f} GB/s "
          f"(ratio {result['ratio_sync_throughput_over_dd']:.2f}, goal >= 0.7; with checksums "
          f"{result['ratio_sync_with_checksums_throughput_over_dd']:.2f})")
    print(f"async blocking / sync: process {result['ratio_async_process_blocking_over_sync']:.3f}, "
          f"thread {result['ratio_async_thread_blocking_over_sync']:.3f} (goal <= 0.05)")
    print(f"load {med['load_verified_s']:.2f} s (CRC checked), {med['load_unverified_s']:.2f} s "
          f"without; legacy save / torch_dist save {result['ratio_legacy_over_torch_dist_sync']:.2f}")
    for name, v in result["fully_parallel_bytes"].items():
        print(f"{name}: bytes per rank {v['bytes_per_rank']} (max / mean {v['max_over_mean']:.2f})")
    print(f"wrote {out}")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
