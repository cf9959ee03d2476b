# %% [markdown]
# # 08 · Timers: where the iteration's time goes, on the slowest rank and the fastest
#
# "The step takes 9 s" is not actionable; "forward-backward takes 7.1 s on the fastest rank and
# 8.8 s on the slowest, the optimizer 0.4 s everywhere" is: one rank is a straggler, and it
# straggles in compute. Megatron's timers are named stopwatches at three levels of detail, read
# out as the **minimum and maximum over all ranks**. This page builds them with Megatron's
# names, levels and output format, and shows a deliberate straggler on a real two-rank world.

# %%
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["TIMER_LEVELS", "TIMER_PARENT", "DummyTimer", "Timer", "Timers"]

# %% [markdown]
# ## Names and levels
#
# A timer is created at a **level**; `--timing-log-level L` (0, 1 or 2; default 0) keeps the
# timers of level $\le L$ and turns every other one into a shared `DummyTimer` whose methods do
# nothing, so that an instrumented line costs a dictionary lookup when it is off
# (`megatron/core/timers.py:217,241`). The levels form a hierarchy — each level splits a
# coarser one:
#
# ```mermaid
# flowchart LR
#   IT["interval-time (0)"] --> FB["forward-backward (1)"]
#   IT --> OPT["optimizer (1)"]
#   FB --> BG["batch-generator (2)"]
#   FB --> FC["forward-compute (2)"]
#   FB --> BC["backward-compute (2)"]
#   FB --> AGS["all-grads-sync (1)"]
#   OPT --> O1["optimizer-copy-to-main-grad (1)"]
#   OPT --> O2["optimizer-unscale-and-check-inf (1)"]
#   OPT --> O3["optimizer-clip-main-grad (1)"]
#   OPT --> O4["optimizer-inner-step (1)"]
#   OPT --> O5["optimizer-copy-main-to-model-params (1)"]
# ```
#
# Level 0 also holds the rare events: `load-checkpoint`, `save-checkpoint`,
# `model-and-optimizer-setup`, `evaluate`. A timer requested without a level gets level 2.
#
# ## What a reading means
#
# `Timer.start`/`stop` read the wall clock; on CUDA they first call
# `torch.cuda.synchronize()`, otherwise the clock would stop when the *launch* returns, not when
# the kernels finish. `barrier=True` first waits for every rank of the group, so that the time
# measured is this phase's own, not the wait for a late rank (`Timer`, `:109`).
#
# The report is a **collective**: each rank writes its elapsed seconds into its row of a
# `[world, names]` tensor, one all-gather fills every row, and per name the min and max are
# taken over the ranks whose value is **not zero** (a rank that never ran `embedding-grads-all-reduce`
# — not a pipeline end — must not make the minimum 0). Values are divided by `normalizer`
# (`log_interval`, to get a per-iteration average) and printed in **ms** on the last rank
# (`_get_elapsed_time_all_ranks` `:270`, `log` `:422`). Every rank must ask for the same names
# in the same order, or the gather mixes columns.
#
# Worked example: 2 ranks, `log_interval = 4`; rank 0 spent 2.0 s in `forward-backward` over the
# 4 iterations, rank 1 (the straggler) 3.2 s; only rank 1 ran `embedding-grads-all-reduce`
# (0.04 s). The report: `forward-backward: (500.00, 800.00)` ms and
# `embedding-grads-all-reduce: (10.00, 10.00)` ms — not `(0.00, 10.00)`.

# %%
TIMER_LEVELS: dict[str, int] = {
    "interval-time": 0, "load-checkpoint": 0, "save-checkpoint": 0,
    "model-and-optimizer-setup": 0, "train/valid/test-data-iterators-setup": 0, "evaluate": 0,
    "forward-backward": 1, "all-grads-sync": 1, "embedding-grads-all-reduce": 1,
    "non-tensor-parallel-grads-all-reduce": 1, "params-all-gather": 1, "optimizer": 1,
    "optimizer-copy-to-main-grad": 1, "optimizer-unscale-and-check-inf": 1,
    "optimizer-clip-main-grad": 1, "optimizer-count-zeros": 1, "optimizer-inner-step": 1,
    "optimizer-copy-main-to-model-params": 1,
    "batch-generator": 2, "forward-compute": 2, "backward-compute": 2,
}
TIMER_PARENT: dict[str, str] = {
    "forward-backward": "interval-time", "optimizer": "interval-time",
    "batch-generator": "forward-backward", "forward-compute": "forward-backward",
    "backward-compute": "forward-backward", "all-grads-sync": "forward-backward",
    **{n: "optimizer" for n in TIMER_LEVELS if n.startswith("optimizer-")},
}


class DummyTimer:
    """What a timer above the configured level becomes: every call does nothing."""

    def start(self, barrier: bool = False) -> None:
        """Nothing."""

    def stop(self, barrier: bool = False) -> None:
        """Nothing."""

    def reset(self) -> None:
        """Nothing."""

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """A disabled timer has no reading."""
        raise RuntimeError("a timer above --timing-log-level was read; raise the level to time it")

    def active_time(self) -> float:
        """A disabled timer has no reading."""
        raise RuntimeError("a timer above --timing-log-level was read; raise the level to time it")


# %% [markdown]
# The real stopwatch keeps two sums: `elapsed` since the last reset (what a report reads and
# clears) and `active_time` since creation (never cleared). Reading a running timer stops it,
# reads it and starts it again, so a report may come in the middle of a phase.
#
# The readings first, as a small base class: reset, read (and maybe reset) the elapsed sum,
# read the active time.

# %%
class _Readings:
    """The two sums of a stopwatch, read and reset."""

    def reset(self) -> None:
        """Zero the elapsed time (not the active time)."""
        self._elapsed, self._started = 0.0, False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds so far; a running timer is read and keeps running."""
        running = self._started
        if running:
            self.stop(barrier=barrier)
        value = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start(barrier=barrier)
        return value

    def active_time(self) -> float:
        """Seconds accumulated since creation."""
        return self._active_time


# %% [markdown]
# Then the stopwatch: `start` and `stop` synchronize first (a barrier if asked, the CUDA
# device if there is one), so the interval covers the kernels and not only their launch.

# %%
class Timer(_Readings):
    """A named stopwatch: accumulates elapsed seconds between start and stop."""

    def __init__(self, name: str, group=None):
        self.name, self.group = name, group
        self._elapsed = 0.0        # since the last reset
        self._active_time = 0.0    # since creation, never reset
        self._started = False
        self._start_time = 0.0

    def _sync(self, barrier: bool) -> None:
        if barrier and dist.is_initialized():
            dist.barrier(group=self.group)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # time the kernels, not their launch

    def start(self, barrier: bool = False) -> None:
        """Start the stopwatch (it must be stopped)."""
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        self._sync(barrier)
        self._start_time, self._started = time.perf_counter(), True

    def stop(self, barrier: bool = False) -> None:
        """Stop it and add the interval."""
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started")
        self._sync(barrier)
        interval = time.perf_counter() - self._start_time
        self._elapsed += interval
        self._active_time += interval
        self._started = False


# %% [markdown]
# ## The registry and the cross-rank report
#
# `Timers(log_level, log_option)` hands out timers by name; `log_option` picks the report:
# `minmax` (default), `max`, or `all` (every rank's value). `get_min_max` returns the numbers,
# `log` the text Megatron prints, `write` sends the max of each to TensorBoard as
# `<name>-time` (`write`, `:452`). `stragglers` adds what `minmax` hides: *which* rank was
# fastest and slowest.
#
# `Timers` is five whole parts, each a small class: `TimerRegistry` hands out timers by name
# and level, `CrossRankTimes` gathers every rank's seconds in one all-gather, `Stragglers`
# names the fastest and slowest rank, `TimerReports` writes Megatron's text and
# `TimerOutputs` prints it and sends TensorBoard scalars; the class `Timers` after the last
# part is the five together.
#
# A worked example in small numbers: two ranks, `forward-backward` took 0.812 s on rank 0 and
# 1.130 s on rank 1. The all-gather builds the $2 \times 1$ table `[[0.812], [1.130]]`;
# `get_min_max` gives `(812.0, 1130.0)` ms, the 318 ms gap that says one rank waits; with
# `normalizer = 4` (four iterations timed together) it gives `(203.0, 282.5)` per iteration.
# `stragglers` adds the names: `(0, 812.0, 1, 1130.0)`, rank 1 is the slow one. A rank that
# never started a timer contributes 0 and is left out of both, so a timer only the last
# pipeline stage runs is not reported with a minimum of 0.

# %%
class TimerRegistry:
    """Timers by name and level: a real Timer up to the configured level, a DummyTimer above it."""

    _MAX_LEVEL = 2

    def __init__(self, log_level: int = 0, log_option: str = "minmax", group=None):
        if log_level not in (0, 1, 2):
            raise ValueError(f"timing_log_level must be 0, 1 or 2, got {log_level}")
        if log_option not in ("minmax", "max", "all"):
            raise ValueError(f"timing_log_option must be minmax, max or all, got {log_option!r}")
        self.log_level, self.log_option, self.group = log_level, log_option, group
        self._timers: dict[str, Timer] = {}
        self._levels: dict[str, int] = {}
        self._dummy = DummyTimer()

    def __call__(self, name: str, log_level: Optional[int] = None):
        """The timer `name` (a DummyTimer if its level is above the configured one)."""
        if name in self._timers:
            if log_level is not None and log_level != self._levels[name]:
                raise ValueError(f"timer {name!r} was created at level {self._levels[name]}, "
                                 f"requested at level {log_level}")
            return self._timers[name]
        level = TIMER_LEVELS.get(name, self._MAX_LEVEL) if log_level is None else log_level
        if level > self.log_level:
            return self._dummy
        self._timers[name] = Timer(name, self.group)
        self._levels[name] = level
        return self._timers[name]


# %% [markdown]
# The cross-rank numbers: one all-gather builds the `[world, names]` table of seconds, and the
# min and max (or the fastest and slowest rank) are taken per column over the ranks that ran
# that timer. Every rank calls these with the same names, in the same order.

# %%
class CrossRankTimes:
    """One all-gather of every rank's seconds; min/max (or fastest/slowest rank) per timer."""

    def all_ranks_seconds(self, names: list[str], reset: bool = True,
                          barrier: bool = False) -> torch.Tensor:
        """[world, len(names)] elapsed seconds (0 where a rank has no such timer); collective."""
        if barrier and dist.is_initialized():
            dist.barrier(group=self.group)
        row = torch.tensor([self._timers[n].elapsed(reset=reset) if n in self._timers else 0.0
                            for n in names], dtype=torch.float64)
        if not dist.is_initialized():
            return row.unsqueeze(0)
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        rows = [torch.empty_like(row, device=device)
                for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, row.to(device), group=self.group)
        return torch.stack(rows).cpu()

    def get_min_max(self, names: list[str], normalizer: float = 1.0, reset: bool = True,
                    barrier: bool = False) -> dict[str, tuple[float, float]]:
        """{name: (min ms, max ms)} over the ranks that ran it (zeros ignored)."""
        if normalizer <= 0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        table = self.all_ranks_seconds(names, reset, barrier)
        out = {}
        for i, name in enumerate(names):
            ran = table[:, i][table[:, i] > 0]
            if ran.numel():
                out[name] = (ran.min().item() * 1000.0 / normalizer,
                             ran.max().item() * 1000.0 / normalizer)
        return out


# %% [markdown]
# The same table read for names instead of numbers: which rank was fastest and which slowest
# for each timer, again over the ranks that ran it.

# %%
class Stragglers:
    """{name: (fastest rank, its ms, slowest rank, its ms)} from the same all-gather."""

    def stragglers(self, names: list[str], normalizer: float = 1.0, reset: bool = True
                   ) -> dict[str, tuple[int, float, int, float]]:
        """{name: (fastest rank, its ms, slowest rank, its ms)} over the ranks that ran it."""
        table = self.all_ranks_seconds(names, reset) * 1000.0 / normalizer
        out = {}
        for i, name in enumerate(names):
            col = table[:, i].masked_fill(table[:, i] <= 0, float("nan"))
            if not torch.isnan(col).all():
                lo = int(torch.where(torch.isnan(col), float("inf"), col).argmin())
                hi = int(torch.where(torch.isnan(col), float("-inf"), col).argmax())
                out[name] = (lo, col[lo].item(), hi, col[hi].item())
        return out


# %% [markdown]
# The outputs: Megatron's report text (`minmax`, `max` or `all`), printed on the last rank by
# default, and the max of each timer sent to TensorBoard as `<name>-time`.
#
# Why the last rank: with pipeline parallelism it is the one that computes the loss, so its
# log line is the one that carries loss and timers together (`megatron/core/timers.py:422`).
# Why the max goes to TensorBoard and not the mean: the step waits for the slowest rank, so
# the max is what the iteration time is made of; the min only says how much the others waited.
#
# For the worked example above, `minmax` prints
#
# ```text
# (min, max) time across ranks (ms):
#     forward-backward ...............................: (500.00, 800.00)
# ```
#
# `max` prints only the `800.00`, and `all` prints one line per rank that ran the timer,
# `rank  0: 500.00` and `rank  1: 800.00`, which is where a straggler's number is read.
# All three are per iteration, since the report divides by `normalizer = log_interval` = 4.

# %%
class TimerReports:
    """Megatron's report text."""

    def log_string(self, names: list[str], normalizer: float = 1.0, reset: bool = True,
                   barrier: bool = False) -> Optional[str]:
        """Megatron's report text for `names` (collective); None if no rank ran any of them."""
        if self.log_option == "all":
            table = self.all_ranks_seconds(names, reset, barrier) * 1000.0 / normalizer
            lines = [f"\n  {name}" + "".join(f"\n     rank {r:2d}: {v:.2f}"
                                              for r, v in enumerate(table[:, i].tolist()) if v > 0)
                     for i, name in enumerate(names) if (table[:, i] > 0).any()]
            return "times across ranks (ms):" + "".join(lines) if lines else None
        mm = self.get_min_max(names, normalizer, reset, barrier)
        if not mm:
            return None
        head = "max time across ranks (ms):" if self.log_option == "max" else \
            "(min, max) time across ranks (ms):"
        body = "".join(f"\n    {(n + ' ').ljust(48, '.')}: " +
                       (f"{hi:.2f}" if self.log_option == "max" else f"({lo:.2f}, {hi:.2f})")
                       for n, (lo, hi) in mm.items())
        return head + body


# %% [markdown]
# Where the text and the numbers go: printed on one rank (the last by default), and the max
# of each timer to TensorBoard.

# %%
class TimerOutputs:
    """The report printed on one rank; the max of each timer sent to TensorBoard."""

    def log(self, names: list[str], normalizer: float = 1.0, reset: bool = True,
            barrier: bool = False, rank: Optional[int] = None) -> Optional[str]:
        """Print the report on `rank` (default: the last rank); return it everywhere."""
        text = self.log_string(names, normalizer, reset, barrier)
        world = dist.get_world_size() if dist.is_initialized() else 1
        me = dist.get_rank() if dist.is_initialized() else 0
        if text and me == (world - 1 if rank is None else rank):
            print(text, flush=True)
        return text

    def write(self, names: list[str], writer, iteration: int, normalizer: float = 1.0,
              reset: bool = False) -> None:
        """Send each timer's max (ms) to a TensorBoard writer as '<name>-time' (collective)."""
        mm = self.get_min_max(names, normalizer, reset)
        if writer is not None:
            for name, (_, hi) in mm.items():
                writer.add_scalar(f"{name}-time", hi, iteration)


# %% [markdown]
# The registry, the all-gather and the reports, together:

# %%
class Timers(TimerOutputs, TimerReports, Stragglers, CrossRankTimes, TimerRegistry):
    """Named timers with levels; min/max across ranks in ms."""


# %% [markdown]
# ## Demo: a straggler on a real two-rank world
#
# Two gloo ranks run four "iterations". `forward-compute` sleeps 30 ms on rank 0 and 80 ms on
# rank 1 (the straggler); `backward-compute` sleeps 20 ms on both; `embedding-grads-all-reduce`
# runs on rank 1 only. The level-0 registry hands out dummies for everything but
# `interval-time`. The report is printed in Megatron's format, and the per-rank times are drawn
# under the timer hierarchy.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.launch import run_on_ranks
    from tinytron.reliability._workers import straggler_timers

    coarse = Timers(log_level=0)
    assert isinstance(coarse("forward-compute"), DummyTimer)   # level 2 > 0: free when off
    assert isinstance(coarse("interval-time"), Timer)

    results = run_on_ranks(straggler_timers, 2, 4, {0: 0.03, 1: 0.08}, timeout=120)
    text, table, names = results[-1]["log"], results[-1]["table"], results[-1]["names"]
    print(text)
    mm = results[0]["min_max"]
    fwd_lo, fwd_hi = mm["forward-compute"]
    assert 30.0 <= fwd_lo < fwd_hi and fwd_hi >= 80.0            # per-iteration ms, min < max
    assert mm["embedding-grads-all-reduce"][0] > 0               # rank 0's zero is ignored
    assert results[0]["stragglers"]["forward-compute"][2] == 1   # the slowest rank is rank 1
    assert results[0]["min_max"] == results[1]["min_max"]         # every rank gets the same report

# %% [markdown]
# The per-rank times of each timer, drawn under the hierarchy's levels: the straggler's
# `forward-compute` bar is the long one.

# %%
if __name__ == "__main__":
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    y = torch.arange(len(names), dtype=torch.float64)
    for r in range(table.shape[0]):
        ax.barh(y + 0.2 - 0.4 * r, table[r], height=0.38, label=f"rank {r}")
    ax.set_yticks(y.tolist(), labels=[f"{n} (level {TIMER_LEVELS[n]})" for n in names],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per iteration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## Summary
#
# - Timers are named, levelled stopwatches; above `--timing-log-level` they are free dummies.
# - The report is a collective over all ranks: per name the min and max over the ranks that
#   ran it, in ms per iteration; a wide (min, max) gap points at a straggler, `stragglers`
#   names it.
# - On CUDA a reading synchronizes the device first; `barrier=True` keeps a late rank's wait
#   out of the next phase's time.
#
# ## How production does it
#
# - `megatron/core/timers.py`: `DummyTimer` `:78`, `Timer` `:109`, `Timers` `:217`,
#   `__call__` `:241`, `_get_elapsed_time_all_ranks` `:270`, `_get_global_min_max_time`
#   `:318`, `log` `:422`, `write` `:452`; created in `megatron/training/global_vars.py:307`.
# - Which timers are printed: `megatron/training/training.py:2418-2447` (`training_log`).
# - Per-rank throughput, GPU clocks and power with the min/max ranks named:
#   `StragglerDetector`, `megatron/core/utils.py:1305` (`report` `:1598`).
#
# ## Exercises
#
# 1. Why does `forward-backward` without `barrier=True` on a pipeline's first stage include
#    time spent waiting for the last stage?
#
#    <details><summary>Hint</summary>
#
#    The first stage's timer starts as soon as that rank gets
#    there, and its schedule then waits in receives for the later stages, the last one
#    possibly still finishing the previous step's work. Look at `Timer._sync`: a barrier in
#    `start()` lines the ranks up first, so that wait falls outside the timed phase.
#
#    </details>
#
# 2. One rank asks for `["forward-backward", "optimizer"]`, another for
#    `["optimizer", "forward-backward"]`. What does the report show, and why does it not hang?
#
#    <details><summary>Hint</summary>
#
#    `all_ranks_seconds` all-gathers one row of
#    `len(names)` floats per rank: both rows have two entries, so the collective matches and
#    returns. But column 0 holds one rank's `forward-backward` and the other's `optimizer`,
#    and the report labels it with the caller's first name: the min and max mix two
#    timers.
#
#    </details>
