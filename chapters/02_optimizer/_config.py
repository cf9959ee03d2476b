"""The optimizer and scheduler configs of chapter 02: Megatron's option names, defaults and checks.

The page `factory.py` shows these fields as a table (with the line of each in Megatron's
`megatron/core/optimizer/optimizer_config.py`); `help(OptimizerConfig)` prints every field with
its one-line docstring. Importable as `tinytron.optimizer.factory.OptimizerConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tinytron._fields import check_choice, check_fields, check_range, document_fields
from tinytron.optimizer.muon import NS_COEFFICIENTS
from tinytron.optimizer.scheduler import LR_DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES

__all__ = ["OptimizerConfig", "SchedulerConfig"]


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


def _fused_adamw_applies(config: OptimizerConfig) -> bool:
    """Whether appendix C's fused AdamW can serve this config (AdamW on the DistributedOptimizer)."""
    return (config.optimizer == "adam" and config.decoupled_weight_decay
            and config.use_distributed_optimizer and not config.optimizer_cpu_offload)
