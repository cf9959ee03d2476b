"""Helpers for tests/test_reliability*.py: launch the tiny job under torchrun, read its losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun_cmd(save, args=(), nproc: int = 2, max_restarts: int = 0,
                 launch=("--standalone",)) -> list[str]:
    """The command line of one job: torchrun on loopback, the tiny job of chapter 08."""
    return [sys.executable, "-m", "torch.distributed.run", *launch,
            f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5", "-m", "tinytron.reliability._run", "--save", str(save),
            *map(str, args)]


def job_env() -> dict:
    """Environment for torchrun: the README's, plus one thread per rank and unbuffered output."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run_job(save, args=(), nproc: int = 2, max_restarts: int = 0, timeout: float = 240,
            launch=("--standalone",)):
    """Run a job to its end: (torchrun exit code, output, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.run(torchrun_cmd(save, args, nproc, max_restarts, launch), env=job_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def logged(save) -> list[tuple[int, float]]:
    """(iteration, lm loss) in the order the last rank logged them, across restarts."""
    path = Path(save) / "losses.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "losses" in rec:
            out.append((rec["iteration"], rec["losses"]["lm loss"]))
    return out


def final_losses(save) -> dict[int, float]:
    """iteration -> the loss of its last (surviving) computation."""
    return dict(logged(save))


def step_losses(save, ranks=(0, 1)) -> dict[tuple[int, int], list[float]]:
    """(rank, iteration) -> the local per-micro-batch loss sums of its last computed pass."""
    out = {}
    for r in ranks:
        path = Path(save) / f"step_losses_rank{r}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            rec = json.loads(line)
            out[(r, rec["iteration"])] = rec["sums"]
    return out


def tracker_iteration(save) -> int:
    """The iteration chapter 03's tracker names."""
    return int((Path(save) / "latest_checkpointed_iteration.txt").read_text().strip())


def signal_rank_when(save, proc: subprocess.Popen, rank: int, sig: int, after_iteration: int,
                     timeout: float = 180) -> None:
    """Send `sig` to one rank once the job has logged `after_iteration`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        done = [it for it, _ in logged(save)]
        if done and max(done) >= after_iteration:
            pid = int((Path(save) / "pids" / f"rank{rank}.pid").read_text())
            os.kill(pid, sig)
            return
        time.sleep(0.1)
    raise TimeoutError(f"the job did not reach iteration {after_iteration}")


def inprocess_job(save: str, args: list) -> tuple:
    """Rank function: the tiny job under inprocess_restart (the launcher's group is replaced)."""
    from datetime import timedelta

    import torch.distributed as dist

    from tinytron.reliability._run import run
    from tinytron.reliability.restarts import inprocess_restart

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()       # inprocess_restart builds one group per attempt
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)
    attempts = []

    def attempt_fn(attempt):
        attempts.append(attempt)
        return run(["--save", save, *map(str, args)])

    code = inprocess_restart(attempt_fn, store=store, rank=rank, world_size=world,
                             max_restarts=1, timeout_s=60)
    return code, attempts


def _bucket_check_pass(rel, bad_backward, passes, norms, *, model, data_iterator,
                       forward_only=False, **_):
    """A one-micro-batch schedule; it records what the installed bucket check saw."""
    import torch

    ddp, batch = model[0], next(data_iterator)
    installed = ddp.bucket_groups[0].grad_check
    if forward_only:
        passes.append(("eval", installed is not None, None))
        return []
    ddp.set_grad_check(lambda buckets: (installed(buckets), norms.append(
        (rel.rsm.current_iteration, rel.rsm.state.name,
         float(buckets[0].grad_data.norm())))))   # observe the real check, after it ran
    from tinytron.buffers._workers import lm_loss
    lm_loss(ddp, batch).backward()
    if bad_backward and (rel.rank, rel.rsm.current_iteration, rel.rsm.state.name) == (
            1, 2, "INITIAL_RUN"):   # a bad backward on rank 1, whatever the checks do
        ddp.module.output.weight.main_grad[0, 0] = float("nan")
    ddp.finish_grad_sync()                        # check, then the all-reduce
    after = bool(torch.isnan(ddp.buffers[0].grad_data).any())
    passes.append((rel.rsm.state.name, installed is not None, after))
    return []


def _attribution_direct(save: str, bad_backward: bool) -> dict:
    """Chapter 05's DDP on 2 DP ranks under chapter 08's schedule wrapper; rank 1's local grads
    at iteration 2 get a NaN from its backward, or from the injector's grad fault."""
    from functools import partial

    import torch
    import torch.distributed as dist

    from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
    from tinytron.buffers._workers import TinyNet, make_batches
    from tinytron.parallel import ParallelGrid
    from tinytron.reliability.rerun_state_machine import RerunDataIterator
    from tinytron.reliability.loop_hooks import Reliability, ReliabilityConfig

    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(TinyNet(), ParallelGrid(), DistributedDataParallelConfig())
    kind = "backward" if bad_backward else "injector"
    rel = Reliability(ReliabilityConfig(
        faults=[] if bad_backward else ["nan@2:rank=1:target=grad"],
        result_rejected_tracker_filename=os.path.join(save, f"{kind}_tracker.txt")),
        rank=rank, world_size=2)
    passes, norms = [], []
    fb = rel.forward_backward_func(partial(_bucket_check_pass, rel, bad_backward, passes, norms))
    batches = make_batches(rank, 3, 1, 1, micro_bs=2)[:, 0, 0]
    data = RerunDataIterator(iter(batches[:2]))
    for _ in range(2):
        while rel.rsm.should_run_forward_backward(data):
            ddp.zero_grad_buffer()
            fb(model=[ddp], data_iterator=data, forward_only=False)
        code = rel.rsm.should_checkpoint_and_exit()[2]
    fb(model=[ddp], data_iterator=iter(batches[2:]), forward_only=True)   # evaluation
    failed = rel.rsm.failed_validation_call
    return {"code": code, "passes": passes, "norms": norms,
            "removed": all(g.grad_check is None for g in ddp.bucket_groups),
            "rejected": None if failed is None else failed.caller.message}


def local_grad_attribution(save: str) -> dict:
    """Rank function: the direct 2-rank checks, then the tiny job with a NaN in rank 1's grads."""
    from tinytron.reliability._run import run

    direct = {kind: _attribution_direct(save, kind == "backward")
              for kind in ("backward", "injector")}
    job = os.path.join(save, "job")
    code = run(["--save", job, "--train-iters", "3", "--save-interval", "2",
                "--fault", "nan@3:rank=1:target=grad"])
    return {**direct, "job_code": code}


__all__ = ["inprocess_job", "local_grad_attribution", "torchrun_cmd", "job_env", "run_job", "logged", "final_losses",
           "step_losses", "tracker_iteration",
           "signal_rank_when", "signal"]


def determinism_stats_job():
    """report_determinism_stats on every rank of the world; rank 1's rerun values differ."""
    import contextlib
    import io
    import itertools

    import torch
    import torch.distributed as dist

    from tinytron.reliability import RerunDataIterator, RerunStateMachine

    rank = dist.get_rank()
    rsm = RerunStateMachine("report_determinism_stats", identity_func=lambda: ("n", rank))
    data, out = RerunDataIterator(itertools.count()), io.StringIO()
    with contextlib.redirect_stdout(out):
        for _ in range(4):
            passes = 0
            while rsm.should_run_forward_backward(data):
                for _ in range(2):
                    v = 1.0 + next(data) + (0.5 * passes if rank == 1 else 0.0)
                    rsm.validate_result(torch.tensor(v), torch.isnan, "loss")
                passes += 1
            rsm.should_checkpoint_and_exit()
    return out.getvalue().splitlines(), sum(len(v) for v in rsm.determinism_diffs.values())


def host_sync_hang_job(report_path: str) -> None:
    """Two ranks under a RankMonitor; rank 1 hangs in step 3 before its first micro-batch,
    rank 0 waits for the all-reduce in a host sync, NCCL-style (async op, then wait)."""
    import torch
    import torch.distributed as dist

    from tinytron.reliability.fault_injection import FaultInjector
    from tinytron.reliability.fault_tolerance import FaultToleranceConfig, RankMonitor

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = FaultToleranceConfig(step_timeout=1.5, num_warmup_iters=0, heartbeat_interval=0.2,
                               heartbeat_timeout=30.0, report_path=report_path)
    monitor = RankMonitor(cfg, rank, world).start()
    injector = FaultInjector(["hang@3:rank=1"], rank=rank)
    for it in range(1, 6):
        monitor.on_training_step_start(it)
        injector.at_step_start(it)
        for _ in range(2):                    # two micro-batches, marked as the trainer does
            monitor.mark()
            grad = torch.full((4,), float(rank))
            monitor.mark()
        work = dist.all_reduce(grad, async_op=True)   # returns at once, as NCCL's does
        try:
            work.wait()                               # the host sync where rank 0 blocks
        except RuntimeError:                          # rank 1 ended first: the verdict wins
            monitor.wait_for_verdict()
            raise
        monitor.on_training_step_end()
    monitor.shutdown()
