"""Validation walls of chapter 02's optimizers, out of the pages' way (not a page)."""

from __future__ import annotations



def check_lr_wd(lr: float, weight_decay: float) -> None:
    """Reject a negative learning rate or weight decay."""
    if lr < 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def check_betas(betas: tuple[float, float]) -> None:
    """Reject betas outside [0, 1)."""
    for b in betas:
        if not 0.0 <= b < 1.0:
            raise ValueError(f"betas must lie in [0, 1), got {betas}")


def check_distopt_inner(optimizer, ddp, fused_adamw: bool) -> list:
    """The DDP chunks (one wrapper, or a list: one per virtual stage); ValueError unless the
    inner rule is elementwise (not Muon) and every chunk's DDP shards for us."""
    from tinytron.optimizer.algorithms import Adam

    chunks = list(ddp) if isinstance(ddp, (list, tuple)) else [ddp]
    if not chunks:
        raise ValueError("DistributedOptimizer needs at least one DDP-wrapped model chunk")
    if fused_adamw and not (isinstance(optimizer, Adam)
                            and all(g["decoupled_weight_decay"] for g in optimizer.param_groups)):
        raise ValueError(f"fused_adamw needs the AdamW inner optimizer, got {type(optimizer).__name__}")
    if not all(c.ddp_config.use_distributed_optimizer for c in chunks):
        raise ValueError("DistributedOptimizer needs DDP built with use_distributed_optimizer=True")
    leaves = getattr(optimizer, "chained_optimizers", [optimizer])
    if any(type(o).__name__ == "Muon" for o in leaves):
        raise ValueError("Muon needs whole matrices: use LayerWiseDistributedOptimizer, "
                         f"got {[type(o).__name__ for o in leaves]}")
    return chunks


def check_scaler_args(min_scale, initial_scale, growth_factor, backoff_factor,
                      growth_interval, hysteresis) -> None:
    """ValueError naming the DynamicGradScaler arguments that cannot make a valid schedule."""
    if not 0 < min_scale <= initial_scale:
        raise ValueError(f"need 0 < min_scale <= initial_scale, got {min_scale}, {initial_scale}")
    if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got "
                         f"{growth_factor}, {backoff_factor}")
    if growth_interval <= 0 or hysteresis <= 0:
        raise ValueError(f"growth_interval and hysteresis must be > 0, got "
                         f"{growth_interval}, {hysteresis}")


def check_grads_reduced(opt) -> None:
    """RuntimeError while a DDP wrapper of the optimizer's params has grads it has not reduced."""
    params = [model for model, _ in opt.pairs]
    params += [p for _, p in getattr(opt, "all_named", [])]  # layer-wise: owned or not
    states = [getattr(p, "grad_sync", None) for p in params]
    # the distributed optimizer may own no piece at all: ask its wrapper too
    states.append(getattr(getattr(opt, "ddp", None), "grad_sync", None))
    if any(s is not None and s.pending for s in states):
        raise RuntimeError("optimizer.step() on grads whose data-parallel reduction has not "
                           "finished: call ddp.finish_grad_sync() (or finalize_model_grads) "
                           "after the backward and before the step, as Megatron's train_step does")


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def _check_choice(value: str, choices: tuple, name: str) -> None:
    """ValueError naming the option when value is not one of choices."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_scheduler(s) -> None:
    """The OptimizerParamScheduler constructor's consistency rules, as ValueErrors naming the argument."""
    if not 0.0 <= s.min_lr <= s.max_lr:
        raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr={s.min_lr}, max_lr={s.max_lr}")
    if s.init_lr > s.max_lr:
        raise ValueError(f"init_lr {s.init_lr} exceeds max_lr {s.max_lr}")
    if s.lr_decay_steps <= 0 or s.lr_warmup_steps >= s.lr_decay_steps:
        raise ValueError(f"need 0 <= lr_warmup_steps < lr_decay_steps, got "
                         f"{s.lr_warmup_steps} and {s.lr_decay_steps}")
    _check_choice(s.lr_decay_style, LR_DECAY_STYLES, "lr_decay_style")
    _check_choice(s.wd_incr_style, WD_INCR_STYLES, "wd_incr_style")
    if s.lr_decay_style == "WSD":
        if s.wsd_decay_steps is None or s.wsd_decay_steps <= 0:
            raise ValueError(f"WSD needs wsd_decay_steps > 0, got {s.wsd_decay_steps}")
        _check_choice(s.lr_wsd_decay_style, WSD_DECAY_STYLES, "lr_wsd_decay_style")
    if not 0.0 <= s.start_wd <= s.end_wd:
        raise ValueError(f"need 0 <= start_wd <= end_wd, got {s.start_wd}, {s.end_wd}")
    if s.wd_incr_style == "constant" and s.start_wd != s.end_wd:
        raise ValueError(f"constant wd_incr_style needs start_wd == end_wd, got "
                         f"{s.start_wd} != {s.end_wd}")
    if s.override_opt_param_scheduler and s.use_checkpoint_opt_param_scheduler:
        raise ValueError("override_opt_param_scheduler and use_checkpoint_opt_param_scheduler "
                         "are both set; choose one")


def check_muon_args(momentum: float, fp32_matmul_prec: str) -> None:
    """ValueError naming the Muon argument out of range."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
    if fp32_matmul_prec not in ("highest", "high", "medium"):
        raise ValueError(f"fp32_matmul_prec must be highest/high/medium, got {fp32_matmul_prec!r}")
