"""Argument checks of chapter 04's samplers, out of the page's way (not a page)."""

from __future__ import annotations


def check_common(total_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int) -> None:
    """ValueError naming the sampler argument that cannot describe a walk over the data."""
    if total_samples <= 0:
        raise ValueError(f"no sample to consume: total_samples={total_samples}")
    if micro_batch_size <= 0 or data_parallel_size <= 0:
        raise ValueError(f"micro_batch_size={micro_batch_size} and data_parallel_size="
                         f"{data_parallel_size} must be positive")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank={data_parallel_rank} must be in [0, {data_parallel_size})")


def check_consumed(consumed_samples: int, total_samples: int) -> None:
    """The sequential sampler must have samples left to walk."""
    if not 0 <= consumed_samples < total_samples:
        raise ValueError(f"no samples left to consume: consumed_samples={consumed_samples}, "
                         f"total_samples={total_samples}")


def check_one_step(total_samples: int, step: int) -> None:
    """The random sampler needs at least one whole step of mbs*dp samples."""
    if total_samples < step:
        raise ValueError(f"total_samples={total_samples} is smaller than one step of "
                         f"mbs*dp={step}")
