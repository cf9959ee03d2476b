"""Logs: Megatron's scalar names in TensorBoard (read back by its reader), JSONL, console, trace."""

from __future__ import annotations

import io
import json

import pytest

from tinytron.reliability.observability import (LoggingConfig, MetricsLogger, ProgressBar,
                                                format_memory_report, megatron_scalars,
                                                memory_report, read_tensorboard_scalars)
from tinytron.reliability.timers import Timers

pytest.importorskip("tensorboard")


def _record(it, loss, samples_per_it=8):
    return dict(iteration=it, train_iters=10, consumed_train_samples=samples_per_it * it,
                skipped_train_samples=0, ms_per_iteration=250.0, tflops_per_device=1.5, mfu=0.25,
                tokens_per_second=4096.0, tokens_per_second_per_device=4096.0,
                learning_rate=1e-3 * it, global_batch_size=8, losses={"lm loss": loss},
                loss_scale=1.0, grad_norm=0.5 + it, num_zeros_in_grad=None,
                skipped_iterations=0, nan_iterations=0)


def test_scalars_carry_megatron_names_and_sample_axes():
    s = {(n, st): v for n, v, st in megatron_scalars(_record(3, 2.5), world_size=4)}
    assert s[("lm loss", 3)] == 2.5 and s[("lm loss vs samples", 24)] == 2.5
    assert s[("learning-rate", 3)] == pytest.approx(3e-3) and s[("world-size", 3)] == 4
    assert s[("grad-norm", 3)] == 3.5 and s[("iteration-time", 3)] == 0.25
    assert s[("throughput", 3)] == 1.5 and not any(n == "num-zeros" for n, _ in s)
    assert s[("tokens-per-second", 3)] == 4096.0 and s[("mfu", 3)] == 0.25
    no_peak = {n for n, _, _ in megatron_scalars(dict(_record(3, 2.5), mfu=None))}
    assert "tokens-per-second" in no_peak and "mfu" not in no_peak
    v = megatron_scalars({"iteration": 5, "consumed_train_samples": 40,
                          "validation": {"lm loss": 3.0}})
    assert v == [("lm loss validation", 3.0, 5), ("lm loss validation vs samples", 3.0, 40)]


def test_tensorboard_and_jsonl_hold_every_logged_scalar(tmp_path):
    cfg = LoggingConfig(tensorboard_dir=str(tmp_path / "tb"), jsonl_path=str(tmp_path / "m.jsonl"),
                        progress_bar=False)
    timers = Timers(log_level=1)
    timers("forward-backward").start()
    timers("forward-backward").stop()
    logger = MetricsLogger(cfg, train_iters=10, timers=timers, timer_names=("forward-backward",))
    for it, loss in [(1, 3.0), (2, 2.5), (4, 2.0)]:
        if it == 4:   # the timer runs again between the records of 2 and 4
            timers("forward-backward").start()
            timers("forward-backward").stop()
        logger(_record(it, loss))
    logger.close()
    tb = read_tensorboard_scalars(str(tmp_path / "tb"))
    assert tb["lm loss"] == [(1, 3.0), (2, 2.5), (4, 2.0)]
    assert [s for s, _ in tb["lm loss vs samples"]] == [8, 16, 32]
    assert [v for _, v in tb["grad-norm"]] == [1.5, 2.5, 4.5]
    # a timer's point for each interval in which it ran, none where it did not
    assert [s for s, _ in tb["forward-backward-time"]] == [1, 4] and "mem-rss-bytes" in tb
    lines = [json.loads(x) for x in open(tmp_path / "m.jsonl")]
    assert [x["losses"]["lm loss"] for x in lines] == [3.0, 2.5, 2.0]
    assert all(x["memory"]["mem-rss-bytes"] > 0 for x in lines)


def test_progress_bar_line_eta_and_non_tty_newlines():
    out = io.StringIO()
    bar = ProgressBar(total=10, stream=out, width=10)
    line = bar.render(_record(4, 2.0), {"mem-rss-bytes": 3 * 2 ** 30})
    assert line == ("[####------] 4/10 | lm loss 2.0000 | lr 4.00e-03 | 4.1k tok/s | "
                    "MFU 25.0% | rss 3.00 GiB | ETA 0:00:01")
    assert "| allocated 1.00 GiB |" in bar.render(_record(4, 2.0), {"mem-allocated-bytes": 2 ** 30})
    bar.update(_record(4, 2.0))
    bar.update(_record(5, 2.0))
    assert out.getvalue().count("\n") == 2 and "\r" not in out.getvalue()


def test_memory_report_on_cpu():
    rep = memory_report("cpu")
    assert rep["mem-max-rss-bytes"] >= rep["mem-rss-bytes"] > 10 * 2 ** 20
    assert format_memory_report(rep, "(after 1 iterations)").startswith(
        "[Rank 0] (after 1 iterations) memory (MB) | rss: ")


def test_trace_of_one_iteration_and_nesting(tmp_path):
    import torch
    from torch.profiler import record_function

    from tinytron.reliability.trace import load_trace, nest_depths, profile_iteration

    w = torch.randn(32, 32, requires_grad=True)

    def step(i):
        with record_function("forward-compute"):
            loss = (torch.randn(8, 32) @ w).pow(2).mean()
        with record_function("backward-compute"):
            loss.backward()

    events = load_trace(profile_iteration(step, str(tmp_path / "t.json"), warmup=1))
    names = {e["name"] for e in events}
    assert {"iteration-1", "forward-compute", "backward-compute", "aten::mm"} <= names
    assert "iteration-0" not in names                         # the warm-up is not recorded
    fake = [dict(name=n, tid=1, start_ms=s, dur_ms=d) for n, s, d in
            [("a", 0, 10), ("b", 1, 3), ("c", 2, 1), ("d", 5, 4), ("e", 12, 1)]]
    assert nest_depths(fake) == [0, 1, 2, 1, 0]
    (tmp_path / "empty.json").write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match="no complete"):
        load_trace(str(tmp_path / "empty.json"))


def test_trainer_tensorboard_timers_cover_their_interval_and_say_their_units(tmp_path):
    """A real six-iteration trainer run, saving at 2, 4 and 6, read back from its event files."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.train_workers import corpus, train_cli
    from tinytron.reliability.observability import PER_INTERVAL_TIMERS, SCALAR_UNITS, TIMER_UNIT

    run = tmp_path / "run"
    train_cli("--config", "configs/tiny.toml",
              "--model.hidden_size", "64", "--model.ffn_hidden_size", "128",
              "--model.seq_length", "64", "--training.micro_batch_size", "2",
              "--training.global_batch_size", "4", "--training.log_interval", "1",
              "--scheduler.lr_warmup_iters", "1", "--training.eval_interval", "none",
              "--training.train_iters", "6", "--training.save_interval", "2",
              "--logging.progress_bar", "false", "--logging.timing_log_level", "1",
              "--data.split", "\"90,10,0\"", "--data.data_path", corpus(tmp_path, 20),
              "--checkpoint.save", str(run))
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    points = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
              for tag in events.Tags()["scalars"]}
    # a save runs after its iteration's record: the saves at 2 and 4 are the points at 3 and 5;
    # nothing is written where no save ran, and the save at 6, which has no record after it, is
    # written at 6 when the run ends (the final save's time)
    saves = points["save-checkpoint-time"]
    assert [s for s, _ in saves] == [3, 5, 6] and all(v > 0 for _, v in saves), saves
    # per-iteration timers are the interval's, not the run's running total: the forward-
    # backward of one iteration fits inside that iteration, every time
    iteration = dict(points["iteration-time"])
    fb = points["forward-backward-time"]
    assert [s for s, _ in fb] == [1, 2, 3, 4, 5, 6], fb
    assert all(0 < v <= iteration[s] for s, v in fb), (fb, iteration)
    # Megatron's tags, with the unit as each tag's description in the event file
    described = {tag: events.SummaryMetadata(tag).summary_description for tag in
                 ("iteration-time", "throughput", "forward-backward-time", "save-checkpoint-time")}
    assert described["iteration-time"] == SCALAR_UNITS["iteration-time"]
    assert described["throughput"] == SCALAR_UNITS["throughput"]
    assert "TFLOP/s per device" in described["throughput"]
    assert described["forward-backward-time"] == TIMER_UNIT
    assert described["save-checkpoint-time"] == PER_INTERVAL_TIMERS["save-checkpoint"]
    # the token rate at every record, with its unit; no MFU on a CPU (no peak to divide by)
    assert [s for s, _ in points["tokens-per-second"]] == [1, 2, 3, 4, 5, 6]
    assert all(v > 0 for _, v in points["tokens-per-second"])
    assert (events.SummaryMetadata("tokens-per-second").summary_description
            == SCALAR_UNITS["tokens-per-second"])
    if not torch.cuda.is_available():
        assert "mfu" not in points
