"""The arguments the schedules of chapter 01 refuse, each with a one-line ValueError naming it.

Kept out of the pages (`schedules.py`, `interleaved.py`) so that they show the mechanism; the
messages are the ones the tests match.
"""

from __future__ import annotations


def single_chunk(model, data_iterator, name: str):
    """The one chunk (and iterator) of a non-interleaved schedule."""
    model = model if isinstance(model, (list, tuple)) else [model]
    iters = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    if len(model) != 1 or len(iters) != 1:
        raise ValueError(f"the {name} schedule takes one model chunk and one data iterator, got "
                         f"{len(model)} chunks and {len(iters)} iterators (interleaving needs "
                         "vpp_size)")
    return model[0], iters[0]


def chunks_and_iterators(model, data_iterator) -> tuple[list, list]:
    """The interleaved schedule's chunks and their data iterators, one per chunk."""
    model = list(model) if isinstance(model, (list, tuple)) else [model]
    if not isinstance(data_iterator, (list, tuple)) or len(data_iterator) != len(model):
        n = len(data_iterator) if isinstance(data_iterator, (list, tuple)) else 1
        raise ValueError(f"the interleaved schedule needs one data iterator per model chunk: "
                         f"{len(model)} chunks, {n} iterator(s)")
    return model, list(data_iterator)


def check_num_microbatches(num_microbatches) -> None:
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")


def check_pipeline(grid, num_microbatches) -> None:
    """A positive int m and a grid with more than one pipeline stage."""
    check_num_microbatches(num_microbatches)
    if grid is None or grid.size("pp") < 2:
        raise ValueError("a pipelined schedule needs a grid with pp > 1, got "
                         f"{None if grid is None else grid.size('pp')}")


def check_pp_size(pp_size) -> None:
    if not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pp_size must be a positive int, got {pp_size!r}")


def message_width(config_hidden, model_config) -> int:
    """The pipeline message's hidden size: the schedule's, else the model chunk's config."""
    hidden = config_hidden or getattr(model_config, "hidden_size", None)
    if hidden is None:
        raise ValueError("ScheduleConfig.hidden_size is None and the model chunk has no "
                         "config.hidden_size to read the pipeline message width from")
    return hidden


def check_sequence_split(seq_length: int, split: int) -> None:
    if seq_length % split:
        raise ValueError(f"seq_length ({seq_length}) must be divisible by cp*tp(SP) ({split})")


def batch_p2p(config) -> bool:
    """The schedule's p2p method: batched (True) or single isend/irecv (False).

    `batch_p2p_comm` None means the negation of `overlap_p2p_comm`, as Megatron's training
    arguments set it (megatron/training/argument_utils.py:302); both True is refused
    (megatron/core/model_parallel_config.py:304-312).
    """
    batch, overlap = config.batch_p2p_comm, config.overlap_p2p_comm
    if batch is None:
        return not overlap
    if batch and overlap:
        raise ValueError("batch_p2p_comm = True with overlap_p2p_comm = True: overlapped p2p "
                         "posts single isend/irecv, so set batch_p2p_comm = False (or None)")
    return bool(batch)
