# %% [markdown]
# # 05 · Buffers: what overlap looks like, recorded from real runs
#
# Two pictures of one mechanism. The **ideal** one plays the buckets out with unit costs: the
# forward of the whole model takes 1, its backward 2, and the reduce-scatter of all gradients
# 1, on a network engine of its own. The **recorded** one comes from a real 2-rank gloo
# world: one backward with the grad collectives launched after backward versus from the hooks,
# and one forward whose parameters arrive bucket by bucket through the all-gather the forward
# pre-hooks wait for. On this 2-core CPU the recorded pictures show the *order* of events,
# which is the mechanism, not its speed: see the note under demo 1.

# %%
from __future__ import annotations

__all__ = ["timeline_summary", "ideal_overlap", "plot_timeline", "plot_param_gather"]

# %% [markdown]
# ## Recording and drawing a backward
#
# Passing a `CommTimeline` to `DistributedDataParallel(..., timeline=...)` records events
# `(name, bucket_id, seconds)` from inside the real code path, per bucket:
#
# | event | recorded when |
# |---|---|
# | `grad` | a parameter's backward hook fires (the bucket is *ready* at its last `grad`) |
# | `start` | `start_grad_sync` launches the bucket's reduce-scatter / all-reduce |
# | `done` | the collective completes (a callback on the work's future; polled where the backend has no future) |
# | `waited` | `finish_grad_sync` returns from waiting for it |
# | `gather_start`, `gather_complete`, `gather_waited` | the same for the param all-gather |
# | `forward` | (demo hook) a module using the bucket is about to run |
#
# The overlap we want to see: `start` long before the end of backward, and `done` before it
# too, so that `finish_grad_sync` has (almost) nothing left to wait for.

# %% tags=["hide-input"]
def timeline_summary(events) -> dict:
    """Per bucket: last grad arrival, collective start/done/waited; plus backward end and sync."""
    out: dict = {}
    for event, bucket, t in events:
        row = out.setdefault(bucket, {})
        if event == "grad":
            row["ready"] = max(row.get("ready", 0.0), t)
        else:
            row.setdefault(event, t)
    return out


# %% [markdown]
# The backward picture: one row per bucket, the grads arriving as ticks, the bucket ready at
# the orange dot, its collective as a bar, and two lines, the end of the backward and the
# moment the grads are synced.

# %% tags=["hide-input"]
def plot_timeline(runs, axes=None, scale: float = 1e3,
                  unit: str = "ms since backward started"):
    """One panel per (title, events) run: grads (dots), collective (bar), backward end (line)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(len(runs), 1, figsize=(10, 1.6 + 1.3 * len(runs)), sharex=True)
    for ax, (title, events) in zip(list(axes), runs):
        rows = timeline_summary(events)
        for event, bucket, t in events:
            if event == "grad":
                ax.plot(t * scale, bucket, "|", color="gray", ms=8)
        for bucket, row in rows.items():
            if bucket < 0 or "start" not in row:
                continue
            done = row.get("done", row.get("waited", row["start"]))
            ax.barh(bucket, (done - row["start"]) * scale, left=row["start"] * scale, height=0.5,
                    color="tab:blue", alpha=0.7)
            ax.plot(row["ready"] * scale, bucket, "o", color="tab:orange", ms=5)
        ax.axvline(rows[-1]["backward_end"] * scale, color="black", ls="--", lw=1)
        ax.axvline(rows[-1]["synced"] * scale, color="tab:red", lw=1.5)
        ax.set_ylabel("bucket")
        ax.set_xlim(left=0)
        ax.set_title(title, fontsize=9)
    list(axes)[-1].set_xlabel(unit)
    return axes


# %% [markdown]
# The forward picture: each bucket's all-gather in flight, and the moment the first module
# that needs it starts. A marker after its bar is a gather that was hidden.

# %% tags=["hide-input"]
def plot_param_gather(events, ax=None):
    """Per bucket: all-gather in flight (bar) and the forward's first use of it (marker)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3))
    rows = timeline_summary(events)
    for bucket, row in rows.items():
        if bucket < 0 or "gather_start" not in row:
            continue
        end = row.get("gather_complete", row.get("gather_waited", row["gather_start"]))
        ax.barh(bucket, (end - row["gather_start"]) * 1e3, left=row["gather_start"] * 1e3,
                height=0.5, color="tab:green", alpha=0.7)
        if "forward" in row:
            ax.plot(row["forward"] * 1e3, bucket, "v", color="black", ms=6)
    ax.axvline(rows[-1]["forward_end"] * 1e3, color="black", ls="--", lw=1)
    ax.set_ylabel("bucket")
    ax.set_xlabel("ms since the forward started (bar = all-gather in flight, "
                  "v = first module using the bucket starts, -- forward ends)")
    return ax


# %% [markdown]
# ## The ideal backward, from unit costs
#
# The model of the left-hand pictures: the backward fills the buckets one after another in
# $t_b = 2$ (bucket 0 first), and one network engine, running beside the compute, moves all
# gradients in $t_{comm} = 1$, each bucket its share. It writes the same events as the
# recorded runs, so `plot_timeline` draws both.

# %%
def ideal_overlap(bucket_numels: list[int], overlap: bool, t_b: float = 2.0,
                  t_comm: float = 1.0) -> list:
    """Unit-cost backward (t_b for all grads), one network engine (t_comm for all of them).

    Without overlap the buffer is one bucket, reduced after backward (as Megatron does)."""
    total, now, net = sum(bucket_numels), 0.0, 0.0
    events, ready = [], []
    for b, n in enumerate(bucket_numels):  # bucket 0 is ready first (the output end)
        now += t_b * n / total
        events.append(("grad", b if overlap else 0, now))
        ready.append(now)
    buckets = list(zip(bucket_numels, ready)) if overlap else [(total, now)]
    for b, (n, t) in enumerate(buckets):
        net = max(net, t)  # launched from its hook (at its last grad), or after backward
        events += [("start", b, net), ("done", b, net + t_comm * n / total)]
        net += t_comm * n / total
    return events + [("backward_end", -1, now), ("synced", -1, net)]

# %% [markdown]
# ## Demo 1: the ideal backward, overlap off and on
#
# `ideal_overlap` takes the bucket sizes of the run below and plays them out: the backward
# fills bucket after bucket (bucket 0, the output head and last blocks, first), each bucket's
# reduce-scatter lasts its share of $t_{comm} = 1$ and they queue on one network engine. Off,
# the buffer is one bucket reduced when backward ends: the step pays all of $t_{comm}$ after it.
# On, each starts at its bucket's last grad; as long as the network keeps up (here it moves a
# bucket in half the time backward takes to fill one), what is left after backward is only
# the end of the queue: the last bucket's collective and the rest of the one before it (the
# last bucket, the embedding, is small and fills quickly). The asserts state both.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.buffers._workers import timeline_and_gather_runs
    from tinytron.launch import run_on_ranks

    per_rank = run_on_ranks(timeline_and_gather_runs, 2, timeout=180)
    runs = per_rank[0]  # rank 0's timelines are drawn; the stale-read check covers both ranks
    off, on = runs["off"], runs["on"]
    numels = on["bucket_numels"]
    ideal = {flag: timeline_summary(ideal_overlap(numels, flag))[-1] for flag in (False, True)}
    for flag, row in ideal.items():
        print(f"ideal, overlap={flag}: backward {row['backward_end']:.2f}, "
              f"left after backward {row['synced'] - row['backward_end']:.3f} (units)")
    assert abs(ideal[False]["synced"] - ideal[False]["backward_end"] - 1.0) < 1e-9
    left_on = ideal[True]["synced"] - ideal[True]["backward_end"]
    assert 0 < left_on <= (numels[-1] + numels[-2]) / sum(numels)  # the last two, at most

# %% [markdown]
# ## The same backward, recorded on two gloo ranks
#
# Two gloo ranks train a small residual MLP (6 blocks, hidden 256) with the distributed
# optimizer's reduce-scatter; we record the *second* step (the first only learns the golden
# grad counts). Without overlap there is one bucket, reduced after backward; with overlap and
# 200k-element buckets, the buckets launch from the hooks during backward. The asserts check
# the order, which is the mechanism: with overlap, bucket 0 starts before backward ends;
# without, nothing starts before it.
#
# What the recorded times do *not* show is overlap paying off. The two ranks and gloo's
# communication threads share this machine's two cores, so a byte moved during backward is
# moved by a core taken from backward, and the step times swing from run to run: on this
# machine the step with overlap has come out 17% slower in one run and more than twice as
# fast in another. Neither is the mechanism. On a GPU the bytes move over NVLink or
# InfiniBand by the network engine while the SMs compute: the left column's picture, and
# where overlap pays.

# %%
if __name__ == "__main__":
    for run in (off, on):
        rows = timeline_summary(run["events"])
        print(f"recorded, overlap={run['overlap']}: {len(run['bucket_numels'])} bucket(s), "
              f"backward {rows[-1]['backward_end'] * 1e3:.1f} ms, sync after backward "
              f"{(rows[-1]['synced'] - rows[-1]['backward_end']) * 1e3:.1f} ms")
    fig, axes = plt.subplots(2, 2, figsize=(12, 5), dpi=150, sharey=True)
    plot_timeline([("ideal, overlap off: all of t_comm after backward",
                    ideal_overlap(numels, False)),
                   ("ideal, overlap on: only the end of the queue after backward",
                    ideal_overlap(numels, True))], axes[:, 0], 1.0,
                  "units (forward 1, backward 2, all grads' reduce-scatter 1)")
    plot_timeline([("recorded, overlap off (order, not speed)", off["events"]),
                   ("recorded, overlap on (order, not speed)", on["events"])], axes[:, 1])
    fig.suptitle("Launching each bucket from its hook leaves only the last buckets after "
                 "backward (left); the CPU trace shows that order (right). | grad, o bucket "
                 "ready, bar reduce-scatter, -- backward end, red synced", fontsize=8)
    fig.tight_layout()
    plt.show()
    rows_on, rows_off = timeline_summary(on["events"]), timeline_summary(off["events"])
    assert rows_on[0]["start"] < rows_on[-1]["backward_end"]  # launched during backward
    assert all(r["start"] >= rows_off[-1]["backward_end"] for b, r in rows_off.items() if b >= 0)
    assert len(on["bucket_numels"]) > 1 and len(off["bucket_numels"]) == 1

# %% [markdown]
# ## Demo 2: the param all-gather, bucket by bucket, during the next forward
#
# Same world, now with `overlap_param_gather=True`. After one step each rank updates only its
# shard of every bucket (a stand-in for [chapter 02's optimizer](../02_optimizer/distributed.py)) and does **not** gather. The
# next forward's pre-hooks do: the embedding's bucket (the last one) is gathered first, and
# each wait dispatches the gather of the bucket the forward needs next. Every module must
# start only after its bucket's gather completed.

# %%
if __name__ == "__main__":
    gather = runs["gather"]
    rows = timeline_summary(gather["events"])
    order = sorted((r["gather_start"], b) for b, r in rows.items() if b >= 0)
    print("gather dispatch order (bucket ids):", [b for _, b in order])
    print("modules that ran before their bucket was gathered:", gather["stale_reads"])
    plot_param_gather(gather["events"])
    plt.title("overlap_param_gather=True: all-gathers dispatched by forward pre-hooks", fontsize=9)
    plt.tight_layout()
    plt.show()
    assert all(r["gather"]["stale_reads"] == [] for r in per_rank)
    assert [b for _, b in order] == sorted(rows.keys() - {-1}, reverse=True)  # forward order
    for b, r in rows.items():
        if b >= 0:
            assert r["gather_start"] <= r["gather_waited"] <= r["forward"]

# %% [markdown]
# ## Summary
#
# - With overlap, each bucket's reduce-scatter starts the moment its last grad arrives, so
#   ideally only the last (small) bucket is left after backward; without overlap the whole
#   buffer is reduced after it. A CPU trace confirms the order; the saving needs a network
#   that does not take its cycles from the backward.
# - With `overlap_param_gather`, the forward pre-hooks gather each bucket just before the first
#   module that needs it and dispatch the next bucket's gather, in forward order; no module ever
#   runs on a stale weight (the demo checks every module).
#
# ## How production does it
#
# - Megatron-LM records the same intervals with its timers (`megatron/core/timers.py`) and, in
#   detail, with the PyTorch/Nsight profiler (`--profile`, `megatron/training/training.py`);
#   NCCL kernels on their own stream show the overlap directly in Nsight Systems.
# - torchtitan's FSDP2 runs expose the same picture in the PyTorch profiler trace
#   (`--profiling.enable_profiling`): all-gather and reduce-scatter on their own streams.
#
# ## Exercises
#
# 1. Make the buckets 10x smaller. Does the wait after backward get shorter, and what does the
#    per-collective latency do to the total?
#    <details><summary>Hint</summary>
#
#    In `ideal_overlap` the wait after the backward is the
#    last bucket's share of $t_{comm}$, so it shrinks with the bucket. The ideal model has no
#    per-call cost; add the latency term $2(d-1)\alpha$ of [the naive page](naive_ddp.py) per
#    collective and the total grows with the number of buckets.
#
#    </details>
#
# 2. In the all-gather picture, why is the embedding's bucket always the first one dispatched,
#    and what would happen if the model registered its output layer before its embedding?
#    <details><summary>Hint</summary>
#
#    The first pre-hook to run belongs to the first module of
#    the forward, and `finish_param_sync` dispatches its group's gather, then the next one in
#    forward order, which `compute_param_layout` derives from the *registration* order
#    reversed. Work out which bucket the forward's first module would then sit in.
#
#    </details>
