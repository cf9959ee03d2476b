# %% [markdown]
# # 07.11 · Memory: the step in time — the windows a transfer can hide in
#
# [07.10](step_compute.py) timed a micro-batch's compute kernel by kernel and a collective's
# bytes over its link. A transfer costs the step only what it cannot hide, and where it may
# hide is set by a rule in Megatron's code. This page reads those rules one by one and turns
# each into a function of small numbers: the gradient reduce-scatter (rule 1), the parameter
# all-gather (rule 2, also with virtual stages), the pipeline's sends (rule 3, with the
# schedule played out) and the checkpoint's copy and write (rule 4). [07.12](step_offload.py)
# adds rule 5, offload, and [07.13](step_time.py) puts the step together.
#
# You will build: `dp_buckets`, `reduce_scatter_exposed`, `all_gather_exposed`,
# `aligned_gather_exposed`, `p2p_seconds`, `pipeline_seconds`, `schedule_1f1b`,
# `checkpoint_bytes` and `checkpoint_items`.

# %%
from __future__ import annotations

import itertools

from tinytron.memory._layout_cache import LAYOUT_CACHE, layout_key
from tinytron.memory.states import MemoryConfig, buffer_layouts
from tinytron.memory.step_compute import (Links, StepOptions, collective_seconds,
                                          stage_compute)

__all__ = ["dp_buckets", "reduce_scatter_exposed", "all_gather_exposed",
           "aligned_gather_exposed", "p2p_seconds", "pipeline_seconds", "schedule_1f1b",
           "checkpoint_bytes", "checkpoint_items"]

# %% [markdown]
# ## The data-parallel buckets, from chapter 05's layout
#
# The gradient buffer is laid out in reverse parameter order and cut into buckets of
# `bucket_size` elements, $\max(40\text{M}, 1\text{M} \cdot d)$ by default
# (`megatron/core/distributed/param_and_grad_buffer.py:915`, the default at
# `megatron/core/distributed/distributed_data_parallel.py:69`): bucket 0 holds the *last*
# layers, whose gradients the backward produces first. Chapter 07's `buffer_layouts` builds
# that exact layout (chapter 05's `compute_param_layout`, padding included) for any stage of
# any layout without a process group.
#
# When does a bucket become ready? When the backward has passed its first parameter (in
# forward order). The backward's time is spent in GEMMs, and a GEMM's FLOPs are proportional
# to its weight's elements (6 per element and token for forward plus backward), so the
# fraction of a micro-batch's backward done when bucket $k$ is ready is the fraction of
# matrix elements in buckets $0..k$. The input embedding is a lookup, no GEMM: its elements
# weigh nothing. The same weights, in forward order, split the forward among the buckets for
# the all-gather below.
#
# The running example's first stage at DP 64: `bucket_size` is $\max(40\text{M}, 64\text{M})$
# = 64 M elements, and one layer holds 109.1 M on a rank (QKV 12.6 M, projection 8.4 M, the
# MLP 88.1 M), so the buckets come out one layer's worth each, shifted by half a layer: 18
# buckets — the final norm with the last layer's MLP (88.1 M), fifteen of 109.1 M (a layer's
# attention and the MLP below it), the first layer's attention (21.0 M), and the tied
# embedding alone (262.7 M), in that order. The second stage has two: its copy of the tied
# output layer, and everything else (1.745 G elements), because Megatron gives every stage but
# the first one bucket. `dp_buckets` caches a layout per (shape, layout, first/middle/last
# stage) in `_layout_cache`: the search asks for thousands of layouts that share a few hundred
# buffers.

# %%
def dp_buckets(cfg: MemoryConfig, pp_rank: int = 0) -> list[dict]:
    """The DP buckets of a stage, in backward order: elements and backward fraction when ready."""
    key = layout_key(cfg, pp_rank)
    if key not in LAYOUT_CACHE:
        LAYOUT_CACHE[key] = _layout_buckets(cfg, pp_rank)
    return LAYOUT_CACHE[key]


def _layout_buckets(cfg: MemoryConfig, pp_rank: int) -> list[dict]:
    """dp_buckets without the cache."""
    buckets = []
    for chunk, (params, layout) in enumerate(buffer_layouts(cfg, pp_rank)):
        work = [0.0] * len(layout.bucket_indices)
        for p in params:
            _, _, bucket = layout.param_index_map[p]
            gemm = p.matrix and "word_embeddings" not in p.name
            work[bucket] += p.count if gemm else 0.0
        for (start, end), w in zip(layout.bucket_indices, work):
            buckets.append({"numel": end - start, "work": w, "chunk": chunk})
    total = sum(b["work"] for b in buckets) or 1.0
    done = 0.0
    for b in buckets:
        done += b["work"] / total
        b["share"], b["ready"] = b.pop("work") / total, min(done, 1.0)
    return buckets


# %% [markdown]
# ## Rule 1: the reduce-scatter hides only behind the last micro-batch's backward
#
# With several micro-batches per step, the gradients of micro-batches $1..m-1$ are only
# accumulated: the schedule runs them inside `no_sync()` and turns grad sync back on just
# before the last backward.
#
# <details><summary>Megatron detail: where grad sync is switched</summary>
#
# `megatron/core/pipeline_parallel/schedules.py:741-742` without a pipeline; in 1F1B
# `:2384` and `:2411` turn grad sync back on just before the last backward, and `:2428`,
# after the cool-down, launches whatever reductions are still pending.
#
# </details>
#
# A bucket's gradient hook counts a parameter
# as ready only when `is_last_microbatch` is set
# (`megatron/core/distributed/param_and_grad_buffer.py:813`; `no_sync` clears it,
# `megatron/core/distributed/distributed_data_parallel.py:480-490`). When every parameter of
# a bucket is ready its reduce-scatter starts (`param_and_grad_buffer.py:820-822`), on one
# communication stream, so the
# buckets go out in order, each after the previous one and not before it is ready.
#
# Worked in small numbers: a backward of 10 ms with three buckets ready at 4, 7 and 10 ms,
# each taking 3 ms to reduce: the first runs 4-7, the second 7-10, the third 10-13. Only the
# last bucket's 3 ms stick out, however long the step is — the last bucket, holding the
# first layers and the embedding, is ready only when the backward ends, so some of the DP
# reduce-scatter is always exposed on the first stage unless that bucket is small.
#
# | ms | 0-4 | 4-7 | 7-10 | 10-13 |
# |---|---|---|---|---|
# | compute | backward | backward | backward | (waits: exposed) |
# | DP stream | idle | bucket 0 | bucket 1 | bucket 2 |
#
# Stage $s > 0$ finishes its last backward earlier than stage 0, by the backwards still to
# run below it, and the step ends when stage 0's does (the optimizer's gradient-norm
# all-reduce joins all ranks). That is Megatron's reason for one bucket on every later
# stage (`megatron/core/distributed/distributed_data_parallel.py:95-106`): its transfer has
# `slack` to hide in.

# %%
def reduce_scatter_exposed(seconds: list[float], ready: list[float], backward: float,
                           slack: float = 0.0, overlap: bool = True) -> tuple[float, list]:
    """(exposed seconds, [(start, end)] per bucket from the last backward's start)."""
    clock, spans = 0.0, []
    for t, r in zip(seconds, ready):
        start = max(clock, r * backward if overlap else backward)  # without overlap: after it
        clock = start + t
        spans.append((start, clock))
    return max(0.0, clock - backward - slack), spans

# %% [markdown]
# Rule 1 on the running example's first stage, drawn: its 18 buckets of fp32 gradients cross
# one DP group of 64 ranks whose four ranks in a node share their NICs, 200 GB/s, behind the
# 117 ms of the last micro-batch's backward.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.memory.calculator import running_example

    example, links = running_example().replace(overlap_grad_reduce=True), Links()
    backward = stage_compute(example, links)[0][1]
    dp, tp = example.data_parallel_size, example.tensor_model_parallel_size
    bw = links.link(tp * dp, min(dp, links.gpus_per_node // tp))
    buckets = dp_buckets(example, 0)
    times = [collective_seconds("reduce_scatter", b["numel"] * example.grad_bytes, dp, bw)
             for b in buckets]
    exposed, spans = reduce_scatter_exposed(times, [b["ready"] for b in buckets], backward)
    fig, ax = plt.subplots(figsize=(6, 2.2))
    ax.broken_barh([(0, backward * 1e3)], (1, 0.6), color="tab:orange")
    ax.broken_barh([(a * 1e3, (b - a) * 1e3) for a, b in spans], (0, 0.6),
                   facecolors=["tab:red", "salmon"] * len(spans), edgecolor="white")
    ax.axvline(backward * 1e3, color="k", ls=":")
    ax.set(yticks=[0.3, 1.3], yticklabels=["DP stream", "last backward"],
           xlabel="ms from the start of the last backward")
    plt.tight_layout()
    plt.show()
    print(f"{len(buckets)} buckets, {sum(times) * 1e3:.1f} ms in a {backward * 1e3:.0f} ms "
          f"window, {exposed * 1e3:.1f} ms exposed (the last bucket: {times[-1] * 1e3:.1f} ms)")
    assert len(buckets) == 18 and 0.3 < sum(times) / backward < 0.4
    assert 0.1 < exposed / sum(times) < 0.25 and exposed > times[-1]

# %% [markdown]
# *Figure:* the reduce-scatter fits its window three times over and still sticks out — the
# last bucket, the embedding, is ready only when the backward ends.

# %% [markdown]
# ## Rule 2: the all-gather hides behind the first forward, one bucket ahead
#
# With the distributed optimizer each DP rank updates its shard of every bucket, then the
# updated bf16 parameters must be all-gathered before the next forward uses them. With
# `overlap_param_gather` Megatron does not gather in the optimizer step: a forward pre-hook
# on each module waits for its bucket
# (`megatron/core/distributed/distributed_data_parallel.py:413-447`). The first bucket (in
# forward order, the *last* of the buffer) is dispatched by that first wait itself, and
# each wait dispatches the next bucket before returning
# (`megatron/core/distributed/param_and_grad_buffer.py:512-529`; the chain runs in reverse
# bucket order, `distributed_data_parallel.py:295-306`). So exactly one all-gather is in
# flight at a time, and:
#
# - the first bucket's all-gather is fully exposed (nothing computes while it runs);
# - bucket $k+1$'s all-gather hides behind the forward of bucket $k$'s layers, and only what
#   exceeds it is exposed.
#
# Worked: three buckets of 3 ms each, forward 4 ms per bucket: exposed 3 + 0 + 0 = 3 ms.
# With 6 ms all-gathers: 6 + 2 + 2 = 10 ms. Later micro-batches find the parameters in place.
#
# | ms | 0-6 | 6-10 | 10-12 | 12-16 | 16-18 | 18-22 |
# |---|---|---|---|---|---|---|
# | compute | waits | forward 0 | waits | forward 1 | waits | forward 2 |
# | DP stream | gather 0 | gather 1 | gather 1 | gather 2 | gather 2 | idle |

# %%
def all_gather_exposed(seconds: list[float], forward: list[float],
                       overlap: bool = True) -> tuple[float, list]:
    """(exposed seconds, [(start, end)] per bucket) of the first forward, buckets in forward order."""
    if not overlap:  # gathered inside the optimizer step, nothing computes meanwhile
        spans = list(itertools.accumulate(seconds, initial=0.0))
        return spans[-1], list(zip(spans, spans[1:]))
    clock, exposed, spans = 0.0, 0.0, []
    done = seconds[0] if seconds else 0.0  # dispatched by the first pre-hook, at time 0
    for k, f in enumerate(forward):
        wait = max(0.0, done - clock)
        exposed += wait
        clock += wait
        spans.append((done - seconds[k], done))
        if k + 1 < len(seconds):
            done = clock + seconds[k + 1]  # dispatched when the wait returns
        clock += f
    return exposed, spans


if __name__ == "__main__":  # the worked examples of rules 1 and 2
    assert reduce_scatter_exposed([3, 3, 3], [0.4, 0.7, 1.0], backward=10)[0] == 3
    assert all_gather_exposed([3, 3, 3], [4, 4, 4])[0] == 3
    assert all_gather_exposed([6, 6, 6], [4, 4, 4])[0] == 10

# %% [markdown]
# ### Rule 2 with virtual stages: the gathers launched together
#
# With interleaving, `overlap_param_gather` and `align_param_gather` (Megatron's default), the
# schedule takes the gathers out of the pre-hooks' chain: every rank launches the all-gathers
# of its chunks 0 and 1 at the start of the step
# (`megatron/core/pipeline_parallel/schedules.py:1161-1163`), and the gather of chunk $c + 1$
# when its micro-batch counter reaches the one where chunk $c$ begins on rank 0 — rank $r$
# looks $r$ micro-batches ahead (`schedules.py:1283-1296`), so all ranks launch the same
# chunk at the same wall-clock time. One communication stream runs them in order. Rank $r$
# needs chunk $c$ when its first micro-batch of that chunk arrives: in the fill, after
# $c\,p + r$ chunk-forwards of $f$ seconds. So later stages hide their gathers behind the fill
# instead of adding them up along it; the step pays the largest wait of any rank.
#
# Worked: $p = 2$, two chunks, $f = 1$ ms, 3 ms per chunk's gather. Rank 0: chunk 0 ready at
# 3, needed at 0 (waits 3); chunk 1 ready at 6, needed at $2 + 3 = 5$ (waits 1): 4 ms. Rank 1:
# chunk 0 needed at 1 (waits 2), chunk 1 at $3 + 2 = 5$ (waits 1): 3 ms. The step: 4 ms,
# where adding the first waits along the fill would say 3 + 3 = 6 ms and more chunks more.

# %%
def aligned_gather_exposed(seconds: list[float], chunk_forward: float, p: int,
                           rank: int) -> float:
    """Rank `rank`'s waits for its chunks' gathers (launched aligned) in the pipeline's fill."""
    comm, waited = 0.0, 0.0
    for c, t in enumerate(seconds):
        launch = 0.0 if c < 2 else (c - 1) * p * chunk_forward
        comm = max(comm, launch) + t
        need = (c * p + rank) * chunk_forward + waited
        waited += max(0.0, comm - need)
    return waited


if __name__ == "__main__":  # the worked example
    assert aligned_gather_exposed([3, 3], 1, 2, 0) == 4 and aligned_gather_exposed([3, 3], 1, 2, 1) == 3

# %% [markdown]
# ## Rule 3: the pipeline's sends, with and without `overlap_p2p_comm`
#
# Between stages each micro-batch sends its activation forward and its gradient back: a
# tensor of $s/c \times b \times h$ elements, $s/(c\,t)$ with sequence parallelism
# (`megatron/core/pipeline_parallel/schedules.py:2080-2085`). That split is the only one: at
# `e03878b5f` Megatron no longer scatters the tensor over the TP ranks before a send and
# gathers it after (older versions did), so without sequence parallelism each of the $t$
# ranks sends the whole tensor through its own NIC. In 1F1B Megatron's sends and
# receives are blocking (`batch_p2p_comm`, `megatron/core/model_parallel_config.py:309`):
# the compute stream waits for each. Only the interleaved schedule can post them early and
# compute meanwhile (`overlap_p2p_comm`, `model_parallel_config.py:304`; rejected without
# interleaving, `schedules.py:2123-2126`).
#
# On the critical path of 1F1B lie the fill (a forward through every stage), $m - 1$ steady
# steps of the slowest stage, and the drain (a backward through every stage). So with
# $F_s + B_s$ the compute of one micro-batch on stage $s$ and $v$ model chunks per rank,
#
# $$ t_\text{pipeline} = m \max_s (F_s + B_s) + \tfrac{1}{v}\Big(\sum_s (F_s + B_s) -
#    \max_s (F_s + B_s)\Big) + t_\text{p2p} $$
#
# The middle term is the bubble: $(p-1)/(v m)$ of the compute for equal stages, as chapter 01
# says. Each transfer of $\tau$ seconds is exposed on the fill and the drain, $2(p-1)\tau$;
# in the steady state a blocking step exchanges one activation and one gradient, $2\tau$ per
# chunk and micro-batch; with `overlap_p2p_comm` only what exceeds a chunk's forward is left —
# in the steady state. The warm-up's forwards and the cool-down's backwards still exchange
# blocking (`schedules.py:1575-1672` and `:1896-2011`): on rank 0 that is $W = 2(p-1) +
# (v-1)p$ of each (`schedules.py:891-892`), so $2W\tau$ stays exposed — at PP8, $v = 5$,
# $m = 64$, 92 of 640 transfers, 14%.
# With $v$ chunks per rank the fill and the drain pass through chunks $v$ times smaller, so
# the bubble shrinks by $v$ while the number of transfers grows by $v$: interleaving trades
# bubble for p2p, which is why Megatron lets only the interleaved schedule overlap its p2p.
# The model does not play the interleaved order; it uses the same closed form with $v$.
#
# Worked: $p = 2$, $m = 4$, $F = 1$, $B = 2$ ms, $\tau = 0.1$ ms: $4 \cdot 3 + 3 = 15$ ms of
# compute and bubble, plus $0.2 + 0.6 = 0.8$ ms of blocking p2p.
#
# In the running example a transfer is 2 bytes × 4096/2 tokens × 2 × 4096 = 33.6 MB (SP
# sends a TP rank's slice of the sequence), 0.67 ms over the network (adjacent stages are 128
# ranks apart, on different nodes): 16 transfers on the critical path, 10.7 ms a step.

# %%
def p2p_seconds(cfg: MemoryConfig, links: Links = Links()) -> float:
    """Seconds of one activation (or gradient) transfer between adjacent stages."""
    m, t, c = cfg.model, cfg.tensor_model_parallel_size, cfg.context_parallel_size
    seq = m.seq_length // c // (t if m.sequence_parallel else 1)
    nbytes = cfg.param_bytes * seq * cfg.micro_batch_size * m.hidden_size
    apart = t * c * cfg.data_parallel_size  # rank distance of adjacent stages
    return collective_seconds("p2p", nbytes, 2, links.link(apart + 1), links.latency)


def pipeline_seconds(stages: list[tuple[float, float]], num_microbatches: int,
                     num_chunks: int = 1, p2p: float = 0.0,
                     overlap_p2p_comm: bool = False) -> dict:
    """Compute, bubble and exposed p2p of the schedule (1F1B, interleaved with num_chunks > 1)."""
    m, v, p = num_microbatches, num_chunks, len(stages)
    per_mb = [f + b for f, b in stages]
    compute = m * max(per_mb)
    bubble = (sum(per_mb) - max(per_mb)) / v
    if p == 1:
        return {"compute": compute, "bubble": 0.0, "p2p": 0.0}
    if overlap_p2p_comm:  # rank 0's warm-up and cool-down exchanges stay blocking
        blocking = min(m * v, 2 * (p - 1) + (v - 1) * p)
        chunk_forward = min(f for f, _ in stages) / v
        return {"compute": compute, "bubble": bubble,
                "p2p": 2 * blocking * p2p + 2 * (m * v - blocking) * max(0.0, p2p - chunk_forward)}
    return {"compute": compute, "bubble": bubble, "p2p": 2 * (p - 1) * p2p + 2 * (m * v - 1) * p2p}


if __name__ == "__main__":  # the worked example above
    got = pipeline_seconds([(1e-3, 2e-3)] * 2, 4, p2p=1e-4)
    assert abs(got["compute"] + got["bubble"] - 15e-3) < 1e-12 and abs(got["p2p"] - 8e-4) < 1e-12

# %% [markdown]
# ## Playing the schedule
#
# To draw the step, `schedule_1f1b` plays the schedule: every stage runs its forwards and
# backwards in 1F1B order (warm-up forwards, then one forward and one backward, then the
# cool-down backwards), each starting when its stage is free and its input has arrived
# $\tau$ after the neighbor finished. `step_timeline` (in `_step_time_io`) then lays the
# other lanes around the first stage's compute: the all-gather spans before and inside the first forward, the
# reduce-scatter spans from the start of the last backward, the optimizer, the checkpoint's
# copy (staged: inside the next iteration's compute) and write, and the offload copies of
# each layer. The played schedule and the closed form of rule 3 must agree; the closed form
# is slightly pessimistic, since a blocking send that falls into a wait costs nothing.
#
# Played in small numbers ($p = 2$, $m = 4$, $F = 1$, $B = 2$ ms, $\tau = 0$): stage 0 runs
# F0 F1 at 0-2, waits for stage 1's B0 (F0 arrives there at 1, runs 1-2, B0 2-4), runs B0 at
# 4-6, F2 6-7, B1 7-9, F3 9-10, B2 10-12, B3 13-15: 15 ms, as rule 3's formula says
# ($4 \cdot 3 + 3$). The 3 ms of waiting are the bubble. The played
# schedule feeds the drawing of a whole step on [07.14](step_published.py).

# %%
def schedule_1f1b(stages: list[tuple[float, float]], m: int, tau: float,
                  first_wait: list[float] | None = None) -> list[list[tuple]]:
    """Per stage, [(kind, micro-batch, start, end)] of a played 1F1B schedule with p2p tau."""
    p = len(stages)
    first_wait = first_wait or [0.0] * p  # the all-gather's exposed part, in the first forward
    order = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        order.append(ops + [("B", i) for i in range(m - warm, m)])
    done, clock, out = {}, [0.0] * p, [[] for _ in range(p)]
    pending = [list(o) for o in order]
    while any(pending):
        for s in range(p):
            while pending[s]:
                kind, i = pending[s][0]
                dep = (s - 1, "F", i) if kind == "F" else (s + 1, "B", i) if s < p - 1 else \
                    (s, "F", i)
                if dep[0] in (-1,) or (kind == "F" and s == 0):
                    ready = 0.0
                elif dep not in done:
                    break
                else:
                    ready = done[dep] + (tau if dep[0] != s else 0.0)
                start = max(clock[s], ready)
                end = start + stages[s][0 if kind == "F" else 1] + (
                    first_wait[s] if (kind, i) == ("F", 0) else 0.0)
                sends = (kind == "F" and s < p - 1) or (kind == "B" and s > 0)
                done[(s, kind, i)], clock[s] = end, end + (tau if sends else 0.0)  # blocking
                out[s].append((kind, i, start, end))
                pending[s].pop(0)
    return out

# %% [markdown]
# ## Rule 4: the checkpoint's copy to host, and its write
#
# An asynchronous save (chapter 03) has two parts. The device-to-host copy of the rank's
# state must finish before the optimizer changes it; the disk write then runs in a
# background process. Each rank copies what it writes: with the fully parallel save the
# replicated bf16 weights are split over the $d$ DP ranks, and the distributed optimizer's
# fp32 masters and moments are already a shard. Megatron's `TemporalAsyncCaller` runs the
# copy (`preload_fn`) and then `torch.cuda.synchronize()` before it forks the writer
# (`megatron/core/dist_checkpointing/strategies/async_utils.py:264-273`): the copy *blocks*
# the training loop. Staged instead — start the copy on a side stream right after the step
# and wait only before the next `optimizer.step` — it hides behind the next iteration's
# forward and backward. That is tinytron's staged path, not Megatron's. The write hides as
# long as it finishes within `save_interval` steps; otherwise the next save waits for it.
# Megatron blocks for a reason: the writer is a forked process, and a forked child cannot
# use the parent's CUDA context, so every byte it writes must already sit in host memory
# when it starts. Staging keeps that property: the wait moves from the fork to the next
# optimizer step, which is the first moment the state changes.
#
# Worked: 0.5 GB per rank at 50 GB/s is 10 ms; blocking every 100 steps of 2 s, it costs
# 0.005%; staged, nothing, since 10 ms is far below the 2 s of compute behind it.
# In the running example a first-stage rank writes 439 MB per save: a 64th of its 4.0 GB of
# bf16 weights (63 MB), its shard of the fp32 masters (125 MB) and of the two Adam moments
# (251 MB) — 8.8 ms of copy at 50 GB/s and 0.44 s of write at 1 GB/s.

# %%
def checkpoint_bytes(cfg: MemoryConfig, pp_rank: int = 0) -> float:
    """Bytes one rank copies to host and writes per save (fully parallel save)."""
    from tinytron.memory.states import state_ledger

    states = state_ledger(cfg, pp_rank)
    dp_cp = cfg.data_parallel_size * cfg.context_parallel_size
    optimizer = states["master_params"] + states["optimizer_state"] + states["host_optimizer"]
    return states["weights"] / dp_cp + optimizer / (1 if cfg.use_distributed_optimizer else dp_cp)


def checkpoint_items(cfg: MemoryConfig, links: Links, options: StepOptions,
                     step_seconds: float, compute_seconds: float) -> list[dict]:
    """The copy and the write of one save: seconds, window, exposed per save."""
    if options.checkpoint == "none":
        return []
    if options.checkpoint not in ("blocking", "staged"):
        raise ValueError(f"checkpoint must be none, blocking or staged, got {options.checkpoint!r}")
    nbytes = checkpoint_bytes(cfg)
    d2h = links.latency + nbytes / links.pcie
    write = links.latency + nbytes / links.disk
    copy_window = compute_seconds if options.checkpoint == "staged" else 0.0
    write_window = options.save_interval * step_seconds
    return [{"item": f"checkpoint D2H ({options.checkpoint})", "bytes": nbytes, "seconds": d2h,
             "window": copy_window, "exposed": max(0.0, d2h - copy_window), "per": "save"},
            {"item": "checkpoint write", "bytes": nbytes, "seconds": write,
             "window": write_window, "exposed": max(0.0, write - write_window), "per": "save"}]

# %%
if __name__ == "__main__":  # the played example and rule 4 on the running example
    played = schedule_1f1b([(1e-3, 2e-3)] * 2, 4, 0.0)
    assert abs(played[0][-1][3] - 15e-3) < 1e-12
    ckpt = checkpoint_items(example, links, StepOptions(), 2.0, 1.6)[0]
    print(f"checkpoint: {ckpt['bytes'] / 1e6:.0f} MB, copy {ckpt['seconds'] * 1e3:.1f} ms")
    assert round(ckpt["bytes"] / 1e6) == 439 and ckpt["exposed"] == ckpt["seconds"]

# %% [markdown]
# ## Summary
#
# - The gradient reduce-scatter hides only behind the last micro-batch's backward, bucket by
#   bucket in reverse order, so the last bucket is always exposed; later stages have the
#   backwards below them as slack, hence Megatron's one bucket there.
# - The parameter all-gather hides behind the first forward, one bucket ahead, so the first
#   bucket is always exposed; with virtual stages the gathers launch aligned and the step
#   pays the largest wait of any rank.
# - The pipeline's sends block in 1F1B; `overlap_p2p_comm` (interleaved only) hides the
#   steady state's, not the warm-up's and cool-down's. The played schedule agrees with the
#   closed form.
# - The checkpoint's copy blocks in Megatron and hides in the next step when staged; the
#   write hides within `save_interval` steps.
#
# ## How production does it
#
# The rules are read from `megatron/core/distributed/param_and_grad_buffer.py` (buckets,
# `register_grad_ready`, `start_grad_sync`, `finish_param_sync`),
# `megatron/core/distributed/distributed_data_parallel.py` (the forward pre-hooks,
# `no_sync`), `megatron/core/pipeline_parallel/schedules.py` (where grad sync is switched on,
# p2p overlap) and `megatron/core/dist_checkpointing/strategies/async_utils.py` (the blocking
# copy before the fork). Holistic Trace Analysis reads chapter 08's Chrome traces and reports
# the exposed communication these rules predict.
