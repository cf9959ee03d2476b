# %% [markdown]
# # 02 · Optimizer: master weights, loss scaling and gradient clipping
#
# The wrapper Megatron puts around every optimizer: bf16/fp16 model params with fp32 master
# copies and fp32 optimizer state, the loss scaler that protects fp16 gradients (constant or
# dynamic with hysteresis) and skips exactly the steps that overflowed, and gradient clipping
# by one global L2 norm computed over tensor-, pipeline- and data-parallel shards without
# counting replicated params twice.

# %%
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from tinytron.optimizer._checks import check_grads_reduced, check_scaler_args
from tinytron.optimizer._state_dict import (LayoutFreeStateDict, _group_hparams,  # noqa: F401
                                            _load_group_hparams)

__all__ = [
    "ConstantGradScaler", "DynamicGradScaler", "copy_param_attributes", "param_counts_in_norm",
    "grads_for_norm", "get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32",
    "MixedPrecisionOptimizer",
]

# %% [markdown]
# ## Loss scaling
#
# fp16 has 5 exponent bits: gradients below $6\cdot10^{-8}$ flush to zero. Multiplying the loss
# by a scale $S$ multiplies every gradient by $S$ (backward is linear), lifting them into range;
# the optimizer divides by $S$ before using them. Too large an $S$ overflows to inf/NaN; then the
# step must be **skipped** (a partial update with some infs would destroy the weights) and $S$
# lowered. bf16 has fp32's exponent range, so Megatron uses no scaler for bf16
# (`megatron/core/optimizer/__init__.py:637-660`).
#
# `DynamicGradScaler.update(found_inf)` (`megatron/core/optimizer/grad_scaler.py:131`):
#
# - overflow: `growth_tracker = 0`, `hysteresis_tracker -= 1`, and if it reached 0:
#   `scale = max(scale · backoff, min_scale)`. The hysteresis tracker is **not** reset on backoff,
#   so after the first backoff every further consecutive overflow backs off again;
# - clean step: `growth_tracker += 1`; at `growth_interval`: reset it, restore
#   `hysteresis_tracker = hysteresis`, `scale *= growth_factor`.
#
# Why hysteresis: a single overflow is often a one-off, one unusual batch. Backing off on the
# first inf would halve the scale for a transient event, and win it back only after
# `growth_interval` (1,000 by default) clean steps. With `hysteresis=2` the first overflow only
# skips its step; the second one before the next growth backs off. The invalid arguments
# (a growth factor of at most 1, a window of 0, …) are refused with one-line errors from the
# chapter's private module `tinytron.optimizer._checks`.
#
# Defaults: `initial_loss_scale=2**32`, `min_loss_scale=1.0`, growth 2, backoff 0.5,
# `loss_scale_window=1000`, `hysteresis=2`. Worked example with `hysteresis=2`, `interval=3`,
# scale 8: inf → (hyst 1, scale 8); inf → (hyst 0, scale 4); inf → scale 2; clean ×3 → scale 4,
# hyst back to 2.

# %%
class ConstantGradScaler:
    """A loss scale that never changes (`--loss-scale X`)."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self._scale = float(scale)

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        """1/scale, computed in float64 as Megatron does."""
        return float(torch.tensor(1.0, dtype=torch.float64) / self._scale)

    def update(self, found_inf: bool) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict:
        """The scale."""
        return {"scale": self._scale}

    def load_state_dict(self, sd: dict) -> None:
        """Restore the scale."""
        self._scale = float(sd["scale"])


# %% [markdown]
# The dynamic scaler adds the two trackers of the rule above; its state (scale and both
# trackers) is saved with the optimizer, so a resumed run continues the same schedule.

# %%
class DynamicGradScaler(ConstantGradScaler):
    """Megatron's dynamic loss scale: backoff after `hysteresis` overflows, growth after a clean window."""

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2):
        super().__init__(initial_scale)
        check_scaler_args(min_scale, initial_scale, growth_factor, backoff_factor,
                          growth_interval, hysteresis)  # one-line ValueErrors (_checks.py)
        self.min_scale, self.growth_factor, self.backoff_factor = min_scale, growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker, self._hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        """Advance the state machine by one step."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale *= self.growth_factor

    def state_dict(self) -> dict:
        """scale, growth_tracker, hysteresis_tracker (Megatron's three keys)."""
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, sd: dict) -> None:
        """Restore the three values."""
        self._scale = float(sd["scale"])
        self._growth_tracker = int(sd["growth_tracker"])
        self._hysteresis_tracker = int(sd["hysteresis_tracker"])


# %% [markdown]
# ## Which gradients count in the norm
#
# The clip coefficient must be the same on every rank and equal to what one process holding the
# whole model would compute. Each rank sums the squares of *its* gradients, one all-reduce (SUM)
# over the grad-stats group adds them, a square root finishes. The danger is counting a
# parameter twice (`get_main_grads_for_grad_norm`, `megatron/core/optimizer/optimizer.py:140`):
#
# - a param that is **not** TP-sharded (`tensor_model_parallel` unset: norms, biases of
#   row-parallel layers) lives on every TP rank — only TP rank 0 counts it;
# - with tied embeddings the last pipeline stage holds a copy of the word embedding flagged
#   `shared` — it is not counted (the first stage's copy is);
# - data-parallel replicas: without the DistributedOptimizer every DP rank has the same full
#   grads, so the sum runs over the model-parallel group only; with it, each DP rank holds a
#   disjoint shard and the sum runs over **all** ranks.
#
# Then `coef = max_norm / (norm + 1e-6)`, applied only if `coef < 1`
# (`megatron/core/optimizer/clip_grads.py:55, 147`). Example: TP=2, a `[4, 8]` column-parallel
# weight split into two `[2, 8]` shards with squared norms 3 and 5, plus a replicated norm weight
# with squared norm 1 on both ranks: rank 0 contributes 3+1, rank 1 contributes 5, total
# $\sqrt{9} = 3$ — exactly the norm of the unsharded model.
#
# ```mermaid
# flowchart LR
#   P[params on this rank] --> F{"shared?<br/>TP duplicate on tp_rank>0?"}
#   F -- yes --> X[not counted]
#   F -- no --> S["Σ ‖g‖² (local)"] --> R["all-reduce SUM<br/>(mp group, or world for DistOpt)"] --> N["√ → total norm"]
#   N --> C["coef = max/(norm+1e-6); scale grads if coef<1"]
# ```

# %%
_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared",
                     "shared_embedding", "sequence_parallel", "is_embedding_or_output_parameter",
                     "is_qkv", "qkv_split_shapes")


def copy_param_attributes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Carry the TP / sharing flags of a model param over to its master copy."""
    for name in _PARAM_ATTRIBUTES:
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


def param_counts_in_norm(p: torch.Tensor, tp_rank: int) -> bool:
    """Megatron's rule: not a `shared` copy, and TP-sharded or on TP rank 0."""
    if getattr(p, "shared", False):
        return False
    return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0


def grads_for_norm(params: Iterable[torch.Tensor], tp_rank: int = 0) -> list[torch.Tensor]:
    """The grads this rank contributes to the global norm."""
    return [p.grad for p in params if p.grad is not None and param_counts_in_norm(p, tp_rank)]


# %% [markdown]
# With the right list of gradients, the norm is one local sum of squares and one all-reduce;
# clipping scales every gradient by the same coefficient, and the count of zero gradients
# (a health signal Megatron can log) follows the same rule.

# %%
def get_grad_norm_fp32(grads: list[torch.Tensor], norm_type: float = 2.0, group=None,
                       reduce: bool = True, device=None) -> float:
    """Global p-norm of grads spread over the ranks of `group` (None: the default world)."""
    # a rank may hold no counted grad; its zero must still live where the backend reduces (NCCL: GPU)
    device = grads[0].device if grads else (device or torch.device("cpu"))
    if norm_type == math.inf:
        local = torch.stack([g.abs().max().float() for g in grads]).max() if grads else \
            torch.zeros((), device=device)
        if reduce and dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return float(local)
    if grads:
        norms = torch._foreach_norm([g.float() for g in grads], norm_type)
        local = torch.stack(norms).pow(norm_type).sum()
    else:
        local = torch.zeros((), device=device)
    if reduce and dist.is_initialized():
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    return float(local) ** (1.0 / norm_type)


def clip_grad_by_total_norm_fp32(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale grads by max_norm/(total_norm+1e-6) when that is < 1; return the coefficient used."""
    coef = max_norm / (total_norm + 1.0e-6)
    if coef < 1.0 and grads:
        torch._foreach_mul_(grads, coef)
    return min(coef, 1.0)


def count_zeros_fp32(params: Iterable[torch.Tensor], tp_rank: int = 0, group=None,
                     reduce: bool = True, device=None) -> int:
    """Number of exactly-zero grad entries over the counted params of all ranks."""
    grads = grads_for_norm(params, tp_rank)
    local = sum(g.numel() - int(torch.count_nonzero(g)) for g in grads)
    t = torch.tensor(float(local), device=device)
    if reduce and dist.is_initialized():
        dist.all_reduce(t, group=group)
    return int(t)


# %% [markdown]
# ## The mixed-precision optimizer
#
# Why fp32 masters at all: an update smaller than half the spacing of bf16 numbers near the
# weight is rounded away. bf16 keeps 8 significant bits, so near 1.0 its spacing is $2^{-8}
# \approx 0.0039$ below 1 and $2^{-7}$ above; an Adam step with lr $10^{-4}$ moves a weight by
# about $10^{-4}$, 39 times less than that spacing. Applied to the bf16 weight directly, every
# such step is lost (the last demo shows it); applied to an fp32 copy, the steps add up, and the
# bf16 weight changes once they have moved the copy past a rounding boundary.
#
# For every bf16/fp16 param the wrapper creates `main_param = param.detach().clone().float()`,
# copies its TP/sharing flags, and puts the master copy in the inner optimizer's group in the
# param's place (`Float16OptimizerWithFloat16Params.__init__`,
# `megatron/core/optimizer/optimizer.py:668-736`); fp32 params are stepped directly (the
# `FP32Optimizer` case, `:918`). The inner optimizer never sees a bf16 tensor: its state
# (`exp_avg`, `exp_avg_sq`) is fp32 too. Memory per param: 2 (bf16) + 4 (master) + 8 (Adam)
# bytes, plus the 4-byte fp32 `main_grad`. All of it is *resident*: allocated before the first
# step and kept for the whole run. The master weights and the Adam moments, 12 of those 18
# bytes, are the optimizer's own, and [the DistributedOptimizer](distributed.py) shards them.
# For the book's 7B model on one GPU without sharding that is $18 \times 7.5 \cdot 10^9 = 135$ GB,
# which is why the running example shards.
#
# The optimizer is four small classes, each whole: `MasterWeights` (the copies and the groups),
# `MasterCopies` (grads in, params out: the part the distributed optimizer replaces),
# `GradPreparation` (unscale, agree on overflow, the global norm and the clip) and `StepOrder`
# (the step itself). `MixedPrecisionOptimizer` combines them with the state dict of the next
# section.
#
# Two helpers come first: the master copy of one param, and a map from each master to the
# state dict of the optimizer that steps it (a chained optimizer has one state per child).

# %%
def _make_main_param(p: torch.Tensor) -> torch.Tensor:
    """An fp32 master copy for a half-precision param; fp32 params are their own master."""
    if p.dtype == torch.float32:
        return p
    if p.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"params must be fp32, bf16 or fp16, got {p.dtype}")
    main = torch.nn.Parameter(p.detach().clone().float())
    copy_param_attributes(main, p)
    p.main_param = main
    return main


def _state_owners(optimizer) -> dict:
    """id(main param) -> the state dict of the (possibly chained) optimizer that steps it."""
    leaves = getattr(optimizer, "chained_optimizers", [optimizer])
    return {id(p): opt.state for opt in leaves for g in opt.param_groups for p in g["params"]}


# %% [markdown]
# The class puts a master in place of every param in the inner optimizer's groups and remembers
# the pairs; the scheduler reaches the groups through it.

# %%
class MasterWeights:
    """The fp32 master copy of every half-precision param, in the inner optimizer's groups."""

    def __init__(self, optimizer, *, clip_grad: float = 1.0, grad_scaler=None, grid=None,
                 log_num_zeros_in_grad: bool = False, grad_norm_skip_threshold: float = math.inf):
        if clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0, got {clip_grad}")
        self.optimizer, self.clip_grad, self.grad_scaler = optimizer, clip_grad, grad_scaler
        self.grad_norm_skip_threshold = grad_norm_skip_threshold
        self.grid, self.log_num_zeros_in_grad = grid, log_num_zeros_in_grad
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []   # (model_param, main_param)
        self.names: list[str] = []
        self.group_names = [list(g.get("param_names") or [f"group{gi}.param{i}" for i in
                                                           range(len(g["params"]))])
                            for gi, g in enumerate(optimizer.param_groups)]
        self._build_main_params()
        self._state_of = _state_owners(self.optimizer)

    def _build_main_params(self) -> None:
        """Put a master param in place of every model param in the inner optimizer's groups."""
        for group, names in zip(self.optimizer.param_groups, self.group_names):
            for i, p in enumerate(group["params"]):
                group["params"][i] = _make_main_param(p)
                self.pairs.append((p, group["params"][i]))
                self.names.append(names[i])

    def main_params(self) -> list[torch.Tensor]:
        """The fp32 tensors the inner optimizer steps."""
        return [m for _, m in self.pairs]

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (the scheduler writes lr / weight_decay here)."""
        return self.optimizer.param_groups

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * scale (1 without a scaler)."""
        return loss if self.grad_scaler is None else loss * self.grad_scaler.scale


# %% [markdown]
# Next the parts that [the DistributedOptimizer](distributed.py) replaces: where the grad
# statistics are reduced (the model-parallel group here, because every data-parallel rank holds
# the same full grads after DDP's all-reduce), how grads come in (an fp32 copy of `main_grad`,
# or a view when it already is fp32) and how params go out (one `_foreach_copy_` that rounds
# every master into its bf16 param).

# %%
class MasterCopies:
    """Grads into the masters, masters back into the model params, and where stats reduce."""

    def grad_stats_group(self):
        """Where grad norms and found_inf are reduced: the model-parallel group."""
        if self.grid is None or self.grid.size("mp") == 1:
            return None
        return self.grid.group("mp")

    def _reduce(self) -> bool:
        """Whether the grad-stats reduction has more than one rank."""
        return self.grad_stats_group() is not None

    def copy_model_grads_to_main_grads(self) -> None:
        """main_param.grad = fp32 view/copy of main_grad (or grad); drop the model grad."""
        for model, main in self.pairs:
            g = getattr(model, "main_grad", None)
            g = model.grad if g is None else g
            main.grad = None if g is None else g.float()
            if model is not main:
                model.grad = None

    def copy_main_params_to_model_params(self) -> None:
        """Round the fp32 masters into the half-precision model params."""
        model = [p for p, m in self.pairs if p is not m]
        if model:
            torch._foreach_copy_([p.data for p in model], [m.data for p, m in self.pairs if p is not m])


# %% [markdown]
# `step()` in Megatron's exact order (`MixedPrecisionOptimizer.step`, `:621`), after one check
# of ours: when [chapter 05's DDP](../05_buffers/distributed_data_parallel.py) wraps the params, their grads must have been reduced
# (`finish_grad_sync`) — stepping on local grads would train every rank differently, silently:
#
# 1. `prepare_grads` — `main_param.grad = model_param.main_grad.float()` (or `.grad`); unscale
#    in place by `1/scale` while detecting inf/NaN; all-reduce `found_inf` (MAX) over the
#    grad-stats group so **all** ranks agree; `scaler.update(found_inf)`;
# 2. on overflow return `(False, None, None)` — nothing is updated, the scheduler is not stepped;
# 3. clip with the global norm (`clip_grad`, default 1.0);
# 4. optionally count zero grads; if the norm exceeds `grad_norm_skip_threshold` (default
#    $+\infty$; checked in `ChainedOptimizer.step`, `:1451`) report the step as unsuccessful;
# 5. inner `optimizer.step()`, then copy fp32 masters back into the bf16 params.
#
# Steps 1 and 3 first: the grads arrive in the masters, are unscaled while inf/NaN is detected
# (one fused pass over all grads), every rank agrees on `found_inf`; then the global norm and
# the clip. Worked example: scale $2^{16}$, a true gradient of $3 \cdot 10^{-6}$ arrives as
# $0.197$ (a normal fp16 number with all 11 significant bits, where $3 \cdot 10^{-6}$ itself would
# be a subnormal with about 6) and is unscaled in fp32 back to $3 \cdot 10^{-6}$.
#
# The unscale and the agreement on overflow, as one function: every grad is divided by the
# scale in the same pass that looks for inf/NaN, and the flag is maxed over the ranks.

# %%
def _unscale_and_agree(grads: list[torch.Tensor], inv_scale: float, device: torch.device,
                       reduce: bool, group) -> bool:
    """Unscale grads in place; True when any rank saw an inf/NaN."""
    found = torch.zeros(1, device=device)
    if grads:
        inv = torch.full((1,), inv_scale, device=found.device)
        # fused check-and-unscale (one pass; has a CPU kernel since torch 2.3)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    if reduce:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item() > 0)


# %% [markdown]
# The mixin around it: copy the grads in, unscale, update the scaler; then the global norm and
# the clip.

# %%
class GradPreparation:
    """Unscale and agree on overflow; the global grad norm and the clip."""

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Copy grads to the masters, unscale, agree on found_inf, update the scaler."""
        self.copy_model_grads_to_main_grads()
        if self.grad_scaler is None:
            return False
        grads = [m.grad for m in self.main_params() if m.grad is not None]
        found_inf = _unscale_and_agree(grads, self.grad_scaler.inv_scale, self._device(),
                                       self._reduce(), self.grad_stats_group())
        self.grad_scaler.update(found_inf)
        return found_inf

    def _device(self) -> torch.device:
        """Where this rank's reductions run: its params' device, else the grid's."""
        if self.pairs:
            return self.pairs[0][1].device
        return self.grid.device if self.grid is not None else torch.device("cpu")

    def _tp_rank(self) -> int:
        """My TP rank (0 without a grid)."""
        return 0 if self.grid is None else self.grid.rank("tp")

    def get_grad_norm(self) -> float:
        """The global L2 norm of the master grads."""
        grads = grads_for_norm(self.main_params(), self._tp_rank())
        return get_grad_norm_fp32(grads, 2.0, self.grad_stats_group(), reduce=self._reduce(),
                                  device=self._device())

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Compute the global norm and clip every master grad with it; return the norm."""
        norm = self.get_grad_norm()
        grads = [m.grad for m in self.main_params() if m.grad is not None]
        clip_grad_by_total_norm_fp32(grads, clip_grad, norm)
        return norm


# %% [markdown]
# The step itself, in that order, behind the check that the data-parallel reduction has
# finished; a skipped step (overflow, or a norm above the threshold) changes nothing. The check
# looks for the flag that [chapter 05's DDP](../05_buffers/distributed_data_parallel.py) shares
# with its params, and lives with the chapter's other checks in the private module
# `tinytron.optimizer._checks` (`chapters/02_optimizer/_checks.py`).

# %%
class StepOrder:
    """The step in Megatron's order: prepare, skip on overflow, clip, inner step, write back."""

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Inner step on the fp32 masters, then write them back."""
        self.optimizer.step()
        self.copy_main_params_to_model_params()

    def check_grads_reduced(self) -> None:
        """RuntimeError while a DDP wrapper of these params has grads it has not reduced yet."""
        check_grads_reduced(self)

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """(success, grad_norm, num_zeros); success is False exactly when the step overflowed."""
        self.check_grads_reduced()
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.clip_grad_norm(self.clip_grad) if self.clip_grad > 0 else self.get_grad_norm()
        num_zeros = None
        if self.log_num_zeros_in_grad:
            num_zeros = count_zeros_fp32(self.main_params(), self._tp_rank(),
                                         self.grad_stats_group(), reduce=self._reduce(),
                                         device=self._device())
        if grad_norm > self.grad_norm_skip_threshold:   # ChainedOptimizer.step's guard
            return False, grad_norm, num_zeros
        self.step_with_ready_grads()
        return True, grad_norm, num_zeros

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the grads of model and master params (the buffer is zeroed by DDP)."""
        for model, main in self.pairs:
            model.grad = None
            main.grad = None


# %% [markdown]
# ## A state dict that does not depend on the layout
#
# [Chapter 03](../03_checkpoint/formats.py) saves the optimizer and may reload it with another
# data-parallel size. The form used throughout this chapter is therefore *per parameter, by
# name, full tensors*:
# `{"params": {name: {"fp32_param": ..., "exp_avg": ..., "exp_avg_sq": ..., "step": ...}},
# "param_groups": [hyperparameters + param_names], "grad_scaler": ...}` — the same keys
# whether the optimizer is plain or sharded over DP. (Under TP the tensors are this TP rank's
# shards; [chapter 03 reshards them](../03_checkpoint/resharding.py) with the params'
# `partition_dim`.) Loading copies each `fp32_param` into its master and rounds it into the
# model param, so that a resumed run's bf16 weights are exactly the rounded masters, as they
# were when the checkpoint was written.
#
# <details><summary>Megatron detail: its state dict is keyed by index</summary>
#
# Megatron's mixed-precision state dict is the inner PyTorch optimizer's, keyed by parameter
# *index*, with the fp32 masters saved beside it as `fp32_from_fp16_params`
# (`Float16OptimizerWithFloat16Params.state_dict`, `optimizer.py:817-826`), and its
# distributed optimizer has formats of its own. tinytron keeps one form keyed by parameter *name* for every optimizer of this
# chapter, so that any of them loads any other's checkpoint at any DP size. The code is plumbing
# (`LayoutFreeStateDict` in the private module `tinytron.optimizer._state_dict`,
# `chapters/02_optimizer/_state_dict.py`).
#
# </details>

# %%
class MixedPrecisionOptimizer(MasterCopies, GradPreparation, StepOrder, LayoutFreeStateDict,
                              MasterWeights):
    """fp32 master params + state around any optimizer; scaler, global-norm clip, skip on overflow."""


# %% [markdown]
# ## Demo 1: the dynamic scaler skips exactly the overflowing steps
#
# A linear model with a dynamic scaler (growth interval 5, hysteresis 2) starting at $2^{40}$.
# The fp32 gradients times $2^{40}$ stay finite, so only the two steps where we inject an inf
# (12 and 13) overflow. The trace shows the scale growing every 5 clean steps, staying put on
# the first overflow (hysteresis), halving on the second, and growing again afterwards; the
# two overflowing steps are skipped and no other.

# %%
def _train_linear(dtype, steps: int, scaler=None, inject=(), clip: float = 1.0, seed: int = 0):
    """Train y = x W on random data; return (wrapper, history of (ok, scale, grad_norm))."""
    gen = torch.Generator().manual_seed(seed)
    x, w_true = torch.randn(64, 8, generator=gen), torch.randn(8, 4, generator=gen)
    y = x @ w_true
    model = torch.nn.Linear(8, 4, bias=False).to(dtype)
    torch.nn.init.zeros_(model.weight)
    from tinytron.optimizer.algorithms import AdamW
    opt = MixedPrecisionOptimizer(AdamW(model.parameters(), lr=0.05, weight_decay=0.0),
                                  clip_grad=clip, grad_scaler=scaler)
    history = []
    for step in range(steps):
        loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
        opt.scale_loss(loss).backward()
        if step in inject:
            model.weight.grad[0, 0] = float("inf")
        scale = None if scaler is None else scaler.scale
        ok, norm, _ = opt.step()
        opt.zero_grad()
        history.append((ok, scale, norm, loss.item()))
    return opt, model, history


# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    scaler = DynamicGradScaler(initial_scale=2.0 ** 40, min_scale=1.0, growth_interval=5, hysteresis=2)
    opt, model, hist = _train_linear(torch.float32, 40, scaler, inject=(12, 13))
    skipped = [i for i, h in enumerate(hist) if not h[0]]
    print("skipped steps:", skipped)
    print("scale per step:", [int(math.log2(h[1])) for h in hist], "(log2)")
    fig, ax = plt.subplots(figsize=(7, 2.5))
    ax.step(range(len(hist)), [math.log2(h[1]) for h in hist], where="post")
    ax.scatter(skipped, [math.log2(hist[i][1]) for i in skipped], color="red", label="skipped")
    ax.set(xlabel="step", ylabel="log2 scale", title="dynamic loss scale")
    ax.legend()
    plt.tight_layout()
    plt.show()
    assert skipped == [12, 13]
    assert hist[12][1] == hist[13][1] == 2 * hist[14][1]   # hysteresis 2: backoff on the 2nd inf
    # every step whose gradients were finite after unscaling was applied, the others skipped
    assert all(hist[i][0] for i in range(len(hist)) if i not in skipped)
    assert hist[-1][3] < hist[len(skipped)][3]   # the model still trained

# %% [markdown]
# ## Demo 2: bf16 params with fp32 masters
#
# The same regression with bf16 params. The master weights stay fp32, the bf16 weights are
# exactly the rounded masters after every step, and the loss follows the fp32 run down to
# bf16's resolution. Without the master copy, an update smaller than half of bf16's spacing
# ($2^{-8}$ of the weight) would be rounded away: with lr $10^{-4}$ on a weight of 1 *every*
# Adam step would be lost.

# %%
if __name__ == "__main__":
    opt32, m32, h32 = _train_linear(torch.float32, 200, clip=0.0)
    opt16, m16, h16 = _train_linear(torch.bfloat16, 200, clip=0.0)
    main = m16.weight.main_param
    print(f"final loss fp32 {h32[-1][3]:.2e} | bf16+fp32 master {h16[-1][3]:.2e}")
    assert main.dtype == torch.float32 and m16.weight.dtype == torch.bfloat16
    assert torch.equal(m16.weight.data, main.data.bfloat16())
    state = opt16.optimizer.state[main]
    assert state["exp_avg"].dtype == torch.float32
    assert h16[-1][3] < 3 * h32[-1][3] + 1e-3

# %% [markdown]
# The negative control for the claim above: a bf16 weight of 1, a constant gradient, lr
# $10^{-4}$. Plain AdamW on the bf16 weight itself rounds every update away (the nearest bf16
# below 1 is $1 - 2^{-8} \approx 0.9961$); the same optimizer behind fp32 masters moves the
# master by $10^{-4}$ per step, and after 100 steps the bf16 copy has moved too.

# %%
if __name__ == "__main__":
    from tinytron.optimizer.algorithms import AdamW

    lost = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    kept = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    no_master = AdamW([lost], lr=1e-4, weight_decay=0.0)
    with_master = MixedPrecisionOptimizer(AdamW([kept], lr=1e-4, weight_decay=0.0), clip_grad=0.0)
    for _ in range(100):
        lost.grad = torch.ones(4, dtype=torch.bfloat16)
        kept.grad = torch.ones(4, dtype=torch.bfloat16)
        no_master.step()
        with_master.step()
        with_master.zero_grad()
    print(f"after 100 steps: bf16 alone {lost[0].item():.5f} | fp32 master "
          f"{kept.main_param[0].item():.5f} -> bf16 {kept[0].item():.5f}")
    assert torch.equal(lost.data, torch.ones(4, dtype=torch.bfloat16))  # every update lost
    assert abs(kept.main_param[0].item() - (1 - 100 * 1e-4)) < 1e-5      # every update kept
    assert kept[0].item() < 1.0 and torch.equal(kept.data, kept.main_param.data.bfloat16())

# %% [markdown]
# ## Summary
#
# - Half-precision params get fp32 masters and fp32 state; grads arrive in fp32 `main_grad`.
# - The scaler's state machine (growth interval, backoff, hysteresis) decides the scale;
#   `found_inf` is agreed by all ranks, and an overflowing step changes nothing but the scale.
# - One global norm: sum of squares over shards, counting TP-replicated params on TP rank 0
#   and the tied-embedding copy once.
#
# ## How production does it
#
# - Megatron: `megatron/core/optimizer/optimizer.py` (`MixedPrecisionOptimizer:465`,
#   `prepare_grads:552`, `step:621`, `Float16OptimizerWithFloat16Params:654`,
#   `get_main_grads_for_grad_norm:140`), `megatron/core/optimizer/grad_scaler.py`,
#   `megatron/core/optimizer/clip_grads.py`.
# - torchtitan: FSDP2 `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` keeps fp32
#   sharded params and clips with `torch.nn.utils.clip_grad_norm_` over DTensors
#   (`torchtitan/distributed/utils.py`, `clip_grad_norm_`).
#
# ## Exercises
#
# 1. With `hysteresis=2`, write down the scale after the sequence inf, clean, inf, inf. Why is
#    the tracker not reset on backoff?
#
#    <details><summary>Answer</summary>
#
#    From scale $S$ with a long growth interval,
#    `DynamicGradScaler.update` gives $S$ (inf: hysteresis tracker 2 → 1), $S$ (clean: only the
#    growth tracker moves), $S/2$ (inf: tracker 0, backoff), $S/4$ (inf again). The tracker is
#    refilled only after `growth_interval` clean steps, so a run of overflows keeps halving
#    until the scale fits.
#
#    </details>
#
# 2. Why must `found_inf` be all-reduced before the scaler update rather than after the step?
#    What happens if one TP rank skips and the other does not?
#
#    <details><summary>Hint</summary>
#
#    `prepare_grads` decides whether to skip from the reduced
#    flag, and `update` changes the scale from it. Picture the two halves of one TP-split weight
#    after a step that only one half took, and the two scales the ranks would carry on with.
#
#    </details>
#
# 3. A row-parallel layer's bias is replicated across TP. Where would its gradient be counted
#    twice if `param_counts_in_norm` ignored the TP rank?
#
#    <details><summary>Hint</summary>
#
#    `get_grad_norm` sums squares on every rank of the
#    grad-stats group. A replicated bias has the same full gradient on each TP rank; see how
#    `param_counts_in_norm` uses the TP rank, and Megatron's
#    `get_main_grads_for_grad_norm`.
#
#    </details>
