# %% [markdown]
# # 01 · Schedules, drawn: the ideal timeline and a recorded one
#
# The schedule pages built 1F1B and interleaving and checked *what* they compute. This page
# looks at *when*, twice. First the **ideal** timeline: each stage's real order of forwards
# and backwards, taken from the schedule's own warmup count and table, played out with unit
# costs ($t_f = 1$, $t_b = 2$, no message time) — its bubble is exactly the formula. Then a
# **recorded** one: the same schedules run an iteration on 2 and 4 gloo ranks, every forward,
# backward, send and receive stamped by the `ScheduleRecorder`. On this CPU the recorded
# trace shows the *order* the schedule ran in — it is asserted equal to the ideal one — but
# not its speed: the ranks share two cores, so its box lengths and gaps are mostly the
# operating system's.
#
# You will build: `ScheduleEvent`, `ScheduleRecorder`, `stage_order`, `ideal_events`,
# `measured_bubble`, `bubble_formula`, `plot_timeline`.

# %%
from __future__ import annotations

from typing import NamedTuple

__all__ = ["ScheduleEvent", "ScheduleRecorder", "bubble_formula", "ideal_events",
           "measured_bubble", "plot_timeline", "stage_order"]

# %% [markdown]
# ## What the schedules record
#
# A `ScheduleRecorder` handed to a schedule through `ScheduleConfig.recorder` receives one
# `ScheduleEvent` per forward, backward, send and receive: the pipeline stage, the model chunk,
# the micro-batch, the kind, and `time.perf_counter()` at start and end. On Linux that clock is
# `CLOCK_MONOTONIC`, shared by all processes of a machine, so the events of different ranks
# can be put on one time axis. A combined exchange (send an output, receive a gradient) is
# recorded once per tensor it moved, with the same start and end. The schedules themselves
# hold no recording code: a wrapper around each stage's communicator and around its
# forward/backward steps writes the events
# (`chapters/01_main_loop/_schedule_recording.py`, told on the schedules page).

# %%
class ScheduleEvent(NamedTuple):
    """One thing a stage did: forward/backward of (chunk, micro-batch), or a send/recv of it."""

    stage: int
    chunk: int
    microbatch: int
    kind: str  # "forward", "backward", "send" or "recv"
    start: float
    end: float


class ScheduleRecorder:
    """Collects the ScheduleEvents of the schedules it is handed to (perf_counter seconds)."""

    KINDS = ("forward", "backward", "send", "recv")

    def __init__(self):
        self.events: list[ScheduleEvent] = []

    def record(self, stage: int, chunk: int, microbatch: int, kind: str, start: float,
               end: float) -> None:
        """Append one event."""
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        self.events.append(ScheduleEvent(stage, chunk, microbatch, kind, start, end))

    def order(self, kinds=("forward", "backward")) -> list[tuple[str, int, int]]:
        """(kind, chunk, micro-batch) of the recorded events of these kinds, in start order."""
        evs = sorted((e for e in self.events if e.kind in kinds), key=lambda e: e.start)
        return [(e.kind, e.chunk, e.microbatch) for e in evs]

# %% [markdown]
# ## The bubble, in formula
#
# Take $p$ stages, $m$ micro-batches and equal times $t_f$, $t_b$ for a micro-batch's forward
# and backward on every stage. The ideal iteration is $m\,(t_f + t_b)$ per stage. With 1F1B
# (or GPipe) the last forward of stage 0 cannot start its backward until the micro-batch has
# gone down the pipeline and back: stage $r$ idles $(p - 1)(t_f + t_b)$ in total, spread over
# the warmup and the cooldown. Narayanan et al. (*Efficient Large-Scale Language Model
# Training on GPU Clusters Using Megatron-LM*, SC'21, arXiv:2104.04473, §2.2.1) write it as the
# **bubble time fraction** $\frac{(p-1)(t_f + t_b)}{m (t_f + t_b)} = \frac{p-1}{m}$ of the ideal
# time. As a share of the whole iteration:
#
# $$\text{1F1B: } \frac{p - 1}{m + p - 1}, \qquad \text{interleaved with } v \text{ chunks: }
# \frac{p - 1}{v\,m + p - 1},$$
#
# the second from the same paper's §2.2.2: with $v$ chunks per rank each slot lasts
# $(t_f + t_b)/v$, so the idle time is $\frac{1}{v}$ as long, $\frac{1}{v}\cdot\frac{p-1}{m}$ of
# the ideal time.
#
# | case | $p$ | $m$ | $v$ | bubble share |
# |---|---|---|---|---|
# | running example, 1F1B | 2 | 8 | 1 | $1/9 = 11.1\%$ |
# | running example, interleaved | 2 | 8 | 2 | $1/17 = 5.9\%$ |
# | this page, PP 4 | 4 | 8 | 1 | $3/11 = 27.3\%$ |
# | this page, PP 4 interleaved | 4 | 8 | 2 | $3/19 = 15.8\%$ |
#
# The bubble of a timeline, ideal or recorded: for every stage, the time it spent in forward
# or backward compute, divided by the span from the first forward anywhere to the last
# backward anywhere; the bubble is one minus that, averaged over the stages.

# %%
def bubble_formula(pp: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """Idle share of the iteration: (p - 1) / (v m + p - 1) (Narayanan et al. 2021, 2.2)."""
    return (pp - 1) / (num_chunks * num_microbatches + pp - 1)


def measured_bubble(events: list[ScheduleEvent]) -> float:
    """1 - (compute time / span), averaged over the stages of one recorded iteration."""
    compute = [e for e in events if e.kind in ("forward", "backward")]
    if not compute:
        raise ValueError("measured_bubble needs forward/backward events, got none")
    start = min(e.start for e in compute)
    span = max(e.end for e in compute) - start
    stages = sorted({e.stage for e in compute})
    busy = [sum(e.end - e.start for e in compute if e.stage == s) for s in stages]
    return 1.0 - sum(busy) / (len(stages) * span)

# %% [markdown]
# ## The ideal timeline, from the schedule's own order
#
# Each stage runs its operations in a fixed order, and the schedule code fixes it: stage $r$
# runs $w_r$ warmup forwards, then alternates one forward and one backward, then drains the
# remaining backwards. $w_r = \min(p - r - 1, m)$ for 1F1B (`num_warmup_microbatches_1f1b`,
# Megatron's `schedules.py:2227-2228`) and $2(p - r - 1) + (v - 1)\,g$ interleaved
# (`get_pp_rank_microbatches`, `schedules.py:856`); the $k$-th forward is entry $k$ of
# `get_schedule_table` (`schedules.py:916`), the $k$-th backward the same entry with the
# chunks counted from the end. `stage_order` writes
# that list down from the same functions the schedules call.
#
# `ideal_events` then plays the lists out with nothing but the data dependencies: a forward
# of (chunk $c$, micro-batch $i$) on stage $r$ waits for the same forward on stage $r - 1$
# (stage 0 waits for chunk $c - 1$ on the last stage); a backward waits for the same backward
# on stage $r + 1$ (the last stage for chunk $c + 1$ on stage 0, and for its own forward of
# the last chunk). Each operation starts when its stage is free and its input exists, and
# lasts $t_f / v$ or $t_b / v$ — a chunk is $1/v$ of a stage. Messages take no time.

# %%
def stage_order(pp: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]]:
    """(kind, chunk, micro-batch) of stage `rank`'s forwards/backwards, in the schedule's order."""
    from tinytron.main_loop.interleaved import get_pp_rank_microbatches, get_schedule_table
    from tinytron.main_loop.schedules import num_warmup_microbatches_1f1b

    if v == 1:
        warmup, table = num_warmup_microbatches_1f1b(pp, rank, m), [(i, 0) for i in range(m)]
    else:  # the default group size g = p, as in the demo below
        warmup = get_pp_rank_microbatches(m, v, pp, pp, rank)[2]
        table = get_schedule_table(m, v, pp)
    fwd = [("forward", c, i) for i, c in table]
    bwd = [("backward", v - 1 - c, i) for i, c in table]
    order = fwd[:warmup]
    for k in range(m * v - warmup):  # steady state: one forward, one backward
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[m * v - warmup:]


# %% [markdown]
# Playing the lists out needs one rule per operation, what it waits for (`_needs`), and a loop
# that advances every stage as far as its next operation's input exists.

# %%
def _needs(op: tuple, pp: int, v: int):
    """The (stage, kind, chunk, micro-batch) whose output this operation consumes, if any."""
    r, kind, c, i = op
    if kind == "forward":
        return (r - 1, kind, c, i) if r > 0 else (pp - 1, kind, c - 1, i) if c > 0 else None
    if r < pp - 1:
        return (r + 1, kind, c, i)
    return (0, kind, c + 1, i) if c < v - 1 else (r, "forward", c, i)


def ideal_events(pp: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0):
    """The schedule's own order played out with unit costs and free messages."""
    orders = [stage_order(pp, m, v, r) for r in range(pp)]
    done, free, pos, events = {}, [0.0] * pp, [0] * pp, []
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, c, i = orders[r][pos[r]]
                need = _needs((r, kind, c, i), pp, v)
                if need is not None and need not in done:
                    break  # wait for the other stage
                start = max(free[r], done[need] if need else 0.0)
                free[r] = done[(r, kind, c, i)] = start + (t_f if kind == "forward" else t_b) / v
                events.append(ScheduleEvent(r, c, i, kind, start, free[r]))
                pos[r], moved = pos[r] + 1, True
        assert moved, "the schedule's order deadlocks"
    return events

# %% [markdown]
# ## Drawing a timeline
#
# One row per stage, time to the right. Forwards are light, backwards dark, one color per
# model chunk, each box labeled with its micro-batch; the thin gray bars under a row are that
# stage's sends and receives (a receive includes the time spent waiting for the neighbor,
# which is where the bubble shows up).

# %%
def plot_timeline(ax, events: list[ScheduleEvent], title: str = "", scale: float = 1e3,
                  unit: str = "ms") -> None:
    """Draw one iteration: a row per stage, boxes for forward/backward, bars for p2p."""
    t0 = min(e.start for e in events)
    chunk_colors = [("#9ecae1", "#2171b5"), ("#fdae6b", "#d94801"), ("#a1d99b", "#238b45")]
    for e in events:
        x, w = (e.start - t0) * scale, (e.end - e.start) * scale
        if e.kind in ("send", "recv"):
            ax.broken_barh([(x, max(w, 0.02))], (e.stage + 0.36, 0.08), color="gray")
            continue
        light, dark = chunk_colors[e.chunk % len(chunk_colors)]
        color = light if e.kind == "forward" else dark
        ax.broken_barh([(x, w)], (e.stage - 0.3, 0.6), facecolor=color, edgecolor="white",
                       linewidth=0.5)
        ax.text(x + w / 2, e.stage, str(e.microbatch), ha="center", va="center", fontsize=6,
                color="black" if e.kind == "forward" else "white")
    stages = sorted({e.stage for e in events})
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.set_ylim(max(stages) + 0.6, -0.6)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)

# %% [markdown]
# ## Demo 1: the ideal timelines and their bubble
#
# Four layouts, $m = 8$: 1F1B and interleaved ($v = 2$) on 2 and on 4 stages, each played out
# with $t_f = 1$, $t_b = 2$. The assert is the claim of the formula section: the bubble of
# the schedule's real order equals $(p-1)/(v m + p - 1)$, to rounding.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    layouts = [(2, 1), (2, 2), (4, 1), (4, 2)]  # (p, v), all with m = 8
    M = 8
    ideal = {(pp, v): ideal_events(pp, M, v) for pp, v in layouts}
    for (pp, v), events in ideal.items():
        got, formula = measured_bubble(events), bubble_formula(pp, M, v)
        print(f"p = {pp}, v = {v}: ideal bubble {got:6.2%}, formula {formula:6.2%}")
        assert abs(got - formula) < 1e-9
    assert bubble_formula(2, 8) == 1 / 9 and bubble_formula(2, 8, 2) == 1 / 17

# %% [markdown]
# ## Demo 2: the same schedules, recorded on gloo ranks
#
# A small GPT ($h = 256$, $s = 128$, one sequence per micro-batch, $m = 8$), each layout
# trained for two iterations and the second one recorded: 2 ranks with 4 layers, 4 ranks with
# 8. Two asserts: every stage ran exactly the ideal timeline's order, and every micro-batch
# went forward and backward once per chunk.

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.main_loop._workers import timeline_cases

    # (pp, vpp, m, group size, layers): each world runs its cases one after the other
    worlds = {2: [(2, None, M, None, 4), (2, 2, M, None, 4)],
              4: [(4, None, M, None, 8), (4, 2, M, None, 8)]}
    recorded = {}
    for size, cases in worlds.items():
        per_rank = run_on_ranks(timeline_cases, size, cases, timeout=180)
        for i, (pp, vpp, _, _, _) in enumerate(cases):
            recorded[(pp, vpp or 1)] = [e for rank_events in per_rank for e in rank_events[i]]
    for (pp, v), events in recorded.items():
        for stage in range(pp):
            mine = [e for e in events if e.stage == stage]
            ran = [(e.kind, e.chunk, e.microbatch) for e in sorted(mine, key=lambda e: e.start)
                   if e.kind in ("forward", "backward")]
            assert ran == stage_order(pp, M, v, stage)  # the order is the schedule's
            for chunk in range(v):
                fwd = [e.microbatch for e in mine if e.chunk == chunk and e.kind == "forward"]
                assert sorted(fwd) == list(range(M))
        print(f"p = {pp}, v = {v}: recorded bubble {measured_bubble(events):6.1%} "
              f"(ideal {bubble_formula(pp, M, v):5.1%}), order = schedule's on every stage")

# %% [markdown]
# ## The two side by side
#
# Left, the ideal timeline in units of $t_f$; right, the recorded one in milliseconds. The
# boxes on the right are in the same order as on the left, stage by stage; their lengths and
# the gaps between them are not the schedule's.

# %%
if __name__ == "__main__":
    fig, axes = plt.subplots(len(layouts), 2, figsize=(12, 9), dpi=150,
                             gridspec_kw={"width_ratios": [1, 1.3]})
    for row, (pp, v) in zip(axes, layouts):
        name = "1F1B" if v == 1 else f"interleaved v = {v}"
        plot_timeline(row[0], ideal[(pp, v)], f"ideal, p = {pp}, {name}: bubble "
                      f"{measured_bubble(ideal[(pp, v)]):.1%} = (p-1)/(vm+p-1)", 1.0, "t_f")
        plot_timeline(row[1], recorded[(pp, v)], f"recorded on this CPU, p = {pp}, {name}: "
                      f"same order, bubble {measured_bubble(recorded[(pp, v)]):.0%} "
                      "(shared cores)")
    fig.suptitle("Interleaving shrinks the ideal bubble (left); a CPU trace shows the order "
                 "the schedule ran in, not its speed (right)", fontsize=10)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## Reading the pictures
#
# - **1F1B, ideal**: stage 0 starts with $p - 1$ forwards in a row (its warmup), the last
#   stage alternates forward and backward from the start; the idle gaps sit in a triangle at
#   the start of the lower stages and at the end of the upper ones. Their total is
#   $(p-1)(t_f + t_b)$ per stage: 11.1% of the iteration at $p = 2$, 27.3% at $p = 4$.
# - **Interleaved, ideal**: the boxes are half as long (one chunk = half a stage), the two
#   colors alternate in groups of $g = p$ micro-batches, and the triangles are half as tall:
#   5.9% at $p = 2$, 15.8% at $p = 4$. Interleaving wins, as Narayanan et al. say — *when*
#   a message costs nothing next to a chunk's compute.
# - **Recorded on this CPU**: the same order, box for box — that is what the trace proves.
#   The bubble it shows is larger than the formula and interleaving looks *worse* than 1F1B.
#   That is not the schedule: two or four ranks share two cores (a rank that waits is
#   descheduled, and one that computes is slowed by its neighbor's spin), every message and
#   the Python around it costs about as much as these millisecond boxes, interleaving pays
#   it $v$ times as often, and the first and last stages hold the embedding and the loss.
#   A gap with no message in it is the operating system. On GPUs, where each stage owns its
#   device and messages run on their own engine, the recorded picture approaches the left
#   column; Megatron's `overlap_p2p_comm` hides what is left of the messages.
#
# The benchmark `benchmarks/bench_pipeline.py` measures the same bubble over repeated runs
# and compares tokens/s of PP 2 with one rank.
#
# ## Summary
#
# - The ideal timeline is the schedule's own order played out with unit costs; its bubble is
#   the formula exactly. A recorded CPU timeline checks the order, not the speed.
# - The bubble is $(p-1)/(m+p-1)$ of the iteration for 1F1B and $(p-1)/(v m+p-1)$ interleaved
#   (Narayanan et al. 2021); more micro-batches or more chunks shrink it.
#
# ## How production does it
#
# - Megatron-LM records nothing like this itself; its timers (`forward-compute`,
#   `backward-compute`, the p2p timers at `--timing-log-level 2`, `training.py:2416-2446`)
#   give totals, and Nsight Systems with NVTX ranges (`nvtx_range_push` in the schedules)
#   draws the real GPU timeline.
# - PyTorch's `torch.distributed.pipelining` can export a schedule's planned actions to a
#   Chrome trace before running it.
#
# ## Exercises
#
# 1. Play out `ideal_events(2, m)` for $m = 2, 4, 16$ and check its bubble against
#    $(p-1)/(m+p-1)$. Then set `t_b = t_f`: does the formula still hold?
#
#    <details><summary>Answer</summary>
#
#    `measured_bubble` gives $1/3$, $1/5$ and $1/17$
#    (33.3%, 20.0%, 5.9%), which are $(p-1)/(m+p-1)$ for $p = 2$. With `t_b = t_f` the three
#    numbers are the same: the bubble is $p - 1$ forward slots and $p - 1$ backward slots out
#    of $m + p - 1$ of each, so the ratio $t_b / t_f$ cancels.
#
#    </details>
#
# 2. Give `ideal_events` a message cost (add it to every dependency that crosses stages).
#    At what cost per message does interleaving ($v = 2$) stop beating 1F1B at $p = 4$?
#
#    <details><summary>Hint</summary>
#
#    Add the cost where `ideal_events` takes `done[need]` for a
#    `need` on another stage. Interleaving sends $v$ times as many messages, each on the
#    critical path, while its bubble gain shrinks with $m$; sweep the cost for the demo's $m$
#    and compare `measured_bubble` of the two timelines (or their end times).
#
#    </details>
