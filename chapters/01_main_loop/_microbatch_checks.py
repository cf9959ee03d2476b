"""The arguments chapter 01's micro-batch calculators refuse, each with a one-line ValueError.

Kept out of the page (`microbatches.py`) so that it shows the arithmetic; the messages are the
ones the tests match.
"""

from __future__ import annotations


def positive_int(name: str, value) -> int:
    """value if it is an int >= 1, else ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def positive_sizes(global_batch_size, micro_batch_size, data_parallel_size) -> None:
    """B, b and d are positive ints (checked in this order, as the messages name them)."""
    for name, v in (("global_batch_size", global_batch_size),
                    ("micro_batch_size", micro_batch_size),
                    ("data_parallel_size", data_parallel_size)):
        positive_int(name, v)


def check_schedule(schedule: list[tuple[int, int]]) -> None:
    """First threshold 0, strictly increasing thresholds, positive and non-shrinking sizes."""
    if not schedule:
        raise ValueError("step_batch_size_schedule has no entries")
    if schedule[0][0] != 0:
        raise ValueError(f"the first threshold must be 0, got {schedule[0][0]}")
    for (t0, b0), (t1, b1) in zip(schedule, schedule[1:]):
        if t1 <= t0:
            raise ValueError(f"thresholds must strictly increase (in samples), got {t0} "
                             f"then {t1}")
        if b1 < b0:
            raise ValueError(f"the batch size must not shrink: {b0} from {t0} samples, then "
                             f"{b1} from {t1} samples")
    for t, b in schedule:
        if b < 1:
            raise ValueError(f"batch sizes must be positive, got {b} at threshold {t}")
