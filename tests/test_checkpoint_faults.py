"""Atomicity with real processes: SIGKILL at chosen points of a sync and an async save, and a write
that hits a file-size limit. The tracker must keep naming the previous checkpoint, which loads
with the weights it was saved with; the failed save's error names the file and the cause."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint_workers import tiny_training
from tinytron.checkpoint import load_checkpoint, read_tracker

REPO = Path(__file__).resolve().parents[1]

# (format, mode, fault point, the process is killed?)
KILLS = [
    ("torch_dist", "sync", "before_write", True),          # common.pt written, no shard yet
    ("torch_dist", "sync", "mid_write", True),             # inside the shard file
    ("torch_dist", "sync", "before_metadata_json", True),  # .metadata written, metadata.json not
    ("torch_dist", "sync", "before_tracker", True),        # directory renamed, tracker not moved
    ("torch_dist", "process", "after_schedule", True),     # trainer dies, orphaned writer finishes
    ("torch_dist", "process", "mid_write", False),         # the writer dies; training survives
    ("torch_dist", "process", "before_finalize", True),    # all written, trainer dies at finalize
    ("torch", "sync", "mid_write", True),                  # between the two legacy files
]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Run every kill scenario at once (one process each); wait for all."""
    root = tmp_path_factory.mktemp("kills")
    procs = {}
    for i, (fmt, mode, point, _) in enumerate(KILLS):
        ckpt = root / f"case{i}"
        procs[i] = (ckpt, subprocess.Popen(
            [sys.executable, "-m", "tests.checkpoint_workers", "kill", str(ckpt), fmt, mode, point],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    for i, (ckpt, p) in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        results[i] = (ckpt, p.returncode, stdout, stderr)
    return results


@pytest.mark.parametrize("case", range(len(KILLS)),
                         ids=[f"{f}-{m}-{p}" for f, m, p, _ in KILLS])
def test_sigkill_leaves_the_previous_checkpoint(killed, case):
    fmt, mode, point, dies = KILLS[case]
    ckpt, returncode, stdout, stderr = killed[case]
    if dies:
        assert returncode == -9, (returncode, stderr[-2000:])
    else:
        assert returncode == 0, stderr[-2000:]
        error = json.loads(stdout.splitlines()[-1])["error"]
        assert "iter_0000002.tmp" in error and "died (exit code -9)" in error
    assert read_tracker(ckpt) == (1, False)
    _, model, opt, _ = tiny_training(seed=7)
    state = load_checkpoint(ckpt, model, opt, ckpt_format=fmt)
    expected = torch.load(str(ckpt) + ".expected.pt", weights_only=True)
    assert state.iteration == 1 and state.consumed_train_samples == 2
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
    complete = (ckpt / "iter_0000002").is_dir()
    assert complete == (point == "before_tracker")   # a visible directory is a complete one
    if complete:
        assert load_checkpoint(ckpt, model, opt, ckpt_step=2).iteration == 2


def test_failing_write_reports_path_and_cause(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tests.checkpoint_workers", "fsize", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout.splitlines()[-1])
    assert set(results) == {"torch_dist_sync", "torch_dist_process", "torch_dist_thread",
                            "torch_sync"}
    for name, r in results.items():
        assert "iter_0000002.tmp/" in r["error"] and "File too large" in r["error"], name
        assert r["tracker"] == 1 and r["loaded_iteration"] == 1 and r["weights_ok"], name
