# %% [markdown]
# # 08 · The trace of one iteration
#
# Timers say *how long* each phase took; a trace says *what ran when*, operator by operator, on
# every thread (and, on a GPU, every CUDA stream): where the data loader stalls, whether the
# gradient all-reduce really overlaps the backward, which kernel dominates. PyTorch's profiler
# records it and writes the Chrome trace format (open it in `chrome://tracing` or Perfetto).
# This page records one iteration of the book's model, with the phases named after Megatron's
# timers, and draws the trace from the file.

# %%
from __future__ import annotations

import json
import os
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

__all__ = ["PHASES", "profile_iteration", "load_trace", "nest_depths", "draw_trace"]

# %% [markdown]
# ## Recording
#
# The profiler's `schedule(wait, warmup, active)` skips the first calls (the first iteration
# allocates memory and fills caches, so it is not representative), records `active` ones, and
# hands the result to `on_trace_ready`, which here exports the Chrome trace JSON. Megatron does
# the same for `--profile --use-pytorch-profiler` between `--profile-step-start` and
# `--profile-step-end` (default 10 and 12) on the ranks in `--profile-ranks`, with TensorBoard's
# trace handler; without `--use-pytorch-profiler` it brackets the same steps with
# `cudaProfilerStart/Stop` for Nsight Systems (`megatron/training/training.py:3344-3360` builds
# the profiler with `wait = profile_step_start - 1`, `warmup = 1`, `active = end - start`;
# `:3406-3411` starts it, or Nsight's range, at `profile_step_start`).
#
# `record_function(name)` adds a named range, shown as a `user_annotation` event above the
# operators it contains. Naming the ranges after the timers (`batch-generator`,
# `forward-compute`, `backward-compute`, `optimizer`) lines the trace up with the timer report.
#
# Each event of the file is a JSON object; the complete ones (`"ph": "X"`) have a name, a
# category (`cpu_op`, `user_annotation`, `kernel`, …), a start `ts` and a duration `dur` in
# microseconds, a process `pid` and a thread `tid`. Ranges on one thread nest; the drawing
# stacks each event one row below the innermost range that contains it.

# %%
PHASES = ("batch-generator", "forward-compute", "backward-compute", "optimizer")


def profile_iteration(step_fn: Callable[[int], None], path: str, warmup: int = 1) -> str:
    """Run `step_fn(i)` for warmup + 1 iterations, trace the last one to a Chrome JSON at `path`."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for i in range(warmup + 1):
            with record_function(f"iteration-{i}"):
                step_fn(i)
            prof.step()
    return path


def load_trace(path: str) -> list[dict]:
    """The complete events ('ph' == 'X') of a Chrome trace, times made relative, in ms."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("ph") == "X" and "dur" in e and "ts" in e]
    if not events:
        raise ValueError(f"{path} holds no complete ('X') events")
    t0 = min(float(e["ts"]) for e in events)
    return [dict(e, start_ms=(float(e["ts"]) - t0) / 1e3, dur_ms=float(e["dur"]) / 1e3)
            for e in events]


# %% [markdown]
# To draw the trace, each event needs a row: `nest_depths` sweeps one thread's events in start
# order with a stack of the ranges still open, so an event's row is the number of open ranges
# that contain it. `draw_trace` then draws the busiest thread, the four phases in color.
#
# A worked example in microseconds: `forward-compute` at `ts = 1000, dur = 350` is open when
# `aten::mm` starts at 1 100 (`dur = 80`), so `aten::mm` is one row below it (depth 1). An
# `aten::add` at 1 400 comes after `forward-compute` has closed (at 1 000 + 350 = 1 350): the
# sweep pops the range from the stack, and `aten::add` sits at depth 0.

# %%
def nest_depths(events: list[dict]) -> list[int]:
    """Per event, how many events of the same thread contain it (its row in the drawing)."""
    order = sorted(range(len(events)),
                   key=lambda i: (events[i]["tid"], events[i]["start_ms"], -events[i]["dur_ms"]))
    depth = [0] * len(events)
    stack: list[int] = []
    tid = None
    for i in order:
        e = events[i]
        if e["tid"] != tid:
            stack, tid = [], e["tid"]
        end = e["start_ms"] + e["dur_ms"]
        while stack and events[stack[-1]]["start_ms"] + events[stack[-1]]["dur_ms"] < end - 1e-6:
            stack.pop()
        depth[i] = len(stack)
        stack.append(i)
    return depth


def draw_trace(events: list[dict], ax, max_depth: int = 4, min_ms: float = 0.0) -> None:
    """Draw the main thread's events as nested bars; phases colored, operators gray."""
    busiest = max({e["tid"] for e in events},
                  key=lambda t: sum(e["dur_ms"] for e in events if e["tid"] == t))
    mine = [e for e in events if e["tid"] == busiest and not e["name"].startswith("ProfilerStep")]
    colors = dict(zip(PHASES, ("tab:purple", "tab:blue", "tab:orange", "tab:green")))
    for e, d in zip(mine, nest_depths(mine)):
        if d > max_depth or e["dur_ms"] < min_ms:
            continue
        c = colors.get(e["name"], "0.75" if e.get("cat") == "cpu_op" else "0.55")
        ax.broken_barh([(e["start_ms"], e["dur_ms"])], (-d - 0.9, 0.8), color=c, lw=0)
        if e["name"] in colors or e["dur_ms"] > 0.12 * max(x["dur_ms"] for x in mine):
            ax.text(e["start_ms"] + e["dur_ms"] / 2, -d - 0.5, e["name"], ha="center",
                    va="center", fontsize=6, clip_on=True)
    ax.set_yticks([-d - 0.5 for d in range(max_depth + 1)],
                  labels=[f"depth {d}" for d in range(max_depth + 1)], fontsize=7)
    ax.set_xlabel("ms since the traced iteration started")


# %% [markdown]
# ## Demo: one iteration of the tiny GPT
#
# Two iterations run; the second is traced. The trace is written to a file, read back, and
# drawn: the top row is the iteration, the next the four phases, below them the operators
# each phase ran (`aten::mm` in the linear layers, the attention kernel, `aten::_foreach_*` in
# AdamW). On this CPU the picture is one thread; on a GPU the same file has a row per stream,
# and the backward's kernels would run while the CPU launches the next ones.

# %%
if __name__ == "__main__":
    import tempfile

    import matplotlib.pyplot as plt

    from tinytron.model import GPTModel, tiny_config

    torch.manual_seed(0)
    cfg = tiny_config()
    model = GPTModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)

    def step(i: int) -> None:
        with record_function("batch-generator"):
            x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length), generator=g)
        with record_function("forward-compute"):
            loss = model(x, labels=torch.roll(x, -1, 1)).mean()
        with record_function("backward-compute"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad()

    path = profile_iteration(step, os.path.join(tempfile.mkdtemp(), "iteration.json"))
    events = load_trace(path)
    phases = {e["name"]: e["dur_ms"] for e in events if e["name"] in PHASES}
    iteration = next(e for e in events if e["name"] == "iteration-1")
    print(f"{len(events)} events in {path}; iteration {iteration['dur_ms']:.1f} ms:",
          {k: round(v, 2) for k, v in phases.items()})
    assert set(phases) == set(PHASES) and not any(e["name"] == "iteration-0" for e in events)
    assert sum(phases.values()) <= iteration["dur_ms"] + 1e-3      # the phases nest inside
    assert phases["backward-compute"] > phases["batch-generator"]
    assert any(e["name"] == "aten::mm" for e in events)

# %% [markdown]
# The traced iteration, drawn from the file: the iteration on top, the four phases, and the
# operators under them.

# %%
if __name__ == "__main__":
    fig, ax = plt.subplots(figsize=(8, 2.6))
    draw_trace(events, ax, max_depth=4, min_ms=0.002 * iteration["dur_ms"])
    ax.set_title("one training iteration (torch.profiler Chrome trace, main thread)", fontsize=9)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## Summary
#
# - `torch.profiler` with a `(wait, warmup, active)` schedule records chosen iterations and
#   exports a Chrome trace: complete events with name, category, start and duration.
# - Named ranges (`record_function`) with the timers' names make the trace and the timer
#   report tell the same story at two resolutions.
#
# ## How production does it
#
# - Megatron: `--profile`, `--use-pytorch-profiler`, `--profile-step-start/end`,
#   `--profile-ranks` (`megatron/training/arguments.py`; the hooks in
#   `megatron/training/training.py`'s `train` loop); Nsight Systems with
#   `cudaProfilerStart/Stop` otherwise, and NVTX ranges around the same phases.
# - torchtitan: `torchtitan/tools/profiling.py` (`maybe_enable_profiling`: a trace every
#   `profile_freq` steps per rank, plus memory snapshots).
# - The PyTorch profiler's Chrome/Perfetto format and the HTA (Holistic Trace Analysis) tools
#   that compare traces across ranks to find stragglers and exposed communication.
#
# ## Exercises
#
# 1. Trace iterations 1 and 10 and compare `optimizer`: why is the first AdamW step slower?
#
#    <details><summary>Hint</summary>
#
#    AdamW keeps two moments per parameter, and it creates
#    them lazily: look in the first step's `optimizer` range for the allocations and fills of
#    `exp_avg` and `exp_avg_sq` (`aten::zeros_like`, `aten::empty`) that later steps do not
#    have.
#
#    </details>
#
# 2. With chapter 05's overlapped DDP on two gloo ranks, find the all-reduce events in the
#    trace and check whether they start before `backward-compute` ends.
#
#    <details><summary>Hint</summary>
#
#    Run `profile_iteration` inside each rank, with `step`
#    built on chapter 05's DDP, then filter `load_trace`'s events by a name containing
#    `allreduce` or `all_reduce` and compare their `start_ms` with the end of `backward-compute`
#    (`start_ms + dur_ms`). An overlapped bucket starts while the backward of the earlier
#    layers still runs.
#
#    </details>
