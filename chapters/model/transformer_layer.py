# %% [markdown]
# # B.3 · Model: the transformer layer, cut by TP, SP and CP
#
# Page [B.2](layers.py) built the small pieces: the norm, the rotary embedding and an init that
# does not depend on the layout. This page joins them with
# [appendix A's](../parallel/tensor_parallel.py) parallel linears into the block the model
# repeats $L$ times: grouped-query attention and a SwiGLU MLP, each behind its norm and around
# a residual.
#
# Almost every cut of the model happens inside this block, and each cut asks something of it.
# Tensor parallelism must hand every rank *whole* heads and *whole* SwiGLU units, or a rank
# would wait for another's half before it could multiply. Context parallelism gives a rank only
# some of the tokens, yet its queries need the keys of every earlier token. Dropout must draw
# the same mask where ranks hold the same activations and different masks where they do not.
# The next page, [B.4](gpt.py), stacks the layers into the model.
#
# You will build: `CoreAttention`, `QKVProjection`, `SelfAttention`, `SwiGLUMLP`,
# `TransformerLayer`.

# %%
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from tinytron.kernels import flash_attention, rms_norm, swiglu, swiglu_reference, use_triton
from tinytron.model.config import ModelConfig
from tinytron.model.layers import RMSNorm, ShardSpec, apply_rope, scaled_std
from tinytron.parallel import ColumnParallelLinear, ParallelGrid, RowParallelLinear
from tinytron.parallel.context_parallel import cp_positions, gather_kv_for_context_parallel

__all__ = [
    "CoreAttention",
    "QKVProjection",
    "SelfAttention",
    "KernelRMSNorm",
    "SwiGLUMLP",
    "TransformerLayer",
]

# %% [markdown]
# ## One layer, as shapes
#
# Activations inside the model are $[s, b, h]$ (sequence first), Megatron's layout: sequence
# parallelism and pipeline sends then cut or ship dim 0. With $t$ TP ranks, $c$ CP ranks and
# sequence parallelism on, a layer's input on one rank is $[s/(c t), b, h]$, and inside it:
#
# ```mermaid
# flowchart TB
#   X["x [s/(c t), b, h]"] --> N1["input_layernorm"]
#   N1 --> QKV["linear_qkv (all-gather s)<br/>[s/c, b, (a + 2g) d / t]"]
#   QKV --> R["RoPE on q and k<br/>K, V gathered over CP"]
#   R --> ATT["attention<br/>[s/c, b, a d / t]"]
#   ATT --> P["linear_proj (reduce-scatter s)<br/>[s/(c t), b, h], + x"]
#   P --> N2["pre_mlp_layernorm"]
#   N2 --> FC1["linear_fc1 (all-gather s)<br/>[s/c, b, 2f/t]"]
#   FC1 --> SW["silu(gate) * up<br/>[s/c, b, f/t]"]
#   SW --> FC2["linear_fc2 (reduce-scatter s)<br/>[s/(c t), b, h], + residual"]
# ```
#
# Without sequence parallelism the column layers' input gather is a no-op copy and the row
# layers all-reduce instead of reduce-scattering. Parameter names follow Megatron's local
# spec (`megatron/core/models/gpt/gpt_layer_specs.py:467`): under `decoder.layers.{i}.`,
# `self_attention.linear_qkv.weight`, `…linear_proj`, `mlp.linear_fc1`, `mlp.linear_fc2`,
# `input_layernorm` and `pre_mlp_layernorm`.
#
# ## Attention with grouped queries
#
# `linear_qkv` is one column-parallel matrix whose $(a + 2g) d$ output rows are laid out **group
# by group**: for each key/value group, its $a/g$ query heads, then its key head, then its value
# head. Cutting the rows into $t$ contiguous pieces hands each TP rank $g/t$ whole groups with
# their queries, so attention needs no communication. Megatron views the output as
# $[s, b, g/t, (a/g + 2) d]$ and splits it (`megatron/core/transformer/attention.py:1540-1631`).
# Worked example, the tiny config ($a = 4$, $g = 2$, $d = 16$): 128 rows =
# [q0 q1 k0 v0 | q2 q3 k1 v1] × 16; TP rank 1 holds the second group.
#
# The heads go through `torch.nn.functional.scaled_dot_product_attention` with
# `enable_gqa=True` (query head $j$ reads key/value group $j \,/\, (a/g)$, Megatron's
# `repeat_interleave` at `dot_product_attention.py:169`). The mask is causal; an optional
# `attention_mask` adds Megatron's boolean mask with **True = masked** (`[b, 1, s_q, s_k]`,
# e.g. [chapter 00's](../00_overview/batch.py) reset-at-end-of-document mask for packed
# sequences), so a token never attends forward.
#
# **Context parallel.** A CP rank holds sequence chunks $r$ and $2c - 1 - r$ of every sample
# ([appendix A](../parallel/context_parallel.py)). Its queries need the keys and values of every
# earlier token, so K and V are
# all-gathered over the CP group (`gather_kv_for_context_parallel`), and the causal mask
# compares the *global* sequence index of each local query with that of each key. The keys
# arrive in rank order — for $c = 2$ chunks 0, 3, 1, 2 — so the mask's columns are put in that
# order rather than moving the tensors. The gather's backward reduce-scatters the K/V
# gradients home. The `attention_mask` of a CP rank holds its
# own query rows and all key columns, `[b, 1, s/c, s]`, which is how Megatron's
# `get_batch_on_this_cp_rank` slices it (`megatron/core/utils.py`).

# %% [markdown]
# Core attention comes first, as a small class of its own that `SelfAttention` inherits (Megatron
# keeps it a separate module too, `DotProductAttention`): the flash kernel when it applies, else
# PyTorch's scaled dot-product attention with the causal mask combined with any given mask.
# `_allowed` builds that combined mask. Example, $c = 2$, $s = 8$, CP rank 0: its queries sit at
# positions $[0, 1, 6, 7]$ and the gathered keys at $[0, 1, 6, 7, 2, 3, 4, 5]$, so the query
# at 6 may attend to key columns 0, 1, 2, 4, 5, 6, 7 and not to column 3 (position 7): a causal
# mask, with its columns in the order the keys arrived (the demo checks this row).

# %%
class CoreAttention:
    """softmax(q k^T / sqrt(d) + mask) v for SelfAttention; reads config, grid and rng_tracker."""

    def _attend(self, q, k, v, attention_mask):
        """softmax(q k^T / sqrt(d) + mask) v over the whole sequence, causal; [s, b, n, d] inputs."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # -> [b, n, s, d]
        if (use_triton(self.config.kernels, q.device) and self.grid.size("cp") == 1
                and attention_mask is None and not (self.training and self.config.dropout > 0)):
            # appendix C's flash kernel: causal, no extra mask, no dropout (else SDPA below)
            out = flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
            return out.permute(2, 0, 1, 3).flatten(2)
        k = gather_kv_for_context_parallel(k, self.grid, seq_dim=2)
        v = gather_kv_for_context_parallel(v, self.grid, seq_dim=2)
        allowed = self._allowed(q.shape[2], k.shape[2], attention_mask, q.device)
        p = self.config.dropout if self.training else 0.0
        with _fork(self.rng_tracker, p > 0 and not self.config.sequence_parallel):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p,
                                                 is_causal=allowed is None, enable_gqa=True)
        return out.permute(2, 0, 1, 3).flatten(2)  # -> [s, b, n * d]

    def _allowed(self, s_q: int, s_k: int, attention_mask, device):
        """Boolean 'may attend' mask [., 1, s_q, s_k] in gathered-key order; None if plain causal."""
        cp, grid = self.grid.size("cp"), self.grid
        if cp == 1 and attention_mask is None:
            return None
        if cp > 1:
            q_pos = cp_positions(s_k, cp, grid.rank("cp")).to(device)
            k_pos = torch.cat([cp_positions(s_k, cp, r) for r in range(cp)]).to(device)
        else:
            q_pos = k_pos = torch.arange(s_k, device=device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if attention_mask is not None:
            if attention_mask.dim() != 4 or tuple(attention_mask.shape[-2:]) != (s_q, s_k):
                raise ValueError(f"attention_mask must be [b, 1, {s_q}, {s_k}] (True = masked), "
                                 f"got {tuple(attention_mask.shape)}")
            allowed = allowed & ~attention_mask.to(torch.bool)[..., k_pos]
        return allowed


# %% [markdown]
# Two helpers: `_no_init` leaves a new weight as allocated, and `_fork` enters the RNG
# tracker's TP fork only when dropout draws.

# %%
def _no_init(weight: torch.Tensor) -> None:
    """Leave a freshly allocated weight as is: init_parameters fills every weight afterwards."""


def _fork(tracker, enabled: bool = True):
    """The tracker's TP-parallel RNG fork, or a no-op when there is no tracker or no dropout."""
    if tracker is None or not enabled:
        return contextlib.nullcontext()
    return tracker.fork()


# %% [markdown]
# The projection views the fused QKV output group by group: in each group, $a/g$ query heads,
# then one key head and one value head. RoPE turns queries and keys; the values pass as they are.

# %%
class QKVProjection:
    """project_qkv for SelfAttention; reads linear_qkv, config, heads_per_group, local_groups."""

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [s, b, a/t, d], k and v [s, b, g/t, d], RoPE applied; B.6's KV cache calls it too."""
        qkv = self.linear_qkv(x)  # [s, b, g/t * (a/g + 2) * d]
        s, b = qkv.shape[:2]
        d, per = self.config.head_dim, self.heads_per_group
        qkv = qkv.view(s, b, self.local_groups, per + 2, d)
        q, k, v = qkv.split([per, 1, 1], dim=3)  # views; the backward is one concatenation
        k, v = k.squeeze(3), v.squeeze(3)  # [s, b, g/t, d]
        # RoPE reads the query view as [s, b, g/t, a/g, d] and writes a new contiguous tensor,
        # so the heads are flattened for free (no copy of the strided query rows first)
        q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2)).view(s, b, -1, d)
        return q, apply_rope(k, cos, sin), v


# %% [markdown]
# `SelfAttention` owns the two weights, the fused `linear_qkv` (column-parallel) and
# `linear_proj` (row-parallel), built with shard specs instead of an init (`init_parameters`
# draws every weight later). Its forward projects, attends (or lets chapter 06's
# `attend_wrapper` attend), and projects back.

# %%
class SelfAttention(CoreAttention, QKVProjection, nn.Module):
    """GQA self-attention: fused column-parallel QKV, RoPE, SDPA, row-parallel output projection."""

    def __init__(self, config: ModelConfig, grid: ParallelGrid, rng_tracker=None):
        super().__init__()
        tp, h, d = grid.size("tp"), config.hidden_size, config.head_dim
        a, g = config.num_attention_heads, config.num_query_groups
        self.grid, self.config, self.rng_tracker = grid, config, rng_tracker
        self.heads_per_group, self.local_groups = a // g, g // tp
        sp = config.sequence_parallel
        self.linear_qkv = ColumnParallelLinear(h, (a + 2 * g) * d, grid, bias=False,
                                               sequence_parallel=sp, init_method=_no_init)
        self.linear_qkv.weight.shard_spec = ShardSpec(((a + 2 * g) * d, h), dim=0,
                                                      std=config.init_std)
        self.linear_proj = RowParallelLinear(a * d, h, grid, bias=False, sequence_parallel=sp,
                                             init_method=_no_init)
        self.linear_proj.weight.shard_spec = ShardSpec(
            (h, a * d), dim=1, std=scaled_std(config.init_std, config.num_layers))
        # Chapter 06 sets this to wrap core attention: selective recompute and/or offload.
        self.attend_wrapper = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        if self.attend_wrapper is None:
            context = self._attend(q, k, v, attention_mask)  # [s, b, a/t * d]
        else:
            context = self.attend_wrapper(self._attend, q, k, v, attention_mask)
        return self.linear_proj(context)


# %% [markdown]
# ## SwiGLU MLP and the layer
#
# $\mathrm{MLP}(x) = W_2\,(\mathrm{silu}(W_g x) \odot W_u x)$. `linear_fc1` holds $W_g$ and $W_u$
# stacked ($2f$ rows); each TP rank holds its $f/t$ gate rows *and* its $f/t$ up rows, so it
# can form its $f/t$ products locally, and `linear_fc2` (row-parallel) sums them
# (`megatron/core/transformer/mlp.py:202` doubles fc1 for gated units; the `glu` split is in
# `mlp.py:252`).
#
# The layer is pre-norm with residuals: $x \mathrel{+}= \mathrm{drop}(\mathrm{attn}(\mathrm{norm}_1(x)))$,
# $x \mathrel{+}= \mathrm{drop}(\mathrm{mlp}(\mathrm{norm}_2(x)))$ (`transformer_layer.py:682` and `:931`,
# "bias-dropout-add" with no bias here).
#
# **Which dropout draws differ per TP rank.** Without sequence parallelism the hidden states are
# identical on all TP ranks, so residual dropout must draw the *same* mask everywhere (default
# RNG), while attention-probability dropout acts on each rank's own heads and runs under the
# RNG tracker's TP fork (`dot_product_attention.py:216-220`). With sequence parallelism every
# rank holds different tokens, so the whole block runs under the fork
# (`transformer_block.py:592`) and so does embedding dropout (`megatron/core/models/common/embeddings/language_model_embedding.py:139-152`).
#
# **Fused kernels.** With `kernels = "triton"` in the config (or `"auto"` on a GPU) the norms, the
# SwiGLU product, causal attention and the loss run [appendix C's](../kernels/roofline.py) Triton
# kernels instead of the
# eager ops; parameters, names and results stay the same (the tests compare the two over
# training steps). Attention with an explicit mask, under CP or with dropout keeps using SDPA.

# %%
class KernelRMSNorm(RMSNorm):
    """RMSNorm whose forward runs appendix C's Triton kernels when `kernels` selects them."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool, kernels: str):
        super().__init__(hidden_size, eps, sequence_parallel=sequence_parallel)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(self.kernels, x.device):
            return rms_norm(x.contiguous(), self.weight, self.eps)
        return super().forward(x)


def _rms_norm(config: ModelConfig, hidden_size: int, eps: float) -> RMSNorm:
    """Appendix B's RMSNorm, or its kernel-backed twin when config.kernels is not 'torch'."""
    if config.kernels == "torch":
        return RMSNorm(hidden_size, eps, sequence_parallel=config.sequence_parallel)
    return KernelRMSNorm(hidden_size, eps, config.sequence_parallel, config.kernels)


# %% [markdown]
# The MLP: a column-parallel fc1 that holds the gate and up rows of each rank together, the SwiGLU
# product, and a row-parallel fc2.

# %%
class SwiGLUMLP(nn.Module):
    """silu(gate) * up with a column-parallel fc1 [gate; up] and a row-parallel fc2."""

    def __init__(self, config: ModelConfig, grid: ParallelGrid):
        super().__init__()
        h, f, sp = config.hidden_size, config.ffn_hidden_size, config.sequence_parallel
        self.linear_fc1 = ColumnParallelLinear(h, 2 * f, grid, bias=False, sequence_parallel=sp,
                                               init_method=_no_init)
        self.linear_fc1.weight.shard_spec = ShardSpec((2 * f, h), dim=0, chunks=2,
                                                      std=config.init_std)
        self.linear_fc2 = RowParallelLinear(f, h, grid, bias=False, sequence_parallel=sp,
                                            init_method=_no_init)
        self.linear_fc2.weight.shard_spec = ShardSpec(
            (h, f), dim=1, std=scaled_std(config.init_std, config.num_layers))
        self.kernels = config.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1 = self.linear_fc1(x)
        if use_triton(self.kernels, fc1.device):
            return self.linear_fc2(swiglu(fc1))  # appendix C: gate and up read once
        if torch.compiler.is_compiling():  # dynamo cannot trace out= into views; inductor fuses this
            return self.linear_fc2(swiglu_reference(fc1))
        return self.linear_fc2(_SwiGLUProduct.apply(fc1))


# %% [markdown]
# The product is a small autograd function rather than `silu(gate) * up` on two `chunk`
# views, for its backward. Autograd's version computes the two halves' gradients as two
# $[s, b, f/t]$ tensors and concatenates them into fc1's $[s, b, 2f/t]$ gradient: a copy of
# the MLP's widest tensor in every layer's backward. `_SwiGLUProduct` allocates that gradient
# once and writes each half in place: $g_{up} = g \cdot \mathrm{silu}(gate)$, then
# $g \cdot up$ into the gate half and through `silu_backward` there. Those are the calls
# autograd's `MulBackward0` and `SiluBackward0` make, so the gradients are equal bit for bit
# (the tests compare against `F.silu(gate) * up`).
#
# <details><summary>Megatron detail: what the product saves, and Megatron's fused SwiGLU</summary>
#
# The forward saves what autograd saved for the two ops — fc1's output and
# $\mathrm{silu}(gate)$ — so chapter 06's and 07's ledgers count the same tensors. Megatron's
# fused `SwiGLUFunction` (`megatron/core/fusions/fused_bias_swiglu.py:147`) saves only fc1's
# output, recomputes the sigmoid in the backward and still concatenates (`swiglu_back`,
# `:55-69`). Under `torch.compile` the plain expression is kept (appendix C's
# `swiglu_reference`), since dynamo cannot trace `out=` into views.
#
# </details>

# %%
class _SwiGLUProduct(torch.autograd.Function):
    """silu(gate) * up from fc1's output [..., 2f]; the backward fills one [..., 2f] gradient."""

    @staticmethod
    def forward(ctx, fc1):
        gate, up = fc1.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(fc1, act)  # what autograd keeps for the two ops: gate, up, silu
        return act * up

    @staticmethod
    def backward(ctx, grad):
        fc1, act = ctx.saved_tensors
        gate, up = fc1.chunk(2, dim=-1)
        out = torch.empty_like(fc1, memory_format=torch.contiguous_format)
        grad_gate, grad_up = out.chunk(2, dim=-1)
        torch.mul(grad, act, out=grad_up)
        torch.mul(grad, up, out=grad_gate)  # the gradient of silu(gate), then through silu:
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return out


# %% [markdown]
# A layer is the two residual blocks, each behind its norm.

# %%
class TransformerLayer(nn.Module):
    """Pre-norm decoder layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, config: ModelConfig, grid: ParallelGrid, layer_number: int,
                 rng_tracker=None):
        super().__init__()
        self.layer_number = layer_number  # global index, whatever the pipeline stage
        eps = config.norm_epsilon
        self.input_layernorm = _rms_norm(config, config.hidden_size, eps)
        self.self_attention = SelfAttention(config, grid, rng_tracker)
        self.pre_mlp_layernorm = _rms_norm(config, config.hidden_size, eps)
        self.mlp = SwiGLUMLP(config, grid)
        self.dropout = config.dropout

    def forward(self, x, cos, sin, attention_mask=None):
        attn = self.self_attention(self.input_layernorm(x), cos, sin, attention_mask)
        x = x + F.dropout(attn, self.dropout, self.training)
        return x + F.dropout(self.mlp(self.pre_mlp_layernorm(x)), self.dropout, self.training)


# %% [markdown]
# ## Demo: the rows of `linear_qkv`, the CP mask, the product's gradient, a causal layer
#
# First the fused projection on the tiny config. Row $r$ of `linear_qkv` is set to read
# channel 0 times $r$, and the input is channel 0 alone at position 0, where RoPE turns
# nothing, so each head's first value names the row it starts at: the layout of the worked
# example, [q0 q1 k0 v0 | q2 q3 k1 v1] × 16.

# %%
if __name__ == "__main__":
    from types import SimpleNamespace

    import matplotlib.pyplot as plt

    from tinytron.model.config import tiny_config
    from tinytron.model.layers import init_full_tensor, rope_cos_sin

    config = tiny_config()  # h 64, a 4, g 2, d 16
    grid = ParallelGrid.single()
    attn = SelfAttention(config, grid)
    rows = attn.linear_qkv.weight.shape[0]  # (a + 2g) d = 128
    with torch.no_grad():
        attn.linear_qkv.weight.zero_()
        attn.linear_qkv.weight[:, 0] = torch.arange(float(rows))
    x = torch.zeros(1, 1, config.hidden_size)
    x[..., 0] = 1.0
    cos, sin = rope_cos_sin(torch.arange(1), config.head_dim, config.rotary_base)
    q, k, v = attn.project_qkv(x, cos.unsqueeze(1), sin.unsqueeze(1))
    starts = {name: t[0, 0, :, 0].int().tolist() for name, t in (("q", q), ("k", k), ("v", v))}
    print(f"linear_qkv: {rows} rows; heads start at rows {starts}")

# %% [markdown]
# Then core attention's mask under CP, as both ranks of $c = 2$, $s = 8$ see it. `_allowed`
# asks the grid only for the CP size and rank, so a stand-in that answers those two lets one
# process draw both ranks. The columns are the keys in the order the all-gather delivers them.
# Each rank may attend 18 of the 36 causal pairs: pairing chunk $r$ with chunk $2c - 1 - r$
# splits the causal work evenly.

# %%
if __name__ == "__main__":
    def cp_mask(rank: int) -> torch.Tensor:
        """CoreAttention._allowed as CP rank `rank` of 2 sees it, for s = 8 (4 local queries)."""
        cp_grid = SimpleNamespace(size=lambda axis: 2, rank=lambda axis: rank)
        return CoreAttention._allowed(SimpleNamespace(grid=cp_grid), 4, 8, None, "cpu")

    masks = [cp_mask(r) for r in range(2)]
    key_order = torch.cat([cp_positions(8, 2, r) for r in range(2)]).tolist()
    fig, axes = plt.subplots(1, 2, figsize=(7, 2.6))
    for r, (ax, mask) in enumerate(zip(axes, masks)):
        ax.imshow(mask.int(), cmap="Blues", vmin=0, vmax=1.4)
        ax.set_xticks(range(8), key_order)
        ax.set_yticks(range(4), cp_positions(8, 2, r).tolist())
        ax.set(title=f"CP rank {r} of 2: may attend", xlabel="key position, arrival order",
               ylabel="query position")
    fig.tight_layout()
    plt.show()

# %% [markdown]
# Last, `_SwiGLUProduct`'s gradient against autograd's on `F.silu(gate) * up`, and one layer
# with its weights drawn as [B.2](layers.py) draws them: changing the token at position 10
# changes the outputs from position 10 on, and no earlier one.

# %%
if __name__ == "__main__":
    fc1 = torch.randn(8, 2, 2 * config.ffn_hidden_size, requires_grad=True)
    grad = torch.randn(8, 2, config.ffn_hidden_size)
    (ours,) = torch.autograd.grad(_SwiGLUProduct.apply(fc1), fc1, grad)
    gate, up = fc1.chunk(2, dim=-1)
    (autograds,) = torch.autograd.grad(F.silu(gate) * up, fc1, grad)
    print("fc1's gradient equals autograd's bit for bit:", torch.equal(ours, autograds))

    layer = TransformerLayer(config, grid, layer_number=0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(init_full_tensor(p.shard_spec, config.seed, name))
    s = 16
    cos, sin = (t.unsqueeze(1) for t in rope_cos_sin(torch.arange(s), config.head_dim,
                                                      config.rotary_base))
    x = torch.randn(s, 1, config.hidden_size)
    x2 = x.clone()
    x2[10] += 1.0
    with torch.no_grad():
        moved = (layer(x2, cos, sin) - layer(x, cos, sin)).abs().amax(dim=(1, 2))
    changed = (moved > 0).nonzero().flatten().tolist()
    print(f"layer output [s, b, h] = {tuple(layer(x, cos, sin).shape)}; positions changed: {changed}")

    assert starts == {"q": [0, 16, 64, 80], "k": [32, 96], "v": [48, 112]}  # group by group
    assert masks[0][2].nonzero().flatten().tolist() == [0, 1, 2, 4, 5, 6, 7]  # query 6, not key 7
    assert [m.sum().item() for m in masks] == [18, 18]  # causal work split evenly
    assert torch.equal(ours, autograds)
    assert changed == list(range(10, s))  # a token never attends forward

# %% [markdown]
# ## Summary
#
# - The fused QKV rows are grouped by key/value group, and fc1 stacks gate and up per TP
#   shard, so every TP rank computes whole heads and whole SwiGLU units without talking;
#   grouped queries read their key/value group in place (`enable_gqa`), with no copy.
# - Under CP the keys and values are all-gathered and the causal (and packed-document) mask
#   is evaluated at global positions, its columns in arrival order; the gradients flow back by
#   reduce-scatter.
# - Dropout draws from the TP-forked RNG exactly where the activations differ across TP ranks.
# - `_SwiGLUProduct` writes fc1's gradient once instead of concatenating two halves, and equals
#   autograd's bit for bit; with `kernels = "triton"` the norms, the product and causal
#   attention run appendix C's kernels.
#
# ## How production does it
#
# - Megatron: `megatron/core/transformer/attention.py` and `dot_product_attention.py` (QKV
#   layout, GQA, the unfused attention), `megatron/core/transformer/mlp.py`,
#   `transformer_layer.py` (the two residual blocks), and
#   `megatron/core/extensions/transformer_engine.py` for the fused TE layers the GPU path uses
#   instead (fused QKV + norm, flash / cuDNN attention with CP rings).
# - torchtitan: `Attention`, `FeedForward` and `TransformerBlock` in
#   `torchtitan/models/llama3/model/model.py`, with DTensor-based TP plans in
#   `torchtitan/models/llama3/infra/parallelize.py`.
#
# ## Exercises
#
# 1. The running example has $a = 32$, $g = 8$, $d = 128$, $h = 4096$ at TP 2. How many rows
#    of `linear_qkv` does a rank hold, and how many whole groups are they?
#
#    <details><summary>Answer</summary>
#
#    The full matrix has $(a + 2g) d = (32 + 16) \cdot 128 = 6144$ rows; a rank holds
#    $6144 / 2 = 3072$ of them, a $[3072, 4096]$ shard. One group is
#    $(a/g + 2) d = (4 + 2) \cdot 128 = 768$ rows, so the shard is $3072 / 768 = 4 = g/t$
#    whole groups: 16 query heads and their 4 key and 4 value heads.
#
#    </details>
#
# 2. Replace the CP all-gather of K and V by a ring: each step sends one K/V block to the next
#    rank and merges partial softmax results (log-sum-exp). What memory does it save at $c = 8$?
#
#    <details><summary>Hint</summary>
#
#    Count blocks of $s/c$ tokens of K and V. The all-gather in
#    <code>_attend</code> builds all $c = 8$ of them, and SDPA keeps them for the backward; a ring
#    holds the local block and the one in flight, 2 of 8, and keeps only the local one, running
#    the ring again in the backward. Appendix A's <code>ring_attention</code> ([page A.4](../parallel/context_parallel.py)) is the
#    merge to start from.
#
#    </details>
#
# 3. With $g = 2$ and $t = 4$ this model refuses to build. Make it replicate each key/value
#    head over $t / g$ ranks as Megatron does, and keep the parity tests green.
#
#    <details><summary>Hint</summary>
#
#    Three places change: the check in <code>check_layout</code>,
#    the <code>ShardSpec</code> of <code>linear_qkv</code> (the key/value rows are copied, not
#    split, for $t > g$), and <code>local_groups</code> in <code>SelfAttention</code>, which
#    becomes one group shared by $t/g$ ranks. The gradients of a replicated head must then be
#    summed over those ranks, as the tied embedding's are over the embedding group.
#
#    </details>
#
# 4. Measure how much activation memory sequence parallelism saves on the tiny model with
#    `torch.autograd.graph.saved_tensors_hooks`.
#
#    <details><summary>Hint</summary>
#
#    Run the forward of <code>_workers.layout_parity</code>'s
#    model under a pack hook that adds up <code>t.numel() * t.element_size()</code> per distinct
#    storage, with <code>sequence_parallel</code> on and off at TP 2. Sequence parallelism splits
#    what the norms, the dropouts and the residual adds save by $t$; the attention and MLP inputs
#    after the all-gather stay whole.
#
#    </details>
