# %% [markdown]
# # B.2 · Model: RMSNorm, RoPE and a layout-independent init
#
# The three small pieces under every layer: the norm, the rotary position embedding, and a
# parameter initialization that gives the same full weights whether the model is cut over one
# rank or sixteen — so a TP 2 × PP 2 run can be compared with a single-process run number for
# number.
#
# You will build: `RMSNorm`, `rope_cos_sin`, `apply_rope`, `ShardSpec`, `shard_of`, `unshard`,
# `init_full_tensor`.

# %%
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "RMSNorm",
    "rope_cos_sin",
    "apply_rope",
    "rotate_half",
    "ShardSpec",
    "shard_of",
    "unshard",
    "init_full_tensor",
]

# %% [markdown]
# ## RMSNorm
#
# $\mathrm{RMSNorm}(x) = w \odot x / \sqrt{\overline{x^2} + \epsilon}$: no mean subtraction and no
# bias, one weight of $h$ per norm. The mean of squares runs in fp32 even for bf16 input (a bf16
# sum of 4096 squares keeps only 8 bits of mantissa). Megatron builds it from
# `torch.nn.RMSNorm` or Transformer Engine (`megatron/core/transformer/torch_norm.py:58`); its
# fp32 formula is at `torch_norm.py:102`. Hugging Face's `LlamaRMSNorm` casts back to the input
# dtype *before* multiplying by the weight; so does this one, so the two agree bit for bit.
#
# Under sequence parallelism each TP rank normalizes only its own $s / t$ tokens, so the
# gradient of $w$ on each rank covers a different slice of the sequence; it must be summed
# over the TP group before the optimizer step. The weight is marked `sequence_parallel = True`
# for [chapter 05's `finalize_model_grads`](../05_buffers/finalize_model_grads.py) to find it.

# %%
class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel weight (initialized to ones)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.weight.sequence_parallel = sequence_parallel
        self.weight.shard_spec = ShardSpec((hidden_size,), dim=None, init="ones")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


# %% [markdown]
# **What the norm keeps for backward.** Left to autograd, the four lines of that formula
# would save the fp32 copy of the input (for the square and the product), $1/\mathrm{rms}$ and
# the normalized input in the input's dtype: $4 + P$ bytes per element. Megatron's fused norm
# keeps the input as it came, in bf16, and one fp32 $1/\mathrm{rms}$ per row: Transformer
# Engine's RMSNorm (Megatron's `TENorm`) saves its input and the per-row `rstdevs` its fused
# forward returns, Apex's `FusedRMSNormAffineFunction` its input, the weight and `invvar`; both
# rebuild the normalized input in backward. `_RMSNormFunction` does the same: $P$ bytes per element plus
# 4 per row. Its backward recomputes $x_{32}$ and the normalized input from the saved $x$ and
# $1/\mathrm{rms}$ and then applies, op for op and in the same order, the formulas autograd's
# own backward nodes use (`MulBackward0`, `ToCopyBackward0`, `RsqrtBackward0`,
# `MeanBackward1`, `PowBackward0`), so the gradients are the ones the plain formula gives,
# bit for bit (the tests compare the two).

# %%
class _RMSNormFunction(torch.autograd.Function):
    """w * (x / rms(x)) saving x (its own dtype) and 1/rms (fp32, one per row), as Megatron's norm."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        x32 = x.float()
        grad_w = None
        if ctx.needs_input_grad[1]:
            normed = (x32 * rstd).to(x.dtype)
            grad_w = (normed.mul_(grad) if normed.dtype == grad.dtype
                      else grad * normed).to(weight.dtype).sum_to_size(weight.shape)
            del normed
        if not ctx.needs_input_grad[0]:
            return None, grad_w, None
        grad_normed = (grad * weight).to(x.dtype).float()
        grad_rstd = (grad_normed * x32).sum_to_size(rstd.shape)
        grad_mean = (-0.5 * grad_rstd) * rstd.pow(3) / x32.shape[-1]  # d rsqrt(m)/dm = -rsqrt(m)^3/2
        # autograd's order: (g_n * rstd) + (g_mean * 2 x); products commute, so in place is exact
        grad_x = grad_normed.mul_(rstd).add_((2.0 * x32).mul_(grad_mean))
        return grad_x.to(x.dtype), grad_w, None


# %% [markdown]
# ## RoPE, rotate-half convention
#
# Rotary embeddings turn each pair of channels of a query or key into a point in the plane and
# rotate it by an angle proportional to the token position: channel pair $i$ at position $m$
# turns by $m\,\theta_i$ with $\theta_i = \text{base}^{-2i/d}$. The dot product of a query at
# $m$ and a key at $n$ then depends on $m - n$ only.
#
# Which channels form a pair is a convention. *Rotate-half* pairs channel $i$ with channel
# $i + d/2$: with $x = [x_1, x_2]$ split in halves,
# $$\mathrm{rope}(x) = x \cos + [-x_2, x_1] \sin,$$
# where $\cos$ and $\sin$ repeat the $d/2$ angles twice (`torch.cat((freqs, freqs))`). Megatron
# (`megatron/core/models/common/embeddings/rope_utils.py:73` for `_rotate_half`,
# `rotary_pos_embedding.py:168` for the doubled table) and Hugging Face Llama both use it, so a
# Hugging Face checkpoint loads with no permutation of the q/k rows. (Meta's original Llama
# pairs *adjacent* channels; converting from that layout needs the permutation.)
#
# Worked example, $d = 4$, base 10000, position $m = 1$: $\theta = [1, 0.01]$, so channels
# (0, 2) rotate by 1 rad and (1, 3) by 0.01 rad; $x = [1, 0, 0, 0]$ becomes
# $[\cos 1, 0, \sin 1, 0] = [0.540, 0, 0.841, 0]$.
#
# The angles come from explicit `position_ids` ([b, s]) rather than `arange(s)`: with packed
# documents whose positions restart at each end-of-document token
# ([chapter 00](../00_overview/batch.py)), and under
# context parallelism, where a rank holds chunks $r$ and $2c - 1 - r$ of the sequence, the
# positions are not $0 \dots s - 1$.

# %%
def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape position_ids.shape + (head_dim,) for rotate-half RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                            dtype=torch.float32) / head_dim))
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., d/2]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] along the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., heads, d] by full-width tables cos/sin [..., d], broadcast over heads."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotate_half(x) * sin


# %% [markdown]
# That is the whole forward: two products, a negation, one concatenation and a sum, over the
# whole batch at once. Autograd saves only the two tables for the backward (the products'
# other operands), not $x$, so RoPE adds nothing to chapter 07's count of saved activations.
# Megatron's unfused path is the same formula (`rope_utils.py:73` for `_rotate_half`, applied
# at `:92`); Transformer Engine fuses it into one kernel (`fused_apply_rotary_pos_emb`).
#
# The tables are the same in every step, so the model builds them **once per sequence length**
# and caches them ([page B.4](gpt.py)) rather than taking a power, an outer product, a cosine
# and a sine per position in every layer. Applying the formula per half instead (four
# half-width products written into the halves of one output, no `rotate_half`) saves the
# concatenation but not time: on a CPU each of those products walks a strided half of $x$, and
# this model's benchmark (`benchmarks/bench_model.py`, against a plain-PyTorch Llama that
# uses the formula) ran slower with them than with the formula, so the formula stays.

# %% [markdown]
# ## One init for every layout
#
# Chapters compare a sharded run with a single-process run and expect the same numbers. That
# only works if "the same seed" means "the same full weights", whatever the layout. Drawing
# each rank's shard from its own RNG stream does not give that: the shards of TP 2 are not the
# halves of the TP 1 weight.
#
# So every parameter is first drawn **in full** from a generator seeded by
# `(config.seed, global parameter name)` and then sliced to this rank's shard. The global name
# uses the global layer index (`decoder.layers.17.…` on whichever stage holds layer 17), so a
# pipeline split does not rename anything.
#
# <details><summary>Megatron detail: seeding per name</summary>
#
# <p>Megatron's <code>--use-cpu-initialization</code> also draws the master weight and splits it
# (<code>megatron/core/tensor_parallel/layers.py:152</code>), but from one global RNG stream
# whose order depends on the layout, and its default GPU path draws each shard on its own rank
# (<code>:137-148</code>). Seeding per name removes that dependence: layer 17's
# <code>linear_fc1</code> gets the same $[2f, h]$ matrix at TP 1, TP 8 or on any pipeline
# stage.</p>
#
# </details>
#
# The cost is that each rank draws the full tensors of its own layers: for the 7B example at
# TP 8 a rank draws 8× its shard, 7.5 B normal numbers — about two minutes on one busy CPU
# core of the machine this book was written on — once, holding at most one full tensor (the
# 2.1 GB fp32 embedding) at a time. A loader that overwrites every weight skips the draw
# (`GPTModel(..., initialize=False)`).
#
# A `ShardSpec` on each parameter records its full shape and how TP cuts it: `dim` is the
# partitioned dimension (None = replicated); `chunks = 2` says the dimension holds two stacked
# blocks that are split separately — SwiGLU's `linear_fc1` stacks gate and up rows, and rank $r$
# holds gate rows $r$ *and* up rows $r$, not one contiguous half. The same spec gathers shards
# back into the full tensor for a Hugging Face export.

# %%
@dataclass(frozen=True)
class ShardSpec:
    """Full shape of a parameter and how tensor parallelism cuts it."""

    full_shape: tuple[int, ...]
    dim: int | None = None
    chunks: int = 1
    init: str = "normal"
    std: float = 0.02


def shard_of(full: torch.Tensor, spec: ShardSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's piece of a full tensor."""
    if tuple(full.shape) != tuple(spec.full_shape):
        raise ValueError(f"expected shape {tuple(spec.full_shape)}, got {tuple(full.shape)}")
    if spec.dim is None or tp == 1:
        return full
    blocks = full.chunk(spec.chunks, dim=spec.dim)
    return torch.cat([b.chunk(tp, dim=spec.dim)[tp_rank] for b in blocks], dim=spec.dim)


def unshard(pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from the pieces of TP ranks 0..t-1 (inverse of shard_of)."""
    if spec.dim is None or len(pieces) == 1:
        return pieces[0]
    per_rank = [p.chunk(spec.chunks, dim=spec.dim) for p in pieces]
    blocks = [torch.cat([pr[c] for pr in per_rank], dim=spec.dim) for c in range(spec.chunks)]
    return torch.cat(blocks, dim=spec.dim)


# %% [markdown]
# The init draws each full tensor from a generator seeded by the run's seed and the parameter's
# global name, hashed, so a weight's values do not depend on which rank draws it or in what order.

# %%
def _name_seed(seed: int, name: str) -> int:
    """A 63-bit seed that depends only on (seed, name) — stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_full_tensor(spec: ShardSpec, seed: int, name: str) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` (CPU), independent of the layout."""
    if spec.init == "ones":
        return torch.ones(spec.full_shape)
    if spec.init == "zeros":
        return torch.zeros(spec.full_shape)
    gen = torch.Generator().manual_seed(_name_seed(seed, name))
    return torch.randn(spec.full_shape, generator=gen) * spec.std


def scaled_std(init_std: float, num_layers: int) -> float:
    """Std of the layers that write into the residual stream: init_std / sqrt(2 L)."""
    return init_std / math.sqrt(2.0 * num_layers)


# %% [markdown]
# ## Demo: RoPE is relative, RMSNorm is scale-free, the init is layout-free

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    torch.manual_seed(0)
    d = 8
    q, k = torch.randn(1, 1, d), torch.randn(1, 1, d)

    def score(m: int, n: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([m]), d)
        ck, sk = rope_cos_sin(torch.tensor([n]), d)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    print("q.k at (m, n) = (5, 2), (13, 10), (103, 100):",
          [round(score(m, m - 3), 5) for m in (5, 13, 103)])
    cos, sin = rope_cos_sin(torch.tensor([1]), 4)
    print("x = [1, 0, 0, 0] at position 1 ->", apply_rope(torch.tensor([[[1.0, 0, 0, 0]]]),
                                                          cos, sin).flatten().tolist())

# %% [markdown]
# RMSNorm divides by the row's own scale, so scaling the input by 10 changes nothing; and it keeps
# its bf16 input, the weight and one fp32 number per row for the backward.

# %%
if __name__ == "__main__":
    norm = RMSNorm(d, eps=1e-12)  # a tiny eps: the scale-invariance is then exact to rounding
    x = torch.randn(3, d)
    with torch.no_grad():
        gap = float((norm(10 * x) - norm(x)).abs().max())
    print(f"RMSNorm(10 x) - RMSNorm(x), max: {gap:.1e}")
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        norm(torch.randn(3, d).bfloat16().requires_grad_())
    print("RMSNorm keeps for backward:", [(tuple(t.shape), str(t.dtype)) for t in kept])

# %% [markdown]
# A `ShardSpec` with two chunks: TP rank 0 of a stacked fc1 holds the first half of the gate rows
# and the first half of the up rows.

# %%
if __name__ == "__main__":
    spec = ShardSpec((6, 4), dim=0, chunks=2)
    full = init_full_tensor(spec, seed=1234, name="decoder.layers.0.mlp.linear_fc1.weight")
    halves = [shard_of(full, spec, r, 2) for r in range(2)]
    print("fc1 (gate rows 0-2, up rows 3-5) on TP rank 0 holds rows [0, 1, 3, 4]:",
          tuple(halves[0].shape))

# %% [markdown]
# Last, RoPE's pairs over 64 positions, then the asserts of the demo's claims.

# %%
if __name__ == "__main__":
    positions = torch.arange(64)
    cos, _ = rope_cos_sin(positions, 16)
    plt.figure(figsize=(6, 2.5))
    for i in range(0, 8, 2):
        plt.plot(positions, cos[:, i], label=f"pair {i}")
    plt.xlabel("position m")
    plt.ylabel("cos(m θ_i)")
    plt.legend(fontsize=7)
    plt.title("RoPE: low pairs spin fast, high pairs slowly")
    plt.tight_layout()
    plt.show()

    assert abs(score(5, 2) - score(103, 100)) < 1e-4, "RoPE scores depend on m - n only"
    assert gap < 1e-5
    # its bf16 input, the weight and one fp32 1/rms per row, as Megatron's fused norm
    assert [t.dtype for t in kept] == [torch.bfloat16, torch.float32, torch.float32]
    assert torch.equal(unshard(halves, spec), full)
    assert torch.equal(halves[0], torch.cat([full[0:2], full[3:5]]))

# %% [markdown]
# ## Summary
#
# - RMSNorm normalizes in fp32 and casts back before the weight, like Hugging Face's Llama; it
#   keeps only its input and $1/\mathrm{rms}$ for backward, like Megatron's fused norm.
# - RoPE here is rotate-half, the convention of Megatron and Hugging Face Llama: no q/k
#   permutation is needed to load a Hugging Face checkpoint.
# - Every parameter is drawn in full from a `(seed, global name)` generator and sliced, so the
#   same seed gives the same model on any TP/PP layout; `ShardSpec` records the cut, and
#   `shard_of`/`unshard` move between full and sharded forms.
#
# ## How production does it
#
# - Megatron: `megatron/core/transformer/torch_norm.py` (norm selection),
#   `megatron/core/models/common/embeddings/rotary_pos_embedding.py` and `rope_utils.py`
#   (RoPE tables, rotate-half, the CP slice at `rope_utils.py:48`),
#   `megatron/core/tensor_parallel/layers.py:137-200` (GPU and CPU affine-weight init).
# - torchtitan: `torchtitan/models/llama3/model/model.py` (`precompute_freqs_cis` uses complex
#   numbers and the adjacent-pair convention, then permutes weights on HF conversion).
#
# ## Exercises
#
# 1. Implement the adjacent-pair (interleaved) RoPE and find the row permutation of `q_proj`
#    that makes it equal to rotate-half.
#
#    <details><summary>Hint</summary>
#
#    Interleaved RoPE rotates channels $(2i, 2i+1)$ of a head by
#    $m\theta_i$; rotate-half (<code>apply_rope</code>) rotates $(i, i + d/2)$. Reorder each
#    head's $d$ rows of <code>q_proj</code> (and <code>k_proj</code>) so that row $2i$ goes to $i$
#    and row $2i+1$ to $i + d/2$; check with <code>score</code> from the demo that both forms give
#    the same $q \cdot k$.
#
#    </details>
#
# 2. Show that RMSNorm's fp32 statistics matter: compare a bf16-only version on $h = 4096$.
#
#    <details><summary>Hint</summary>
#
#    Compute the mean of squares in bf16 (no
#    <code>.float()</code>) and compare both versions with an fp64 reference on rows of 4,096
#    values. A bf16 sum keeps 8 significant bits, so once the running sum is a few hundred times
#    larger than each square, the small squares round away; [page C.1](../kernels/rmsnorm.py)'s demo shows a kernel that
#    sums the squares in bf16 breaking its error bound.
#
#    </details>
#
# 3. Why must the init seed depend on the *global* layer index and not on the local one?
#
#    <details><summary>Hint</summary>
#
#    With PP 2, stage 1's local layer 0 is the model's layer 8.
#    Seeded by local names, both stages would draw the same weights for their layer 0, and the
#    model would differ from the one-process model of the same seed. Look at
#    <code>global_parameter_name</code> in <code>init_parameters</code> ([page B.4](gpt.py)).
#
#    </details>
