"""Chapter 01 schedules: no pipelining, 1F1B and interleaved 1F1B against one process (CPU/gloo)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tinytron.buffers import finalize_model_grads
from tinytron.launch import run_on_ranks
from tinytron.main_loop import _workers as w
from tinytron.main_loop.interleaved import (check_interleaving, get_pp_rank_microbatches,
                                            get_schedule_table)
from tinytron.main_loop.schedules import (ScheduleConfig, ScheduleRecorder, custom_backward,
                                          deallocate_output_tensor,
                                          forward_backward_no_pipelining,
                                          forward_backward_pipelining_without_interleaving,
                                          get_forward_backward_func,
                                          num_warmup_microbatches_1f1b)
from tinytron.model.gpt import GPTModel
from tinytron.parallel import ParallelGrid

from tests import main_loop_schedule_workers as workers

# Hand-derived 1F1B order for p = 4, m = 8: warmup min(p-r-1, m) forwards, then F/B pairs.
HAND_1F1B_P4_M8 = [
    "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
    "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
    "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
    "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
]
# Megatron's documented table, p=2, g=3, M=5, v=2 (schedules.py, interleaved function comments).
MEGATRON_MICROBATCH_IDS = [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
MEGATRON_CHUNK_IDS = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def _fb_string(order) -> str:
    return " ".join(f"{k[0].upper()}{mb}" for k, _, mb in order)


def _expected_interleaved(warmup: int, v: int = 2) -> list[tuple[str, int, int]]:
    """Forward k = table[k]; backward k = table[k] with the chunk reversed; 1F1B after warmup."""
    fwd = [("forward", c, mb) for mb, c in zip(MEGATRON_MICROBATCH_IDS, MEGATRON_CHUNK_IDS)]
    bwd = [("backward", v - 1 - c, mb) for _, c, mb in fwd]
    out = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        out += [fwd[warmup + k], bwd[k]]
    return out + bwd[len(fwd) - warmup:]


# ------------------------------------------------------------------ pure functions (no world)

def test_schedule_table_is_megatrons_documented_example():
    table = get_schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == MEGATRON_MICROBATCH_IDS
    assert [c for _, c in table] == MEGATRON_CHUNK_IDS
    assert get_schedule_table(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0),
                                           (2, 1), (3, 1)]


def test_schedule_table_and_warmup_match_megatron_core():
    """Against the installed megatron-core (pure functions; its communicator only answers
    'how many pipeline ranks, which one am I, how many virtual stages')."""
    from types import SimpleNamespace

    sched = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    for m in range(1, 13):
        for v in (1, 2, 3):
            for g in range(1, m + 1):
                assert get_schedule_table(m, v, g) == sched.get_schedule_table(m, v, g), (m, v, g)
    for p in (2, 4):
        for r in range(p):
            for m, v, g in ((4, 2, 2), (5, 2, 3), (8, 2, 4), (8, 3, 4), (2, 2, 2)):
                comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: p, rank=lambda: r),
                                       virtual_pipeline_model_parallel_size=v)
                for fwd_only in (False, True):
                    theirs = sched.get_pp_rank_microbatches(m, v, g, forward_only=fwd_only,
                                                            p2p_communicator=comm)
                    assert get_pp_rank_microbatches(m, v, g, p, r, fwd_only) == tuple(theirs)


def test_warmup_counts():
    # 1F1B: min(p - r - 1, m); the running example (p=2, m=8) warms up 1 and 0.
    assert [num_warmup_microbatches_1f1b(4, r, 8) for r in range(4)] == [3, 2, 1, 0]
    assert [num_warmup_microbatches_1f1b(2, r, 8) for r in range(2)] == [1, 0]
    assert num_warmup_microbatches_1f1b(8, 0, 3) == 3  # capped at m
    # Interleaved: 2(p-r-1) + (v-1) g, capped at m v (then all warmup).
    assert get_pp_rank_microbatches(5, 2, 3, 2, 0) == (10, False, 5, 5)
    assert get_pp_rank_microbatches(5, 2, 3, 2, 1) == (10, False, 3, 7)
    assert get_pp_rank_microbatches(8, 2, 2, 2, 0) == (16, False, 4, 12)  # running example
    assert get_pp_rank_microbatches(2, 2, 2, 4, 0) == (4, True, 4, 0)
    assert get_pp_rank_microbatches(8, 2, 2, 2, 1, forward_only=True) == (16, True, 16, 0)


def test_interleaving_constraints_name_the_numbers():
    check_interleaving(2, 5, 3)  # Megatron's example is valid (remainder 2 >= p)
    check_interleaving(4, 8, 4)
    with pytest.raises(ValueError, match=r"num_microbatches \(6\) mod .* \(4\) = 2 .* pp \(4\)"):
        check_interleaving(4, 6, 4)  # m % p != 0 with the default g = p
    with pytest.raises(ValueError, match=r"\(3\) must lie in \[pp \(4\), num_microbatches \(8\)\]"):
        check_interleaving(4, 8, 3)
    with pytest.raises(ValueError, match=r"\(9\) must lie in \[pp \(4\), num_microbatches \(8\)\]"):
        check_interleaving(4, 8, 9)


def test_get_forward_backward_func_selects_megatrons_schedules():
    from tinytron.main_loop.interleaved import forward_backward_pipelining_with_interleaving
    assert get_forward_backward_func(1) is forward_backward_no_pipelining
    assert get_forward_backward_func(1, 2) is forward_backward_no_pipelining
    assert get_forward_backward_func(4) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(4, 1) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(2, 2) is forward_backward_pipelining_with_interleaving
    with pytest.raises(ValueError, match="pp_size must be a positive int, got 0"):
        get_forward_backward_func(0)


def test_pseudo_freed_output_still_backpropagates():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    y = lin(x) + 1.0
    (y * 2).sum().backward()
    ref = lin.weight.grad.clone()
    lin.zero_grad()
    y = lin(x) + 1.0
    deallocate_output_tensor(y, True)
    assert y.numel() == 1 and y.grad_fn is not None
    custom_backward(y, torch.full((4, 8), 2.0))
    assert torch.equal(lin.weight.grad, ref)
    with pytest.raises(ValueError, match="cannot pseudo-free a view"):
        deallocate_output_tensor(lin(x)[:2], True)
    z = lin(x)
    deallocate_output_tensor(z, False)
    assert z.shape == (4, 8)


def test_no_pipelining_equals_one_process_and_holds_back_the_sync():
    config = w.tiny_config(num_layers=2, tie_embeddings=False)
    batches = w.make_microbatches(config, 4)
    ref = w.reference_run(config, [batches])[0]
    model, rec, in_no_sync = GPTModel(config), ScheduleRecorder(), []

    @contextlib.contextmanager
    def no_sync():  # notes which micro-batches ran while the grad collectives were held back
        in_no_sync.append(len(rec.events))
        yield
        in_no_sync.append(len(rec.events))

    cfg = ScheduleConfig(finalize_model_grads_func=finalize_model_grads, recorder=rec,
                         no_sync_func=no_sync)
    reports = forward_backward_no_pipelining(
        forward_step_func=w.forward_step_func, data_iterator=iter(batches), model=[model],
        num_microbatches=4, seq_length=config.seq_length, micro_batch_size=1,
        grid=ParallelGrid.single(), config=cfg)
    gap, bitwise = w.compare(w.full_grads([model], ParallelGrid.single()), ref["grads"])
    assert bitwise, gap
    assert torch.equal(torch.stack([r["lm loss"] for r in reports]), ref["reports"])
    assert _fb_string(rec.order()) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert in_no_sync == [0, 6]  # micro-batches 0..2 inside no_sync, the last one outside


def test_no_pipelining_forward_only_and_bad_input():
    config = w.tiny_config(num_layers=2, tie_embeddings=False)
    batches = w.make_microbatches(config, 2)
    model = GPTModel(config)
    before = [p.detach().clone() for p in model.parameters()]
    kwargs = dict(forward_step_func=w.forward_step_func, model=[model], seq_length=64,
                  micro_batch_size=1, grid=ParallelGrid.single())
    reports = forward_backward_no_pipelining(data_iterator=iter(batches), num_microbatches=2,
                                             forward_only=True, **kwargs)
    assert len(reports) == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="num_microbatches must be a positive int, got 0"):
        forward_backward_no_pipelining(data_iterator=iter(batches), num_microbatches=0, **kwargs)
    with pytest.raises(ValueError, match="got 2 chunks and 1 iterators"):
        forward_backward_no_pipelining(data_iterator=iter(batches), num_microbatches=2,
                                       **{**kwargs, "model": [model, model]})
    with pytest.raises(ValueError, match=r"pipelined schedule needs a grid with pp > 1, got 1"):
        forward_backward_pipelining_without_interleaving(
            data_iterator=iter(batches), num_microbatches=2, **kwargs)


def test_default_normalization_and_loss_scaling_match_chapter_00():
    """Mean of micro-batch means (per-token off) equals chapter 00's forward_backward; a
    grad_scale_func of 4 scales every gradient by exactly 4."""
    from tinytron.overview.loss import forward_backward

    config = w.tiny_config(num_layers=2, tie_embeddings=False)
    batches = w.make_microbatches(config, 3)
    model = GPTModel(config)
    forward_backward(model, batches, calculate_per_token_loss=False)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for scale, expected in ((None, 1.0), (lambda loss: loss * 4, 4.0)):
        model.zero_grad(set_to_none=True)
        cfg = ScheduleConfig(calculate_per_token_loss=False, grad_scale_func=scale,
                             finalize_model_grads_func=finalize_model_grads)
        forward_backward_no_pipelining(
            forward_step_func=w.forward_step_func, data_iterator=iter(batches), model=[model],
            num_microbatches=3, seq_length=64, micro_batch_size=1, grid=ParallelGrid.single(),
            config=cfg)
        for n, p in model.named_parameters():
            assert torch.allclose(p.grad, ref[n] * expected, rtol=1e-6, atol=1e-9), n


@pytest.mark.gpu
def test_no_pipelining_on_cuda_equals_cpu():
    """The schedules are device-agnostic: one CUDA process against the CPU reference."""
    config = w.tiny_config(num_layers=2, tie_embeddings=False)
    batches = w.make_microbatches(config, 4)
    ref = w.reference_run(config, [batches])[0]
    model = GPTModel(config, device="cuda")
    forward_backward_no_pipelining(
        forward_step_func=w.forward_step_func, data_iterator=iter(batches), model=[model],
        num_microbatches=4, seq_length=config.seq_length, micro_batch_size=1,
        grid=ParallelGrid.single(),
        config=ScheduleConfig(finalize_model_grads_func=finalize_model_grads))
    gap, _ = w.compare(w.full_grads([model], ParallelGrid.single()), ref["grads"])
    assert gap < 1e-4, gap


@pytest.mark.gpu
def test_pp2_1f1b_and_interleaved_over_nccl():
    """Each p2p method end to end over NCCL, where a batched send never meets a single
    receive: 1F1B batched and single, interleaved plain and overlapped (the trainer's
    default, single isend/irecv with one direction on the world group)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices for a 2-rank NCCL world")
    for vpp, p2p in ((None, {}), (None, {"batch_p2p_comm": False}), (2, {}),
                     (2, {"overlap_p2p_comm": True})):
        for r in run_on_ranks(w.run_case, 2, 1, 2, vpp, 4, 2, backend="nccl", timeout=300,
                              p2p=p2p):
            assert max(r["gaps"]) < 1e-4, (vpp, p2p, r["gaps"])


# ------------------------------------------------------------------ one 4-rank world

@pytest.fixture(scope="module")
def world():
    """Every multi-rank case runs in a single gloo world of 4 ranks (~5 s to start)."""
    return run_on_ranks(workers.world_checks, 4, timeout=300)


def _losses_close(res, rel=1e-6):
    return all(g <= rel for g in res["loss_gaps"])


def test_pp4_1f1b_is_bitwise_and_in_megatrons_order(world):
    for rank, r in enumerate(world):
        res = r["pp4"]
        assert res["stage"] == rank
        assert all(res["bitwise"]), res["gaps"]  # same op order as one process: same bits
        assert res["loss_gaps"] == ([0.0] * 3 if rank == 3 else [])
        assert res["num_reports"] == (8 if rank == 3 else 0)
        for order in res["orders"]:
            assert _fb_string(order) == HAND_1F1B_P4_M8[rank]


def test_fewer_microbatches_than_warmup(world):
    """m < p (1F1B: warmup = m, no steady state) and interleaving with all of it in warmup."""
    for rank, r in enumerate(world):
        assert all(r["pp4_m2"]["bitwise"]), r["pp4_m2"]["gaps"]
        # warmup min(p-r-1, 2) = 2, 2, 1, 0: only the last stage alternates from the start
        assert _fb_string(r["pp4_m2"]["orders"][0]) == ("F0 B0 F1 B1" if rank == 3
                                                        else "F0 F1 B0 B1")
        res = r["vpp_all_warmup"]
        assert max(res["gaps"]) <= 1e-6 and _losses_close(res)


def test_each_stage_runs_m_forwards_and_backwards_in_forward_order(world):
    for r in world:
        for case, m in (("pp4", 8), ("dp2pp2", 4), ("dp2pp2_vpp", 4), ("megatron_example", 5),
                        ("dp4", 4), ("pp4_m2", 2), ("vpp_all_warmup", 2)):
            res = r[case]
            for order in res["orders"]:
                for chunk in {c for _, c, _ in order}:
                    fwd = [mb for k, c, mb in order if c == chunk and k == "forward"]
                    bwd = [mb for k, c, mb in order if c == chunk and k == "backward"]
                    assert fwd == bwd == list(range(m)), (case, chunk)


def test_stage_holds_at_most_p_minus_r_microbatches(world):
    """Measured: LiveBytesMeter bytes and autograd's live saved tensors, after every F and B."""
    for rank, r in enumerate(world):
        res = r["inflight"]
        assert res["max_in_flight_saved"] == 4 - rank
        # bytes: within half a micro-batch of p - r (pseudo-freed outputs and p2p buffers)
        assert abs(res["max_in_flight_bytes"] - (4 - rank)) < 0.5, res["max_in_flight_bytes"]
        assert res["peak_at_marks"] <= (4 - rank + 0.5) * res["per_microbatch"]


def test_tp2_pp2_equals_one_process(world):
    for r in world:
        res = r["tp2pp2"]
        assert max(res["gaps"]) <= 1e-6 and _losses_close(res)


def test_dp2_pp2_1f1b_and_interleaved_equal_one_process(world):
    for r in world:
        for case in ("dp2pp2", "dp2pp2_vpp", "megatron_example", "dp2pp2_sync",
                     "dp2pp2_vpp_sync"):
            res = r[case]
            assert max(res["gaps"]) <= 1e-6 and _losses_close(res), (case, res["gaps"])
            assert res["num_reports"] == (0 if res["stage"] == 0 else 5 if "example" in case else 4)


def test_dp4_no_pipelining_equals_one_process(world):
    for r in world:
        res = r["dp4"]
        assert max(res["gaps"]) <= 1e-6 and _losses_close(res)
        assert _fb_string(res["orders"][0]) == "F0 B0 F1 B1 F2 B2 F3 B3"


def test_megatron_documented_interleaved_order(world):
    for r in world:
        res = r["megatron_example"]
        warmup = {0: 5, 1: 3}[res["stage"]]  # 2(p-r-1) + (v-1) g with p=2, v=2, g=3
        assert res["orders"][0] == _expected_interleaved(warmup)


def test_no_grad_collective_before_the_last_backward(world):
    """Chapter 05's bucket records: every launch ('start') comes in or after the chunk's last
    backward; from the second step on (golden counts known) the hooks launch it *during* it."""
    for r in world:
        for case in ("dp2pp2", "dp2pp2_vpp", "dp4", "dp2pp2_sync", "dp2pp2_vpp_sync"):
            res = r[case]
            for step, (events, comm) in enumerate(zip(res["events"], res["comm"])):
                for chunk in {c for c, _, _ in comm}:
                    last = [e for e in events if e.kind == "backward" and e.chunk == chunk
                            and e.microbatch == 3]  # m = 4
                    assert len(last) == 1
                    starts = [t for c, ev, t in comm if c == chunk and ev == "start"]
                    assert starts and min(starts) >= last[0].start, (case, step, chunk)
                    # with a grad_sync_func, 1F1B lets stage 0's hooks launch; the other
                    # stages (and every interleaved chunk) call it after that backward
                    deferred = "sync" in case and ("vpp" in case or res["stage"] > 0)
                    if step > 0 and not deferred:
                        assert min(starts) <= last[0].end, (case, step, chunk)
                    if deferred:
                        assert min(starts) >= last[0].end, (case, step, chunk)


def test_forward_only_changes_nothing(world):
    for r in world:
        for case in ("forward_only_pp4", "forward_only_vpp"):
            res = r[case]
            assert res["params_same"] and res["no_grads"] and res["same_losses"], (case, res)
    assert world[3]["forward_only_pp4"]["num"] == 4 and world[0]["forward_only_pp4"]["num"] == 0


def test_bad_layouts_raise_value_errors_naming_the_numbers(world):
    msgs = world[0]["errors"]
    assert "num_microbatches (3) mod microbatch_group_size_per_vp_stage (2) = 1" in msgs[0]
    assert "(1) must lie in [pp (2), num_microbatches (4)]" in msgs[1]
    assert "(5) must lie in [pp (2), num_microbatches (4)]" in msgs[2]
    assert "num_microbatches (5) mod microbatch_group_size_per_vp_stage (4) = 1" in msgs[3]
    assert "2 chunks, 1 iterator(s)" in msgs[4]
    assert "got 2 chunks and 1 iterators" in msgs[5]


def test_every_message_is_received_as_the_one_sent(world):
    """Per pipeline pair, the micro-batch ids a stage sends (in posting order) are the ids its
    neighbor records receiving: the schedules' bookkeeping of who sends what matches."""
    for case in ("dp2pp2", "dp2pp2_vpp", "megatron_example"):
        a, b = world[0][case], world[2][case]  # the pp group of dp rank 0: ranks 0 and 2
        assert (a["stage"], b["stage"]) == (0, 1)
        for step in range(len(a["events"])):
            ids = {}
            for name, res in (("a", a), ("b", b)):
                events = sorted(res["events"][step], key=lambda e: e.start)  # stable
                ids[name] = {k: [e.microbatch for e in events if e.kind == k]
                             for k in ("send", "recv")}
            assert ids["a"]["send"] == ids["b"]["recv"], case
            assert ids["b"]["send"] == ids["a"]["recv"], case
