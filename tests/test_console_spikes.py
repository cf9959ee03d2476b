"""The spiky-loss check as the trainer's console reports it: when it arms, a spike before that,
and a spike it rejects, each said in the iteration it happens.

One run of `python -m tinytron.train` (one process, 16 micro-batches of one sequence per
iteration, so the check's 100 warm-up losses end in iteration 8), with two injected spikes: a
1000x loss at iteration 4, while the check is still learning its threshold, and a 10^6x loss
at iteration 9, once it is armed. Every assertion reads the run's own records: its console,
its tracker file and its JSONL log.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.train_workers import corpus, train_cli

ARGS = ["--config", "configs/tiny.toml",
        "--model.hidden_size", "64", "--model.ffn_hidden_size", "128",
        "--model.seq_length", "64", "--training.micro_batch_size", "1",
        "--training.global_batch_size", "16", "--training.log_interval", "1",
        "--scheduler.lr_warmup_iters", "1", "--training.eval_iters", "1",
        "--training.eval_interval", "none", "--training.train_iters", "10",
        "--training.save_interval", "5", "--logging.progress_bar", "false",
        "--data.split", "\"90,10,0\"", "--reliability.check_for_spiky_loss", "true",
        "--reliability.faults", '["spike@4", "spike@9:factor=1e6"]']
NUMBER = r"([0-9.e+-]+)"


@pytest.fixture(scope="module")
def spiky_run(tmp_path_factory):
    """(run directory, console) of the ten-iteration run with both spikes."""
    prefix = corpus(tmp_path_factory.mktemp("data"), 40)
    run_dir = tmp_path_factory.mktemp("runs") / "spiky"
    proc = train_cli(*ARGS, "--data.data_path", prefix, "--checkpoint.save", str(run_dir))
    return run_dir, proc.stdout


def _lines(console: str, needle: str) -> list[str]:
    return [line for line in console.splitlines() if needle in line]


def _losses(run_dir) -> dict[int, float]:
    records = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["losses"]["lm loss"] for r in records if "losses" in r}


def test_the_console_says_once_that_the_check_is_not_armed_and_from_when(spiky_run):
    _, console = spiky_run
    lines = _lines(console, "check_for_spiky_loss is not armed yet:")
    assert len(lines) == 1, console
    # 16 losses per iteration from iteration 2 on: the 101st is in iteration 1 + ceil(101/16)
    assert "84 still to learn at 16 per iteration" in lines[0], lines
    assert "judges its first value in iteration 8 (value 5 of 16 there)" in lines[0], lines
    armed = _lines(console, "reliability: check_for_spiky_loss armed in iteration 8: ")
    assert len(armed) == 1, console


def test_a_spike_in_the_warm_up_is_warned_about_not_absorbed_silently(spiky_run):
    run_dir, console = spiky_run
    warned = _lines(console, "but check_for_spiky_loss is not armed yet")
    assert len(warned) == 1 and warned[0].startswith("reliability: iteration 4, rank 0: loss "), \
        console
    m = re.search(rf"loss {NUMBER} >= 10 x its running max {NUMBER}, .* rises to {NUMBER}$",
                  warned[0])
    value, before, raised = map(float, m.groups())
    assert value >= 10 * before and math.isclose(raised, 10 * value, rel_tol=1e-5)
    # Megatron's rule: the warm-up value raised the threshold the check arms with
    armed = _lines(console, "check_for_spiky_loss armed in iteration 8")[0]
    factor, peak, threshold = map(float, re.search(
        rf"threshold {NUMBER} x {NUMBER} = {NUMBER} ", armed).groups())
    assert factor == 10 and peak >= value and math.isclose(threshold, 10 * peak, rel_tol=1e-5)
    losses = _losses(run_dir)
    assert losses[4] > 100 * losses[3], losses   # not rejected: iteration 4 trained on it
    assert "iteration=4 " not in (run_dir / "result_rejected_tracker.txt").read_text()


def test_a_rejected_spike_is_one_line_with_value_threshold_and_verdict(spiky_run):
    run_dir, console = spiky_run
    lines = _lines(console, "Spiky loss: ")
    assert len(lines) == 1 and lines[0].startswith("reliability: iteration 9, rank 0: "), console
    m = re.search(rf"Spiky loss: {NUMBER} >= 10 x {NUMBER} = {NUMBER} \(check_for_spiky_loss: "
                  rf"10 x the largest of the first 100 loss values\); the rerun in place gave "
                  rf"{NUMBER}: not reproduced, a transient error; training continues with the "
                  rf"rerun's gradients$", lines[0])
    assert m, lines[0]
    value, peak, threshold, rerun = map(float, m.groups())
    armed = _lines(console, "check_for_spiky_loss armed in iteration 8")[0]
    assert f"x {peak:.6g} = {threshold:.6g} " in armed and value >= threshold
    # the line and the tracker tell the same story, and the step went on with the rerun
    events = [dict(kv.split("=", 1) for kv in re.findall(r"(\w+=\S+)", line))
              for line in (run_dir / "result_rejected_tracker.txt").read_text().splitlines()]
    assert [(e["iteration"], e["status"]) for e in events] == [
        ("9", "initial_run"), ("9", "first_rerun_not_reproducible")]
    assert f"{float(events[0]['result']):.6g}" == f"{value:.6g}"
    assert f"{float(events[1]['result']):.6g}" == f"{rerun:.6g}"
    losses = _losses(run_dir)
    assert losses[9] < 2 * losses[8] and rerun < threshold, losses
    order = [i for i, line in enumerate(console.splitlines()) if line.startswith("reliability:")]
    assert len(order) == 4   # not armed, warm-up spike, armed, rejected: nothing else
