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
# moments as views of flat buffers, the state the optimizer keeps, one launch per param group
# per step), and `adamw_reference_` (the `_foreach_` step it replaces).

# %%
from __future__ import annotations

import torch

from tinytron.kernels._checks import check_grad_view, check_one_step, check_segment
from tinytron.kernels._triton import INTERPRET, check_tensor, require_triton, round_to, tl, triton

__all__ = ["fused_adamw_", "adamw_reference_", "FlatAdamW", "adamw_bytes", "build_chunk_table",
           "HPARAM_COLUMNS", "DEFAULT_CHUNK", "adamw_warps"]

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
# rate for embeddings) and the bias corrections per step, so each param group gets its own
# table and launch, with seven scalars: $(1 - \eta\lambda,\; 1 - \beta_1,\; \beta_2,\; 1 - \beta_2,\; -\eta / (1 - \beta_1^t),\;
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
#
# A program updates one chunk of 1024 elements (64 under the interpreter, so that the tests'
# small pieces still split) with 8 warps: each thread holds 4 values of each of its four fp32
# inputs, one 16-byte load apiece (`adamw_warps`). Compiled ahead of time with Triton 3.6 (the
# lent H200's) and 3.9, that takes 40 registers per thread on sm_80 and sm_90, no spills, so
# six 256-thread blocks share an SM. The chunk this page used before, 4096 at 8 warps (16 values
# of each per thread), took 254 registers on sm_90 with either Triton (198 on sm_80 with 3.6):
# one block per SM. 2048 at 8 warps takes 64 registers with Triton 3.6 but 118 with 3.9 on
# sm_90, and 4096 at 4 warps spills (224 B per thread on sm_90 with 3.6). A memory-bound kernel wants many loads in flight per SM, which
# small per-thread shares and several resident blocks give. The chunk table costs 32 bytes per
# chunk, 0.8% of the fp32 master shard at 1024.

# %%
DEFAULT_CHUNK = 64 if INTERPRET else 1024
"""Elements per program: 1024 compiled (8 warps, 4 per thread), 64 under the interpreter."""


def adamw_warps(chunk: int) -> int:
    """num_warps for a chunk: 4 elements of each tensor per thread (one 16-byte load), 4 to 16."""
    return max(4, min(16, chunk // 128))

HPARAM_COLUMNS = ("decay", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size",
                  "bias_correction2_sqrt", "eps")


@triton.jit
def _adamw_kernel(chunks_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, param_ptr,
                  decay, one_minus_beta1, beta2, one_minus_beta2, step_size,
                  bias_correction2_sqrt, eps, CHUNK: tl.constexpr):
    """AdamW on one chunk of the flat shard; the rounded result goes into the param buffer."""
    row = tl.program_id(0).to(tl.int64) * 4
    flat_start = tl.load(chunks_ptr + row)
    buffer_start = tl.load(chunks_ptr + row + 1)
    numel = tl.load(chunks_ptr + row + 2)
    w1, w2, bc2_sqrt = one_minus_beta1, one_minus_beta2, bias_correction2_sqrt
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


# %% [markdown]
# `fused_adamw_` checks the buffers and the hyperparameter row, then launches one program per row
# of the chunk table.

# %%
def fused_adamw_(chunks: torch.Tensor, hparams: list[float], master: torch.Tensor,
                 exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad_buffer: torch.Tensor,
                 param_buffer: torch.Tensor, chunk: int) -> None:
    """One launch: AdamW on every chunk of the table, bf16 (or any dtype) copy into param_buffer.

    `hparams` is one row of HPARAM_COLUMNS, passed to the kernel as scalar arguments.
    """
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                    ("grad buffer", grad_buffer)):
        check_tensor(f"fused AdamW {name}", t, dtype=torch.float32)
    check_tensor("fused AdamW param buffer", param_buffer, dims=1)
    check_tensor("fused AdamW chunk table", chunks, dtypes=(torch.int64,), dims=2)
    if len(hparams) != len(HPARAM_COLUMNS):
        raise ValueError(f"fused AdamW takes {len(HPARAM_COLUMNS)} hyperparameters "
                         f"{HPARAM_COLUMNS}, got {len(hparams)}")
    if chunks.shape[0]:
        _adamw_kernel[(chunks.shape[0],)](chunks, master, exp_avg, exp_avg_sq, grad_buffer,
                                          param_buffer, *map(float, hparams), CHUNK=chunk,
                                          num_warps=adamw_warps(chunk))


# %% [markdown]
# Beside the kernel sit the eager multi-tensor step it replaces, the parity reference of the demo,
# and the bytes the kernel moves, for the roofline below.

# %%
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
#
# The state stays the optimizer's, so it can change under the flat buffers: a loaded state dict
# puts fresh tensors in `state[main]`, and code elsewhere may re-point a master. Before each
# step `adopt_state` notices either (the data pointers differ), copies the values into the flat
# buffers and makes the entries views again; a piece seen for the first time gets zero moments.

# %%
def adopt_state(state: dict, main: torch.Tensor, flats: tuple, a: int, b: int) -> dict:
    """state[main] with step and the moments as views of the flat buffers (copied in if new)."""
    master, exp_avg, exp_avg_sq = flats
    if main.data_ptr() != master[a:b].data_ptr():  # someone re-pointed the master
        master[a:b].copy_(main.detach().reshape(-1))
        main.data = master[a:b].view_as(main)
    st = state[main]
    st.setdefault("step", 0)
    for key, flat in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        view, held = flat[a:b].view_as(main), st.get(key)
        if held is None:
            view.zero_()
        elif held.data_ptr() != view.data_ptr():
            view.copy_(held.reshape(view.shape))
        st[key] = view
    return st


# %% [markdown]
# The hyperparameters of a step are seven numbers per param group, computed on the host in
# double precision from the group's entries as they are at that step (a scheduler's new learning
# rate applies at once) and from the step count $t$. They go to the kernel as **scalar
# arguments**, which travel inside the launch itself: no host tensor is built and copied to the
# device each step (that copy, `torch.tensor(rows, device="cuda")`, would wait for the host and
# put a pageable host-to-device transfer in every step, which also cannot be captured in a CUDA
# graph). Triton passes a Python float as an fp32 argument, rounded to nearest like
# `torch.tensor(..., dtype=torch.float32)`, so the kernel sees the same bits either way.

# %%
def step_hparams(group: dict, step: int) -> list[float]:
    """The row of HPARAM_COLUMNS for a param group at step `step` (host doubles, as chapter 02)."""
    beta1, beta2 = group["betas"]
    lr, wd = group["lr"], group["weight_decay"]
    return [1 - lr * wd, 1 - beta1, beta2, 1 - beta2, -lr / (1 - beta1 ** step),
            (1 - beta2 ** step) ** 0.5, group["eps"]]


# %% [markdown]
# The masters move into one flat fp32 buffer in the order of the pieces, and each master is
# re-pointed at its slice. The moments get buffers of the same size, zeroed.

# %%
def _flat_buffers(mains: list[torch.Tensor], slices: list[tuple[int, int]],
                  flat: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(master, exp_avg, exp_avg_sq) of `flat` fp32 elements; each master becomes its view."""
    device = mains[0].device if mains else torch.device("cpu")
    master = torch.empty(flat, dtype=torch.float32, device=device)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    with torch.no_grad():
        for main, (a, b) in zip(mains, slices):
            master[a:b].copy_(main.detach().reshape(-1))
            main.data = master[a:b].view_as(main)
    return master, exp_avg, exp_avg_sq


# %% [markdown]
# `FlatAdamW` ties these together. At construction it checks every piece (the checks, with
# their messages, are in the page's private module `chapters/kernels/_checks.py`: an fp32 master,
# an fp32 grad buffer, a param buffer, a piece inside its buffer and in an AdamW param group),
# lays out the flat buffers and builds one chunk table per (grad buffer, param buffer, param
# group). A step adopts each piece's state, checks that its `.grad` is still the grad buffer's
# slice the table points at, and launches once per table: with the usual two param groups
# (decayed matrices, undecayed norms and biases) and one buffer, two launches per step.

# %%
class FlatAdamW:
    """AdamW on pieces held as views of flat fp32 buffers: one launch per buffer and param group."""

    def __init__(self, param_groups: list[dict], state, segments, chunk: int | None = None):
        require_triton()
        self.param_groups, self.state = param_groups, state
        self.chunk = chunk or DEFAULT_CHUNK
        group_of = {id(p): g for g in param_groups for p in g["params"]}
        self.mains, self.groups, self.slices, self.grad_ptrs, rows = [], [], [], [], {}
        flat = 0
        for main, grad_buffer, param_buffer, buffer_start in segments:
            group = check_segment(main, grad_buffer, param_buffer, buffer_start, group_of)
            key = (grad_buffer.data_ptr(), param_buffer.data_ptr(), id(group))
            rows.setdefault(key, (grad_buffer, param_buffer, group, []))[3].append(
                (flat, buffer_start, main.numel(), len(self.mains)))
            self.mains.append(main)
            self.groups.append(group)
            self.slices.append((flat, flat + main.numel()))
            self.grad_ptrs.append(grad_buffer.data_ptr() + 4 * buffer_start)
            flat += main.numel()
        self.master, self.exp_avg, self.exp_avg_sq = _flat_buffers(self.mains, self.slices, flat)
        self.launches = [(g, p, group, build_chunk_table(segs, self.chunk, self.master.device),
                          [seg[3] for seg in segs]) for g, p, group, segs in rows.values()]

    @torch.no_grad()
    def step(self) -> None:
        """Advance every piece by one AdamW step and write the rounded params into their buffers."""
        flats = (self.master, self.exp_avg, self.exp_avg_sq)
        steps = []
        for i, main in enumerate(self.mains):
            check_grad_view(main, self.grad_ptrs[i])
            st = adopt_state(self.state, main, flats, *self.slices[i])
            st["step"] += 1
            steps.append(st["step"])
        for grad_buffer, param_buffer, group, chunks, pieces in self.launches:
            step = check_one_step([steps[i] for i in pieces])
            fused_adamw_(chunks, step_hparams(group, step), *flats, grad_buffer, param_buffer,
                         self.chunk)


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
    chunks = torch.cat([table for *_, table, _ in opt.launches])  # one table per param group
    print(f"{len(opt.launches)} launches per step; chunk tables (flat_start, buffer_start, numel, "
          f"piece): {chunks.tolist()}")

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
# - One launch per param group walks a chunk table (flat offset, buffer offset, length,
#   piece), takes the group's seven hyperparameters as scalar arguments (nothing is copied to
#   the device per step), reads the gradient from chapter 05's grad buffer and writes the
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
#
#    <details><summary>Hint</summary>
#
#    List chapter 02's passes over the fp32 gradient before the
#    update: the unscale multiplies it in place, the clip first reads it for the norm, then
#    multiplies it in place. Each in-place multiply reads and writes 8 bytes per element. Which of
#    them can become a scalar the kernel applies to $g$ as it loads it, and which must still run
#    before the step, because the coefficient depends on it?
#
#    </details>
#
# 2. Keep `exp_avg_sq` in bf16 (precision-aware optimizer): bytes per element, and what happens
#    to the update when $v$ is tiny?
#
#    <details><summary>Answer</summary>
#
#    <code>adamw_bytes</code> counts $7 \cdot 4 + 2 = 30$ bytes
#    per element with bf16 params; $v$ read and written in bf16 saves 4, so 26 (and 2 bytes of
#    memory per element). bf16 keeps fp32's exponent range, so a tiny $v$ does not underflow, but
#    it keeps 8 significant bits: with $\beta_2 = 0.999$, $\beta_2 v$ rounds back to $v$ whenever
#    $(1 - \beta_2) g^2$ is small against it, so $v$ stops decaying and the step
#    $m / (\sqrt{v} + \epsilon)$ stays too small; stochastic rounding or an fp32 $v$ avoid
#    it.
#
#    </details>
#
# 3. Why must the chunk size be a power of two, and what does a chunk much larger than the
#    typical piece cost?
#
#    <details><summary>Hint</summary>
#
#    The kernel's offsets are <code>tl.arange(0, CHUNK)</code>,
#    and Triton's <code>arange</code> takes only a power of two. <code>build_chunk_table</code>
#    cuts each piece on its own, so the last chunk of every piece is partly masked: a
#    4,096-element norm weight fills four 1,024 chunks exactly, but with a chunk of 65,536 it
#    would be one program with 94% of its lanes masked. Count the masked lanes and the programs
#    per piece.
#
#    </details>
