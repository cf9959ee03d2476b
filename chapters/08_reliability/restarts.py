# %% [markdown]
# # 08 · Restarts: signals, `torchrun` and resuming
#
# [08.6](fault_tolerance.py) ended a hang with every rank exiting 18, for the launcher to
# restart the job. This page is about the two ways a job ends early on purpose and comes back:
# a **signal** from the cluster scheduler (finish the iteration, save, exit 0) and an
# **automatic restart** by the launcher after a crash or a detected hang (start again, find
# the last complete checkpoint, continue — and produce exactly the losses an uninterrupted run
# would have produced). [08.8](loop_hooks.py) then installs every net of this chapter in
# chapter 01's loop.
#
# You will build: `DistributedSignalHandler`, `init_torchrun_process_group` (each restart's
# keys under its own prefix) and `inprocess_restart`, the restart that keeps the processes.

# %%
from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["DistributedSignalHandler", "inprocess_restart", "init_torchrun_process_group"]

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
# ## What a restart costs
#
# $$t_{\text{lost}} = t_{\text{detect}} + t_{\text{restart}} + t_{\text{load}} +
#   t_{\text{redo}},\qquad \mathbb{E}[t_{\text{redo}}] = \tfrac12\,\text{save\_interval}\cdot t_{\text{iter}}$$
#
# — detection (immediate for a crash, the section timeout for a hang), process start and
# process-group set-up, the checkpoint load, and the iterations since the last save, which
# must be computed again. In small numbers — a step of 6 s, a save every 200 steps, a 90 s
# relaunch and a 60 s load (figures assumed for scale, not measured):
#
# | failure | $t_{\text{detect}}$ | $t_{\text{restart}}$ | $t_{\text{load}}$ | $\mathbb{E}[t_{\text{redo}}]$ | $t_{\text{lost}}$ |
# |---|---|---|---|---|---|
# | crash (exit, SIGKILL) | 0 s | 90 s | 60 s | ½ · 200 · 6 s = 600 s | 750 s |
# | hang (step timeout 180 s) | 180 s | 90 s | 60 s | 600 s | 930 s |
#
# The redo term dominates: saving more often shrinks it (chapter 03's asynchronous save makes
# that cheap); the in-process restart below shrinks only $t_{\text{restart}}$.
#
# "Equal to an uninterrupted run" holds only if the checkpoint carries *everything* the next
# iteration depends on ([chapter 03's resume](../03_checkpoint/resume.py)) and nothing
# depends on the process's history.

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
# ## Demo: a signal, and two attempts in one process
#
# First the signal handler alone: `SIGTERM` sent to this very process is recorded, not fatal.

# %%
if __name__ == "__main__":
    with DistributedSignalHandler() as handler:
        os.kill(os.getpid(), signal.SIGTERM)
        print("after SIGTERM: still running; received =", handler.received())
        assert handler.received() and handler.received_signals == [signal.SIGTERM]

# %% [markdown]
# Then `inprocess_restart` on a one-rank world over an in-memory store: the first attempt
# fails with the error a rank sees when a peer's connection closes, the second trains. Each
# attempt's status lies under its own prefix, so attempt 1 never reads attempt 0's keys. The
# tests run it with two ranks, one of them blocked in a collective, and run the torchrun
# restarts with kills, hangs and signals.

# %%
if __name__ == "__main__":
    store, seen = dist.HashStore(), []

    def attempt_fn(attempt: int) -> str:
        seen.append(attempt)
        if attempt == 0:
            raise RuntimeError("Connection closed by peer")   # what gloo raises
        return "trained"

    result = inprocess_restart(attempt_fn, store=store, rank=0, world_size=1, max_restarts=2)
    statuses = [dist.PrefixStore(f"inprocess/{a}/", store).get("status/0").decode()
                for a in seen]
    for a, status in zip(seen, statuses):
        print(f"attempt {a}: status = {status}")
    assert result == "trained" and seen == [0, 1]
    assert statuses == ["RuntimeError: Connection closed by peer", "ok"]
    dist.destroy_process_group()   # the last attempt's group stays up for the caller
    os.environ.pop("TINYTRON_INPROCESS_ATTEMPT")

# %% [markdown]
# ## Summary
#
# - Signals are recorded, agreed on by all ranks after the iteration, and answered with a
#   save and exit 0.
# - `torchrun --max-restarts` restarts every worker after a crash or a detected hang; each
#   resumes from the last complete checkpoint, and the losses continue bit for bit. Each
#   attempt's keys go under its own prefix of the store that outlives the workers.
# - An in-process restart skips the relaunch for errors that reach Python; hangs, frozen hosts
#   and CUDA errors still need a new process.
#
# ## How production does it
#
# - `megatron/training/dist_signal_handler.py:50`, `megatron/training/training.py:2953`
#   (`checkpoint_and_decide_exit`).
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
# 2. With the table's figures (6 s a step, a 90 s relaunch, a 60 s load), a job crashes about
#    once a day. What save interval keeps the expected time lost below 1 % of the day?
#
#    <details><summary>Answer</summary>
#
#    1 % of 86,400 s is 864 s. A crash costs $0 + 90 + 60 + \tfrac12 \cdot N \cdot 6$ s, so
#    $3N \le 714$: $N \le 238$, a save every 200 steps or fewer (the save's own time not
#    counted).
#
#    </details>
#
# 3. A person presses Ctrl-C at $t$ = 0 s; `torchrun` forwards its copy at 0.1 s; the person,
#    impatient, presses it again at 4 s and once more at 12 s. What does the handler do with
#    each of the four?
#
#    <details><summary>Answer</summary>
#
#    The first is recorded; the copies at 0.1 s and 4 s come within `absorb_s` = 10 s of the
#    first and are absorbed (recorded too); the one at 12 s is more than 10 s after the first
#    and raises `KeyboardInterrupt`. If the save begun after the first had not finished, the
#    tracker still names the last complete checkpoint.
#
#    </details>
