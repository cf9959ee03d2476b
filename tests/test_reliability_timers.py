"""Timers: levels and dummies, running reads, zero-ignoring min/max in ms, a 2-rank straggler."""

from __future__ import annotations

import time

import pytest

from tinytron.launch import run_on_ranks
from tinytron.reliability._workers import straggler_timers
from tinytron.reliability.timers import DummyTimer, Timer, Timers


def test_levels_dummies_and_conflicts():
    t = Timers(log_level=1)
    assert isinstance(t("forward-compute"), DummyTimer)       # Megatron level 2
    assert isinstance(t("my-new-timer"), DummyTimer)          # no level given -> 2
    assert isinstance(t("optimizer"), Timer) and t("optimizer") is t("optimizer")
    t("mine", log_level=0)
    with pytest.raises(ValueError, match="level 0"):
        t("mine", log_level=1)
    with pytest.raises(RuntimeError, match="timing-log-level"):
        t("forward-compute").elapsed()
    with pytest.raises(ValueError, match="timing_log_level"):
        Timers(log_level=3)
    with pytest.raises(ValueError, match="timing_log_option"):
        Timers(log_option="median")


def test_elapsed_on_a_running_timer_keeps_it_running_and_active_time_survives_reset():
    timer = Timer("x")
    timer.start()
    time.sleep(0.02)
    first = timer.elapsed(reset=True)
    time.sleep(0.02)
    timer.stop()
    second = timer.elapsed(reset=False)
    assert first >= 0.02 and second >= 0.02 and timer.active_time() >= first + second - 1e-9
    with pytest.raises(RuntimeError, match="not started"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="already"):
        timer.start()


def test_single_process_report_in_ms_and_formats():
    t = Timers(log_level=2, log_option="minmax")
    t("forward-backward").start()
    time.sleep(0.05)
    t("forward-backward").stop()
    mm = t.get_min_max(["forward-backward", "optimizer"], normalizer=2.0, reset=False)
    assert list(mm) == ["forward-backward"]                   # never-run timers are absent
    assert 25.0 <= mm["forward-backward"][0] == mm["forward-backward"][1] < 200.0
    text = t.log_string(["forward-backward"], reset=False)
    assert text.startswith("(min, max) time across ranks (ms):\n    forward-backward ....")
    t.log_option = "max"
    assert t.log_string(["forward-backward"], reset=False).startswith("max time across ranks (ms):")
    t.log_option = "all"
    assert "rank  0:" in t.log_string(["forward-backward"], reset=True)
    assert t.log_string(["forward-backward"]) is None           # reset: nothing left to report


def test_straggler_min_max_across_two_gloo_ranks():
    out = run_on_ranks(straggler_timers, 2, 3, {0: 0.02, 1: 0.12}, timeout=120)
    mm = out[0]["min_max"]
    lo, hi = mm["forward-compute"]
    assert 20.0 <= lo < 100.0 and 120.0 <= hi < 400.0          # per-iteration ms, loose on load
    assert hi - lo >= 90.0
    assert mm["embedding-grads-all-reduce"][0] == mm["embedding-grads-all-reduce"][1] > 0
    assert out[1]["stragglers"]["forward-compute"][::2] == (0, 1)  # fastest 0, slowest 1
    assert out[0]["min_max"] == out[1]["min_max"]
    # the barrier in 'interval-time' makes the fast rank's iteration wait for the slow
    # rank's forward (without it rank 0's iteration would be ~50 ms); load only adds to this
    it_lo, _ = mm["interval-time"]
    assert it_lo - lo > 0.5 * (hi - lo)
