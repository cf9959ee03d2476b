"""The bucket grad check runs on each rank's local grads, before the collective (2 gloo ranks).

One launch: chapter 05's DDP under chapter 08's schedule wrapper, step by step (a NaN from rank
1's backward, then from the injector's grad fault), and the tiny job of chapter 08 through
chapter 01's loop (the injector's grad fault on rank 1).
"""

from __future__ import annotations

import math

import pytest

from tinytron.launch import run_on_ranks
from tinytron.reliability.result_checks import parse_tracker_file

from tests.reliability_workers import local_grad_attribution

MESSAGE = ("found NaN in local grad norm for bucket #0 in backward pass before data-parallel "
           "communication collective")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    save = tmp_path_factory.mktemp("attribution")
    return save, run_on_ranks(local_grad_attribution, 2, str(save), timeout=240)


@pytest.mark.parametrize("kind", ["backward", "injector"])
def test_only_the_faulty_rank_rejects_though_the_nan_reached_both(launched, kind):
    """`backward`: the NaN is written before the check, whatever runs where (a check moved
    after the collective fails here); `injector`: the grad fault strikes inside the check."""
    save, out = launched
    r0, r1 = out[0][kind], out[1][kind]
    # Iteration 2's first pass: rank 1's check saw the NaN, rank 0's saw a finite local norm ...
    seen = [{(it, state): n for it, state, n in o[kind]["norms"]} for o in out]
    assert math.isnan(seen[1][(2, "INITIAL_RUN")]) and math.isfinite(seen[0][(2, "INITIAL_RUN")])
    assert all(math.isfinite(n) for k, n in seen[1].items() if k != (2, "INITIAL_RUN"))
    # ... although after the all-reduce rank 0's buffer held the NaN too: a check there would
    # have rejected it on both ranks.
    assert [after for _, _, after in r0["passes"]] == [False, True, False, None]
    assert r0["rejected"] is None and r1["rejected"] == MESSAGE
    events = parse_tracker_file(str(save / f"{kind}_tracker.txt"))
    assert [(e["rank"], e["iteration"], e["status"]) for e in events] == [
        (1, 2, "INITIAL_RUN"), (1, 2, "FIRST_RERUN_NOT_REPRODUCIBLE")]
    assert math.isnan(events[0]["result"]) and events[0]["message"] == MESSAGE
    # Every rank reran the step in place (the fault was transient): exit 17, Megatron's code.
    assert r0["code"] == r1["code"] == 17


def test_the_check_is_installed_for_each_training_pass_and_never_for_evaluation(launched):
    _, out = launched
    for d in [o[kind] for o in out for kind in ("backward", "injector")]:
        # iteration 1 (one pass), iteration 2 (first pass + rerun in place), then evaluation
        assert [(state, installed) for state, installed, _ in d["passes"]] == [
            ("INITIAL_RUN", True), ("INITIAL_RUN", True), ("RERUNNING_IN_PLACE", True),
            ("eval", False)]
        assert [(it, state) for it, state, _ in d["norms"]] == [
            (1, "INITIAL_RUN"), (2, "INITIAL_RUN"), (2, "RERUNNING_IN_PLACE")]
        assert d["removed"]       # no check left behind on the buckets after a pass


def test_through_the_loop_rank_1_reports_its_own_nan_and_the_job_exits_17(launched):
    save, out = launched
    assert [o["job_code"] for o in out] == [17, 17]
    events = parse_tracker_file(str(save / "job" / "result_rejected_tracker.txt"))
    assert [(e["rank"], e["iteration"], e["status"]) for e in events] == [
        (1, 3, "INITIAL_RUN"), (1, 3, "FIRST_RERUN_NOT_REPRODUCIBLE")]
    assert math.isnan(events[0]["result"]) and events[0]["message"] == MESSAGE
