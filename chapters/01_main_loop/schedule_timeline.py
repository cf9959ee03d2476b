# %% [markdown]
# # 01 · Schedules, drawn from real runs: the timeline and the bubble
#
# The previous two pages built the schedules and checked *what* they compute. This page looks
# at *when*: each schedule runs one training iteration on 2 and on 4 gloo ranks, every forward,
# backward, send and receive is stamped by the `ScheduleRecorder`, and the picture below is
# drawn from those stamps — not by hand. From the same stamps we measure the pipeline bubble
# and put it next to the formula.
#
# You will build: `ScheduleEvent`, `ScheduleRecorder`, `measured_bubble`, `bubble_formula`,
# `plot_timeline`.

# %%
from __future__ import annotations

from typing import NamedTuple

__all__ = ["ScheduleEvent", "ScheduleRecorder", "bubble_formula", "measured_bubble",
           "plot_timeline"]

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
# The measurement: for every stage, the time it spent in forward or backward compute, divided
# by the span from the first forward anywhere to the last backward anywhere; the bubble is one
# minus that, averaged over the stages. It includes what the formula leaves out: the messages
# themselves, and unequal stages (the first holds the embedding, the last the output layer and
# the loss).

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
# ## Drawing a recorded iteration
#
# One row per stage, time to the right. Forwards are light, backwards dark, one color per
# model chunk, each box labeled with its micro-batch; the thin gray bars under a row are that
# stage's sends and receives (a receive includes the time spent waiting for the neighbor,
# which is where the bubble shows up).

# %%
def plot_timeline(ax, events: list[ScheduleEvent], title: str = "") -> None:
    """Draw one recorded iteration: a row per stage, boxes for forward/backward, bars for p2p."""
    t0 = min(e.start for e in events)
    chunk_colors = [("#9ecae1", "#2171b5"), ("#fdae6b", "#d94801"), ("#a1d99b", "#238b45")]
    for e in events:
        x, w = (e.start - t0) * 1e3, (e.end - e.start) * 1e3
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
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)

# %% [markdown]
# ## Demo: four schedules, recorded
#
# A small GPT ($h = 256$, $s = 128$, one sequence per micro-batch, $m = 8$), each layout
# trained for two iterations and the second one drawn: 1F1B and interleaved ($v = 2$) on 2 ranks
# (4 layers), then on 4 ranks (8 layers). The 4-rank world runs on however many cores this
# machine has — on a 2-core laptop two stages share a core, which stretches the boxes but
# not their order. Beside each picture: the bubble measured from the stamps and the formula.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.launch import run_on_ranks
    from tinytron.main_loop._workers import timeline_cases

    # (pp, vpp, m, group size, layers): each world runs its cases one after the other
    worlds = {2: [(2, None, 8, None, 4), (2, 2, 8, None, 4)],
              4: [(4, None, 8, None, 8), (4, 2, 8, None, 8)]}
    runs = []
    for size, cases in worlds.items():
        per_rank = run_on_ranks(timeline_cases, size, cases, timeout=180)
        for i, (pp, vpp, m, _, _) in enumerate(cases):
            events = [e for rank_events in per_rank for e in rank_events[i]]
            runs.append((pp, vpp or 1, m, events))

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.1 * sum(r[0] for r in runs) + 1.5))
    for ax, (pp, v, m, events) in zip(axes, runs):
        name = "1F1B" if v == 1 else f"interleaved, v = {v}"
        got, formula = measured_bubble(events), bubble_formula(pp, m, v)
        print(f"p = {pp}, m = {m}, {name:16s}: measured bubble {got:5.1%}, formula {formula:5.1%}")
        plot_timeline(ax, events, f"p = {pp}, m = {m}, {name}: bubble measured {got:.0%}, "
                                  f"formula (p-1)/(vm+p-1) = {formula:.0%}")
    fig.tight_layout()
    plt.show()

    for pp, v, m, events in runs:
        for stage in range(pp):
            for chunk in range(v):
                mine = [e for e in events if e.stage == stage and e.chunk == chunk]
                fwd = [e.microbatch for e in mine if e.kind == "forward"]
                bwd = [e.microbatch for e in mine if e.kind == "backward"]
                assert fwd == bwd == list(range(m))  # m of each, backward in forward order
        assert 0.0 < measured_bubble(events) < 0.9
    assert bubble_formula(2, 8) == 1 / 9 and bubble_formula(2, 8, 2) == 1 / 17

# %% [markdown]
# ## Reading the pictures
#
# - **1F1B**: stage 0 starts with $p - 1$ forwards in a row (its warmup), the last stage
#   alternates forward and backward from the start; the idle gaps sit in a triangle at the
#   start of the lower stages and at the end of the upper ones. Their total is the bubble.
# - **Interleaved**: the boxes are half as long (one chunk = half a stage), the two colors
#   alternate in groups of $g = p$ micro-batches, and the triangles are about half as tall —
#   at the price of twice as many gray p2p bars.
# - The measured bubble is larger than the formula's, for reasons the formula leaves out on
#   purpose: unequal stages (the output layer and the loss make the last chunk slower, so the
#   others wait for it), the time of each message and of the Python around it (paid $v$ times
#   more often when interleaving, and large next to these millisecond-sized boxes), and, on a
#   small or busy machine, ranks that share a core and get descheduled — a gap with no message
#   waiting in it is the operating system, not the schedule. On GPUs the messages cost real
#   time too, which is what Megatron's `overlap_p2p_comm` hides.
#
# The benchmark `benchmarks/bench_pipeline.py` measures the same bubble over repeated runs
# and compares tokens/s of PP 2 with one rank.
#
# ## Summary
#
# - Every schedule records what it ran; the timeline is a direct picture of those records.
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
# 1. Run the 2-rank 1F1B case with $m = 2, 4, 16$ and plot the measured bubble against
#    $(p-1)/(m+p-1)$.
# 2. Make the last stage's loss artificially slow (sleep in `loss_func`). Which stages idle,
#    and does interleaving still help?
