# %% [markdown]
# # 05 · Buffers: what overlap looks like, recorded from real runs
#
# Two timelines measured on a real 2-rank gloo world: one backward with the grad collectives
# launched after backward versus from the hooks, and one forward whose parameters arrive bucket
# by bucket through the all-gather the forward pre-hooks wait for.

# %%
from __future__ import annotations

__all__ = ["timeline_summary", "plot_timeline", "plot_param_gather"]

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


def plot_timeline(runs, axes=None):
    """One panel per (title, events) run: grads (dots), collective (bar), backward end (line)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(len(runs), 1, figsize=(10, 1.6 + 1.3 * len(runs)), sharex=True)
    for ax, (title, events) in zip(list(axes), runs):
        rows = timeline_summary(events)
        for event, bucket, t in events:
            if event == "grad":
                ax.plot(t * 1e3, bucket, "|", color="gray", ms=8)
        for bucket, row in rows.items():
            if bucket < 0 or "start" not in row:
                continue
            done = row.get("done", row.get("waited", row["start"]))
            ax.barh(bucket, (done - row["start"]) * 1e3, left=row["start"] * 1e3, height=0.5,
                    color="tab:blue", alpha=0.7)
            ax.plot(row["ready"] * 1e3, bucket, "o", color="tab:orange", ms=5)
        ax.axvline(rows[-1]["backward_end"] * 1e3, color="black", ls="--", lw=1)
        ax.axvline(rows[-1]["synced"] * 1e3, color="tab:red", lw=1.5)
        ax.set_ylabel("bucket")
        ax.set_title(title, fontsize=9)
    axes[-1].set_xlabel("ms since backward started (| grad arrives, o bucket ready, bar = "
                        "reduce-scatter in flight, -- backward ends, red = grads synced)")
    return axes


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
# ## Demo 1: a real 2-rank backward, overlap off and on
#
# Two gloo ranks train a small residual MLP (6 blocks, hidden 256) with the distributed
# optimizer's reduce-scatter. We record the *second* step (the first step only learns the
# golden grad counts). Without overlap Megatron uses one bucket and reduces it after backward;
# with overlap and 200k-element buckets, bucket 0 (the output head and last blocks) is
# reduce-scattered while the earlier blocks are still in backward, and what is left after
# backward is the last, small bucket. On this 2-core CPU the gloo thread competes with backward
# for the same cores, so backward itself gets slower by about what the tail saves; on a GPU the
# bytes move over NVLink/InfiniBand while the SMs compute, which is where overlap pays off.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.buffers._workers import timeline_and_gather_runs
    from tinytron.launch import run_on_ranks

    per_rank = run_on_ranks(timeline_and_gather_runs, 2, timeout=180)
    runs = per_rank[0]  # rank 0's timelines are drawn; the stale-read check covers both ranks
    off, on = runs["off"], runs["on"]
    tail = {}
    for run in (off, on):
        rows = timeline_summary(run["events"])
        tail[run["overlap"]] = (rows[-1]["synced"] - rows[-1]["backward_end"]) * 1e3
        print(f"overlap={run['overlap']}: {len(run['bucket_numels'])} bucket(s) "
              f"{run['bucket_numels']}, backward {rows[-1]['backward_end'] * 1e3:.1f} ms, "
              f"sync after backward {tail[run['overlap']]:.1f} ms")
    plot_timeline([("overlap_grad_reduce=False (one bucket, reduced after backward)", off["events"]),
                   ("overlap_grad_reduce=True (bucket_size=200k, launched from the hooks)",
                    on["events"])])
    plt.tight_layout()
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
#   after backward only the last (small) bucket is left to wait for; without overlap the whole
#   buffer is reduced after backward.
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
# 2. In the all-gather picture, why is the embedding's bucket always the first one dispatched,
#    and what would happen if the model registered its output layer before its embedding?
