# %% [markdown]
# # 02 · Optimizer: CPU offload of the optimizer step
#
# Adam's fp32 master + two moments are 12 bytes per parameter, more than the bf16 weights and
# fp32 grads together. The hybrid optimizer keeps a chosen fraction of them in host memory and
# runs that part of the step on the CPU, while the rest steps on the accelerator; on a GPU the
# grad downloads and param uploads run on their own CUDA streams so they overlap the compute.

# %%
from __future__ import annotations

from typing import Callable

import torch

from tinytron.optimizer._offload import SubOptimizerState, _Streams
from tinytron.optimizer.algorithms import AdamW

__all__ = ["HybridDeviceOptimizer", "split_by_fraction"]

# %% [markdown]
# ## The split and the step
#
# Megatron's `HybridDeviceOptimizer` (`megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py:14`,
# enabled by `--optimizer-cpu-offload --optimizer-offload-fraction F`, AdamW only):
#
# - walk the params in group order; while the elements offloaded so far are fewer than
#   $F \cdot$ (total elements), the next param gets a **pinned** fp32 host copy stepped by a CPU
#   optimizer; the rest stay on the device (`_get_sub_optimizer_param_groups`, `:251`);
# - with `overlap_cpu_optimizer_d2h_h2d` there is **one CPU optimizer per parameter**, so the
#   CPU can start on parameter 1 as soon as *its* gradient has arrived (`build_cpu_optimizer_list`,
#   `:227`);
# - `step()` (`:150`): copy the groups' `lr`/`weight_decay` down to the sub-optimizers; on the
#   D2H (device-to-host) stream copy every offloaded grad into a pinned host buffer and record
#   one event per CPU optimizer; step the device optimizer meanwhile; then for each CPU optimizer
#   wait for its event, step it, and copy its params back on the H2D (host-to-device) stream;
#   finally publish the sub-optimizers' state as this optimizer's state. (*Pinned* host memory
#   is page-locked, so the GPU's copy engine can read and write it directly, asynchronously.)
#
# Offload moves resident memory, it does not remove it: the offloaded fraction of the fp32
# master weights and Adam moments (12 bytes per parameter) becomes resident *host* memory, plus
# a pinned fp32 grad copy per offloaded parameter.
#
# Worked example: params of 600, 300, 100 elements, $F=0.5$: the budget is 500 elements; 0 < 500
# so the first param goes to the host (600 offloaded, more than the budget: the param that
# crosses it is still taken), then 600 ≥ 500 stops the walk and the other two stay. With
# $F=0.7$ (700) the second one is taken too (600 < 700), the third is not (900 ≥ 700).
#
# On a CPU-only machine the "device" is the CPU too: the structure is identical (host copies,
# one optimizer per param, the per-param wait), the streams and events are no-ops.
#
# ```mermaid
# sequenceDiagram
#   participant D as device (GPU) stream
#   participant S as D2H / H2D streams
#   participant C as CPU
#   S->>C: grad_i → pinned host buffer (event i)
#   D->>D: device optimizer step (rest of the params)
#   C->>C: wait event i, step param i (fp32 master + m, v on host)
#   C->>S: param_i → device (H2D, non-blocking)
# ```

# %%
def split_by_fraction(numels: list[int], fraction: float) -> list[bool]:
    """Which params are offloaded: in order, while the offloaded total is below fraction * total."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload fraction must lie in [0, 1], got {fraction}")
    budget, used, out = fraction * sum(numels), 0, []
    for n in numels:
        out.append(used < budget)   # the param that crosses the budget still goes to the host
        used += n if out[-1] else 0
    return out


# %% [markdown]
# ## The host copies
#
# `_build` walks the groups once: a param that `split_by_fraction` offloads gets an fp32 copy on
# the host (pinned when the model is on a GPU) with a zeroed host grad of the same size, and
# its own one-param group for a CPU optimizer; every other param stays in a device group. Each
# sub-group remembers its outer group (`_outer`), so that a scheduler changing the outer `lr`
# reaches every sub-optimizer at the next step. It runs at the first `step()`, not in
# `__init__`, because a wrapper built by [the factory](factory.py) may replace the params in
# the groups after construction (by its fp32 masters), and the copies must be of those.
#
# Worked example, the demo's MLP at $F = 0.5$: the first layer's weight is offloaded, so the
# host holds its fp32 master, its grad and (after the first step) its two Adam moments: 4 fp32
# tensors of that shape, 16 bytes per element, and none of them on the device.

# %%
class HostCopies:
    """Mixin for HybridDeviceOptimizer: the host fp32 copies and the sub-optimizers."""

    def _build(self) -> None:
        """Create the host copies and the sub-optimizers from the current groups."""
        params = [p for g in self.param_groups for p in g["params"]]
        offload = dict(zip(map(id, params), split_by_fraction([p.numel() for p in params],
                                                              self.offload_fraction)))
        pin = params and params[0].device.type == "cuda"
        self.host_of, self.cpu_optimizers, dev_groups = {}, [], []
        cpu_groups = []
        for gi, g in enumerate(self.param_groups):
            hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            dev = [p for p in g["params"] if not offload[id(p)]]
            dev_groups.append(dict(hyper, params=dev, _outer=gi))
            for p in g["params"]:
                if offload[id(p)]:
                    host = p.detach().to("cpu", torch.float32, copy=True)
                    host = torch.nn.Parameter(host.pin_memory() if pin else host)
                    host.grad = torch.zeros_like(host).pin_memory() if pin else torch.zeros_like(host)
                    self.host_of[p] = host
                    cpu_groups.append(dict(hyper, params=[host], _outer=gi))
        chunks = [[g] for g in cpu_groups] if self.overlap_d2h_h2d else [cpu_groups]
        self.cpu_optimizers = [self.optimizer_cls(c) for c in chunks if c]
        self._outer_of = {id(h): p for p, h in self.host_of.items()}
        self._owner_of = {id(h): o for o in self.cpu_optimizers for g in o.param_groups
                          for h in g["params"]}
        dev_groups = [g for g in dev_groups if g["params"]]
        self.device_optimizer = self.optimizer_cls(dev_groups) if dev_groups else None
        self.streams = _Streams(params[0].device if params else torch.device("cpu"))
        self._built = True


# %% [markdown]
# ## The step
#
# The step follows the sequence diagram: the offloaded grads go down to their pinned host
# copies, the device optimizer steps meanwhile, each CPU optimizer steps as soon as *its*
# grad has landed, and its param goes back up. On a CPU every stream call is a no-op and the
# events are `None`, so the same code runs in order. The side streams, and the bookkeeping that
# pushes each outer group's hyperparameters down to its sub-groups and publishes the
# sub-optimizers' state as this optimizer's `state` (so that a checkpoint sees one optimizer),
# are in the chapter's private module `tinytron.optimizer._offload`
# (`chapters/02_optimizer/_offload.py`).
#
# **Ordering the side streams.** A side stream sees nothing of what the compute stream has
# queued unless told to wait for it, so the step first makes *both* wait
# (`after_compute("d2h", "h2d")`). D2H reads the grads that the backward wrote there. H2D
# overwrites parameters that earlier work may still be reading: chapter 03's staged
# checkpoint copies the parameters to the host on a stream of its own, and its wait before the
# step ([the staged copy](../03_checkpoint/staged_copy.py)) orders only the compute
# stream, so an upload that ignored the compute stream could land in a checkpoint that should
# hold the pre-step values. Megatron's H2D stream waits the same way
# (`megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py:120`).
#
# <details><summary>Megatron detail: why the wait was missing unnoticed, and its test</summary>
#
# Without that wait the
# uploads were still safe, but only by accident: each one is issued after the host waited for
# its grad's D2H event, which queues behind the compute stream; an upload not preceded by such
# a host wait would lose the order. `tests/test_checkpoint_staged.py` checks the rule on a CPU
# and, on a GPU, that a staged save beside the offloaded step writes the synchronous save's
# bytes.
#
# </details>

# %%
class HybridDeviceOptimizer(HostCopies, SubOptimizerState, torch.optim.Optimizer):
    """Step a prefix of the params (fraction of elements) on the host, the rest on their device."""

    def __init__(self, params, offload_fraction: float = 0.5, optimizer_cls: Callable = AdamW,
                 overlap_d2h_h2d: bool = True, **defaults):
        split_by_fraction([1], offload_fraction)   # validates the fraction
        self.offload_fraction, self.optimizer_cls = offload_fraction, optimizer_cls
        self.overlap_d2h_h2d = overlap_d2h_h2d
        super().__init__(params, defaults)
        self._built = False   # built lazily: a wrapper may swap the params first

    @torch.no_grad()
    def step(self, closure=None):
        """D2H grads, device step, per-param CPU steps as grads land, H2D params, publish state."""
        if not self._built:
            self._build()
        self._sync_hyperparams_and_state()
        events = {}
        self.streams.after_compute("d2h", "h2d")   # both: see "Ordering the side streams"
        with self.streams.on(self.streams.d2h):
            for p, host in self.host_of.items():
                if p.grad is not None:
                    host.grad.copy_(p.grad, non_blocking=True)
                    events[p] = self.streams.event(self.streams.d2h)
        if self.device_optimizer is not None:
            self.device_optimizer.step()
        for p, host in self.host_of.items():
            if p.grad is None:
                continue
            if events[p] is not None:
                events[p].synchronize()
            self._owner(host).step()
            with self.streams.on(self.streams.h2d):
                p.copy_(host, non_blocking=True)
        self.streams.join(self.streams.h2d)
        self._publish_state()


# %% [markdown]
# ## Demo: offloaded or not, the same training
#
# A small MLP trained 20 steps by plain AdamW and by the hybrid optimizer with offload fractions
# 0, 0.5 and 1. The params agree with the plain run to the bit, and with $F=0.5$ the first layer's
# Adam state really lives in the host copies.

# %%
if __name__ == "__main__":
    from tinytron.optimizer._workers import batch, small_mlp
    import torch.nn.functional as F

    def train(make_opt):
        model = small_mlp()
        opt = make_opt(model)
        for step in range(20):
            x, y = batch(step, 16)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    ref, _ = train(lambda m: AdamW(m.parameters(), lr=1e-2))
    numels = [p.numel() for p in ref.parameters()]
    for frac in (0.0, 0.5, 1.0):
        model, opt = train(lambda m: HybridDeviceOptimizer(m.parameters(), frac, lr=1e-2))
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        print(f"fraction {frac}: offloaded {sum(split_by_fraction(numels, frac))}/{len(numels)} "
              f"params, {len(opt.cpu_optimizers)} CPU optimizers, max |hybrid - AdamW| = {diff:.1e}")
        assert diff == 0.0
        assert opt.streams.after_compute_names == ("d2h", "h2d")   # both copy streams ordered
        if frac == 0.5:
            first = next(model.parameters())
            assert opt.state[first]["exp_avg"].data_ptr() == \
                opt._owner(opt.host_of[first]).state[opt.host_of[first]]["exp_avg"].data_ptr()
    assert split_by_fraction([600, 300, 100], 0.5) == [True, False, False]
    assert split_by_fraction([600, 300, 100], 0.7) == [True, True, False]

# %% [markdown]
# ## Summary
#
# - A prefix of the params (by element budget) is stepped on the host with fp32 state in
#   (pinned) host memory; the rest on the device; hyperparameters flow down, state flows up.
# - One CPU optimizer per param lets each host step start as soon as its own grad has arrived;
#   the copies run on side streams on a GPU and inline on a CPU.
#
# ## How production does it
#
# - Megatron: `megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py` (`step:150`,
#   `build_cpu_optimizer_list:227`, `_get_sub_optimizer_param_groups:251`), used as the inner
#   optimizer of the DistributedOptimizer (`megatron/core/optimizer/__init__.py:505-544`).
# - DeepSpeed ZeRO-Offload (`deepspeed/ops/adam/cpu_adam.py`): a vectorised C++ Adam on the host
#   with the same "grads down, params up" traffic.
#
# ## Exercises
#
# 1. The 7B example at DP 64 with $F=1$, inside the distributed optimizer: each GPU offloads
#    only its own 1/64 shard, and what crosses PCIe is that shard's fp32 grads down and its
#    fp32 master params up (the hybrid optimizer is the *inner* optimizer, over fp32 pieces).
#    How many GB move per GPU per step? At 25 GB/s, how long is that compared with a 1 s step,
#    and how does the answer change at DP 8?
#
#    <details><summary>Answer</summary>
#
#    A GPU of the first stage holds $n$ = 2,007,629,824
#    parameters; its shard is $n/64$ = 31,369,216. Grads down and masters up are $4 + 4 = 8$ bytes
#    each: 0.25 GB per step, 10 ms at 25 GB/s, 1% of a 1 s step. At DP 8 the shard is 8 times
#    larger: 2.0 GB and 80 ms, 8% of the step.
#
#    </details>
#
# 2. Why does a *prefix* split make sense when grads arrive in reverse layer order?
#
#    <details><summary>Hint</summary>
#
#    `split_by_fraction` takes params from the front of the
#    groups, the first layers, whose grads backward finishes last. Follow `step()`: which copies
#    and which optimizer run while the CPU waits on its per-param events, and what the device
#    can do with the params whose grads were ready early.
#
#    </details>
