"""Chapter 01's loop: micro-batch calculators, TrainState, train_step parity, skips, exits, eval."""

from __future__ import annotations

import math
import os
import signal
from functools import partial

import pytest
import torch

from tests import main_loop_workers as workers
from tinytron.buffers import DistributedDataParallelConfig
from tinytron.launch import run_on_ranks
from tinytron.main_loop._loop_workers import SyntheticTokens, synthetic_iterators
from tinytron.main_loop.loop import (TorchOptimizer, TrainState, build_schedule_config, evaluate,
                                     megatron_optimizer_provider, megatron_scheduler_provider,
                                     train_step, wrap_with_ddp)
from tinytron.main_loop.microbatches import (ConstantNumMicroBatchesCalculator,
                                             StepBatchsizeNumMicroBatchesCalculator,
                                             build_num_microbatches_calculator, num_microbatches,
                                             parse_numeric_value, parse_step_batch_size_schedule,
                                             train_iters_from_samples)
from tinytron.main_loop.run import pretrain
from tinytron.main_loop.schedules import get_forward_backward_func
from tinytron.model import GPTModel, build_stage_models
from tinytron.optimizer import (DynamicGradScaler, OptimizerConfig, SchedulerConfig,
                                get_megatron_optimizer, get_optimizer_param_scheduler)
from tinytron.overview.loss import lm_loss_func, microbatch_objective
from tinytron.parallel import ParallelGrid

CFG = workers.CFG
MBS = workers.MBS
FORWARD_STEP = workers.FORWARD_STEP
_training = workers.training


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _run(training, opt_config=None, sched_config=None, ddp=True, **kw):
    """pretrain the tiny GPT on synthetic tokens with the book's parts; returns (run, logs)."""
    opt_config = opt_config or OptimizerConfig(lr=1e-3, weight_decay=0.0)
    sched_config = sched_config or SchedulerConfig(lr_decay_style="cosine")
    logs = []
    run = pretrain(
        training, model_provider=lambda grid: build_stage_models(CFG, grid),
        forward_step_func=kw.pop("forward_step_func", FORWARD_STEP),
        data_iterators_provider=partial(synthetic_iterators, CFG, micro_batch_size=MBS),
        optimizer_provider=kw.pop("optimizer_provider", megatron_optimizer_provider(opt_config)),
        scheduler_provider=kw.pop("scheduler_provider",
                                  megatron_scheduler_provider(sched_config, opt_config)),
        ddp_config=DistributedDataParallelConfig() if ddp else None, seq_length=CFG.seq_length,
        log_fn=logs.append, **kw)
    return run, [r for r in logs if "losses" in r]


# -- micro-batch calculators -----------------------------------------------------------------
def test_num_microbatches_running_example_and_errors():
    assert num_microbatches(1024, 2, 64) == 8
    with pytest.raises(ValueError, match=r"global_batch_size \(1000\).*micro_batch_size \(2\)"
                                         r".*data_parallel_size \(64\) = 128"):
        num_microbatches(1000, 2, 64)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int, got 0"):
        ConstantNumMicroBatchesCalculator(8, 0, 1)


def test_decrease_batch_size_if_needed_rounds_down_and_counts_skipped():
    c = ConstantNumMicroBatchesCalculator(1000, 2, 64, decrease_batch_size_if_needed=True)
    assert (c.current_running_global_batch_size, c.get(), c.skipped_samples_per_iteration) == \
        (896, 7, 104)
    with pytest.raises(ValueError, match=r"global_batch_size \(100\) is smaller.*= 128"):
        ConstantNumMicroBatchesCalculator(100, 2, 64, decrease_batch_size_if_needed=True)


def test_step_schedule_parsing():
    assert parse_numeric_value("250B") == 250 * 10 ** 9
    assert parse_numeric_value("1.5k") == 1500 and parse_numeric_value("2T") == 2 * 10 ** 12
    assert parse_numeric_value("3M") == 3_000_000 and parse_numeric_value("17") == 17
    # tokens -> samples by integer division; entries sorted; commas allowed
    assert parse_step_batch_size_schedule("2M:1024, 0:256 1M:512", seq_length=4096) == \
        [(0, 256), (244, 512), (488, 1024)]
    with pytest.raises(ValueError, match="first threshold must be 0, got 10"):
        parse_step_batch_size_schedule("10:8 20:16")
    with pytest.raises(ValueError, match="strictly increase.*got 0 then 0"):
        parse_step_batch_size_schedule("0:8 100:16", seq_length=4096)  # 100 tokens -> 0 samples
    with pytest.raises(ValueError, match=r"must not shrink: 512 from 100 samples, then 256 from "
                                         r"200 samples"):
        parse_step_batch_size_schedule("0:256 100:512 200:256")
    with pytest.raises(ValueError, match="not THRESHOLD:BATCH_SIZE"):
        parse_step_batch_size_schedule("0:8 100")
    with pytest.raises(ValueError, match="K/M/B/T"):
        parse_numeric_value("12Q")


def test_step_calculator_updates_and_checks_divisibility():
    c = StepBatchsizeNumMicroBatchesCalculator(2, 2, "0:4 10:6 20:16")
    assert c.get() == 1
    c.update(10, consistency_check=False)
    assert (c.current_global_batch_size, c.get()) == (6, 1)
    with pytest.raises(ValueError, match=r"current global batch size \(6, at 10 consumed samples\)"
                                         r".*micro_batch_size \(2\) x data_parallel_size \(2\)"):
        c.update(10)
    c.update(25)
    assert c.get() == 4
    assert train_iters_from_samples(c, 40) == 6   # steps start at 0, 4, 8, 12, 18, 24
    with pytest.raises(ValueError, match="decrease_batch_size_if_needed"):
        build_num_microbatches_calculator(None, 2, 2, True, "0:4")
    assert train_iters_from_samples(ConstantNumMicroBatchesCalculator(8, 2, 1), 20) == 2


# -- TrainState ----------------------------------------------------------------------------------
def test_train_state_round_trip_and_bad_keys():
    s = TrainState(3, 24, 1, 8, 10 ** 15)
    t = TrainState()
    t.load_state_dict(s.state_dict())
    assert t == s
    with pytest.raises(ValueError, match=r"missing \['iteration'\], unknown \['iters'\]"):
        t.load_state_dict({**{k: v for k, v in s.state_dict().items() if k != "iteration"},
                           "iters": 3})


# -- train_step equals a hand-written loop -----------------------------------------------------
def _reference_losses_and_params(iters: int, m: int, opt_config, sched_config, train_iters):
    """The same model, data and optimizer, driven by a plain loop written out by hand."""
    torch.manual_seed(0)
    model = GPTModel(CFG)
    opt = get_megatron_optimizer(opt_config, model)
    sched = get_optimizer_param_scheduler(sched_config, opt, opt_config, train_iters, m * MBS)
    ds = SyntheticTokens(10_000, CFG.seq_length, CFG.vocab_size, 1234)
    losses, k = [], 0
    for _ in range(iters):
        for p in model.parameters():
            p.grad = None
        pair = torch.zeros(2)
        for _ in range(m):
            b = {key: torch.stack([ds[k + i][key] for i in range(MBS)]) for key in ds[0]}
            k += MBS
            out = model(b["tokens"], b["position_ids"], labels=b["labels"])
            loss_sum, n, report = lm_loss_func(b["loss_mask"], out)
            microbatch_objective(loss_sum, n, m, False).backward()
            pair += report["lm loss"]
        ok, _, _ = opt.step()
        assert ok
        sched.step(m * MBS)
        losses.append((pair[0] / pair[1]).item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}



def test_train_step_is_bitwise_a_hand_written_loop():
    opt_config = OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5)
    sched_config = SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=1)
    ref_losses, ref_params = _reference_losses_and_params(4, 4, opt_config, sched_config, 4)
    grid = ParallelGrid.single()
    model = wrap_with_ddp([GPTModel(CFG)], grid, DistributedDataParallelConfig())
    opt = megatron_optimizer_provider(opt_config)(model, grid)
    sched = megatron_scheduler_provider(sched_config, opt_config)(opt, train_iters=4,
                                                                  global_batch_size=8)
    data, _ = synthetic_iterators(CFG, grid, TrainState(), micro_batch_size=MBS)
    config = build_schedule_config(model, opt, grid)
    losses = []
    for _ in range(4):
        result = train_step(FORWARD_STEP, data, model, opt, sched, get_forward_backward_func(1),
                            num_microbatches=4, micro_batch_size=MBS, seq_length=CFG.seq_length,
                            grid=grid, config=config)
        assert result.skipped_iter == 0
        losses.append(result.loss_dict["lm loss"].item())
    assert losses == ref_losses                                  # bitwise, every iteration
    params = dict(model[0].module.named_parameters())
    assert all(torch.equal(params[n], ref_params[n]) for n in ref_params)
    assert sched.num_steps == 4 * 8


def test_plain_torch_parts_match_torch_adamw():
    """The loop with torch.optim.AdamW and no DDP equals a hand loop with torch.optim.AdamW."""
    ref = GPTModel(CFG)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0, foreach=True)
    ds = SyntheticTokens(10_000, CFG.seq_length, CFG.vocab_size, 1234)
    k = 0
    for _ in range(3):
        ref_opt.zero_grad()
        for _ in range(4):
            b = {key: torch.stack([ds[k + i][key] for i in range(MBS)]) for key in ds[0]}
            k += MBS
            out = ref(b["tokens"], b["position_ids"], labels=b["labels"])
            (out.float().sum() / out.numel() / 4).backward()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
        ref_opt.step()
    run, _ = _run(_training(train_iters=3), ddp=False, scheduler_provider=None,
                  optimizer_provider=lambda model, grid: TorchOptimizer(torch.optim.AdamW(
                      model[0].parameters(), lr=1e-3, weight_decay=0.0, foreach=True)))
    got = dict(run.model[0].named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p, rtol=0, atol=1e-6)


# -- skipped steps, exits, evaluation ------------------------------------------------------------
def _poison_call(call_index: int):
    """A forward_step_func whose call number call_index returns an infinite loss."""
    calls = {"n": 0}

    def step(data_iterator, model):
        out, loss_func = FORWARD_STEP(data_iterator, model)
        calls["n"] += 1
        return (out * math.inf if calls["n"] == call_index else out), loss_func
    return step


def test_skipped_step_keeps_the_scheduler_but_consumes_the_samples():
    # fp16 config -> dynamic loss scaler; the inf loss in iteration 2 (calls 5-8) overflows
    opt_config = OptimizerConfig(lr=1e-3, fp16=True, hysteresis=1)
    run, logs = _run(_training(train_iters=4, log_interval=4), opt_config,
                     forward_step_func=_poison_call(6))
    assert isinstance(run.optimizer.grad_scaler, DynamicGradScaler)
    assert run.state.consumed_train_samples == 4 * 8           # the skipped batch was consumed
    assert run.scheduler.num_steps == 3 * 8                    # but did not move the schedule
    assert run.optimizer.grad_scaler.scale == 2.0 ** 31        # backed off once
    last = logs[-1]
    assert (last["skipped_iterations"], last["nan_iterations"]) == (1, 1)
    assert math.isfinite(last["losses"]["lm loss"])            # averaged over advanced ones only
    # grad_norm_skip_threshold: every step skipped, nothing moves but the sample counter
    run, logs = _run(_training(train_iters=2),
                     OptimizerConfig(lr=1e-3, grad_norm_skip_threshold=0.0))
    init = dict(GPTModel(CFG).named_parameters())
    assert run.scheduler.num_steps == 0 and run.state.consumed_train_samples == 16
    assert all(torch.equal(p, init[n]) for n, p in run.model[0].module.named_parameters())
    # log_interval 1: every line covers its own iteration, the first one too
    assert [r["skipped_iterations"] for r in logs] == [1, 1]


def _saving_run(training, **kw):
    """_run with a save hook that records the iterations it was called at."""
    saves = []
    run, _ = _run(training, save_checkpoint_fn=lambda s, *parts: saves.append(s.iteration), **kw)
    return run, saves


def test_exit_conditions_stop_where_they_say():
    run, saves = _saving_run(_training(train_iters=3, save_interval=2))
    assert (run.state.iteration, run.exit_reason, saves) == (3, None, [2, 3])  # final save at 3
    run, _ = _saving_run(_training(train_iters=None, train_samples=20))
    assert (run.state.iteration, run.state.consumed_train_samples) == (2, 16)
    run, saves = _saving_run(_training(train_iters=10, save_interval=2, exit_interval=3))
    assert (run.state.iteration, run.exit_reason, saves) == (3, "exit_interval", [2, 3])
    minutes = iter(range(100))
    run, saves = _saving_run(_training(train_iters=10, exit_duration_in_mins=2.5),
                             clock=lambda: 60.0 * next(minutes))
    assert (run.state.iteration, run.exit_reason, saves) == (3, "duration", [3])

    calls = {"n": 0}

    def sigterm_in_iteration_2(data_iterator, model):
        calls["n"] += 1
        if calls["n"] == 6:
            os.kill(os.getpid(), signal.SIGTERM)
        return FORWARD_STEP(data_iterator, model)
    before = signal.getsignal(signal.SIGTERM)
    run, saves = _saving_run(_training(train_iters=10, exit_signal_handler=True),
                             forward_step_func=sigterm_in_iteration_2)
    assert (run.state.iteration, run.exit_reason, saves) == (2, "signal", [2])
    assert signal.getsignal(signal.SIGTERM) is before            # handler restored


def test_step_schedule_and_decrease_in_the_loop():
    run, saves = _saving_run(_training(global_batch_size=None, step_batch_size_schedule=f"0:4 {8 * CFG.seq_length}:8",
                                       train_iters=4))
    assert saves == [2, 4]     # m grew from 2 to 4 before iteration 3: saved; and at the end
    assert run.state.consumed_train_samples == 4 + 4 + 8 + 8 == run.scheduler.num_steps
    run, _ = _saving_run(_training(global_batch_size=7, decrease_batch_size_if_needed=True,
                                   train_iters=3))
    assert (run.state.consumed_train_samples, run.state.skipped_train_samples) == (18, 3)


def _tensors_equal(a, b) -> bool:
    """Nested dicts/lists of tensors and plain values, compared exactly."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def test_evaluation_changes_no_parameter_and_no_optimizer_state():
    run, _ = _run(_training(train_iters=2))
    chunk = run.model[0]
    params = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    opt_state, sched_state = run.optimizer.state_dict(), dict(run.scheduler.state_dict())
    valid = SyntheticTokens(10_000, CFG.seq_length, CFG.vocab_size, 1235)
    it = iter([{k: torch.stack([valid[i + j][k] for j in range(MBS)]) for k in valid[0]}
               for i in range(0, 16, MBS)])
    losses = evaluate(FORWARD_STEP, it, run.model, get_forward_backward_func(1),
                      num_microbatches=4, micro_batch_size=MBS, seq_length=CFG.seq_length,
                      eval_iters=2, grid=run.grid,
                      config=build_schedule_config(run.model, run.optimizer, run.grid))
    assert all(torch.equal(p, params[n]) for n, p in chunk.named_parameters())
    assert _tensors_equal(run.optimizer.state_dict(), opt_state)
    assert run.scheduler.state_dict() == sched_state and chunk.training
    with torch.no_grad():
        b = {k: torch.stack([valid[i][k] for i in range(16)]) for k in valid[0]}
        chunk.eval()
        expect = chunk.module(b["tokens"], b["position_ids"], labels=b["labels"]).mean().item()
        chunk.train()
    assert abs(losses["lm loss"] - expect) < 1e-6


# -- data parallel with the distributed optimizer, and pipeline parallel, vs one process ---------
def test_dp2_distributed_optimizer_pp2_and_interleaved_equal_one_process():
    iters = 3
    ref_run, ref_logs = _run(_training(train_iters=iters), workers.OPT_CONFIG)
    ref = {n: p.detach() for n, p in ref_run.model[0].module.named_parameters()}
    ref_losses = [r["losses"]["lm loss"] for r in ref_logs]
    ranks = run_on_ranks(workers.dp2_and_pp2, 2, iters, timeout=240)
    for r in ranks:
        for name, p in r["dp2"]["params"].items():
            torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-6)
        assert max(abs(a - b) for a, b in zip(r["dp2"]["losses"], ref_losses)) < 1e-6
        for name, p in r["pp2"]["params"].items():
            torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-6)
        assert r["pp2"]["state"]["consumed_train_samples"] == iters * 8
    assert set(ranks[0]["pp2"]["params"]) | set(ranks[1]["pp2"]["params"]) == set(ref)
    assert set(ranks[0]["dp2"]["params"]) == set(ref) and len(ref_losses) == iters
    assert max(abs(a - b) for a, b in zip(ranks[1]["pp2"]["losses"], ref_losses)) < 1e-6
    assert ranks[0]["pp2"]["losses"] == []                    # the loss lives on the last stage
    # interleaved (v = 2) on a 4-layer model: chunks of both ranks together equal one process
    ref4_run, ref4_losses = workers.pretrain_tiny(ParallelGrid.single, DistributedDataParallelConfig(),
                                                  workers.OPT_CONFIG, iters, cfg=workers.CFG4)
    ref4 = {n: p.detach() for n, p in ref4_run.model[0].module.named_parameters()}
    got = {**ranks[0]["vpp2"]["params"], **ranks[1]["vpp2"]["params"]}
    assert set(got) == set(ref4)
    for name, p in got.items():
        torch.testing.assert_close(p, ref4[name], rtol=0, atol=1e-6)
    assert max(abs(a - b) for a, b in zip(ranks[1]["vpp2"]["losses"], ref4_losses)) < 1e-6


def test_resumed_run_equals_the_uninterrupted_run_and_evaluates_on_schedule():
    """Save at 2 through the hook, resume through load_checkpoint_fn, finish: same weights."""
    import copy

    full, _ = _run(_training(train_iters=4))
    saved = {}

    def save(state, model, optimizer, scheduler):
        saved.update(state=copy.deepcopy(state), model=copy.deepcopy(model[0].state_dict()),
                     optimizer=copy.deepcopy(optimizer.state_dict()),
                     scheduler=copy.deepcopy(scheduler.state_dict()))

    _run(_training(train_iters=4, exit_interval=2), save_checkpoint_fn=save)
    assert saved["state"].iteration == 2 and saved["state"].consumed_train_samples == 16

    def load(model, optimizer, scheduler):
        model[0].load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        return copy.deepcopy(saved["state"])

    records = []
    resumed = pretrain(
        _training(train_iters=4, eval_interval=2, eval_iters=1),
        model_provider=lambda grid: build_stage_models(CFG, grid), forward_step_func=FORWARD_STEP,
        data_iterators_provider=partial(synthetic_iterators, CFG, micro_batch_size=MBS),
        optimizer_provider=megatron_optimizer_provider(OptimizerConfig(lr=1e-3, weight_decay=0.0)),
        scheduler_provider=megatron_scheduler_provider(SchedulerConfig(lr_decay_style="cosine"),
                                                       OptimizerConfig(lr=1e-3, weight_decay=0.0)),
        ddp_config=DistributedDataParallelConfig(), seq_length=CFG.seq_length,
        load_checkpoint_fn=load, log_fn=records.append)
    assert (resumed.state.iteration, resumed.state.consumed_train_samples) == (4, 32)
    assert resumed.state.consumed_train_samples == full.state.consumed_train_samples
    want = dict(full.model[0].module.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in resumed.model[0].module.named_parameters())
    assert [r["iteration"] for r in records if "validation" in r] == [4]   # 2 was before resume
    assert resumed.state.consumed_valid_samples == 8
