# %% [markdown]
# # 08 · Fault tolerance: heartbeats, section timeouts and the rank that hung
#
# A crashed rank is easy: its process exits, `torchrun` notices and restarts the job. A *hung*
# rank is the expensive failure: a stuck kernel, a dead-locked data loader or a frozen host
# stops one rank, every other rank waits for it inside the next collective, and the job burns
# the whole cluster doing nothing until the collective's timeout fires (the process-group
# timeout: Megatron's `--distributed-timeout-minutes`, 10 minutes by default) — or, for a hang
# outside any collective, forever. This page builds what Megatron gets from NVIDIA's fault-tolerance package: per-rank
# **heartbeats**, named **sections** (setup, step, checkpoint) each with its timeout, and a
# monitor that, when a timeout expires, says *which rank* hung *where*, and ends the job so
# the launcher can restart it.

# %%
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

__all__ = ["EXIT_CODE_HANG_DETECTED", "SECTIONS", "FaultToleranceConfig", "RankMonitor",
           "connect_store", "find_hung_ranks", "main_thread_position"]

# %% [markdown]
# ## Sections and timeouts
#
# Megatron's `ft_integration.py` divides a rank's life into sections (`:76-193`): `setup`
# (from process start to the first training step: imports, process groups, model build,
# checkpoint load), `step` (one `train_step`), `checkpointing` (one save, or one asynchronous
# finalization) — and the time outside any section, with its own timeout. The first
# `num_warmup_iters = 5` steps run out of section, because they include one-off work (memory
# pool growth, compilation) that would force a loose step timeout. Each rank's section events
# go to a **rank monitor**, a separate process that kills the rank when a section overruns;
# `ft_launcher` then restarts the job.
#
# The timeouts follow the job: with `--calc-ft-timeouts` the observed maxima (after at least
# 16 steps for `step`, `_MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE`) replace the initial values and are
# saved in `<save>/ft_state.json` for the next launch (`_maybe_update_timeouts`, `:244`).
#
# For the running example (7B, 256 GPUs) a step takes about 2 s: 07.13's model predicts 1.94 s,
# 41% MFU by chapter 01's count ($2.0 \cdot 10^{17}$ FLOPs per iteration over 256 × 989 TFLOP/s
# × 1.94 s); a step
# timeout of one minute — 30 steps — catches a hang 9 minutes before a 10-minute collective
# timeout would: 38 GPU-hours saved per hang at 256 GPUs, about 2 500 at 16 384.

# %%
EXIT_CODE_HANG_DETECTED = 18  # tinytron's own; Megatron leaves hangs to the FT launcher
SECTIONS = ("setup", "step", "checkpoint")


@dataclass
class FaultToleranceConfig:
    """Heartbeat and section-timeout settings (seconds)."""

    setup_timeout: float = 600.0
    """From process start to the first training step."""
    step_timeout: float = 180.0
    """One train_step, after the warm-up steps."""
    checkpoint_timeout: float = 600.0
    """One save (or one async finalization)."""
    out_of_section_timeout: float = 600.0
    """Time outside any section (warm-up steps, logging, evaluation)."""
    num_warmup_iters: int = 5
    """Steps that run out of section (Megatron's --ft-num-warmup-iters)."""
    heartbeat_interval: float = 1.0
    """How often each rank's monitor beats and checks the others."""
    heartbeat_timeout: float = 30.0
    """A rank whose beat stops this long is frozen or dead."""
    report_path: Optional[str] = None
    """Where the verdict is also written (a file a job scheduler can read)."""

    def __post_init__(self):
        for name in ("setup_timeout", "step_timeout", "checkpoint_timeout",
                     "out_of_section_timeout", "heartbeat_interval", "heartbeat_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ValueError(f"heartbeat_interval ({self.heartbeat_interval}) must be below "
                             f"heartbeat_timeout ({self.heartbeat_timeout})")

    def timeout(self, section: Optional[str]) -> float:
        """The timeout of a section (None = out of section)."""
        return {None: self.out_of_section_timeout, "setup": self.setup_timeout,
                "step": self.step_timeout, "checkpoint": self.checkpoint_timeout}[section]


# %% [markdown]
# ## Telling the hung rank from the ranks that wait for it
#
# When rank 1 hangs inside step 7, rank 0 soon blocks in step 7's gradient all-reduce: *both*
# overrun the step timeout. A monitor that only sees "rank 0: step open for 200 s" blames
# every rank. Two more facts, published with each heartbeat, separate them:
#
# - **is the process alive?** A small thread in every rank beats every `heartbeat_interval`.
#   A frozen process (`SIGSTOP`, a host that stopped scheduling it) stops beating; a rank
#   blocked in a collective or stuck in Python keeps beating.
# - **where is its main thread?** The same thread reads the main thread's Python stack
#   (`sys._current_frames`) and publishes the innermost frame and whether any frame is inside
#   `torch.distributed`. A rank *waiting in a collective* is a victim; a rank over time
#   *outside* any collective is the culprit.
#
# | rank | beat | section (age) | main thread | verdict |
# |---|---|---|---|---|
# | 0 | fresh | step 7 (200 s) | `distributed_c10d.py: all_reduce` | waiting |
# | 1 | fresh | step 7 (201 s) | `loader.py:88 in next` | **hung in step** |
# | 2 | 45 s old | step 7 | — | **frozen** |
#
# The stack test is exact on gloo, whose collectives block the calling thread inside
# `torch.distributed` until every rank has joined. It is not on GPUs: an NCCL collective
# returns as soon as its kernel is *enqueued* on the stream, so a rank waiting for a hung
# peer leaves `torch.distributed` at once and blocks later, on the host, wherever it first
# needs a result — a `.item()` on the loss, a `torch.cuda.synchronize()`, the next
# collective's stream wait — and its stack says "busy", like the culprit's. So the verdict
# rests first on **progress**: each report carries how far the rank got — the iteration, the
# number of sections it has opened, and `marks`, a counter the loop bumps around every
# micro-batch's forward step (`RankMonitor.mark`, called by `Reliability.forward_step_func`).
# When the live ranks are not level, the ones furthest behind are what the others wait for
# (a rank that never issued the collective the others issued is behind by construction),
# wherever each main thread sits. Only when every rank is at the same point does the stack
# decide (exact on gloo; under NCCL it then blames all the late ranks, which is still the
# truth when, say, the network itself hung). Ranks in one pipeline are not level within a
# step by design (1F1B runs stage 0 ahead), so with PP > 1 the marks can blame a later stage
# that waits in a receive for a hung earlier one; the section and iteration still name the
# step. PyTorch's NCCL flight recorder answers the same question one layer down: per rank,
# the collectives it entered (last section of this page).
#
# Ages are measured by the *observer's* clock from when it first saw a value change, so hosts
# need not agree on the time. Heartbeats travel through the job's key-value store (the
# `TCPStore` every `torch.distributed` job already has), each rank under its own key, so the
# training loop itself never touches the network for them: it only updates a dict in memory.

# %%
def main_thread_position() -> tuple[str, bool]:
    """('file:line in function' of the main thread's innermost frame, inside torch.distributed?)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "?", False
    code = frame.f_code
    where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
    in_collective = False
    marker = os.sep.join(("torch", "distributed", ""))
    while frame is not None:
        if marker in frame.f_code.co_filename:
            in_collective = True
            break
        frame = frame.f_back
    return where, in_collective


# %% [markdown]
# The verdict: frozen ranks first, then — if the live ranks are not level — the ones behind;
# only when they are level, the ranks whose main thread is outside a collective.
#
# The middle of that rule on its own: among the live ranks, who is busy (the culprits), who
# waits, and how the waiting ones wait.

# %%
def _progress(report: dict) -> tuple[int, int, int]:
    """How far a rank got: (iteration, sections opened, progress marks within them)."""
    return report["iteration"], report.get("section_seq", 0), report.get("marks", 0)


def _blame(reports: dict[int, dict], frozen: list[int]) -> tuple[list, list, str]:
    """(busy ranks, waiting ranks, how they wait) among the live ranks."""
    # If the live ranks are not all at the same point, the ones behind
    # are what the others wait for, wherever each main thread happens to block (NCCL returns
    # from a collective at once; the wait shows up later, in a host sync).
    alive = [r for r in reports if r not in frozen]
    progress = {r: _progress(reports[r]) for r in alive}
    behind = min(progress.values(), default=None)
    if len(set(progress.values())) > 1:
        busy = [r for r in alive if progress[r] == behind]
        waiting = [r for r in alive if progress[r] != behind]
        how = ("waiting for it in a collective" if all(reports[r]["in_collective"] for r in waiting)
               else "waiting for it, further along the step")
    elif frozen:   # the live ranks are level: they wait for the silent one
        busy, waiting = [], alive
        how = ("waiting for it in a collective" if all(reports[r]["in_collective"] for r in alive)
               else "waiting for it")
    else:   # all at one point: only the main threads' stacks can tell (exact on gloo)
        busy = [r for r in alive if not reports[r]["in_collective"]]
        waiting = [r for r in alive if reports[r]["in_collective"]]
        how = "waiting for it in a collective"
    return busy, waiting, how


# %% [markdown]
# The verdict itself: nobody over time means no verdict; otherwise one line per frozen rank,
# one per busy rank (or, when nobody is busy, per late rank), and who waits for them.

# %%
def find_hung_ranks(reports: dict[int, dict], ages: dict[int, tuple[float, float]],
                    config: FaultToleranceConfig) -> Optional[str]:
    """A verdict naming the hung rank(s) and section, or None if every rank is within time.

    `reports[r]` is rank r's last published state; `ages[r] = (seconds since its beat last
    changed, seconds since its section last changed)`, both by the observer's clock.
    """
    frozen = [r for r, (beat_age, _) in ages.items() if beat_age > config.heartbeat_timeout]
    late = [r for r, (_, sec_age) in ages.items()
            if r not in frozen and sec_age > config.timeout(reports[r]["section"])]
    if not frozen and not late:
        return None
    busy, waiting, how = _blame(reports, frozen)   # someone is over time: who is to blame
    lines = []
    for r in frozen:
        rep = reports[r]
        lines.append(f"rank {r} stopped beating {ages[r][0]:.1f} s ago "
                     f"(> heartbeat_timeout {config.heartbeat_timeout:g} s), last seen in section "
                     f"{rep['section']!r} at iteration {rep['iteration']} (frozen or dead)")
    for r in busy if (busy or frozen) else late:
        rep = reports[r]
        lines.append(f"rank {r} hung in section {rep['section']!r} at iteration "
                     f"{rep['iteration']} ({ages[r][1]:.1f} s in it, timeout "
                     f"{config.timeout(rep['section']):g} s); main thread at {rep['where']}")
    if waiting and (busy or frozen):
        lines.append(f"{how}: ranks {waiting}")
    return "hang detected: " + "; ".join(lines)


# %% [markdown]
# ## The rank monitor
#
# `RankMonitor` is the per-rank client with Megatron's hook names: `setup` opens when it
# starts, `on_training_step_start/end` bracket each step (the first call closes `setup`; steps
# after the warm-up open the `step` section), `on_checkpointing_start/end` bracket a save. Its
# daemon thread beats, reads every rank's report, and when `find_hung_ranks` returns a verdict
# it writes the verdict once to the store (`compare_set`: the first monitor to see the hang
# wins), prints it, writes it to `report_path`, and exits the process with
# `EXIT_CODE_HANG_DETECTED`. Every rank's monitor sees the same verdict, so the whole job ends
# within one heartbeat interval of the timeout — and `torchrun` restarts it.
#
# The store is a separate client connection (keys prefixed by the restart attempt, so a
# restarted job never reads the previous life's beats); losing it for `heartbeat_timeout`
# (the rank hosting it died) also ends the rank.
#
# The demo below, as a sequence: rank 1's main thread hangs inside step 3, rank 0's waits for
# it in the all-reduce, and only the monitor threads keep talking to the store.
#
# ```mermaid
# sequenceDiagram
#   participant M0 as rank 0 main
#   participant T0 as rank 0 monitor
#   participant S as job's TCPStore
#   participant T1 as rank 1 monitor
#   participant M1 as rank 1 main
#   M0->>T0: step_start(3):<br/>section "step" opens
#   M1->>T1: step_start(3):<br/>section "step" opens
#   Note over M1: injected hang:<br/>never returns
#   Note over M0: all_reduce of<br/>step 3 waits<br/>for rank 1
#   loop every heartbeat_interval
#     T0->>S: set rank0:<br/>beat+1, step,<br/>in_collective
#     T1->>S: set rank1:<br/>beat+1, step,<br/>at_step_start
#     S-->>T0: every report,<br/>aged by<br/>T0's clock
#     S-->>T1: every report,<br/>aged by<br/>T1's clock
#   end
#   Note over T0,T1: beats stay fresh, but step 3<br/>is open longer than step_timeout
#   Note over T0: find_hung_ranks:<br/>rank 1 late outside<br/>any collective (culprit),<br/>rank 0 in all_reduce<br/>(waiting)
#   T0->>S: compare_set(<br/>"verdict", "",<br/>"rank 1 hung ...")
#   Note over S: the first<br/>verdict wins
#   S-->>T1: the same verdict
#   T0->>M0: os._exit(18)
#   T1->>M1: os._exit(18)
#   Note over M0,M1: every rank exits with EXIT_CODE_HANG_DETECTED (18),<br/>the launcher restarts the job
# ```
#
# A frozen rank (`SIGSTOP`) is the other branch of the same loop: its monitor thread stops too,
# so its beat ages past `heartbeat_timeout` and the verdict says "stopped beating".
#
# The client first: a store connection of its own, and the state that the main thread writes
# and the monitor thread reads, guarded by one lock.
#
# The monitor is six whole parts, each a small class: `MonitorState` (its fields and the
# lock), `Sections` and `LoopHooks` (what the training loop calls), `Reports` and
# `MonitorThread` (the background loop) and `JobEnd` (agreeing the verdict and leaving);
# `RankMonitor` after them is the six together. The main thread only ever touches `Sections`
# and `LoopHooks`, the thread only `Reports`, `MonitorThread` and `JobEnd`, and the two meet
# in `MonitorState` under its lock.

# %%
def connect_store(prefix: str, timeout_s: float):
    """A fresh client of the job's TCPStore (MASTER_ADDR/MASTER_PORT), under `prefix`."""
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(prefix, store)


class MonitorState:
    """The monitor's shared state: this rank's report, every rank's last-seen values, the lock."""

    def __init__(self, config: FaultToleranceConfig, rank: int, world_size: int, store=None,
                 attempt: Optional[int] = None, exit_fn: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic):
        self.config, self.rank, self.world_size = config, rank, world_size
        if attempt is None:
            from tinytron.reliability.fault_injection import restart_attempt
            attempt = restart_attempt()
        self.store = store or connect_store(f"tinytron_ft/{attempt}/", config.heartbeat_timeout)
        self.exit_fn, self.clock = exit_fn, clock
        self._lock = threading.Lock()
        self._mine = {"section": None, "section_seq": 0, "iteration": 0, "beat": 0, "marks": 0}
        self._seen: dict[int, dict] = {}   # observer bookkeeping per rank
        self._steps_seen = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.verdict: Optional[str] = None
        self.section_times: dict[str, float] = {}  # longest observed duration per section


# %% [markdown]
# The hooks the training loop calls. Each one only rewrites `_mine` under the lock (a new
# section, a new `section_seq`) and records how long the closed section lasted: the loop
# never waits on the network for fault tolerance.

#
# First the one move underneath them all, `_open`, and the checkpoint section built on it.

# %%
class Sections:
    """Open a section (closing the previous one and timing it); the checkpoint section."""

    def _open(self, section: Optional[str]) -> None:
        with self._lock:
            old, since = self._mine["section"], self._mine.get("opened", self.clock())
            if old is not None:
                self.section_times[old] = max(self.section_times.get(old, 0.0),
                                              self.clock() - since)
            self._mine.update(section=section, section_seq=self._mine["section_seq"] + 1,
                              opened=self.clock())

    def on_checkpointing_start(self) -> None:
        """Open the checkpoint section."""
        self._open("checkpoint")

    def on_checkpointing_end(self) -> None:
        """Close the checkpoint section."""
        self._open(None)

    @contextlib.contextmanager
    def section(self, name: str):
        """`with monitor.section("checkpoint"): ...`"""
        if name not in SECTIONS:
            raise ValueError(f"section must be one of {SECTIONS}, got {name!r}")
        self._open(name)
        try:
            yield
        finally:
            self._open(None)


# %% [markdown]
# Then the loop's side: start the monitor, bracket each step (the `step` section only after
# the warm-up), mark progress, and stop.

# %%
class LoopHooks:
    """What the training loop calls: start, bracket steps, mark progress, wait, shut down."""

    def start(self) -> "RankMonitor":
        """Open the setup section and start beating."""
        self._open("setup")
        self._thread = threading.Thread(target=self._run, name="tinytron-rank-monitor",
                                        daemon=True)
        self._thread.start()
        return self

    def on_training_step_start(self, iteration: int) -> None:
        """Close setup (first step); open the step section once past the warm-up."""
        self._steps_seen += 1
        with self._lock:
            self._mine["iteration"] = iteration
        self._open("step" if self._steps_seen > self.config.num_warmup_iters else None)

    def on_training_step_end(self) -> None:
        """Close the step section."""
        self._open(None)

    def mark(self) -> None:
        """A progress point inside a section (the loop calls it around each micro-batch)."""
        with self._lock:
            self._mine["marks"] += 1

    def wait_for_verdict(self) -> None:
        """After a failed collective: up to heartbeat_timeout for a hang verdict to end us."""
        if self._thread is not None:  # none came: the caller re-raises its error
            self._thread.join(timeout=self.config.heartbeat_timeout)

    def shutdown(self) -> None:
        """Stop beating (end of training)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.config.heartbeat_interval)


# %% [markdown]
# The monitor thread: every `heartbeat_interval` it publishes this rank's report (beat,
# section, main-thread position), reads every rank's report, and ages each value by its own
# clock from the moment it last saw it change. A verdict, its own or one already in the
# store, ends the loop; so does losing the store for longer than `heartbeat_timeout`.

# %%
class Reports:
    """Publish this rank's report; read and age every rank's, and judge."""

    def _publish(self) -> None:
        where, in_collective = main_thread_position()
        with self._lock:
            self._mine["beat"] += 1
            report = dict(self._mine, where=where, in_collective=in_collective)
        report.pop("opened", None)
        self.store.set(f"rank{self.rank}", json.dumps(report))

    def _observe(self) -> Optional[str]:
        """Read every rank's report, update the ages by my clock, judge."""
        now, reports, ages = self.clock(), {}, {}
        for r in range(self.world_size):
            key = f"rank{r}"
            if not self.store.check([key]):
                continue  # not started yet: covered by the setup timeout of those that did
            rep = json.loads(self.store.get(key))
            seen = self._seen.setdefault(r, {"beat": -1, "sec": -1, "beat_t": now, "sec_t": now})
            if rep["beat"] != seen["beat"]:
                seen.update(beat=rep["beat"], beat_t=now)
            if rep["section_seq"] != seen["sec"]:
                seen.update(sec=rep["section_seq"], sec_t=now)
            reports[r], ages[r] = rep, (now - seen["beat_t"], now - seen["sec_t"])
        return find_hung_ranks(reports, ages, self.config)


# %% [markdown]
# The loop of the thread around those two. A failing store is forgiven for
# `heartbeat_timeout` seconds; past that, losing it is the verdict.

# %%
class MonitorThread:
    """The background thread: every beat, publish, observe, and end the job on a verdict."""

    def _run(self) -> None:
        last_contact = self.clock()
        while not self._stop.wait(self.config.heartbeat_interval):
            try:
                self._publish()
                verdict = self._observe()
                if verdict is None and self.store.check(["verdict"]):
                    verdict = self.store.get("verdict").decode().partition("|")[2]
                last_contact = self.clock()
            except Exception as e:  # noqa: BLE001 - a lost store is itself a verdict
                if self.clock() - last_contact <= self.config.heartbeat_timeout:
                    continue
                verdict = f"rank {self.rank} lost the job's store for > " \
                          f"{self.config.heartbeat_timeout:g} s ({type(e).__name__}): " \
                          f"the rank hosting it is dead or frozen"
            if verdict is not None:
                self._end(verdict)
                return


# %% [markdown]
# Ending the job: the verdict is agreed once through the store (`compare_set` keeps the first
# one written), written to `report_path` by a hard link that only the first rank can create,
# printed by its owner, and then every rank exits with `EXIT_CODE_HANG_DETECTED`.

# %%
class JobEnd:
    """Agree the verdict once through the store, write the report, exit with the hang code."""

    def _end(self, verdict: str) -> None:
        owner = str(self.rank)
        with contextlib.suppress(Exception):
            stored = self.store.compare_set("verdict", "", f"{self.rank}|{verdict}").decode()
            owner, _, verdict = stored.partition("|")
        self.verdict = verdict
        if self.config.report_path:  # every rank tries; the first file written stays
            with contextlib.suppress(OSError):
                tmp = f"{self.config.report_path}.{self.rank}.tmp"
                with open(tmp, "w") as f:
                    f.write(verdict + "\n")
                try:
                    os.link(tmp, self.config.report_path)   # fails if it exists: first wins
                finally:
                    os.unlink(tmp)
        if owner == str(self.rank):  # the first monitor to see the hang prints it
            print(f"[rank monitor {self.rank}] {verdict}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        # Linger two beats so the other monitors read the verdict before this process (which
        # may host the store) goes away.
        self._stop.wait(2 * self.config.heartbeat_interval)
        self.exit_fn(EXIT_CODE_HANG_DETECTED)


class RankMonitor(JobEnd, MonitorThread, Reports, LoopHooks, Sections, MonitorState):
    """Per-rank heartbeats and section timeouts; ends the job when a rank hangs."""

# %% [markdown]
# ## Demo: rank 1 hangs in step 3
#
# Two gloo ranks run a data-parallel loop under a `RankMonitor` with a 1.5 s step timeout (no
# warm-up steps, beats every 0.2 s). At iteration 3 the fault injector makes rank 1's main
# thread sleep forever; rank 0 reaches the all-reduce and waits. The monitors find the hang,
# every rank exits with code 18, and the verdict file names the rank, the section, the
# iteration and the line where rank 1's main thread is stuck.
#
# Who leaves first is a race. If rank 1's monitor ends its process before rank 0's monitor
# has read the verdict, rank 0's all-reduce fails at once ("connection closed by peer") and
# its main thread would end the rank with that error, not code 18. So the demo's loop catches
# the collective's error and calls `wait_for_verdict`: rank 0's monitor then has up to
# `heartbeat_timeout` to read the verdict and end the process with the hang code. The trainer
# does not need to: under torchrun the agent stops every other rank as soon as one exits, so
# the job ends either way, its verdict in the report (`tests/test_reliability_restart.py`).

# %%
if __name__ == "__main__":
    import tempfile

    from tinytron.launch import RankError, run_on_ranks
    from tinytron.reliability._workers import hang_job

    report = os.path.join(tempfile.mkdtemp(), "hang.txt")
    ft = dict(step_timeout=1.5, num_warmup_iters=0, heartbeat_interval=0.2,
              heartbeat_timeout=5.0, report_path=report)
    t0 = time.monotonic()
    try:
        run_on_ranks(hang_job, 2, 5, ["hang@3:rank=1"], ft, timeout=60)
        raise AssertionError("the job should not have finished")
    except RankError as e:
        codes = {r: msg for r, msg in e.failures.items()}
    took = time.monotonic() - t0
    verdict = open(report).read().strip()
    print(verdict)
    print(f"job ended {took:.1f} s after launch; rank exits: {codes}")
    assert "rank 1 hung in section 'step' at iteration 3" in verdict
    assert "at_step_start" in verdict and "waiting for it in a collective: ranks [0]" in verdict
    assert all(f"code {EXIT_CODE_HANG_DETECTED}" in m for m in codes.values())

# %% [markdown]
# The other branch, without a job: two reports by hand, rank 1's beat 31 s old against a
# 30 s heartbeat timeout, rank 0 waiting in an all-reduce.

# %%
if __name__ == "__main__":
    cfg = FaultToleranceConfig(step_timeout=10, heartbeat_timeout=30)
    frozen = find_hung_ranks({0: {"section": "step", "iteration": 9, "in_collective": True,
                                  "where": "distributed_c10d.py:2800 in all_reduce"},
                              1: {"section": "step", "iteration": 9, "in_collective": False,
                                  "where": "x.py:1 in f"}},
                             {0: (0.1, 12.0), 1: (31.0, 12.0)}, cfg)
    print(frozen)
    assert frozen.startswith("hang detected: rank 1 stopped beating 31.0 s ago")
    assert frozen.endswith("waiting for it in a collective: ranks [0]")

# %% [markdown]
# ## Summary
#
# - Sections (setup, step, checkpoint, and out-of-section time) each get a timeout; the first
#   steps run out of section.
# - A beat from a side thread says *alive*; progress marks say *how far*; the rank behind the
#   others, or silent, is the one that hung — the others wait for it. When all are level,
#   the main thread's stack decides (exact on gloo; NCCL returns from collectives at once).
# - The verdict is agreed through the job's store, written where a scheduler can read it, and
#   every rank exits so that the launcher restarts the job (next page).
#
# ## How production does it
#
# - `megatron/training/ft_integration.py`: `setup` `:76`, `on_training_step_start/end`
#   `:121/:136`, `on_checkpointing_start/end` `:169/:176`, `on_checkpoint_loaded` `:193`,
#   `shutdown` `:207`, `_maybe_update_timeouts` `:244`; CLI `arguments.py:2278-2292`.
# - NVIDIA `nvidia-resiliency-ext`: `fault_tolerance.RankMonitorClient` (the client) and a rank
#   monitor *process* per rank that enforces the timeouts and signals the rank; `ft_launcher`
#   (a `torchrun` derivative) restarts the workers. A separate process sees a hang even when
#   the rank holds the GIL forever — a thread, as here, does not.
# - PyTorch's NCCL watchdog (`TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`) and flight recorder
#   (`TORCH_NCCL_TRACE_BUFFER_SIZE`) dump which collectives each rank had entered: the same
#   "who waits for whom" question, one layer down.
#
# ## Exercises
#
# 1. A rank spins in pure Python without releasing the GIL. Which of this page's signals still
#    work, and which does Megatron's separate monitor process add?
#
#    <details><summary>Hint</summary>
#
#    Every signal of this page comes from `MonitorThread`, a
#    thread of the same process: it needs the GIL to beat. Ask what the *other* ranks'
#    monitors then see of this rank's beat (`find_hung_ranks`, the frozen branch), and who
#    can still end this rank. A monitor in its own process keeps its own GIL, and can signal
#    the stuck rank from outside.
#
#    </details>
#
# 2. With `--calc-ft-timeouts`, why is the step timeout only updated after 16 steps, and why
#    is the checkpoint timeout not updated when saves are asynchronous?
#
#    <details><summary>Hint</summary>
#
#    Look at `_maybe_update_timeouts` in Megatron's
#    `ft_integration.py`, and at what the first steps contain that later ones do not (warm-up,
#    first allocations, the first collectives). For the second half: how long does the `checkpoint` section last when the
#    save only hands its tensors to a background writer, and what would a timeout computed
#    from that do to the next synchronous save?
#
#    </details>
