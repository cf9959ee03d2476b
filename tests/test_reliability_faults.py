"""Fault injector: spec parsing, the passes each story strikes, rank/attempt filters, saves."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tinytron.reliability.fault_injection import (CHECKPOINT_FAULT_ENV, Fault, FaultInjector,
                                                  parse_fault)
from tinytron.reliability.rerun_diagnoses import RerunStateMachine
from tinytron.reliability.rerun_state_machine import RerunState


def test_parse_fault_round_trip_and_errors():
    f = parse_fault("nan@5:rank=1:diagnostic=persistent_error:attempt=0:target=grad")
    assert f == Fault("nan", 5, rank=1, diagnostic="persistent_error", attempt=0, target="grad")
    assert parse_fault("spike@2:factor=50").factor == 50.0
    assert parse_fault("kill_in_save@4:point=before_rename").point == "before_rename"
    for bad, word in [("nan", "kind@iteration"), ("nan@0", "1-based"), ("boom@1", "kind"),
                      ("nan@1:rank", "unknown option"), ("nan@1:target=weights", "target")]:
        with pytest.raises(ValueError, match=word):
            parse_fault(bad)


def _rsm_at(iteration, state, node="a"):
    rsm = RerunStateMachine(identity_func=lambda: (node, -1))
    rsm.current_iteration, rsm.state = iteration, state
    return rsm


@pytest.mark.parametrize("diagnostic, expected", [
    # (initial run on a, rerun in place on a, rerun from checkpoint on b)
    ("transient_error", [True, False, False]),
    ("persistent_error", [True, True, False]),
    ("correct_result", [True, True, True]),
])
def test_each_story_strikes_the_passes_it_should(diagnostic, expected):
    inj = FaultInjector([f"nan@3:diagnostic={diagnostic}"])
    passes = [_rsm_at(3, RerunState.INITIAL_RUN), _rsm_at(3, RerunState.RERUNNING_IN_PLACE),
              _rsm_at(3, RerunState.RERUNNING_FROM_CHECKPOINT, node="b")]
    got = [math.isnan(inj.corrupt(torch.tensor(1.0), "loss", r).item()) for r in passes]
    assert got == expected
    assert inj.corrupt(torch.tensor(1.0), "loss", _rsm_at(4, RerunState.INITIAL_RUN)).item() == 1.0


def test_value_kinds_and_targets():
    rsm = _rsm_at(2, RerunState.INITIAL_RUN)
    assert math.isinf(FaultInjector(["inf@2"]).corrupt(torch.tensor(2.0), "loss", rsm).item())
    spike = FaultInjector(["spike@2:factor=10"])
    assert spike.corrupt(torch.tensor(2.0), "loss", rsm).item() == 20.0
    grad = torch.ones(5)
    out = FaultInjector(["nan@2:target=grad"]).corrupt(grad, "grad", rsm)
    assert out is grad and math.isnan(grad[0].item()) and grad[1:].eq(1).all()  # in place
    grad_only = FaultInjector(["nan@2:target=grad"])
    assert grad_only.corrupt(torch.tensor(2.0), "loss", rsm).item() == 2.0
    loss = torch.tensor(3.0, requires_grad=True)
    bad = FaultInjector(["nan@2"]).corrupt(loss * 2, "loss", rsm)
    bad.backward()
    assert math.isnan(loss.grad.item())  # the NaN reaches the gradients, as a real one would


def test_rank_and_attempt_filters():
    faults = ["kill@3:rank=1:attempt=0", "hang@4:rank=1", "nan@2:rank=0"]
    assert [f.kind for f in FaultInjector(faults, rank=1, attempt=0).faults] == ["kill", "hang"]
    assert [f.kind for f in FaultInjector(faults, rank=1, attempt=1).faults] == ["hang"]
    assert [f.kind for f in FaultInjector(faults, rank=0, attempt=5).faults] == ["nan"]


def test_hang_never_returns_and_around_save_arms_one_save(monkeypatch):
    naps = []

    def sleep(s):
        naps.append(s)
        if len(naps) == 3:
            raise TimeoutError("still hanging")

    inj = FaultInjector(["hang@2", "kill_in_save@4:point=before_rename"], sleep=sleep)
    inj.at_step_start(1)
    with pytest.raises(TimeoutError):
        inj.at_step_start(2)
    assert naps == [3600, 3600, 3600]
    monkeypatch.delenv(CHECKPOINT_FAULT_ENV, raising=False)
    with inj.around_save(3):
        assert CHECKPOINT_FAULT_ENV not in os.environ
    with inj.around_save(4):
        assert os.environ[CHECKPOINT_FAULT_ENV] == "before_rename@0"
    assert CHECKPOINT_FAULT_ENV not in os.environ


def test_raise_fault_is_a_recoverable_error_only_in_its_attempt():
    with pytest.raises(RuntimeError, match="injected fault: rank 1, iteration 3"):
        FaultInjector(["raise@3:rank=1:attempt=0"], rank=1, attempt=0).at_step_start(3)
    FaultInjector(["raise@3:rank=1:attempt=0"], rank=1, attempt=1).at_step_start(3)
