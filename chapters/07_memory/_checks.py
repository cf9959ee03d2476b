"""Argument checks of chapter 07's config, kept off the pages (the messages are the page's).

`MemoryConfig.__post_init__` ([07.2](states.py)) calls `check_memory_config`: every field is
checked once, with a one-line error naming the field, and the model config's own layout check
(appendix B's `ModelConfig.check_layout`) runs on the layout.
"""

from __future__ import annotations

_POSITIVE = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
             "context_parallel_size", "data_parallel_size", "micro_batch_size",
             "num_microbatches")


def check_choice(name: str, value, allowed) -> None:
    """ValueError naming the field unless value is one of allowed."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_memory_config(cfg) -> None:
    """ValueError (one line, naming the field) for a MemoryConfig that cannot be a layout."""
    for name in _POSITIVE:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if cfg.optimizer not in ("adam", "sgd", "lion"):
        raise ValueError(f"optimizer must be adam, sgd or lion, got {cfg.optimizer!r}")
    check_choice("attention_kernel", cfg.attention_kernel,
                 ("auto", "flash", "efficient", "cudnn", "math"))
    check_choice("device", cfg.device, ("cpu", "cuda"))
    if not 0.0 <= cfg.optimizer_offload_fraction <= 1.0:
        raise ValueError("optimizer_offload_fraction must lie in [0, 1], got "
                         f"{cfg.optimizer_offload_fraction}")
    cfg.model.check_layout(tp=cfg.tensor_model_parallel_size, cp=cfg.context_parallel_size,
                           pp=cfg.pipeline_model_parallel_size, num_virtual_stages=cfg.num_chunks)


def check_rank(cfg, pp_rank: int, dp_rank: int, dp_cp: int) -> None:
    """ValueError unless (pp_rank, dp_rank) names a rank of the layout."""
    if not 0 <= pp_rank < cfg.pipeline_model_parallel_size:
        raise ValueError(f"pp_rank must be in [0, {cfg.pipeline_model_parallel_size}), "
                         f"got {pp_rank}")
    if not 0 <= dp_rank < dp_cp:
        raise ValueError(f"dp_rank must be in [0, {dp_cp}) (DP x CP), got {dp_rank}")
