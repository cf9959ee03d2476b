"""Rerun state machine and result checks: transitions, verdicts, replay, tracker, payload."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tinytron.reliability import (RerunConfig, RerunDataIterator, RerunDiagnostic,
                                  RerunErrorInjector, RerunMode, RerunState, RerunStateMachine,
                                  build_rerun_state_machine, checked_loss_func, compare_floats,
                                  get_skipped_iterations_from_tracker_file)
from tinytron.reliability.result_checks import parse_tracker_file

NAN = float("nan")


def _machine(tmp_path=None, node="n0", **kw):
    tracker = None if tmp_path is None else str(tmp_path / "tracker.txt")
    ident = {"node": node}
    rsm = RerunStateMachine(tracker_path=tracker, identity_func=lambda: (ident["node"], -1), **kw)
    return rsm, ident


def _step(rsm, data, values, fatal=True, message="loss is NaN", check=torch.isnan):
    """One train step, each pass validating `values(rsm)`; returns the passes and the decision."""
    passes = []
    while rsm.should_run_forward_backward(data):
        seen, batches = [], []
        for v in values(rsm):
            batches.append(next(data))
            rsm.validate_result(torch.tensor(v), check, message, fatal=fatal)
            seen.append(v)
        passes.append((rsm.state, seen, batches))
    return passes, rsm.should_checkpoint_and_exit()


def _data():
    return RerunDataIterator(itertools.count())


def test_compare_floats_edge_cases():
    assert compare_floats(NAN, NAN) == 0.0
    assert compare_floats(NAN, 1.0) == math.inf and compare_floats(1.0, math.inf) == math.inf
    assert compare_floats(NAN, math.inf) == math.inf
    assert compare_floats(2.0, 2.0) == 0.0
    assert compare_floats(1.0, 3.0) == pytest.approx(1.0)       # |2(1-3)/(1+3)|
    assert compare_floats(math.inf, -math.inf) == math.inf      # not a silent match
    assert compare_floats(1.5, -1.5) == math.inf                # a + b = 0: no ZeroDivisionError


def test_healthy_steps_run_once_and_count_iterations():
    rsm, _ = _machine()
    data = _data()
    for it in range(1, 4):
        passes, decision = _step(rsm, data, lambda r: [1.0, 2.0])
        assert [p[0] for p in passes] == [RerunState.INITIAL_RUN]
        assert decision == (False, False, 0) and rsm.current_iteration == it
        assert rsm.state == RerunState.NOT_RUNNING_YET


def test_first_iteration_is_not_validated_but_disabled_mode_raises():
    rsm, _ = _machine()
    passes, decision = _step(rsm, _data(), lambda r: [NAN])
    assert len(passes) == 1 and decision == (False, False, 0)
    off, _ = _machine(mode="disabled")
    with pytest.raises(RuntimeError, match=r"Rank 0, node n0, device -1, iteration 1.*loss is NaN"):
        _step(off, _data(), lambda r: [NAN])


def test_bad_mode_names_the_value():
    with pytest.raises(ValueError, match="report_stats"):
        RerunStateMachine("report_stats")
    with pytest.raises(ValueError, match="rerun_mode.*say 'report_determinism_stats'"):
        RerunConfig(rerun_mode="report_stats")   # Megatron's config spelling (see the page)
    with pytest.raises(ValueError, match="error_injection_type"):
        RerunConfig(error_injection_type="cosmic")


def test_transient_reruns_in_place_replays_data_and_exits_17(tmp_path):
    rsm, _ = _machine(tmp_path)
    data = _data()
    _step(rsm, data, lambda r: [1.0, 1.0])
    passes, decision = _step(rsm, data, lambda r: [NAN, 1.0] if r.state == RerunState.INITIAL_RUN
                             else [1.0, 1.0])
    assert [p[0] for p in passes] == [RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE]
    assert decision == (False, True, 17) and rsm.diagnosis == RerunDiagnostic.TRANSIENT_ERROR
    assert [p[2] for p in passes] == [[2, 3], [2, 3]]  # the rerun replayed the same micro-batches
    statuses = [e["status"] for e in parse_tracker_file(str(tmp_path / "tracker.txt"))]
    assert statuses == ["INITIAL_RUN", "FIRST_RERUN_NOT_REPRODUCIBLE"]
    assert rsm.failed_validation_call.sequence == 1


def test_only_the_first_rejection_of_a_pass_is_tracked_and_sequence_matches(tmp_path):
    rsm, _ = _machine(tmp_path)
    data = _data()
    _step(rsm, data, lambda r: [1.0, 1.0, 1.0])
    # initial: call #2 and #3 are NaN; rerun: #2 is fine, #3 still NaN -> compared is #2 only
    passes, decision = _step(rsm, data, lambda r: [1.0, NAN, NAN] if r.state ==
                             RerunState.INITIAL_RUN else [1.0, 1.0, NAN])
    assert rsm.failed_validation_call.sequence == 2
    assert decision == (False, True, 17)
    assert len(parse_tracker_file(str(tmp_path / "tracker.txt"))) == 2


def test_persistent_error_matrix_with_relaunches(tmp_path):
    rsm, ident = _machine(tmp_path, node="bad")
    data = _data()
    bad = lambda r: [NAN] if ident["node"] == "bad" else [1.0]  # noqa: E731
    _step(rsm, data, lambda r: [1.0])
    passes, decision = _step(rsm, data, bad)
    assert decision == (True, True, 16) and rsm.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert (rsm.suspicious_node, rsm.suspicious_device) == ("bad", -1)
    saved = rsm.state_dict()

    def relaunch(node):
        r, idt = _machine(tmp_path, node=node)
        r.load_state_dict(saved)
        r.current_iteration = 1  # the trainer's sync with the loaded iteration
        idt["node"] = node
        ident["node"] = node
        return r, _step(r, RerunDataIterator(itertools.count()), bad)

    r, (passes, decision) = relaunch("bad")
    assert [p[0] for p in passes] == [RerunState.RERUNNING_FROM_CHECKPOINT]
    assert decision == (False, True, 16) and r.current_iteration == 2
    r, (passes, decision) = relaunch("good")
    assert decision == (False, True, 17) and r.diagnosis == RerunDiagnostic.PERSISTENT_ERROR
    statuses = [e["status"] for e in parse_tracker_file(str(tmp_path / "tracker.txt"))]
    assert statuses == ["INITIAL_RUN", "FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_NOT_REPRODUCIBLE"]
    assert get_skipped_iterations_from_tracker_file(str(tmp_path / "tracker.txt")) == []


def test_correct_result_is_skipped_on_the_next_launch(tmp_path):
    rsm, ident = _machine(tmp_path, node="a")
    data = _data()
    _step(rsm, data, lambda r: [1.0])
    _, decision = _step(rsm, data, lambda r: [NAN])
    assert decision == (True, True, 16)
    r, idt = _machine(tmp_path, node="b")
    r.load_state_dict(rsm.state_dict())
    r.current_iteration = 1
    _, decision = _step(r, _data(), lambda x: [NAN])
    assert decision == (False, True, 17) and r.diagnosis == RerunDiagnostic.CORRECT_RESULT
    assert get_skipped_iterations_from_tracker_file(str(tmp_path / "tracker.txt")) == [2]


def test_non_fatal_spike_continues_with_the_rerun_values(tmp_path):
    rsm, _ = _machine(tmp_path)
    data = _data()
    spiky = lambda v: v > 100  # noqa: E731
    _step(rsm, data, lambda r: [1.0], check=spiky, fatal=False, message="Spiky loss")
    passes, decision = _step(rsm, data, lambda r: [1000.0] if r.state == RerunState.INITIAL_RUN
                             else [1.0], check=spiky, fatal=False, message="Spiky loss")
    assert [p[0] for p in passes] == [RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE]
    assert passes[-1][1] == [1.0] and decision == (False, False, 0)   # optimizer uses the rerun
    assert rsm.state == RerunState.NOT_RUNNING_YET
    # persistent non-fatal: reproducible in place -> continue too, no checkpoint
    passes, decision = _step(rsm, data, lambda r: [1000.0], check=spiky, fatal=False,
                             message="Spiky loss")
    assert len(passes) == 2 and decision == (False, False, 0)


def test_rerun_replays_rng_so_dropout_losses_are_bitwise_equal():
    rsm, _ = _machine(mode="report_determinism_stats")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5),
                                torch.nn.Linear(32, 1))
    g = torch.Generator().manual_seed(3)
    data = RerunDataIterator(iter([torch.randn(4, 8, generator=g) for _ in range(10)]))
    losses = []
    for _ in range(3):
        while rsm.should_run_forward_backward(data):
            loss = model(next(data)).pow(2).mean()
            rsm.validate_result(loss, torch.isnan, "loss")
            losses.append((rsm.state, loss.item()))
        assert rsm.should_checkpoint_and_exit() == (False, False, 0)
    pairs = list(zip(losses[::2], losses[1::2]))
    assert len(pairs) == 3 and all(a[1] == b[1] for a, b in pairs)
    assert pairs[0][0][1] != pairs[1][0][1]  # different steps draw different masks and data
    assert rsm.determinism_diffs["loss"] == [0.0, 0.0, 0.0]


def test_rewind_asks_for_no_more_than_was_read():
    d = RerunDataIterator(iter(range(5)))
    d.advance()
    assert [next(d), next(d)] == [0, 1]
    d.rewind()
    assert [next(d), next(d)] == [0, 1]
    with pytest.raises(RuntimeError, match="micro-batch 3"):
        next(d)
    d.advance()
    assert next(d) == 2
    with pytest.raises(TypeError, match="RerunDataIterator"):
        RerunStateMachine().should_run_forward_backward(iter([1]))


def test_unexpectedly_large_warmup_threshold_and_resample():
    rsm = RerunStateMachine()
    assert not any(rsm.is_unexpectedly_large(v, 10, "grads", num_samples=3)
                   for v in [1.0, 3.0, 2.0])
    assert not rsm.is_unexpectedly_large(29.9, 10, "grads", num_samples=3)
    assert rsm.is_unexpectedly_large(30.0, 10, "grads", num_samples=3)
    assert rsm.is_unexpectedly_large(-30.0, 10, "grads", num_samples=3)   # magnitude
    assert not rsm.is_unexpectedly_large(math.inf, 10, "grads", num_samples=3)
    assert not rsm.is_unexpectedly_large(30.0, 10, "grads", num_samples=3, resample=True)


def test_state_dict_same_keys_in_steady_and_fault_state_and_disabled_ignores(tmp_path):
    rsm, _ = _machine(tmp_path)
    steady = rsm.state_dict()
    data = _data()
    _step(rsm, data, lambda r: [1.0])
    _step(rsm, data, lambda r: [NAN])
    fault = rsm.state_dict()
    assert steady.keys() == fault.keys()
    assert fault["flags"][0] is True and steady["flags"][0] is False
    assert fault["state"] == RerunState.WILL_RERUN_FROM_CHECKPOINT
    off = RerunStateMachine("disabled")
    off.load_state_dict(fault)
    assert off.state == RerunState.NOT_RUNNING_YET and off.mode == RerunMode.DISABLED


def test_state_dict_takes_a_plain_iterator_in_steady_state(tmp_path):
    """Megatron reads the data iterator only when a rerun is pending
    (rerun_state_machine.py:823-824): in steady state a plain iterator is accepted and the
    checkpoint stores no data; with a step to replay, the iterator must be replayable."""
    rsm, _ = _machine(tmp_path)
    _step(rsm, _data(), lambda r: [1.0])
    assert rsm.state == RerunState.NOT_RUNNING_YET
    assert rsm.state_dict(data_iterator=iter([1, 2, 3]))["data_iterators"] is None
    assert rsm.state_dict(data_iterator=[iter([1]), None])["data_iterators"] is None
    data = _data()
    _step(rsm, data, lambda r: [NAN])
    assert rsm.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert rsm.state_dict(data_iterator=data)["data_iterators"] is not None
    with pytest.raises(TypeError):
        rsm.state_dict(data_iterator=iter([1, 2, 3]))


def test_random_injector_forces_verdicts_and_survives_checkpoint(tmp_path):
    cfg = RerunConfig(error_injection_rate=1, error_injection_type="persistent_error",
                      result_rejected_tracker_filename=str(tmp_path / "t.txt"))
    rsm = build_rerun_state_machine(cfg, identity_func=lambda: ("a", 0))
    data = _data()
    _step(rsm, data, lambda r: [1.0])
    _, decision = _step(rsm, data, lambda r: [1.0])  # healthy values, rejected by injection
    assert decision == (True, True, 16)
    r2 = build_rerun_state_machine(cfg, identity_func=lambda: ("b", 0))
    r2.load_state_dict(rsm.state_dict())
    r2.current_iteration = 1
    _, decision = _step(r2, _data(), lambda r: [1.0])
    assert decision == (False, True, 17) and r2.diagnosis == RerunDiagnostic.PERSISTENT_ERROR
    assert isinstance(r2.error_injector, RerunErrorInjector)
    assert r2.error_injector.injected_error_type is None          # the verdict re-armed it


@pytest.mark.parametrize("kind", ["transient_error", "persistent_error", "correct_result"])
def test_random_injector_rearms_after_each_verdict(kind):
    """A non-fatal check over 60 steps at rate 3: about one injection in three, not one per job."""
    cfg = RerunConfig(error_injection_rate=3, error_injection_type=kind)
    rsm = build_rerun_state_machine(cfg, identity_func=lambda: ("a", 0))
    data, injected = _data(), 0
    for _ in range(60):
        passes, decision = _step(rsm, data, lambda r: [1.0], fatal=False)
        assert decision == (False, False, 0), decision   # non-fatal: every verdict continues
        injected += [p[0] for p in passes] == [RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE]
        assert rsm.error_injector.injected_error_type is None   # re-armed after each verdict
    # 59 validated steps at 1 in 3: the seed-0 draws give a count well inside these bounds
    assert 10 <= injected <= 35, injected


def test_checked_loss_func_validates_the_corrupted_loss():
    rsm, _ = _machine()
    cfg = RerunConfig()
    data = _data()

    def loss_func(out):
        s = out.sum()
        return s, 4, {"lm loss": torch.stack([s.detach(), torch.tensor(4.0)])}

    state = {"corrupt": False}
    f = checked_loss_func(loss_func, rsm, cfg,
                          corrupt=lambda loss, what: loss * NAN if state["corrupt"] else loss)
    for corrupt in (False, True):
        state["corrupt"] = corrupt
        while rsm.should_run_forward_backward(data):
            next(data)
            loss, n, report = f(torch.ones(4, requires_grad=True))
            state["corrupt"] = False  # transient: only the first pass
        decision = rsm.should_checkpoint_and_exit()
    assert decision == (False, True, 17)
    assert math.isnan(rsm.initial_result)


@pytest.mark.parametrize("mode", [m.value for m in RerunMode])
def test_the_trainers_data_iterator_keeps_at_most_one_step_of_micro_batches(mode):
    """300 steps x 4 micro-batches through the trainer's wrapped iterator: one step stays alive."""
    import weakref

    from tinytron.reliability import Reliability, ReliabilityConfig

    rel = Reliability(ReliabilityConfig(rerun_mode=mode), rank=0, world_size=1)
    alive: list = []

    def batches():
        for i in itertools.count():
            t = torch.full((64,), float(i))
            alive.append(weakref.ref(t))
            yield t

    data, held = rel.data_iterator(batches()), []
    for _ in range(300):
        while rel.rsm.should_run_forward_backward(data):
            for _ in range(4):
                b = next(data)
                rel.rsm.validate_result(b.sum(), torch.isnan, "loss is NaN")
            b = None
        assert rel.rsm.should_checkpoint_and_exit() == (False, False, 0)
        held.append(sum(r() is not None for r in alive))
    assert len(alive) == 1200
    # disabled: only the generator's own last item; else the current step's four micro-batches
    assert max(held) <= (1 if mode == "disabled" else 4), (mode, max(held), held[-1])
    if mode == "disabled":
        assert data.saved_microbatches == []


def test_determinism_stats_are_gathered_from_every_rank():
    """Two gloo ranks: only rank 1's values change on the rerun; rank 0's report shows them."""
    from tests.reliability_workers import determinism_stats_job
    from tinytron.launch import run_on_ranks

    out = run_on_ranks(determinism_stats_job, 2, timeout=120)
    report, held = out[0]
    # 4 steps x 2 values per rank per step; reports at iterations 2 and 4 (every 2 iterations)
    assert report[-1].startswith("determinism [loss]: 16 samples, 8 identical, max "), report
    assert held == 16 and out[1] == ([], 0)   # rank 1 sent its samples and kept none


def test_exit_16_checkpoint_carries_the_steps_micro_batches(tmp_path):
    """A loader whose order differs in every launch: the rerun from the checkpoint still sees
    the rejected step's micro-batches, and the loader then continues past that step."""
    import os
    import random

    def loader(start):   # repositioned by the consumed count; its order is new in each launch
        order = list(range(1000))
        random.Random(os.urandom(8)).shuffle(order)
        return (torch.tensor([i]) for i in order[start:])

    rsm, ident = _machine(tmp_path, node="bad")
    data = RerunDataIterator(loader(0), rsm)
    bad = lambda r: [NAN, 1.0] if ident["node"] == "bad" else [1.0, 1.0]  # noqa: E731
    _step(rsm, data, lambda r: [1.0, 1.0])                          # step 1: two micro-batches
    passes, decision = _step(rsm, data, bad)
    assert decision == (True, True, 16)
    rejected = passes[0][2]
    torch.save(rsm.state_dict(data), tmp_path / "rerun.pt")

    relaunched, idt = _machine(tmp_path, node="good")
    relaunched.load_state_dict(torch.load(tmp_path / "rerun.pt", weights_only=True))
    relaunched.current_iteration = 1
    ident["node"] = "good"
    fresh = loader(2)                                   # positioned after step 1, new order
    data = RerunDataIterator(fresh, relaunched)
    passes, decision = _step(relaunched, data, bad)
    assert [p[0] for p in passes] == [RerunState.RERUNNING_FROM_CHECKPOINT]
    assert [int(b) for b in passes[0][2]] == [int(b) for b in rejected]
    assert decision == (False, True, 17) and relaunched.diagnosis == RerunDiagnostic.PERSISTENT_ERROR
    # the repositioned loader was read past the replayed step, as if it had served it
    assert len(list(fresh)) == 1000 - 2 - 2
