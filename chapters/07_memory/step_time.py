# %% [markdown]
# # 07.8 · Memory: the step in time — what overlaps, and what stays exposed
#
# The ledger of the earlier pages says whether a layout *fits*; this page says how long its
# iteration takes, and why. A step is compute plus every transfer that compute could not hide:
# the gradient reduce-scatter inside the backward (chapter 05), the parameter all-gather inside
# the next forward (chapters 02 and 05), the pipeline's point-to-point sends (appendix A), the
# checkpoint's copy to host and its write to disk (chapter 03), the activation copies of
# offload (chapter 06). Each of them can hide only in a particular window, set by a rule in
# Megatron's code, and a transfer longer than its window shows up in the step time.
#
# Compute is timed kernel by kernel from the layout's shapes by appendix C's law, so a
# narrow TP slice and a wide one cost what their GEMMs cost. The next page
# ([07.9](step_published.py)) holds the model against Megatron's published H100
# throughput and against real runs of the trainer on this machine.
#
# You will build: `Links`, `StepOptions`, `layer_gemms`, `stage_kernel_seconds`,
# `stage_compute`, `collective_seconds`, `dp_buckets`, `reduce_scatter_exposed`,
# `all_gather_exposed`, `aligned_gather_exposed`, `pipeline_seconds`, `tp_layer_seconds`,
# `checkpoint_items`, `offload_table`, `best_offload_modules`, `estimate_step` and
# `schedule_1f1b`.

# %%
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from tinytron.kernels.roofline import KernelLaw, attention_seconds, gemm_seconds, stream_seconds
from tinytron.main_loop.training_log import flops_terms
from tinytron.memory._layout_cache import LAYOUT_CACHE, layout_key
from tinytron.memory.activations import _offloaded, layer_saved
from tinytron.memory.states import MemoryConfig, buffer_layouts

__all__ = ["Links", "StepOptions", "StepItem", "StepTime", "stage_flops", "stage_compute",
           "collective_seconds",
           "dp_buckets", "reduce_scatter_exposed", "all_gather_exposed", "p2p_seconds",
           "pipeline_seconds", "checkpoint_items", "offload_table", "best_offload_modules",
           "estimate_step", "schedule_1f1b", "optimizer_seconds", "layer_seconds",
           "checkpoint_bytes", "offload_exposed", "OFFLOAD_MODULES", "STREAM_BYTES",
           "layer_gemms", "stage_kernel_seconds", "aligned_gather_exposed", "tp_layer_seconds"]

# %% [markdown]
# ## Why a second step-time model
#
# A step-time estimate that adds every transfer to the compute, as if nothing overlapped, is
# safe for ranking, but it gets the most important design questions wrong. Take the running
# example (the 7B model on 256 H100s, TP2 (SP) · PP2 · DP64, micro-batch 2, 8 micro-batches,
# selective recompute, distributed optimizer), its compute timed kernel by kernel on an H100
# (below). A rank of the first stage holds about 2 billion parameters (the tied 128 K-token
# embedding included), so its gradient reduce-scatter moves 7.9 GB of fp32 gradients; the
# four DP ranks of a node send it through their four NICs side by side, 200 GB/s: 40 ms.
# Added to a step of about 1.9 seconds that is 2%; hidden it is 0%. Whether it hides depends
# on a single rule: Megatron starts the reduce-scatter only in the backward of the *last*
# micro-batch, and that backward lasts 117 ms. The transfer fits — and the order of the
# buckets makes part of it stick out anyway (below). On a TP8 layout, one DP rank per node,
# the same gradients would cross one NIC at 50 GB/s and miss the window by far.
#
# So the model of this page takes each transfer, finds its window by Megatron's rule, and
# keeps only what sticks out:
#
# $$ t_\text{step} = t_\text{compute} + t_\text{bubble} + t_\text{optimizer} +
#    \sum_\text{items} \max(0,\ t_\text{item} - t_\text{window}) $$
#
# where the max is applied bucket by bucket, layer by layer or micro-batch by micro-batch as
# each rule says, not once for the whole transfer. The same numbers for every layout feed the
# calculator's search (07.7), which ranks layouts by this step time.
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
# it, a staged copy hides it. Rule 4 below puts both in numbers, so the choice is a number
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
# of a transfer running behind it. On a GPU the copy engines and the network are separate
# from the tensor cores and the default 0 ignores the few SMs NCCL occupies; on a CPU, gloo's
# thread and the compute share the cores, and 07.9's CPU check measures it.
#
# On a real cluster each default has a measurement that replaces it: the law's fractions
# from a GEMM and a copy timed on the device (appendix C), `network` and `nvlink` from
# NCCL's own tests (their "bus bandwidth" is exactly the per-link rate used here), `pcie`
# from a pinned host-to-device copy, `disk` from the time of one checkpoint save divided
# by its bytes. On a CPU (07.9, and the trainer's own report) the compute rate is measured
# and the law is off. The `interference` line was measured on a CPU by 07.9's check;
# on a GPU it is the SMs NCCL's kernels take.

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
    ax.legend(fontsize=7)
    plt.tight_layout()
    plt.show()
    assert rates[8] == sorted(rates[8]) and rates[1][-1] > rates[8][0] * 1.3

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
# behind it; 07.9's CPU check measures its rate and latency instead of assuming them,
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

# %% [markdown]
# ## Rule 5: offload, module by module, against one layer's compute
#
# Chapter 06 moves the activations a module saves to host memory right after the module's
# forward, on a side stream, and brings them back one layer ahead in the backward
# (`megatron/core/pipeline_parallel/fine_grained_activation_offload.py`; the modules are
# `attn_norm`, `qkv_linear`, `core_attn`, `attn_proj`, `mlp_norm`,
# `megatron/core/transformer/transformer_config.py:1127-1146`). All copies of a layer share
# one PCIe direction, and the next layer produces its own copies, so in steady state the
# copies of one layer must fit in one layer's forward (device to host) and one layer's
# backward (host to device); what does not fit piles up and is exposed, layer after layer
# and micro-batch after micro-batch. The bytes come from chapter 07's `layer_saved` with
# chapter 06's rule of what moves (`_offloaded`: tensors of at least
# `min_offloaded_tensor_size` elements, the attention output once for `core_attn` and once
# for `attn_proj`).
# Prefetching one layer ahead means the copy back of layer $i-1$ overlaps the backward of
# layer $i$: the window is one layer's backward, twice its forward plus recomputation, so
# for the same bytes the forward (copy out) is always the binding window.
# Not modeled: on many servers a GPU's PCIe link is shared with its NIC (GPUDirect RDMA
# crosses the same switch), so offload's copies and the DP traffic compete; the stated 50
# GB/s is then an upper bound.

# %%
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")


def _offloaded_bytes(cfg: MemoryConfig, modules: tuple[str, ...]) -> int:
    """Bytes per layer and micro-batch that offloading `modules` copies each way."""
    if not modules:
        return 0
    model = cfg.model.replace(fine_grained_activation_offloading=True,
                              offload_modules=list(modules))
    sized = cfg.replace(model=model)
    return sum(e.nbytes for e in _offloaded(sized, layer_saved(sized))[1])


def layer_seconds(cfg: MemoryConfig, links: Links = Links()) -> tuple[float, float]:
    """(forward, backward) seconds of one layer and micro-batch on one rank."""
    if links.law is not None:  # a stage without the logits, divided by its layers
        per = cfg.model.num_layers // cfg.pipeline_model_parallel_size
        return tuple(x / per for x in stage_kernel_seconds(cfg, -1, links.law))
    terms = flops_terms(cfg.model, cfg.micro_batch_size, recompute=cfg.recompute_granularity)
    layers = sum(v for k, v in terms.items() if k not in ("logits", "recompute"))
    per = cfg.model.num_layers * cfg.tensor_model_parallel_size * cfg.context_parallel_size
    return (layers / 3 / per / links.flops,
            (layers * 2 / 3 + terms["recompute"]) / per / links.flops)

# %% [markdown]
# `offload_table` puts each module alone against the layer's compute, and
# `best_offload_modules` searches every valid set (`attn_proj` needs `core_attn`, as
# chapter 06 checks) for the one that moves the most bytes and still hides in both
# directions — the default this page suggests for `offload_modules` on a GPU.

# %%
def _module_bytes(cfg: MemoryConfig, name: str) -> int:
    """Bytes one module's offload adds (attn_proj counted on top of core_attn)."""
    if name == "attn_proj":
        return (_offloaded_bytes(cfg, ("core_attn", "attn_proj"))
                - _offloaded_bytes(cfg, ("core_attn",)))
    return _offloaded_bytes(cfg, (name,))


def offload_table(cfg: MemoryConfig, links: Links = Links()) -> list[dict]:
    """Per module (and all five): bytes per layer, copy seconds, the windows, whether it hides."""
    forward, backward = layer_seconds(cfg, links)
    rows = [(name, _module_bytes(cfg, name)) for name in OFFLOAD_MODULES]
    rows.append(("all five", _offloaded_bytes(cfg, OFFLOAD_MODULES)))
    out = []
    for name, nbytes in rows:
        copy = links.latency + nbytes / links.pcie if nbytes else 0.0
        out.append({"module": name, "bytes": nbytes, "copy": copy, "forward": forward,
                    "backward": backward, "hides": copy <= forward and copy <= backward})
    return out

# %% [markdown]
# The search over module sets, and the exposed time of whatever set a run configures: per
# layer, what the copy out exceeds the forward by plus what the copy back exceeds the
# backward by, for every offloaded layer and micro-batch.

# %%
def best_offload_modules(cfg: MemoryConfig, links: Links = Links()) -> list[str]:
    """The valid module set with the most bytes whose copies hide in one layer's compute."""
    forward, backward = layer_seconds(cfg, links)
    best, best_bytes = [], 0
    for n in range(1, len(OFFLOAD_MODULES) + 1):
        for combo in itertools.combinations(OFFLOAD_MODULES, n):
            if "attn_proj" in combo and "core_attn" not in combo:
                continue
            nbytes = _offloaded_bytes(cfg, combo)
            copy = links.latency + nbytes / links.pcie
            if copy <= min(forward, backward) and nbytes > best_bytes:
                best, best_bytes = list(combo), nbytes
    return best


def offload_exposed(cfg: MemoryConfig, links: Links, layers: int) -> float:
    """Exposed seconds of the configured offload over one step of a stage with `layers` layers."""
    if not cfg.model.fine_grained_activation_offloading:
        return 0.0
    forward, backward = layer_seconds(cfg, links)
    copy = links.latency + _offloaded_bytes(cfg, tuple(cfg.model.offload_modules)) / links.pcie
    per_layer = max(0.0, copy - forward) + max(0.0, copy - backward)
    return per_layer * layers * cfg.num_microbatches

# %% [markdown]
# ## The step: compute plus what stays exposed
#
# `estimate_step` applies the five rules to every stage and keeps, per item, the transfer's
# seconds, its window and what sticks out. TP's all-reduces (and SP's all-gathers and
# reduce-scatters, the same bytes) run on the compute stream between the GEMMs that need
# them: exposed in full unless Transformer Engine's `tp_comm_overlap` is on
# (`megatron/core/model_parallel_config.py:184`, off by default). CP's K/V exchange is
# counted the same way (Transformer Engine overlaps its ring with the attention blocks; not
# modeled). The optimizer step streams its state once: per stepped element the fp32 gradient,
# the fp32 master and the moments read and written, and the bf16 parameter written, at
# `memory` bandwidth. A save's exposed seconds are spread over its `save_interval` steps.
#
# The result is a `StepTime`: the compute, the bubble and the optimizer, and one `StepItem`
# per transfer with its seconds alone, its window and its exposed part (per stage where the
# rule is per stage, and the spans of the first stage's buckets for the drawing). `total` is
# the sum that the calculator's search ranks by.
#
# Why stage 1's one bucket hides behind slack in the running example: its last backward
# ends 117 ms (stage 0's last backward) before the step's backward does, and its 40 ms
# reduce-scatter fits in that. Megatron's comment says the same in words: data-parallel
# communication of later stages is "not on the critical path".

# %%
@dataclass
class StepItem:
    """One transfer: its seconds, the window it can hide in, what stays exposed (per step)."""

    item: str
    seconds: float
    window: float
    exposed: float
    spans: list = field(default_factory=list)
    """(start, end) of each bucket on the first stage, for the drawing."""
    per_stage: list = field(default_factory=list)
    """Exposed seconds on each pipeline stage, where the rule is per stage."""


@dataclass
class StepTime:
    """The step of a layout: compute, bubble, optimizer and the items, all in seconds."""

    compute: float
    bubble: float
    optimizer: float
    items: list[StepItem]

    @property
    def exposed(self) -> float:
        """Seconds of transfers not hidden behind compute."""
        return sum(i.exposed for i in self.items)

    @property
    def total(self) -> float:
        """Seconds per iteration."""
        return self.compute + self.bubble + self.optimizer + self.exposed

    def item(self, name: str) -> StepItem:
        """The item whose name starts with `name`."""
        return next(i for i in self.items if i.item.startswith(name))

# %% [markdown]
# Where each rule lives in Megatron (all at `e03878b5f`):
#
# | rule | code |
# |---|---|
# | grad sync only in the last micro-batch | `megatron/core/pipeline_parallel/schedules.py:741-742`, `:2384`, `:2411`, `:2428` |
# | a parameter counts as ready only then | `megatron/core/distributed/param_and_grad_buffer.py:800-822` |
# | buckets in reverse order, default size | `megatron/core/distributed/param_and_grad_buffer.py:915`, `distributed_data_parallel.py:69` |
# | one bucket on later pipeline stages | `megatron/core/distributed/distributed_data_parallel.py:95-106` |
# | all-gather waited for by the pre-hook, next one dispatched | `distributed_data_parallel.py:413-447`, `param_and_grad_buffer.py:494-529` |
# | p2p shapes with SP; blocking unless `overlap_p2p_comm` | `schedules.py:2080-2085`, `:2123-2126`; `model_parallel_config.py:304-312` |
# | TP traffic on the compute stream unless `tp_comm_overlap` | `megatron/core/model_parallel_config.py:184` |
# | warm-up and cool-down p2p blocking even with `overlap_p2p_comm` | `schedules.py:1575-1672`, `:1896-2011`; warm-up count `:891-892` |
# | aligned chunk gathers with virtual stages | `schedules.py:1161-1163`, `:1283-1296` |
# | the checkpoint's blocking copy | `megatron/core/dist_checkpointing/strategies/async_utils.py:264-273` |
# | offload's modules | `megatron/core/transformer/transformer_config.py:1127-1146` |
#
# What the model leaves out, on purpose: the data loader (chapter 04 prefetches it), kernel
# launch gaps, the scalar all-reduces of the step (gradient norm, found-inf, the logged loss:
# microseconds on a GPU network), stragglers (a step waits for the slowest rank), and
# contention between a transfer and the compute beyond the `interference` input. Each is
# small on a healthy GPU cluster; 07.9's CPU check shows what they add on a crowded CPU.

# %% [markdown]
# The DP rules per stage: the reduce-scatter of stage $s$ has its last backward plus the
# backwards of the stages below it as window; the all-gather's exposed parts add up along
# the pipeline's fill, since every stage's first forward lies on it.

# %%
def _stage_gather(cfg: MemoryConfig, links: Links, options: StepOptions, buckets: list[dict],
                  forward: float, s: int, num_stages: int, dp: int, bw: float,
                  aligned: bool) -> tuple[float, float, list]:
    """One stage's parameter all-gather: (exposed, seconds, spans), by rule 2 or aligned."""
    order = buckets[::-1]
    ag = [collective_seconds("all_gather", b["numel"] * cfg.param_bytes, dp, bw,
                             links.latency) for b in order]
    exposed, spans = all_gather_exposed(ag, [b["share"] * forward for b in order],
                                        options.overlap_param_gather)
    if aligned:
        per_chunk = [sum(a for a, b in zip(ag, order) if b["chunk"] == c)
                     for c in range(cfg.num_chunks)]
        exposed = aligned_gather_exposed(per_chunk, forward / cfg.num_chunks, num_stages, s)
    return exposed, sum(ag), spans

# %% [markdown]
# `_dp_items` runs both rules stage by stage and keeps, per item, the longest transfer and
# what each stage leaves exposed.

# %%
def _dp_items(cfg: MemoryConfig, links: Links, options: StepOptions,
              stages: list[tuple[float, float]]) -> list[StepItem]:
    """The gradient reduce-scatter (or all-reduce) and the parameter all-gather."""
    dp, stride = cfg.data_parallel_size * cfg.context_parallel_size, cfg.tensor_model_parallel_size
    bw = links.link(stride * dp, min(dp, links.gpus_per_node // stride))
    distopt = cfg.use_distributed_optimizer
    kind = "all_reduce" if (not distopt or links.reduce_scatter_as_all_reduce) else "reduce_scatter"
    rs_seconds, rs_spans, ag_seconds, ag_spans, rs_stage, ag_stage = 0, [], 0, [], [], []
    aligned = cfg.num_chunks > 1 and options.overlap_param_gather and options.align_param_gather
    if cfg.overlap_grad_reduce != options.overlap_grad_reduce:  # it decides the buckets
        cfg = cfg.replace(overlap_grad_reduce=options.overlap_grad_reduce)
    for s, (forward, backward) in enumerate(stages):
        buckets = dp_buckets(cfg, s)
        times = [collective_seconds(kind, b["numel"] * cfg.grad_bytes, dp, bw, links.latency)
                 for b in buckets]
        slack = sum(b for _, b in stages[:s])
        exposed, spans = reduce_scatter_exposed(times, [b["ready"] for b in buckets], backward,
                                                slack, options.overlap_grad_reduce)
        rs_stage.append(exposed)
        rs_seconds = max(rs_seconds, sum(times))
        rs_spans = rs_spans or spans
        if distopt:
            exposed, seconds, spans = _stage_gather(cfg, links, options, buckets, forward, s,
                                                    len(stages), dp, bw, aligned)
            ag_stage.append(exposed)
            ag_seconds = max(ag_seconds, seconds)
            ag_spans = ag_spans or spans
    items = [StepItem(f"DP grad {kind.replace('_', '-')}", rs_seconds, stages[0][1],
                      max(rs_stage), rs_spans, rs_stage)]
    if distopt:
        items.append(StepItem("DP param all-gather", ag_seconds, stages[0][0],
                              max(ag_stage) if aligned else sum(ag_stage), ag_spans, ag_stage))
    return items


# %% [markdown]
# The model-parallel items come from the pipeline formula of rule 3 and the TP and CP
# traffic per layer and micro-batch: with TP each layer does two all-reduce-sized exchanges
# of one activation ($P \cdot s/c \cdot b \cdot h$ bytes) in its forward and two in its
# backward, two more when full recompute repeats the forward; CP gathers the K/V heads of
# every layer forward and reduce-scatters their gradients backward. The optimizer's time
# counts the elements the rank steps (its shard with the distributed optimizer).

# %%
def _model_parallel_items(cfg: MemoryConfig, links: Links, options: StepOptions,
                          stages: list[tuple[float, float]]) -> tuple[dict, list[StepItem]]:
    """The pipeline (compute, bubble, p2p) and the TP and CP traffic on the compute stream."""
    m, t, c = cfg.model, cfg.tensor_model_parallel_size, cfg.context_parallel_size
    mb, layers = cfg.num_microbatches, m.num_layers // cfg.pipeline_model_parallel_size
    tau = p2p_seconds(cfg, links)
    pipe = pipeline_seconds(stages, mb, cfg.num_chunks, tau, options.overlap_p2p_comm)
    tp_seconds, tp_exposed = (mb * layers * x for x in tp_layer_seconds(cfg, links, options))
    kv = 2 * cfg.param_bytes * m.seq_length * cfg.micro_batch_size * m.num_query_groups \
        * m.head_dim // t
    cp = mb * layers * 2 * collective_seconds("all_gather", kv, c, links.link(t * c), links.latency)
    items = [StepItem("TP all-reduce" if not options.tp_comm_overlap else "TP (tp_comm_overlap)",
                      tp_seconds, 0.0, tp_exposed), StepItem("CP K/V exchange", cp, 0.0, cp),
             StepItem("PP p2p", 2 * (mb * cfg.num_chunks + cfg.pipeline_model_parallel_size - 2)
                      * tau if cfg.pipeline_model_parallel_size > 1 else 0.0, 0.0, pipe["p2p"])]
    return pipe, items

# %% [markdown]
# TP's traffic per layer and micro-batch: all-reduce-sized exchanges on the compute stream,
# or, with `tp_comm_overlap`, only what each exchange exceeds its GEMM piece by.

# %%
def tp_layer_seconds(cfg: MemoryConfig, links: Links,
                     options: StepOptions) -> tuple[float, float]:
    """(seconds, exposed seconds) of one layer's TP traffic for one micro-batch."""
    m, t, c = cfg.model, cfg.tensor_model_parallel_size, cfg.context_parallel_size
    unit = cfg.param_bytes * (m.seq_length // c) * cfg.micro_batch_size * m.hidden_size
    ops = 6 if cfg.recompute_granularity == "full" else 4  # forward 2, backward 2, recompute 2
    gather = collective_seconds("all_gather", unit, t, links.link(t), links.latency)
    seconds = ops * 2 * gather  # an all-reduce moves an all-gather and a reduce-scatter
    if not options.tp_comm_overlap or t == 1 or links.law is None:
        return seconds, seconds
    exposed = 0.0  # each gather or reduce-scatter rides inside its GEMM, one piece per rank
    for name, mm, nn, kk in layer_gemms(cfg):
        forward, dgrad = (p * gemm_seconds(mm // p, a, b, links.law)
                          for p, a, b in zip(_pieces(name, t), (nn, kk), (kk, nn)))
        exposed += (ops // 2 - 1) * max(0.0, gather - forward) + max(0.0, gather - dgrad)
    return seconds, exposed

# %% [markdown]
# The optimizer step streams its state once: per stepped element the grad, the fp32 master
# and moments read and written, and the bf16 weight written back.

# %%
def optimizer_seconds(cfg: MemoryConfig, links: Links = Links()) -> float:
    """One optimizer step of a first-stage rank, streaming its state once at `memory` bandwidth."""
    from tinytron.memory.states import _MOMENTS, state_ledger

    key = ("states",) + layout_key(cfg, 0) + (cfg.optimizer_cpu_offload,
                                              cfg.optimizer_offload_fraction)
    if key not in LAYOUT_CACHE:
        LAYOUT_CACHE[key] = state_ledger(cfg, 0)
    states = LAYOUT_CACHE[key]
    elements = (states["master_params"] + states["optimizer_state"]) \
        / 4 / (1 + _MOMENTS[cfg.optimizer]) if cfg.bf16 else states["optimizer_state"] / 4 \
        / _MOMENTS[cfg.optimizer]
    per_element = cfg.grad_bytes + 8 * (1 + _MOMENTS[cfg.optimizer]) + (cfg.param_bytes if cfg.bf16
                                                                        else 0)
    return elements * per_element / links.memory


# %% [markdown]
# `estimate_step` puts it together. The exposed part of a save is divided by the save
# interval, so the step it reports is the average step of a long run. The interference term
# (zero by default) charges the compute for every second of DP traffic that was hidden.
# Worked: 100 ms of compute hiding a 30 ms all-reduce with `interference` 0.4 costs
# 100 + 0.4 · 30 = 112 ms — on a CPU, where gloo's thread takes a core the compute wanted,
# that is the order of what the check measures; on a GPU it would be a few percent.

# %%
def estimate_step(cfg: MemoryConfig, links: Links = Links(),
                  options: StepOptions = StepOptions()) -> StepTime:
    """Seconds of one iteration: compute, bubble, optimizer and each item's exposed part."""
    stages = stage_compute(cfg, links, options)
    pipe, items = _model_parallel_items(cfg, links, options, stages)
    items = _dp_items(cfg, links, options, stages) + items
    layers = cfg.model.num_layers // cfg.pipeline_model_parallel_size
    off = offload_exposed(cfg, links, layers)
    if cfg.model.fine_grained_activation_offloading:
        items.append(StepItem("offload copies", off, 0.0, off))
    hidden = sum(i.seconds - i.exposed for i in items if i.item.startswith("DP"))
    if links.interference and hidden > 0:
        items.append(StepItem("compute lost to hidden DP traffic", hidden, 0.0,
                              links.interference * hidden))
    step = StepTime(pipe["compute"], pipe["bubble"], optimizer_seconds(cfg, links), items)
    for c in checkpoint_items(cfg, links, options, step.total, pipe["compute"]):
        items.append(StepItem(c["item"], c["seconds"] / options.save_interval,
                              c["window"] / options.save_interval,
                              c["exposed"] / options.save_interval))
    return step

# %% [markdown]
# ## Playing the schedule
#
# To draw the step, `schedule_1f1b` plays the schedule: every stage runs its forwards and
# backwards in 1F1B order (warm-up forwards, then one forward and one backward, then the
# cool-down backwards), each starting when its stage is free and its input has arrived
# $\tau$ after the neighbor finished. `step_timeline` (in `_step_time_io`) then lays the
# other lanes around the
# first stage's compute: the all-gather spans before and inside the first forward, the
# reduce-scatter spans from the start of the last backward, the optimizer, the checkpoint's
# copy (staged: inside the next iteration's compute) and write, and the offload copies of
# each layer. The played schedule and the closed form of rule 3 must agree; the closed form
# is slightly pessimistic, since a blocking send that falls into a wait costs nothing.
#
# Played in small numbers ($p = 2$, $m = 4$, $F = 1$, $B = 2$ ms, $\tau = 0$): stage 0 runs
# F0 F1 at 0-2, waits for stage 1's B0 (F0 arrives there at 1, runs 1-2, B0 2-4), runs B0 at
# 4-6, F2 6-7, B1 7-9, F3 9-10, B2 10-12, B3 13-15: 15 ms, as rule 3's formula says
# ($4 \cdot 3 + 3$). The 3 ms of waiting are the bubble.

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
# ## Demo: the running example, item by item
#
# The model on the running example with Megatron's switches on (`overlap_grad_reduce`,
# `overlap_param_gather`, a blocking save every 500 steps, all three as the running example's
# `configs/llama7b_tp2_pp2_dp64.toml` sets them). First the four rows of the
# back-of-envelope this page started from, recomputed: each transfer, its window by the
# rules above, and what stays exposed.
# Each row is one transfer of one stage; "time" is the transfer alone on its link, "window"
# is what the rule lets it hide behind (for stage 1's reduce-scatter: its own last backward
# plus stage 0's, the slack), "exposed" is what the step pays. Below the table the whole
# step: compute is the slowest stage's eight micro-batches, the bubble what the pipeline's
# fill and drain add, then each item.

# %%
if __name__ == "__main__":
    from tinytron.memory.calculator import running_example

    example = running_example().replace(overlap_grad_reduce=True)
    links, options = Links(), StepOptions(save_interval=500)  # as in its config file
    step = estimate_step(example, links, options)
    (f0, b0), (f1, b1) = stage_compute(example, links)
    rs, ag = step.item("DP grad"), step.item("DP param")
    ckpt = checkpoint_items(example, links, options, step.total, step.compute)[0]
    staged = checkpoint_items(example, links, replace(options, checkpoint="staged"),
                              step.total, step.compute)[0]
    everything = offload_table(example, links)[-1]
    print(f"{'item':<42}{'time':>9}{'window':>10}{'exposed':>10}")
    for name, t, w, e in (
            ("grad reduce-scatter, stage 0 (7.9 GB fp32)", rs.seconds, b0, rs.per_stage[0]),
            ("grad reduce-scatter, stage 1 (one bucket)", rs.seconds, b1 + b0, rs.per_stage[1]),
            ("param all-gather, stage 0", ag.seconds, f0, ag.per_stage[0]),
            ("param all-gather, stage 1 (one bucket)", ag.seconds, f1, ag.per_stage[1]),
            ("checkpoint D2H, blocking (per save)", ckpt["seconds"], 0.0, ckpt["exposed"]),
            ("checkpoint D2H, staged (per save)", staged["seconds"], staged["window"],
             staged["exposed"]),
            ("offload, all five modules (per layer)", everything["copy"],
             everything["forward"], everything["copy"] - everything["forward"])):
        print(f"{name:<42}{t * 1e3:>7.1f}ms{w * 1e3:>8.1f}ms{e * 1e3:>8.1f}ms")
    print(f"step {step.total:.3f} s = compute {step.compute:.3f} + bubble {step.bubble:.3f} "
          f"+ optimizer {step.optimizer * 1e3:.2f} ms + exposed {step.exposed * 1e3:.1f} ms")
    for i in step.items:
        print(f"  {i.item:<32} {i.seconds * 1e3:8.2f} ms, exposed {i.exposed * 1e3:7.2f} ms")

# %% [markdown]
# What the table says, row by row:
#
# - **The reduce-scatter fits its window, and still sticks out.** Stage 0's 7.9 GB of fp32
#   gradients take 40 ms against a last backward of 117 ms — yet 6 ms are exposed. The rule
#   is bucket by bucket: the last bucket in backward order is the input embedding alone
#   (128,256 / 2 × 4096 = 263 M elements; the tied table gets a bucket of its own), and its
#   gradient is the last one the backward produces. Its 5 ms, plus the queue in front of it,
#   can only start when there is nothing left to hide behind. Stage 1's single bucket starts
#   later still, but it has stage 0's whole last backward as slack: hidden.
# - **The all-gather has the opposite problem on stage 1.** One bucket (Megatron's choice for
#   every stage but the first, made for the reduce-scatter) means its first forward waits for
#   the whole gather: 17 ms exposed. Stage 0 waits only for its first bucket, the embedding
#   again (3 ms). Together 20 ms, more than the reduce-scatter leaves exposed.
# - **The checkpoint's copy** is 9 ms per save per rank: blocking, 0.02 ms per step at one save
#   every 500 steps; staged, nothing. The write (440 MB at 1 GB/s) hides easily in 500 steps.
# - **Offloading all five modules** moves 176 MiB per layer and micro-batch each way; at
#   50 GB/s that is 3.7 ms against a layer forward of 3.5 ms: just too slow, and four of the
#   five modules fit (below). These are the bytes chapter 07's ledger counts for tinytron's
#   modules, now that its norms keep what Megatron's keep (chapter 06's
#   [offload page](../06_recompute_offload/offload.py) counts the same regions).
#
# In total the model gives 1.94 s per step, of which 0.12 s is exposed transfer — TP's
# collectives (76 ms, on the compute stream: the example's config leaves `tp_comm_overlap`
# off), the all-gather (20 ms), the p2p (11 ms) and the reduce-scatter's last bucket (6 ms)
# — and 0.17 s pipeline bubble. With `tp_comm_overlap` the TP traffic hides inside its GEMMs,
# which run in two pieces each and slow by 0.2%: 1.86 s, the number 07.7's search quotes.

# %%
if __name__ == "__main__":
    assert 0.3 < rs.seconds / b0 < 0.4 and 0.1 < rs.per_stage[0] / rs.seconds < 0.25
    assert rs.per_stage[1] == 0.0 and ag.per_stage[1] > 0.8 * ag.seconds > ag.per_stage[0]
    assert ckpt["exposed"] == ckpt["seconds"] and staged["exposed"] == 0.0
    assert everything["copy"] > everything["forward"] and not everything["hides"]
    assert abs(step.total - (step.compute + step.bubble + step.optimizer + step.exposed)) < 1e-12
    assert 1.9 < step.total < 2.0 and step.exposed / step.total < 0.1
    overlapped = estimate_step(example, links, replace(options, tp_comm_overlap=True))
    assert 1.8 < overlapped.total < step.total - 0.05
    naive = step.compute + step.bubble + sum(i.seconds for i in step.items)  # nothing hidden
    assert step.total < naive - 0.03

# %% [markdown]
# ## Offload, with its bandwidth (chapter 06's table)
#
# Which of chapter 06's regions can move to the host without slowing the step? For the
# running example and PCIe Gen5 at 50 GB/s, per layer and micro-batch on one rank: each
# module's bytes, its copy time, and the two windows (a layer's forward for the copy out, its
# backward for the copy back). The backward is twice the forward plus the recomputation, so
# the forward is the binding window. Every module fits alone; all five do not; the best set
# that fits moves `attn_norm`, `qkv_linear`, `core_attn` and `attn_proj`: 144 MiB in 3.0 ms
# of a 3.5 ms forward. At PCIe Gen4 (25 GB/s) only the smaller sets fit, so the same search
# gives a smaller default.

# %%
if __name__ == "__main__":
    fitted = best_offload_modules(example, links)
    drawn = example.replace(model=example.model.replace(
        fine_grained_activation_offloading=True, offload_modules=fitted))
    print(f"{'module':<12}{'MiB/layer':>10}{'copy':>9}{'forward':>9}{'backward':>10}  hides")
    for row in offload_table(example, links):
        print(f"{row['module']:<12}{row['bytes'] / 2**20:>10.1f}{row['copy'] * 1e3:>7.2f}ms"
              f"{row['forward'] * 1e3:>7.2f}ms{row['backward'] * 1e3:>8.2f}ms  {row['hides']}")
    gen4 = best_offload_modules(example, replace(links, pcie=25e9))
    print("fits at 50 GB/s:", fitted, " at 25 GB/s:", gen4)
    assert fitted == ["attn_norm", "qkv_linear", "core_attn", "attn_proj"]
    assert all(r["hides"] for r in offload_table(example, links)[:5])
    assert _offloaded_bytes(example, tuple(gen4)) < _offloaded_bytes(example, tuple(fitted))
    with_offload = estimate_step(drawn, links, options)
    assert with_offload.item("offload").exposed == 0.0
    too_much = example.replace(model=example.model.replace(
        fine_grained_activation_offloading=True, offload_modules=list(OFFLOAD_MODULES)))
    too_much_exposed = estimate_step(too_much, links, options).item("offload").exposed
    print(f"all five exposed: {too_much_exposed * 1e3:.1f} ms per step")
    assert too_much_exposed > 0

# %% [markdown]
# So on an H100 node the suggested `offload_modules` default is
# `["attn_norm", "qkv_linear", "core_attn", "attn_proj"]` — what the model says hides behind
# compute — and offload stays off unless memory asks for it. Offloading all five (176 MiB a
# layer) needs 3.7 ms of copy in a 3.5 ms forward: the demo prints what that exposes per
# step (19 ms here), a small price, but one the four-module set does not pay.
#
# The same search answers for any layout and link: a longer sequence makes a layer's
# compute grow faster than its saved bytes (attention is quadratic in the sequence, the
# saved tensors linear), so more modules fit; a larger TP divides both by the same factor
# and changes nothing; a slower link — PCIe Gen4 — leaves `attn_norm` and `core_attn`
# (80 MiB; `qkv_linear` in place of `attn_norm` moves the same bytes).
# Chapter 06 keeps `offload_modules` empty by default, as Megatron does; when a run turns
# offload on for a GPU, this set is the one that costs no time.

# %% [markdown]
# ## Measured on a GPU
#
# `bash scripts/gpu_check.sh 1` times the ~1B trainer on one GPU (`configs/gpt_1b.toml`, 16
# sequences of 2048 tokens per iteration), and the model predicts the same layout with
# appendix C's kernel law of that GPU and the run's own options: on one GPU nothing is
# exposed, so the error is how far the law's GEMM, attention and bandwidth fractions are from
# what the kernels achieved. With two or more GPUs, `bash scripts/gpu_check.sh 2` also traces
# the DP 2 and PP 2 runs of 07.9's CPU check over NCCL. `chapters/_gpu_results.py` renders
# the tables from `benchmarks/results/gpu/<device>.json`.

# %%
if __name__ == "__main__":
    from tinytron._gpu_results import gpu_table

    print(gpu_table("step_time"))

# %% [markdown]
# ## Summary
#
# - A step is compute + bubble + optimizer + what each transfer cannot hide in its window.
# - Windows, by Megatron's rules: the gradient reduce-scatter behind the last micro-batch's
#   backward, bucket by bucket in reverse order (so the last bucket is always exposed); the
#   parameter all-gather behind the first forward, one bucket ahead (so the first bucket is
#   always exposed); blocking p2p on the critical path unless `overlap_p2p_comm` (interleaved
#   only); the checkpoint's copy blocking in Megatron, hidden in the next step when staged;
#   offload per layer against the layer's compute.
# - Compute is every kernel of a micro-batch timed by appendix C's law (tiles and waves for
#   GEMMs, bytes for streaming kernels, a stated flash-attention fraction); page 07.9 holds
#   it against Megatron's published H100 throughput.
# - For the running example the overlap rules leave 0.12 s of 1.94 s exposed, most of it
#   TP's traffic on the compute stream; among DP items the later stage's one-bucket
#   all-gather exposes more than the reduce-scatter.
# - Offload on a 50 GB/s PCIe link hides `attn_norm`, `qkv_linear`, `core_attn` and
#   `attn_proj`; all five modules need a little more than 50 GB/s.
# - The layouts' ranking (07.7's search) changes with the rules: without a pipeline there is
#   no bubble and no one-bucket all-gather, so PP1 layouts that fit come first.
# - Page 07.9 holds the model against Megatron's published H100 throughput and against
#   traced runs of the real trainer on this CPU.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/distributed/distributed_data_parallel.py` (buckets, the
#   forward pre-hooks, `no_sync`), `megatron/core/distributed/param_and_grad_buffer.py`
#   (`register_grad_ready`, `start_grad_sync`, `finish_param_sync`),
#   `megatron/core/pipeline_parallel/schedules.py` (where grad sync is switched on, p2p
#   overlap), `megatron/core/dist_checkpointing/strategies/async_utils.py` (the blocking copy
#   before the fork), `megatron/core/pipeline_parallel/fine_grained_activation_offload.py`.
#   Megatron has no step-time model; its timers (chapter 08) measure the phases.
# - torchtitan stages the checkpoint's copy (`maybe_wait_for_staging`) and leaves the layout
#   to the user; NeMo's auto-configurator ranks layouts by short profiling runs.
# - Holistic Trace Analysis reads the same Chrome traces as chapter 08 and reports exposed
#   communication per rank — the measured side of this page's model.
#
# <details><summary>Megatron detail: where tinytron differs</summary>
#
# The staged checkpoint copy of rule 4 is tinytron's (chapter 03), Megatron blocks for the
# copy before it forks its writer; the played 1F1B schedule and the closed form are this
# book's, Megatron's schedules only run; and the rules are read from Megatron's code as it is
# at `e03878b5f`, including its choice of one bucket on later pipeline stages, which the
# model shows costs the running example's all-gather most of its overlap.
#
# </details>
#
# ## Exercises
#
# 1. Halve `Links.network`. Which window does the reduce-scatter miss first, and what does
#    `bucket_size` do to the exposed part?
#
#    <details><summary>Answer</summary>
#
#    At 25 GB/s stage 0's reduce-scatter takes 79 ms
#    against its 117 ms last backward and exposes 14.1 ms instead of 6.3: the window it misses
#    is the last bucket's, the embedding's, which has no backward left behind it. Stage 1's
#    one bucket still hides in its 252 ms of slack. The step grows from 1.935 to 1.978 s.
#    Buckets of 10 M elements bring the reduce-scatter down to 12.1 ms but expose 13.2 ms of
#    stage 0's all-gather instead of 7.1 (1.982 s); 400 M leave 26.9 ms exposed (1.995 s).
#    The default, 40 M, is the best of the three.
#
#    </details>
#
# 2. Give every pipeline stage the first stage's buckets (`bucket_size` on all ranks): how
#    much of stage 1's all-gather hides, and what does that cost the reduce-scatter?
#
#    <details><summary>Answer</summary>
#
#    With `bucket_size_for` giving stage 1 stage 0's size
#    (18 buckets on each), stage 1's all-gather exposes 0.55 ms instead of 17.2: nearly all of
#    it hides, and the DP all-gather item drops from 20.4 to 3.7 ms. The reduce-scatter costs
#    nothing: stage 1's buckets still hide in stage 0's backward (0 ms exposed). Only the
#    interference term grows, 3.95 to 5.97 ms, with the extra hidden traffic. The step: 1.935
#    to 1.921 s.
#
#    </details>
#
# 3. Turn on interleaving (`virtual_pipeline_model_parallel_size=2`) with
#    `overlap_p2p_comm`: how much of the p2p and of the bubble goes away?
#
#    <details><summary>Answer</summary>
#
#    The bubble halves, 174 to 87 ms ($v = 2$ divides it).
#    The p2p first doubles, 10.7 to 21.5 ms exposed (twice the sends, still blocking); with
#    `overlap_p2p_comm` 5.4 ms of it stays, the warm-up and cool-down sends, which block
#    anyway. The DP items gain too (all-gather 20.4 to 11.2 ms, reduce-scatter 6.3 to
#    1.2 ms). The step: 1.935 s, then 1.846 s with interleaving, 1.830 s with both.
#
#    </details>
#
# 4. Replace `Links.pcie` by 25 GB/s (PCIe Gen4) and then 100 GB/s: what does
#    `best_offload_modules` return, and what does the ledger (07.5) say each choice saves?
#
#    <details><summary>Answer</summary>
#
#    At 25 GB/s `attn_norm` and `core_attn` (80 MiB a
#    layer); at 50 GB/s the four of the demo (144 MiB); at 100 GB/s all five (176 MiB). On
#    stage 0 the ledger's peak activations go from 22.01 GiB to 18.26, 16.26 and 15.26 GiB:
#    3.75, 5.75 and 6.75 GiB saved.
#
#    </details>
#
# 5. Stage the checkpoint (`StepOptions(checkpoint="staged")`) and set `save_interval` to 1:
#    which of the copy and the write is exposed now, and by how much?
#
#    <details><summary>Answer</summary>
#
#    Neither: the 8.8 ms copy hides in the next step's
#    1.643 s of compute and the 439 ms write in the 1.935 s step, so the step stays 1.935 s.
#    Blocking at the same interval would pay the whole copy every step: 1.944 s.
#
#    </details>
