"""Fault tolerance: who is blamed for a hang, a frozen rank seen through a real TCPStore."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tinytron.reliability.fault_tolerance import (EXIT_CODE_HANG_DETECTED, FaultToleranceConfig,
                                                  RankMonitor, find_hung_ranks,
                                                  main_thread_position)

CFG = FaultToleranceConfig(step_timeout=10, checkpoint_timeout=20, out_of_section_timeout=30,
                           heartbeat_timeout=5, heartbeat_interval=1)


def _rep(section, in_collective, it=4, where="f.py:1 in g"):
    return {"section": section, "iteration": it, "in_collective": in_collective, "where": where}


def test_nobody_late_no_verdict_and_each_section_has_its_timeout():
    reps = {0: _rep("step", True), 1: _rep("checkpoint", False), 2: _rep(None, False)}
    assert find_hung_ranks(reps, {0: (0.1, 9.9), 1: (0.1, 19.9), 2: (0.1, 29.9)}, CFG) is None
    v = find_hung_ranks(reps, {0: (0.1, 1.0), 1: (0.1, 20.5), 2: (0.1, 1.0)}, CFG)
    # both are busy outside a collective
    assert "rank 1 hung in section 'checkpoint'" in v and "rank 2" in v


def test_the_rank_outside_the_collective_is_blamed_not_the_waiting_ones():
    reps = {0: _rep("step", True), 1: _rep("step", False, where="loader.py:88 in next"),
            2: _rep("step", True)}
    v = find_hung_ranks(reps, {0: (0.1, 11.0), 1: (0.2, 9.0), 2: (0.1, 10.5)}, CFG)
    assert v.startswith("hang detected: rank 1 hung in section 'step' at iteration 4")
    assert "loader.py:88 in next" in v and v.endswith("ranks [0, 2]")


def test_frozen_rank_and_all_waiting_case():
    reps = {0: _rep("step", True), 1: _rep("step", True)}
    v = find_hung_ranks(reps, {0: (0.1, 3.0), 1: (6.0, 3.0)}, CFG)
    assert "rank 1 stopped beating 6.0 s ago" in v and v.endswith("ranks [0]")
    v = find_hung_ranks(reps, {0: (0.1, 10.5), 1: (0.1, 9.0)}, CFG)   # e.g. a network hang
    assert "rank 0 hung" in v and "rank 1" not in v


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="step_timeout"):
        FaultToleranceConfig(step_timeout=0)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        FaultToleranceConfig(heartbeat_interval=5, heartbeat_timeout=5)
    with pytest.raises(ValueError, match="section must be"):
        with RankMonitor(CFG, 0, 1, store=object()).section("lunch"):
            pass


def test_main_thread_position_reports_where_the_main_thread_waits():
    import threading

    seen, inside = [], []

    def look():
        while not inside:  # wait until the main thread is past start() and in this frame
            time.sleep(0.001)
        seen.append(main_thread_position())

    t = threading.Thread(target=look)
    t.start()
    inside.append(True)
    while not seen:  # only C calls from here on: the main thread's innermost frame is this one
        time.sleep(0.01)
    t.join()
    where, in_collective = seen[0]
    assert "test_reliability_ft.py" in where and "test_main_thread_position" in where
    assert not in_collective


def test_a_frozen_rank_is_reported_through_a_real_store(tmp_path):
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    store = dist.PrefixStore("t/", master)
    cfg = FaultToleranceConfig(heartbeat_interval=0.05, heartbeat_timeout=0.6,
                               report_path=str(tmp_path / "verdict.txt"))
    exits = []
    frozen = RankMonitor(cfg, 1, 2, store=store, exit_fn=exits.append)
    frozen._open("setup")
    frozen.on_training_step_start(1)
    frozen._publish()                      # one beat, then silence: the process "froze"
    alive = RankMonitor(cfg, 0, 2, store=store, exit_fn=exits.append).start()
    alive.on_training_step_start(1)
    t0 = time.monotonic()
    while not exits and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert exits == [EXIT_CODE_HANG_DETECTED]
    text = (tmp_path / "verdict.txt").read_text()
    assert "rank 1 stopped beating" in text and "(frozen or dead)" in text
    silent = float(re.search(r"stopped beating ([0-9.]+) s ago", text).group(1))
    assert silent >= round(cfg.heartbeat_timeout, 1)   # not blamed before its beat was overdue
    assert alive.verdict == text.strip()
    assert alive.section_times["setup"] >= 0.0


def test_the_rank_behind_is_blamed_when_the_waiting_rank_sits_in_a_host_sync():
    """NCCL returns from a collective at once: the waiting rank blocks later, outside
    torch.distributed. The progress marks still tell who is behind."""
    reps = {0: dict(_rep("step", False, where="loss.py:40 in item"), section_seq=7, marks=12),
            1: dict(_rep("step", False, where="loader.py:88 in next"), section_seq=7, marks=9)}
    v = find_hung_ranks(reps, {0: (0.1, 11.0), 1: (0.2, 11.0)}, CFG)
    assert v.startswith("hang detected: rank 1 hung in section 'step' at iteration 4"), v
    assert "rank 0 hung" not in v
    assert v.endswith("waiting for it, further along the step: ranks [0]"), v


def test_a_rank_blocked_in_a_host_sync_is_not_blamed_on_two_gloo_ranks(tmp_path):
    """Rank 1 hangs at the start of step 3; rank 0 issues its all-reduce asynchronously (as
    NCCL does) and blocks in work.wait(), a host sync outside any torch.distributed frame."""
    from tests.reliability_workers import host_sync_hang_job
    from tinytron.launch import RankError, run_on_ranks

    report = tmp_path / "hang.txt"
    with pytest.raises(RankError) as err:
        run_on_ranks(host_sync_hang_job, 2, str(report), timeout=120)
    # the hung rank's monitor ends it; rank 0 may fail first in its wait once rank 1 is gone
    assert f"code {EXIT_CODE_HANG_DETECTED}" in err.value.failures[1], err.value.failures
    verdict = report.read_text().strip()
    assert verdict.startswith("hang detected: rank 1 hung in section 'step' at iteration 3"), \
        verdict
    assert "rank 0 hung" not in verdict
    assert verdict.endswith("waiting for it, further along the step: ranks [0]"), verdict


def test_a_failed_collective_waits_for_the_hang_verdict():
    """A peer ended for a hang makes this rank's collective fail first: the verdict still wins."""
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    store = dist.PrefixStore("w/", master)
    store.set("verdict", "1|hang detected: rank 1 hung in section 'step' at iteration 3")
    cfg = FaultToleranceConfig(heartbeat_interval=0.05, heartbeat_timeout=5.0)
    exits = []
    monitor = RankMonitor(cfg, 0, 2, store=store, exit_fn=exits.append).start()
    t0 = time.monotonic()
    monitor.wait_for_verdict()             # what the loop does when its all-reduce raised
    assert exits == [EXIT_CODE_HANG_DETECTED] and time.monotonic() - t0 < cfg.heartbeat_timeout
    assert monitor.verdict.startswith("hang detected: rank 1 hung")
