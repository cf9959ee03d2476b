"""Injected faults through chapter 01's loop and chapter 03's checkpoints (one rank, in process)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch.distributed as dist

from tinytron.reliability._run import run
from tinytron.reliability.result_checks import (get_skipped_iterations_from_tracker_file,
                                                parse_tracker_file)
from tinytron.reliability.loop_hooks import rerun_state_path
from tests.reliability_workers import final_losses, logged, tracker_iteration

ITERS = ["--train-iters", "4", "--save-interval", "2", "--timing-log-level", "1"]


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _launch(save, *args, node="node-A"):
    before = os.environ.get("TINYTRON_NODE_NAME")
    try:
        return run(["--save", str(save), "--node", node, *ITERS, *args])
    finally:
        os.environ.pop("TINYTRON_NODE_NAME", None)
        if before is not None:
            os.environ["TINYTRON_NODE_NAME"] = before


def _statuses(save):
    return [e["status"] for e in parse_tracker_file(str(save / "result_rejected_tracker.txt"))]


def test_transient_nan_exits_17_without_a_new_checkpoint_and_resumes(tmp_path):
    assert _launch(tmp_path, "--fault", "nan@3:diagnostic=transient_error") == 17
    assert tracker_iteration(tmp_path) == 2          # the last periodic save, nothing newer
    assert _statuses(tmp_path) == ["INITIAL_RUN", "FIRST_RERUN_NOT_REPRODUCIBLE"]
    assert [it for it, _ in logged(tmp_path)] == [1, 2]
    assert _launch(tmp_path) == 0                     # resumed from iteration 2, fault gone
    assert [it for it, _ in logged(tmp_path)] == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in final_losses(tmp_path).values())


def test_persistent_nan_checkpoints_16_then_same_node_16_other_node_17(tmp_path):
    fault = ["--fault", "nan@3:diagnostic=persistent_error:node=node-A"]
    assert _launch(tmp_path, *fault) == 16
    assert tracker_iteration(tmp_path) == 2
    assert os.path.exists(rerun_state_path(str(tmp_path), 2, 0))
    assert _launch(tmp_path, *fault, node="node-A") == 16   # rescheduled on the bad GPU
    assert _launch(tmp_path, *fault, node="node-B") == 17
    assert _statuses(tmp_path) == ["INITIAL_RUN", "FIRST_RERUN_REPRODUCIBLE",
                                   "SECOND_RERUN_NOT_REPRODUCIBLE"]
    assert get_skipped_iterations_from_tracker_file(
        str(tmp_path / "result_rejected_tracker.txt")) == []


def test_bad_data_is_a_correct_result_and_marked_for_skipping(tmp_path):
    fault = ["--fault", "inf@3:diagnostic=correct_result"]
    assert _launch(tmp_path, *fault) == 16
    assert _launch(tmp_path, *fault, node="node-B") == 17
    assert _statuses(tmp_path)[-1] == "SECOND_RERUN_REPRODUCIBLE"
    assert get_skipped_iterations_from_tracker_file(
        str(tmp_path / "result_rejected_tracker.txt")) == [3]
    assert _launch(tmp_path, *fault, node="node-C") == 0   # the next launch skips iteration 3
    assert [it for it, _ in logged(tmp_path)] == [1, 2, 4]
    last = [json.loads(x) for x in open(tmp_path / "losses.jsonl")][-1]
    assert (last["consumed_train_samples"], last["skipped_train_samples"]) == (32, 8)


def test_nan_in_a_gradient_bucket_is_caught_by_the_grad_check(tmp_path):
    assert _launch(tmp_path, "--fault", "nan@4:target=grad") == 17
    events = parse_tracker_file(str(tmp_path / "result_rejected_tracker.txt"))
    assert [e["iteration"] for e in events] == [4, 4]
    assert events[0]["message"] == ("found NaN in local grad norm for bucket #0 in backward pass "
                                    "before data-parallel communication collective")


def test_reliability_config_errors_name_the_field():
    from tinytron.reliability.loop_hooks import ReliabilityConfig

    for kwargs, word in [(dict(rerun_mode="report_stats"), "rerun_mode"),
                         (dict(ft_step_timeout=0), "ft_step_timeout"),
                         (dict(ft_heartbeat_interval=40.0), "ft_heartbeat_interval"),
                         (dict(faults=["boom@1"]), "boom")]:
        with pytest.raises(ValueError, match=word):
            ReliabilityConfig(**kwargs)


def test_signal_handler_absorbs_ctrl_c_for_ten_seconds_and_not_after():
    """One Ctrl-C reaches a rank twice (the terminal's and torchrun's): the second SIGINT within
    absorb_s of the first is recorded, not fatal; one later than that stops at once."""
    import signal
    import time

    from tinytron.reliability.restarts import DistributedSignalHandler

    before = signal.getsignal(signal.SIGTERM)
    with DistributedSignalHandler() as handler:
        assert not handler.received() and handler.absorb_s == 10.0
        os.kill(os.getpid(), signal.SIGINT)
        assert handler.received() and handler.received_signals == [signal.SIGINT]
        os.kill(os.getpid(), signal.SIGINT)   # torchrun's copy of the same Ctrl-C
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.received_signals == [signal.SIGINT, signal.SIGINT, signal.SIGTERM]
    with DistributedSignalHandler(absorb_s=0.05) as handler:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before     # restored on exit


def test_pending_rerun_state_is_ignored_on_another_world_size(tmp_path):
    import torch

    from tinytron.reliability.loop_hooks import Reliability, ReliabilityConfig
    from tinytron.reliability.rerun_state_machine import RerunState

    donor = Reliability(ReliabilityConfig(), save_dir=str(tmp_path), rank=0, world_size=2)
    donor.rsm.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
    donor._save_rerun_state(6)
    saved = torch.load(rerun_state_path(str(tmp_path), 6, 0), weights_only=True)
    assert saved["world_size"] == 2
    for world, expected in [(2, RerunState.WILL_RERUN_FROM_CHECKPOINT),
                            (4, RerunState.NOT_RUNNING_YET)]:
        rel = Reliability(ReliabilityConfig(), save_dir=str(tmp_path), rank=0, world_size=world)
        rel._load_rerun_state(6)
        assert rel.rsm.state == expected and rel.rsm.current_iteration == 6
