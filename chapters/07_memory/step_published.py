# %% [markdown]
# # 07.9 · Memory: the step-time model against Megatron's published throughput
#
# Page 07.8 builds a step out of kernels and transfers, each timed by a stated law. A model
# of time is worth what it predicts on runs it was not fitted to, so this page holds it
# against the one table of whole-iteration throughput Megatron-LM publishes for its own
# code: the weak-scaling runs of its README at `e03878b5f` (`images/model_table.png`, H100,
# GPT models from 1.7 B to 462 B parameters). Every row is predicted with the same H100
# constants of appendix C's law and 07.8's links, and every assumption the table leaves open
# is written down below with its reason.
#
# You will build: `PUBLISHED`, `published_config` and `predict_published`; the benchmark
# `benchmarks/bench_step_time.py --published` writes the same table to
# `benchmarks/results/step_time_published.json`.

# %%
from __future__ import annotations

from dataclasses import dataclass

from tinytron.main_loop.training_log import megatron_num_floating_point_operations
from tinytron.memory.states import MemoryConfig
from tinytron.memory.step_time import Links, StepOptions, estimate_step
from tinytron.model.config import ModelConfig

__all__ = ["PublishedRun", "PUBLISHED", "published_config", "predict_published"]

# %% [markdown]
# ## The table, transcribed
#
# Vocabulary 131,072, sequence 4,096, DP 48 on every row (GPUs = TP · PP · DP), batch in
# sequences, TFLOP/s per GPU by Megatron's `num_floating_point_operations`
# (`megatron/training/training.py:411`), MFU of 989 TFLOP/s. The runs used
# `--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap` (README, "Benchmark
# Configuration"). Head size is 128 on every row; the parameter counts ($12 L h^2 + 2 V h$)
# say the models are GPT's: a GeLU MLP of $4h$, one key/value head per query head, untied
# embeddings.

# %%
@dataclass(frozen=True)
class PublishedRun:
    """One row of Megatron's weak-scaling table (README at e03878b5f)."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    batch: int
    tflops: float
    """Published TFLOP/s per GPU."""
    dp: int = 48


PUBLISHED = [PublishedRun("1.7B", 16, 2048, 24, 1, 1, 192, 408.8),
             PublishedRun("7.1B", 32, 4096, 30, 2, 1, 192, 465.9),
             PublishedRun("16B", 48, 6144, 32, 4, 1, 192, 489.1),
             PublishedRun("32B", 56, 7168, 48, 8, 1, 192, 459.6),
             PublishedRun("70B", 64, 8192, 84, 8, 2, 384, 419.7),
             PublishedRun("119B", 80, 10240, 92, 8, 4, 768, 420.5),
             PublishedRun("177B", 96, 12288, 96, 8, 6, 1152, 432.8),
             PublishedRun("314B", 128, 16384, 96, 8, 8, 1536, 474.4),
             PublishedRun("462B", 144, 18432, 112, 8, 16, 3072, 459.9)]

# %% [markdown]
# ## What the table leaves open, and what the model assumes
#
# | open question | assumed | why |
# |---|---|---|
# | the MLP | the book's SwiGLU layer with $f = 8h/3$ rounded to a multiple of 8 | appendix B has one MLP; this one has the GeLU MLP's $8h^2$ weights and GEMM FLOPs (to 0.05%) |
# | micro-batch size | 1 | the most micro-batches per step ($m$ = batch / 48), so the smallest bubble; 4 K tokens of these widths fit an 80 GB rank without recompute |
# | recompute | none | Megatron's default; the table's TFLOP/s count no recompute either |
# | virtual stages | none (1F1B); the finest the layers allow shown beside it | the table does not say; the two bracket what interleaving can do |
# | gradient reduce | bf16 (`--grad-reduce-in-bf16`) | Megatron's own H100 recipe does it (`examples/llama/train_llama3_8b_h100_fp8.sh` at `e03878b5f`); fp32 would double the DP bytes |
# | data type | bf16 compute, the distributed optimizer | `--overlap-param-gather` requires the distributed optimizer |
# | the network | 8 GPUs per node, one 400 Gb/s NIC each (07.8's `Links`) | the H100 SuperPOD the README's runs name |
#
# With virtual stages the run also gets `overlap_p2p_comm` (the README says PP overlap is on
# by default, and Megatron allows it only with interleaving). The links, the law's three
# fractions and the NCCL interference are 07.8's defaults, unchanged for every row: nothing
# below is fitted to this table.

# %%
def published_config(run: PublishedRun, virtual_stages: int | None = None) -> MemoryConfig:
    """The MemoryConfig of one published row under the assumptions above."""
    h = run.hidden
    model = ModelConfig(hidden_size=h, num_layers=run.layers, num_attention_heads=run.heads,
                        num_query_groups=run.heads, ffn_hidden_size=round(8 * h / 3 / 8) * 8,
                        vocab_size=131072, seq_length=4096, tie_embeddings=False,
                        sequence_parallel=run.tp > 1)
    return MemoryConfig(model, tensor_model_parallel_size=run.tp,
                        pipeline_model_parallel_size=run.pp,
                        virtual_pipeline_model_parallel_size=virtual_stages,
                        data_parallel_size=run.dp, micro_batch_size=1,
                        num_microbatches=run.batch // run.dp, use_distributed_optimizer=True,
                        overlap_grad_reduce=True, grad_reduce_in_fp32=False)


def predict_published(run: PublishedRun, virtual_stages: int | None = None,
                      links: Links = Links()) -> dict:
    """Predicted step and TFLOP/s per GPU of one row (Megatron's FLOP count, as published)."""
    cfg = published_config(run, virtual_stages)
    options = StepOptions(tp_comm_overlap=True, overlap_p2p_comm=bool(virtual_stages),
                          checkpoint="none")
    step = estimate_step(cfg, links, options)
    gpus = run.tp * run.pp * run.dp
    tflops = megatron_num_floating_point_operations(cfg.model, run.batch) / gpus / step.total
    return {"name": run.name, "virtual_stages": virtual_stages or 1, "step_s": step.total,
            "compute_s": step.compute, "bubble_s": step.bubble, "optimizer_s": step.optimizer,
            "exposed_s": {i.item: i.exposed for i in step.items if i.seconds},
            "published_tflops": run.tflops, "predicted_tflops": tflops / 1e12,
            "ratio": tflops / 1e12 / run.tflops}


def finest_virtual_stages(run: PublishedRun) -> int | None:
    """The most model chunks per rank the layer count allows (one layer each), or None."""
    per_stage = run.layers // run.pp
    return per_stage if run.pp > 1 and per_stage > 1 else None

# %% [markdown]
# ## Demo: published, predicted, ratio

# %%
if __name__ == "__main__":
    print(f"{'model':>5} {'TP':>2} {'PP':>2} {'m':>3} {'published':>9} {'1F1B':>6} {'ratio':>6}"
          f" {'finest v':>8} {'TFLOP/s':>7} {'ratio':>6}")
    rows = []
    for run in PUBLISHED:
        plain = predict_published(run)
        fine = predict_published(run, finest_virtual_stages(run)) if run.pp > 1 else plain
        rows.append((plain, fine))
        print(f"{run.name:>5} {run.tp:>2} {run.pp:>2} {run.batch // run.dp:>3} "
              f"{run.tflops:>9.1f} {plain['predicted_tflops']:>6.1f} {plain['ratio']:>6.2f} "
              f"{fine['virtual_stages']:>8} {fine['predicted_tflops']:>7.1f} {fine['ratio']:>6.2f}")
