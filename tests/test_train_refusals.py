"""Mistakes a user makes on the command line: each is one ConfigError naming the key, found
before any process group exists and before anything is written. In process (no launch), plus
one launch that shows the command line's own contract: exit 2, one line, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

BASE = ["--config", "configs/tiny.toml", "--training.train_iters", "4",
        "--scheduler.lr_warmup_iters", "1"]

CASES = {
    "log_interval 0": (["--training.log_interval", "0"], "training.log_interval must be >= 1"),
    "micro_batch_size 0": (["--training.micro_batch_size", "0"], "training.micro_batch_size"),
    "micro_batch_size -1": (["--training.micro_batch_size", "-1"], "training.micro_batch_size"),
    "min_lr > lr": (["--optimizer.lr", "1e-4", "--optimizer.min_lr", "1e-3"], "optimizer.min_lr"),
    "malformed schedule": (["--training.global_batch_size", "none",
                            "--training.step_batch_size_schedule", "0:16 32"],
                           "training.step_batch_size_schedule '0:16 32'"),
    "split without validation": (["--data.split", '"100,0,0"', "--training.eval_interval", "2"],
                                 "data.split '100,0,0' leaves no validation"),
    "train_iters 0": (["--training.train_iters", "0"], "training.skip_train"),
    "sft with micro-batches of 2": (["--data.sft", "true", "--training.micro_batch_size", "2"],
                                    "data.sft needs training.micro_batch_size 1"),
    "sft without its file": (["--data.sft", "true", "--training.micro_batch_size", "1",
                              "--data.data_path", "no/such/chat.jsonl"],
                             "chat JSONL no/such/chat.jsonl does not exist"),
    "save path is a file": (["--checkpoint.save", "{file}"], "exists and is not a directory"),
    "save dir not writable": (["--checkpoint.save", "/proc/tinytron-run"], "is not writable"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_value_is_one_config_error_naming_it(case, data_prefix, tmp_path):
    from tinytron.config import ConfigError
    from tinytron.train import resolve_config

    args, needle = CASES[case]
    (tmp_path / "file").write_text("not a directory")
    args = [a.replace("{file}", str(tmp_path / "file")) for a in args]
    save = [] if "--checkpoint.save" in args else ["--checkpoint.save", str(tmp_path / "run")]
    with pytest.raises(ConfigError) as e:
        resolve_config([*BASE, "--data.data_path", data_prefix, *save, *args], 2)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_sft_over_a_middle_pipeline_stage_is_refused(data_prefix, tmp_path):
    """A middle stage would attend without its block-causal mask: refused for 4 stages."""
    from tinytron.config import ConfigError
    from tinytron.train import resolve_config

    with pytest.raises(ConfigError, match="data.sft with parallel.pipeline_model_parallel_size 4"):
        resolve_config([*BASE, "--data.data_path", data_prefix, "--checkpoint.save",
                        str(tmp_path / "run"), "--data.sft", "true",
                        "--training.micro_batch_size", "1",
                        "--parallel.pipeline_model_parallel_size", "4"], 4)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a CPU run")
def test_triton_kernels_on_a_cpu_are_refused_not_interpreted(tmp_path):
    from tinytron.config import ConfigError
    from tinytron.train import resolve_config

    with pytest.raises(ConfigError, match="model.kernels = 'triton' on a CPU"):
        resolve_config([*BASE, "--model.kernels", "triton", "--checkpoint.save",
                        str(tmp_path / "run")], 2)


def test_decreasing_the_batch_also_decreases_the_default_evaluation_batch(tmp_path):
    from tinytron.main_loop._parts import eval_batch
    from tinytron.train import resolve_config

    cfg = resolve_config([*BASE, "--training.global_batch_size", "20",
                          "--training.decrease_batch_size_if_needed", "true",
                          "--checkpoint.save", str(tmp_path / "run")], 2)
    per_step = cfg.training.micro_batch_size * 2
    assert cfg.training.eval_global_batch_size == 20 // per_step * per_step
    assert eval_batch(cfg.training, 2)[1] == cfg.training.eval_global_batch_size


def test_the_command_line_says_it_in_one_line_exits_2_and_writes_nothing(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "tinytron.train", *BASE,
                           "--training.micro_batch_size", "-1", "--checkpoint.save",
                           str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "tinytron.train: error: training.micro_batch_size must be >= 1, got -1"]
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """5 standard-library files, byte-tokenized (a data path that exists)."""
    from tinytron.data.preprocess import run as preprocess, stdlib_corpus

    out = tmp_path_factory.mktemp("data")
    return preprocess(["--input", *stdlib_corpus(5), "--output-prefix", str(out / "corpus"),
                       "--workers", "1", "--no-progress"])
