"""The DDP configuration's validation, out of the page's way (chapter 05; not a page)."""

from __future__ import annotations

from tinytron._fields import check_fields


def check_ddp_config(config) -> None:
    """ValueError naming the first DistributedDataParallelConfig field tinytron cannot run."""
    check_fields(config)  # bucket_size="1000" or grad_reduce_in_fp32="true" stop here
    if config.num_distributed_optimizer_instances != 1:
        raise ValueError("num_distributed_optimizer_instances must be 1, got "
                         f"{config.num_distributed_optimizer_instances}")
    if config.bucket_size is not None and config.bucket_size <= 0:
        raise ValueError(f"bucket_size must be positive or None, got {config.bucket_size}")
    if config.overlap_param_gather and not config.use_distributed_optimizer:
        raise ValueError("overlap_param_gather=True needs use_distributed_optimizer=True")
    if config.average_in_collective and config.calculate_per_token_loss:
        raise ValueError("average_in_collective cannot be combined with "
                         "calculate_per_token_loss (grads are summed, then divided by tokens)")
