# %% [markdown]
# # 02 · Optimizer: Muon and MuonClip
#
# Muon replaces Adam's per-coordinate scaling by an *orthogonalized* momentum for the 2-D hidden
# matrices: a few Newton–Schulz iterations push every singular value of the update towards 1.
# We build the iteration with Megatron's coefficient sets, the scale modes, the QKV split, the
# three tensor-parallel modes, the AdamW fallback for the other params, and MuonClip (QK-clip),
# which rescales the query/key rows of heads whose attention logits grew too large.

# %%
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from tinytron.optimizer._checks import check_muon_args
from tinytron.optimizer._ns_coefficients import NS_COEFFICIENTS
from tinytron.optimizer.algorithms import AdamW, ChainedOptimizer, build_param_groups

__all__ = [
    "NS_COEFFICIENTS", "ns_coefficients", "newton_schulz", "muon_scale_factor", "Muon",
    "is_muon_param", "build_muon_adamw", "attention_max_logits", "MaxLogitTracker", "qk_clip_",
]

# %% [markdown]
# ## Why orthogonalize
#
# A gradient matrix of a hidden layer is usually dominated by a few directions: its largest
# singular values are orders of magnitude above the rest. SGD or Adam then moves the weight
# mostly along those few directions, and the rare ones barely learn. Muon replaces the
# momentum matrix $B = U\Sigma V^\top$ by $UV^\top$: the same singular directions, every
# singular value set to 1, so each direction moves by the same amount. Example: a momentum with
# singular values $(10, 1, 0.01)$ would step the third direction 1,000 times less than the
# first; after orthogonalization all three step equally, and the learning rate sets how far.
#
# ## The update
#
# Per 2-D parameter and step (the `emerging_optimizers` library's `OrthogonalizedOptimizer.step`,
# which Megatron's `TensorParallelMuon` extends, `megatron/core/optimizer/emerging_optimizers.py:160`):
#
# 1. decoupled weight decay $\theta \leftarrow \theta(1-\eta\lambda)$;
# 2. momentum as an EMA $B \leftarrow \mu B + (1-\mu) g$ (state key `momentum_buffer`);
# 3. direction $D = B$, or with Nesterov $D = (1-\mu) g + \mu B$;
# 4. $O = \mathrm{NS}(D) \cdot s(\text{rows}, \text{cols}) \cdot \text{extra\_scale}$;
# 5. $\theta \leftarrow \theta - \eta O$.
#
# **Newton–Schulz.** Normalize $X = D/\max(\lVert D\rVert_F, 10^{-7})$ (so every singular value
# is $\le 1$), transpose if rows $>$ cols (so $XX^\top$ is the small Gram matrix), then for each
# coefficient triple $(a, b, c)$: $A = XX^\top$, $B = bA + cA^2$, $X \leftarrow aX + BX$. On the
# SVD $X = U\Sigma V^\top$ each step maps every singular value $\sigma \mapsto a\sigma + b\sigma^3 +
# c\sigma^5$ and leaves $U, V$ alone, so the result approximates $UV^\top$. Worked example with the
# first quintic triple $(4.0848, -6.8946, 2.9270)$ on $\sigma = 0.1$:
# $0.408 - 0.0069 + 0.00003 \approx 0.402$ — small singular values grow about 4× per step; after
# five steps they sit in roughly $(0.7, 1.2)$, not exactly at 1: the coefficients trade accuracy
# for speed.
#
# Megatron's default is `quintic` with `muon_num_ns_steps=5` (one pass through its five
# triples); `simple`/`aol` are cycled, `polar_express` repeats its last triple
# (facts from the `emerging_optimizers` v0.2.0 library Megatron pins, `pyproject.toml:231`).
#
# The coefficient tables themselves (`NS_COEFFICIENTS`) are data, kept in the chapter's private
# module `tinytron.optimizer._ns_coefficients`.
#
# **Scale.** The orthogonal update has RMS $\approx 1/\sqrt{\max(r,c)}$; the modes rescale it:
# `spectral` $s = \sqrt{\max(r, c)}$ (Megatron default), `shape_scaling`
# $s = \sqrt{\max(1, r/c)}$, `unit_rms_norm` $s = \sqrt{r/c}$.

# %%
def ns_coefficients(coefficient_type: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) triple of every step: cycled, or last repeated for polar_express."""
    if coefficient_type not in NS_COEFFICIENTS:
        raise ValueError(f"unknown coefficient_type {coefficient_type!r}; "
                         f"choose from {sorted(NS_COEFFICIENTS)}")
    if steps < 1:
        raise ValueError(f"num_ns_steps must be >= 1, got {steps}")
    table = NS_COEFFICIENTS[coefficient_type]
    if coefficient_type == "polar_express":
        return [table[min(i, len(table) - 1)] for i in range(steps)]
    return [table[i % len(table)] for i in range(steps)]


def muon_scale_factor(rows: int, cols: int, mode: str = "spectral") -> float:
    """The factor that sets the RMS of an orthogonalized update of a rows x cols matrix."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    raise ValueError(f"unknown scale_mode {mode!r}; choose spectral, shape_scaling, unit_rms_norm")


# %% [markdown]
# ## Newton–Schulz, also across tensor-parallel shards
#
# With TP a weight is split along `partition_dim` (0 for a column-parallel weight, whose output
# rows are split; 1 for a row-parallel one). The three modes (`muon_tp_mode`):
#
# - `blockwise` (Megatron's default): every TP rank orthogonalizes its own shard, scale from the
#   shard's shape. Cheapest, but the result is *not* the orthogonalization of the full matrix.
# - `duplicated`: all-gather the shards, orthogonalize the full matrix on every rank, keep my
#   chunk. Exact, costs one gather and TP× the work.
# - `distributed`: arrange the shard so the split dimension is the one the Gram matrix
#   contracts over; then $XX^\top = \sum_r X_r X_r^\top$ is one all-reduce of a small matrix, and
#   $X_r \leftarrow aX_r + BX_r$ is local. $\lVert D\rVert_F^2$ is all-reduced too. Same result as
#   `duplicated` up to rounding.
#
# Cost, for a row-parallel `[4096, 11008]` MLP weight at TP 2 (each rank holds `[4096, 5504]`):
# `duplicated` gathers 22.5M fp32 elements (90 MB) and runs NS on the full matrix on both
# ranks; `distributed` all-reduces a `[4096, 4096]` Gram matrix (16.8M elements) once per NS
# step, five times per update; `blockwise` sends nothing and orthogonalizes each half on its
# own, which is why Megatron makes it the default.

# %%
def _ns_iterate(x: torch.Tensor, coeffs, gram_reduce: Callable | None) -> torch.Tensor:
    """Run the polynomial iteration on x (rows <= cols layout) in x's dtype."""
    for a, b, c in coeffs:
        gram = x @ x.mT
        if gram_reduce is not None:
            gram = gram_reduce(gram)
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x


def newton_schulz(d: torch.Tensor, steps: int = 5, coefficient_type: str = "quintic",
                  matmul_dtype: torch.dtype = torch.float32, tp_group=None,
                  partition_dim: int | None = None) -> torch.Tensor:
    """Approximate U V^T of d (fp32 in and out); with tp_group + partition_dim, d is a TP shard."""
    if d.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(d.shape)}")
    coeffs = ns_coefficients(coefficient_type, steps)
    distributed = tp_group is not None and partition_dim is not None
    x = d.float()
    # distributed: the split dim must be the contracted one (dim 1), so transpose a dim-0 split.
    transpose = (partition_dim == 0) if distributed else x.shape[0] > x.shape[1]
    if transpose:
        x = x.mT
    sq = x.pow(2).sum()
    if distributed:
        dist.all_reduce(sq, group=tp_group)
    x = x / torch.clamp(sq.sqrt(), min=1e-7)
    reduce = None
    if distributed:
        def reduce(g):
            g = g.float()
            dist.all_reduce(g, group=tp_group)
            return g.to(matmul_dtype)
    x = _ns_iterate(x.to(matmul_dtype), coeffs, reduce).float()
    return x.mT if transpose else x


# %% [markdown]
# The three modes then differ only in what they hand to `newton_schulz`: the local shard
# (blockwise), the gathered full matrix (duplicated), or the shard with the TP group so the Gram
# matrix is all-reduced (distributed). The scale factor always uses the full matrix's shape.

# %%
def _gather_shards(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """All-gather equal TP shards of x and concatenate them along dim."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def orthogonalize_tp(d: torch.Tensor, *, tp_mode: str = "blockwise", tp_group=None,
                     partition_dim: int | None = None, steps: int = 5,
                     coefficient_type: str = "quintic", matmul_dtype=torch.float32,
                     scale_mode: str = "spectral", extra_scale_factor: float = 1.0) -> torch.Tensor:
    """Scaled NS of a (possibly TP-sharded) 2-D matrix, in one of the three TP modes."""
    if tp_mode not in ("blockwise", "duplicated", "distributed"):
        raise ValueError(f"tp_mode must be blockwise, duplicated or distributed, got {tp_mode!r}")
    sharded = tp_group is not None and partition_dim is not None and tp_mode != "blockwise"
    rows, cols = d.shape
    ns = dict(steps=steps, coefficient_type=coefficient_type, matmul_dtype=matmul_dtype)
    if not sharded:
        out = newton_schulz(d, **ns)
    elif tp_mode == "duplicated":
        full = newton_schulz(_gather_shards(d, tp_group, partition_dim), **ns)
        out = full.chunk(dist.get_world_size(tp_group), dim=partition_dim)[
            dist.get_rank(tp_group)]
    else:
        out = newton_schulz(d, tp_group=tp_group, partition_dim=partition_dim, **ns)
    if sharded:  # the scale uses the full matrix's shape
        size = [rows, cols]
        size[partition_dim] *= dist.get_world_size(tp_group)
        rows, cols = size
    return out * (muon_scale_factor(rows, cols, scale_mode) * extra_scale_factor)


# %% [markdown]
# ## QKV split
#
# Megatron's fused `linear_qkv.weight` stacks, per query group, the Q rows of its
# `heads/groups` heads, then one K head, then one V head: shape
# `[groups · (heads/groups + 2) · d_head, hidden]`. Orthogonalizing that block as one matrix
# would mix queries with keys, so with `muon_split_qkv=True` (default) the weight is viewed as
# `[groups, rows_per_group, hidden]`, split along dim 1 into `[q_rows, d_head, d_head]`, each part
# flattened to 2-D and orthogonalized on its own, then put back
# (`megatron/core/optimizer/emerging_optimizers.py:258-288`, `_get_qkv_split_shapes:133`).
# Example: 4 heads, 2 groups, `d_head`=16, hidden 64 → weight `[128, 64]` = 2 × (32 Q + 16 K + 16 V)
# rows; Q is orthogonalized as `[64, 64]`, K and V as `[32, 64]` each.

# %%
class QKVSplit:
    """Mixin for Muon: orthogonalize a direction, per Q/K/V slab for fused QKV weights."""

    def orthogonalize(self, p: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """Scaled NS of one param's direction, split into Q/K/V slabs for fused QKV weights."""
        partition_dim = getattr(p, "partition_dim", None) if getattr(
            p, "tensor_model_parallel", False) else None
        kw = dict(self.ortho_kw, partition_dim=partition_dim)
        shapes = getattr(p, "qkv_split_shapes", None) or self.qkv_split_shapes
        if not (self.split_qkv and getattr(p, "is_qkv", False)):
            return orthogonalize_tp(d, **kw).to(p.dtype)
        if shapes is None:
            raise ValueError("split_qkv needs qkv_split_shapes (on the param or the optimizer)")
        per_group = sum(shapes)
        if d.shape[0] % per_group:
            raise ValueError(f"QKV weight rows {d.shape[0]} not a multiple of {per_group}")
        groups = d.shape[0] // per_group
        parts = torch.split(d.view(groups, per_group, -1), shapes, dim=1)
        outs = [orthogonalize_tp(s.reshape(-1, d.shape[1]), **kw).view(groups, -1, d.shape[1])
                for s in parts]
        return torch.cat(outs, dim=1).view_as(d).to(p.dtype)


# %% [markdown]
# The step is AdamW's outer shape with the orthogonalized momentum as the update: decoupled
# decay, an EMA of the gradient (or its Nesterov look-ahead), then the scaled Newton–Schulz
# direction, split into Q, K and V for the fused attention weight.
#
# Worked example of one step with `momentum` 0.95 and no Nesterov: the buffer starts at 0, so
# after the first step it is $0.05\,g_1$, after the second $0.0475\,g_1 + 0.05\,g_2$; the
# update is the *orthogonalized* buffer, so its size is set by the scale factor, not by how
# small $0.05\,g$ is. The constructor's argument checks are in the chapter's private module
# `tinytron.optimizer._checks`.
#
# The Newton–Schulz settings are checked and packed once, into the keyword arguments every
# `orthogonalize` call of the step passes on.

# %%
def _muon_ortho_kw(num_ns_steps: int, coefficient_type: str, scale_mode: str,
                   extra_scale_factor: float, fp32_matmul_prec: str, tp_mode: str,
                   tp_group) -> dict:
    """Validate the coefficient type, step count and scale mode; return orthogonalize's kwargs."""
    ns_coefficients(coefficient_type, num_ns_steps)   # validates both
    muon_scale_factor(2, 1, scale_mode)                # validates the mode
    # "medium" lets the NS matmuls run in bf16 (Megatron's default); "highest" keeps fp32.
    return dict(steps=num_ns_steps, coefficient_type=coefficient_type,
                scale_mode=scale_mode, extra_scale_factor=extra_scale_factor,
                matmul_dtype=torch.bfloat16 if fp32_matmul_prec == "medium"
                else torch.float32, tp_mode=tp_mode, tp_group=tp_group)


# %% [markdown]
# The optimizer itself: the constructor refuses anything but 2-D matrices, and the step is the
# loop described above, one parameter at a time.

# %%
class Muon(QKVSplit, torch.optim.Optimizer):
    """Muon for 2-D hidden matrices: EMA momentum, Newton-Schulz, scale, decoupled decay."""

    def __init__(self, params, lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = False,
                 weight_decay: float = 0.01, split_qkv: bool = True,
                 qkv_split_shapes: list[int] | None = None, coefficient_type: str = "quintic",
                 num_ns_steps: int = 5, scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, fp32_matmul_prec: str = "medium",
                 tp_mode: str = "blockwise", tp_group=None):
        check_muon_args(momentum, fp32_matmul_prec)       # one-line ValueErrors (_checks.py)
        ortho_kw = _muon_ortho_kw(num_ns_steps, coefficient_type, scale_mode,
                                  extra_scale_factor, fp32_matmul_prec, tp_mode, tp_group)
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                      weight_decay=weight_decay))
        for p in (p for g in self.param_groups for p in g["params"]):
            if p.dim() != 2:
                raise ValueError(f"Muon handles 2-D matrices only, got shape {tuple(p.shape)}")
        self.split_qkv, self.qkv_split_shapes = split_qkv, qkv_split_shapes
        self.tp_mode, self.tp_group = tp_mode, tp_group
        self.ortho_kw = ortho_kw

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One Muon step over every group."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                if wd != 0:
                    p.mul_(1 - lr * wd)
                buf.lerp_(p.grad, 1 - mu)
                direction = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                p.add_(self.orthogonalize(p, direction), alpha=-lr)
        return loss


# %% [markdown]
# ## Which params get Muon
#
# Why not everything: an embedding's rows are looked up one token at a time, so its gradient is
# a few sparse rows per step, not a matrix whose singular directions mean anything; norms and
# biases are vectors. Adam's per-coordinate scaling suits them.
#
# Megatron routes a param to Muon when it is 2-D and not flagged
# `is_embedding_or_output_parameter` (`_is_nonlinear_or_embedding`,
# `megatron/core/optimizer/emerging_optimizers.py:128`); embeddings, the output layer, norms and
# biases go to Adam through a default override (`:427-453`). The two optimizers are chained.
# A model that does not set the flag is recognized by name (`embedding`, `output_layer`). The Muon
# half gets the matrices' own parameter groups (so their weight decay follows the same rules as
# AdamW's), and `adam_lr` lets the AdamW half keep its own learning rate, as the training page
# of this chapter does.

# %%
def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """2-D and not an embedding / output weight."""
    embedding = getattr(p, "is_embedding_or_output_parameter", False) or any(
        key in name for key in ("embedding", "output_layer", "lm_head"))
    return p.dim() == 2 and not embedding


def build_muon_adamw(named_params: Iterable[tuple[str, torch.Tensor]], lr: float,
                     weight_decay: float = 0.01, adam_lr: float | None = None,
                     adam_betas=(0.9, 0.999), adam_eps: float = 1e-8, **muon_kw) -> ChainedOptimizer:
    """Muon on the hidden matrices, AdamW on everything else, chained (Megatron's split)."""
    named = [(n, p) for n, p in named_params if p.requires_grad]
    if muon_kw.get("qkv_split_shapes"):   # tag fused QKV weights by their Megatron name
        for n, p in named:
            if n.endswith("linear_qkv.weight"):
                p.is_qkv = True
    muon_named = [(n, p) for n, p in named if is_muon_param(n, p)]
    adam_named = [(n, p) for n, p in named if not is_muon_param(n, p)]
    optimizers = []
    if muon_named:
        groups = build_param_groups(muon_named, lr=lr, weight_decay=weight_decay)
        optimizers.append(Muon(groups, lr=lr, weight_decay=weight_decay, **muon_kw))
    if adam_named:
        a_lr = lr if adam_lr is None else adam_lr
        groups = build_param_groups(adam_named, lr=a_lr, weight_decay=weight_decay)
        optimizers.append(AdamW(groups, lr=a_lr, betas=adam_betas, eps=adam_eps,
                                weight_decay=weight_decay))
    return ChainedOptimizer(optimizers)


# %% [markdown]
# ## MuonClip (QK-clip)
#
# Muon's updates have a fixed spectral size, so a query/key pair can keep growing until softmax
# saturates. QK-clip watches the largest pre-softmax logit of each head and, after the step,
# shrinks the offending group's Q and K rows (`megatron/core/optimizer/qk_clip.py:8`,
# `megatron/core/transformer/attention.py:1691-1781`, called from `train_step` right after
# `optimizer.step()`, `megatron/training/training.py:2290-2293`):
#
# - forward keeps a running elementwise max of the per-head max logit over microbatches
#   (`[heads]`); after the step it is all-reduced with MAX over DP×CP;
# - per query group $g$: $m_g = \max_{h \in g} m_h$; if $m_g > \tau$ (`qk_clip_threshold`,
#   default 100): $\eta_g = \tau / m_g$, Q rows $\times \eta_g^{\alpha}$, K rows
#   $\times \eta_g^{1-\alpha}$ (`qk_clip_alpha` default 0.5); V untouched; the fp32 master copy is
#   scaled too; the running max is reset.
#
# Since $q\cdot k$ scales by $\eta_g^\alpha \eta_g^{1-\alpha} = \eta_g$, the group's largest logit
# becomes exactly $\tau$ on the same input. Example: $\tau = 100$, $m_g = 400$ → $\eta_g = 0.25$,
# Q and K rows $\times 0.5$. Megatron gets $m_h$ from TE's fused attention; here it is computed
# from $q k^\top$ directly.

# %%
def attention_max_logits(q: torch.Tensor, k: torch.Tensor, softmax_scale: float,
                         causal: bool = True) -> torch.Tensor:
    """Per-head max pre-softmax logit; q [b, s, heads, d], k [b, s, groups, d] -> [heads]."""
    heads, groups = q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // groups, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * softmax_scale
    if causal:
        s = q.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        logits = logits.masked_fill(mask, float("-inf"))
    return logits.amax(dim=(0, 2, 3))


# %% [markdown]
# A step has several microbatches, and the clip needs the largest logit seen in any of them:
# the tracker keeps an elementwise running max per head until the clip resets it.

# %%
class MaxLogitTracker:
    """Running elementwise max of per-head max logits over the microbatches of one step."""

    def __init__(self):
        self.current_max_attn_logits: torch.Tensor | None = None

    def update(self, max_logits: torch.Tensor) -> None:
        """Fold in one microbatch's per-head maxima."""
        m = max_logits.detach()
        cur = self.current_max_attn_logits
        self.current_max_attn_logits = m.clone() if cur is None else torch.maximum(cur, m)

    def reset(self) -> None:
        """Forget the maxima (after the clip)."""
        self.current_max_attn_logits = None


# %% [markdown]
# The clip itself, after the optimizer step: all-reduce the maxima over data parallel, take each
# query group's maximum, and scale that group's Q rows by $\eta_g^{\alpha}$ and K rows by
# $\eta_g^{1-\alpha}$ in the model weight and its master copy.

# %%
@torch.no_grad()
def qk_clip_(qkv_weights: list[torch.Tensor], max_logits: torch.Tensor, num_query_groups: int,
             head_dim: int, threshold: float = 100.0, alpha: float = 0.5, dp_group=None) -> torch.Tensor:
    """Rescale Q/K rows of groups whose max logit exceeds threshold; returns the per-group factors."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"qk_clip_alpha must lie in (0, 1), got {alpha}")
    m = max_logits.detach().clone().float()
    if dp_group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=dp_group)
    heads_per_group = m.numel() // num_query_groups
    group_max = m.view(num_query_groups, heads_per_group).amax(dim=1)
    eta = torch.clamp(threshold / group_max, max=1.0)
    q_rows = heads_per_group * head_dim
    for w in qkv_weights:   # the model weight and, when present, its fp32 master copy
        view = w.view(num_query_groups, q_rows + 2 * head_dim, -1)
        view[:, :q_rows] *= eta.pow(alpha).to(w.dtype).view(-1, 1, 1)
        view[:, q_rows:q_rows + head_dim] *= eta.pow(1 - alpha).to(w.dtype).view(-1, 1, 1)
    return eta


# %% [markdown]
# ## Demo 1: what Newton–Schulz does to the singular values
#
# A random 64×96 matrix, an ill-conditioned one (singular values from 1 down to $10^{-2}$), and a
# tall one (transposed internally). After five quintic steps every singular value lies in roughly
# $(0.7, 1.2)$. The scalar map printed last shows the limit: after the Frobenius normalization a
# singular value of $10^{-3}$ only reaches ~0.5 in five steps — directions that weak stay weaker.
# The test matrices (`_spread_matrix`) are built in `tinytron.optimizer._muon_demo`.
#
# <details><summary>Megatron detail: one run's numbers</summary>
#
# On the run this page was written with, every output singular value lay in $[0.978, 1.144]$
# (the ill-conditioned input is the widest), and the scalar map took $0.001$ to $0.475$ and
# $0.01 \dots 1$ to within 3% of 1.
#
# </details>

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.optimizer._muon_demo import _qkv_logits, _spread_matrix

    gen = torch.Generator().manual_seed(0)
    mats = {"random 64x96": torch.randn(64, 96, generator=gen),
            "cond 1e2 64x64": _spread_matrix(64, 64, gen),
            "tall 96x32": torch.randn(96, 32, generator=gen)}
    fig, (ax0, ax) = plt.subplots(1, 2, figsize=(10, 3))
    for name, m in mats.items():
        sv = torch.linalg.svdvals(newton_schulz(m))
        print(f"{name:16s} singular values after NS: min {sv.min():.3f} max {sv.max():.3f}")
        assert 0.6 < sv.min() and sv.max() < 1.25, name
        before = torch.linalg.svdvals(m)
        ax0.semilogy((before / before.max()).numpy(), label=name)
        ax.plot(sv.numpy(), label=name)
    ax0.set(xlabel="index", ylabel="σ / σ_max", title="input singular values")
    ax.set(xlabel="index", ylabel="singular value", title="after 5 quintic NS steps")
    ax.legend()
    plt.tight_layout()
    plt.show()

    # sigma -> a s + b s^3 + c s^5 over the five steps, starting from small sigmas
    sigma = torch.tensor([0.001, 0.01, 0.1, 0.5, 1.0])
    for a, b, c in ns_coefficients("quintic", 5):
        sigma = a * sigma + b * sigma ** 3 + c * sigma ** 5
    print("scalar map of 0.001, 0.01, 0.1, 0.5, 1.0 after 5 steps:", [round(x, 3) for x in sigma.tolist()])

# %% [markdown]
# ## Demo 2: QKV split and scale modes
#
# The split orthogonalizes Q, K and V slabs separately: each slab (flattened over the groups) is
# then near-orthogonal on its own, while the unsplit update of the fused matrix is not.

# %%
if __name__ == "__main__":
    heads, groups, d_head, hidden = 4, 2, 8, 32
    shapes = [heads // groups * d_head, d_head, d_head]
    w = torch.nn.Parameter(torch.zeros(groups * sum(shapes), hidden))
    w.is_qkv = True
    g = torch.randn(w.shape, generator=gen)
    opt = Muon([w], lr=1.0, momentum=0.0, weight_decay=0.0, qkv_split_shapes=shapes,
               fp32_matmul_prec="highest", scale_mode="unit_rms_norm")
    upd = opt.orthogonalize(w, g)
    k_slab = upd.view(groups, sum(shapes), hidden)[:, shapes[0]:shapes[0] + d_head].reshape(-1, hidden)
    sv = torch.linalg.svdvals(k_slab / muon_scale_factor(*k_slab.shape, "unit_rms_norm"))
    print(f"K slab {tuple(k_slab.shape)} singular values in [{sv.min():.2f}, {sv.max():.2f}]")
    assert 0.6 < sv.min() and sv.max() < 1.25
    for mode in ("spectral", "shape_scaling", "unit_rms_norm"):
        print(f"{mode:14s} scale for a 256x64 matrix: {muon_scale_factor(256, 64, mode):.2f}")

# %% [markdown]
# ## Demo 3: MuonClip brings every head under the threshold
#
# A fused QKV weight with large entries, so the logits are far above $\tau = 30$. After the
# clip, on the same input, every group's largest logit is $\le \tau$ (the worst head sits exactly
# at $\tau$), groups that were below are untouched, and V rows never change.
#
# <details><summary>Megatron detail: one run's numbers</summary>
#
# In the run this page was written with, the four heads' maxima went from 753, 585, 7.4, 8.0
# to 30.0, 23.3, 7.4, 8.0, with $\eta = 0.040$ for group 0 and 1 for group 1.
#
# </details>

# %%
if __name__ == "__main__":
    x = torch.randn(2, 16, hidden, generator=gen)
    w = torch.randn(groups * sum(shapes), hidden, generator=gen)
    w.view(groups, sum(shapes), hidden)[0] *= 3.0     # group 0 far above the threshold
    w.view(groups, sum(shapes), hidden)[1] *= 0.3     # group 1 below it
    tracker = MaxLogitTracker()
    tracker.update(_qkv_logits(x, w, groups, heads, d_head))
    before, w0 = tracker.current_max_attn_logits, w.clone()
    tau = 30.0
    eta = qk_clip_([w], before, groups, d_head, threshold=tau)
    tracker.reset()
    after = _qkv_logits(x, w, groups, heads, d_head)
    print("per-head max logit before:", [round(v, 1) for v in before.tolist()])
    print("per-head max logit after: ", [round(v, 1) for v in after.tolist()], " eta:", eta.tolist())
    assert after.max() <= tau * (1 + 1e-4)
    assert abs(after[: heads // groups].max().item() - tau) < 1e-3 * tau
    v_rows = slice(shapes[0] + d_head, sum(shapes))
    assert torch.equal(w.view(groups, sum(shapes), -1)[:, v_rows], w0.view(groups, sum(shapes), -1)[:, v_rows])
    assert torch.equal(w.view(groups, sum(shapes), -1)[1], w0.view(groups, sum(shapes), -1)[1])

# %% [markdown]
# ## Summary
#
# - Muon = EMA momentum → Newton–Schulz (Megatron's quintic coefficients, 5 steps) → scale →
#   decoupled decay; only for 2-D hidden matrices, AdamW for the rest, chained.
# - The QKV split orthogonalizes Q, K, V separately; the TP modes choose between a cheap local
#   approximation (`blockwise`) and the exact full-matrix result (`duplicated`, `distributed`).
# - MuonClip caps each query group's max attention logit at $\tau$ by rescaling Q and K rows.
#
# ## How production does it
#
# - Megatron: `megatron/core/optimizer/emerging_optimizers.py` (`TensorParallelMuon:160`,
#   `orthogonalize:233`, registry `:427`), `megatron/core/optimizer/qk_clip.py`,
#   `megatron/core/transformer/attention.py:1691` (`clip_qk`); the NS kernels live in NVIDIA's
#   `emerging_optimizers` (`orthogonalized_optimizers/muon_utils.py`).
# - Layer-wise distribution across DP (whole matrices per rank) is on the DistributedOptimizer
#   page of this chapter.
#
# ## Exercises
#
# 1. Plot $\sigma \mapsto$ the five-step quintic map on $[0, 1]$. Where does it overshoot 1?
#
#    <details><summary>Answer</summary>
#
#    Apply `ns_coefficients("quintic", 5)` as in Demo 1 to a
#    grid of $10^5$ points in float64. Below $\sigma \approx 0.0026$ the map stays under 1; above it
#    the output oscillates around 1 and exceeds it on 33 short intervals up to $\sigma \approx 0.994$.
#    The largest value is 1.145, at $\sigma \approx 0.004$; $\sigma = 1$ lands at 0.978.
#
#    </details>
#
# 2. Run `blockwise` and `duplicated` on a 2-way row split of a random matrix: which singular
#    values does `blockwise` get wrong, and why does it still train well?
#
#    <details><summary>Hint</summary>
#
#    `orthogonalize_tp` with `tp_mode="blockwise"` runs
#    `newton_schulz` on each shard alone, so each shard's rows come out orthonormal, not the full
#    matrix's. Compare the singular values of the concatenated result with those of `duplicated`,
#    and ask whether an update needs exact singular values to point downhill.
#
#    </details>
#
# 3. Why does QK-clip scale Q by $\eta^\alpha$ and K by $\eta^{1-\alpha}$ instead of scaling only
#    Q by $\eta$? (Hint: GQA shares a K head across several Q heads.)
#
#    <details><summary>Hint</summary>
#
#    In `qk_clip_` the factor is per query group, and one K head
#    serves all the Q heads of its group. The logit scales by $\eta^\alpha\eta^{1-\alpha} = \eta$
#    either way; think about how far each of Q and K moves from its trained value when $\alpha$
#    is 0, 0.5 or 1.
#
#    </details>
