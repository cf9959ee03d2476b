"""Chapter 01's naive pipeline schedules (GPipe, the bare 1F1B) against the trainer's 1F1B.

One 2-rank gloo world runs the three schedules on the same weights and micro-batches: the
naive ones must give the trainer's losses and, with the same operations in the same order,
bitwise its gradients (and one process's).
"""

from __future__ import annotations

import pytest

from tinytron.launch import run_on_ranks
from tinytron.main_loop import _workers as w

M = 6


@pytest.fixture(scope="module")
def stages():
    return run_on_ranks(w.naive_case, 2, M, timeout=300)


@pytest.mark.parametrize("schedule", ["gpipe", "bare"])
def test_naive_schedule_equals_the_trainers_1f1b(stages, schedule):
    for rank, res in enumerate(stages):
        assert res["stage"] == rank
        assert res[schedule]["grads_bitwise"], (schedule, rank, res[schedule]["vs_reference"])
        assert res[schedule]["losses_equal"], (schedule, rank)


def test_losses_only_on_the_last_stage_and_all_equal_one_process(stages):
    assert [res["num_reports"] for res in stages] == [0, M]
    for res in stages:
        for schedule in ("real", "gpipe", "bare"):
            gap, bitwise = res[schedule]["vs_reference"]
            assert bitwise, (schedule, res["stage"], gap)


def test_gpipe_holds_all_m_microbatches_and_1f1b_p_minus_r(stages):
    """LiveBytesMeter peaks (storage-counted, not timed): GPipe / 1F1B is about m / (p - r)."""
    for res in stages:
        expected = M / (2 - res["stage"])  # 3 on stage 0, 6 on stage 1
        ratio = res["peaks"]["gpipe"] / res["peaks"]["bare"]
        assert 0.6 * expected < ratio <= 1.05 * expected, (res["stage"], res["peaks"], ratio)
