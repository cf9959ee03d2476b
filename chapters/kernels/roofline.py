# %% [markdown]
# # C.0 · Kernels: the roofline of one layer, eager and fused
#
# Appendix B's model is written in eager PyTorch: every op reads its inputs from GPU memory and
# writes its output back. For a matmul that costs nothing next to its arithmetic; for a norm, an
# activation, a softmax or an optimizer update it *is* the cost. This page puts the operations
# of one training step on the roofline of an H100 for the running example, eager and fused, and
# says which of them the next five pages turn into kernels, and why those.
#
# You will build: `step_operations` (FLOPs, eager bytes and fused bytes of each operation of the
# running example), `plot_roofline`, and the law chapter 07's step-time model times every
# kernel of a step with: `KernelLaw`, `gemm_seconds`, `stream_seconds`, `attention_seconds`.

# %%
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tinytron.kernels._measure import A100_SXM, H100_SXM, H200_SXM, EagerTraffic, GPU, roofline_seconds
from tinytron.kernels.cross_entropy import cross_entropy_bytes, vocab_parallel_cross_entropy_reference
from tinytron.kernels.flash_attention import attention_bytes, attention_eager, attention_flops
from tinytron.kernels.fused_adamw import adamw_bytes, adamw_reference_
from tinytron.kernels.rmsnorm import rms_norm_bytes, rms_norm_reference
from tinytron.kernels.swiglu import swiglu_bytes, swiglu_reference
from tinytron.parallel import ParallelGrid

__all__ = ["eager_bytes_per_element", "step_operations", "plot_roofline", "KernelLaw",
           "gemm_seconds", "stream_seconds", "attention_seconds", "LAWS"]

# %% [markdown]
# ## Two ceilings
#
# A kernel that performs $F$ floating-point operations and moves $B$ bytes between the
# processor and its memory needs at least
#
# $$t \ge \max\Big(\frac{F}{\text{peak FLOP/s}},\; \frac{B}{\text{peak bytes/s}}\Big).$$
#
# The ratio $F / B$ is its *arithmetic intensity*. An H100 SXM does 989 TFLOP/s of dense bf16
# and moves 3.35 TB/s, so below $989 / 3.35 = 295$ FLOP per byte (the *ridge*) a kernel is
# limited by memory, above it by the tensor cores. A matmul of the running example
# ($8192 \times 4096$ by $4096 \times 7168$ in bf16) does 481 GFLOP on 243 MB: 2,000 FLOP/byte,
# far right of the ridge. An RMSNorm does about 4 FLOPs per element on 4 bytes: 1 FLOP/byte,
# three hundred times left of it. For such an operation only the bytes matter, and eager
# PyTorch moves many more bytes than the operation needs (pages
# [C.1](rmsnorm.py)–[C.3](cross_entropy.py) count them op by op).
#
# ## What one micro-batch of the running example runs
#
# Per TP rank (TP 2 with sequence parallelism, micro-batch 2, $s = 4096$) and per layer: two
# RMSNorms over 4,096 tokens of $h = 4096$; one SwiGLU over 8,192 tokens of $f/t = 7168$; one
# causal attention with 16 query and 4 key/value heads of 128. The last stage adds the loss
# over 8,192 tokens of $V/t = 64{,}128$ logits, and every step ends with one AdamW update of the
# rank's 31.4 M-element shard. `step_operations` lists each with its FLOPs, the bytes the eager
# code moves (measured per element on small tensors by the dispatch-mode counter of
# [C.1](rmsnorm.py), then scaled) and the bytes the kernel moves (its loads and stores).

# %%
def eager_bytes_per_element() -> dict[str, dict[str, float]]:
    """Bytes the eager references move per element (forward, backward), counted on small tensors."""
    out = {}
    n, h, v = 64, 256, 256
    cases = {
        "rmsnorm": (lambda x, w: rms_norm_reference(x, w), [torch.randn(n, h), torch.ones(h)], n * h),
        "swiglu": (swiglu_reference, [torch.randn(n, 2 * h)], n * h),
        "cross_entropy": (lambda z: vocab_parallel_cross_entropy_reference(
            z.float(), torch.zeros(n, dtype=torch.long), ParallelGrid.single()), [torch.randn(n, v)],
            n * v),
        "attention": (attention_eager, [torch.randn(1, 2, 64, 16) for _ in range(3)], 2 * 64 * 64),
    }
    for name, (fn, inputs, elements) in cases.items():
        leaves = [t.bfloat16().requires_grad_() for t in inputs]
        with EagerTraffic() as meter:
            y = fn(*leaves)
            meter.phase = "backward"
            y.backward(torch.ones_like(y))
        out[name] = {p: meter.total(p) / elements for p in ("forward", "backward")}
    tensors, param_bf16 = [torch.randn(4096) for _ in range(4)], torch.empty(4096, dtype=torch.bfloat16)
    with EagerTraffic() as meter:  # one _foreach_ AdamW step and its bf16 copy (chapter 02)
        adamw_reference_(*([t] for t in tensors), 1, 1e-3)
        param_bf16.copy_(tensors[0])
    out["adamw"] = {"forward": meter.total() / 4096, "backward": 0.0}
    return out


# %% [markdown]
# The counts come out per element. `step_operations` scales them to the running example: each
# operation's FLOPs, the bytes the eager code moves, the bytes the kernel moves, and the best-case
# time of both.

# %%
def step_operations(per_element: dict) -> list[dict]:
    """FLOPs and bytes (fused, eager) of each fused operation of one micro-batch, running example."""
    bf16, ops = torch.bfloat16, []
    norm_tokens, tokens, h, f, v, shard = 4096, 8192, 4096, 7168, 64128, 31_369_216
    for name, count, elements, flops, fused in (
            ("rmsnorm", 32, norm_tokens * h, 14 * norm_tokens * h, rms_norm_bytes(norm_tokens, h, bf16)),
            ("swiglu", 16, tokens * f, 18 * tokens * f, swiglu_bytes(tokens, f, bf16)),
            ("cross_entropy", 1, tokens * v, 10 * tokens * v, cross_entropy_bytes(tokens, v, bf16))):
        eager = sum(per_element[name][p] for p in ("forward", "backward")) * elements
        ops.append(dict(name=name, count=count, flops=flops, fused=sum(fused.values()), eager=eager))
    att_flops = attention_flops(2, 16, 4096, 128)
    scores = 2 * 16 * 4096 * 4096  # the eager form writes every score, masked or not
    ops.append(dict(name="attention", count=16, flops=att_flops["forward"] * 3.5,
                    fused=sum(attention_bytes(2, 16, 4, 4096, 128, bf16).values()),
                    eager=sum(per_element["attention"].values()) * scores))
    ops.append(dict(name="adamw (per step)", count=1, flops=15 * shard, fused=adamw_bytes(shard),
                    eager=per_element["adamw"]["forward"] * shard))
    for op in ops:
        op["t_fused"] = roofline_seconds(op["flops"], op["fused"])
        op["t_eager"] = roofline_seconds(op["flops"], op["eager"])
    return ops


# %% [markdown]
# The FLOP counts are rough (elementwise work per element: about 14 for a norm's forward and
# backward, 18 for SwiGLU, 10 for the loss, 15 for AdamW); for attention they are the matmuls,
# forward plus 2.5× for the backward. Being off by a factor of two changes nothing: every
# operation but attention sits one to three orders of magnitude left of the ridge.

# %%
def plot_roofline(ops: list[dict], gpu: GPU = H100_SXM, ax=None):
    """Each operation at its intensity, eager (hollow) and fused (filled), under the two ceilings."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    xs = torch.logspace(-2, 5, 200)
    ax.plot(xs, torch.minimum(xs * gpu.hbm_bytes_per_s, torch.tensor(gpu.bf16_flops)) / 1e12,
            color="black", lw=1)
    for i, op in enumerate(ops):
        color = plt.get_cmap("tab10")(i)
        for kind, face in (("eager", "none"), ("fused", color)):
            intensity = op["flops"] / op[kind]
            achievable = min(intensity * gpu.hbm_bytes_per_s, gpu.bf16_flops) / 1e12
            ax.scatter(intensity, achievable, s=60, edgecolors=color, facecolors=face,
                       label=op["name"] if kind == "fused" else None)
    ax.axvline(gpu.ridge, color="gray", ls=":", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="FLOP per byte moved", ylabel="TFLOP/s at best",
           title=f"{gpu.name}: eager (hollow) vs fused (filled), running example")
    ax.legend(fontsize=7, loc="lower right")
    return ax


# %% [markdown]
# ## From a bound to a law: what a step-time model times kernels with
#
# The roofline is a lower bound. Chapter 07's step-time model (pages 07.10 to 07.14) needs a
# *prediction* for every kernel of a micro-batch, on any layout, from datasheet numbers, so it
# turns the bound into a law with three stated fractions and the two quantizations of a GEMM.
# Each fraction is a property of the device and its libraries, the same for every model and
# layout — nothing in it is fitted to a particular run.
#
# **GEMMs: tiles and waves.** cuBLAS and CUTLASS compute an $M \times N$ output in tiles of
# $128 \times 256$ (their large bf16 tile on Hopper and Ampere), one tile per SM at a time. A
# GEMM runs $\lceil M/128 \rceil \lceil N/256 \rceil$ tiles in $\lceil \text{tiles} /
# \text{SMs} \rceil$ *waves*, and each wave takes as long as one full tile's $2 \cdot 128
# \cdot 256 \cdot K$ FLOPs at one SM's share of the sustained peak — a ragged last wave or a
# half-empty edge tile costs a whole one (tile and wave quantization). The tile's result is
# written after its last multiply, so the output's bytes are added at memory speed; the
# inputs are read while the main loop runs, so they only count when they take longer.
#
# $$ t_\text{GEMM} = \max\Big(\text{waves} \cdot \frac{2 \cdot 128 \cdot 256 \cdot K}
#    {\eta_\text{tc} P / \text{SMs}},\ \frac{2(MK + KN)}{\eta_\text{mem} B}\Big) +
#    \frac{2MN}{\eta_\text{mem} B} $$
#
# **Streaming kernels** (norms, the activation, residual adds, the loss's softmax, the
# optimizer) take their bytes at $\eta_\text{mem} B$. **Flash attention** takes its matmul
# FLOPs (forward $4 b s^2 d\,a/2$ for causal attention; the backward 2.5× that, since it
# recomputes the scores) at $\eta_\text{att} P$.
#
# | constant | H100 SXM | A100 SXM | why this number |
# |---|---|---|---|
# | $P$, $B$, SMs | 989 TFLOP/s, 3.35 TB/s, 132 | 312 TFLOP/s, 2.04 TB/s, 108 | the datasheets (H200: 989, 4.8 TB/s, 132) |
# | $\eta_\text{tc}$ | 0.65 | 0.80 | a large cuBLAS bf16 GEMM on random data, sustained: an H100 SXM under its 700 W cap holds its clock well below the boost the datasheet peak assumes (640-700 TFLOP/s); an A100 at 400 W sustains 250-260 |
# | $\eta_\text{mem}$ | 0.90 | 0.90 | a streaming copy reaches about 90% of HBM's rate on both |
# | $\eta_\text{att}$ | 0.45 | 0.50 | FlashAttention-3's and cuDNN's published rates at head 128, causal, 4 K tokens (about 600 TFLOP/s forward, 450 backward, in isolation) under the same power cap; FlashAttention-2's on an A100 |
#
# The H200 takes the H100's fractions: the same SMs at the same power. Worked in small
# numbers on an H100: the running example's fc1 forward on a TP rank, $M = 8192$ tokens,
# $N = 2 \cdot 14336/2 = 14336$, $K = 4096$. With $128 \times 256$ tiles: $64 \times 56 =
# 3584$ tiles, 28 waves (27.2 rounded up), each $2 \cdot 128 \cdot 256 \cdot 4096 / (0.65
# \cdot 989 \cdot 10^{12} / 132) = 55.1\ \mu$s: 1.54 ms, plus 235 MB of output at 3.0 TB/s,
# 0.08 ms. The $128 \times 128$ tile fills the waves better — 7,168 tiles in 55 waves (54.3)
# of 27.5 $\mu$s, 1.52 ms — so the library takes it: 962 GFLOP in 1.59 ms is 604 TFLOP/s,
# 61% of the datasheet, 4% below the main loop's 65% for the ragged last wave and the output.

# %%
@dataclass(frozen=True)
class KernelLaw:
    """A device's kernel speeds: datasheet numbers and the three stated fractions."""

    gpu: GPU = H100_SXM
    tensor_fraction: float = 0.65
    """Of the datasheet bf16 peak, what a large GEMM's main loop sustains."""
    memory_fraction: float = 0.90
    """Of the datasheet HBM bandwidth, what a streaming kernel reaches."""
    attention_fraction: float = 0.45
    """Of the datasheet bf16 peak, what flash attention sustains (head 128, causal)."""
    tiles: tuple[tuple[int, int], ...] = ((128, 256), (256, 128), (128, 128))
    """The output tiles the GEMM library chooses from (one SM computes one at a time)."""


LAWS = {"H100": KernelLaw(), "H200": KernelLaw(H200_SXM),
        "A100": KernelLaw(A100_SXM, tensor_fraction=0.80, attention_fraction=0.50)}


def gemm_seconds(m: int, n: int, k: int, law: KernelLaw = KernelLaw()) -> float:
    """Seconds of a bf16 (m x k) @ (k x n) GEMM: tile and wave quantized main loop + output."""
    per_sm = law.tensor_fraction * law.gpu.bf16_flops / law.gpu.sms
    main = min(math.ceil(math.ceil(m / tm) * math.ceil(n / tn) / law.gpu.sms) * 2 * tm * tn * k
               for tm, tn in law.tiles) / per_sm  # the library picks the best tile
    bandwidth = law.memory_fraction * law.gpu.hbm_bytes_per_s
    return max(main, 2 * (m * k + k * n) / bandwidth) + 2 * m * n / bandwidth


def stream_seconds(nbytes: float, law: KernelLaw = KernelLaw()) -> float:
    """Seconds of a memory-bound kernel that moves nbytes."""
    return nbytes / (law.memory_fraction * law.gpu.hbm_bytes_per_s)


def attention_seconds(flops: float, law: KernelLaw = KernelLaw()) -> float:
    """Seconds of flash attention doing `flops` of matmul work."""
    return flops / (law.attention_fraction * law.gpu.bf16_flops)


# %% [markdown]
# ## Demo: the running example on the roofline
#
# The table adds, for one micro-batch of one pipeline stage (16 layers; the loss on the last
# stage) and one optimizer step, the best-case time of each operation eager and fused. The
# eager attention row is the materialized form (`attention_eager`); appendix B's call to
# `scaled_dot_product_attention` already dispatches to a fused flash kernel on a GPU, which is
# what the kernel of page [C.4](flash_attention.py) is measured against.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    per_element = eager_bytes_per_element()
    ops = step_operations(per_element)
    print(f"{'operation':>18} {'x':>3} {'FLOP/byte fused':>16} {'eager ms':>9} {'fused ms':>9}")
    for op in ops:
        print(f"{op['name']:>18} {op['count']:>3} {op['flops'] / op['fused']:>16.1f} "
              f"{op['count'] * op['t_eager'] * 1e3:>9.2f} {op['count'] * op['t_fused'] * 1e3:>9.2f}")
    total_eager = sum(op["count"] * op["t_eager"] for op in ops)
    total_fused = sum(op["count"] * op["t_fused"] for op in ops)
    print(f"best-case time of these operations: eager {total_eager * 1e3:.1f} ms, "
          f"fused {total_fused * 1e3:.1f} ms")
    plot_roofline(ops)
    plt.tight_layout()
    plt.show()

    by_name = {op["name"]: op for op in ops}
    assert by_name["attention"]["flops"] / by_name["attention"]["fused"] > H100_SXM.ridge
    assert all(op["flops"] / op["fused"] < H100_SXM.ridge / 10 for op in ops
               if op["name"] != "attention")
    assert by_name["attention"]["t_eager"] > 10 * by_name["attention"]["t_fused"]
    assert total_eager > 5 * total_fused
    fc1 = gemm_seconds(8192, 14336, 4096)
    print(f"law: running example's fc1 forward {fc1 * 1e3:.2f} ms, "
          f"{2 * 8192 * 14336 * 4096 / fc1 / 1e12:.0f} TFLOP/s")
    assert abs(fc1 - 1.59e-3) < 0.01e-3
    for h in (2048, 8192):  # a TP8 slice of a layer runs below the law's large-GEMM rate
        assert 2 * 4096 * h * h / 8 / gemm_seconds(4096, h // 8, h) < 0.65 * H100_SXM.bf16_flops
    assert gemm_seconds(4096, 256, 2048) > 0.2 * gemm_seconds(4096, 2048, 2048)  # quantized

# %% [markdown]
# ## Measured on a GPU
#
# The roofline says where each kernel should land; `bash scripts/gpu_check.sh 2` measures where
# it does, with `benchmarks/bench_kernels.py` at a ~1B model's shapes: each memory-bound
# kernel's minimum bytes over its forward-and-backward time, as a fraction of the device's
# datasheet HBM bandwidth, beside eager PyTorch and `torch.compile`; and the flash attention
# kernel's TFLOP/s against SDPA's flash backend. `chapters/_gpu_results.py` renders the table
# from `benchmarks/results/gpu/<device>.json`.

# %%
if __name__ == "__main__":
    from tinytron._gpu_results import gpu_table

    print(gpu_table("kernels"))

# %% [markdown]
# ## Summary
#
# - Norms, activations, the loss and the optimizer update are memory-bound by two orders of
#   magnitude: their time is their bytes, and eager PyTorch moves 2.5–13 times the bytes the
#   operation needs.
# - Attention's matmuls are compute-bound, but its eager form writes an $s \times s$ score
#   matrix per head and becomes memory-bound; tiling brings it back right of the ridge.
# - The next pages write these five kernels: RMSNorm ([C.1](rmsnorm.py)), SwiGLU ([C.2](swiglu.py)),
#   the cross-entropy ([C.3](cross_entropy.py)), flash attention ([C.4](flash_attention.py)) and
#   AdamW ([C.5](fused_adamw.py)). The model (appendix B) and the optimizer
#   (chapter 02) pick them with `kernels = "triton"`.
#
# ## How production does it
#
# - Megatron takes most fusions from Transformer Engine (`megatron/core/extensions/transformer_engine.py`)
#   and Apex, and has its own `torch.compile`/`jit` fusions in `megatron/core/fusions/`
#   (bias-SwiGLU, bias-dropout-add, the vocab-parallel cross-entropy, masked softmax, RoPE).
# - `torch.compile` generates Triton kernels for such elementwise chains automatically; the
#   benchmark (`benchmarks/bench_kernels.py`) compares it with the hand-written kernels.
#
# ## Exercises
#
# 1. Put the four matmuls of a layer (QKV, projection, fc1, fc2) on the plot. How far right of
#    the ridge are they at micro-batch 1, and at $s = 512$?
#
#    <details><summary>Answer</summary>
#
#    A bf16 GEMM of $M \times K$ by $K \times N$ does $2MNK$
#    FLOPs on $2(MK + KN + MN)$ bytes, so its intensity is $MNK / (MK + KN + MN)$. Per TP rank
#    ($t = 2$): QKV is $K = 4096$, $N = 3072$; the projection $K = 2048$, $N = 4096$; fc1
#    $K = 4096$, $N = 14336$; fc2 $K = 7168$, $N = 4096$. At micro-batch 1, $M = 4096$ tokens:
#    1,229, 1,024, 1,792 and 1,593 FLOP/byte, 3.5 to 6.1 times the ridge of 295. At $s = 512$,
#    $M = 512$: 396, 372, 441 and 428 FLOP/byte, only 1.3 to 1.5 times the ridge, so the weights'
#    bytes start to matter.
#
#    </details>
#
# 2. Where does the bias-dropout-add of a model with dropout land, and how many bytes does
#    Megatron's fused version save per element?
#
#    <details><summary>Hint</summary>
#
#    Count it as <code>step_operations</code> does: a few FLOPs
#    per element, so it lands next to the norms, far left of the ridge. For the bytes, list the
#    loads and stores of the eager chain (add the bias, dropout with its mask, add the residual:
#    each op writes a tensor the next reads) against one kernel that reads the input and the
#    residual and writes the output and the mask. Megatron's version is
#    <code>megatron/core/fusions/fused_bias_dropout.py</code>.
#
#    </details>
