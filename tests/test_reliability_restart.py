"""Real torchrun jobs (2 gloo ranks on loopback): kills and restarts, a hang, SIGTERM.

Each launch costs several seconds (torchrun, two Python processes importing torch), so the
checks are batched: one uninterrupted reference, one job killed twice (once mid-save), one hang,
one SIGTERM + resume.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest

from tinytron.launch import run_on_ranks

from tests.reliability_workers import (inprocess_job, job_env, logged, run_job,
                                       signal_rank_when, step_losses, torchrun_cmd,
                                       tracker_iteration)

ITERS = ["--train-iters", "8", "--save-interval", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's local loss sums per (rank, iteration), exact floats."""
    save = tmp_path_factory.mktemp("reference")
    code, out, _ = run_job(save, ITERS)
    assert code == 0, out[-3000:]
    losses = step_losses(save)
    assert sorted(losses) == [(r, i) for r in (0, 1) for i in range(1, 9)]
    return losses


def test_sigkill_and_kill_during_save_restart_and_match_bitwise(tmp_path, reference):
    faults = ["--fault", "kill@3:rank=1:attempt=0",                        # life 0 dies in step 3
              "--fault", "kill_in_save@6:rank=0:attempt=1:point=mid_write"]  # life 1 dies saving 6
    code, out, _ = run_job(tmp_path, ITERS + faults, max_restarts=2)
    assert code == 0, out[-4000:]
    order = [it for it, _ in logged(tmp_path)]
    # life 0 logged 1, 2 (saved 2), died in 3; life 1 resumed at 2: 3..6, died writing
    # checkpoint 6 (the tracker still named 4); life 2 resumed at 4: 5..8.
    assert order == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8], order
    assert step_losses(tmp_path) == reference       # bitwise: float equality of every loss
    assert tracker_iteration(tmp_path) == 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("launch", ["master_port", "c10d_endpoint"])
def test_restart_under_each_launch_form_resumes_bitwise(tmp_path, reference, launch):
    """The launcher's shared store outlives the killed workers; the restart must not read it.

    `--standalone` is the other tests' form and the README's `--nproc-per-node` alone is
    tests/test_train.py's; these are the static rendezvous (`--master-port`, whose store is
    always the agent's) and `scripts/slurm_train.sh`'s c10d endpoint.
    """
    port = _free_port()
    form = {"master_port": (f"--master-port={port}",),
            "c10d_endpoint": ("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                              f"--rdzv-id=job{port}")}[launch]
    code, out, _ = run_job(tmp_path, ITERS + ["--fault", "kill@6:rank=1:attempt=0"],
                           max_restarts=1, launch=form)
    assert code == 0, out[-4000:]
    # life 0 logged 1..5 (saved 4) and died in 6; life 1 resumed at 4: 5..8
    assert [it for it, _ in logged(tmp_path)] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    assert step_losses(tmp_path) == reference
    assert tracker_iteration(tmp_path) == 8


def test_a_hung_rank_is_named_with_its_section_and_the_job_ends(tmp_path):
    args = ITERS + ["--fault", "hang@3:rank=1", "--ft-step-timeout", "2",
                    "--ft-heartbeat-interval", "0.2"]
    # the process group's timeout is 120 s: a job ended by it would leave no hang report
    code, out, _ = run_job(tmp_path, args, max_restarts=0, timeout=180)
    report = (tmp_path / "hang_report.txt").read_text()
    assert code != 0
    assert report.startswith("hang detected: rank 1 hung in section 'step' at iteration 3"), report
    assert "waiting for it in a collective: ranks [0]" in report
    assert [it for it, _ in logged(tmp_path)] == [1, 2]


def test_sigterm_saves_exits_zero_and_the_resumed_run_continues_the_curve(tmp_path, reference):
    proc = subprocess.Popen(torchrun_cmd(tmp_path, ITERS + ["--step-sleep", "0.4"]),
                            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        signal_rank_when(tmp_path, proc, rank=0, sig=signal.SIGTERM, after_iteration=2)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    stopped = tracker_iteration(tmp_path)
    assert 2 <= stopped < 8 and "reason: signal" in out
    assert max(it for it, _ in logged(tmp_path)) == stopped     # saved where it stopped
    code, out, _ = run_job(tmp_path, ITERS)
    assert code == 0, out[-3000:]
    assert step_losses(tmp_path) == reference


def test_inprocess_restart_after_a_raised_error_matches_bitwise(tmp_path, reference):
    args = ITERS + ["--fault", "raise@5:rank=1:attempt=0"]
    out = run_on_ranks(inprocess_job, 2, str(tmp_path), args, timeout=240)
    assert out == [(0, [0, 1]), (0, [0, 1])]        # both ranks: two attempts, exit code 0
    assert [it for it, _ in logged(tmp_path)] == [1, 2, 3, 4, 5, 6, 7, 8]  # resumed at 4
    assert step_losses(tmp_path) == reference


def _stopped(out: str) -> tuple[int, int]:
    """(iteration, exit code) from the job's own last line."""
    import re

    m = re.findall(r"\[run\] stopped at iteration (\d+) \(reason: \w+\), exit code (\d+)", out)
    assert m, out[-3000:]
    return int(m[-1][0]), int(m[-1][1])


def test_a_pending_rerun_is_restored_on_its_layout_and_ignored_on_another(tmp_path):
    """Megatron restores the rerun state only with equal world size, (TP, PP) and DP.

    A NaN that node-A's GPU gives at iteration 3 on every pass: exit 16 with a pending rerun
    on TP2. Relaunched on TP2 and node-A, the rerun resumes (and, on the suspect GPU, asks for
    another relaunch); relaunched on DP2 — the same two ranks — it is ignored, and iteration 3
    runs afresh on node-B.
    """
    from tinytron.reliability.result_checks import parse_tracker_file
    from tinytron.reliability.loop_hooks import rerun_state_path

    args = ["--train-iters", "4", "--save-interval", "2",
            "--fault", "nan@3:diagnostic=persistent_error:node=node-A"]
    tp2 = ["--tensor-model-parallel-size", "2"]
    code, out, _ = run_job(tmp_path, args + tp2 + ["--node-name", "node-A"])
    assert _stopped(out) == (2, 16), out[-3000:]
    assert all(os.path.exists(rerun_state_path(str(tmp_path), 2, r)) for r in (0, 1))
    tracked = len(parse_tracker_file(str(tmp_path / "result_rejected_tracker.txt")))

    code, out, _ = run_job(tmp_path, args + tp2 + ["--node-name", "node-A"])
    assert _stopped(out) == (2, 16), out[-3000:]   # restored: rerun again elsewhere
    assert "Job sharding has changed" not in out
    assert len(parse_tracker_file(str(tmp_path / "result_rejected_tracker.txt"))) == tracked

    code, out, _ = run_job(tmp_path, args + ["--node-name", "node-B"])   # DP2 now
    assert code == 0 and _stopped(out) == (4, 0), out[-3000:]
    assert out.count("Job sharding has changed: Rerun state will be ignored") == 1, out[-3000:]
    # no second opinion was given: the tracker is as the first launch left it
    assert len(parse_tracker_file(str(tmp_path / "result_rejected_tracker.txt"))) == tracked
    assert [it for it, _ in logged(tmp_path)] == [1, 2, 3, 4]
