# %% [markdown]
# # C.5 · Kernels: fused AdamW over a flat fp32 shard
#
# After chapter 05's reduce-scatter, a data-parallel rank of the DistributedOptimizer updates
# one contiguous range of every bucket: fp32 master weights, two fp32 moments, an fp32 gradient
# that already sits in the grad buffer, and the bf16 copy in the param buffer. Chapter 02 does
# this with PyTorch's multi-tensor (`_foreach_`) ops: eight passes over the shard, each reading
# and writing whole tensors. One kernel reads each element's five numbers once and writes its
# four results once — the job Apex's and Transformer Engine's FusedAdam do with
# `multi_tensor_apply` for Megatron.
#
# You will build: `fused_adamw_` (the launch over a chunk table), `FlatAdamW` (masters and
# moments as views of flat buffers, the state the optimizer keeps, one launch per step), and
# `adamw_reference_` (the `_foreach_` step it replaces).

# %%
from __future__ import annotations

import torch

from tinytron.kernels._triton import INTERPRET, check_tensor, require_triton, round_to, tl, triton

__all__ = ["fused_adamw_", "adamw_reference_", "FlatAdamW", "adamw_bytes", "build_chunk_table",
           "HPARAM_COLUMNS"]

# %% [markdown]
# ## One launch over many tensors: the chunk table
#
# A model has hundreds of parameters of very different sizes. Launching one kernel per tensor
# costs a launch (~5 µs) each and leaves the GPU idle on the small ones; `multi_tensor_apply`
# instead cuts every tensor into chunks of a fixed size and launches **one** grid whose
# program $i$ looks up "which tensor, which offset, how many elements" in a table. Here the
# tensors are already *pieces of flat buffers* (chapter 05), so a chunk is just three offsets:
#
# | column | meaning |
# |---|---|
# | `flat_start` | first element in the flat fp32 shard (master, `exp_avg`, `exp_avg_sq`) |
# | `buffer_start` | the same element in chapter 05's grad buffer and param buffer |
# | `numel` | elements in this chunk ($\le$ `CHUNK`) |
# | `segment` | which piece it belongs to: the row of its hyperparameters |
#
# Hyperparameters differ per parameter group (no weight decay on norms, a different learning
# rate for embeddings) and the bias corrections per step, so the step uploads one small row per
# piece: $(1 - \eta\lambda,\; 1 - \beta_1,\; \beta_2,\; 1 - \beta_2,\; -\eta / (1 - \beta_1^t),\;
# \sqrt{1 - \beta_2^t},\; \epsilon)$ — the scalars chapter 02's `_adam_foreach` passes to each
# `_foreach_` call, computed the same way in double precision on the host.
#
# The arithmetic per element is chapter 02's, op for op, so fp32 results agree to rounding:
#
# $$\theta \leftarrow \theta (1 - \eta\lambda),\quad m \leftarrow m + (1 - \beta_1)(g - m),\quad
#   v \leftarrow \beta_2 v + (1 - \beta_2) g^2,$$
# $$\theta \leftarrow \theta - \frac{\eta}{1 - \beta_1^t} \cdot
#   \frac{m}{\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon}, \qquad
#   \text{param buffer} \leftarrow \mathrm{bf16}(\theta).$$

# %%
HPARAM_COLUMNS = ("decay", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size",
                  "bias_correction2_sqrt", "eps")


@triton.jit
def _adamw_kernel(chunks_ptr, hparams_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr,
                  param_ptr, CHUNK: tl.constexpr):
    """AdamW on one chunk of the flat shard; the rounded result goes into the param buffer."""
    row = tl.program_id(0).to(tl.int64) * 4
    flat_start = tl.load(chunks_ptr + row)
    buffer_start = tl.load(chunks_ptr + row + 1)
    numel = tl.load(chunks_ptr + row + 2)
    h = hparams_ptr + tl.load(chunks_ptr + row + 3) * 7
    decay, w1, beta2 = tl.load(h), tl.load(h + 1), tl.load(h + 2)
    w2, step_size, bc2_sqrt, eps = tl.load(h + 3), tl.load(h + 4), tl.load(h + 5), tl.load(h + 6)
    offs = tl.arange(0, CHUNK)
    mask = offs < numel
    p = tl.load(master_ptr + flat_start + offs, mask=mask)
    m = tl.load(exp_avg_ptr + flat_start + offs, mask=mask)
    v = tl.load(exp_avg_sq_ptr + flat_start + offs, mask=mask)
    g = tl.load(grad_ptr + buffer_start + offs, mask=mask)
    p = p * decay
    m = tl.where(w1 < 0.5, m + w1 * (g - m), g - (g - m) * (1.0 - w1))  # torch.lerp's two forms
    v = v * beta2 + w2 * g * g
    p = p + step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(master_ptr + flat_start + offs, p, mask=mask)
    tl.store(exp_avg_ptr + flat_start + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + flat_start + offs, v, mask=mask)
    tl.store(param_ptr + buffer_start + offs, round_to(p, param_ptr.dtype.element_ty), mask=mask)


# %%
def build_chunk_table(segments: list[tuple[int, int, int, int]], chunk: int,
                      device: torch.device) -> torch.Tensor:
    """int64 [num_chunks, 4] rows (flat_start, buffer_start, numel, segment), <= chunk each."""
    rows = []
    for flat_start, buffer_start, numel, segment in segments:
        for off in range(0, numel, chunk):
            rows.append((flat_start + off, buffer_start + off, min(chunk, numel - off), segment))
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 4)


def fused_adamw_(chunks: torch.Tensor, hparams: torch.Tensor, master: torch.Tensor,
                 exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad_buffer: torch.Tensor,
                 param_buffer: torch.Tensor, chunk: int) -> None:
    """One launch: AdamW on every chunk of the table, bf16 (or any dtype) copy into param_buffer."""
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                    ("grad buffer", grad_buffer), ("hyperparameters", hparams)):
        check_tensor(f"fused AdamW {name}", t, dtype=torch.float32)
    check_tensor("fused AdamW param buffer", param_buffer, dims=1)
    check_tensor("fused AdamW chunk table", chunks, dtypes=(torch.int64,), dims=2)
    if chunks.shape[0]:
        _adamw_kernel[(chunks.shape[0],)](chunks, hparams, master, exp_avg, exp_avg_sq,
                                          grad_buffer, param_buffer, CHUNK=chunk)


def adamw_reference_(params, grads, exp_avgs, exp_avg_sqs, step: int, lr: float,
                     betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01) -> None:
    """The multi-tensor step the kernel replaces (chapter 02's _adam_foreach, AdamW form)."""
    beta1, beta2 = betas
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, (1 - beta2 ** step) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -lr / (1 - beta1 ** step))


def adamw_bytes(numel: int, param_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the kernel moves: read master, m, v, grad (fp32); write master, m, v and the param."""
    return numel * (7 * 4 + torch.empty((), dtype=param_dtype).element_size())


# %% [markdown]
# ## The optimizer object: flat buffers behind ordinary-looking state
#
# `FlatAdamW` takes the pieces an optimizer steps — for each, its fp32 master tensor, the flat
# grad buffer and param buffer it lives in (chapter 05's `grad_data` / `param_data`) and its
# offset there — plus the optimizer's `param_groups` and `state`. It allocates one flat fp32
# buffer each for the masters, `exp_avg` and `exp_avg_sq`, copies the masters in and
# **re-points** every master tensor at its slice (`main.data = flat[a:b]`, the trick chapter 05
# plays with the bf16 params). The moments go into `state[main]` as views too, so the optimizer
# state dict, the checkpoint code and the learning-rate scheduler see exactly what they saw
# before; only the arithmetic moved. A state dict loaded later replaces those entries with
# fresh tensors: the next step copies them back into the flat buffers and re-points them.
#
# It reads the gradients straight from the grad buffer, so each master's `.grad` must be that
# buffer's view (chapter 02's DistributedOptimizer over an fp32 grad buffer sets exactly that;
# unscaling and clipping work in place on it). A bf16 grad buffer, an L2-coupled Adam group or
# a piece without its gradient is refused with an error that says so.

# %%
class FlatAdamW:
    """AdamW on pieces held as views of flat fp32 buffers: one kernel launch per step (per buffer)."""

    def __init__(self, param_groups: list[dict], state, segments, chunk: int | None = None):
        require_triton()
        self.param_groups, self.state = param_groups, state
        self.chunk = chunk or (64 if INTERPRET else 4096)
        group_of = {id(p): g for g in param_groups for p in g["params"]}
        self.mains, self.groups, self.slices, self.grad_ptrs, rows = [], [], [], [], {}
        flat = 0
        for main, grad_buffer, param_buffer, buffer_start in segments:
            group = _check_segment(main, grad_buffer, param_buffer, buffer_start, group_of)
            key = (grad_buffer.data_ptr(), param_buffer.data_ptr())
            rows.setdefault(key, (grad_buffer, param_buffer, []))[2].append(
                (flat, buffer_start, main.numel(), len(self.mains)))
            self.mains.append(main)
            self.groups.append(group)
            self.slices.append((flat, flat + main.numel()))
            self.grad_ptrs.append(grad_buffer.data_ptr() + 4 * buffer_start)
            flat += main.numel()
        device = self.mains[0].device if self.mains else torch.device("cpu")
        self.master = torch.empty(flat, dtype=torch.float32, device=device)
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.master), torch.zeros_like(self.master)
        with torch.no_grad():
            for main, (a, b) in zip(self.mains, self.slices):
                self.master[a:b].copy_(main.detach().reshape(-1))
                main.data = self.master[a:b].view_as(main)
        self.launches = [(g, p, build_chunk_table(segs, self.chunk, device))
                         for g, p, segs in rows.values()]


# %% [markdown]
# The state stays the optimizer's, so it can change under the flat buffers: a loaded state dict
# puts fresh tensors in `state[main]`, and code elsewhere may re-point a master. Before each
# step `_adopt_state` notices either (the data pointers differ), copies the values into the flat
# buffers and makes the entries views again; a piece seen for the first time gets zero moments.

# %%
class FlatAdamW(FlatAdamW):  # the same class, continued
    __doc__ = FlatAdamW.__doc__  # help() keeps the first cell's docstring
    def _adopt_state(self, i: int) -> dict:
        """state[main] with step and the moments as views of the flat buffers (copied in if new)."""
        main, (a, b) = self.mains[i], self.slices[i]
        if main.data_ptr() != self.master[a:b].data_ptr():  # someone re-pointed the master
            self.master[a:b].copy_(main.detach().reshape(-1))
            main.data = self.master[a:b].view_as(main)
        st = self.state[main]
        st.setdefault("step", 0)
        for key, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            view, held = flat[a:b].view_as(main), st.get(key)
            if held is None:
                view.zero_()
            elif held.data_ptr() != view.data_ptr():
                view.copy_(held.reshape(view.shape))
            st[key] = view
        return st


# %% [markdown]
# The step itself is one row of seven host-computed scalars per piece (the learning rate and
# weight decay come from the piece's param group, read at each step, so a scheduler's change
# applies at once) and then one `fused_adamw_` launch per pair of grad and param buffers.

# %%
class FlatAdamW(FlatAdamW):  # the same class, continued
    __doc__ = FlatAdamW.__doc__  # help() keeps the first cell's docstring
    def _hparams(self, i: int, step: int) -> list[float]:
        """This piece's row of HPARAM_COLUMNS (host doubles, as chapter 02's scalars)."""
        g = self.groups[i]
        beta1, beta2 = g["betas"]
        lr, wd = g["lr"], g["weight_decay"]
        return [1 - lr * wd, 1 - beta1, beta2, 1 - beta2, -lr / (1 - beta1 ** step),
                (1 - beta2 ** step) ** 0.5, g["eps"]]

    @torch.no_grad()
    def step(self) -> None:
        """Advance every piece by one AdamW step and write the rounded params into their buffers."""
        rows = []
        for i, main in enumerate(self.mains):
            _check_grad_view(main, self.grad_ptrs[i])
            st = self._adopt_state(i)
            st["step"] += 1
            rows.append(self._hparams(i, st["step"]))
        if not rows:
            return
        hparams = torch.tensor(rows, dtype=torch.float32, device=self.master.device)
        for grad_buffer, param_buffer, chunks in self.launches:
            fused_adamw_(chunks, hparams, self.master, self.exp_avg, self.exp_avg_sq, grad_buffer,
                         param_buffer, self.chunk)


# %% [markdown]
# The checks refuse, with a message that says why, what the single fused step cannot serve: a
# master that is not fp32, a bf16 grad buffer, no param buffer, a piece outside its buffer or in
# no param group, an L2-coupled Adam group, and (at each step) a `.grad` that is not the grad
# buffer's slice the chunk table points at.

# %%
def _check_segment(main, grad_buffer, param_buffer, buffer_start, group_of) -> dict:
    """The piece's param group, after ValueErrors for what the fused step cannot serve."""
    if main.dtype != torch.float32:
        raise ValueError(f"fused AdamW masters must be fp32, got {main.dtype}")
    if grad_buffer.dtype != torch.float32:
        raise ValueError(f"fused AdamW reads grads from the grad buffer, which is {grad_buffer.dtype}; "
                         "it needs an fp32 grad buffer (grad_reduce_in_fp32=True)")
    if param_buffer is None:
        raise ValueError("fused AdamW writes into a param buffer; the buffer has none "
                         "(use_distributed_optimizer=False)")
    if not 0 <= buffer_start <= grad_buffer.numel() - main.numel():
        raise ValueError(f"piece [{buffer_start}, {buffer_start + main.numel()}) is outside the "
                         f"buffer of {grad_buffer.numel()} elements")
    group = group_of.get(id(main))
    if group is None:
        raise ValueError("a fused AdamW piece is in none of the optimizer's param groups")
    if not group.get("decoupled_weight_decay", True):
        raise ValueError("fused AdamW implements decoupled weight decay (AdamW); a param group "
                         "has decoupled_weight_decay=False")
    return group


def _check_grad_view(main, want_ptr: int) -> None:
    """RuntimeError unless main.grad is the grad buffer's slice the chunk table points at."""
    grad = main.grad
    if grad is None or grad.data_ptr() != want_ptr or not grad.is_contiguous():
        raise RuntimeError("fused AdamW: a master's .grad is not its slice of the fp32 grad "
                           "buffer (the kernel reads the buffer directly)")


# %% [markdown]
# ## Bytes and the roofline for the running example
#
# A DP rank of the running example's first stage steps $2{,}007{,}629{,}824 / 64 = 31.4$ M
# elements. The kernel reads master, $m$, $v$ and the gradient (16 bytes) and writes master,
# $m$, $v$ and the bf16 param (14 bytes): 30 bytes per element, 941 MB, **281 µs** at an
# H100's 3.35 TB/s, and a handful of FLOPs per element: memory-bound. The demo counts the
# `_foreach_` step plus its bf16 copy at 92 bytes per element (each of the eight passes reads
# and writes whole fp32 tensors, and `sqrt` materializes a temporary): 2.9 GB, 861 µs.
# That is per step, not per micro-batch — a smaller prize than the activations' kernels, but
# paid on every rank every step, and it grows with $1/\mathrm{dp}$ as the shards get bigger.

# %% [markdown]
# ## Demo: a miniature param buffer, stepped both ways
#
# Three parameters laid out like chapter 05 (reverse order, 64-element aligned starts, padding
# in between) in a bf16 param buffer and an fp32 grad buffer; two param groups (weight decay on
# the matrix only); the learning rate changes every step as a scheduler would change it. The
# fused step and the `_foreach_` reference run side by side for five steps; the chunk table is
# drawn over the buffer.

# %%
if __name__ == "__main__":
    from collections import defaultdict

    import matplotlib.pyplot as plt

    from tinytron.kernels._measure import EagerTraffic

    gen = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (20, 6), "fc.bias": (7,), "norm.weight": (6,)}
    starts, end = {}, 0
    for name in reversed(shapes):  # chapter 05 lays params out in reverse, 64-aligned
        starts[name] = -(-end // 64) * 64
        end = starts[name] + torch.Size(shapes[name]).numel()
    grad_buffer = torch.zeros(-(-end // 64) * 64)
    param_buffer = torch.zeros_like(grad_buffer, dtype=torch.bfloat16)
    masters = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    ref = {n: m.clone() for n, m in masters.items()}
    ref_m, ref_v = ({n: torch.zeros_like(m) for n, m in masters.items()} for _ in range(2))
    for n, m in masters.items():
        param_buffer[starts[n]:starts[n] + m.numel()] = m.reshape(-1).bfloat16()
    groups = [dict(params=[masters["fc.weight"]], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                   eps=1e-8, names=["fc.weight"]),
              dict(params=[masters["fc.bias"], masters["norm.weight"]], lr=1e-2, weight_decay=0.0,
                   betas=(0.9, 0.95), eps=1e-8, names=["fc.bias", "norm.weight"])]
    opt = FlatAdamW(groups, defaultdict(dict), [(m, grad_buffer, param_buffer, starts[n])
                                                 for n, m in masters.items()], chunk=32)
    for step in range(1, 6):
        grad_buffer.normal_(generator=gen)
        for n, m in masters.items():
            m.grad = grad_buffer[starts[n]:starts[n] + m.numel()].view_as(m)
        for g in groups:
            g["lr"] = 1e-2 / step  # a scheduler writes the groups; the next step reads them
            names = g["names"]
            adamw_reference_([ref[n] for n in names], [masters[n].grad for n in names],
                             [ref_m[n] for n in names], [ref_v[n] for n in names], step,
                             g["lr"], g["betas"], g["eps"], g["weight_decay"])
        opt.step()

# %% [markdown]
# After five steps the masters and moments match the `_foreach_` reference, every bf16 param in
# the buffer is the rounded master, the padding between pieces is untouched, and the chunk
# table splits the three pieces into six chunks of at most 32.

# %%
if __name__ == "__main__":
    def rel(a, b):
        """max |a - b| / max |b|."""
        return ((a - b).abs().max() / b.abs().max()).item()

    gap = max(rel(masters[n], ref[n]) for n in shapes)
    gap_v = max(rel(opt.state[masters[n]]["exp_avg_sq"], ref_v[n]) for n in shapes)
    written = all(torch.equal(param_buffer[starts[n]:starts[n] + m.numel()],
                              m.detach().reshape(-1).bfloat16()) for n, m in masters.items())
    used = torch.zeros_like(grad_buffer, dtype=torch.bool)
    for n, m in masters.items():
        used[starts[n]:starts[n] + m.numel()] = True
    print(f"after 5 steps: relative gap fused vs foreach: master {gap:.1e}, exp_avg_sq {gap_v:.1e}; "
          f"bf16 params written: {written}; padding untouched: {bool((param_buffer[~used] == 0).all())}")
    chunks = opt.launches[0][2]
    print("chunk table (flat_start, buffer_start, numel, segment):", chunks.tolist())

    fig, ax = plt.subplots(figsize=(8, 1.6))
    for pid, (_, start, numel, seg) in enumerate(chunks.tolist()):
        ax.barh(0, numel, left=start, color=plt.get_cmap("tab10")(seg), edgecolor="black")
        ax.text(start + numel / 2, 0, f"p{pid}", ha="center", va="center", fontsize=7)
    ax.set(yticks=[], xlim=(0, grad_buffer.numel()),
           xlabel="buffer offset (white = padding); one program per chunk of <= 32, color = piece")
    fig.tight_layout()
    plt.show()
    assert gap < 1e-6 and gap_v < 1e-6 and written
    assert bool((param_buffer[~used] == 0).all())
    assert len(chunks) == 6 and chunks[:, 2].max() <= 32

# %% [markdown]
# Last, the bytes: the dispatch-mode counter tallies what the `_foreach_` step and its bf16 copy
# move per element, against the kernel's 30.

# %%
if __name__ == "__main__":
    numel = 4096
    tensors = [torch.randn(numel) for _ in range(4)]
    bf16_out = torch.empty(numel, dtype=torch.bfloat16)
    with EagerTraffic() as eager:
        adamw_reference_([tensors[0]], [tensors[1]], [tensors[2]], [tensors[3]], 1, 1e-3)
        bf16_out.copy_(tensors[0])
    per_elem = eager.total() / numel
    print(f"bytes per element: foreach {per_elem:.0f} ({' '.join(eager.op_names())}), "
          f"kernel {adamw_bytes(numel) / numel:.0f}")
    assert round(per_elem) == 92 and adamw_bytes(numel) / numel == 30

# %% [markdown]
# ## Summary
#
# - Masters and moments live in three flat fp32 buffers; the optimizer state holds views of
#   them, so state dicts, checkpoints and schedulers are unchanged.
# - One launch walks a chunk table (flat offset, buffer offset, length, piece), reads
#   hyperparameters per piece, reads the gradient from chapter 05's grad buffer and writes the
#   rounded parameter into its param buffer: 30 bytes per element against 92.
# - Chapter 02's `DistributedOptimizer(..., fused_adamw=True)` (config `kernels = "triton"`)
#   hands its pieces to `FlatAdamW`; the all-gather that follows is unchanged.
#
# ## How production does it
#
# - Megatron imports Transformer Engine's or Apex's `FusedAdam` and falls back to
#   `torch.optim.AdamW` (`megatron/core/optimizer/__init__.py:13-35`); both fused versions
#   use `multi_tensor_apply` (chunk lists over many tensors, as here). With
#   `use_precision_aware_optimizer` (`__init__.py:563`) TE's FusedAdam also keeps the master
#   weights and moments itself, in chosen dtypes, and writes the bf16 params
#   (`megatron/core/optimizer/distrib_optimizer.py:399`).
# - `torch.optim.AdamW(fused=True)` is PyTorch's own single-kernel step over lists of tensors.
#
# ## Exercises
#
# 1. Add the gradient unscaling and the clip coefficient to the kernel (one more scalar each):
#    how many passes over the shard does chapter 02's step then save?
# 2. Keep `exp_avg_sq` in bf16 (precision-aware optimizer): bytes per element, and what happens
#    to the update when $v$ is tiny?
# 3. Why must the chunk size be a power of two, and what does a chunk much larger than the
#    typical piece cost?
