"""Validation walls of chapter 02's optimizers, out of the pages' way (not a page)."""

from __future__ import annotations

from tinytron.optimizer.algorithms import Adam


def check_distopt_inner(optimizer, ddp, fused_adamw: bool) -> None:
    """ValueError unless the inner rule is elementwise (not Muon) and DDP shards for us."""
    if fused_adamw and not (isinstance(optimizer, Adam)
                            and all(g["decoupled_weight_decay"] for g in optimizer.param_groups)):
        raise ValueError(f"fused_adamw needs the AdamW inner optimizer, got {type(optimizer).__name__}")
    if not ddp.ddp_config.use_distributed_optimizer:
        raise ValueError("DistributedOptimizer needs DDP built with use_distributed_optimizer=True")
    leaves = getattr(optimizer, "chained_optimizers", [optimizer])
    if any(type(o).__name__ == "Muon" for o in leaves):
        raise ValueError("Muon needs whole matrices: use LayerWiseDistributedOptimizer, "
                         f"got {[type(o).__name__ for o in leaves]}")
