# %% [markdown]
# # 07.10 · Memory: the step in time — compute, kernel by kernel
#
# The ledger of the earlier pages says whether a layout *fits*, and [07.9](calculator.py)'s
# search ranks the layouts that fit by a step time; this page and the next two build that
# time: how long an iteration takes, and why. A step is compute plus every transfer that compute
# could not hide: the gradient reduce-scatter inside the backward (chapter 05), the parameter
# all-gather inside the next forward (chapters 02 and 05), the pipeline's point-to-point sends
# (appendix A), the checkpoint's copy to host and its write to disk (chapter 03), the
# activation copies of offload (chapter 06). This page states the model's inputs and times
# the compute, kernel by kernel from the layout's shapes by appendix C's law, and the bytes of
# a collective over a link; [07.11](step_overlap.py) finds each transfer's window by Megatron's
# rules, and [07.13](step_time.py) adds up the step.
#
# You will build: `Links`, `StepOptions`, `stage_flops`, `stage_compute`, `layer_gemms`,
# `stage_kernel_seconds` and `collective_seconds`.

# %%
from __future__ import annotations

from dataclasses import dataclass

from tinytron.kernels.roofline import KernelLaw, attention_seconds, gemm_seconds, stream_seconds
from tinytron.main_loop.training_log import flops_terms
from tinytron.memory.states import MemoryConfig

__all__ = ["Links", "StepOptions", "stage_flops", "stage_compute", "collective_seconds",
           "STREAM_BYTES", "layer_gemms", "stage_kernel_seconds"]

# %% [markdown]
# ## Why a second step-time model
#
# A step-time estimate that adds every transfer to the compute, as if nothing overlapped, is
# safe for ranking, but it gets the most important design questions wrong. Take the running
# example (the 7B model on 256 H100s, TP2 (SP) · PP2 · DP64, micro-batch 2, 8 micro-batches,
# selective recompute, distributed optimizer), its compute timed kernel by kernel on an H100
# (this page). A rank of the first stage holds about 2 billion parameters (the tied 128 K-token
# embedding included), so its gradient reduce-scatter moves 7.9 GB of fp32 gradients; the
# four DP ranks of a node send it through their four NICs side by side, 200 GB/s: 40 ms.
# Added to a step of about 1.9 seconds that is 2%; hidden it is 0%. Whether it hides depends
# on a single rule: Megatron starts the reduce-scatter only in the backward of the *last*
# micro-batch, and that backward lasts 117 ms. The transfer fits — and the order of the
# buckets makes part of it stick out anyway ([07.13](step_time.py)). On a TP8 layout, one DP rank per node,
# the same gradients would cross one NIC at 50 GB/s and miss the window by far.
#
# So the model of these three pages takes each transfer, finds its window by Megatron's rule, and
# keeps only what sticks out:
#
# $$ t_\text{step} = t_\text{compute} + t_\text{bubble} + t_\text{optimizer} +
#    \sum_\text{items} \max(0,\ t_\text{item} - t_\text{window}) $$
#
# where the max is applied bucket by bucket, layer by layer or micro-batch by micro-batch as
# each rule says, not once for the whole transfer. The same numbers for every layout feed the
# calculator's search ([07.9](calculator.py)), which ranks layouts by this step time.
#
# In small numbers, one transfer of 30 ms in three layouts of the same 100 ms of compute:
#
# | where the transfer may run | window | exposed | step |
# |---|---|---|---|
# | after the compute (no overlap) | 0 ms | 30 ms | 130 ms |
# | behind the last 40 ms, in 3 buckets of 10 ms ready at 60, 80, 100 ms | 40 ms | 10 ms | 110 ms |
# | behind the last 40 ms, in 30 buckets of 1 ms, the last ready at 100 ms | 40 ms | 1 ms | 101 ms |
#
# The window is the same in the last two rows; what changes is how much of the transfer
# can only start once the window has closed. That is why the bucket order, not only the
# bucket sizes, shows up in the step time.
#
# The same question runs through the book's other chapters. Chapter 03's asynchronous save
# and the front page describe the checkpoint's copy to host differently: Megatron blocks for
# it, a staged copy hides it. Rule 4 ([07.11](step_overlap.py)) puts both in numbers, so the choice is a number
# of milliseconds per save rather than a matter of description.

# %% [markdown]
# ## The inputs, with their defaults
#
# A model of time needs rates. They are inputs, one field each, and the defaults are an H100
# SXM node of 8 GPUs, stated so that a reader can replace them with a measurement:
#
# | field | default | why this number |
# |---|---|---|
# | `law` | H100 SXM | appendix C's kernel law: datasheet peak, HBM and SMs, and three stated fractions |
# | `peak_flops`, `mfu` | 989 TFLOP/s, 0.40 | used only without a law (a CPU, whose rate is measured) |
# | `nvlink` | 450 GB/s | NVLink 4: 900 GB/s per GPU both ways, so 450 GB/s one way |
# | `network` | 50 GB/s | one 400 Gb/s InfiniBand NIC per GPU |
# | `pcie` | 50 GB/s | PCIe Gen5 x16: 64 GB/s raw per direction, about 50 reached by copies |
# | `disk` | 1 GB/s | a GPU's share of a node's ~8 GB/s write to the checkpoint store |
# | `memory` | 3.35 TB/s | HBM3, for the optimizer step, which streams its state once |
# | `interference` | 16/132 | NCCL's ring kernels occupy about 16 of the 132 SMs while a hidden DP transfer runs |
#
# Bandwidths are per GPU and per direction, as the collective algorithms need them: a ring
# reduce-scatter or all-gather over $g$ ranks sends $(g-1)/g$ of the buffer through each
# rank's link, an all-reduce twice that. A group uses NVLink when all its ranks share a node
# (Megatron's rank order puts TP innermost, then CP, DP, PP) and the network otherwise —
# and when $k$ of its ranks share a node, NCCL runs $k$ rings side by side through their $k$
# NICs, so the group moves $\min(k \cdot 50, 450)$ GB/s per rank.
# In the running example TP's pairs are neighbors (NVLink), a DP group spans 2 × 64 ranks
# and adjacent pipeline stages are 128 ranks apart (both over the network).
# `reduce_scatter_as_all_reduce` describes gloo, which has no reduce-scatter: torch emulates
# it with an all-reduce (chapter 05's `_comm`), so on CPU the reduce-scatter costs twice.
# `interference` is what a hidden transfer still costs: the compute seconds lost per second
# of a transfer running behind it. On a GPU it is the SMs NCCL's kernels take (the default, 16
# of 132); on a CPU, gloo's thread and the compute share the cores, and
# [07.14](step_published.py)'s CPU check measures it.
#
# <details><summary>Measuring the inputs on a real cluster</summary>
#
# Each default has a measurement that replaces it: the law's fractions
# from a GEMM and a copy timed on the device (appendix C), `network` and `nvlink` from
# NCCL's own tests (their "bus bandwidth" is exactly the per-link rate used here), `pcie`
# from a pinned host-to-device copy, `disk` from the time of one checkpoint save divided
# by its bytes. On a CPU (07.14, and the trainer's own report) the compute rate is measured
# and the law is off.
#
# </details>

# %%
@dataclass(frozen=True)
class Links:
    """The rates the step-time model assumes (defaults: H100 SXM, 8 per node, 400 Gb/s NICs)."""

    peak_flops: float = 989e12
    mfu: float = 0.40
    """Used only without a `law` (a CPU): compute = FLOPs / (peak_flops * mfu)."""
    law: KernelLaw | None = KernelLaw()
    """Appendix C's kernel law of the device; None times compute at peak_flops * mfu."""
    nvlink: float = 450e9
    network: float = 50e9
    pcie: float = 50e9
    disk: float = 1e9
    memory: float = 3.35e12
    gpus_per_node: int = 8
    latency: float = 0.0
    """Fixed seconds per collective or copy (0: bandwidth only; the CPU check measures it)."""
    reduce_scatter_as_all_reduce: bool = False
    interference: float = 16 / 132
    """Compute seconds lost per second of DP transfer hidden behind it (GPU: NCCL's 16 SMs of 132)."""

    @property
    def flops(self) -> float:
        """Achieved FLOP/s of the compute stream."""
        return self.peak_flops * self.mfu

    def link(self, ranks_spanned: int, per_node: int = 1) -> float:
        """NVLink within one node; across nodes, the NICs of the group's `per_node` ranks in a
        node carry its rings side by side, up to NVLink's rate."""
        if ranks_spanned <= self.gpus_per_node:
            return self.nvlink
        return min(self.nvlink, max(1, per_node) * self.network)

# %% [markdown]
# The rates are one input; the run's switches are the other. `StepOptions` holds the overlap
# switches under Megatron's names and the checkpoint's schedule, so that one layout can be
# timed with each switch on and off.

# %%
@dataclass(frozen=True)
class StepOptions:
    """The overlap switches of one run (Megatron's names) and the checkpoint's schedule."""

    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    overlap_p2p_comm: bool = False
    """Megatron allows it only with interleaving (schedules.py:2123)."""
    tp_comm_overlap: bool = False
    """Transformer Engine hides TP's all-gathers and reduce-scatters inside the GEMMs."""
    align_param_gather: bool = True
    """With virtual stages, every rank launches chunk gathers at the same time (Megatron's default)."""
    checkpoint: str = "blocking"
    """"none", "blocking" (Megatron: D2H before the fork) or "staged" (tinytron: D2H hidden)."""
    save_interval: int = 100

# %% [markdown]
# ## Compute: chapter 01's FLOPs, and what one efficiency cannot say
#
# Chapter 01 counts the FLOPs of an iteration exactly (`flops_terms`, Megatron's formula at
# `megatron/training/training.py:411` plus the causal diagonal and the recomputation). Per
# micro-batch and per rank, a stage does its share of the layer terms — $L/p$ of the layers,
# divided over the $t \cdot c$ ranks of its TP and CP groups — and the last stage adds the
# logits. The forward is one third of the non-recomputed FLOPs and the backward two thirds
# (one GEMM for the input gradient, one for the weight gradient), plus the recomputed forward
# that the backward runs first. Worked in small numbers: a stage whose micro-batch costs
# 3 GFLOP forward at 1 TFLOP/s achieved takes 3 ms forward and 6 ms backward.
# Dividing by one efficiency (`mfu`, chapter 01's 40%) folds GEMM quantization, attention,
# the memory-bound kernels and the launches into a single number — and then predicts that
# per-GPU throughput falls as models grow, where every published weak-scaling table shows it
# rising. On a GPU the model therefore times the kernels themselves (next section); the
# FLOP division stays for a CPU, whose matmul rate the trainer measures.
#
# The step of a rank is the pipeline: the layers of the slowest stage set the pace, and a
# first and last stage with the embedding and the logits are not equal to the middle ones.
# `stage_compute` returns the forward and backward seconds of one micro-batch on every stage.
#
# For the running example: a micro-batch is 2 × 4096 tokens; stage 0's 16 layers cost
# 30.8 TFLOP forward and 63.8 TFLOP backward per rank (the backward includes selective
# recompute's second pass through core attention). By the kernels of the next section they
# take 57 and 117 ms on an H100 (540 TFLOP/s); stage 1 adds the logits of a 128,256-token
# vocabulary and the loss: 70 and 135 ms. The last stage is the slowest by 18%, and the
# pipeline runs at its pace.

# %%
def stage_flops(cfg: MemoryConfig, pp_rank: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of one micro-batch on one rank of stage `pp_rank`."""
    model, p = cfg.model, cfg.pipeline_model_parallel_size
    terms = flops_terms(model, cfg.micro_batch_size, recompute=cfg.recompute_granularity)
    layers = sum(v for k, v in terms.items() if k not in ("logits", "recompute"))
    share = 1 / p  # the layers are cut evenly (appendix B's stage_layer_ranges)
    logits = terms["logits"] if pp_rank == p - 1 else 0
    total = layers * share + logits
    ranks = cfg.tensor_model_parallel_size * cfg.context_parallel_size
    return total / 3 / ranks, (total * 2 / 3 + terms["recompute"] * share) / ranks


def stage_compute(cfg: MemoryConfig, links: Links = Links(),
                  options: StepOptions = StepOptions()) -> list[tuple[float, float]]:
    """Per pipeline stage, (forward, backward) seconds of one micro-batch on one of its ranks."""
    if links.law is None:
        return [tuple(f / links.flops for f in stage_flops(cfg, r))
                for r in range(cfg.pipeline_model_parallel_size)]
    return [stage_kernel_seconds(cfg, r, links.law, options.tp_comm_overlap)
            for r in range(cfg.pipeline_model_parallel_size)]

# %% [markdown]
# ## Compute from the shapes: every kernel of a micro-batch, by appendix C's law
#
# One efficiency for every shape cannot be right: a TP8 rank of a 2,048-wide model multiplies
# slivers 256 columns wide that fill a fifth of an H100's SMs, a 16,384-wide one multiplies
# blocks that fill them many times over. So with a device `law` (the default: appendix C's
# [roofline page](../kernels/roofline.py), H100 SXM) the model lists the kernels one
# micro-batch runs on one rank and times each by its own law: GEMMs by tiles and waves,
# flash attention at its stated fraction of the peak, the streaming kernels by their bytes.
#
# Per layer and rank, with $T = b\,s/c$ tokens, $n = T/t$ rows of the residual stream with
# sequence parallelism (else $T$) and $q = a d$, $k = g d$:
#
# | kernel | forward | backward |
# |---|---|---|
# | QKV, projection, fc1, fc2 | GEMMs $T \times \frac{q + 2k}{t} \times h$, $T \times h \times \frac{q}{t}$, $T \times \frac{2f}{t} \times h$, $T \times h \times \frac{f}{t}$ | each twice: input gradient ($M \times K \times N$) and weight gradient ($N \times K \times M$) |
# | attention | $4 b (s^2/2c) d\,a/t$ FLOPs | 2.5× the forward (scores recomputed) |
# | 2 norms, 2 residual adds | 4 and 6 B per element of $n \times h$ | 6 and 6 B |
# | SwiGLU, rotary | 6 B per element of $T \times f/t$; 4 B of $T \times (q + k)/t$ | 10 B; 4 B |
# | the loss (last stage) | logits GEMM $T \times V/t \times h$; 38 B per logit | the GEMM twice; 22 B per logit |
#
# The bytes per element are the loads and stores of the fused kernels of appendix C (C.1,
# C.2) in bf16; the loss's are Megatron's vocab-parallel cross-entropy, which works on fp32
# logits (`megatron/core/tensor_parallel/cross_entropy.py`): a bf16 read and fp32 write,
# the max, the subtraction, the exponential and the normalization forward, the gradient's
# three passes backward. Selective recompute adds the attention forward to the backward,
# full recompute the whole layer's forward. With `tp_comm_overlap` Transformer Engine cuts
# the GEMMs next to a TP collective into pieces along the tokens, and each piece pays its own
# quantization — the price of hiding TP. By its default configuration: QKV and fc1 forward
# in $t$ pieces (the all-gather's ring exchange), projection and fc2 forward in 4 (the
# reduce-scatter's pipeline), their input gradients in $t$, and the rest whole (bulk
# overlap, `megatron/core/extensions/transformer_engine.py` passes the `ub_*` switches).

# %%
STREAM_BYTES = {"norm": (4, 6), "residual": (6, 6), "swiglu": (6, 10), "rotary": (4, 4),
                "loss": (38, 22)}
"""Bytes per element (forward, backward) of the memory-bound kernels (see the table above)."""


def layer_gemms(cfg: MemoryConfig) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K) of the forward GEMMs of one layer on one rank, per micro-batch."""
    m, t = cfg.model, cfg.tensor_model_parallel_size
    tokens = cfg.micro_batch_size * m.seq_length // cfg.context_parallel_size
    q, k = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    return [("qkv", tokens, (q + 2 * k) // t, m.hidden_size),
            ("proj", tokens, m.hidden_size, q // t),
            ("fc1", tokens, 2 * m.ffn_hidden_size // t, m.hidden_size),
            ("fc2", tokens, m.hidden_size, m.ffn_hidden_size // t)]

# %% [markdown]
# Under `tp_comm_overlap` a GEMM runs in pieces, and each piece pays the law's wave
# quantization on its own rows; a GEMM's backward is two GEMMs, the input gradient (in
# pieces too) and the weight gradient.

# %%
def _pieces(name: str, t: int) -> tuple[int, int]:
    """(forward, input-gradient) pieces of a GEMM under Transformer Engine's TP overlap."""
    if name in ("qkv", "fc1"):  # all-gather by ring exchange, t pieces; dgrad in bulk
        return t, 1
    return min(4, t), t  # reduce-scatter pipelined in 4 splits; dgrad's all-gather by ring


def _gemm_fwd_bwd(m: int, n: int, k: int, law: KernelLaw,
                  pieces: tuple[int, int] = (1, 1)) -> tuple[float, float]:
    """(forward, input + weight gradient) seconds of one GEMM, forward and dgrad in pieces."""
    f, d = pieces
    return (f * gemm_seconds(max(1, m // f), n, k, law),
            d * gemm_seconds(max(1, m // d), k, n, law) + gemm_seconds(n, k, m, law))

# %% [markdown]
# A stage's micro-batch is then its layers' GEMMs, attention and streaming kernels, the
# recompute's repeated forward, and on the last stage the logits and the loss.

# %%
def stage_kernel_seconds(cfg: MemoryConfig, pp_rank: int, law: KernelLaw,
                         tp_comm_overlap: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch on a rank of stage `pp_rank`, by kernel."""
    m, t, b = cfg.model, cfg.tensor_model_parallel_size, cfg.micro_batch_size
    tokens = b * m.seq_length // cfg.context_parallel_size
    rows = tokens // t if m.sequence_parallel else tokens
    overlap = tp_comm_overlap and t > 1
    fwd = bwd = 0.0
    for name, mm, nn, kk in layer_gemms(cfg):
        f, g = _gemm_fwd_bwd(mm, nn, kk, law, _pieces(name, t) if overlap else (1, 1))
        fwd, bwd = fwd + f, bwd + g
    heads = m.num_attention_heads // t
    att = 4 * b * m.seq_length ** 2 / 2 / cfg.context_parallel_size * m.head_dim * heads
    att_f, att_b = attention_seconds(att, law), attention_seconds(2.5 * att, law)
    width = {"norm": 2 * rows * m.hidden_size, "residual": 2 * rows * m.hidden_size,
             "swiglu": tokens * m.ffn_hidden_size // t,
             "rotary": tokens * (m.num_attention_heads + m.num_query_groups) * m.head_dim // t}
    mem_f = stream_seconds(sum(STREAM_BYTES[k][0] * n for k, n in width.items()), law)
    mem_b = stream_seconds(sum(STREAM_BYTES[k][1] * n for k, n in width.items()), law)
    layer_f = fwd + att_f + mem_f
    again = {None: 0.0, "selective": att_f, "full": layer_f}[cfg.recompute_granularity]
    layers = m.num_layers // cfg.pipeline_model_parallel_size
    forward, backward = layers * layer_f, layers * (bwd + att_b + mem_b + again)
    if pp_rank == cfg.pipeline_model_parallel_size - 1:  # the logits and the loss
        f, g = _gemm_fwd_bwd(tokens, m.vocab_size // t, m.hidden_size, law)
        logits = tokens * m.vocab_size // t
        forward += f + stream_seconds(STREAM_BYTES["loss"][0] * logits, law)
        backward += g + stream_seconds(STREAM_BYTES["loss"][1] * logits, law)
    return forward, backward

# %% [markdown]
# What the law says about width, drawn: the rate one rank achieves on a micro-batch of one
# layer (4,096 tokens, forward and backward, Megatron's FLOP count over the law's seconds)
# for GPT layers of width 1,024 to 16,384, alone (TP1) and cut over 8 ranks (TP8 with
# sequence parallelism), against the flat 40% a single efficiency would draw. Narrow TP8
# slices fill few of the 132 SMs; wide ones approach the law's 65% main-loop rate, less the
# attention and the memory-bound kernels: from 221 to 590 TFLOP/s at TP8, from 403 to 602
# alone. The gap between the two curves at small widths is what TP costs in compute, before
# it costs anything in communication.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.model.config import ModelConfig

    def layer_rate(h: int, t: int) -> float:
        model = ModelConfig(hidden_size=h, num_layers=1, num_attention_heads=h // 128,
                            num_query_groups=h // 128, ffn_hidden_size=8 * h // 3 // 8 * 8,
                            vocab_size=1024, seq_length=4096, sequence_parallel=t > 1)
        cfg = MemoryConfig(model, tensor_model_parallel_size=t, pipeline_model_parallel_size=1)
        f, b = stage_kernel_seconds(cfg, -1, KernelLaw())
        flops = sum(v for k, v in flops_terms(model, 1).items() if k not in ("logits",
                                                                             "recompute"))
        return flops / t / (f + b) / 1e12

    widths = [1024, 2048, 4096, 8192, 16384]
    rates = {t: [layer_rate(h, t) for h in widths] for t in (1, 8)}
    fig, ax = plt.subplots(figsize=(6, 3))
    for t, ys in rates.items():
        ax.plot(widths, ys, marker="o", label=f"TP{t}, appendix C's law")
    ax.axhline(0.4 * 989, color="gray", ls=":", label="one efficiency (40%)")
    ax.set(xscale="log", xlabel="hidden size", ylabel="TFLOP/s per GPU, one layer")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    assert rates[8] == sorted(rates[8]) and rates[1][-1] > rates[8][0] * 1.3

# %% [markdown]
# *Figure:* TP costs compute before it costs any communication — a narrow slice fills few
# SMs, so per-GPU throughput rises with width, which a single efficiency cannot draw.

# %% [markdown]
# ## Collectives: bytes over a link
#
# A transfer's time is its bytes through one rank's link plus a fixed latency. For a ring
# over $g$ ranks (NCCL's algorithm at these sizes), each rank sends
#
# | collective | bytes through a rank's link |
# |---|---|
# | reduce-scatter, all-gather | $\frac{g-1}{g} N$ |
# | all-reduce | $2\frac{g-1}{g} N$ |
# | point-to-point | $N$ |
#
# of an $N$-byte buffer: at $g = 64$ a reduce-scatter of 40 M fp32 gradients (160 MB) moves
# 157.5 MB, 3.15 ms at 50 GB/s.
# Point-to-point has no ring: the whole tensor crosses one link, once. The same formula
# serves gloo on one machine, where "the link" is the loopback socket and the memory copies
# behind it; 07.14's CPU check measures its rate and latency instead of assuming them,
# and reads a reduce-scatter as the all-reduce gloo runs underneath.
#
# A reduce-scatter and the all-gather that follows it move together exactly what one
# all-reduce moves: the distributed optimizer costs no extra DP bytes, it splits the
# all-reduce in two halves that hide in two different windows. Latency (a few microseconds
# per NCCL call on a GPU network) is left at 0 for the running example: a 64 M-element bucket
# takes milliseconds.

# %%
def collective_seconds(kind: str, nbytes: float, group: int, bandwidth: float,
                       latency: float = 0.0) -> float:
    """Seconds of one ring collective ('reduce_scatter', 'all_gather', 'all_reduce', 'p2p')."""
    if group == 1 and kind != "p2p":
        return 0.0
    factor = {"reduce_scatter": (group - 1) / group, "all_gather": (group - 1) / group,
              "all_reduce": 2 * (group - 1) / group, "p2p": 1.0}
    if kind not in factor:
        raise ValueError(f"kind must be one of {sorted(factor)}, got {kind!r}")
    return latency + factor[kind] * nbytes / bandwidth

# %%
if __name__ == "__main__":  # the worked example: 40 M fp32 gradients over 64 ranks at 50 GB/s
    rs = collective_seconds("reduce_scatter", 160e6, 64, 50e9)
    assert abs(rs - 3.15e-3) < 1e-12 and collective_seconds("all_reduce", 160e6, 64, 50e9) == 2 * rs
    from tinytron.memory.calculator import running_example

    (f0, b0), (f1, b1) = stage_compute(running_example())
    print(f"stage 0: {f0 * 1e3:.0f} + {b0 * 1e3:.0f} ms, stage 1: {f1 * 1e3:.0f} + {b1 * 1e3:.0f} ms")
    assert round(f0 * 1e3) == 57 and round(b0 * 1e3) == 117 and f1 + b1 > 1.15 * (f0 + b0)

# %% [markdown]
# ## Summary
#
# - A step is compute, bubble and optimizer plus what each transfer cannot hide in its
#   window; [07.11](step_overlap.py) finds the windows and [07.13](step_time.py) adds them up.
# - The rates are inputs (`Links`, an H100 SXM node by default), each replaceable by a
#   measurement; the run's overlap switches are `StepOptions`, under Megatron's names.
# - Compute is every kernel of a micro-batch timed by appendix C's law: GEMMs by tiles and
#   waves, flash attention at a stated fraction, streaming kernels by their bytes. In the
#   running example stage 0 takes 57 + 117 ms per micro-batch, the last stage 18% more.
# - A ring collective sends $(g-1)/g$ of the buffer through each rank's link; a
#   reduce-scatter and an all-gather together move one all-reduce.
#
# ## How production does it
#
# Megatron counts an iteration's FLOPs (`megatron/training/training.py:411`) but has no
# step-time model: its timers (chapter 08) measure the phases. NCCL's tests report a "bus
# bandwidth" that is this page's per-link rate, and NeMo's auto-configurator ranks layouts
# by short profiling runs instead of a model.
