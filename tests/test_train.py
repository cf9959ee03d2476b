"""tinytron.train: parity of every layout with one process, multi-node, kill + resume, the README job, bad input."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.train_workers import TINY, read_losses
from tinytron.launch import run_on_ranks


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """40 standard-library files as one byte-tokenized .bin/.idx, shared by every run."""
    from tinytron.data.preprocess import run as preprocess, stdlib_corpus

    out = tmp_path_factory.mktemp("data")
    return preprocess(["--input", *stdlib_corpus(40), "--output-prefix", str(out / "corpus"),
                       "--workers", "1", "--no-progress", "--append-eod"])


# -- parity: every layout gives the single-process losses -------------------------------------
VPP2 = ["--parallel.pipeline_model_parallel_size", "2",
        "--parallel.virtual_pipeline_model_parallel_size", "2"]
DISTOPT = ["--optimizer.use_distributed_optimizer", "true", "--ddp.overlap_grad_reduce", "true",
           "--ddp.overlap_param_gather", "true", "--ddp.align_param_gather", "true"]
LAYOUTS = {
    "tp2_pp2": ["--parallel.tensor_model_parallel_size", "2",
                "--parallel.pipeline_model_parallel_size", "2"],
    "tp2_dp2": ["--parallel.tensor_model_parallel_size", "2",  # with evaluation: TP rank 1
                "--training.eval_interval", "5", "--training.eval_iters", "1"],  # has no iterator
    "pp2_dp2_distopt": ["--parallel.pipeline_model_parallel_size", "2",
                        "--optimizer.use_distributed_optimizer", "true",
                        "--ddp.overlap_grad_reduce", "true", "--ddp.overlap_param_gather", "true"],
    "pp2_vpp2_dp2": ["--parallel.pipeline_model_parallel_size", "2",
                     "--parallel.virtual_pipeline_model_parallel_size", "2"],
    # one DistributedOptimizer over both chunks, the schedule dispatching each chunk's gathers;
    # it saves at iteration 5 for the resumes below
    "pp2_vpp2_dp2_distopt": VPP2 + DISTOPT + ["--training.save_interval", "5"],
    "cp2_dp2": ["--parallel.context_parallel_size", "2"],
    "tp2_sp_dp2": ["--parallel.tensor_model_parallel_size", "2", "--model.sequence_parallel", "true"],
}


def _resumes(root: str) -> dict[str, tuple[str, list[str]]]:
    """Runs that load iteration 5 of a PP2 x VPP2 distributed-optimizer run into another layout:
    name -> (the run whose losses 6-10 they continue, their arguments)."""
    def load(run):
        return ["--checkpoint.load", os.path.join(root, run), "--checkpoint.ckpt_step", "5"]
    return {  # torch_dist reshards anything; the legacy format reshards DP only
        "vpp_distopt_to_pp2_plain": ("pp2_vpp2_dp2_distopt", ["--parallel.pipeline_model_parallel_size",
                                                              "2"] + load("pp2_vpp2_dp2_distopt")),
        "vpp_distopt_to_tp2_dp2_distopt": ("pp2_vpp2_dp2_distopt", [
            "--parallel.tensor_model_parallel_size", "2"] + DISTOPT[:4]
            + load("pp2_vpp2_dp2_distopt")),
        "legacy_dp1_to_dp2": ("pp2_vpp2_dp1_distopt_legacy", VPP2 + DISTOPT + LEGACY
                              + load("pp2_vpp2_dp1_distopt_legacy")),
    }


LEGACY = ["--checkpoint.ckpt_format", "torch"]


@pytest.fixture(scope="module")
def parity(tmp_path_factory, data_prefix):
    from tests import train_workers

    root = str(tmp_path_factory.mktemp("parity"))
    single = run_on_ranks(train_workers.run_layouts, 1, root, data_prefix, {"single": []},
                          timeout=300)[0]["single"]
    two = run_on_ranks(train_workers.run_layouts, 2, root, data_prefix, {
        "pp2_vpp2_dp1_distopt_legacy": VPP2 + DISTOPT + LEGACY + ["--training.save_interval", "5"]},
        timeout=300)[-1]
    resumes = {name: argv for name, (_, argv) in _resumes(root).items()}
    per_rank = run_on_ranks(train_workers.run_layouts, 4, root, data_prefix,
                            {**LAYOUTS, **resumes}, timeout=900)
    runs = {**two, **per_rank[-1]}  # the last rank writes the log
    return single, runs, {name: runs[source] for name, (source, _) in _resumes(root).items()}


def test_runs_in_one_process_release_their_groups(parity):
    """Six run() calls in one world: each destroys its gloo groups (27 threads a run leaked before)."""
    _, runs, _ = parity
    threads = [r["threads"] for name, r in runs.items() if name in LAYOUTS]
    assert threads[-1] - threads[0] <= 4 * (len(threads) - 1), threads


def test_single_process_run_trains(parity):
    single, _, _ = parity
    assert single["code"] == 0 and sorted(single["losses"]) == list(range(1, 11))
    assert single["losses"][10] < single["losses"][1] - 0.5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_gives_the_single_process_losses(parity, layout):
    single, runs, _ = parity
    got = runs[layout]
    assert got["code"] == 0 and sorted(got["losses"]) == list(range(1, 11)), got
    for it, ref in single["losses"].items():
        assert abs(got["losses"][it] - ref) <= 1e-5 * abs(ref), (layout, it, got["losses"][it], ref)
    if "--training.eval_interval" in LAYOUTS[layout]:  # every rank joined the evaluation
        assert got["validations"][:2] == [5, 10], got["validations"]


def test_distributed_optimizer_over_virtual_stages_equals_the_plain_optimizer(parity):
    """PP2 x VPP2 x DP2: the DistributedOptimizer over both chunks (overlapped, aligned gathers)
    against the plain optimizer over them. The sums are the same (two DP ranks) and the update
    is elementwise; only the clip norm is summed in another order (shards over the world, not
    whole parameters over the pipeline group), so 1e-6 relative is allowed (measured: equal).
    Bit for bit without clipping: tests/test_main_loop_param_sync.py."""
    _, runs, _ = parity
    plain, sharded = runs["pp2_vpp2_dp2"]["losses"], runs["pp2_vpp2_dp2_distopt"]["losses"]
    assert sorted(sharded) == sorted(plain) == list(range(1, 11))
    for it, ref in plain.items():
        assert abs(sharded[it] - ref) <= 1e-6 * abs(ref), (it, sharded[it], ref)


@pytest.mark.parametrize("name", ["vpp_distopt_to_pp2_plain", "vpp_distopt_to_tp2_dp2_distopt",
                                  "legacy_dp1_to_dp2"])
def test_a_virtual_stage_distopt_checkpoint_resumes_on_another_layout(parity, name):
    """Iteration 5 of a PP2 x VPP2 DistributedOptimizer run, loaded on another layout (torch_dist:
    no virtual stages and the plain optimizer, or TP2 x DP2; legacy: DP 1 -> 2), continues with
    the uninterrupted run's losses 6-10 (1e-5 relative, the tolerance of the layouts above)."""
    _, runs, sources = parity
    got, ref = runs[name], sources[name]["losses"]
    assert got["code"] == 0 and sorted(got["losses"]) == [6, 7, 8, 9, 10], got
    for it in range(6, 11):
        assert abs(got["losses"][it] - ref[it]) <= 1e-5 * abs(ref[it]), (name, it, got, ref)


def test_validation_data_is_sized_with_the_evaluation_batch(tmp_path, data_prefix):
    """Evaluation reads eval_global_batch_size samples a batch, so the validation dataset is
    sized with it (Megatron's get_train_valid_test_num_samples, training.py:4119): 8 per batch
    against a training batch of 2 runs its three evaluations instead of running out of data."""
    from tests import train_workers

    argv = ["--training.global_batch_size", "2", "--training.eval_global_batch_size", "8",
            "--training.train_iters", "4", "--training.eval_interval", "2",
            "--training.eval_iters", "1"]
    got = run_on_ranks(train_workers.run_layouts, 1, str(tmp_path), data_prefix,
                       {"eval_batch": argv}, timeout=300)[0]["eval_batch"]
    assert got["code"] == 0 and got["validations"] == [2, 4], got


# -- torchrun: the README's job in a fresh clone, two launchers, a kill and a restart -----------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(cwd, nproc: int, args: list[str], *, extra_launch=(), timeout=300, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           *extra_launch, "-m", "tinytron.train", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait(proc, timeout=300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


JOB = ["--config", "configs/tiny.toml", "--training.train_iters", "6",
       "--training.save_interval", "2", "--training.eval_interval", "3",
       "--training.eval_iters", "1", "--training.log_interval", "1",
       "--scheduler.lr_warmup_iters", "2", "--logging.progress_bar", "false"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory, data_prefix):
    """A fresh clone of the committed tree: the README's command runs from its root."""
    dst = tmp_path_factory.mktemp("clone") / "tinytron"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dst)], check=True)
    return dst


@pytest.fixture(scope="module")
def readme_run(clone, data_prefix):
    """The README's main command, shortened by overrides, run from the clone's root."""
    out = _wait(_torchrun(clone, 2, JOB + ["--data.data_path", data_prefix]))
    return clone / "runs" / "tiny", out


def test_readme_job_writes_checkpoint_log_and_plot(readme_run):
    run_dir, out = readme_run
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert (run_dir / "iter_0000006" / "metadata.json").is_file()
    losses = read_losses(str(run_dir / "log.jsonl"))
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1]
    assert (run_dir / "loss.png").stat().st_size > 10_000
    for hint in ("resume", "tinytron-convert to-hf", "tensorboard --logdir"):
        assert hint in out, out[-2000:]


def test_two_launchers_on_loopback_equal_one_launcher(readme_run, clone, data_prefix, tmp_path):
    run_dir, _ = readme_run
    port = _free_port()
    args = JOB + ["--data.data_path", data_prefix, "--checkpoint.save", str(tmp_path / "two")]
    procs = [_torchrun(clone, 1, args, extra_launch=(
        "--nnodes=2", f"--node-rank={r}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}")) for r in (0, 1)]
    for p in procs:
        _wait(p)
    assert read_losses(str(tmp_path / "two" / "log.jsonl")) == read_losses(str(run_dir / "log.jsonl"))


def test_sigkill_and_torchrun_restart_resume_to_the_same_losses(readme_run, clone, data_prefix,
                                                                tmp_path):
    """Rank 1 dies by SIGKILL in iteration 6; torchrun restarts; the job resumes from iteration 4.

    The README's launch as it is (no rendezvous variables). The restart is read from the run's
    own records — the log holds iteration 5 twice, the second launch says it resumed from the
    tracker's iteration 4 — never from torchrun's messages.
    """
    run_dir, _ = readme_run
    save = tmp_path / "killed"
    args = JOB + ["--data.data_path", data_prefix, "--checkpoint.save", str(save),
                  "--reliability.faults", '["kill@6:rank=1:attempt=0"]']
    out = _wait(_torchrun(clone, 2, args, extra_launch=("--max-restarts=1",)))
    records = [json.loads(x) for x in (save / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "losses" in r] == [1, 2, 3, 4, 5, 5, 6], records
    assert out.count("tinytron.train: world 2 = ") == 2, out[-3000:]   # two launches
    assert out.count("checkpoint: starting fresh at iteration 0") == 1, out[-3000:]
    assert f"checkpoint: resumed from {save / 'iter_0000004'} at iteration 4;" in out, out[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert read_losses(str(save / "log.jsonl")) == read_losses(str(run_dir / "log.jsonl"))


# -- bad input: one line naming the field or file, exit code 2, no traceback ------------------
BAD = {
    "unknown key": (["--model.hiden_size", "64"], "did you mean model.hidden_size?"),
    "wrong type": (["--training.micro_batch_size", "two"], "training.micro_batch_size must be int"),
    "impossible layout": (["--parallel.tensor_model_parallel_size", "2"],
                          "world size 1 is not divisible by tp·pp·cp"),
    "missing data": (["--data.data_path", "/nonexistent/corpus"],
                     "data.data_path: /nonexistent/corpus.bin does not exist"),
    "missing config": (["--config", "configs/nope.toml"], "configs/nope.toml does not exist"),
    "warmup too long": (["--scheduler.lr_warmup_iters", "400"], "scheduler.lr_warmup_iters (400)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_exit_code_2(case):
    args, message = BAD[case]
    argv = (["--config", "configs/tiny.toml"] if args[0] != "--config" else []) + args
    proc = subprocess.run([sys.executable, "-m", "tinytron.train", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr, lines
