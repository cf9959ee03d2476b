# %% [markdown]
# # 02 · Optimizer: from a config to the optimizer and its scheduler
#
# The trainer does not pick classes by hand: a config with Megatron's option names and defaults
# decides the update rule, the loss scaler, the wrapper (plain, distributed, layer-wise), CPU
# offload, and the scheduler's lengths in samples. This page is that decision, in one function
# each.

# %%
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from tinytron._fields import check_choice, check_fields, check_range, document_fields
from tinytron.kernels import use_triton
from tinytron.optimizer.algorithms import SGD, Adam, Lion, build_param_groups
from tinytron.optimizer.distributed import DistributedOptimizer
from tinytron.optimizer.layer_wise import LayerWiseDistributedOptimizer
from tinytron.optimizer.mixed_precision import (ConstantGradScaler, DynamicGradScaler,
                                                MixedPrecisionOptimizer)
from tinytron.optimizer.muon import build_muon_adamw
from tinytron.optimizer.offload import HybridDeviceOptimizer
from tinytron.optimizer.muon import NS_COEFFICIENTS
from tinytron.optimizer.scheduler import (LR_DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES,
                                        OptimizerParamScheduler)

__all__ = ["OptimizerConfig", "SchedulerConfig", "get_megatron_optimizer", "build_grad_scaler",
           "get_optimizer_param_scheduler"]

# %% [markdown]
# ## The decisions
#
# `get_megatron_optimizer` (`megatron/core/optimizer/__init__.py:975`) and the functions it
# calls make these choices, in this order:
#
# | question | answer | Megatron |
# |---|---|---|
# | which params share a group? | identical overrides: `wd_mult=0` for biases / 1-D, `decoupled_lr` for embedding/output | `_get_param_groups:300` |
# | which update rule? | `adam` (AdamW when `decoupled_weight_decay`), `sgd`, `lion`, `muon` (+ AdamW for non-matrices) | `:545-625`, `:725` |
# | CPU offload? | `optimizer_cpu_offload` → hybrid optimizer (AdamW only) with `optimizer_offload_fraction` | `:505-544` |
# | loss scaler? | `loss_scale` set → constant; else `fp16` → dynamic; else none (bf16, fp32) | `:637-660` |
# | wrapper? | `use_distributed_optimizer` → DistributedOptimizer (layer-wise for Muon), else the mixed-precision wrapper | `:662-690` |
#
# The scheduler's lengths are given in iterations on the command line and converted to samples
# by the global batch size (`megatron/training/training.py:1827-1880`):
# `lr_decay_steps = (lr_decay_iters or train_iters) · gbs`, `wd_incr_steps = train_iters · gbs`,
# warmup `= lr_warmup_fraction · lr_decay_steps` if a fraction is given, else
# `lr_warmup_iters · gbs`; `wsd_decay_steps = lr_wsd_decay_iters · gbs`. Example: 1000 iterations
# of 256 samples with a 1% warmup fraction: decay over 256 000 samples, warmup 2 560.

# %%
@document_fields
@dataclass
class OptimizerConfig:
    """Megatron's optimizer options that tinytron implements (same names and defaults).

    The defaults are those of Megatron's command line (`megatron/training/arguments.py`), which
    is what a run gets. Two differ from the `OptimizerConfig` class of megatron/core, which the
    command line always overrides: `min_lr` 0.0 (`arguments.py:2654`; the class has None,
    `optimizer_config.py:151`) and `optimizer_offload_fraction` 1.0 (`arguments.py:2585`; the
    class has 0.0, `optimizer_config.py:347`).
    """

    optimizer: str = "adam"
    """adam, sgd, lion or muon."""
    lr: float | None = None
    """Peak learning rate (required)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    decoupled_lr: float | None = None
    """Separate peak lr for params flagged is_embedding_or_output_parameter."""
    decoupled_min_lr: float | None = None
    """Separate min lr for those params."""
    weight_decay: float = 0.01
    """Weight decay (0 for biases and 1-D params)."""
    apply_wd_to_qk_layernorm: bool = False
    """Decay q/k layernorm weights although they are 1-D."""
    fp16: bool = False
    """fp16 params: dynamic loss scaling unless loss_scale is set."""
    bf16: bool = False
    """bf16 params (no loss scaler)."""
    loss_scale: float | None = None
    """A constant loss scale (overrides the dynamic one)."""
    initial_loss_scale: float = 2.0 ** 32
    """Start of the dynamic loss scale."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale."""
    loss_scale_window: int = 1000
    """Clean steps before the dynamic scale grows."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale backs off."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    decoupled_weight_decay: bool = True
    """AdamW (True) or L2-coupled Adam (False)."""
    sgd_momentum: float = 0.9
    """SGD momentum."""
    lion_beta1: float = 0.95
    """Lion beta1 (interpolation for the sign)."""
    lion_beta2: float = 0.98
    """Lion beta2 (momentum EMA)."""
    muon_momentum: float = 0.95
    """Muon EMA momentum."""
    muon_nesterov: bool = False
    """Nesterov direction for Muon."""
    muon_split_qkv: bool = True
    """Orthogonalize Q, K, V slabs of linear_qkv separately."""
    muon_scale_mode: str = "spectral"
    """spectral, shape_scaling or unit_rms_norm."""
    muon_fp32_matmul_prec: str = "medium"
    """medium runs Newton-Schulz matmuls in bf16; highest keeps fp32."""
    muon_coefficient_type: str = "quintic"
    """Newton-Schulz coefficients: quintic, simple, polar_express, aol."""
    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations."""
    muon_tp_mode: str = "blockwise"
    """blockwise, duplicated or distributed."""
    muon_extra_scale_factor: float = 1.0
    """Extra factor on the orthogonalized update."""
    use_distributed_optimizer: bool = False
    """Shard master weights and state over DP (layer-wise for Muon)."""
    optimizer_cpu_offload: bool = False
    """Step (part of) the optimizer on the host."""
    optimizer_offload_fraction: float = 1.0
    """Fraction of the elements whose state and step live on the host."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """One host optimizer per param, transfers on side streams."""
    clip_grad: float = 1.0
    """Clip by the global L2 norm (0 disables)."""
    log_num_zeros_in_grad: bool = False
    """Count zero grad entries each step."""
    grad_norm_skip_threshold: float = math.inf
    """Skip the update when the grad norm exceeds this."""
    kernels: str = "torch"
    """torch, triton (AdamW as one Triton launch over the DistOpt shard, appendix C) or auto (CUDA)."""

    def __post_init__(self):
        check_fields(self)  # lr="3e-4" or clip_grad="1.0" must not get past the constructor
        check_choice(self, "optimizer", ("adam", "sgd", "lion", "muon"))
        check_choice(self, "kernels", ("torch", "triton", "auto"))
        if self.kernels == "triton" and not _fused_adamw_applies(self):
            raise ValueError("kernels='triton' (fused AdamW) needs optimizer='adam' with "
                             "decoupled_weight_decay=True and use_distributed_optimizer=True, "
                             "without optimizer_cpu_offload")
        _check_optimizer_ranges(self)
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 are both set; choose one")
        if self.optimizer_cpu_offload and not (self.optimizer == "adam"
                                               and self.decoupled_weight_decay):
            raise ValueError("optimizer_cpu_offload needs optimizer='adam' with "
                             f"decoupled_weight_decay=True, got {self.optimizer!r}")


@document_fields
@dataclass
class SchedulerConfig:
    """Megatron's learning-rate / weight-decay schedule options, in iterations."""

    lr_decay_style: str = "linear"
    """constant, linear, cosine, inverse-square-root or WSD."""
    lr_decay_iters: int | None = None
    """Iterations to decay over (default: train_iters)."""
    lr_warmup_iters: int = 0
    """Warmup iterations."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of the decay (overrides lr_warmup_iters)."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of the warmup."""
    lr_wsd_decay_style: str = "exponential"
    """WSD anneal: linear, cosine, exponential, minus_sqrt."""
    lr_wsd_decay_iters: int | None = None
    """Length of the WSD anneal in iterations."""
    start_weight_decay: float | None = None
    """Weight decay at the start (default: the optimizer's)."""
    end_weight_decay: float | None = None
    """Weight decay at the end (default: the optimizer's)."""
    weight_decay_incr_style: str = "constant"
    """constant, linear or cosine."""
    override_opt_param_scheduler: bool = False
    """On reload keep this config's values."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On reload take the checkpoint's values."""

    def __post_init__(self):
        check_fields(self)
        check_choice(self, "lr_decay_style", LR_DECAY_STYLES)
        check_choice(self, "lr_wsd_decay_style", WSD_DECAY_STYLES)
        check_choice(self, "weight_decay_incr_style", WD_INCR_STYLES)
        for name in ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters", "lr_warmup_init",
                     "start_weight_decay", "end_weight_decay"):
            check_range(self, name, 0)
        check_range(self, "lr_warmup_fraction", 0, 1)


def _check_optimizer_ranges(c: OptimizerConfig) -> None:
    """ValueError naming the first option outside its meaningful range."""
    for name in ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "weight_decay", "clip_grad",
                 "grad_norm_skip_threshold"):
        check_range(c, name, 0)
    for name in ("adam_beta1", "adam_beta2", "sgd_momentum", "lion_beta1", "lion_beta2",
                 "muon_momentum"):
        check_range(c, name, 0, 1, high_open=True)
    for name in ("adam_eps", "loss_scale", "initial_loss_scale", "min_loss_scale"):
        check_range(c, name, 0, low_open=True)
    for name in ("loss_scale_window", "hysteresis", "muon_num_ns_steps"):
        check_range(c, name, 1)
    check_range(c, "optimizer_offload_fraction", 0, 1)
    check_choice(c, "muon_scale_mode", ("spectral", "shape_scaling", "unit_rms_norm"))
    check_choice(c, "muon_fp32_matmul_prec", ("highest", "high", "medium"))
    check_choice(c, "muon_coefficient_type", sorted(NS_COEFFICIENTS))
    check_choice(c, "muon_tp_mode", ("blockwise", "duplicated", "distributed"))


# %%
def build_grad_scaler(config: OptimizerConfig):
    """Constant if loss_scale is set, dynamic for fp16, none otherwise."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale, 2.0, 0.5,
                                 config.loss_scale_window, config.hysteresis)
    return None


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
    module = ddp.module if ddp is not None else model
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
            and all(b.grad_dtype == torch.float32 for b in ddp.buffers)
            and use_triton("auto", ddp.buffers[0].grad_data.device))
        return DistributedOptimizer(inner, ddp, **common, **extra, fused_adamw=fused)
    return MixedPrecisionOptimizer(inner, grid=grid, **common, **extra)


def _fused_adamw_applies(config: OptimizerConfig) -> bool:
    """Whether appendix C's fused AdamW can serve this config (AdamW on the DistributedOptimizer)."""
    return (config.optimizer == "adam" and config.decoupled_weight_decay
            and config.use_distributed_optimizer and not config.optimizer_cpu_offload)


def get_optimizer_param_scheduler(config: SchedulerConfig, optimizer, opt_config: OptimizerConfig,
                                  train_iters: int, global_batch_size: int) -> OptimizerParamScheduler:
    """The scheduler with every length converted from iterations to samples."""
    decay = (config.lr_decay_iters or train_iters) * global_batch_size
    # a fraction stays a float sample count, as Megatron keeps it (training.py:1840)
    warmup = (config.lr_warmup_fraction * decay if config.lr_warmup_fraction is not None
              else config.lr_warmup_iters * global_batch_size)
    wsd = None if config.lr_wsd_decay_iters is None else config.lr_wsd_decay_iters * global_batch_size
    wd = opt_config.weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=config.lr_warmup_init, max_lr=opt_config.lr, min_lr=opt_config.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=config.lr_decay_style,
        start_wd=wd if config.start_weight_decay is None else config.start_weight_decay,
        end_wd=wd if config.end_weight_decay is None else config.end_weight_decay,
        wd_incr_steps=train_iters * global_batch_size, wd_incr_style=config.weight_decay_incr_style,
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
# 2. With `fp16=True` and `loss_scale=1.0`, which scaler is built, and what does that mean for
#    gradients below $6\cdot10^{-8}$?
