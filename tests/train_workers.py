"""Per-rank bodies for the trainer's tests: run tinytron.train inside a launched world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch.distributed as dist

TINY = ["--model.hidden_size", "64", "--model.num_layers", "4", "--model.num_attention_heads", "4",
        "--model.num_query_groups", "2", "--model.ffn_hidden_size", "128",
        "--model.vocab_size", "512", "--model.seq_length", "64",
        "--training.micro_batch_size", "2", "--training.global_batch_size", "16",
        "--training.train_iters", "10", "--training.log_interval", "1",
        "--training.eval_interval", "none", "--training.save_interval", "none",
        "--scheduler.lr_warmup_iters", "2", "--optimizer.lr", "3e-3",
        "--data.split", '"98,2,0"', "--data.num_workers", "0",
        "--logging.progress_bar", "false"]


def corpus(out_dir, files: int = 20, *extra: str) -> str:
    """`files` standard-library files as one byte-tokenized .bin/.idx in `out_dir`: its prefix."""
    from tinytron.data.preprocess import run as preprocess, stdlib_corpus

    return preprocess(["--input", *stdlib_corpus(files), "--output-prefix",
                       str(Path(out_dir) / "corpus"), "--workers", "1", "--no-progress", *extra])


def train_cli(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m tinytron.train ARGV` as a user runs it (repository root, one OpenMP thread);
    it must exit 0. Returns the finished process (its console in .stdout and .stderr)."""
    proc = subprocess.run([sys.executable, "-m", "tinytron.train", *argv],
                          cwd=Path(__file__).resolve().parents[1],
                          env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def read_losses(jsonl: str) -> dict[int, float]:
    """iteration -> lm loss from a run's JSONL log (a restarted run's last record wins)."""
    out = {}
    for line in open(jsonl):
        r = json.loads(line)
        if "losses" in r and "lm loss" in r["losses"]:
            out[r["iteration"]] = r["losses"]["lm loss"]
    return out


def _native_threads() -> int:
    """OS threads of this process (gloo's live there), 0 where /proc is absent."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


def _validation_iterations(jsonl: str) -> list[int]:
    """Iterations at which the run logged a validation record."""
    if not os.path.isfile(jsonl):
        return []
    return [r["iteration"] for r in map(json.loads, open(jsonl)) if "validation" in r]


def run_layouts(root: str, data_prefix: str, layouts: dict[str, list[str]]) -> dict:
    """Each layout through tinytron.train.run in this world; the last rank returns the losses."""
    from tinytron.train import resolve_config, run

    out = {}
    for name, extra in layouts.items():
        save = os.path.join(root, name)
        argv = TINY + ["--data.data_path", data_prefix, "--checkpoint.save", save] + extra
        cfg = resolve_config(argv, dist.get_world_size())
        code = run(cfg, argv, name)
        jsonl = os.path.join(save, "log.jsonl")
        out[name] = {"code": code,
                     "losses": read_losses(jsonl) if os.path.isfile(jsonl) else None,
                     "validations": _validation_iterations(jsonl),
                     "threads": threading.active_count() + _native_threads()}
        dist.barrier()
    return out
