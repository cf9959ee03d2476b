# %% [markdown]
# # 02 · Optimizer: from a config to the optimizer and its scheduler
#
# The trainer does not pick classes by hand: a config with Megatron's option names and defaults
# decides the update rule, the loss scaler, the wrapper (plain, distributed, layer-wise), CPU
# offload, and the scheduler's lengths in samples. This page is that decision, in one function
# each.

# %%
from __future__ import annotations

import torch

from tinytron.kernels import use_triton
from tinytron.optimizer._config import OptimizerConfig, SchedulerConfig, _fused_adamw_applies
from tinytron.optimizer.algorithms import SGD, Adam, Lion, build_param_groups
from tinytron.optimizer.distributed import DistributedOptimizer
from tinytron.optimizer.layer_wise import LayerWiseDistributedOptimizer
from tinytron.optimizer.mixed_precision import (ConstantGradScaler, DynamicGradScaler,
                                                MixedPrecisionOptimizer)
from tinytron.optimizer.muon import build_muon_adamw
from tinytron.optimizer.offload import HybridDeviceOptimizer
from tinytron.optimizer.scheduler import OptimizerParamScheduler

__all__ = ["OptimizerConfig", "SchedulerConfig", "get_megatron_optimizer", "build_grad_scaler",
           "get_optimizer_param_scheduler"]

# %% [markdown]
# ## The decisions
#
# `get_megatron_optimizer` (`megatron/core/optimizer/__init__.py:975`) and the functions it
# calls make these choices, in this order:
#
# ```mermaid
# flowchart TD
#   C["OptimizerConfig"] --> G["param groups: wd_mult 0 for biases and 1-D,<br/>decoupled_lr for embedding and output"]
#   G --> R{"optimizer?"}
#   R -->|adam| O{"optimizer_cpu_offload?"}
#   O -->|yes| HY["HybridDeviceOptimizer<br/>AdamW, a fraction on the host"]
#   O -->|no| AD["Adam, or AdamW when<br/>decoupled_weight_decay"]
#   R -->|sgd| SG["SGD with momentum"]
#   R -->|lion| LI["Lion"]
#   R -->|muon| MU["Muon for matrices,<br/>AdamW for the rest"]
#   HY --> S{"loss_scale set?"}
#   AD --> S
#   SG --> S
#   LI --> S
#   MU --> S
#   S -->|yes| CS["ConstantGradScaler"]
#   S -->|no| F{"fp16?"}
#   F -->|yes| DS["DynamicGradScaler"]
#   F -->|"no (bf16, fp32)"| NS["no scaler"]
#   CS --> W{"use_distributed_optimizer?"}
#   DS --> W
#   NS --> W
#   W -->|"yes, muon"| LW["LayerWiseDistributedOptimizer"]
#   W -->|"yes, the rest"| DO["DistributedOptimizer (ZeRO-1)"]
#   W -->|no| MP["MixedPrecisionOptimizer"]
# ```
#
# | question | answer | Megatron |
# |---|---|---|
# | which params share a group? | identical overrides: `wd_mult=0` for biases / 1-D, `decoupled_lr` for embedding/output | `_get_param_groups:300` |
# | which update rule? | `adam` (AdamW when `decoupled_weight_decay`), `sgd`, `lion`, `muon` (+ AdamW for non-matrices) | `:545-625`, `:725` |
# | CPU offload? | `optimizer_cpu_offload` → hybrid optimizer (AdamW only) with `optimizer_offload_fraction` | `:505-544` |
# | loss scaler? | `loss_scale` set → constant; else `fp16` → dynamic; else none (bf16, fp32) | `:637-660` |
# | wrapper? | `use_distributed_optimizer` → DistributedOptimizer (layer-wise for Muon), else the mixed-precision wrapper | `:662-690` |
#
# ## The config, field by field
#
# `OptimizerConfig` carries Megatron's option names and the defaults a Megatron run gets. The
# defaults are those of Megatron's command line (`megatron/training/arguments.py`); two differ
# from the `OptimizerConfig` class of megatron/core, which the command line always overrides:
# `min_lr` is 0.0 (`arguments.py:2654`; the class has None) and `optimizer_offload_fraction` is
# 1.0 (`arguments.py:2585`; the class has 0.0). Lines are in
# `megatron/core/optimizer/optimizer_config.py`.
#
# | fields | defaults | what they decide | Megatron |
# |---|---|---|---|
# | `optimizer` | `"adam"` | the update rule: `adam`, `sgd`, `lion` or `muon` | `optimizer_config.py:209` |
# | `lr`, `min_lr` | required, 0.0 | the peak learning rate and the floor of the decay | `optimizer_config.py:146`, `:151` |
# | `decoupled_lr`, `decoupled_min_lr` | None, None | a separate peak and floor for the embedding and output params | `optimizer_config.py:154`, `:157` |
# | `weight_decay`, `apply_wd_to_qk_layernorm` | 0.01, False | decay (0 for biases and 1-D params, unless q/k layernorm is opted in) | `optimizer_config.py:162`, `:165` |
# | `fp16`, `bf16` | False, False | the params' precision; fp16 brings dynamic loss scaling | `optimizer_config.py:174`, `:177` |
# | `loss_scale` | None | a constant loss scale, which overrides the dynamic one | `optimizer_config.py:216` |
# | `initial_loss_scale`, `min_loss_scale`, `loss_scale_window`, `hysteresis` | $2^{32}$, 1.0, 1000, 2 | the dynamic scaler: start, floor, clean steps before it grows, overflows tolerated before it backs off | `optimizer_config.py:221-230` |
# | `adam_beta1`, `adam_beta2`, `adam_eps`, `decoupled_weight_decay` | 0.9, 0.999, 1e-8, True | Adam, and AdamW when decoupled | `optimizer_config.py:237-250` |
# | `sgd_momentum` | 0.9 | SGD | `optimizer_config.py:256` |
# | `lion_beta1`, `lion_beta2` | 0.95, 0.98 | Lion's sign interpolation and momentum | `optimizer_config.py:293`, `:296` |
# | `muon_momentum`, `muon_nesterov`, `muon_split_qkv` | 0.95, False, True | Muon's momentum, and whether Q, K, V are orthogonalized separately | `optimizer_config.py:260-266` |
# | `muon_scale_mode`, `muon_fp32_matmul_prec`, `muon_coefficient_type`, `muon_num_ns_steps`, `muon_tp_mode`, `muon_extra_scale_factor` | `"spectral"`, `"medium"`, `"quintic"`, 5, `"blockwise"`, 1.0 | the Newton–Schulz orthogonalization ([the Muon page](muon.py)) | `optimizer_config.py:269-285` |
# | `use_distributed_optimizer` | False | shard the master weights and state over DP ([the DistributedOptimizer](distributed.py); layer-wise for Muon) | `optimizer_config.py:321` |
# | `optimizer_cpu_offload`, `optimizer_offload_fraction`, `overlap_cpu_optimizer_d2h_h2d` | False, 1.0, False | step part of the optimizer on the host ([the offload page](offload.py)) | `optimizer_config.py:344`, `:347`, `:353` |
# | `clip_grad`, `grad_norm_skip_threshold`, `log_num_zeros_in_grad` | 1.0, inf, False | clip by the global L2 norm; skip a step whose norm is too large; count zero grads | `optimizer_config.py:371`, `:374`, `:380` |
# | `kernels` | `"torch"` | tinytron's own: `triton` runs AdamW as one fused launch over the DistributedOptimizer's shard ([appendix C](../kernels/fused_adamw.py)) | — |
#
# The config is checked when it is built: a wrong type (`lr="3e-4"`), a value out of its range
# (`adam_beta2=1.0`), an unknown choice, `fp16` with `bf16`, or CPU offload for anything but
# AdamW is a `ValueError` that names the field. `help(OptimizerConfig)` prints every field with
# its one-line description (the dataclass lives in `_config.py` next to this page).
#
# `SchedulerConfig` holds the schedule, in iterations: `lr_decay_style` (`"linear"`),
# `lr_decay_iters` (None: `train_iters`), `lr_warmup_iters` (0) or `lr_warmup_fraction`,
# `lr_warmup_init` (0.0), `lr_wsd_decay_style` (`"exponential"`) and `lr_wsd_decay_iters`,
# `start_weight_decay` / `end_weight_decay` with `weight_decay_incr_style` (`"constant"`), and
# on reload `override_opt_param_scheduler` or `use_checkpoint_opt_param_scheduler`
# ([the scheduler page](scheduler.py) builds the schedule itself).
#
# The scheduler's lengths are given in iterations on the command line and converted to samples
# by the global batch size (`megatron/training/training.py:1827-1880`):
# `lr_decay_steps = (lr_decay_iters or train_iters) · gbs`, `wd_incr_steps = train_iters · gbs`,
# warmup `= lr_warmup_fraction · lr_decay_steps` if a fraction is given, else
# `lr_warmup_iters · gbs`; `wsd_decay_steps = lr_wsd_decay_iters · gbs`. Example: 1000 iterations
# of 256 samples with a 1% warmup fraction: decay over 256 000 samples, warmup 2 560.

# %% [markdown]
# ## The loss scaler
#
# A constant scale when one is given; the dynamic scaler for fp16, whose 5-bit exponent
# underflows small gradients ([mixed precision](mixed_precision.py) builds both); none for bf16
# and fp32, whose exponent range is fp32's.

# %%
def build_grad_scaler(config: OptimizerConfig):
    """Constant if loss_scale is set, dynamic for fp16, none otherwise."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale, 2.0, 0.5,
                                 config.loss_scale_window, config.hysteresis)
    return None


# %% [markdown]
# ## The update rule
#
# Megatron's param groups feed one update rule; Muon builds its own pair (Muon for the 2-D
# matrices, AdamW for embeddings, norms and biases) and needs the attention shape to split the
# fused QKV matrix into its Q, K and V slabs.

# %%
def _muon_kwargs(config: OptimizerConfig, model_config, tp_group) -> dict:
    """Muon's options from the config (QKV split shapes from the model config)."""
    kw = dict(momentum=config.muon_momentum, nesterov=config.muon_nesterov,
              split_qkv=config.muon_split_qkv, scale_mode=config.muon_scale_mode,
              fp32_matmul_prec=config.muon_fp32_matmul_prec,
              coefficient_type=config.muon_coefficient_type, num_ns_steps=config.muon_num_ns_steps,
              tp_mode=config.muon_tp_mode, extra_scale_factor=config.muon_extra_scale_factor,
              tp_group=tp_group, adam_betas=(config.adam_beta1, config.adam_beta2),
              adam_eps=config.adam_eps)
    if config.muon_split_qkv and model_config is not None:
        d = model_config.hidden_size // model_config.num_attention_heads
        heads_per_group = model_config.num_attention_heads // model_config.num_query_groups
        kw["qkv_split_shapes"] = [heads_per_group * d, d, d]
    return kw


def _inner_optimizer(config: OptimizerConfig, named: list, model_config=None, tp_group=None):
    """The update rule over Megatron's param groups."""
    if config.optimizer == "muon":
        return build_muon_adamw(named, lr=config.lr, weight_decay=config.weight_decay,
                                **_muon_kwargs(config, model_config, tp_group))
    groups = build_param_groups(named, lr=config.lr, weight_decay=config.weight_decay,
                                min_lr=config.min_lr, decoupled_lr=config.decoupled_lr,
                                decoupled_min_lr=config.decoupled_min_lr,
                                apply_wd_to_qk_layernorm=config.apply_wd_to_qk_layernorm)
    if config.optimizer == "sgd":
        return SGD(groups, lr=config.lr, momentum=config.sgd_momentum)
    if config.optimizer == "lion":
        return Lion(groups, lr=config.lr, betas=(config.lion_beta1, config.lion_beta2))
    kw = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    if config.optimizer_cpu_offload:
        return HybridDeviceOptimizer(groups, config.optimizer_offload_fraction,
                                     overlap_d2h_h2d=config.overlap_cpu_optimizer_d2h_h2d, **kw)
    return Adam(groups, decoupled_weight_decay=config.decoupled_weight_decay, **kw)


# %% [markdown]
# ## The wrapper
#
# The update rule is wrapped once more: the DistributedOptimizer (which needs the DDP wrapper's
# contiguous buffers to shard) or its layer-wise variant for Muon, or the mixed-precision
# wrapper that keeps fp32 master weights on every rank.

# %%
def get_megatron_optimizer(config: OptimizerConfig, model: torch.nn.Module, grid=None, ddp=None):
    """Groups -> update rule -> scaler -> wrapper, as Megatron decides them.

    Example::

        opt = get_megatron_optimizer(OptimizerConfig(lr=3e-4, bf16=True), model)   # one process
        ddp = DistributedDataParallel(model, grid, DistributedDataParallelConfig(
            use_distributed_optimizer=True))
        opt = get_megatron_optimizer(OptimizerConfig(lr=3e-4, use_distributed_optimizer=True),
                                     model, grid, ddp=ddp)                          # ZeRO-1 over DP
    """
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr is required, got None")
    chunks = list(ddp) if isinstance(ddp, (list, tuple)) else [] if ddp is None else [ddp]
    # one chunk: its module; several (virtual stages): `model`, a ModuleList of their modules
    module = chunks[0].module if len(chunks) == 1 else model
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    model_config = getattr(module, "config", None)
    tp_group = grid.group("tp") if grid is not None and grid.size("tp") > 1 else None
    common = dict(clip_grad=config.clip_grad, grad_scaler=build_grad_scaler(config))
    if config.use_distributed_optimizer and config.optimizer == "muon":
        return LayerWiseDistributedOptimizer(
            lambda mine: _inner_optimizer(config, mine, model_config, tp_group), named, grid,
            **common)
    inner = _inner_optimizer(config, named, model_config, tp_group)
    extra = dict(log_num_zeros_in_grad=config.log_num_zeros_in_grad,
                 grad_norm_skip_threshold=config.grad_norm_skip_threshold)
    if config.use_distributed_optimizer:
        if ddp is None:
            raise ValueError("use_distributed_optimizer needs the DistributedDataParallel wrapper "
                             "(ddp=...) built with use_distributed_optimizer=True")
        fused = config.kernels == "triton" or (
            config.kernels == "auto" and _fused_adamw_applies(config)
            and all(b.grad_dtype == torch.float32 for c in chunks for b in c.buffers)
            and use_triton("auto", chunks[0].buffers[0].grad_data.device))
        return DistributedOptimizer(inner, ddp, **common, **extra, fused_adamw=fused)
    return MixedPrecisionOptimizer(inner, grid=grid, **common, **extra)


# %% [markdown]
# ## The scheduler
#
# Every length the command line gives in iterations becomes a number of samples, once, here:
# the samples those iterations consume. With a constant batch that is iterations × the global
# batch size (Megatron's rule, `megatron/training/training.py:1832-1843`). With a batch-size
# schedule the batch grows as the run goes, so the product with the *first* batch falls short:
# 10 iterations of `"0:16 10K:32"` consume 240 samples, and a decay sized as $10 \cdot 16 = 160$
# reaches `min_lr` at iteration 8 of 10. Chapter 01's loop passes `samples_of`, the walk over
# its batch schedule, so the decay ends exactly where the run ends. A run given in samples
# (`train_samples`) decays over `train_samples`, as Megatron's sample-based branch does
# (`training.py:1845-1858`); its iteration count comes from the same walk (`update_train_iters`,
# `training.py:1485-1506`). Megatron's iteration branch multiplies by `args.global_batch_size`,
# which a step schedule leaves at `micro_batch_size · dp` (`arguments.py:700-702`): its decay is
# compressed the same way, and its sample-based branch is the one to follow.

# %%
def get_optimizer_param_scheduler(config: SchedulerConfig, optimizer, opt_config: OptimizerConfig,
                                  train_iters: int, global_batch_size: int, *, samples_of=None,
                                  train_samples: int | None = None) -> OptimizerParamScheduler:
    """The scheduler with every length converted from iterations to samples.

    `samples_of(n)`: the samples the first n iterations consume (default n · global_batch_size;
    under a batch-size schedule, its walk). A sample-based run decays over `train_samples`.
    """
    samples_of = samples_of or (lambda n: n * global_batch_size)
    decay_iters = config.lr_decay_iters or train_iters
    decay = (train_samples if train_samples and not config.lr_decay_iters
             else samples_of(decay_iters))
    # a fraction stays a float sample count, as Megatron keeps it (training.py:1840)
    warmup = (config.lr_warmup_fraction * decay if config.lr_warmup_fraction is not None
              else samples_of(config.lr_warmup_iters))
    n_wsd = config.lr_wsd_decay_iters
    wsd = (None if n_wsd is None else n_wsd * global_batch_size if n_wsd > decay_iters
           else samples_of(decay_iters) - samples_of(decay_iters - n_wsd))  # the last n_wsd
    wd = opt_config.weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=config.lr_warmup_init, max_lr=opt_config.lr, min_lr=opt_config.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=config.lr_decay_style,
        start_wd=wd if config.start_weight_decay is None else config.start_weight_decay,
        end_wd=wd if config.end_weight_decay is None else config.end_weight_decay,
        wd_incr_steps=train_samples or samples_of(train_iters),
        wd_incr_style=config.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=config.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=config.override_opt_param_scheduler,
        wsd_decay_steps=wsd, lr_wsd_decay_style=config.lr_wsd_decay_style)


# %% [markdown]
# ## Demo: five configs, five optimizers
#
# The tiny GPT in one process, in the config's precision; each config is built and stepped once,
# and the table shows what the factory chose. The fp16 run starts at Megatron's initial loss scale
# $2^{32}$, so its first step overflows and is skipped — the dynamic scaler then works its way
# down (with `hysteresis=2`, the first overflow does not even lower the scale).

# %%
def _describe(opt) -> str:
    """wrapper / update rule(s) / scaler, in a few words."""
    inner = opt.optimizer
    rules = [type(o).__name__ for o in getattr(inner, "chained_optimizers", [inner])]
    scaler = type(opt.grad_scaler).__name__ if opt.grad_scaler is not None else "none"
    return f"{type(opt).__name__} / {'+'.join(rules)} / scaler {scaler}"


# %%
if __name__ == "__main__":
    from tinytron.model import GPTModel, tiny_config

    configs = {
        "bf16 AdamW": OptimizerConfig(lr=1e-3, bf16=True),
        "fp16 Adam (L2)": OptimizerConfig(lr=1e-3, fp16=True, decoupled_weight_decay=False),
        "Lion, loss_scale 1024": OptimizerConfig(optimizer="lion", lr=1e-4, loss_scale=1024.0),
        "Muon": OptimizerConfig(optimizer="muon", lr=1e-3, muon_fp32_matmul_prec="highest"),
        "AdamW + CPU offload": OptimizerConfig(lr=1e-3, optimizer_cpu_offload=True,
                                               optimizer_offload_fraction=0.5),
    }
    cfg = tiny_config(seq_length=16)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for name, oc in configs.items():
        torch.manual_seed(0)
        dtype = torch.bfloat16 if oc.bf16 else torch.float16 if oc.fp16 else torch.float32
        model = GPTModel(cfg).to(dtype)
        opt = get_megatron_optimizer(oc, model)
        sched = get_optimizer_param_scheduler(SchedulerConfig(lr_decay_style="cosine",
                                                              lr_warmup_fraction=0.01),
                                              opt, oc, train_iters=1000, global_batch_size=256)
        opt.scale_loss(model(tokens, labels=tokens).mean()).backward()
        ok, norm, _ = opt.step()
        scale = "" if opt.grad_scaler is None else f", loss scale now {opt.grad_scaler.scale:.3g}"
        print(f"{name:22s} -> {_describe(opt)}; step ok={ok}{scale}")
        # fp16 starts at scale 2**32: the first steps overflow and are skipped, as in Megatron
        assert ok == (not oc.fp16)
    assert (sched.lr_decay_steps, sched.lr_warmup_steps) == (256_000, 2_560)
    assert "DynamicGradScaler" in _describe(get_megatron_optimizer(configs["fp16 Adam (L2)"], model))

# %% [markdown]
# ## Summary
#
# - One config (Megatron's names and defaults) → groups, rule, offload, scaler, wrapper.
# - Muon with `use_distributed_optimizer` becomes the layer-wise optimizer; everything else
#   elementwise shards by bucket ranges.
# - Schedule lengths are converted to samples once, at construction.
#
# ## How production does it
#
# - Megatron: `megatron/core/optimizer/__init__.py` (`get_megatron_optimizer:975`,
#   `_get_megatron_optimizer_based_on_param_groups:451`), `optimizer_config.py` (the defaults),
#   `megatron/training/training.py:1827-1880` (`get_optimizer_param_scheduler`).
# - torchtitan: `torchtitan/components/optimizer.py` (`build_optimizers`) and
#   `lr_scheduler.py` (`build_lr_schedulers`) from its job config.
#
# ## Exercises
#
# 1. Why does Megatron refuse CPU offload for anything but AdamW?
#
#    <details><summary>Hint</summary>
#
#    See what [the offload page](offload.py)'s
#    `HybridDeviceOptimizer` needs from its optimizer class: one instance per parameter on the
#    host and another on the device, each stepping part of the params independently. Which rules
#    of this chapter are elementwise and cheap on a CPU, and which need a whole matrix?
#
#    </details>
#
# 2. With `fp16=True` and `loss_scale=1.0`, which scaler is built, and what does that mean for
#    gradients below $6\cdot10^{-8}$?
#
#    <details><summary>Answer</summary>
#
#    `loss_scale` is tested before `fp16`, so the factory builds
#    `ConstantGradScaler(1.0)`: the loss is not scaled at all. fp16's smallest subnormal is
#    $2^{-24} \approx 5.96\cdot10^{-8}$, so a gradient below it is rounded to 0 or to that single
#    value in the backward, and those updates are lost before the optimizer sees them.
#
#    </details>
