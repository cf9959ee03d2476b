"""A user's third day with the trainer: what a run reports and where it writes.

- a batch-size schedule: the learning rate decays over the samples the run consumes;
- ms/iteration and tokens/s leave evaluations and saves out (Megatron's interval timer);
- `checkpoint.save none` (or "") writes no checkpoint and reads none;
- no test touches the repository's own run directory (tests/conftest.py's guard).

Every run is the trainer's own entry point (`tinytron.train.main`, one process, in this process),
and every check reads what the run wrote: its log.jsonl and its console.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, touches_runs
from tests.test_train_second_day import data_prefix  # noqa: F401 (fixture)

TINY = str(ROOT / "configs" / "tiny.toml")
SMALL = ["--config", TINY, "--model.hidden_size", "64", "--model.ffn_hidden_size", "128",
         "--model.num_layers", "2", "--model.seq_length", "64",
         "--training.micro_batch_size", "4", "--training.log_interval", "1",
         "--scheduler.lr_warmup_iters", "1", "--logging.progress_bar", "false",
         "--data.split", '"90,10,0"']


def _main(capsys, *args) -> tuple[int, str]:
    from tinytron.train import main

    code = main([*SMALL, *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def _records(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("type") == kind]


# -- a batch-size schedule and the learning rate; evaluation and saves out of ms/iteration --------
@pytest.fixture(scope="module")
def scheduled_run(tmp_path_factory, data_prefix):  # noqa: F811
    """10 iterations of "0:8 1K:16" (2 at 8 samples, 8 at 16 = 144 samples), evaluating a long
    validation at 3 and 7 and saving at 5 (with checksums, so the save takes a while)."""
    import contextlib
    import io

    from tinytron.train import main

    run = tmp_path_factory.mktemp("third") / "sched"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*SMALL, "--data.data_path", data_prefix, "--checkpoint.save", str(run),
                     "--training.global_batch_size", "none",
                     "--training.step_batch_size_schedule", "0:8 1K:16",
                     "--training.train_iters", "10", "--training.eval_interval", "4",
                     "--training.eval_iters", "12", "--training.save_interval", "5",
                     "--checkpoint.crc_checksums", "true"])
    assert code == 0, out.getvalue()[-3000:]
    return run, out.getvalue()


def test_a_batch_schedule_decays_the_learning_rate_over_the_samples_consumed(scheduled_run):
    """Each logged LR is the cosine schedule at its consumed samples, with the decay over the
    144 samples the 10 iterations consume: min_lr at iteration 10, not before (today: 8)."""
    from tinytron.config import load_config

    run, _ = scheduled_run
    train = _records(run / "log.jsonl", "train")
    assert [r["iteration"] for r in train] == list(range(1, 11))
    assert [r["global_batch_size"] for r in train] == [8, 8] + [16] * 8
    assert train[-1]["consumed_train_samples"] == 144
    opt = load_config(TINY).optimizer
    warmup, decay = 8, 144   # lr_warmup_iters 1 = the first batch; the decay = all 144 samples
    for r in train:
        n = r["consumed_train_samples"]   # the scheduler's count after the iteration's step
        ratio = (n - warmup) / (decay - warmup)
        expected = opt.min_lr + (opt.lr - opt.min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1)
        assert r["learning_rate"] == pytest.approx(expected, rel=1e-9), (r["iteration"], n)
    assert train[-2]["learning_rate"] > opt.min_lr * 1.01      # still decaying at iteration 9
    assert train[-1]["learning_rate"] == pytest.approx(opt.min_lr)


def test_a_sample_based_run_under_a_batch_schedule_decays_over_train_samples(
        tmp_path, capsys, data_prefix):  # noqa: F811
    """train_samples 144 walks the schedule to 10 iterations and decays over the 144 samples."""
    from tinytron.config import load_config

    run = tmp_path / "samples"
    code, out = _main(capsys, "--data.data_path", data_prefix, "--checkpoint.save", str(run),
                      "--training.global_batch_size", "none",
                      "--training.step_batch_size_schedule", "0:8 1K:16",
                      "--training.train_iters", "none", "--training.train_samples", "144",
                      "--training.eval_interval", "none", "--training.save_interval", "none")
    assert code == 0, out[-3000:]
    train = _records(run / "log.jsonl", "train")
    opt = load_config(TINY).optimizer
    assert [r["consumed_train_samples"] for r in train][-1] == 144 and len(train) == 10
    assert train[-2]["learning_rate"] > opt.min_lr * 1.01
    assert train[-1]["learning_rate"] == pytest.approx(opt.min_lr)


def test_ms_per_iteration_leaves_out_evaluation_and_saving(scheduled_run):
    """The record after an evaluation (or a save) times the iteration, not the evaluation: its
    ms/iteration is below the wall time between the two records minus half the evaluation's
    (the save's) own duration, measured from the records' own timestamps (the console's
    'training blocked' for the save). Today it includes them, 12 evaluation batches of them."""
    run, console = scheduled_run
    records = list(map(json.loads, (run / "log.jsonl").read_text().splitlines()))
    train = {r["iteration"]: r for r in records if r.get("type") == "train"}
    valid = {r["iteration"]: r for r in records if r.get("type") == "validation"
             and not r.get("final")}
    assert sorted(valid) == [4, 8]
    for it in valid:   # the evaluation ran between record `it` and record `it + 1`
        evaluation = valid[it]["time"] - train[it]["time"]
        gap = train[it + 1]["time"] - train[it]["time"]
        if evaluation < 0.1:  # too short to tell apart from an iteration's own noise: the
            continue          # save below (and the last assert) still hold the interval clock
        assert train[it + 1]["ms_per_iteration"] / 1e3 < gap - 0.5 * evaluation, (it, gap)
    blocked = float(re.search(r"iteration 5 written to .* \(training blocked ([0-9.]+) s\)",
                              console).group(1))
    gap = train[6]["time"] - train[5]["time"]
    assert train[6]["ms_per_iteration"] / 1e3 < gap - 0.5 * blocked, (gap, blocked)
    # and the throughput with it: tokens/s is the interval's tokens over that same time
    assert train[9]["tokens_per_second"] == pytest.approx(
        16 * 64 / (train[9]["ms_per_iteration"] / 1e3), rel=1e-6)
    typical = statistics.median(r["ms_per_iteration"] for r in train.values())
    assert max(train[it + 1]["ms_per_iteration"] for it in valid) < 5 * typical + 1e3 * blocked


# -- checkpoint.save none ---------------------------------------------------------------------
@pytest.mark.parametrize("save", ["none", '""'])
def test_save_none_writes_no_checkpoint_and_reads_none(tmp_path, capsys, monkeypatch, save,
                                                       data_prefix):  # noqa: F811
    """The working directory's own run folder for tiny.toml holds a checkpoint: save none neither
    resumes it nor writes there; its logs go to a new directory; no checkpoint anywhere."""
    work, scratch = tmp_path / "work", tmp_path / "tmp"
    (work / "runs" / "tiny" / "iter_0000005").mkdir(parents=True)
    (work / "runs" / "tiny" / "latest_checkpointed_iteration.txt").write_text("5")
    scratch.mkdir()
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code, out = _main(capsys, "--data.data_path", data_prefix, "--checkpoint.save", save,
                      "--training.train_iters", "2", "--training.save_interval", "1",
                      "--training.eval_interval", "none", "--training.global_batch_size", "4")
    assert code == 0, out[-3000:]
    assert "starting fresh" in out and "no checkpoint is written" in out
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before  # the planted run folder untouched
    (logs,) = scratch.iterdir()
    assert [r["iteration"] for r in _records(logs / "log.jsonl", "train")] == [1, 2]
    written = sorted(p for p in tmp_path.rglob("*") if p.name.startswith("iter_")
                     or p.name == "latest_checkpointed_iteration.txt")
    assert written == sorted(work / "runs" / "tiny" / n   # the planted ones, nothing else
                             for n in ("iter_0000005", "latest_checkpointed_iteration.txt"))
    assert 'save = ""' in (logs / "config.toml").read_text()   # read back: still never save


# -- the guard: no test touches the repository's run directory -------------------------------------------
def test_the_guard_tells_the_repositorys_runs_from_a_run_directory_of_its_own(tmp_path,
                                                                             monkeypatch):
    """tests/conftest.py fails any test whose trainer resolves, opens or changes the
    repository's run folder; a run directory resolved under another working directory is not that."""
    from tests import conftest
    from tinytron.config import load_config
    from tinytron.train import output_dir

    assert touches_runs(conftest.RUNS / "tiny") and touches_runs(conftest.RUNS)
    assert not touches_runs(ROOT / "runs_elsewhere") and not touches_runs(3)
    monkeypatch.chdir(tmp_path)   # configs/tiny.toml without a save of its own, resolved here
    resolved = output_dir(load_config(TINY), "tiny")
    assert not touches_runs(resolved) and conftest._TOUCHED == []


# -- one run per save directory -------------------------------------------------------------------
def test_a_second_run_into_a_held_save_directory_is_refused_and_a_killed_holder_frees_it(
        tmp_path, capsys, data_prefix):  # noqa: F811
    """Another process holds the save directory's lock: the run exits 2 with one line naming
    the holder's host and pid, and writes nothing; SIGKILL the holder and the run goes."""
    import signal
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom tinytron.reliability._run_lock import "
         "lock_save_dir\nlock = lock_save_dir(sys.argv[1])\nprint('held', flush=True)\n"
         "time.sleep(120)", str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = sorted(p.name for p in run.iterdir())
        args = ["--data.data_path", data_prefix, "--checkpoint.save", str(run),
                "--training.train_iters", "2", "--training.eval_interval", "none",
                "--training.global_batch_size", "4"]
        code, out = _main(capsys, *args)
        assert code == 2
        (line,) = [x for x in out.splitlines() if x.startswith("tinytron.train: error")]
        assert f"checkpoint.save {run} is in use by another run" in line
        assert f"pid {holder.pid}," in line and "host " in line, line
        assert sorted(p.name for p in run.iterdir()) == before == ["tinytron.lock"]
    finally:
        holder.send_signal(signal.SIGKILL)   # the kernel releases a dead process's flock
        holder.wait(timeout=30)
    code, out = _main(capsys, *args)
    assert code == 0, out[-3000:]
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert "host " in (run / "tinytron.lock").read_text()   # this run's name, left behind


# -- Ctrl-C under torchrun, as a terminal sends it ------------------------------------------------
CTRL_C_SHAPE = ["--model.hidden_size", "64", "--model.ffn_hidden_size", "128",
                "--model.num_layers", "2", "--model.seq_length", "64",
                "--training.micro_batch_size", "2", "--training.global_batch_size", "8",
                "--training.train_iters", "100000", "--training.log_interval", "1",
                "--scheduler.lr_warmup_iters", "1", "--logging.progress_bar", "false",
                "--data.split", '"90,10,0"']


def _torchrun(workdir: Path, save: Path, data: str, *extra: str):
    """The README's command (2 ranks, configs/tiny.toml) in its own session, console to a file."""
    import subprocess
    import sys

    log = open(workdir / f"console{len(list(workdir.glob('console*')))}.txt", "w+")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "-m", "tinytron.train", "--config", TINY, "--checkpoint.save", str(save),
           "--data.data_path", data, *CTRL_C_SHAPE, *extra]
    proc = subprocess.Popen(cmd, cwd=workdir, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.console = log
    return proc


def _ranks_of(pid: int) -> list[int]:
    """The processes torchrun started (its children), from /proc."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _ctrl_c(proc) -> None:
    """What a terminal's Ctrl-C delivers to a process group that holds torchrun and its ranks:
    SIGINT to every rank and to torchrun, which forwards its own SIGINT to every rank once its
    agent wakes. The ranks' copy goes first and torchrun's 0.3 s later, so that each rank sees
    two (sent together, two pending SIGINTs can merge into one and hide a handler that stops
    at the second)."""
    import signal
    import time

    ranks = _ranks_of(proc.pid)
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)


def _wait_for(predicate, proc, what: str, timeout: float = 120.0):
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = predicate()
        if found:
            return found
        assert proc.poll() is None, (what, _console(proc)[-3000:])
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}: {_console(proc)[-3000:]}")


def _console(proc) -> str:
    proc.console.flush()
    proc.console.seek(0)
    return proc.console.read()


def _launch_records(save: Path, launch: int) -> list[dict]:
    path = save / "log.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, lines[:-1] if lines and not lines[-1] else lines)
            if r.get("launch") == launch] if lines else []


def _stopped_by_ctrl_c(proc, save: Path) -> int:
    """The ranks saved and exited 0 (the run's own last line and tracker); the iteration."""
    proc.wait(timeout=60)
    out = _console(proc)
    m = re.search(r"stopped at iteration (\d+) \(reason: signal\), exit code 0", out)
    assert m, out[-4000:]
    # no rank was interrupted or killed: torchrun lists a failed rank with its exitcode
    assert "KeyboardInterrupt" not in out and "exitcode" not in out and "SIGKILL" not in out, \
        out[-4000:]
    tracker = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert tracker == int(m.group(1)), (tracker, m.group(1))
    return tracker


def _train_iterations(save: Path, launch: int) -> list[int]:
    return [r["iteration"] for r in _launch_records(save, launch) if r.get("type") == "train"]


def test_ctrl_c_under_torchrun_saves_in_training_evaluation_and_a_save(tmp_path, capsys,
                                                                       data_prefix):  # noqa: F811
    """Three launches of the README's torchrun command into one save directory, each stopped by
    a terminal's Ctrl-C: during training, during a long evaluation, during a save. Each time the
    ranks save the iteration reached and exit 0, and the next launch resumes from it. While the
    first runs, a second run into its directory is refused (one line, nothing written)."""
    from tinytron.checkpoint.convert import main as convert

    save = tmp_path / "run"
    # 1. during training; meanwhile a second run into the same directory is refused
    proc = _torchrun(tmp_path, save, data_prefix, "--training.eval_interval", "none")
    try:
        _wait_for(lambda: len(_train_iterations(save, 0)) >= 3, proc, "iteration 3")
        code, out = _main(capsys, "--data.data_path", data_prefix, "--checkpoint.save",
                          str(save), "--training.train_iters", "2")
        assert code == 2 and "is in use by another run" in out, out[-2000:]
        _ctrl_c(proc)
        first = _stopped_by_ctrl_c(proc, save)
    finally:
        proc.kill() if proc.poll() is None else None
    assert first >= 3 and _train_iterations(save, 0)[-1] == first
    assert [r["type"] for r in map(json.loads, (save / "log.jsonl").read_text().splitlines())
            ].count("start") == 1    # the refused run wrote no record

    # 2. during an evaluation of 1000 batches (minutes): abandoned, saved, exit 0
    at = first + 2
    proc = _torchrun(tmp_path, save, data_prefix, "--training.eval_interval", str(at),
                     "--training.eval_iters", "1000")
    try:
        _wait_for(lambda: at in _train_iterations(save, 1), proc, f"iteration {at}")
        import time
        time.sleep(0.5)   # the record of iteration `at` is written; its evaluation has begun
        _ctrl_c(proc)
        second = _stopped_by_ctrl_c(proc, save)
    finally:
        proc.kill() if proc.poll() is None else None
    records = _launch_records(save, 1)
    assert records[0]["type"] == "start" and records[0]["iteration"] == first   # resumed
    assert _train_iterations(save, 1) == list(range(first + 1, at + 1)) and second == at
    assert not [r for r in records if r["type"] == "validation"]   # abandoned, not logged

    # 3. during a save (a checkpoint every iteration; Ctrl-C while iter_*.tmp is written)
    proc = _torchrun(tmp_path, save, data_prefix, "--training.eval_interval", "none",
                     "--training.save_interval", "1", "--checkpoint.crc_checksums", "true")
    try:
        staging = _wait_for(lambda: [p for p in save.glob("iter_*.tmp")
                                     if int(p.name[5:12]) > second + 1], proc, "a save")
        _ctrl_c(proc)
        third = _stopped_by_ctrl_c(proc, save)
    finally:
        proc.kill() if proc.poll() is None else None
    assert _launch_records(save, 2)[0]["iteration"] == second   # resumed from launch 2's
    assert third >= int(staging[0].name[5:12]) and third == _train_iterations(save, 2)[-1]
    assert not list(save.glob("iter_*.tmp"))
    assert convert(["to-hf", str(save), str(tmp_path / "hf")]) == 0   # the last one loads
