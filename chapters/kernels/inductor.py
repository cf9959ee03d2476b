# %% [markdown]
# # C.6 · Kernels: what torch.compile writes for RMSNorm
#
# `[model] compile = true` hands each transformer layer to `torch.compile`
# (`tinytron.model._compile.compile_layers`: one region per layer, compiled in place, as
# torchtitan compiles each block). Dynamo traces the layer into a graph, AOTAutograd splits it
# into a forward and a backward graph, and inductor writes fused kernels for both: C++ on a
# CPU, Triton on a GPU. The norms, RoPE, the SwiGLU product and the residual adds become
# generated kernels; the matmuls and attention stay library calls. This page reads what inductor
# writes for the op of [C.1](rmsnorm.py), RMSNorm, and sets it beside the hand-written kernel.
#
# You will build: `inductor_kernels` (the kernels of a real compile, as source text) and
# `inductor_triton_source` (inductor's Triton for a function, also on a machine without a GPU).

# %%
from __future__ import annotations

import re
from unittest import mock

import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

__all__ = ["inductor_kernels", "inductor_triton_source", "write_triton_report"]

# %% [markdown]
# ## Reading what inductor writes
#
# For every graph it compiles, inductor writes one Python module: buffer allocations, library
# calls, and each fused kernel as a string literal handed to `async_compile`: a C++ function to
# `async_compile.cpp_pybinding` on a CPU, a `@triton.jit` function to `async_compile.triton` on a
# GPU. `torch._inductor.utils.run_and_get_code(fn, *args)` runs `fn` and returns those modules
# as text (what `TORCH_LOGS=output_code` prints); `inductor_kernels` cuts the kernels out of them.
# The function may run a backward too, so a training graph's two modules both come back.

# %%
_KERNEL = re.compile(r"async_compile\.(cpp_pybinding|triton)\(.*?'''\n?(.*?)'''", re.S)


def inductor_kernels(fn, *args) -> list[tuple[str, str]]:
    """(kind, source) of every kernel inductor generates while `fn(*args)` runs: cpp or triton."""
    _, modules = run_and_get_code(fn, *args)
    return [(m.group(1).replace("cpp_pybinding", "cpp"), m.group(2))
            for code in modules for m in _KERNEL.finditer(code)]


# %% [markdown]
# ## Inductor's Triton without a GPU
#
# On a CPU, inductor can write Triton instead of C++ (`cpu_backend = "triton"`, meant for
# Triton's CPU backend). The code generator is the one it uses for a GPU, and it stops at two
# places only: it asks the active Triton driver for a hash to put in the kernel's metadata, and
# it hands the finished source to `async_compile.triton`, which would compile it. With no
# driver present, `inductor_triton_source` gives the hash a fixed value and takes the source at
# the second place, before anything is compiled. On CUDA tensors it is a plain compile.
#
# Two caveats, both visible in the output: the kernel's metadata names a CPU device, and the
# block sizes are not in the source at all. They are the `XBLOCK` and `R0_BLOCK` constexprs,
# chosen at the first launch by `triton_heuristics.reduction` from a short list of
# configurations (benchmarked when there is more than one). So the text below is what a GPU
# gets up to the device fields; `scripts/gpu_check.sh` saves the CUDA version to its report.
# This reaches into inductor's internals (torch 2.13): if they move, the page fails loudly.

# %%
class _Captured(Exception):
    """Raised at async_compile.triton with the kernel's source: nothing is compiled."""


def inductor_triton_source(fn, *args) -> list[str]:
    """The Triton kernels inductor writes for fn(*args): compiled on CUDA, source only on a CPU."""
    torch._dynamo.reset()  # a fresh trace: no graph compiled before is reused
    compiled = torch.compile(fn)
    if all(a.is_cuda for a in args if isinstance(a, torch.Tensor)):
        return [src for kind, src in inductor_kernels(compiled, *args) if kind == "triton"]
    sources = []

    def capture(self, kernel_name, source_code, *rest, **kw):
        sources.append(source_code)
        raise _Captured(kernel_name)

    with inductor_config.patch(cpu_backend="triton", fx_graph_cache=False), \
            mock.patch("torch.utils._triton.triton_hash_with_backend", lambda: "no-driver"), \
            mock.patch("torch._inductor.async_compile.AsyncCompile.triton", capture):
        try:
            compiled(*args)
        except Exception as err:  # inductor wraps what the capture raised
            if not sources:
                raise RuntimeError(f"inductor stopped before writing a Triton kernel: {err}") from err
    torch._dynamo.reset()
    return sources


# %% [markdown]
# ## Demo: one norm of the running example, three kernels
#
# 64 rows of $h = 4096$ in bf16 (one row per token; a TP rank of the running example
# normalizes 4096 such rows per norm), through C.1's `rms_norm_reference`, which is appendix
# B's RMSNorm forward: $y = w \odot \mathrm{cast}(x r)$, $r = 1/\sqrt{\overline{x^2} +
# \epsilon}$ in fp32. The demo compiles it on this CPU and prints inductor's C++ kernel, then
# inductor's Triton for the same graph, then C.1's hand-written forward kernel. It compares the
# compiled output with eager, bit for bit, with and without inductor's
# `emulate_precision_casts`; and it compiles a forward and backward to see what inductor's
# forward keeps for the backward.

# %%
if __name__ == "__main__":
    import inspect

    from tinytron.kernels import rmsnorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(4096, generator=gen)).to(torch.bfloat16)
    norm = lambda x, w: rmsnorm.rms_norm_reference(x, w, 1e-5)  # noqa: E731
    eager = norm(x, w)
    exact = w.float() * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5))

    torch._dynamo.reset()
    (kind, cpp), = inductor_kernels(torch.compile(norm), x, w)
    compiled = torch.compile(norm)(x, w)
    with inductor_config.patch(emulate_precision_casts=True):
        torch._dynamo.reset()
        emulated = torch.compile(norm)(x, w)
    differ = (compiled != eager).float().mean().item()
    err = {k: (v.float() - exact).abs().max().item() for k, v in
           (("eager", eager), ("compiled", compiled))}
    print(f"inductor's {kind} kernel:\n{cpp}")
    print(f"compiled != eager: {100 * differ:.1f}% of the bf16 outputs; with "
          f"emulate_precision_casts: {(emulated != eager).sum().item()} outputs")
    print("largest |y - fp32 math|:", {k: f"{v:.4f}" for k, v in err.items()})

# %% [markdown]
# The C++ kernel is a loop over rows with two vectorized loops inside, 32 lanes at a time on
# this machine (`VectorizedN<float, 2>`, two 16-lane AVX-512 registers; the width follows the
# CPU's vector instructions). The first squares and
# adds into a 32-lane fp32 accumulator and reduces the lanes at the end of the row; the sum lands
# in a `[64, 1]` fp32 buffer. The second loop reads the row again, and the weight, and writes
# $y$. The cast to bf16 before the weight is gone (`tmp12 = (tmp11)`): inductor keeps the
# product in fp32 and rounds once at the store. That is more accurate, not less (the largest
# error against fp32 math printed above is smaller), but a quarter of the bf16 outputs differ
# from eager by an ulp. `emulate_precision_casts = True` puts the rounding back and the outputs
# are bit-identical. In fp32, the dtype of the CPU trainer, there is no cast to drop; that is
# why the compiled trainer's losses match eager's to the bit on this machine
# (`tests/test_model_compile.py` allows $10^{-6}$ relative).

# %%
if __name__ == "__main__":
    triton_kernels = inductor_triton_source(norm, x, w)
    print(f"inductor's Triton ({len(triton_kernels)} kernel):\n{triton_kernels[0]}")
    print("C.1's hand-written forward kernel:\n" + inspect.getsource(rmsnorm._rmsnorm_fwd_kernel.fn))

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch._dynamo.reset()
    train = torch.compile(norm)
    _, (fwd_module, _bwd) = run_and_get_code(lambda: train(xr, wr).float().sum().backward())
    saved = [ln.strip() for ln in fwd_module.splitlines() if ln.strip().startswith("return (")]
    print("the compiled forward returns (y, then what it saves):", saved[-1])

    assert kind == "cpp" and cpp.count("for(int64_t x1") == 2  # two passes over each row
    assert "tl.range(0, r0_numel, R0_BLOCK)" in triton_kernels[0]
    assert triton_kernels[0].count("for r0_offset") == 2
    assert 0.1 < differ < 0.5 and (emulated != eager).sum().item() == 0
    assert err["compiled"] <= err["eager"]

# %% [markdown]
# ## Side by side
#
# ```mermaid
# flowchart LR
#   subgraph hand["C.1: one program, whole rows"]
#     H1["load x: ROWS x 4096, once"] --> H2["sum x² in fp32 → r"]
#     H2 --> H3["round(x r) to bf16, × w"] --> H4["store y and r"]
#   end
#   subgraph ind["inductor: XBLOCK rows, R0_BLOCK columns at a time"]
#     I1["loop 1: load a chunk of x, acc += x²"] --> I2["tl.sum(acc) → r"]
#     I2 --> I3["loop 2: load the chunk again, and w"] --> I4["x r w in fp32, store y"]
#   end
# ```
#
# | | C.1, hand-written | inductor (Triton above; the C++ kernel has the same plan) |
# |---|---|---|
# | reduction | whole row in registers, one `tl.sum` per row | looped: a `[XBLOCK, R0_BLOCK]` fp32 accumulator over the row's chunks, then one `tl.sum` |
# | passes over $x$ | one | two: the second load is marked `evict_first`, the first `evict_last`, so the second pass should hit the L2 cache |
# | tiling | `ROWS` × `BLOCK_H`, the next power of two ≥ $h$, fixed by a rule (C.1's warps table) | `XBLOCK` × `R0_BLOCK` chosen at the first launch from a list of configurations |
# | accumulator | fp32 | fp32 |
# | weight multiply | fused, after rounding $x r$ to the input dtype (eager's numbers) | fused, in fp32 with no intermediate rounding (unless `emulate_precision_casts`) |
# | saved for backward | $x$, $w$, $r$ (fp32, one per row) | the printed line: $x$, $w$ and a `[64, 1]` fp32 buffer, the same three |
# | widest row | 8192 (registers; wider is refused) | any: the loop has no limit |
#
# The hand-written kernel gets its single pass from holding the row in registers, which is why
# C.1 sizes the warps to the row and refuses rows wider than 8192; inductor's loop works for
# any width and pays a second read, which the cache absorbs when the chunk fits. Whether the
# extra read costs anything on an H200 is `gpu_check.sh`'s measurement, not this page's claim.
#
# <details><summary>Measured: the compiled step on this book's CPU</summary>
#
# On this 2-core CPU, one thread, the whole step at `bench_train.py`'s shape (h 256, 4 layers,
# s 256) takes 0.92× eager's CPU time with every layer compiled, and 0.95× that of the
# independent plain-PyTorch loop (eager tinytron: 1.05×); at `configs/tiny.toml`'s shape 0.91×
# and 0.98× (eager 1.06×). The compile is left out: about 90 s the first time on the loaded
# machine, a few seconds once inductor's on-disk cache holds the graphs
# (`python benchmarks/bench_compile.py [--shape tiny]`, `benchmarks/results/compile*.json`).
#
# </details>
#
# Inductor also fuses across op boundaries that a hand-written kernel does not cross. Compiled
# whole, one layer of the tiny config (h = 64) runs five generated kernels in its forward: the
# first norm, RoPE on queries and keys, the residual add together with the second norm
# (`cpp_fused__unsafe_view_add_mean_mul_pow_rsqrt_2`), the SwiGLU product and the last residual
# add; the four matmuls and SDPA stay library calls.
#
# <details><summary>Megatron detail: compiling functions, not layers</summary>
#
# <p>Megatron applies <code>torch.compile</code> to small functions, not to layers:
# <code>jit_fuser</code> is <code>torch.compile</code> on torch 2.2 and later
# (<code>megatron/core/jit.py:21</code>) and decorates elementwise pieces such as the bias-SwiGLU
# (<code>megatron/core/fusions/fused_bias_swiglu.py:15</code>); its norms come from Transformer
# Engine. tinytron compiles whole layers, and refuses <code>compile</code> together with
# <code>kernels = "triton"</code>: one switch decides who writes the fused kernels.</p>
#
# </details>

# %% [markdown]
# ## The GPU report
#
# `write_triton_report` is what `scripts/gpu_check.sh` calls on the GPU: the Triton kernels of
# the forward and the backward of this norm at the running example's 4096 rows, as a Markdown
# file for the report.

# %%
def write_triton_report(path: str, device: str = "cuda", rows: int = 4096,
                        hidden: int = 4096) -> int:
    """Write inductor's Triton for RMSNorm's forward (and, on CUDA, backward) to `path`."""
    from tinytron.kernels.rmsnorm import rms_norm_reference

    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    w = torch.ones(hidden, device=device, dtype=torch.bfloat16, requires_grad=device == "cuda")
    x.requires_grad_(device == "cuda")

    def norm_step(x, w):  # on CUDA the backward is compiled too; on a CPU the forward only
        y = rms_norm_reference(x, w, 1e-5)
        if x.requires_grad:
            y.float().sum().backward()
        return y
    kernels = inductor_triton_source(norm_step, x, w)
    with open(path, "w") as f:
        f.write(f"inductor's Triton for RMSNorm, {rows} x {hidden} bf16 on {device} "
                f"(torch {torch.__version__}):\n\n")
        for src in kernels:
            f.write("```python\n" + src.strip() + "\n```\n\n")
    return len(kernels)


# %% [markdown]
# ## Summary
#
# - `run_and_get_code` returns what inductor writes; the kernels are the strings handed to
#   `async_compile`: C++ on a CPU, Triton on a GPU, and Triton on a CPU too when asked.
# - Inductor's RMSNorm is a looped reduction with two passes over each row, fp32 accumulation,
#   and the weight multiply fused; it drops the cast before the weight, so bf16 outputs differ
#   from eager by an ulp in a quarter of the elements unless `emulate_precision_casts` is set.
# - C.1's kernel makes one pass with the row in registers, rounds where eager rounds, and
#   stops at rows of 8192.
#
# ## Exercises
#
# 1. Compile appendix B's SwiGLU product (`silu(gate) * up` on the two halves of fc1's output)
#    and read its Triton: how many loads and stores does it make per element, against C.2's?
#
#    <details><summary>Hint</summary>
#
#    Pass the product to <code>inductor_triton_source</code> and
#    count the <code>tl.load</code> and <code>tl.store</code> lines of each kernel. C.2's forward
#    makes two loads (gate and up, $f$ apart) and one store per output element, 6 bytes in bf16
#    (<code>swiglu_bytes</code>); check whether inductor fuses the <code>chunk</code>, the
#    <code>silu</code> and the product into one kernel the same way.
#
#    </details>
#
# 2. Compile a whole `TransformerLayer` and run a backward through it. How many kernels does
#    the backward graph have, and which forward values does the partitioner recompute there
#    rather than save?
#
#    <details><summary>Hint</summary>
#
#    Compile with a backend that prints the partitioned graphs, or
#    read the backward's kernels with <code>inductor_kernels</code> on a GPU. The min-cut
#    partitioner recomputes cheap elementwise values (the norm's scaled output, the SwiGLU
#    activation) from tensors it saves anyway, as C.1 and C.2 do by hand, and saves the matmul
#    outputs.
#
#    </details>
#
# 3. Set `emulate_precision_casts = True` and compile the norm again: which lines of the C++
#    kernel change?
#
#    <details><summary>Hint</summary>
#
#    Diff the two C++ sources from <code>inductor_kernels</code>.
#    Look for the casts: with the flag on, inductor rounds intermediate values to the input's
#    dtype where eager PyTorch would, so extra conversions to bf16 and back appear between the
#    multiply and the reduction.
#
#    </details>
