# %% [markdown]
# # 07.4 · Memory: the peak — micro-batches in flight and what lives only for a moment
#
# Page 07.3 counted what one micro-batch keeps. A rank holds several at once when it
# pipelines, and the peak is reached *inside* an operation, when temporaries sit on top of
# everything kept. This page replays the schedule a rank runs and adds those temporaries.
#
# You will build: `schedule_ops`, `p2p_buffers` and `activation_peak`.

# %%
from __future__ import annotations

from tinytron.main_loop.interleaved import get_pp_rank_microbatches, get_schedule_table
from tinytron.main_loop.schedules import num_warmup_microbatches_1f1b
from tinytron.memory.activations import (Dims, attention_kernel, chunk_saved, layer_saved,
                                         saved_bytes)
from tinytron.memory.states import MemoryConfig

__all__ = ["schedule_ops", "p2p_buffers", "activation_peak"]

# %% [markdown]
# ## How many micro-batches are in flight
#
# Without pipelining each micro-batch runs forward and backward back to back: one in flight.
# With 1F1B stage $r$ runs $\min(p - r - 1, m)$ warmup forwards before its first backward, so
# it holds up to $\min(p - r, m)$ micro-batches (chapter 01). Interleaved, rank $r$ runs
# $2(p - r - 1) + (v - 1)\,g$ forwards first, each of a chunk of $L/(p v)$ layers, in the
# order of chapter 01's schedule table. Rather than a factor, the ledger replays that order —
# `F` adds a chunk's activations, `B` removes them — and takes the maximum, so the first
# chunk's embedding and the last chunk's head are counted exactly as often as they are live.
#
# The peak is not reached *between* operations but inside one, so each step adds what is
# alive only while it runs (found op by op with chapter 01's meter, then written down):
#
# | moment | what is alive on top of the kept tensors |
# |---|---|
# | end of a layer's forward | fc2's output and the new residual (the layer input and the mid-layer residual are alive too, but the norms keep them) |
# | TP collective after fc2 | fc2's partial sum over the whole local sequence and the collective's output |
# | math attention | $q k^\top$ and its masked copy, q, k, v cast to fp32 — before the layer's MLP half is kept |
# | cross-entropy forward | bf16 logits, their fp32 copy, the shifted logits, their exponential: 14 bytes per logit (12 in fp32), 4 of which stay as the softmax; at TP 1 one `log_softmax` output replaces the last two and becomes the softmax in place: 10 bytes (8 in fp32) |
# | fc2 backward | the incoming grad (gathered over the sequence under SP), fc2's input grad and its weight grad, with the SwiGLU chain still kept |
# | SwiGLU backward | the incoming grad and the grads of gate, up and fc1's output, once the product and silu are freed |
# | attention backward | the grads of the output, q, and the (gathered) k and v |
# | fc1 / output-layer backward | the weight gradient (`.grad`, until DDP's hook adds it to `main_grad` and frees it); under SP also fc1's input, gathered again from the kept slice (A.2) |
# | end of the first chunk's backward | the embedding's weight gradient, $P\,V h / t$; tied on one stage, the output layer's as well and their sum, $3\,P\,V h$ |
#
# With one stage holding both ends of tied embeddings, the output layer's weight gradient waits
# in `.grad` until the embedding adds its share at the very end of the backward. With
# pipelining, a stage that sends activations forward still holds the previous micro-batch's
# output in its send while the next forward runs (`p2p_buffers`); 1F1B lets go of a round's
# output, incoming gradient and input gradient once the round has sent them, so nothing of the
# previous round is left during a steady-state backward; the received inputs and gradients
# are already counted (as kept stage inputs, and as the incoming grad of each backward
# event).
#
# Measured on the 42-case grid of page 07.6, this replay is within 2.6% of the measured peak
# (median 0.95%, 07.6's table, the CPU math-attention cases included); what remains is the
# timing of small buffers inside one operation.
#
# **Moments that hide under a larger one.** A replay that takes the maximum only shows its
# errors where the maximum falls. At TP 1 [page A.3's](../parallel/vocab_parallel.py)
# single-rank loss writes one `log_softmax` output, so on several layouts the peak sits in the
# backward, and three moments there are easy to get wrong. The end of a backward with the
# table tied on one stage holds the output layer's weight gradient, the embedding's and their
# sum, which autograd writes into a third tensor. The block method checkpoints a chunk's
# *first* layers, so their re-run comes after the later layers' backward has freed what those
# kept. And a re-run forks the RNG: with dropout on a CPU the tracker's three streams are
# snapshotted and restored as new tensors, six 5,056-byte states beside the re-created
# activations.
#
# <details><summary>Megatron detail: how the three moments were found</summary>
#
# The TP 1 cross-entropy used to build the shifted logits and their exponential side by side,
# and on most of the grid that forward chain was the peak; the single `log_softmax` output,
# 4 bytes per logit less, moved the peak into the backward on several layouts, where these
# three moments had been written down too small or too large. The tied sum: a CP 4 case
# measured 196,956 B against 189,312 predicted. The block re-run: counting both at once put
# a case 10.6% too high. The RNG fork: selective core-attention and MLP recompute with
# dropout measured 732,052 B, 689,408 predicted before.
#
# </details>

# %%
def schedule_ops(cfg: MemoryConfig, pp_rank: int,
                 max_steady_rounds: int | None = None) -> list[tuple[str, int, int]]:
    """("F" or "B", chunk, micro-batch) in the order this pipeline rank runs them.

    `max_steady_rounds` keeps only that many 1F1B rounds of the steady state (its live set
    repeats with period p·v rounds, so 2·p·v rounds already hold its maximum).
    """
    p, v, m = cfg.pipeline_model_parallel_size, cfg.num_chunks, cfg.num_microbatches
    if p == 1:
        rounds = m if max_steady_rounds is None else min(m, max_steady_rounds)
        return [op for mb in range(rounds) for op in (("F", 0, mb), ("B", 0, mb))]
    if v == 1:
        warmup = num_warmup_microbatches_1f1b(p, pp_rank, m)
        table = [(mb, 0) for mb in range(m)]
    else:
        table = get_schedule_table(m, v, p)
        _, _, warmup, _ = get_pp_rank_microbatches(m, v, p, p, pp_rank)
    fwd = [("F", chunk, mb) for mb, chunk in table]
    bwd = [("B", v - 1 - chunk, mb) for mb, chunk in table]
    ops = fwd[:warmup]
    steady = len(table) - warmup
    for i in range(steady if max_steady_rounds is None else min(steady, max_steady_rounds)):
        ops += [fwd[warmup + i], bwd[i]]
    return ops + bwd[steady:]

# %% [markdown]
# Each `F` and `B` of that order adds, for as long as it runs, the temporaries of the table
# above. A chunk's forward reaches its largest moment at the end of a layer, in the TP
# collective after fc2, inside math attention, or (on the last chunk) in the cross-entropy chain;
# the function takes the largest of those that apply.

# %%
def _math_scores(cfg: MemoryConfig, x: Dims) -> int:
    """Math attention's temporaries: q k^T (and its masked copy under CP), q, k, v in fp32."""
    e = 4 if cfg.device == "cpu" else x.P
    copies = 2 if cfg.context_parallel_size > 1 else 1
    return copies * e * x.b * x.a_t * x.s_c * x.s + e * x.b * x.d * (x.a_t * x.s_c
                                                                     + 2 * x.g_t * x.s)


def _mlp_half(cfg: MemoryConfig) -> int:
    """What a layer keeps from its MLP half (the pre-MLP norm and the MLP)."""
    return saved_bytes([s for s in layer_saved(cfg) if s.module in ("mlp_norm", "mlp")])


def _forward_transient(cfg: MemoryConfig, x: Dims, head: bool) -> int:
    """Bytes alive in a chunk's forward on top of what it keeps, at its largest moment."""
    unit = x.P * x.s_r * x.b * x.h  # one residual-stream tensor
    rope = 0  # RoPE's tables are the model's cache (page B.4), not a forward temporary
    # the layer's input and the mid-layer residual are alive, but the norms keep both (B.2)
    resid = 0
    end_of_layer = resid + 2 * unit + rope  # fc2's output and the new residual
    t = cfg.tensor_model_parallel_size
    # TP: fc2's partial sum (the whole local sequence) and the collective's output
    collective = resid + (t if cfg.model.sequence_parallel else 1) * unit + unit + rope \
        if t > 1 else 0
    layer = max(end_of_layer, collective)
    if attention_kernel(cfg) == "math":  # q k^T (and its masked copy under CP), q/k/v cast
        # to fp32, while the MLP half is not kept yet
        layer = max(layer, _math_scores(cfg, x) + unit + rope - _mlp_half(cfg))
    if not head:
        return layer
    logits = x.b * x.s_c * x.v_t
    # logits (, fp32 copy), and z beside exp(z); at TP 1 log_softmax writes only log p, which
    # becomes the kept softmax in place (page A.3)
    one_rank = cfg.tensor_model_parallel_size == 1
    chain = ((2 + 4 if x.P == 2 else 4) + (0 if one_rank else 4)) * logits
    return max(layer, chain + (0 if x.P == 4 else unit) + rope)

# %% [markdown]
# The backward's moments are the SwiGLU, attention and fc1 backwards of a layer, each on top of
# whatever the stage still holds at that point: a tied output-layer gradient waiting in
# `.grad`, the head's saved tensors already freed, and the tensors a recompute re-created.

# %%
def _backward_transient(cfg: MemoryConfig, x: Dims, head: bool, tied_here: bool,
                        head_kept: int = 0, recomputed: int = 0, later_kept: int = 0) -> int:
    """Bytes alive in a chunk's backward on top of what it kept, at its largest moment."""
    unit = x.P * x.s_r * x.b * x.h
    table_grad = x.P * x.v_t * x.h  # the .grad of an embedding or output matrix
    # SwiGLU backward: grads of gate, up and fc1's output while the product and silu are freed
    mlp = unit + 2 * x.P * x.s_c * x.b * x.f_t
    # attention backward: grads of the output, q, and (gathered) k and v; the math kernel
    # holds one more s x s tensor (a probability grad arrives as a saved one is released)
    attn = unit + x.P * x.b * (2 * x.a_t * x.s_c + 2 * x.g_t * x.s) * x.d
    if attention_kernel(cfg) == "math":
        attn = unit + (4 if cfg.device == "cpu" else x.P) * x.b * x.a_t * x.s_c * x.s
    # fc1's backward: its input grad and its weight grad, once the MLP's saved tensors are gone
    fc1 = unit + x.P * x.s_c * x.b * x.h + x.P * 2 * x.f_t * x.h - 2 * x.P * x.s_c * x.b * x.f_t
    sp = cfg.model.sequence_parallel and cfg.tensor_model_parallel_size > 1
    if sp:
        fc1 += x.P * x.s_c * x.b * x.h  # the input slice gathered again for the weight gradient
    # fc2's backward: the grad in (gathered over the sequence under SP), fc2's input grad and
    # its weight grad, before the SwiGLU chain is freed
    fc2 = unit + (x.P * x.s_c * x.b * x.h if sp else 0) + x.P * x.s_c * x.b * x.f_t \
        + x.P * x.h * x.f_t
    # one stage holding embedding and head with tied weights: the output layer's weight grad
    # waits in .grad through the layers' backward until the embedding adds its own
    held = table_grad if tied_here else 0
    # on the last chunk the layers' backward starts after the head's saved tensors are freed
    freed = head_kept if head else 0
    # a recompute re-creates its run's (or module's) saved tensors before their backward; the
    # block method's run is the chunk's first layers, so the later layers kept normally have
    # had their backward (and freed what they kept) by the time it is re-created
    events = [e + held - freed + r for e in (mlp, attn, fc1, fc2)
              for r in ((recomputed - later_kept, 0) if later_kept else (recomputed,))]
    if head:  # softmax.clone() as the gradient; then the output layer's weight gradient, with
        logits = x.b * x.s_c * x.v_t  # the softmax freed and the logits' grad in P bytes
        events += [4 * logits, table_grad + (x.P - 4) * logits]
    return max(events)

# %% [markdown]
# Three smaller pieces complete a chunk's transients: the very end of the first chunk's
# backward (the embedding's weight gradient, and with tied weights the sum of both table
# gradients), the bytes a recompute re-creates inside one backward (with the RNG states its
# fork copies), and the function that gathers the three moments of one chunk; for the block
# method it also passes the bytes the later, normally kept layers free before the re-run.

# %%
def _late_backward(cfg: MemoryConfig, x: Dims, parts: dict) -> int:
    """First chunk, end of backward: the embedding's saved ids, the grad in, its weight grad."""
    if not parts["embedding"]:
        return 0
    unit = x.P * x.s_r * x.b * x.h
    table = x.P * x.v_t * x.h
    held = table if parts["head"] and cfg.model.tie_embeddings else 0
    # the grad arriving at the embedding, its [b, s, h] copy, and the table's weight grad
    lookup = saved_bytes(parts["embedding"]) + unit + x.P * x.s_c * x.b * x.h + table + held
    # tied on one stage, autograd then adds the two table grads into a third tensor
    summed = saved_bytes(parts["embedding"]) + 3 * table if held else 0
    return max(lookup, summed)


def _recomputed(cfg: MemoryConfig) -> int:
    """Bytes a recompute re-creates inside one backward: a run of layers, or a module's inside."""
    if cfg.recompute_granularity is None:
        return 0
    # the re-run forks the RNG: a snapshot of the tracker's 3 CPU streams, and their restored
    # copies (the model uses the tracker only with dropout; CUDA states live off the device)
    forked = 2 * 3 * 5056 if cfg.device == "cpu" and cfg.model.dropout > 0 else 0
    layer = saved_bytes(layer_saved(cfg, recompute=False))
    if cfg.recompute_granularity == "full":
        return forked + layer * (cfg.recompute_num_layers if cfg.recompute_method == "uniform"
                                 else 1)
    return forked + layer - saved_bytes(layer_saved(cfg))


def _transients(cfg: MemoryConfig, parts: dict) -> tuple[int, int, int]:
    """(forward, backward, end-of-backward) bytes of a chunk beyond what it keeps."""
    x = Dims.of(cfg)
    head = bool(parts["head"])
    tied_here = head and bool(parts["embedding"]) and cfg.model.tie_embeddings
    block = cfg.recompute_granularity == "full" and cfg.recompute_method == "block"
    later = saved_bytes([e for e in parts["layers"] if e.module != "recompute"]) if block else 0
    backward = _backward_transient(cfg, x, head, tied_here, saved_bytes(parts["head"]),
                                   _recomputed(cfg), later)
    return _forward_transient(cfg, x, head), backward, _late_backward(cfg, x, parts)

# %% [markdown]
# Last, the messages a send still holds, and the replay itself: `activation_peak` walks the
# schedule, adds a chunk's kept bytes at each `F` and removes them at each `B`, and records the
# largest sum of kept bytes, the running step's transient and the messages in transit. With
# the peak it keeps what the peak is made of — the chunks in flight at that moment and the
# transient of the step running — so that 07.7's comparison with Megatron's estimate can
# take the peak apart without replaying the schedule a second time.

# %%
def p2p_buffers(cfg: MemoryConfig, pp_rank: int) -> int:
    """Messages still held by their sends: the last output during the next forward (all but
    the last stage). A backward holds none: a 1F1B round lets go of its gradients once sent.
    """
    p = cfg.pipeline_model_parallel_size
    x = Dims.of(cfg)
    unit = x.P * x.s_r * x.b * x.h
    if p == 1 or (pp_rank == p - 1 and cfg.num_chunks == 1):
        return 0
    return unit


# %% [markdown]
# The replay proper: each `F` adds its chunk's kept bytes and runs its forward transient on
# top; each `B` runs its backward transient, then lets go of what the chunk kept. The largest
# sum seen, and what it was made of, is the peak.

# %%
def activation_peak(cfg: MemoryConfig, pp_rank: int, leave_out: tuple[str, ...] = ()) -> dict:
    """Replay the schedule: the most activation bytes live at once on this rank, and when.

    `leave_out` drops saved entries whose name starts with one of these strings (page 07.6
    leaves out what the meter cannot see).
    """
    kept, transient = {}, {}
    for chunk in range(cfg.num_chunks):
        parts = {k: [e for e in v if not e.what.startswith(leave_out or ("\0",))]
                 for k, v in chunk_saved(cfg, pp_rank, chunk).items()}
        kept[chunk] = sum(saved_bytes(v) for k, v in parts.items() if k != "host")
        transient[chunk] = _transients(cfg, parts)
    live, peak, in_flight, most, when, at_peak = 0, 0, 0, 0, None, 0
    chunks, made_of = [], ([], 0)  # the chunks in flight; (in flight, transient) at the peak
    p2p = p2p_buffers(cfg, pp_rank)
    period = 2 * cfg.pipeline_model_parallel_size * cfg.num_chunks
    for kind, chunk, mb in schedule_ops(cfg, pp_rank, max_steady_rounds=period):
        if kind == "F":  # the previous micro-batch's output may still be in its send
            transit, step = p2p, transient[chunk][0]
            chunks.append(chunk)
            during, holding = live + kept[chunk] + step + transit, list(chunks)
            live, in_flight = live + kept[chunk], in_flight + 1
        else:  # a backward: the previous round's messages are already let go
            transit, before = 0, list(chunks)
            chunks.remove(chunk)
            during, holding, step = max((live + transient[chunk][1], before, transient[chunk][1]),
                                        (live - kept[chunk] + transient[chunk][2], list(chunks),
                                         transient[chunk][2]), key=lambda x: x[0])
            live, in_flight = live - kept[chunk], in_flight - 1
        most = max(most, in_flight + (kind == "B"))
        if during > peak:
            peak, when, at_peak, made_of = during, (kind, chunk, mb), transit, (holding, step)
    return {"peak": peak, "activations": peak - at_peak, "p2p_buffers": at_peak, "at": when,
            "max_in_flight": most, "per_chunk": kept, "transient": transient,
            "in_flight_at_peak": made_of[0], "transient_at_peak": made_of[1]}


# %% [markdown]
# ## Demo: the in-flight counts of the running example
#
# The 1F1B and the interleaved schedule of the running example ($p = 2$, $m = 8$), replayed
# per stage: how many chunk-micro-batches are in flight at most, where the peak is, and the
# live activation bytes over the schedule of stage 0.
#
# What the cell prints, worked from the parts of 07.3 (flash attention, no dropout, selective
# recompute; one micro-batch of stage 0's 16 layers and embedding keeps 10.876 GiB, of stage
# 1's 16 layers and head 12.926 GiB):
#
# | schedule, stage | in flight at most | peak | at | made of |
# |---|---|---|---|---|
# | 1F1B, stage 0 | 2 | 22.01 GiB | backward of micro-batch 0 | $2 \cdot 10.876$ + the backward's 0.26 GiB transient |
# | 1F1B, stage 1 | 1 | 17.85 GiB | forward of micro-batch 0 | $12.926$ + the cross-entropy chain's 4.92 GiB |
# | interleaved ($v = 2$), stage 0 | 5 | 27.45 GiB | backward of chunk 1, micro-batch 1 | 5 chunk-micro-batches of about 5.44 GiB + 0.26 GiB |
# | interleaved ($v = 2$), stage 1 | 3 | 23.32 GiB | forward of chunk 1, micro-batch 0 | 23.29 GiB of activations + 0.03 GiB of p2p buffers |
#
# Two things follow. The first stage holds the most under 1F1B ($p - r = 2$ micro-batches
# against 1), but the last stage's single micro-batch comes close, because its forward ends
# in the fp32 logits chain: $4\,b\,s\,V/t$ bytes per fp32 copy of the logits, 1.96 GiB at
# $V/t = 64{,}128$, and at its worst moment the chain holds about two and a half of them
# (4.92 GiB). A fused cross-entropy (appendix C) removes most of that.
# Interleaving buys a smaller bubble with memory: stage 0 goes from 22.01 to 27.45 GiB,
# Megatron's factor $1 + (p-1)/(p v) = 1.25$ on its 22 GiB.
#
# The transient terms (0.156, 0.25 and 0.583 GiB on stage 0; 4.92 and 1.96 GiB on the last
# stage) are the part of this page written down from the meter's readings, so their
# agreement with the meter in 07.6 is a fit, not a prediction (07.6 says which of its
# comparisons are independent).

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.model.config import llama_7b_config

    big = MemoryConfig(llama_7b_config(sequence_parallel=True, recompute_granularity="selective"),
                       tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                       data_parallel_size=64, micro_batch_size=2, num_microbatches=8,
                       use_distributed_optimizer=True)
    fig, ax = plt.subplots(figsize=(7, 2.6))
    for v in (None, 2):
        cfg = big.replace(virtual_pipeline_model_parallel_size=v)
        for r in range(2):
            pk = activation_peak(cfg, r)
            print(f"vpp={v}, stage {r}: max in flight {pk['max_in_flight']} chunk-micro-batches, "
                  f"peak {pk['peak'] / 2**30:,.2f} GiB at {pk['at']}")
        live, trace = 0, []
        for kind, chunk, _ in schedule_ops(cfg, 0):
            live += activation_peak(cfg, 0)["per_chunk"][chunk] * (1 if kind == "F" else -1)
            trace.append(live / 2**30)
        ax.step(range(len(trace)), trace, where="post", label=f"stage 0, v = {v or 1}")
    ax.set_xlabel("forward / backward steps of one iteration")
    ax.set_ylabel("kept GiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    assert [activation_peak(big, r)["max_in_flight"] for r in range(2)] == [2, 1]
    assert activation_peak(big.replace(virtual_pipeline_model_parallel_size=2), 0)[
        "max_in_flight"] == 5

# %% [markdown]
# ## Summary
#
# - The schedule decides the multiplier: one micro-batch without pipelining, $\min(p - r, m)$
#   with 1F1B, and the replayed interleaved order with virtual stages — not a factor, the
#   actual sequence, so the embedding and the head are counted as often as they are live.
# - The peak sits inside an operation: the logits chain of the cross-entropy on the last
#   stage, a backward on the others; the transients are written down from measurements.
#
# ## How production does it
#
# - Megatron: `megatron/core/pipeline_parallel/schedules.py` (warmup counts; the interleaved
#   schedule table), `megatron/training/theoretical_memory_usage.py:314-338` (the interleaving
#   factor and the $\min(1, m/p)$ discount that replace this replay).
# - Fused cross-entropy kernels (appendix C; Megatron's `--cross-entropy-loss-fusion`) exist
#   mostly to remove the fp32 logits chain from the last stage's peak.
#
# ## Exercises
#
# 1. Replay the running example with $m = 1$: which stage holds the most, and why does
#    Megatron's $\min(1, m/p)$ factor get this case right?
#
#    <details><summary>Answer</summary>
#
#    Stage 1, now: stage 0 holds one micro-batch,
#    $10.876 + 0.258$ = 11.13 GiB, while stage 1 keeps its 17.85 GiB (12.926 kept + the 4.92 GiB
#    logits chain). With $m = 1 < p$ no stage can have more than one micro-batch in flight,
#    and $\min(1, 1/2)$ halves the first stage's two micro-batches to one, which is what the
#    replay finds. The formula speaks only for the first stage, so it does not see that the last
#    one is now the larger.
#
#    </details>
#
# 2. Double the micro-batch size and halve $m$: what happens to each stage's peak?
#
#    <details><summary>Answer</summary>
#
#    Each about doubles: with $b = 4$, $m = 4$ stage 0
#    peaks at 44.00 GiB ($2 \cdot 21.751$ + 0.50 GiB transient) and stage 1 at 35.70 GiB
#    (25.853 + a 9.85 GiB logits chain). Every kept and transient term is linear in $b$, and
#    $m = 4 \ge p$ still gives 2 and 1 micro-batches in flight, so halving $m$ saves nothing
#    here; it only lengthens the bubble's share of the step.
#
#    </details>
