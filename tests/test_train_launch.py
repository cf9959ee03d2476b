"""How a run is launched again: the printed resume command repeats the launch that was used
(one process, torchrun on one or several nodes, a Slurm job), and `scripts/slurm_train.sh`
checks the config once before srun, so a config error is never restarted."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from tests.conftest import ROOT

ARGS = ["--config", "configs/tiny.toml", "--checkpoint.load", "/ckpt/tiny"]


@pytest.mark.parametrize("env, world, expected", [
    ({}, 1, "tinytron-train --config configs/tiny.toml --checkpoint.load /ckpt/tiny"),
    ({"LOCAL_WORLD_SIZE": "2"}, 2,
     "torchrun --nproc-per-node=2 -m tinytron.train --config configs/tiny.toml "
     "--checkpoint.load /ckpt/tiny"),
    ({"LOCAL_WORLD_SIZE": "1"}, 2,
     'torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"'
     " -m tinytron.train --config configs/tiny.toml --checkpoint.load /ckpt/tiny"),
    ({"LOCAL_WORLD_SIZE": "8", "SLURM_JOB_ID": "7", "TINYTRON_SLURM_SCRIPT": "/r/slurm.sh"}, 32,
     "sbatch --nodes=4 /r/slurm.sh configs/tiny.toml --checkpoint.load /ckpt/tiny"),
    ({"LOCAL_WORLD_SIZE": "4", "SLURM_JOB_ID": "7", "TINYTRON_SLURM_SCRIPT": "/r/slurm.sh"}, 8,
     "GPUS_PER_NODE=4 sbatch --nodes=2 /r/slurm.sh configs/tiny.toml --checkpoint.load /ckpt/tiny"),
])
def test_the_resume_command_repeats_the_launch(env, world, expected):
    from tinytron.train import launch_command

    line, where = launch_command(ARGS, world, env)
    assert line == expected
    assert ("each of the 2 nodes" in where) == (world == 2 and env.get("LOCAL_WORLD_SIZE") == "1")


@pytest.fixture
def fake_slurm(tmp_path):
    """srun that records its command line and the script's export; scontrol that names a host."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text('#!/bin/sh\necho "$TINYTRON_SLURM_SCRIPT $*" > "$SRUN_LOG"\n')
    (bin_ / "scontrol").write_text("#!/bin/sh\necho localhost\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    submit = tmp_path / "submit"
    submit.mkdir()
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(submit),
               SLURM_NNODES="2", SLURM_JOB_ID="7", GPUS_PER_NODE="1", PYTHON=sys.executable,
               SRUN_LOG=str(tmp_path / "srun.log"), OMP_NUM_THREADS="1")
    return env, tmp_path


def _sbatch(env, *args):
    return subprocess.run(["bash", str(ROOT / "scripts" / "slurm_train.sh"), *args], cwd=env[
        "SLURM_SUBMIT_DIR"], env=env, capture_output=True, text=True, timeout=120)


def test_slurm_script_stops_on_a_config_error_before_srun(fake_slurm):
    env, tmp = fake_slurm
    proc = _sbatch(env, "configs/tiny.toml", "--training.log_interval", "0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "tinytron.train: error: training.log_interval must be >= 1, got 0"]
    assert not (tmp / "srun.log").exists()  # torchrun never started: nothing to restart
    assert not (tmp / "submit" / "runs").exists()


def test_slurm_script_finds_the_repository_config_from_any_submit_directory(fake_slurm):
    env, tmp = fake_slurm
    proc = _sbatch(env, "configs/tiny.toml")
    assert proc.returncode == 0, proc.stderr[-2000:]
    words = shlex.split((tmp / "srun.log").read_text())
    assert words[0] == str(ROOT / "scripts" / "slurm_train.sh")  # what the resume line names
    assert words[words.index("--config") + 1] == str(ROOT / "configs" / "tiny.toml")
    assert words[words.index("--nnodes") + 1] == "2" and "--max-restarts" in words


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_each_show_the_run_and_the_resume_command_names_both(tmp_path):
    """Two torchrun "nodes" on loopback, one rank each, Megatron's log line (no bar): the first
    node's console shows every interval and the validation too, not only the last node's; the
    last node prints the two-node torchrun command that resumes the run."""
    from tinytron.data.preprocess import run as preprocess, stdlib_corpus

    data = preprocess(["--input", *stdlib_corpus(8), "--output-prefix", str(tmp_path / "c"),
                       "--workers", "1", "--no-progress"])
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
           "two-nodes", "-m", "tinytron.train", "--config", "configs/tiny.toml",
           "--model.hidden_size", "64", "--model.ffn_hidden_size", "128",
           "--model.seq_length", "64", "--training.micro_batch_size", "2",
           "--training.global_batch_size", "4", "--training.train_iters", "2",
           "--training.log_interval", "1", "--training.eval_interval", "2",
           "--training.eval_iters", "1", "--scheduler.lr_warmup_iters", "1",
           "--logging.progress_bar", "false", "--data.split", '"90,10,0"',
           "--data.data_path", data, "--checkpoint.save", str(tmp_path / "run")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    for out in outs:  # whichever node got which rank, both consoles show the run
        assert sum(x.startswith(" iteration ") for x in out.splitlines()) == 2, out[-3000:]
        assert "validation at iteration 2" in out, out[-3000:]
    resume = [o.splitlines() for o in outs if "resume (" in o]
    assert len(resume) == 1  # the last rank's node only
    lines = resume[0]
    line = lines[lines.index(next(x for x in lines if x.startswith("resume ("))) + 1]
    assert line.strip().startswith("torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "
                                   '--rdzv-endpoint="$RDZV_ENDPOINT" -m tinytron.train'), line
