"""A user's second day with the trainer: what the command line loads, keeps, prints and refuses.

Every run here is the trainer as a user starts it (`python -m tinytron.train`, one process
unless the behavior needs torchrun), and every check reads the run's own records: its console,
its tracker, its JSONL, the files it wrote or left alone.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SMALL = ["--config", "configs/tiny.toml",
         "--model.hidden_size", "64", "--model.ffn_hidden_size", "128",
         "--model.seq_length", "64", "--training.micro_batch_size", "2",
         "--training.global_batch_size", "4", "--training.log_interval", "1",
         "--scheduler.lr_warmup_iters", "1", "--training.eval_iters", "1",
         "--logging.progress_bar", "false", "--data.split", "\"90,10,0\""]


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """40 standard-library files, byte-tokenized (with their tokenizer sidecar)."""
    from tinytron.data.preprocess import run as preprocess, stdlib_corpus

    out = tmp_path_factory.mktemp("data")
    return preprocess(["--input", *stdlib_corpus(40), "--output-prefix", str(out / "corpus"),
                       "--workers", "1", "--no-progress"])


def _train(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tinytron.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]


def _train_iterations(run_dir: Path) -> list[int]:
    return [r["iteration"] for r in _records(run_dir) if "losses" in r]


def _tracker(run_dir: Path) -> str:
    return (run_dir / "latest_checkpointed_iteration.txt").read_text().strip()


def _one_error_line(proc, *needles):
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("tinytron.train: error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, data_prefix):
    """4 iterations into a/, saving at 2 and 4, validating at 3 (and at the end)."""
    a = tmp_path_factory.mktemp("runs") / "a"
    proc = _train(*SMALL, "--data.data_path", data_prefix, "--checkpoint.save", str(a),
                  "--training.train_iters", "4", "--training.save_interval", "2",
                  "--training.eval_interval", "3", "--reliability.faults", '["nan@99"]')
    assert proc.returncode == 0, proc.stderr[-3000:]
    return a, proc.stdout


# -- §1: a load path that was given loads, or fails in one line ------------------------------
def test_first_run_says_it_starts_fresh_and_reports_saves_and_validations(first_run):
    a, out = first_run
    assert f"checkpoint: starting fresh at iteration 0: {a} does not exist yet" in out, out
    for it in (2, 4):
        assert f"checkpoint: iteration {it} written to {a / f'iter_{it:07d}'} (training " \
               "blocked " in out, out
    jsonl = {r["iteration"]: r["validation"]["lm loss"] for r in _records(a) if "validation" in r}
    assert sorted(jsonl) == [3, 4], jsonl   # every eval_interval, and once more at the end
    assert f"validation at iteration 3: lm loss {jsonl[3]:.4f}" in out, out
    assert f"final validation at iteration 4: lm loss {jsonl[4]:.4f}" in out, out
    assert _tracker(a) == "4" and (a / "config.toml").is_file()
    # a CPU has no reliable peak: no MFU (it read 101% against a one-shape matmul rate)
    train = [r for r in _records(a) if "losses" in r]
    assert all(r["mfu"] is None and r["tflops_per_device"] > 0 for r in train), train
    assert "MFU: not reported on CPU" in out and " MFU " not in out, out
    # every record says what it is; a validation knows its place in samples (TensorBoard too)
    records = _records(a)
    assert [r["type"] for r in records][:2] == ["start", "train"], records[:2]
    assert {r["type"] for r in records} == {"start", "train", "validation"}
    assert all(r["launch"] == 0 for r in records) and records[0]["resumed_from"] is None
    valid = {r["iteration"]: r["consumed_train_samples"] for r in records if r["type"] ==
             "validation"}
    assert valid == {3: 12, 4: 16}, valid   # global batch 4
    # the end-of-run validation is marked final (README's JSONL schema); the interval one is not
    assert [r.get("final", False) for r in records if r["type"] == "validation"] == [False, True]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(a / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss validation vs samples")] == [12, 16]


def _main_error(capsys, *args) -> str:
    """tinytron.train's entry point in this process, for errors found before any group exists."""
    from tinytron.train import main

    code = main(list(args))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("tinytron.train: error: "), err
    return err[0]


@pytest.mark.parametrize("where", ["not a checkpoint", "missing", "incomplete iter dir"])
def test_a_load_path_without_a_checkpoint_is_refused_in_one_line(where, tmp_path, capsys):
    target = tmp_path / "target"
    if where == "not a checkpoint":
        target.mkdir()
        (target / "notes.txt").write_text("not a checkpoint")
        needle = f"{target / 'latest_checkpointed_iteration.txt'}"
    elif where == "missing":
        needle = f"{target} does not exist"
    else:
        target = tmp_path / "iter_0000002"
        target.mkdir()
        (target / "common.pt").write_bytes(b"")
        needle = "not a complete checkpoint directory"
    save = tmp_path / "b"
    line = _main_error(capsys, *SMALL, "--checkpoint.load", str(target), "--checkpoint.save",
                       str(save), "--training.train_iters", "2")
    assert "checkpoint.load" in line and needle in line, line
    assert not save.exists()   # nothing written, nothing trained


def test_a_warmup_longer_than_the_run_says_how_to_shorten_it(capsys):
    line = _main_error(capsys, *SMALL, "--scheduler.lr_warmup_iters", "20",
                       "--training.train_iters", "10")
    assert "scheduler.lr_warmup_iters (20) must be smaller" in line, line
    assert line.endswith("shorten the warm-up, e.g. --scheduler.lr_warmup_iters 1"), line


def test_resume_with_another_model_size_fails_before_writing_anything(first_run, data_prefix,
                                                                       capsys):
    a, _ = first_run
    before = {p: p.read_bytes() for p in (a / "config.toml", a / "log.jsonl")}
    line = _main_error(capsys, *SMALL, "--data.data_path", data_prefix, "--checkpoint.save",
                       str(a), "--training.train_iters", "6", "--model.hidden_size", "128",
                       "--model.num_layers", "2")
    for needle in (str(a / "iter_0000004"), "hidden_size 64 vs 128", "num_layers 4 vs 2"):
        assert needle in line, line
    assert {p: p.read_bytes() for p in before} == before and _tracker(a) == "4"
    assert [x.name for x in a.iterdir() if x.name.startswith("tensorboard")] == ["tensorboard"]


def test_a_checkpoint_the_loader_refuses_is_one_line(first_run, data_prefix):
    """A longer run without override_opt_param_scheduler: chapter 03 refuses the scheduler."""
    a, _ = first_run
    proc = _train(*SMALL, "--data.data_path", data_prefix, "--checkpoint.save", str(a),
                  "--training.train_iters", "9", "--training.eval_interval", "none")
    _one_error_line(proc, "iter_0000004")
    assert _tracker(a) == "4"


def _resume_command(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    return shlex.split(lines[lines.index(next(x for x in lines if x.startswith("resume ("))) + 1])


def test_data_too_small_for_its_split_is_one_line(tmp_path, capsys):
    """Chapter 04's refusal (no validation sequences) reaches the shell as one line, exit 2."""
    from tinytron.data.preprocess import run as preprocess, stdlib_corpus

    few = preprocess(["--input", *stdlib_corpus(3), "--output-prefix", str(tmp_path / "few"),
                      "--workers", "1", "--no-progress"])
    line = _main_error(capsys, *SMALL, "--data.data_path", few, "--data.split", '"98,2,0"',
                       "--checkpoint.save", str(tmp_path / "run"), "--training.train_iters", "4",
                       "--training.eval_interval", "2")
    assert line.startswith(f"tinytron.train: error: data: dataset '{few}' split 'valid'"), line


def test_an_iteration_directory_loads_and_the_resume_command_continues(first_run, data_prefix,
                                                                       tmp_path):
    """Load a/iter_0000002, save b/, a NaN injected at iteration 4: that iteration directory is
    loaded, the stop names its verdict (exit 17), and the printed resume command loads b/ (not
    a/ again) without the fault, and trains on to the end."""
    a, _ = first_run
    b = tmp_path / "b"
    proc = _train(*SMALL, "--data.data_path", data_prefix, "--training.train_iters", "5",
                  "--checkpoint.load", str(a / "iter_0000002"), "--checkpoint.save", str(b),
                  "--training.save_interval", "1", "--training.eval_interval", "none",
                  "--reliability.faults", "nan@4", "--scheduler.override_opt_param_scheduler",
                  "true")
    assert proc.returncode == 17, proc.stderr[-3000:]
    assert f"checkpoint: resumed from {a / 'iter_0000002'} at iteration 2;" in proc.stdout
    assert _tracker(b) == "3" and _tracker(a) == "4"
    tracker_file = b / "result_rejected_tracker.txt"
    verdict = [x for x in proc.stdout.splitlines() if x.startswith("reliability: ")]
    assert len(verdict) == 1 and verdict[0].startswith("reliability: iteration 4, rank 0: ")
    assert "exit code 17" in verdict[0] and str(tracker_file) in verdict[0], verdict
    assert "iteration=4 " in tracker_file.read_text()
    command = _resume_command(proc.stdout)
    assert command[0] == "tinytron-train", command  # launched as one process: one process
    assert "--reliability.faults" not in command and command[-2:] == ["--checkpoint.load", str(b)]
    assert not any(str(a) in word for word in command), command
    again = _train(*command[1:])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"checkpoint: resumed from {b / 'iter_0000003'} at iteration 3;" in again.stdout
    assert _tracker(b) == "5" and _tracker(a) == "4" and _train_iterations(b)[-2:] == [4, 5]
    starts = [r for r in _records(b) if r["type"] == "start"]
    assert [(r["launch"], r["iteration"], r["resumed_from"]) for r in starts] == [
        (0, 2, str(a / "iter_0000002")), (1, 3, str(b / "iter_0000003"))], starts


# -- §1: tinytron-convert from-hf never overwrites a run --------------------------------------
def test_from_hf_refuses_a_run_directory_unless_forced(first_run, tmp_path, capsys):
    import shutil

    from tinytron.checkpoint.convert import main as convert

    a, _ = first_run
    run = tmp_path / "run"
    shutil.copytree(a, run)
    assert convert(["to-hf", str(run), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert convert(["from-hf", str(tmp_path / "hf"), str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tracker at iteration 4" in err[0] and "--force" in err[0], err
    assert _tracker(run) == "4"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    assert convert(["from-hf", str(tmp_path / "hf"), str(tmp_path / "other")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert convert(["from-hf", str(tmp_path / "hf"), str(tmp_path / "new")]) == 0
    assert convert(["from-hf", str(tmp_path / "hf"), str(run), "--force"]) == 0
    assert _tracker(run) == "0"


# -- §5: an export carries the run's tokenizer ---------------------------------------------------
def test_to_hf_exports_the_runs_tokenizer(first_run, bpe_prefix, tmp_path, capsys):
    import shutil

    from tinytron.checkpoint.convert import main as convert
    from tinytron.overview.batch import ByteTokenizer

    transformers = pytest.importorskip("transformers")
    a, _ = first_run
    assert convert(["to-hf", str(a / "iter_0000004"), str(tmp_path / "byte")]) == 0
    assert "with its tokenizer" in capsys.readouterr().out
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "byte"))
    text = "def f(x):\n    return x  # héllo ✓\t"
    assert auto.encode(text) == ByteTokenizer().encode(text)   # the byte tokenizer's ids
    assert auto.decode(auto.encode(text)) == text
    assert (auto.eos_token_id, auto.pad_token_id) == (256, 257)
    # a run trained with [tokenizer] hf exports that file
    run = tmp_path / "bpe_run"
    shutil.copytree(a, run, ignore=shutil.ignore_patterns("tensorboard", "data"))
    tok_file = bpe_prefix.removesuffix("_text_document") + "_tokenizer.json"
    config = (run / "config.toml").read_text()
    (run / "config.toml").write_text(config.replace(
        'tokenizer_type = "byte"', f'tokenizer_type = "hf"\ntokenizer_model = "{tok_file}"'))
    assert convert(["to-hf", str(run), str(tmp_path / "bpe")]) == 0
    assert (tmp_path / "bpe" / "tokenizer.json").read_bytes() == Path(tok_file).read_bytes()
    bpe = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bpe"))
    assert bpe.eos_token_id == 0 and len(bpe.encode(text)) < len(text.encode())


# -- §1: the data knows its tokenizer ---------------------------------------------------------
@pytest.fixture(scope="module")
def bpe_prefix(tmp_path_factory):
    from tinytron.data.preprocess import run as preprocess, stdlib_corpus

    out = tmp_path_factory.mktemp("bpe")
    return preprocess(["--input", *stdlib_corpus(6), "--output-prefix", str(out / "c"),
                       "--tokenizer-type", "bpe", "--vocab-size", "300", "--workers", "1",
                       "--no-progress"])


def test_bpe_data_under_the_byte_tokenizer_is_refused_before_any_group(bpe_prefix, capsys,
                                                                        tmp_path):
    from tinytron.data._sidecar import read_sidecar, sidecar_path
    from tinytron.train import main, resolve_config

    info = read_sidecar(bpe_prefix)
    assert (info["eod"], info["pad"]) == (0, 1)
    args = [*SMALL, "--data.data_path", bpe_prefix, "--model.vocab_size", "512",
            "--checkpoint.save", str(tmp_path / "run")]   # never the repository's runs/tiny
    assert main(args) == 2   # [tokenizer] left at byte: EOD 256, pad 257
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eod 0 (data) vs 256" in err[0] and "pad 1 (data) vs 257" in err[0]
    assert "tokenizer.tokenizer_model" in err[0], err
    tok = info["tokenizer_file"]
    resolve_config([*args, "--tokenizer.tokenizer_type", "hf", "--tokenizer.tokenizer_model", tok],
                   1)   # the data's own tokenizer passes
    os.remove(sidecar_path(bpe_prefix))   # data without a sidecar (Megatron-made) still loads
    resolve_config(args, 1)


# -- §2: under torchrun a config error is printed once -----------------------------------------
def test_a_config_error_under_torchrun_prints_once(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           "-m", "tinytron.train", *SMALL, "--model.hiden_size", "64"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("tinytron.train: error: unknown config key model.hiden_size") == 1, out
    assert "tinytron/" not in out and "chapters/" not in out, out   # no traceback of ours


# -- §3: list-valued overrides, --help, one signal switch ---------------------------------------
def test_list_overrides_take_bare_words_and_name_the_syntax():
    from tinytron.config import ConfigError, load_config

    cfg = load_config("configs/tiny.toml", ["--reliability.faults", "nan@25",
                                            "--model.recompute_modules", "core_attn,mlp"])
    assert cfg.extra["reliability"].faults == ["nan@25"]
    assert cfg.model.recompute_modules == ["core_attn", "mlp"]
    cfg = load_config("configs/tiny.toml", ["--reliability.faults", '["nan@25", "kill@3:rank=1"]',
                                            "--data.data_path", "0.3 a 0.7 b"])
    assert cfg.extra["reliability"].faults == ["nan@25", "kill@3:rank=1"]
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"]   # [data] splits Megatron's blend itself
    with pytest.raises(ConfigError, match=r"reliability.faults must be list, as a TOML list"):
        load_config("configs/tiny.toml", ["--reliability.faults", "3"])


def test_help_lists_every_key_with_its_default_and_meaning(capsys):
    import dataclasses

    from tinytron.config import SECTIONS, _section_class
    from tinytron.train import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in SECTIONS:
        assert any(x.startswith(f"[{name}]  ") for x in lines), name
        for f in dataclasses.fields(_section_class(name)):
            if f.init and not f.name.startswith("_"):
                assert any(x.startswith(f"  {name}.{f.name} = ") for x in lines), (name, f.name)
    assert "  training.save_interval = none    Save a checkpoint every" in out
    assert '  checkpoint.ckpt_format = "torch_dist"    ' in out


def test_exit_signal_handler_is_one_switch():
    from tinytron.config import ConfigError, load_config

    assert load_config("configs/tiny.toml").extra["reliability"].exit_signal_handler is True
    off = load_config("configs/tiny.toml", ["--training.exit_signal_handler", "false"])
    assert off.extra["reliability"].exit_signal_handler is False
    with pytest.raises(ConfigError, match=r"set it in \[training\] only"):
        load_config("configs/tiny.toml", ["--reliability.exit_signal_handler", "false"])


# -- §5: text out of a trained model -------------------------------------------------------------
@pytest.fixture(scope="module")
def varied_model():
    """A model whose greedy continuation varies (untied, init std 0.1: no repeated last token)."""
    from tinytron.model import GPTModel, tiny_config

    return GPTModel(tiny_config(seq_length=64, seed=3, init_std=0.1, tie_embeddings=False))


def test_greedy_decoding_with_the_kv_cache_equals_the_full_forward_and_transformers(
        varied_model, tmp_path):
    import torch

    from tinytron.model import save_hf_llama
    from tinytron.model._generate import generate

    transformers = pytest.importorskip("transformers")
    prompt = [5, 77, 200, 13]
    cached = generate(varied_model, prompt, 40)
    assert len(set(cached)) > 10, cached   # a continuation worth comparing
    assert cached == generate(varied_model, prompt, 40, use_cache=False)
    save_hf_llama(varied_model, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == cached


def test_sampling_options_and_the_command(varied_model, first_run, capsys):
    from tinytron.model._generate import generate, main

    prompt = [5, 77, 200, 13]
    greedy = generate(varied_model, prompt, 20)
    assert generate(varied_model, prompt, 20, temperature=1.0, top_k=1, seed=4) == greedy
    assert generate(varied_model, prompt, 20, temperature=1.0, top_p=1e-6, seed=4) == greedy
    drawn = generate(varied_model, prompt, 20, temperature=1.5, seed=4, vocab_size=262)
    assert drawn == generate(varied_model, prompt, 20, temperature=1.5, seed=4, vocab_size=262)
    assert drawn != greedy and max(drawn) < 262
    assert generate(varied_model, prompt, 20, eod=greedy[3]) == greedy[:4]   # stops at EOD
    with pytest.raises(ValueError, match="seq_length 64"):
        generate(varied_model, prompt, 61)
    a, _ = first_run
    assert main([str(a), "--prompt", "def main(", "--max-new-tokens", "8", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("def main(")
    assert main([str(a / "nowhere"), "--prompt", "x"]) == 2
    assert "generate: error: " in capsys.readouterr().err


def test_readme_lists_the_commands_sampling_defaults():
    """README's `tinytron-generate` table gives each flag the default the command has."""
    import re

    from tinytron.model._generate import parser

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Generating text: `tinytron-generate`", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(--[\w-]+) \w+` \| ([\d.]+)", section, re.M)
    assert len(rows) == 5, rows
    p = parser()
    for flag, default in rows:
        assert p.get_default(flag[2:].replace("-", "_")) == float(default), flag


def test_sigterm_saves_at_the_iteration_it_stops_and_exits_zero(tmp_path, data_prefix):
    """README: with exit_signal_handler (tiny.toml's) a SIGTERM finishes the iteration, saves
    and exits 0; the tracker and the JSONL agree on where the run stopped."""
    import signal
    import time

    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinytron.train", *SMALL, "--data.data_path", data_prefix,
         "--checkpoint.save", str(run), "--training.train_iters", "10000",
         "--training.eval_interval", "none"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ((run / "log.jsonl").is_file() and _train_iterations(run)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    stopped = int(_tracker(run))
    assert 1 <= stopped < 10000 and (run / f"iter_{stopped:07d}").is_dir()
    assert max(_train_iterations(run)) == stopped
    assert f"stopped at iteration {stopped} (reason: signal), exit code 0" in out, out[-2000:]
