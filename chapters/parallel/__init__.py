"""Appendix A · Parallel primitives: the process-group grid, TP/SP layers, CP, pipeline p2p, RNG."""

from tinytron.parallel.context_parallel import (
    context_parallel_attention, cp_chunk_ids, cp_positions, gather_from_context_parallel,
    gather_kv_for_context_parallel, restore_sequence_order, ring_attention,
    slice_batch_for_context_parallel, split_for_context_parallel)
from tinytron.parallel.grid import AXES, DEFAULT_ORDER, ParallelGrid, RankLayout, rank_layout
from tinytron.parallel.pipeline_p2p import (
    communicate, recv_backward, recv_forward, send_backward, send_backward_recv_backward,
    send_backward_recv_forward, send_forward, send_forward_backward_recv_forward_backward,
    send_forward_recv_backward, send_forward_recv_forward)
from tinytron.parallel.rng import (
    DATA_PARALLEL_RNG, EXPERT_PARALLEL_RNG, MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_tracker,
    model_parallel_seed, set_random_seed)
from tinytron.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, copy_to_tp_region, gather_from_sequence_parallel_region,
    gather_from_tp_region, gather_shards, normal_init, reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tp_region, set_tensor_parallel_attributes, shard_tensor)
from tinytron.parallel.vocab_parallel import (VocabParallelEmbedding, padded_vocab_size, vocab_range,
                                              vocab_parallel_cross_entropy)

__pages__ = ["grid", "tensor_parallel", "vocab_parallel", "context_parallel", "pipeline_p2p", "rng"]

__all__ = [
    # grid
    "AXES", "DEFAULT_ORDER", "ParallelGrid", "RankLayout", "rank_layout",
    # tensor + sequence parallel
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "set_tensor_parallel_attributes",
    "normal_init", "shard_tensor", "gather_shards",
    "padded_vocab_size", "vocab_range", "vocab_parallel_cross_entropy",
    # context parallel
    "cp_chunk_ids", "cp_positions", "split_for_context_parallel", "slice_batch_for_context_parallel",
    "restore_sequence_order", "gather_from_context_parallel", "gather_kv_for_context_parallel",
    "context_parallel_attention", "ring_attention",
    # pipeline p2p
    "communicate", "recv_forward", "recv_backward", "send_forward", "send_backward",
    "send_forward_recv_backward", "send_backward_recv_forward", "send_forward_recv_forward",
    "send_backward_recv_backward", "send_forward_backward_recv_forward_backward",
    # rng
    "MODEL_PARALLEL_RNG", "DATA_PARALLEL_RNG", "EXPERT_PARALLEL_RNG", "RNGStatesTracker",
    "get_rng_tracker", "model_parallel_seed", "set_random_seed",
]
