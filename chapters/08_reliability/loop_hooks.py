# %% [markdown]
# # 08 · Loop hooks: the safety nets, installed in chapter 01's loop
#
# [08.7](restarts.py) made a stop on purpose orderly and a restart a resume. The nets of the
# pages before — the rerun machine and its checks, the fault injector, the rank monitor, the
# signal handler — exist, but the loop does not call them yet. This page connects them, and
# the timers [08.9](timers.py) builds, to chapter 01's loop and chapter 03's checkpoints
# without editing either: chapter 01's `train()` already takes its data iterator, forward
# step, schedule, optimizer, checkpoint functions and step hooks as arguments, so each net
# rides in a *wrapped* version of one of them.
#
# You will build: `ReliabilityConfig` (the trainer's `[reliability]` section) and
# `Reliability`, the object of one rank that owns the nets and wraps the loop's parts.

# %%
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from tinytron.reliability._rerun_plumbing import job_sharding, same_sharding
from tinytron.reliability.fault_injection import FaultInjector, parse_fault
from tinytron.reliability.fault_tolerance import FaultToleranceConfig, RankMonitor
from tinytron.reliability.restarts import DistributedSignalHandler
from tinytron.reliability.result_checks import (RerunConfig, bucket_grad_norms,
                                                build_rerun_state_machine, check_grad_norms,
                                                checked_loss_func,
                                                get_skipped_iterations_from_tracker_file)
from tinytron.reliability.rerun_state_machine import RerunDataIterator, RerunState
from tinytron.reliability.timers import Timers

__all__ = ["ReliabilityConfig", "Reliability", "rerun_state_path"]

# %% [markdown]
# ## The hooks the loop calls
#
# `Reliability` owns the rerun machine, the fault injector, the rank monitor, the timers and
# the signal handler of one rank, and hands the loop wrapped versions of its parts:
#
# | loop part | wrapped with |
# |---|---|
# | `train_data_iterator` | `RerunDataIterator` (replayable step) |
# | `forward_step_func` | its `loss_func` checks each micro-batch loss (after the injector) |
# | `forward_backward_func` | timer `forward-backward`; each DDP chunk's bucket check (chapter 05's `set_grad_check`) for the pass |
# | optimizer | timer `optimizer` around `step()` |
# | `save_checkpoint_fn` | timer `save-checkpoint`, the monitor's `checkpoint` section, the injector's save faults, the machine's state |
# | `load_checkpoint_fn` | timer `load-checkpoint`; restores the machine and its iteration |
# | `step_hooks` | the monitor's step section and the injector's process faults |
# | `iterations_to_skip` | read from the tracker file at start (two GPUs agreed the data is bad) |
# | `exit_signal` | `DistributedSignalHandler` |
#
# The machine's state must ride with the checkpoint when it asks for exit 16: the relaunch
# reruns that step. Chapter 03's checkpoint has no slot for it, so it is written per rank next
# to it, *before* chapter 03 commits the save, keyed by iteration
# (`<save>/rerun_state/iter_0000007/rank_0.pt`): whatever the tracker names, the matching state
# is there. In steady state nothing is written (absent = steady).
#
# The gradient check runs where Megatron runs it: on each bucket's *local* gradients, inside
# chapter 05's `start_grad_sync`, before the bucket is scaled and reduced
# (`param_and_grad_buffer.py:313-348`, called at `:599-603`). A NaN that one rank's GPU
# writes into its gradients is reported by that rank alone; after the data-parallel
# all-reduce every rank would find it. The check is installed for each training pass, the
# in-place reruns included, and removed afterwards, so evaluation runs none — Megatron
# disables the machine during `evaluate` (`training.py:3847`).
#
# ```mermaid
# sequenceDiagram
#   participant R0 as rank 0
#   participant R1 as rank 1 (bad GPU)
#   participant C as all-reduce of bucket 0
#   Note over R0,R1: backward accumulates each rank's local grads into bucket 0
#   R0->>R0: check local norm (3.1): passes
#   R1->>R1: injector writes NaN, check local norm (NaN): rank 1 rejects it
#   R0->>C: bucket 0 (scaled)
#   R1->>C: bucket 0 (scaled, NaN)
#   C-->>R0: NaN, but rank 0 has already checked
#   C-->>R1: NaN
#   Note over R0,R1: the step ends, every rank reruns it in place, rank 1 judges its own value
# ```
#
# ## One section configures every net
#
# The trainer reads the nets' settings from one flat `[reliability]` table of its TOML (the
# rerun machine's fields first, then the ones below), and takes `--reliability.key value`
# overrides on the command line:
#
# ```toml
# [reliability]
# check_for_spiky_loss = true       # the rerun machine (08.4's RerunConfig)
# enable_ft = true                  # heartbeats and section timeouts (08.6)
# ft_step_timeout = 180.0
# faults = ["nan@5:rank=1:diagnostic=persistent_error"]   # tests only (08.5)
# ```
#
# The signal handler's switch is `[training]`'s `exit_signal_handler` (Megatron's one
# `--exit-signal-handler`); the section follows it. A bad value fails at start, not hours
# later, with a `ValueError` that names the key. The
# config is two parts: `ReliabilityFields`, the section's fields and checks on top of
# `RerunConfig`'s, and `ReliabilityParts`, which builds each part's config from them.

# %%
@dataclass
class ReliabilityFields(RerunConfig):
    """The [reliability] section's own fields (after RerunConfig's) and their checks."""

    exit_signal_handler: bool = False
    """On SIGTERM/SIGINT: finish the iteration, save, exit 0."""
    enable_ft: bool = False
    """Heartbeats and section timeouts (Megatron's --enable-ft-package)."""
    ft_setup_timeout: float = 600.0
    """Seconds from start to the first step."""
    ft_step_timeout: float = 180.0
    """Seconds per step after the warm-up steps."""
    ft_checkpoint_timeout: float = 600.0
    """Seconds per save."""
    ft_num_warmup_iters: int = 5
    """Steps run out of section."""
    ft_heartbeat_interval: float = 1.0
    """Seconds between beats."""
    ft_heartbeat_timeout: float = 30.0
    """A rank silent this long is frozen or dead."""
    faults: list = field(default_factory=list)
    """Fault specs for tests, e.g. ['nan@5:rank=1:diagnostic=persistent_error']."""

    def __post_init__(self):
        super().__post_init__()   # a ValueError that names a bad rerun setting
        try:
            self.fault_tolerance()
        except ValueError as e:   # its fields carry an ft_ prefix here
            raise ValueError(f"ft_{e}") from None
        for spec in self.faults:  # ... or a bad fault spec
            parse_fault(spec)


# %% [markdown]
# The section is one flat table for the trainer's TOML; the parts it configures take their
# own config objects, built from it here (the tracker file defaults to the save directory).

# %%
class ReliabilityParts:
    """The config objects of the parts this section configures."""

    def rerun(self, save_dir: Optional[str] = None) -> RerunConfig:
        """The rerun machine's settings."""
        tracker = self.result_rejected_tracker_filename
        if tracker is None and save_dir is not None:
            tracker = os.path.join(save_dir, "result_rejected_tracker.txt")
        shared = {f.name: getattr(self, f.name) for f in fields(RerunConfig)}
        return RerunConfig(**{**shared, "result_rejected_tracker_filename": tracker})

    def fault_tolerance(self, report_path: Optional[str] = None) -> FaultToleranceConfig:
        """The rank monitor's settings."""
        return FaultToleranceConfig(
            setup_timeout=self.ft_setup_timeout, step_timeout=self.ft_step_timeout,
            checkpoint_timeout=self.ft_checkpoint_timeout,
            out_of_section_timeout=max(self.ft_setup_timeout, self.ft_step_timeout),
            num_warmup_iters=self.ft_num_warmup_iters,
            heartbeat_interval=self.ft_heartbeat_interval,
            heartbeat_timeout=self.ft_heartbeat_timeout, report_path=report_path)


@dataclass
class ReliabilityConfig(ReliabilityParts, ReliabilityFields):
    """The trainer's [reliability] section: RerunConfig's fields, then the ones below."""


# %% [markdown]
# ## Seven parts, in the order the loop meets them
#
# `Reliability` below is seven parts, from `SafetyNets` to `StepHooks`. Each hook wraps a
# callable chapter 01's `train()` already takes, so the loop itself is not edited to gain the
# nets.
#
# Two small helpers first: where a rank keeps the machine's state for a given checkpoint, and
# a wrapper that times every call of a loop part.

# %%
def rerun_state_path(save_dir: str, iteration: int, rank: int) -> str:
    """Where rank `rank` keeps the rerun machine's state for the checkpoint of `iteration`."""
    return os.path.join(save_dir, "rerun_state", f"iter_{iteration:07d}", f"rank_{rank}.pt")


def _timed(fn, timers: Timers, name: str, level: int):
    """fn with timer `name` around every call."""
    def wrapped(*args, **kwargs):
        timers(name, log_level=level).start()
        try:
            return fn(*args, **kwargs)
        finally:
            timers(name, log_level=level).stop()
    return wrapped


# %% [markdown]
# The first part builds the nets from the section: the rerun machine (its tracker file in the
# save directory), the injector, the timers, the signal handler and the rank monitor if asked
# for, and the iterations the tracker says to skip.

# %%
class SafetyNets:
    """One rank's safety nets: rerun machine, fault injector, timers, signal handler, monitor."""

    def __init__(self, config: ReliabilityConfig, *, save_dir: Optional[str] = None,
                 timing_log_level: int = 0, timing_log_option: str = "minmax",
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 attempt: Optional[int] = None, store=None):
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        self.world_size = world_size or (dist.get_world_size() if initialized else 1)
        self.config, self.save_dir = config, save_dir
        self.rerun_config = config.rerun(save_dir)
        if save_dir is not None:
            os.makedirs(save_dir, exist_ok=True)
        self.rsm = build_rerun_state_machine(self.rerun_config)
        self.injector = FaultInjector(list(config.faults), rank=self.rank, attempt=attempt)
        self.timers = Timers(log_level=timing_log_level, log_option=timing_log_option)
        self.signal_handler = DistributedSignalHandler() if config.exit_signal_handler else None
        self.monitor = None
        if config.enable_ft:
            report = None if save_dir is None else os.path.join(save_dir, "hang_report.txt")
            self.monitor = RankMonitor(config.fault_tolerance(report), self.rank,
                                       self.world_size, store=store, attempt=attempt).start()
        self.iterations_to_skip = get_skipped_iterations_from_tracker_file(
            self.rerun_config.result_rejected_tracker_filename)
        self._train_data: list[RerunDataIterator] = []


# %% [markdown]
# The data and the loss, wrapped: the iterator becomes replayable, and each micro-batch loss
# passes the injector and then the check.

# %%
class DataAndLoss:
    """The data iterator made replayable; each micro-batch loss through injector and check."""

    def data_iterator(self, iterator):
        """The training iterator, replayable for reruns (None stays None)."""
        if iterator is None:
            return None
        wrapped = RerunDataIterator(iterator, self.rsm)
        self._train_data.append(wrapped)   # its step's micro-batches go into an exit-16 save
        return wrapped

    def forward_step_func(self, forward_step_func):
        """forward_step_func whose loss_func checks (and may corrupt) each micro-batch loss."""
        def wrapped(data_iterator, model):
            if self.monitor is not None:   # progress marks: who is behind, even under NCCL
                self.monitor.mark()
            output, loss_func = forward_step_func(data_iterator, model)
            if self.monitor is not None:
                self.monitor.mark()
            if self.rsm.state == RerunState.NOT_RUNNING_YET:  # evaluation: not validated
                return output, loss_func
            return output, checked_loss_func(loss_func, self.rsm, self.rerun_config,
                                             corrupt=self._corrupt)
        return wrapped

    def _corrupt(self, value, target: str):
        return self.injector.corrupt(value, target, self.rsm)


# %% [markdown]
# The schedule: for each training pass, every DDP chunk gets the bucket check (the
# injector's gradient faults first, then the rerun machine's NaN/Inf and large-gradient
# checks), which chapter 05 calls in each bucket group's `start_grad_sync`; the check is
# removed when the pass ends. `optimizer.step` is timed in place.

# First the check itself, as chapter 05 calls it for one bucket group: the injector's fault
# into the faulty bucket, then the norms of the group's local buckets to the rerun machine.
# A chunk without buckets gives its `.grad` tensors instead.

# %%
class BucketChecks:
    """The gradient-norm check of one bucket group, and the injector's gradient faults."""

    def _check_buckets(self, buckets, faulty=None) -> None:
        """Chapter 05's grad check: one group's local buckets, before their collective."""
        for b in buckets:
            if b is faulty:   # bad memory in one bucket of this rank
                self._corrupt_grad(b.grad_data)
        config = self.rerun_config
        if not (config.check_for_nan_in_loss_and_grad or config.check_for_large_grads):
            return            # both off: no norms to compute (Megatron skips check_grads)
        where = [f" for bucket #{b.bucket_id} in backward pass before data-parallel "
                 "communication collective" for b in buckets]   # Megatron's words
        check_grad_norms(self.rsm, bucket_grad_norms(b.grad_data for b in buckets), config,
                         where=where)

    def _corrupt_grad(self, grad: torch.Tensor) -> None:
        """The injector's grad faults, written into the gradient in place."""
        bad = self._corrupt(grad, "grad")
        if bad is not grad:   # a spike returns a scaled copy
            with torch.no_grad():
                grad.copy_(bad)


def _grads(chunk) -> list:
    """The .grad tensors of a chunk that has no grad buckets."""
    return [p.grad for p in chunk.parameters() if p.grad is not None]


# %% [markdown]
# Then the schedule wrapped: the check installed on every DDP chunk for the pass and removed
# after it, the bucketless chunks checked once the schedule returns.

# %%
class ScheduleChecks:
    """The bucket checks installed for each training pass; the optimizer step timed."""

    def forward_backward_func(self, forward_backward_func):
        """The schedule, timed, with the gradient-norm checks of each training pass."""
        timed = _timed(forward_backward_func, self.timers, "forward-backward", 1)

        def wrapped(**kwargs):
            if kwargs.get("forward_only") or self.rsm.state == RerunState.NOT_RUNNING_YET:
                return timed(**kwargs)                  # evaluation: not validated
            chunks = kwargs["model"]
            ddp = [c for c in chunks if hasattr(c, "set_grad_check")]   # chapter 05's DDP
            for i, chunk in enumerate(ddp):   # each bucket, inside its start_grad_sync
                first = chunk.buffers[0].buckets[0] if i == 0 else None
                chunk.set_grad_check(partial(self._check_buckets, faulty=first))
            try:
                out = timed(**kwargs)
            finally:
                for chunk in ddp:
                    chunk.set_grad_check(None)
            rest = [_grads(c) for c in chunks if c not in ddp and _grads(c)]
            if rest:   # no buckets: the grads as the schedule left them, checked after it
                self._corrupt_grad(rest[0][0])
                check_grad_norms(self.rsm, [torch.stack(bucket_grad_norms(g)).norm()
                                            for g in rest], self.rerun_config)
            return out
        return wrapped

    def wrap_optimizer(self, optimizer):
        """Time optimizer.step() in place (the object itself is kept: checkpoints inspect it)."""
        optimizer.step = _timed(optimizer.step, self.timers, "optimizer", 1)
        return optimizer


# %% [markdown]
# The checkpoint hooks: the save opens the monitor's `checkpoint` section, arms the injector's
# save faults and writes the rerun machine's state *before* chapter 03's save commits; the
# load restores that state, unless the layout changed or the tracker says to skip the
# iteration it would rerun.
#
# "The layout changed" is Megatron's test (`megatron/training/checkpointing.py:1757-1778`):
# the world size, (TP, PP) and DP must all equal the saved ones, or the job prints "Job
# sharding has changed: Rerun state will be ignored" and trains on. The hooks write TP, PP
# and DP, read from the model chunks' grid, beside the state: a 2-rank TP2 job relaunched as
# DP2 has the same world size and still trains on.
#
# The two file operations first: write this rank's machine state for an iteration (nothing in
# steady state; a temporary file renamed, so a half-written state is never read), and read it
# back if it exists, belongs to this layout, and names no iteration the tracker skips.

# %%
class RerunStateFiles:
    """The rerun machine's state, per rank and iteration, beside chapter 03's checkpoint."""

    def _save_rerun_state(self, iteration: int, sharding: Optional[dict] = None) -> None:
        if self.save_dir is None or self.rsm.state == RerunState.NOT_RUNNING_YET:
            return
        path = rerun_state_path(self.save_dir, iteration, self.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({**(sharding or job_sharding(None, self.world_size)),
                    "machine": self.rsm.state_dict(self._train_data or None)}, path + ".tmp")
        os.replace(path + ".tmp", path)

    def _load_rerun_state(self, iteration: int, sharding: Optional[dict] = None) -> None:
        path = None if self.save_dir is None else rerun_state_path(self.save_dir, iteration,
                                                                     self.rank)
        # A pending rerun of an iteration the tracker now says to skip is settled: do not
        # resume it (the loop skips that iteration instead).
        pending = path is not None and os.path.exists(path)
        if pending and iteration + 1 not in self.iterations_to_skip:
            saved = torch.load(path, weights_only=True)
            # Per-rank state means nothing on another layout: the relaunch just trains on
            # (Megatron's rule: equal world size, TP·PP and DP, checkpointing.py:1757-1778).
            if same_sharding(saved, sharding or job_sharding(None, self.world_size)):
                self.rsm.load_state_dict(saved["machine"])
        self.rsm.current_iteration = iteration   # the loop's count wins (training.py:3205)


# %% [markdown]
# The hooks wrap chapter 03's save and load around those two: the save inside the monitor's
# `checkpoint` section and the injector's save faults, the machine's state written first.

# %%
class CheckpointHooks:
    """The rerun machine's state written before a save commits and read back after a load."""

    def checkpoint_hooks(self, save_checkpoint_fn, load_checkpoint_fn):
        """(save, load) hooks that also carry the rerun machine, timers, sections and faults."""
        def save(state, model, optimizer, scheduler):
            section = self.monitor.section("checkpoint") if self.monitor else _null()
            with section, self.injector.around_save(state.iteration):
                self._save_rerun_state(state.iteration, job_sharding(model, self.world_size))
                _timed(save_checkpoint_fn, self.timers, "save-checkpoint", 0)(
                    state, model, optimizer, scheduler)

        def load(model, optimizer, scheduler):
            state = _timed(load_checkpoint_fn, self.timers, "load-checkpoint", 0)(
                model, optimizer, scheduler)
            self._load_rerun_state(0 if state is None else state.iteration,
                                   job_sharding(model, self.world_size))
            return state
        return save, load


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# %% [markdown]
# Around each step the monitor's `step` section opens and closes and the injector may strike;
# at the end, the loop's exit reason becomes the process exit code (16/17 come from the rerun
# machine) and the heartbeats stop.

# %%
class StepHooks:
    """The monitor's step section, the injector's strike, the exit code, the shutdown."""

    def on_step_start(self, state) -> None:
        """Open the step section; strike a planned kill/hang/freeze."""
        if self.monitor is not None:
            self.monitor.on_training_step_start(state.iteration + 1)
        self.injector.at_step_start(state.iteration + 1)

    def on_step_end(self, state) -> None:
        """Close the step section."""
        if self.monitor is not None:
            self.monitor.on_training_step_end()

    def exit_code(self, exit_reason: Optional[str]) -> int:
        """The process exit code for the loop's exit reason (16/17 from the rerun machine)."""
        return self.rsm.should_checkpoint_and_exit()[2] if exit_reason == "rerun" else 0

    def shutdown(self) -> None:
        """Stop the heartbeats."""
        if self.monitor is not None:
            self.monitor.shutdown()


class Reliability(StepHooks, CheckpointHooks, RerunStateFiles, ScheduleChecks, BucketChecks,
                  DataAndLoss, SafetyNets):
    """One rank's safety nets, and the wrapped loop parts that install them."""



# %% [markdown]
# ## Demo: a bad GPU through the real loop
#
# Chapter 01's `pretrain` with chapter 03's checkpoints and every hook of this page
# (`tinytron.reliability._run`, one rank, four iterations, a save every two): iteration 3's
# loss is NaN on "node-A" only. What each launch does, in the demo's own numbers:
#
# | launch | node | iteration 3's loss | the rerun machine | written | exit |
# |---|---|---|---|---|---|
# | 1 | node-A | NaN, and NaN again in place | rejects, reproduces, asks for another GPU | checkpoint 2 and `rerun_state/iter_0000002/rank_0.pt` | 16 |
# | 2 | node-B | finite | loads its state, reruns iteration 3: not reproducible | a tracker line | 17 |
#
# Exit 17 names a persistent fault of node-A's GPU. The rerun state is the file that carries
# the rejected step from the first launch to the second; without it the second launch would
# train on with a fresh machine. The tests do the same under `torchrun` with two ranks, plus
# kills, hangs and signals.

# %%
if __name__ == "__main__":
    import tempfile

    from tinytron.reliability._run import run
    from tinytron.reliability.result_checks import parse_tracker_file

    save = tempfile.mkdtemp()
    fault = "nan@3:diagnostic=persistent_error:node=node-A"
    common = ["--save", save, "--train-iters", "4", "--save-interval", "2", "--fault", fault]
    codes = [run(common + ["--node", "node-A"]), run(common + ["--node", "node-B"])]
    for e in parse_tracker_file(os.path.join(save, "result_rejected_tracker.txt")):
        print(f"  node={e['node']} iteration={e['iteration']} status={e['status']} "
              f"result={e['result']:.4g}")
    print("exit codes:", codes, "| rerun state kept with checkpoint 2:",
          os.path.exists(rerun_state_path(save, 2, 0)))
    assert codes == [16, 17] and os.path.exists(rerun_state_path(save, 2, 0))
    statuses = [e["status"] for e in parse_tracker_file(
        os.path.join(save, "result_rejected_tracker.txt"))]
    assert statuses == ["INITIAL_RUN", "FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_NOT_REPRODUCIBLE"]
    if dist.is_initialized():
        dist.destroy_process_group()

# %% [markdown]
# ## Summary
#
# - `Reliability` installs the rerun machine, the checks, the faults, the heartbeats, the
#   timers and the signal handler through callables chapter 01's loop already takes; the loop
#   is not edited.
# - The gradient check runs on each bucket's local gradients before its collective, so only
#   the rank whose GPU wrote a NaN reports it.
# - The machine's state is written per rank beside the checkpoint, before chapter 03 commits
#   it, and only when a rerun is pending; a relaunch on another layout ignores it.
#
# ## How production does it
#
# - `megatron/training/training.py:2876` (`post_training_step_callbacks`), `:3205` (the loop's
#   iteration set on the machine), `:3847` (the machine disabled during evaluation).
# - `megatron/core/distributed/param_and_grad_buffer.py:313-348` (`check_grads` on a bucket's
#   local gradients), called at `:599-603`.
# - `megatron/training/checkpointing.py:1757-1778`: the rerun state loaded only on the same
#   job sharding.
#
# ## Exercises
#
# 1. A 4-rank job trains 100 iterations with a save every 10, and no value is ever rejected.
#    How many rerun-state files does it write? And when iteration 37 is rejected and
#    reproduced in place?
#
#    <details><summary>Answer</summary>
#
#    None in steady state: `_save_rerun_state` returns while the machine is steady (absent =
#    steady). After the rejection at 37 the machine asks for exit 16 and the job saves the
#    checkpoint of iteration 36 with one file per rank: 4 files,
#    `rerun_state/iter_0000036/rank_{0..3}.pt`.
#
#    </details>
#
# 2. Why must the machine's state be written *before* chapter 03 moves the tracker, and what
#    would a relaunch do if it were written after and the process died in between?
#
#    <details><summary>Hint</summary>
#
#    Read `_load_rerun_state`: a missing
#    `rerun_state/iter_…/rank_….pt` means "steady", so the relaunch would load the checkpoint
#    the tracker names and train on with a fresh machine. The pending rerun from the checkpoint
#    is lost, and the rejected step is that process's first iteration, which is not
#    validated (`first_iteration_complete`).
#
#    </details>
#
# 3. A 2-rank TP2 job exits 16; it is relaunched as DP2 on the same two GPUs. What happens to
#    the saved rerun state, and why is that the safe choice?
#
#    <details><summary>Hint</summary>
#
#    `same_sharding` compares world size, TP, PP and DP: the world size matches but TP and DP
#    do not, so the state is ignored ("Job sharding has changed") and training goes on. The
#    saved state is per rank: rank 1's micro-batches and RNG states under TP2 are not what
#    rank 1 of a DP2 job would compute.
#
#    </details>
