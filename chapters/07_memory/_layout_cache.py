"""The step-time page's cache of DP bucket layouts and state ledgers (not a page).

A stage's buffer layout depends on the model's shape and the layout, not on the batch or
the recompute setting, so `tinytron-memory --search` computes each one once.
"""

from __future__ import annotations


LAYOUT_CACHE: dict = {}  # the layout does not depend on the batch or recompute: the search reuses it


def layout_key(cfg, pp_rank: int) -> tuple:
    """What a stage's buffer layout depends on (first, middle and last stages differ)."""
    m, p = cfg.model, cfg.pipeline_model_parallel_size
    role = 0 if pp_rank == 0 else 2 if pp_rank == p - 1 else 1
    return (m.hidden_size, m.num_layers, m.vocab_size, m.ffn_hidden_size,
            m.num_attention_heads, m.num_query_groups, m.tie_embeddings,
            cfg.tensor_model_parallel_size, p, cfg.num_chunks, role,
            cfg.data_parallel_size * cfg.context_parallel_size, cfg.use_distributed_optimizer,
            cfg.overlap_grad_reduce, cfg.bucket_size, cfg.pad_buckets_for_high_nccl_busbw,
            cfg.bf16, cfg.grad_reduce_in_fp32, cfg.optimizer)
