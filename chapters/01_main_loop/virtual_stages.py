# %% [markdown]
# # 01 · Schedules: virtual stages and the interleaved table
#
# [01.5](schedules.py) finished 1F1B, which leaves every stage idle for $p - 1$ micro-batch
# slots at the start and at the end of the iteration. Interleaving cuts those slots smaller:
# each pipeline rank holds $v$ non-adjacent pieces of the model ("virtual stages", model
# chunks), so a micro-batch visits every rank $v$ times and each visit is $1/v$ of a stage's
# work. This page builds the plan every rank follows — Megatron's schedule table, its
# constraints and each rank's warmup count — and what it costs in memory;
# [01.7](interleaved.py) runs it.

# %%
from __future__ import annotations

__all__ = ["get_schedule_table", "check_interleaving", "get_pp_rank_microbatches"]

# %% [markdown]
# ## Virtual stages and what they buy
#
# With $p = 2$ ranks, $v = 2$ chunks and 8 layers, rank 0 holds layers 0-1 and 4-5, rank 1 holds
# 2-3 and 6-7 (appendix B's `build_stage_models`). A micro-batch goes rank 0 → 1 → 0 → 1: the
# pipeline is $p\,v = 4$ "virtual stages" deep, but each one takes $1/v$ of the time. The
# ramp-up and ramp-down still cost $p - 1$ slots, now of the short kind, so the bubble shrinks
# by $v$ (Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM*, arXiv:2104.04473, §2.2.2): relative to the ideal time it is
# $\frac{1}{v}\cdot\frac{p-1}{m}$, as a fraction of the iteration
#
# $$\text{bubble} = \frac{p-1}{v\,m + p - 1}.$$
#
# The price: $v$ times more point-to-point messages, and more activations in flight — the
# first rank runs more forwards before its first backward (below), a memory factor of
# $1 + \frac{p-1}{p\,v}$ over 1F1B (chapter 07).
#
# ## The schedule table
#
# Every rank walks the same list of $m\,v$ **virtual micro-batches**, `(micro-batch, chunk)`
# pairs. Megatron builds it in groups of $g$ = `microbatch_group_size_per_vp_stage`
# (default $p$): take micro-batches $[0, g)$ through chunk 0, then the same ones through chunk
# 1, …, then the next group; the last group takes whatever is left (`get_schedule_table`,
# `schedules.py:916`). The backward walks the same list with the chunk reversed, $v - 1 - c$.
# Megatron's own example, $p = 2$, $g = 3$, $m = 5$, $v = 2$, from the comments of
# `forward_backward_pipelining_with_interleaving` (`schedules.py:946`):
#
# | virtual id | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 |
# |---|---|---|---|---|---|---|---|---|---|---|
# | micro-batch | 0 | 1 | 2 | 0 | 1 | 2 | 3 | 4 | 3 | 4 |
# | chunk (forward) | 0 | 0 | 0 | 1 | 1 | 1 | 0 | 0 | 1 | 1 |
# | chunk (backward) | 1 | 1 | 1 | 0 | 0 | 0 | 1 | 1 | 0 | 0 |
#
# Why groups of at least $p$: micro-batch 0 leaves chunk 0 of the last rank after $p$ slots
# and comes back to chunk 1 of rank 0. If rank 0 had fewer than $p$ micro-batches to push
# through chunk 0 in the meantime it would idle, waiting for it. Hence the constraints the
# interleaved function checks before it starts: $p \le g \le m$, and a last group
# $m \bmod g$ that is either empty or at least $p$ long. With the default $g = p$ that is
# simply "$m$ divisible by $p$".
#
# <details><summary>Megatron detail: two exception types</summary>
#
# Megatron raises a
# `ValueError` and a `RuntimeError`; tinytron raises `ValueError` for both, naming the
# numbers.
#
# </details>
#
# ```mermaid
# flowchart LR
#   subgraph R0["rank 0"]
#     c00["chunk 0: layers 0-1"]
#     c01["chunk 1: layers 4-5"]
#   end
#   subgraph R1["rank 1"]
#     c10["chunk 0: layers 2-3"]
#     c11["chunk 1: layers 6-7"]
#   end
#   c00 -- "send_forward" --> c10 -- "send_forward (wraps to rank 0)" --> c01 --> c11
# ```

# %%
def get_schedule_table(num_microbatches: int, num_model_chunks: int,
                       microbatch_group_size_per_vp_stage: int) -> list[tuple[int, int]]:
    """The (micro-batch, chunk) of each forward virtual micro-batch, in execution order."""
    m, v, g = num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage
    table = []
    for first in range(0, m, g):
        group = range(first, min(first + g, m))  # the last group takes what is left
        table.extend((mb, chunk) for chunk in range(v) for mb in group)
    return table


def check_interleaving(pp_size: int, num_microbatches: int,
                       microbatch_group_size_per_vp_stage: int) -> None:
    """ValueError unless p <= g <= m and the last group (m mod g) is empty or >= p."""
    p, m, g = pp_size, num_microbatches, microbatch_group_size_per_vp_stage
    if not p <= g <= m:
        raise ValueError(f"microbatch_group_size_per_vp_stage ({g}) must lie in [pp ({p}), "
                         f"num_microbatches ({m})]")
    if 0 < m % g < p:
        raise ValueError(f"num_microbatches ({m}) mod microbatch_group_size_per_vp_stage ({g}) "
                         f"= {m % g} must be 0 or >= pp ({p}): a shorter last group leaves "
                         "the first stage waiting (with the default group size: m % pp != 0)")

# %% [markdown]
# ## How far ahead each rank runs
#
# Rank $r$ runs $w_r = 2\,(p - r - 1) + (v - 1)\,g$ forwards before its first backward
# (`get_pp_rank_microbatches`, `schedules.py:856`): $(v-1)\,g$ on every rank — the first
# micro-batch must pass through all chunks but the last before any backward can start — plus
# two slots per rank below it (one for the forward to reach the end, one for the gradient to
# come back). If that reaches $m\,v$ everything is warmup (then cooldown): no steady state.
# Forward-only runs everything as "warmup".
#
# The running example with $v = 2$ ($m = 8$, $p = 2$, $g = p = 2$, 8 layers per chunk):
#
# | rank | warmup $w_r$ | steady rounds $m v - w_r$ | 1F1B ($v = 1$) warmup |
# |---|---|---|---|
# | 0 | $2 \cdot 1 + 1 \cdot 2 = 4$ | 12 | 1 |
# | 1 | $0 + 2 = 2$ | 14 | 0 |
#
# Rank 0 holds up to $w_0 + 1 = 5$ chunk-activations of half a stage each, 2.5 stage-sized
# micro-batches against 1F1B's 2: the factor $1 + \frac{p-1}{p\,v} = 1.25$. The bubble drops
# from $1/9 \approx 11\%$ to $(p-1)/(v m + p - 1) = 1/17 \approx 5.9\%$.

# %%
def get_pp_rank_microbatches(num_microbatches: int, num_model_chunks: int,
                             microbatch_group_size_per_vp_stage: int, pp_size: int, pp_rank: int,
                             forward_only: bool = False) -> tuple[int, bool, int, int]:
    """(total m*v, all in warmup?, warmup count, remaining) for this rank."""
    total = num_microbatches * num_model_chunks
    if forward_only:
        warmup = total
    else:
        warmup = 2 * (pp_size - pp_rank - 1)
        warmup += (num_model_chunks - 1) * microbatch_group_size_per_vp_stage
    all_warmup = warmup >= total
    warmup = min(warmup, total)
    return total, all_warmup, warmup, total - warmup

# %% [markdown]
# ## Demo: Megatron's example and the running example, from the table
#
# No process group is needed: the table and the warmup counts are plain arithmetic, the same
# on every rank. First Megatron's documented example ($p = 2$, $g = 3$, $m = 5$, $v = 2$),
# against the table above; then the running example with $v = 2$ and 4 against 1F1B; then
# the three ways a group size can be refused.

# %%
if __name__ == "__main__":
    table = get_schedule_table(5, 2, 3)
    print("virtual id   ", " ".join(f"{k:2d}" for k in range(10)))
    print("micro-batch  ", " ".join(f"{mb:2d}" for mb, _ in table))
    print("chunk        ", " ".join(f"{c:2d}" for _, c in table))
    print("warmup per rank:", [get_pp_rank_microbatches(5, 2, 3, 2, r)[2] for r in range(2)])
    p, m = 2, 8
    print(f"running example, 1F1B: rank 0 holds {p} stages' activations, bubble "
          f"{(p - 1) / (m + p - 1):.1%}")
    for v in (2, 4):
        warmups = [get_pp_rank_microbatches(m, v, p, p, r)[2] for r in range(p)]
        held = (warmups[0] + 1) / v  # rank 0's chunk activations, in stage-sized units
        print(f"running example, v = {v}: warmup {warmups}, rank 0 holds {held:.2f} stages' "
              f"activations, bubble {(p - 1) / (v * m + p - 1):.1%}")
    for g, m_bad in ((1, 8), (9, 8), (3, 7)):
        try:
            check_interleaving(2, m_bad, g)
        except ValueError as e:
            print("refused:", e)

# %% [markdown]
# The claims: Megatron's table column by column, the warmup counts of the two tables above,
# the memory factor $1 + \frac{p-1}{p v}$, and every refusal.

# %%
if __name__ == "__main__":
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert [get_pp_rank_microbatches(5, 2, 3, 2, r)[2] for r in range(2)] == [5, 3]
    assert [get_pp_rank_microbatches(8, 2, 2, 2, r)[2] for r in range(2)] == [4, 2]
    assert get_pp_rank_microbatches(8, 2, 2, 2, 0) == (16, False, 4, 12)
    assert get_pp_rank_microbatches(8, 2, 2, 2, 0, forward_only=True) == (16, True, 16, 0)
    for v in (2, 4):  # rank 0: (w_0 + 1) / v stages against 1F1B's p
        w0 = get_pp_rank_microbatches(8, v, 2, 2, 0)[2]
        assert (w0 + 1) / v / 2 == 1 + (2 - 1) / (2 * v)
    for g, m_bad in ((1, 8), (9, 8), (3, 7)):
        try:
            check_interleaving(2, m_bad, g)
            raise AssertionError(f"g = {g}, m = {m_bad} was accepted")
        except ValueError:
            pass
    check_interleaving(2, 8, 2)  # the default g = p with m divisible by p

# %% [markdown]
# ## Summary
#
# - Interleaving gives each rank $v$ model chunks; every rank walks the same table of $m\,v$
#   (micro-batch, chunk) pairs, built in groups of $g$ micro-batches per chunk; the backward
#   walks it with the chunks reversed.
# - Rank $r$ runs $2(p-r-1) + (v-1)g$ warmup forwards (capped at $m v$); $p \le g \le m$ and a
#   last group of 0 or at least $p$ micro-batches, else a `ValueError` naming the numbers.
# - The bubble shrinks from $(p-1)/(m+p-1)$ to $(p-1)/(v m + p - 1)$; the first rank pays with
#   more activations in flight, a factor $1 + \frac{p-1}{p v}$ with $g = p$, and every rank
#   with $v$ times more messages.
#
# ## How production does it
#
# - Megatron-LM: `get_schedule_table` (`megatron/core/pipeline_parallel/schedules.py:916`)
#   and `get_pp_rank_microbatches` (`:856`), called by
#   `forward_backward_pipelining_with_interleaving` (`:946`), whose comments hold the example
#   above.
# - PyTorch: `torch.distributed.pipelining.ScheduleInterleaved1F1B` builds a per-rank action
#   list from a similar table, which can be inspected before running.
#
# ## Exercises
#
# 1. Run Megatron's example with $g = 5$ (one group). How do the warmup counts and the peak
#    memory on rank 0 change?
#
#    <details><summary>Answer</summary>
#
#    $w_r = 2(p - r - 1) + (v - 1)g$ with $p = 2$, $v = 2$,
#    $m = 5$: $g = 3$ gives 5 and 3, $g = 5$ gives 7 and 5 (`get_pp_rank_microbatches`), out of
#    $m v = 10$ steps. Rank 0 then holds up to $w_0 + 1 = 8$ chunk activations instead of 6, a
#    third more, and its steady state shrinks from 5 rounds to 3.
#
#    </details>
#
# 2. Derive the memory factor $1 + \frac{p-1}{p v}$ from the warmup count with $g = p$.
#
#    <details><summary>Answer</summary>
#
#    With $g = p$, rank 0 warms up $w_0 = 2(p-1) + (v-1)p$
#    forwards and holds at most $w_0 + 1 = vp + p - 1$ chunk activations, each $1/v$ of a
#    stage: $p + \frac{p-1}{v}$ stage activations. 1F1B holds $p$ on rank 0. The ratio is
#    $1 + \frac{p-1}{p v}$; for $p = 2$, $v = 2$ that is 5 chunk activations, 2.5 stages, 1.25.
#
#    </details>
#
# 3. The running example with $v = 4$ (4 layers per chunk): what are the bubble, rank 0's
#    warmup and its memory factor over 1F1B?
#
#    <details><summary>Answer</summary>
#
#    $p = 2$, $m = 8$, $g = 2$: bubble
#    $(p-1)/(v m + p - 1) = 1/33 \approx 3.0\%$; $w_0 = 2 \cdot 1 + 3 \cdot 2 = 8$, so rank 0
#    holds 9 chunk activations of a quarter stage, 2.25 stages against 1F1B's 2: the factor
#    $1 + \frac{1}{8} = 1.125$.
#
#    </details>
