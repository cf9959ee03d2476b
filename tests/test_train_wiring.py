"""The trainer's wiring of chapter 03's staged save, chapter 07's step-time model, the generate
command, the load plan under relaunches, and chapter 04's token-id check.

Every run is the trainer's own entry point (`tinytron.train.main`, one process, in this
process), and every check reads what the run printed or wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.test_checkpoint_staged import _files
from tests.test_train_second_day import SMALL, data_prefix  # noqa: F401 (fixture)


def _main(capsys, *args) -> tuple[int, str, str]:
    from tinytron.train import main

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        code = main([*SMALL, *args])
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    return code, out.out, out.err


def _train_iterations(run_dir: Path) -> list[int]:
    lines = (run_dir / "log.jsonl").read_text().splitlines()
    return [r["iteration"] for r in map(json.loads, lines) if "losses" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_prefix):  # noqa: F811
    """The same 4 iterations, saving at 2 and 4: synchronous, and async with the thread writer."""
    import contextlib
    import io

    from tinytron.train import main

    root = tmp_path_factory.mktemp("wiring")
    out = {}
    for name, extra in (("sync", []),
                        ("staged", ["--checkpoint.async_save", "true",
                                    "--checkpoint.async_mode", "thread"])):
        stdout, stderr, cwd = io.StringIO(), io.StringIO(), os.getcwd()
        os.chdir(ROOT)
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                code = main([*SMALL, "--data.data_path", data_prefix, "--checkpoint.save",
                             str(root / name), "--training.train_iters", "4",
                             "--training.save_interval", "2", "--training.eval_interval", "0",
                             *extra])
        finally:
            os.chdir(cwd)
        text = SimpleNamespace(out=stdout.getvalue(), err=stderr.getvalue())
        assert code == 0, text.err[-3000:]
        out[name] = (root / name, text.out)
    return out


# -- chapter 03: the staged copy, waited for before the next optimizer step -------------------
def test_the_trainers_async_save_stages_and_writes_the_sync_checkpoint(runs):
    sync_dir, sync_out = runs["sync"]
    staged_dir, staged_out = runs["staged"]
    for it in (2, 4):
        name = f"iter_{it:07d}"
        # the save returned with its copies still running: the wait is the loop's, later
        assert (f"checkpoint: iteration {it} queued (its copy to host staged behind the next "
                f"forward and backward), written in the background to {staged_dir / name}"
                in staged_out), staged_out
        assert f"checkpoint: iteration {it} written to {sync_dir / name}" in sync_out, sync_out
        a, b = _files(sync_dir / name), _files(staged_dir / name)
        assert a.keys() == b.keys() and "__0_0.distcp" in a and "common.pt" in a
        assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]
    assert (staged_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


# -- chapter 07: the step-time model beside the memory ledger ---------------------------------
def test_the_step_time_model_is_printed_at_start(runs):
    for name, schedule in (("sync", "blocking"), ("staged", "staged")):
        out = runs[name][1].splitlines()
        head = next(i for i, line in enumerate(out) if line.startswith(
            "step time per iteration, predicted by chapter 07 for this CPU, measured now: "))
        assert " GFLOP/s on a micro-batch of the model, memory " in out[head], out[head]
        assert out[head - 2].startswith("memory per rank, predicted by chapter 07"), out[:head]
        assert out[head + 1] == (f"  options: overlap_grad_reduce True, overlap_param_gather "
                                 f"False, overlap_p2p_comm False, tp_comm_overlap False, "
                                 f"checkpoint {schedule}"), out[head + 1]
        total = out[head + 2]
        assert total.startswith("  step time ") and " = compute " in total, total
        items = [line for line in out[head + 3:] if line.startswith("  exposed: ")]
        assert any(f"checkpoint D2H ({schedule})" in line for line in items), items
        assert any("checkpoint write" in line for line in items), items
        assert not any("DP " in line for line in items), items   # one rank: no DP traffic
        # at the end, the same prediction beside the run's own measured step
        predicted = total.split(" = ")[0].removeprefix("  step time ")
        end = [line for line in out if line.startswith("step time: predicted ")]
        assert len(end) == 1 and end[0].startswith(f"step time: predicted {predicted} at the "
                                                   "start, measured "), end


# -- tinytron-generate ------------------------------------------------------------------------
def test_tinytron_generate_on_a_run_and_on_one_iteration_writes_what_the_function_writes(runs):
    from tinytron.checkpoint.convert import read_checkpoint_model
    from tinytron.data.preprocess import TokenizerSpec, build_tokenizer
    from tinytron.model._generate import generate

    run_dir = runs["sync"][0]
    exe = shutil.which("tinytron-generate")
    assert exe is not None, "tinytron-generate is not installed (pip install -e .)"
    proc = subprocess.run([exe, str(run_dir), "--prompt", "def ", "--max-new-tokens", "12",
                           "--temperature", "0"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = build_tokenizer(TokenizerSpec("byte", None))
    new = generate(read_checkpoint_model(str(run_dir)), tok.encode("def "), 12,
                   temperature=0.0, eod=tok.eod, vocab_size=tok.vocab_size)
    assert proc.stdout.rstrip("\n") == "def " + tok.decode([i for i in new if i != tok.eod])
    # one iteration's directory (README: `tinytron-generate runs/tiny/iter_0000150`): that
    # iteration's weights, not the tracker's latest. Sampled (the same seed, the same text), the
    # two checkpoints write different text, so the comparison tells them apart.
    first, sampling = run_dir / "iter_0000002", dict(temperature=1.0, seed=3)
    texts = {}
    for where in (first, run_dir):
        new = generate(read_checkpoint_model(str(where)), tok.encode("def "), 24, eod=tok.eod,
                       vocab_size=tok.vocab_size, **sampling)
        texts[where] = "def " + tok.decode([i for i in new if i != tok.eod])
    assert texts[first] != texts[run_dir]
    one = subprocess.run([exe, str(first), "--prompt", "def ", "--max-new-tokens", "24",
                          "--temperature", "1", "--seed", "3"], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert one.stdout == texts[first] + "\n"
    bad = subprocess.run([exe, str(run_dir / "nothing"), "--prompt", "x"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


# -- the load plan: `load` only while `save` holds no checkpoint ------------------------------
def test_a_relaunch_continues_from_the_save_directory_not_load_again(runs, capsys, tmp_path):
    a = runs["sync"][0]
    b = tmp_path / "b"
    args = ["--data.data_path", _prefix_of(a),
            "--checkpoint.load", str(a), "--checkpoint.save", str(b),
            "--training.train_iters", "6", "--training.save_interval", "2",
            "--training.eval_interval", "0", "--scheduler.override_opt_param_scheduler", "true"]
    code, first, err = _main(capsys, *args)
    assert code == 0, err[-3000:]
    assert f"checkpoint: loading checkpoint.load {a} (checkpoint.save {b} holds no " \
           "checkpoint yet)" in first, first
    assert f"checkpoint: resumed from {a / 'iter_0000004'} at iteration 4" in first, first
    assert _train_iterations(b) == [5, 6]
    code, second, err = _main(capsys, *args)   # the same command line: a relaunch
    assert code == 0, err[-3000:]
    assert f"checkpoint: {b} already holds this run's checkpoint (iteration 6): continuing " \
           f"from it, not from checkpoint.load {a}" in second, second
    assert f"checkpoint: resumed from {b / 'iter_0000006'} at iteration 6" in second, second
    assert _train_iterations(b) == [5, 6]      # nothing retrained, nothing overwritten
    assert (b / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def test_a_relaunch_of_a_finetune_continues_its_own_checkpoint_with_all_its_state(runs, capsys,
                                                                                  tmp_path):
    """`finetune` says how to take `load`'s checkpoint (weights only, iteration 0). The relaunch
    of the same command line reads the run's own checkpoint whole: nothing is trained again."""
    a, b = runs["sync"][0], tmp_path / "b"
    args = ["--data.data_path", _prefix_of(a), "--checkpoint.load", str(a),
            "--checkpoint.save", str(b), "--checkpoint.finetune", "true",
            "--training.train_iters", "6", "--training.save_interval", "2",
            "--training.eval_interval", "0"]
    code, first, err = _main(capsys, *args)
    assert code == 0, err[-3000:]
    assert f"checkpoint: resumed from {a / 'iter_0000004'} at iteration 0; restored model " \
           "weights only" in first, first
    assert _train_iterations(b) == [1, 2, 3, 4, 5, 6]
    code, second, err = _main(capsys, *args)   # the same command line: a relaunch
    assert code == 0, err[-3000:]
    assert f"checkpoint: resumed from {b / 'iter_0000006'} at iteration 6; restored model " \
           "weights, optimizer state, scheduler, RNG states, data position" in second, second
    assert _train_iterations(b) == [1, 2, 3, 4, 5, 6]   # a finetune again would retrain 1-6


def _prefix_of(run_dir: Path) -> str:
    """The data prefix a run trained on (its config.toml)."""
    import tomllib

    return tomllib.loads((run_dir / "config.toml").read_text())["data"]["data_path"][0]


# -- chapter 04: token ids checked on the host before the copy ---------------------------------
def test_a_token_id_beyond_the_vocabulary_is_refused_in_one_line(capsys, tmp_path,
                                                                 data_prefix):  # noqa: F811
    from tinytron.data.indexed import IndexedDataset

    # Megatron-made data (no tokenizer sidecar) holding an id the model's 512 cannot embed
    prefix = str(tmp_path / "bad_text_document")
    for ext in (".bin", ".idx"):
        shutil.copy(data_prefix + ext, prefix + ext)
    dtype = IndexedDataset(prefix).dtype
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r+")
    tokens[::50] = 600
    tokens.flush()
    del tokens
    code, out, err = _main(capsys, "--data.data_path", prefix, "--checkpoint.save",
                           str(tmp_path / "run"), "--training.train_iters", "2",
                           "--training.eval_interval", "0")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("tinytron.train: error: data: tokens hold id 600, outside the "
                               "vocabulary [0, 512) (vocab_size=512)"), lines
