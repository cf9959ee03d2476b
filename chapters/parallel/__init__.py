"""Appendix A · Parallel primitives: the process-group grid, TP/SP layers, CP, pipeline p2p, RNG."""

from tinytron.parallel.grid import AXES, DEFAULT_ORDER, ParallelGrid, RankLayout, rank_layout
from tinytron.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, copy_to_tp_region, gather_from_sequence_parallel_region,
    gather_from_tp_region, gather_shards, normal_init, reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tp_region, set_tensor_parallel_attributes, shard_tensor)
from tinytron.parallel.vocab_parallel import (VocabParallelEmbedding, padded_vocab_size, vocab_range,
                                              vocab_parallel_cross_entropy)

__pages__ = ["grid", "tensor_parallel", "vocab_parallel"]

__all__ = [
    "AXES", "DEFAULT_ORDER", "ParallelGrid", "RankLayout", "rank_layout",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "set_tensor_parallel_attributes",
    "normal_init", "shard_tensor", "gather_shards",
    "padded_vocab_size", "vocab_range", "vocab_parallel_cross_entropy",
]
