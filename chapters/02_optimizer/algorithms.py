# %% [markdown]
# # 02 · Optimizer: the update rules
#
# SGD with momentum, Adam, AdamW and Lion written out as multi-tensor loops, Megatron's
# parameter groups (no weight decay on biases and 1-D params, lr/wd multipliers), and a
# `ChainedOptimizer` that lets two optimizers share one training step. Each rule is checked
# step for step against `torch.optim` or a hand computation.

# %%
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from tinytron.optimizer._chained import ChainSurface
from tinytron.optimizer._checks import check_betas, check_lr_wd

__all__ = [
    "SGD", "Adam", "AdamW", "Lion", "ChainedOptimizer",
    "build_param_groups", "no_weight_decay", "group_tensors_by_device_and_dtype",
]

# %% [markdown]
# ## Why write them again?
#
# `torch.optim` already has all of these. We write them because the rest of the chapter needs to
# *see inside*: the mixed-precision wrapper swaps the parameters an optimizer steps for fp32
# master copies, the DistributedOptimizer hands it 1-D slices of a flat buffer, and the offload
# optimizer moves its state to the host. An optimizer is just "a list of tensors, a list of
# state tensors of the same shapes, and a few elementwise operations", and nothing more is
# assumed below.
#
# With $g$ the (unscaled, clipped) gradient, $\eta$ the learning rate, $\lambda$ the weight decay
# and $t$ the step counter starting at 1:
#
# | rule | state | update |
# |---|---|---|
# | SGD (momentum $\mu$) | $b$ | $g' = g + \lambda\theta$; $b \leftarrow \mu b + g'$ ($b_1 = g'$); $\theta \leftarrow \theta - \eta\,(g' + \mu b$ if Nesterov else $b)$ |
# | Adam (L2) | $m, v$ | $g' = g + \lambda\theta$, then the Adam update with $g'$ |
# | AdamW | $m, v$ | $\theta \leftarrow \theta(1-\eta\lambda)$; $m \leftarrow \beta_1 m + (1-\beta_1)g$; $v \leftarrow \beta_2 v + (1-\beta_2)g^2$; $\theta \leftarrow \theta - \frac{\eta}{1-\beta_1^t}\,\frac{m}{\sqrt{v}/\sqrt{1-\beta_2^t} + \epsilon}$ |
# | Lion | $m$ | $\theta \leftarrow \theta(1-\eta\lambda)$; $u = \mathrm{sign}(\beta_1 m + (1-\beta_1) g)$; $m \leftarrow \beta_2 m + (1-\beta_2) g$; $\theta \leftarrow \theta - \eta u$ |
#
# Worked example, AdamW with $\eta=0.1$, $\lambda=0$, $\beta=(0.9, 0.999)$, $\epsilon=10^{-8}$, one
# scalar $\theta=1$, $g=2$: $m = 0.2$, $v = 0.004$, $\hat m = 0.2/0.1 = 2$, $\hat v = 0.004/0.001 = 4$,
# so $\theta \leftarrow 1 - 0.1 \cdot 2/(2 + 10^{-8}) \approx 0.9$. The first Adam step moves every
# coordinate by about $\eta$, whatever the size of its gradient; that is the point of the
# second moment.
#
# Megatron takes these from Transformer Engine's `FusedAdam` / `FusedSGD` and falls back to
# `torch.optim.AdamW` / `SGD` (`megatron/core/optimizer/__init__.py:13-35, 545-625`); its
# defaults are `adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.01`,
# `sgd_momentum=0.9` (`megatron/core/optimizer/optimizer_config.py:162, 237-256`). Lion comes
# from the `emerging_optimizers` library and Megatron's own Lion defaults are
# `lion_beta1=0.95, lion_beta2=0.98` (`optimizer_config.py:293-298`).
#
# **Multi-tensor.** A 7B model has ~300 parameter tensors. Launching eight small kernels per
# tensor is 2400 launches per step; the `torch._foreach_*` operations take *lists* of tensors
# and do one launch per list (per device and dtype), which is what TE's `FusedAdam` does with
# its `multi_tensor_apply`. The loops below are therefore written over lists.
#
# ```mermaid
# flowchart LR
#   G[param_groups] --> C[collect params with grads<br/>+ their state lists]
#   C --> D[group by device, dtype]
#   D --> F["_foreach_ ops:<br/>decay, lerp m, addcmul v, addcdiv θ"]
# ```

# %%
def group_tensors_by_device_and_dtype(*lists: list[torch.Tensor]) -> dict:
    """Split parallel lists of tensors into buckets keyed by (device, dtype) of the first list."""
    buckets: dict = {}
    for row in zip(*lists):
        key = (row[0].device, row[0].dtype)
        bucket = buckets.setdefault(key, [[] for _ in lists])
        for column, t in zip(bucket, row):
            column.append(t)
    return buckets


def _groups_with_grads(optimizer: torch.optim.Optimizer):
    """Yield (group, its params that received a gradient this step), skipping groups with none."""
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            yield group, params


# %% [markdown]
# ## SGD with momentum (and Nesterov)
#
# PyTorch's semantics, which Megatron inherits: the weight decay is an L2 term added to the
# gradient, and the first momentum buffer *is* the gradient (not $(1-\mu)g$). Worked example,
# $\mu = 0.9$, gradients $g_1 = 1$ then $g_2 = 1$: the buffer is $1$, then $0.9 + 1 = 1.9$, so
# the second step is 1.9 times the first; with Nesterov the step uses $g + \mu b$, 1.9 and
# then 2.71. Every optimizer of this page refuses a negative learning rate or weight decay and
# betas outside $[0, 1)$ with a one-line error; those checks are in the chapter's private
# module `tinytron.optimizer._checks`.

# %%
def _sgd_momentum(state: dict, params, grads, group) -> list[torch.Tensor]:
    """Update the momentum buffers held in `state`; return the direction to step along."""
    mu = group["momentum"]
    bufs = []
    for p, g in zip(params, grads):
        buf_state = state[p]
        if "momentum_buffer" not in buf_state:
            buf_state["momentum_buffer"] = g.detach().clone()
        else:
            buf_state["momentum_buffer"].mul_(mu).add_(g)
        bufs.append(buf_state["momentum_buffer"])
    if group["nesterov"]:
        return torch._foreach_add(grads, bufs, alpha=mu)
    return bufs


# %% [markdown]
# The class checks its arguments and, each step, adds the L2 term, asks the helper above for the
# momentum direction and takes one `_foreach_add_` step along it.

# %%
class SGD(torch.optim.Optimizer):
    """SGD with L2 weight decay, momentum and optional Nesterov, equal to torch.optim.SGD."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, weight_decay: float = 0.0,
                 nesterov: bool = False):
        check_lr_wd(lr, weight_decay)
        if momentum < 0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        if nesterov and momentum == 0:
            raise ValueError(f"nesterov needs momentum > 0, got momentum={momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      nesterov=nesterov))

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One SGD step over every group."""
        loss = closure() if closure is not None else None
        for group, params in _groups_with_grads(self):
            grads = [p.grad for p in params]
            if group["weight_decay"] != 0:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            if group["momentum"] != 0:
                grads = _sgd_momentum(self.state, params, grads, group)
            torch._foreach_add_(params, grads, alpha=-group["lr"])
        return loss


# %% [markdown]
# ## Adam and AdamW
#
# One class does both: `decoupled_weight_decay=True` is AdamW (Megatron's default,
# `decoupled_weight_decay=True` → `adam_w_mode=True`), `False` adds $\lambda\theta$ to the
# gradient (classic L2 Adam). The operations are those of `torch.optim.AdamW(foreach=True)` in the
# same order, so the two agree bit for bit in fp32. The step counter is a Python int per
# parameter (no host sync needed to read it); the state keys are Megatron's
# `exp_avg`, `exp_avg_sq`, `step`.

# %%
class Adam(torch.optim.Optimizer):
    """Adam with bias correction; decoupled (AdamW) or L2 weight decay; multi-tensor."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled_weight_decay: bool = False):
        check_lr_wd(lr, weight_decay)
        check_betas(betas)
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay,
                                      decoupled_weight_decay=decoupled_weight_decay))

    def init_state(self, p: torch.Tensor) -> dict:
        """Create (or return) the zero state of one param, as a checkpoint loader needs it."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One Adam(W) step over every group."""
        loss = closure() if closure is not None else None
        for group, params in _groups_with_grads(self):
            states = [self.init_state(p) for p in params]
            for s in states:
                s["step"] += 1
            lists = (params, [p.grad for p in params], [s["exp_avg"] for s in states],
                     [s["exp_avg_sq"] for s in states], [s["step"] for s in states])
            for bucket in group_tensors_by_device_and_dtype(*lists).values():
                _adam_foreach(*bucket, group)
        return loss


# %% [markdown]
# The arithmetic, on lists of tensors at once (one kernel per operation for the whole list,
# not one per parameter). With $t$ the step, $\beta_1, \beta_2$ the betas, $g$ the gradient:
# $m \leftarrow \beta_1 m + (1-\beta_1) g$, $v \leftarrow \beta_2 v + (1-\beta_2) g^2$,
# $\theta \leftarrow \theta - \eta\,\frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}$,
# after the decay $\theta \leftarrow (1 - \eta\lambda)\theta$ (AdamW) or $g \leftarrow g + \lambda\theta$ (Adam).

# %%
def _adam_foreach(params, grads, exp_avgs, exp_avg_sqs, steps, group) -> None:
    """The Adam(W) arithmetic on lists of same-device, same-dtype tensors."""
    beta1, beta2 = group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    if wd != 0:
        if group["decoupled_weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * wd)
        else:
            grads = torch._foreach_add(grads, params, alpha=wd)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    # Bias corrections as Python floats: 1 - 0.9**1 = 0.1 makes the first step ~lr in size.
    step_sizes = [-lr / (1 - beta1 ** t) for t in steps]
    bc2_sqrt = [(1 - beta2 ** t) ** 0.5 for t in steps]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)


class AdamW(Adam):
    """Adam with decoupled weight decay (Megatron's default optimizer)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=True)


# %% [markdown]
# ## Lion
#
# Lion keeps one buffer and steps by the *sign* of an interpolation, so every coordinate moves
# by exactly $\eta$ (plus decay). The order matters and is easy to get wrong: decay first, then
# the sign of $\beta_1 m + (1-\beta_1) g$ with the **old** $m$, then the EMA with $\beta_2$.
# Worked example ($\eta=0.1$, $\lambda=0$, $\beta=(0.9, 0.99)$, $m=1$, $g=-20$): the
# interpolation is $0.9 - 2 = -1.1$, so $\theta$ *grows* by 0.1, and $m \leftarrow 0.99 - 0.2 = 0.79$.
#
# <details><summary>Megatron detail: Lion's decay rounds differently, in the last bit</summary>
#
# Megatron does not write Lion itself: it builds `emerging_optimizers`' Lion
# (`megatron/core/optimizer/__init__.py:599-609`), whose decoupled decay *adds*
# $-\eta\lambda\,\theta$ to $\theta$ where the loop below *multiplies* $\theta$ by
# $(1-\eta\lambda)$. Same rule, different rounding: the momentum is bitwise equal and no sign
# flips, but $\theta$ drifts by a unit in the last place. Measured over three steps on 4,096
# fp32 values ($\eta = 0.01$, $\lambda = 0.1$): at most $4.8 \cdot 10^{-7}$, one ulp at
# $|\theta| \approx 4$. `tests/test_optimizer.py` writes that arithmetic out and allows 3 ulp of
# the larger of $|\theta|$ before and after (a value can pass near zero on the way).
#
# </details>

# %%
class Lion(torch.optim.Optimizer):
    """Lion: decoupled decay, sign of the beta1 interpolation, beta2 EMA of the gradient."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.95, 0.98),
                 weight_decay: float = 0.01):
        check_lr_wd(lr, weight_decay)
        check_betas(betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One Lion step over every group."""
        loss = closure() if closure is not None else None
        for group, params in _groups_with_grads(self):
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            grads = [p.grad for p in params]
            ms = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
            if wd != 0:
                torch._foreach_mul_(params, 1 - lr * wd)
            update = torch._foreach_lerp(ms, grads, 1 - beta1)
            torch._foreach_sign_(update)
            torch._foreach_lerp_(ms, grads, 1 - beta2)
            torch._foreach_add_(params, update, alpha=-lr)
        return loss


# %% [markdown]
# ## Two optimizers, one step: `ChainedOptimizer`
#
# Muon only handles 2-D hidden matrices; embeddings, the output layer and norms go to AdamW.
# Megatron builds one optimizer per kind and chains them (`ChainedOptimizer`,
# `megatron/core/optimizer/optimizer.py:1104`): its `param_groups` is the concatenation of the
# children's groups, so the scheduler sets the learning rate of all of them in one loop.
# Because the groups are the children's own dict objects, there is nothing to synchronize:
# `chained.param_groups[3]["lr"] = 1e-4` *is* a write into the second child's group, when the
# first has three. What remains besides `step` (the merged per-param `state`, `zero_grad`, one
# state dict per child) is forwarded to the children by a small mixin in the chapter's
# private module `tinytron.optimizer._chained`. The chain may be empty: a rank of the
# [layer-wise optimizer](layer_wise.py) can own no parameter at all.

# %%
class ChainedOptimizer(ChainSurface):
    """Several optimizers stepped together; param_groups is the concatenation of theirs."""

    def __init__(self, optimizers: list):
        # May be empty: a DP rank of the layer-wise optimizer can own no parameter at all.
        self.chained_optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        """All children's groups (the same dict objects: setting lr here sets it there)."""
        return [g for opt in self.chained_optimizers for g in opt.param_groups]

    def step(self, closure: Callable | None = None):
        """Step every child in order."""
        loss = closure() if closure is not None else None
        for opt in self.chained_optimizers:
            opt.step()
        return loss


# %% [markdown]
# ## Parameter groups
#
# Megatron gives every parameter a set of overrides and puts parameters with identical overrides
# into one group (`_get_param_groups`, `megatron/core/optimizer/__init__.py:300`). The standard
# rules (`get_standard_config_overrides`, `:93`): **no weight decay** (`wd_mult=0`) on 1-D
# params (norm weights) and on names ending in `.bias` (unless `apply_wd_to_qk_layernorm` and
# the param is a q/k layernorm); the `decoupled_lr` / `decoupled_min_lr` pair for params
# flagged `is_embedding_or_output_parameter`. Every group carries `wd_mult`, `lr_mult`,
# `max_lr`, `min_lr`, `is_decoupled_lr`; the scheduler reads `max_lr`/`min_lr` from the group
# and writes `lr` and `weight_decay = wd · wd_mult`.
#
# Example, a `Linear(4, 3)` + `LayerNorm(3)`: `weight [3,4]` decays; `bias [3]`,
# `norm.weight [3]`, `norm.bias [3]` do not — two groups.

# %%
def no_weight_decay(name: str, param: torch.Tensor, apply_wd_to_qk_layernorm: bool = False) -> bool:
    """Megatron's rule: biases and 1-D params get no weight decay (optionally except q/k norms)."""
    skip = name.endswith(".bias") or param.dim() == 1
    if skip and apply_wd_to_qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name):
        return False
    return skip


def build_param_groups(named_params: Iterable[tuple[str, torch.Tensor]], lr: float,
                       weight_decay: float = 0.01, min_lr: float = 0.0,
                       decoupled_lr: float | None = None, decoupled_min_lr: float | None = None,
                       overrides: list[tuple[Callable, dict]] | None = None,
                       apply_wd_to_qk_layernorm: bool = False) -> list[dict]:
    """Megatron-style param groups: params with identical overrides share one group."""
    groups: dict = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        ov = {"wd_mult": 1.0, "lr_mult": 1.0, "max_lr": lr, "min_lr": min_lr,
              "is_decoupled_lr": False}
        if no_weight_decay(name, p, apply_wd_to_qk_layernorm):
            ov["wd_mult"] = 0.0
        if decoupled_lr is not None and getattr(p, "is_embedding_or_output_parameter", False):
            ov.update(max_lr=decoupled_lr, is_decoupled_lr=True,
                      min_lr=min_lr if decoupled_min_lr is None else decoupled_min_lr)
        for predicate, extra in overrides or []:
            if predicate(name, p):
                ov.update(extra)
        key = tuple(sorted(ov.items()))
        group = groups.setdefault(key, dict(ov, params=[], param_names=[]))
        group["params"].append(p)
        group["param_names"].append(name)
    out = list(groups.values())
    for g in out:
        g["lr"] = g["max_lr"] * g["lr_mult"]
        g["weight_decay"] = weight_decay * g["wd_mult"]
    return out


# %% [markdown]
# ## Demo: each rule against its reference
#
# Three random tensors (one a bias), five steps with fresh random gradients; our optimizer and
# `torch.optim`'s must hold identical parameters afterwards. (The harness that runs two
# optimizers on the same gradients is `tinytron.optimizer._compare`.) "Identical" means bit
# for bit: the foreach loops perform the same floating-point operations in the same order as
# `torch.optim`'s foreach implementations, so any difference, even $10^{-9}$, would mean a
# different update rule, not rounding. Lion has no `torch.optim`
# counterpart, so it is checked against the hand computation from the table above.

# %%
def _lion_reference(theta, grads, lr, betas, wd) -> torch.Tensor:
    """Lion written scalar-style from the update rule, for the check."""
    m = torch.zeros_like(theta)
    for g in grads:
        theta = theta * (1 - lr * wd)
        u = torch.sign(betas[0] * m + (1 - betas[0]) * g)
        m = betas[1] * m + (1 - betas[1]) * g
        theta = theta - lr * u
    return theta


# %%
if __name__ == "__main__":
    from tinytron.optimizer._compare import _run_pair

    kw = dict(lr=0.01, weight_decay=0.1)
    cases = {
        "SGD momentum": (lambda p: SGD(p, momentum=0.9, **kw),
                         lambda p: torch.optim.SGD(p, momentum=0.9, **kw)),
        "SGD nesterov": (lambda p: SGD(p, momentum=0.9, nesterov=True, **kw),
                         lambda p: torch.optim.SGD(p, momentum=0.9, nesterov=True, **kw)),
        "Adam (L2)": (lambda p: Adam(p, **kw), lambda p: torch.optim.Adam(p, foreach=True, **kw)),
        "AdamW": (lambda p: AdamW(p, **kw), lambda p: torch.optim.AdamW(p, foreach=True, **kw)),
    }
    for name, (ours, ref) in cases.items():
        diff = _run_pair(ours, ref)
        print(f"{name:13s} max |ours - torch.optim| after 5 steps = {diff:.1e}")
        assert diff == 0.0, name

    gen = torch.Generator().manual_seed(1)
    theta0 = torch.randn(6, generator=gen)
    grads = [torch.randn(6, generator=gen) for _ in range(4)]
    p = theta0.clone()
    lion = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    for g in grads:
        p.grad = g
        lion.step()
    ref = _lion_reference(theta0, grads, 0.1, (0.9, 0.99), 0.1)
    print("Lion          max |ours - hand| =", f"{(p - ref).abs().max().item():.1e}")
    assert torch.allclose(p, ref, atol=1e-6)

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    groups = build_param_groups(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    for g in groups:
        print(f"wd_mult={g['wd_mult']}  weight_decay={g['weight_decay']}  {g['param_names']}")
    assert [g["param_names"] for g in groups] == [["0.weight"], ["0.bias", "1.weight", "1.bias"]]

# %% [markdown]
# ## Summary
#
# - An optimizer is a list of tensors, per-tensor state of the same shape, and elementwise
#   updates; writing them over lists (`torch._foreach_*`) keeps the launch count per step
#   independent of the number of tensors.
# - AdamW here equals `torch.optim.AdamW(foreach=True)` bit for bit; SGD and L2 Adam equal
#   theirs; Lion follows the decay → sign → EMA order.
# - Parameter groups carry Megatron's `wd_mult`/`lr_mult`/`max_lr`/`min_lr`, so the scheduler
#   page can drive them.
#
# ## How production does it
#
# - Megatron: `megatron/core/optimizer/__init__.py` (`_get_param_groups:300`,
#   `get_standard_config_overrides:93`, optimizer choice `:545-625`), TE `FusedAdam`
#   (`transformer_engine/pytorch/optimizers/fused_adam.py`), apex `multi_tensor_apply`.
# - torchtitan: `torchtitan/components/optimizer.py` builds `torch.optim.AdamW(fused=True)` per
#   model part and wraps them in an `OptimizersContainer`.
#
# ## Exercises
#
# 1. Count the `torch._foreach_*` calls per AdamW step for a model with 300 params on one
#    device and one dtype. How many kernel launches would a per-tensor loop issue?
#
#    <details><summary>Answer</summary>
#
#    With $\lambda \ne 0$ (AdamW's default 0.01),
#    `_adam_foreach` makes 8 calls: `mul_` (decay), `lerp_`, `mul_`, `addcmul_`, `sqrt`, `div_`,
#    `add_`, `addcdiv_`. One bucket, so 8 launches per step. A per-tensor loop issues the same 8
#    per tensor: $8 \cdot 300 = 2400$ launches. With $\lambda = 0$ it is 7 and 2100.
#
#    </details>
#
# 2. Show that with $\lambda=0$ Adam and AdamW coincide, and that with $\lambda>0$ AdamW's decay
#    does not pass through $\sqrt{v}$. Which parameters does that hurt in L2 Adam?
#
#    <details><summary>Hint</summary>
#
#    In `_adam_foreach` the only branch on
#    `decoupled_weight_decay` sits under `if wd != 0`. In L2 Adam the term $\lambda\theta$ enters
#    $m$ and $v$, so it is divided by $\sqrt{\hat v}$: think of parameters whose gradients are
#    large (large $v$) and what happens to their decay.
#
#    </details>
#
# 3. Why does a Lion step move every coordinate by exactly $\eta$ when $\lambda=0$? What does
#    that suggest about Lion's learning rate compared to AdamW's?
#
#    <details><summary>Hint</summary>
#
#    Look at `torch._foreach_sign_(update)` in `Lion.step`: each
#    entry of the update is $-1$, $0$ or $+1$ before it is scaled by $\eta$. Compare with AdamW,
#    whose later steps are $\eta\,\hat m/\sqrt{\hat v}$, usually well below $\eta$ in size.
#
#    </details>
