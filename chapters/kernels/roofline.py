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
# running example) and `plot_roofline`.

# %%
from __future__ import annotations

import torch

from tinytron.kernels._measure import H100_SXM, EagerTraffic, GPU, roofline_seconds
from tinytron.kernels.cross_entropy import cross_entropy_bytes, vocab_parallel_cross_entropy_reference
from tinytron.kernels.flash_attention import attention_bytes, attention_eager, attention_flops
from tinytron.kernels.fused_adamw import adamw_bytes, adamw_reference_
from tinytron.kernels.rmsnorm import rms_norm_bytes, rms_norm_reference
from tinytron.kernels.swiglu import swiglu_bytes, swiglu_reference
from tinytron.parallel import ParallelGrid

__all__ = ["eager_bytes_per_element", "step_operations", "plot_roofline"]

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
# 2. Where does the bias-dropout-add of a model with dropout land, and how many bytes does
#    Megatron's fused version save per element?
