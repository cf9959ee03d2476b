# %% [markdown]
# # 08 · Restarts: signals, `torchrun`, resuming, and the hooks the loop calls
#
# The previous pages built the parts; this one connects them to chapter 01's loop and chapter
# 03's checkpoints, and to the two ways a job ends early on purpose: a **signal** from the
# cluster scheduler (finish the iteration, save, exit 0) and an **automatic restart** by the
# launcher after a crash or a detected hang (start again, find the last complete checkpoint,
# continue — and produce exactly the losses an uninterrupted run would have produced).
#
# You will build: `DistributedSignalHandler`, `ReliabilityConfig` (the trainer's
# `[reliability]` section) and `Reliability`, the object that wraps the loop's parts.

# %%
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from tinytron.reliability._rerun_plumbing import job_sharding, same_sharding
from tinytron.reliability.fault_injection import FaultInjector, parse_fault
from tinytron.reliability.fault_tolerance import FaultToleranceConfig, RankMonitor
from tinytron.reliability.result_checks import (RerunConfig, bucket_grad_norms,
                                                build_rerun_state_machine, check_grad_norms,
                                                checked_loss_func,
                                                get_skipped_iterations_from_tracker_file)
from tinytron.reliability.rerun_state_machine import RerunDataIterator, RerunState
from tinytron.reliability.timers import Timers

__all__ = ["DistributedSignalHandler", "ReliabilityConfig", "Reliability", "rerun_state_path",
           "inprocess_restart", "init_torchrun_process_group"]

# %% [markdown]
# ## A signal is a request to stop *between* iterations
#
# Slurm sends `SIGTERM` some time before it kills a job at the end of its allocation (with
# `--signal`, or at preemption); a person presses Ctrl-C. Dying on the spot loses everything
# since the last save; dying *inside* a collective also leaves the other ranks hanging. So the
# handler only **records** the signal; after each iteration every rank asks "did *any* rank get
# one?" with one all-reduce — the signal may reach only some ranks, and all must take the same
# branch — and if so they save together and exit with 0: an orderly stop, not a failure
# (`DistributedSignalHandler`, `megatron/training/dist_signal_handler.py:50`;
# `checkpoint_and_decide_exit`, `megatron/training/training.py:2953`).
#
# **One Ctrl-C can arrive twice**, from the terminal and again from `torchrun`, which then
# sends SIGKILL to any rank still alive 30 s later. A handler that stops at the second SIGINT
# loses the save the first one asked for. So the rule here is time, not count: every SIGINT
# within `absorb_s` = 10 s of the first is absorbed; one later than that raises
# `KeyboardInterrupt` at once, for the person who really means it — the last *complete*
# checkpoint stays, since a save cut short never moves the tracker (chapter 03).
#
# <details><summary>Where the second SIGINT comes from, and the evaluation in progress</summary>
#
# A terminal sends SIGINT to its whole foreground process group: `torchrun` gets it, and so
# does every rank that shares that group (older launchers, `kill -INT -- -PGID`); `torchrun`
# then forwards its own copy to every rank (`_shutdown(death_sig)` in
# `torch/distributed/elastic/agent/server/api.py`). An evaluation in progress is abandoned at
# the next batch when a signal has arrived (chapter 01's `evaluate` asks the same all-reduced
# question), so the save fits in `torchrun`'s 30 s however long the evaluation would have been.
#
# </details>
#
# The handler has chapter 01's `ExitSignal` interface (`received(grid)`), so `pretrain(...,
# exit_signal=handler)` uses it as is.
#
# First the question every rank asks after an iteration: one all-gather of a one-int flag;
# `received()` is true when any rank's flag is.

# %%
class _AnyRankReceived:
    """The collective question: did any rank receive a signal?"""

    def signals_received(self, group=None) -> list[bool]:
        """Every rank's flag, all-gathered (Megatron's return value)."""
        flag = torch.tensor([int(bool(self.received_signals))], dtype=torch.int32)
        if not (dist.is_available() and dist.is_initialized()):
            return [bool(flag.item())]
        if dist.get_backend(group) == "nccl":
            flag = flag.cuda()
        out = [torch.zeros_like(flag) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, flag, group=group)
        return [bool(t.item()) for t in out]

    def received(self, grid=None) -> bool:
        """Whether any rank received a signal (chapter 01's exit_signal protocol)."""
        return any(self.signals_received())


# %% [markdown]
# The handler itself installs on entry, restores the previous handlers on exit, and only
# appends to `received_signals`, except for a SIGINT more than `absorb_s` after the first.

# %%
class DistributedSignalHandler(_AnyRankReceived):
    """Record SIGTERM/SIGINT; `received()` says whether any rank got one (collective)."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT), absorb_s: float = 10.0):
        self.signals, self._previous = tuple(signals), {}
        self.received_signals: list[int] = []
        self.absorb_s, self._first_sigint = absorb_s, None

    def __enter__(self) -> "DistributedSignalHandler":
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> bool:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        return False

    def keep_absorbing(self) -> None:
        """Stay installed for the rest of the process: the run is stopping on a signal, and
        another copy of the same Ctrl-C (torchrun's, sent later) must not interrupt its end."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        now = time.monotonic()
        if signum == signal.SIGINT:
            if self._first_sigint is None:
                self._first_sigint = now
            elif now - self._first_sigint > self.absorb_s:
                raise KeyboardInterrupt  # a Ctrl-C well after the first: stop now
        self.received_signals.append(signum)


# %% [markdown]
# ## Restarting the job: `torchrun --max-restarts`
#
# `torchrun --nproc-per-node N --max-restarts R` runs an agent per node that watches its
# workers. When one exits non-zero or dies — `SIGKILL`, a segfault, the rank monitor's exit
# after a hang — the agent stops *all* workers of the job, on every node, and starts a fresh
# set, up to `R` times. Each new worker sees `TORCHELASTIC_RESTART_COUNT` (0, 1, …) and starts the
# training script from the top: build everything, then `load_checkpoint_fn` reads chapter 03's
# tracker (`latest_checkpointed_iteration.txt`), which names the last **complete** checkpoint
# — a save killed half-way never moved it — and training continues from there.
#
# ```mermaid
# sequenceDiagram
#   participant A as torchrun agent
#   participant W0 as worker rank 0
#   participant W1 as worker rank 1
#   participant D as save dir
#   Note over A,W1: life 0, TORCHELASTIC_RESTART_COUNT=0
#   W0->>D: the ranks save iteration 4: all shards, then the tracker says 4
#   W0->>D: the save of iteration 6 begins, shards being written
#   Note over W1: SIGKILL (or exit 18 after a hang) during the save
#   W1--xA: worker exits non-zero
#   A->>W0: stop every worker of the job, on every node
#   Note over A: nodes rendezvous again, restart 1 of max_restarts
#   A->>W0: start a fresh worker, TORCHELASTIC_RESTART_COUNT=1
#   A->>W1: start a fresh worker, TORCHELASTIC_RESTART_COUNT=1
#   Note over W0,W1: the script runs from the top: groups, model, optimizer
#   W0->>D: load_checkpoint_fn reads the tracker (every rank does)
#   D-->>W0: 4 (the half-written iteration 6 is never named)
#   D-->>W0: iteration 4: the whole training state
#   Note over W0,W1: train from iteration 5, with the same losses as before
# ```
#
# An exit 0 (a signal: saved and stopped on purpose) ends the job; any non-zero exit or death
# restarts it, up to `--max-restarts` times.
#
# **One run per save directory.** The trainer's rank 0 holds an exclusive `flock` on
# `<save>/tinytron.lock` for the whole run; a second run started on the same directory exits
# 2 on every rank with one line that names the holder, having written nothing.
#
# <details><summary>Why the lock, and why it is never stale (Megatron has none)</summary>
#
# A Slurm requeue of a job whose old allocation is still alive, or the same command started
# twice, would put two runs into one directory, each "starting fresh" or resuming the other's
# half-written state, with their logs interleaved and both exiting 0. The lock file holds the
# holder's host, pid and start time. The kernel releases a `flock` when its holder dies,
# SIGKILL included, so the relaunch after a crash never finds a stale lock
# (`tinytron.reliability._run_lock`). Megatron has no such lock and relies on the scheduler
# to run one job per directory.
#
# </details>
#
# ### One store, many lives: the keys of each attempt under its own prefix
#
# The workers find each other through a `TCPStore` that the torchrun agent shares with them,
# and that store outlives the workers: it is the same object in every attempt.
# `init_process_group("env://")` puts the world's keys under `default_pg/`, with no attempt in
# the name, so a restarted rank asks for its peers' addresses and gets the *previous*
# attempt's at once — gloo dials ports that died with the old workers ("Connection refused");
# NCCL's bootstrap would read the old rank 0's unique id the same way.
#
# <details><summary>Which launches share the store, and the subgroups</summary>
#
# The agent shares its rendezvous store with the workers (`TORCHELASTIC_USE_AGENT_STORE=True`;
# `MASTER_PORT` then names the agent's store, not one that rank 0 hosts) — the c10d rendezvous
# does unless `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` is set, the static one (`--master-port`)
# always — whichever way torchrun is launched (`--nproc-per-node` alone, which picks c10d on
# one node, `--master-port`, `--standalone`, `--rdzv-backend c10d`). gloo's `connectFullMesh`
# either gets "Connection refused" or waits on a peer that is dialing somewhere else. Every
# subgroup made afterwards (`new_group` names them "1", "2", … again in each process) collides
# the same way.
#
# </details>
#
# The cure is the one Megatron applies to its in-process restarts (`training.py:1088-1090`):
# the attempt's number in front of every key. `init_torchrun_process_group` reads the store
# torchrun gives (the same `env://` rendezvous `init_process_group` would do), wraps it in
# `PrefixStore("tinytron/attempt/<TORCHELASTIC_RESTART_COUNT>/", …)` and builds the world on
# it. `new_group` prefixes each subgroup's keys onto the world's store, so every group of the
# `ParallelGrid` lands under the same attempt.
#
# <details><summary>Megatron detail: the launcher's keys unprefixed</summary>
#
# Megatron itself passes `store=None` at launch (`megatron/training/initialize.py:315-317`):
# it keeps the launcher's keys unprefixed and relies on a fresh store per launch.
#
# </details>
#
# One case stays open: an elastic job whose membership changes restarts its workers without counting a
# restart, so the count repeats; tinytron's launches fix the number of nodes.

# %%
def init_torchrun_process_group(backend: str, timeout) -> None:
    """Join torchrun's world through its store, every key under this attempt's prefix."""
    from datetime import timedelta

    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store = dist.PrefixStore(f"tinytron/attempt/{attempt}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)


# %% [markdown]
# What a restart costs:
#
# $$t_{\text{lost}} = t_{\text{detect}} + t_{\text{restart}} + t_{\text{load}} +
#   t_{\text{redo}},\qquad \mathbb{E}[t_{\text{redo}}] = \tfrac12\,\text{save\_interval}\cdot t_{\text{iter}}$$
#
# — detection (immediate for a crash, the section timeout for a hang), process start and
# process-group set-up, the checkpoint load, and the iterations since the last save, which
# must be computed again. The next page puts numbers on each term.
#
# "Equal to an uninterrupted run" holds only if the checkpoint carries *everything* the next
# iteration depends on ([chapter 03's resume](../03_checkpoint/resume.py)) and nothing
# depends on the process's history.
#
# The config is two parts: `ReliabilityFields`, the section's fields and checks on top of
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
# `Reliability` below is seven parts, in the order the loop meets them, from `SafetyNets` to
# `StepHooks`. Each hook wraps a callable chapter 01's `train()` already takes, so the loop
# itself is not edited to gain the nets.
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
# ## In-process restart, and its limits
#
# A relaunch by `torchrun` costs process start, imports, process-group set-up and the CUDA
# context — tens of seconds to minutes at scale — even when the failure was a recoverable
# error in one rank. Megatron's `--inprocess-restart` (`megatron/training/inprocess_restart.py`)
# keeps the processes: it catches the error, **aborts** the communicators, waits at a store
# barrier for the surviving ranks and calls `pretrain` again, which reloads the last
# checkpoint.
#
# <details><summary>Megatron detail: what the wrapper does</summary>
#
# NVIDIA's `nvidia_resiliency_ext.inprocess.Wrapper` catches the error; NCCL's
# `ncclCommAbort` unblocks ranks stuck in a collective; Transformer Engine and the async
# checkpoint worker are reset too; a CUDA health check runs before the barrier, which can
# swap in warm spares (`--inprocess-active-world-size`). Each attempt prefixes the `TCPStore`
# keys with its number so that stale keys of the previous attempt are never read
# (`training.py:1088-1090`).
#
# </details>
#
# `inprocess_restart` below is that loop for gloo: each attempt gets a fresh process group
# over `PrefixStore("inprocess/<attempt>/", store)`; a rank whose attempt raises a recoverable
# error destroys its group, which closes its gloo connections — a peer blocked in a collective
# with it gets a connection error at once and fails too — every rank reports its status under
# the attempt's prefix, meets the others at a store barrier, and if any failed all start the
# next attempt, which resumes from the last checkpoint like a relaunch would.
#
# Its limits are why the process restart stays the backstop:
#
# - a collective can only be interrupted where the backend lets it: gloo fails fast when a
#   peer closes its connections, NCCL needs an explicit abort; a rank stuck in a kernel or a
#   frozen host never reaches Python again and must be killed — a process restart;
# - a CUDA error such as an illegal memory access poisons the CUDA context: only a new
#   process recovers;
# - every piece of global state (RNG trackers, the rerun machine, caches, data-loader
#   workers, memory pools, signal handlers) must be torn down and rebuilt exactly, or the
#   "same" training diverges after the restart; leaks accumulate over many restarts.
#
# <details><summary>Megatron detail: a leak this page's test met</summary>
#
# Chapter 05's DDP
# registers a hook on every parameter, the hook points back to the DDP object, and the cycle
# runs through autograd's C++ side where the garbage collector cannot see it — so the failed
# attempt's process groups stayed open and the peer waited in its all-reduce for the gloo
# subgroup timeout (30 minutes). The launch script clears the parameters' hooks when an
# attempt fails (`_run._release`).
#
# </details>

# %%
def inprocess_restart(fn, *, store, rank: int, world_size: int, max_restarts: int = 1,
                      backend: str = "gloo", timeout_s: float = 60.0,
                      recoverable: tuple = (RuntimeError,)):
    """fn(attempt) in a fresh process group per attempt; a recoverable error restarts all ranks."""
    import gc
    from datetime import timedelta

    for attempt in range(max_restarts + 1):
        os.environ["TINYTRON_INPROCESS_ATTEMPT"] = str(attempt)   # the fault injector's "life"
        prefixed = dist.PrefixStore(f"inprocess/{attempt}/", store)
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            result, status = fn(attempt), "ok"
        except recoverable as e:  # noqa: PERF203 - one try per attempt
            result, status = None, f"{type(e).__name__}: {e}"
        if status != "ok":
            # Drop the failed attempt's objects (the traceback's frames hold the grid, DDP, ...)
            # so that destroying the groups really frees them and closes their connections:
            # a peer blocked in a collective with this rank fails at once instead of waiting.
            gc.collect()
            dist.destroy_process_group()
            gc.collect()
        prefixed.set(f"status/{rank}", status)
        prefixed.add("arrived", 1)
        while int(prefixed.add("arrived", 0)) < world_size:
            threading.Event().wait(0.05)
        failed = {r: prefixed.get(f"status/{r}").decode() for r in range(world_size)}
        failed = {r: v for r, v in failed.items() if v != "ok"}
        if not failed:
            return result                  # the last attempt's process group stays up
        if status == "ok":
            dist.destroy_process_group()
        if attempt == max_restarts:
            raise RuntimeError(f"in-process restart gave up after {attempt + 1} attempts: "
                               f"{failed}")


# %% [markdown]
# ## Demo: a signal, and a bad GPU through the real loop
#
# First the signal handler alone: `SIGTERM` sent to this very process is recorded, not fatal.
# Then chapter 01's `pretrain` with chapter 03's checkpoints and every hook of this page
# (`tinytron.reliability._run`, one rank): iteration 3's loss is NaN on "node-A" only. The
# first launch reproduces it in place, saves the machine's state and exits 16; the relaunch
# on "node-B" gets a finite loss and exits 17 — a persistent fault of node-A's GPU. The tests
# do the same under `torchrun` with two ranks, plus kills, hangs and signals.

# %%
if __name__ == "__main__":
    import tempfile

    from tinytron.reliability._run import run
    from tinytron.reliability.result_checks import parse_tracker_file

    with DistributedSignalHandler() as handler:
        os.kill(os.getpid(), signal.SIGTERM)
        print("after SIGTERM: still running; received =", handler.received())
        assert handler.received() and handler.received_signals == [signal.SIGTERM]

    save = tempfile.mkdtemp()
    fault = "nan@3:diagnostic=persistent_error:node=node-A"
    common = ["--save", save, "--train-iters", "4", "--save-interval", "2", "--fault", fault]
    codes = [run(common + ["--node", "node-A"]), run(common + ["--node", "node-B"])]
    for e in parse_tracker_file(os.path.join(save, "result_rejected_tracker.txt")):
        print(f"  node={e['node']} iteration={e['iteration']} status={e['status']} "
              f"result={e['result']:.4g}")
    print("exit codes:", codes, "| rerun state kept with checkpoint 2:",
          os.path.exists(rerun_state_path(save, 2, 0)))
    assert codes == [16, 17]
    statuses = [e["status"] for e in parse_tracker_file(
        os.path.join(save, "result_rejected_tracker.txt"))]
    assert statuses == ["INITIAL_RUN", "FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_NOT_REPRODUCIBLE"]
    if dist.is_initialized():
        dist.destroy_process_group()

# %% [markdown]
# ## Summary
#
# - Signals are recorded, agreed on by all ranks after the iteration, and answered with a
#   save and exit 0.
# - `torchrun --max-restarts` restarts every worker after a crash or a detected hang; each
#   resumes from the last complete checkpoint, and the losses continue bit for bit.
# - `Reliability` installs the rerun machine, the checks, the faults, the heartbeats and the
#   timers through the loop's own hooks; the machine's state rides with the exit-16 checkpoint.
# - An in-process restart skips the relaunch for errors that reach Python; hangs, frozen hosts
#   and CUDA errors still need a new process.
#
# ## How production does it
#
# - `megatron/training/dist_signal_handler.py:50`, `megatron/training/training.py:2953`
#   (`checkpoint_and_decide_exit`), `:2876` (`post_training_step_callbacks`).
# - `megatron/training/inprocess_restart.py`: `inprocess_restart` `:32`,
#   `maybe_wrap_for_inprocess_restart` `:131`, `maybe_force_nccl_backend_init` `:153`; CLI
#   `arguments.py:2201-2248`.
# - `torch.distributed.run` (`torchrun`): `--max-restarts`, `--rdzv-backend c10d`,
#   `TORCHELASTIC_RESTART_COUNT`; NVIDIA's `ft_launcher` adds the rank monitors.
#
# ## Exercises
#
# 1. A SIGTERM reaches rank 5 only, while rank 5 is inside a checkpoint save. Walk through
#    what each rank does until the job exits.
#
#    <details><summary>Hint</summary>
#
#    `_handler` only appends to `received_signals`, so the save runs to its end. After the
#    next iteration every rank joins the all-gather of `signals_received` (chapter 01's
#    `checkpoint_and_decide_exit`), sees rank 5's flag, saves and exits 0.
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
