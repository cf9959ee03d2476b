# %% [markdown]
# # 07.2 · Memory: the resident part — weights, the grad buffer, optimizer state
#
# What a rank allocates once and keeps for the whole run: its shard of the weights, the fp32
# `main_grad` buffer of chapter 05 with every element of its padding, and the optimizer's fp32
# master weights and moments of chapter 02, split by the distributed optimizer and, with CPU
# offload, between device and host. Counted to the byte, per pipeline rank and per DP rank.
#
# You will build: `chunk_params`, `buffer_layouts`, `owned_elements`, `state_ledger` and
# `MemoryConfig`, the layout they all read.

# %%
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import math

from tinytron.memory._checks import check_memory_config, check_rank
from tinytron.model.config import ModelConfig, stage_layer_ranges

__all__ = ["MemoryConfig", "ParamSpec", "chunk_params", "buffer_layouts", "owned_elements",
           "state_ledger", "DTYPE_BYTES", "BufferLayout", "lay_out", "bucket_size_for",
           "offloaded_mask"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# %% [markdown]
# Every function on this page takes one layout, `cfg`: a `MemoryConfig`, the training setup under
# Megatron's names (model, TP, PP, CP, DP, micro-batches, optimizer switches). Its fields are
# listed after the mechanism, just before the demo. One thing to know now: $d_{cp}$ below is
# DP × CP, the ranks that hold the same weights and reduce their grads together.

# %% [markdown]
# ## Which parameters a rank holds, in the order DDP sees them
#
# A pipeline rank holds one `GPTModel` chunk per virtual stage ([B.4](../model/gpt.py)). Each chunk is
# wrapped in its own DDP with its own buffer, as Megatron wraps each model chunk
# (`megatron/training/training.py`, `get_model`). Inside a chunk the parameters come in
# registration order: the embedding (first chunk of the first stage), then per layer
# `input_layernorm`, `linear_qkv`, `linear_proj`, `pre_mlp_layernorm`, `linear_fc1`,
# `linear_fc2`, then the final norm and the output layer (last chunk of the last stage; a
# duplicate of the embedding when tied and $p > 1$, marked `shared_embedding`). The tests
# check this list against `named_parameters()` of the built model, name by name.
#
# The ledger lays these light stand-ins out itself, with Megatron's rules written out below,
# and calls nothing of chapter 05 or chapter 02. That is deliberate: chapter 05's
# `compute_param_layout` sized the buffers the trainer allocates, so a ledger that called it
# would agree with the measurement whatever the layout did. Written twice, a slip in either
# shows up as a disagreement, in bytes, in
# `tests/test_memory_independent.py`.

# %%
@dataclass(eq=False)
class ParamSpec:
    """A parameter as the buffer layout sees it: name, element count, flags."""

    name: str
    count: int
    matrix: bool
    """Two-dimensional (gets weight decay, the first optimizer group)."""
    shared_embedding: bool = False

    def numel(self) -> int:
        """Elements, as torch.Tensor.numel()."""
        return self.count


# %% [markdown]
# A layer contributes six parameters, its four matrices cut by TP; a chunk is the embedding
# (first chunk of the first stage), its layers, then the final norm and the output layer (last
# chunk of the last stage).

# %%
def _layer_params(config: ModelConfig, tp: int, index: int) -> list[ParamSpec]:
    """The six parameters of decoder layer `index` (local index in its chunk)."""
    h, d, f = config.hidden_size, config.head_dim, config.ffn_hidden_size
    a, g = config.num_attention_heads, config.num_query_groups
    pre = f"decoder.layers.{index}."
    return [ParamSpec(pre + "input_layernorm.weight", h, False),
            ParamSpec(pre + "self_attention.linear_qkv.weight", (a + 2 * g) * d * h // tp, True),
            ParamSpec(pre + "self_attention.linear_proj.weight", h * a * d // tp, True),
            ParamSpec(pre + "pre_mlp_layernorm.weight", h, False),
            ParamSpec(pre + "mlp.linear_fc1.weight", 2 * f * h // tp, True),
            ParamSpec(pre + "mlp.linear_fc2.weight", h * f // tp, True)]


def chunk_params(cfg: MemoryConfig, pp_rank: int, chunk: int) -> list[ParamSpec]:
    """The parameters of one model chunk of pipeline rank `pp_rank`, in registration order."""
    model, tp, pp = cfg.model, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    start, end = stage_layer_ranges(model.num_layers, pp, cfg.num_chunks, pp_rank)[chunk]
    pre = pp_rank == 0 and chunk == 0
    post = pp_rank == pp - 1 and chunk == cfg.num_chunks - 1
    table = model.vocab_size * model.hidden_size // tp
    tied_split = model.tie_embeddings and not (pre and post)
    params = []
    if pre:
        params.append(ParamSpec("embedding.word_embeddings.weight", table, True, tied_split))
    for i in range(end - start):
        params += _layer_params(model, tp, i)
    if post:
        params.append(ParamSpec("decoder.final_layernorm.weight", model.hidden_size, False))
        if not (model.tie_embeddings and pre):
            params.append(ParamSpec("output_layer.weight", table, True, tied_split))
    return params


# %% [markdown]
# **Worked example: the running example's two stages.** The 7B model (32 layers, $h = 4096$,
# 32 query heads and 8 KV groups of $d = 128$, $f = 14336$, $V = 128256$, tied) at TP 2 · PP 2.
# A layer's four matrices per TP rank hold $(32 + 16) \cdot 128 \cdot 4096 / 2 = 12{,}582{,}912$
# (QKV), $4096 \cdot 4096 / 2 = 8{,}388{,}608$ (proj), $2 \cdot 14336 \cdot 4096 / 2 =
# 58{,}720{,}256$ (fc1, gate and up) and $29{,}360{,}128$ (fc2) elements; its two norms 4,096
# each (replicated, not split by TP). Sixteen layers are $1{,}745{,}092{,}608 + 131{,}072$
# elements. Stage 0 adds the embedding's half table, $128256 \cdot 4096 / 2 = 262{,}668{,}288$:
# 97 tensors, **2,007,629,824** parameters. Stage 1 adds the final norm and its own copy of the
# tied table, marked `shared_embedding` (the first and last stage all-reduce the two copies'
# gradients): 98 tensors, **2,007,633,920**.

# %% [markdown]
# ## The grad buffer and its padding, from Megatron's rules
#
# Megatron lays a chunk's parameters out in **reverse** registration order (the order backward
# produces their gradients), back to back, and cuts the run into buckets. Without the
# distributed optimizer nothing is padded
# (`megatron/core/distributed/param_and_grad_buffer.py:889-931`,
# `_compute_default_per_buffer_param_layout`). With it three rules apply
# (`megatron/core/optimizer/distrib_optimizer.py:483-557`, the helpers at
# `megatron/core/optimizer/param_layout.py:24-42`):
#
# 1. every parameter starts at a multiple of 64 elements (`pad_param_start`);
# 2. every bucket ends at a multiple of $\mathrm{lcm}(d_{cp}, 128)$ — of
#    $\mathrm{lcm}(d_{cp}, 128, 2^{16})$ with `pad_buckets_for_high_nccl_busbw` — so the
#    $d_{cp}$ ranks own equal slices (`pad_bucket_end`);
# 3. a parameter marked `shared_embedding` (the tied output table on the last stage) closes
#    the bucket before it and gets a bucket of its own, so its grad can be all-reduced with the
#    first stage's embedding separately.
#
# A bucket closes once it holds at least `bucket_size` elements. With only these rules the
# whole buffer is a list of `(start, end)` pairs:

# %%
def _round_up(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


@dataclass
class BufferLayout:
    """One chunk's buffer: where each param sits and where each bucket ends (padded)."""

    param_index_map: dict
    """ParamSpec -> (start, end, bucket id), elements from the buffer's start."""
    bucket_indices: list
    """[(start, end)] of each bucket, padding included."""

    @property
    def numel(self) -> int:
        """Elements of the whole buffer (the last bucket's end)."""
        return self.bucket_indices[-1][1] if self.bucket_indices else 0


# %% [markdown]
# `lay_out` walks the parameters in reverse, rounds each start up (rule 1), closes a bucket when
# it is full or when the shared embedding must stand alone (rule 3), and pads each bucket's end
# (rule 2).

# %%
def lay_out(params: list[ParamSpec], bucket_size: int | None, dp_size: int, *,
            distributed_optimizer: bool, pad_for_high_nccl_busbw: bool = False) -> BufferLayout:
    """Megatron's buffer layout of `params` (rules 1-3 with the distributed optimizer)."""
    end_divisor = math.lcm(dp_size, 128, 2**16 if pad_for_high_nccl_busbw else 1)
    where, buckets = {}, []
    first = cursor = 0  # first element of the open bucket; next free element
    held = 0            # params in the open bucket

    def close(end: int) -> int:
        padded = _round_up(end, end_divisor) if distributed_optimizer else end
        buckets.append((first, padded))
        return padded

    for p in reversed(params):
        alone = distributed_optimizer and p.shared_embedding
        if distributed_optimizer:
            cursor = _round_up(cursor, 64)                      # rule 1
        if alone and held:
            first = cursor = close(cursor)                      # rule 3: close the open bucket
            held = 0
        where[p] = (cursor, cursor + p.count, len(buckets))
        cursor, held = cursor + p.count, held + 1
        if alone or (bucket_size is not None and cursor - first >= bucket_size):
            first = cursor = close(cursor)                      # rule 2 pads the end
            held = 0
    if held:
        close(cursor)
    return BufferLayout(where, buckets)


# %% [markdown]
# **The bucket size.** Without `overlap_grad_reduce` there is one bucket (nothing to overlap,
# so one large collective wins); with it the configured size, else
# $\max(40\mathrm{M}, 1\mathrm{M} \cdot d_{cp})$ elements
# (`megatron/core/distributed/distributed_data_parallel.py:66-72`; the training loop passes the
# DP size with CP, `megatron/training/training.py:1772-1775`). Every pipeline rank but the
# first gets one bucket, because its DP traffic is not on the critical path
# (`distributed_data_parallel.py:95-106`).

# %%
def _dp_cp(cfg: MemoryConfig) -> int:
    return cfg.data_parallel_size * cfg.context_parallel_size


def bucket_size_for(cfg: MemoryConfig, pp_rank: int) -> int | None:
    """Elements per bucket of pipeline rank `pp_rank` (None: one bucket)."""
    if not cfg.overlap_grad_reduce or pp_rank > 0:
        return None
    return cfg.bucket_size or max(40_000_000, 1_000_000 * _dp_cp(cfg))


def buffer_layouts(cfg: MemoryConfig, pp_rank: int) -> list[tuple[list[ParamSpec], BufferLayout]]:
    """(params, layout) of each model chunk's DDP buffer on this pipeline rank."""
    out = []
    for chunk in range(cfg.num_chunks):
        params = chunk_params(cfg, pp_rank, chunk)
        out.append((params, lay_out(params, bucket_size_for(cfg, pp_rank), _dp_cp(cfg),
                                    distributed_optimizer=cfg.use_distributed_optimizer,
                                    pad_for_high_nccl_busbw=cfg.pad_buckets_for_high_nccl_busbw)))
    return out


# %% [markdown]
# Worked example, the tiny model ($h = 64$, 2 layers, 4/2 heads, $f = 128$, $V = 512$) at DP 4
# with the distributed optimizer: every parameter size is a multiple of 64, so rule 1 never
# moves a start and only the bucket end moves — 106,816 parameters become a buffer of 106,880
# elements ($835 \cdot 128$). The param buffer (bf16) gets the same layout and the model's
# weights are re-pointed into it, so the weights cost the padded count too.
#
# **Who owns what.** DP rank $r$ of a bucket $[b_0, b_1)$ owns $[b_0 + r\,q, b_0 + (r+1)\,q)$
# with $q = (b_1 - b_0)/d_{cp}$; the distributed optimizer keeps fp32 masters and moments only
# for the *parameter* elements inside that range (`DistributedOptimizer._build_main_params`,
# chapter 02), so padding costs grad and param buffer bytes but no optimizer bytes, and the
# ranks do not all own the same count: the tiny model's four DP ranks own 26,720, 26,720,
# 26,720 and 26,656 elements — the last rank's slice ends in the 64 padding elements.
#
# At 7B scale the same rules cost nothing: every tensor size is a multiple of 128 and $d_{cp}
# = 64$, so $\mathrm{lcm}(64, 128) = 128$ divides every bucket. Rule 3 still shapes the
# buckets: stage 0 has two, $[0, 1{,}744{,}961{,}536)$ for the layers (reverse order puts them
# first) and the embedding alone after them; stage 1 has the tied output table alone at the
# start and the layers after it. Each of the 64 DP ranks owns $1/64$ of each bucket:
# 31,369,216 elements on stage 0, 31,369,280 on stage 1.

# %%
def owned_elements(params: list[ParamSpec], layout: BufferLayout, dp_size: int,
                   dp_rank: int) -> list[int]:
    """Per parameter, how many of its elements lie in DP rank `dp_rank`'s shards."""
    owned = []
    for p in params:
        start, end, bucket_id = layout.param_index_map[p]
        b0, b1 = layout.bucket_indices[bucket_id]
        q = (b1 - b0) // dp_size
        lo, hi = max(start, b0 + dp_rank * q), min(end, b0 + (dp_rank + 1) * q)
        owned.append(max(0, hi - lo))
    return owned


# %% [markdown]
# ## The optimizer: masters, moments, and the offloaded fraction
#
# Per element the optimizer stepping it holds an fp32 master (bf16 training; an fp32 model is
# its own master, and with the distributed optimizer its shard is a view of the fp32 param,
# `distrib_optimizer.py:442-446`) and its moments: Adam 2, Lion 1, SGD 1
# (the momentum buffer), 4 bytes each. Without the distributed optimizer that is every local
# parameter; with it, the owned elements above.
#
# **CPU offload** (chapter 02's `HybridDeviceOptimizer`) takes the masters in optimizer-group
# order — the weight-decay group first when the chunk starts with a matrix, the norms first
# otherwise (`build_param_groups` keeps first-seen order) — and moves whole tensors to the host
# while the offloaded elements are still below the fraction of the total: the tensor that
# crosses the budget still goes (Megatron's rule,
# `megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py:251-275`; written out here as
# `offloaded_mask`, not taken from chapter 02). On the host each offloaded element costs an
# fp32 copy, an fp32 grad and the moments; the device keeps its fp32 master and only the
# moments of what stayed.

# %%
_MOMENTS = {"adam": 2, "lion": 1, "sgd": 1}


def offloaded_mask(counts: list[int], fraction: float) -> list[bool]:
    """Which tensors (in optimizer order) go to the host: while the offloaded sum < budget."""
    budget, taken, mask = fraction * sum(counts), 0, []
    for n in counts:
        mask.append(taken < budget)
        taken += n if mask[-1] else 0
    return mask


def _optimizer_order(params: list[ParamSpec], owned: list[int]) -> list[int]:
    """Owned counts in optimizer order: param groups by first appearance, params kept in order."""
    first_matrix = params[0].matrix
    groups = [[n for p, n in zip(params, owned) if p.matrix == kind and n > 0]
              for kind in (first_matrix, not first_matrix)]
    return groups[0] + groups[1]


# %% [markdown]
# Per chunk, `_optimizer_terms` turns the owned elements into device and host bytes;
# `state_ledger` adds the weights and the grad buffer and sums over the rank's chunks.

# %%
def _optimizer_terms(cfg: MemoryConfig, params, owned) -> dict[str, int]:
    """Device and host bytes of masters, moments and offload copies for one chunk."""
    elements = sum(owned)
    has_master = cfg.bf16  # fp32 params: the shard is a view of the param (no copy)
    moments = 4 * _MOMENTS[cfg.optimizer]
    terms = {"master_params": 4 * elements if has_master else 0,
             "optimizer_state": moments * elements, "host_optimizer": 0}
    if cfg.optimizer_cpu_offload:
        order = _optimizer_order(params, owned)
        offloaded = sum(n for n, off in zip(order, offloaded_mask(
            order, cfg.optimizer_offload_fraction)) if off)
        terms["optimizer_state"] = moments * (elements - offloaded)
        terms["host_optimizer"] = (4 + 4 + moments) * offloaded  # copy, grad, moments
    if cfg.grad_bytes != 4:  # main.grad = main_grad.float(): a persistent fp32 copy
        terms["fp32_grad_copies"] = 4 * elements
    return terms


def state_ledger(cfg: MemoryConfig, pp_rank: int = 0, dp_rank: int = 0) -> dict[str, int]:
    """Resident bytes of one rank: weights, grad buffer, masters, moments (device and host)."""
    check_rank(cfg, pp_rank, dp_rank, _dp_cp(cfg))
    out: dict[str, int] = {}
    for params, layout in buffer_layouts(cfg, pp_rank):
        count = sum(p.count for p in params)
        dist_opt = cfg.use_distributed_optimizer
        owned = (owned_elements(params, layout, _dp_cp(cfg), dp_rank) if dist_opt
                 else [p.count for p in params])
        terms = {"weights": cfg.param_bytes * (layout.numel if dist_opt else count),
                 "grad_buffer": cfg.grad_bytes * layout.numel,
                 **_optimizer_terms(cfg, params, owned)}
        for key, value in terms.items():
            out[key] = out.get(key, 0) + value
    return out


# %% [markdown]
# ## The inputs
#
# Everything the ledger needs is in the trainer's config (`[model]`, `[parallel]`,
# `[training]`, `[optimizer]`, `[ddp]`), gathered in one dataclass under Megatron's names. The
# recompute and activation-offload switches stay where chapter 06 put them, in the model
# config (`recompute_granularity`, `recompute_method`, `recompute_num_layers`,
# `recompute_modules`, `fine_grained_activation_offloading`, `offload_modules`).
# Two choices follow Megatron rather than the dataclass defaults:
#
# - with bf16 the gradient buffer is fp32 (`grad_reduce_in_fp32`), as Megatron forces for bf16
#   (`--accumulate-allreduce-grads-in-fp32`, `megatron/training/arguments.py`);
# - the DP size of the buffers and of the distributed optimizer is **DP × CP**: context-parallel
#   ranks hold the same weights and reduce their grads together (`dp_cp` in appendix A's grid;
#   Megatron's `get_data_parallel_group(with_context_parallel=True)`).

# %% [markdown]
# What the ledger derives from the fields sits in two small base classes. First the recompute
# switches, read through from the model config.

# %%
class _ModelSwitches:
    """The recompute switches MemoryConfig reads through from its model config."""

    # Recompute and activation offload are the model's switches (chapter 06, appendix B).
    @property
    def recompute_granularity(self) -> str | None:
        """None, "selective" or "full" (the model config's)."""
        return self.model.recompute_granularity

    @property
    def recompute_method(self) -> str | None:
        """"uniform" or "block" with full recompute."""
        return self.model.recompute_method

    @property
    def recompute_num_layers(self) -> int | None:
        """Layers per checkpointed run (uniform) or checkpointed layers per stage (block)."""
        return self.model.recompute_num_layers

    @property
    def recompute_modules(self) -> list[str]:
        """What selective recompute checkpoints (default Megatron's ["core_attn"])."""
        return self.model.recompute_modules or ["core_attn"]


# %% [markdown]
# Then what follows from the layout itself: the model chunks per pipeline rank, the world
# size, and the bytes of one parameter and of one gradient element.

# %%
class _Derived(_ModelSwitches):
    """The quantities MemoryConfig derives from its fields (a base class, not a config)."""

    @property
    def num_chunks(self) -> int:
        """Model chunks per pipeline rank (virtual stages; 1 without interleaving)."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def world_size(self) -> int:
        """tp · pp · cp · dp."""
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size * self.data_parallel_size)

    @property
    def param_bytes(self) -> int:
        """Bytes of one model parameter (2 in bf16, 4 in fp32)."""
        return 2 if self.bf16 else 4

    @property
    def grad_bytes(self) -> int:
        """Bytes of one main_grad element."""
        return 4 if (self.grad_reduce_in_fp32 or not self.bf16) else 2

    def replace(self, **changes) -> "MemoryConfig":
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)


# %% [markdown]
# Then the fields themselves.

# %%
@dataclass
class MemoryConfig(_Derived):
    """One training layout, everything the memory ledger needs (Megatron's names)."""

    model: ModelConfig
    """The model shape (appendix B); sequence_parallel and dropout live there."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    data_parallel_size: int = 1
    """DP without CP, as in Megatron: world = tp · pp · cp · dp."""
    micro_batch_size: int = 1
    num_microbatches: int = 1
    """Micro-batches per step on each DP rank (global batch / (mbs · dp))."""
    bf16: bool = True
    """bf16 params (2 bytes) with fp32 masters; False = fp32 params, their own masters."""
    grad_reduce_in_fp32: bool = True
    """fp32 main_grad buffer (forced on with bf16, as Megatron does)."""
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    """Only changes the bucket size (one bucket without overlap)."""
    bucket_size: int | None = None
    pad_buckets_for_high_nccl_busbw: bool = False
    optimizer: str = "adam"
    """adam (2 moments), sgd (momentum) or lion (1 moment)."""
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    attention_kernel: str = "auto"
    """"flash"/"efficient"/"cudnn" (keep q, k, v, out, logsumexp), "math" (the s x s scores),
    "auto" (what torch picks for the layer: 07.3's `attention_kernel`)."""
    device: str = "cuda"
    """Where it runs: decides the auto kernel and the dropout-mask width (CPU: the param dtype)."""

    def __post_init__(self):
        check_memory_config(self)  # one-line errors naming the field (_checks.py)

# %% [markdown]
# The fields are checked in `chapters/07_memory/_checks.py` (`check_memory_config`): every size a
# positive int, the optimizer, kernel and device one of their choices, the offload fraction in
# $[0, 1]$, and appendix B's `check_layout` on the model (heads divisible by TP, layers by the
# pipeline's stages). Each failure is one line naming the field.

# %% [markdown]
# ## Demo: the tiny model at DP 4, and the running example per GPU
#
# The tiny model shows the padding in small numbers; the running example gives the resident
# bytes of the first and last pipeline stage of TP 2 · PP 2 · DP 64 with the distributed
# optimizer, next to Megatron's single estimate. What the cell prints, for reading without
# running it:
#
# | 7B, DP rank 0 | stage 0 | stage 1 |
# |---|---|---|
# | weights (bf16 param buffer) | 4,015,259,648 B (3,829.2 MiB) | 4,015,267,840 B |
# | grad buffer (fp32) | 8,030,519,296 B (7,658.5 MiB) | 8,030,535,680 B |
# | fp32 masters of the owned $1/64$ | 125,476,864 B (119.7 MiB) | 125,477,120 B |
# | Adam moments of the owned $1/64$ | 250,953,728 B (239.3 MiB) | 250,954,240 B |
# | total | **12,422,209,536 B** | **12,422,234,880 B** |
#
# Megatron's estimate, 12,422,222,208 B, sits exactly between the two, 12,672 B from each.
# It counts one stage's share of the TP-sharded weights plus one embedding, all at
# $6 + 12/64$ bytes, and divides *all* norm weights by $p$, the final norm included:
# $(32 \cdot 2 + 1) \cdot 4096 / 2 = 133{,}120$ norm parameters per stage, where stage 0
# holds 131,072 and stage 1 135,168. The 2,048 parameters of difference at 6.1875 bytes are
# the 12,672 B.
#
# **Offload, worked.** With `optimizer_offload_fraction = 0.5` on stage 0, DP rank 0 owns two
# pieces, the first $1/64$ of each bucket: 27,265,024 elements of the last layer's fc2 (reverse
# order puts it at the start of the layers' bucket) and 4,104,192 of the embedding, which
# has a bucket of its own. In optimizer order the embedding comes first: it was registered
# first, and both are matrices of the weight-decay group. The budget is half of
# their 31,369,216: 15,684,608. The first piece is below it, so the second goes too (the
# tensor that crosses the budget still goes): every moment leaves the device, and
# 501,907,456 B — fp32 copy, fp32 grad and two moments of 31,369,216 elements — live on the
# host. The device keeps its 125,476,864 B of masters.

# %%
if __name__ == "__main__":
    from tinytron.memory.megatron_model import megatron_theoretical_memory
    from tinytron.model.config import count_parameters_per_rank, llama_7b_config, tiny_config

    tiny = MemoryConfig(tiny_config(), data_parallel_size=4, use_distributed_optimizer=True)
    (params, layout), = buffer_layouts(tiny, 0)
    per_rank = [sum(owned_elements(params, layout, 4, r)) for r in range(4)]
    print(f"tiny: {sum(p.count for p in params):,} params -> buffer {layout.numel:,} elements; "
          f"owned per DP rank {per_rank}")
    print("tiny, DP rank 0:", state_ledger(tiny))

    big = MemoryConfig(llama_7b_config(sequence_parallel=True), tensor_model_parallel_size=2,
                       pipeline_model_parallel_size=2, data_parallel_size=64,
                       micro_batch_size=2, num_microbatches=8, use_distributed_optimizer=True)
    rows = {f"stage {r}": state_ledger(big, pp_rank=r) for r in range(2)}
    for name, terms in rows.items():
        total = sum(terms.values())
        print(f"7B {name}: " + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in terms.items())
              + f"  = {total:,} B")
    megatron = megatron_theoretical_memory(
        num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
        num_query_groups=8, ffn_hidden_size=14336, swiglu=True, normalization="RMSNorm",
        padded_vocab_size=128256, seq_length=4096, micro_batch_size=2,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=64,
        use_distributed_optimizer=True)["weight_and_optimizer"]
    print(f"Megatron's estimate: {megatron:,.0f} B")

    assert sum(per_rank) == sum(p.count for p in params) == 106_816 and layout.numel == 106_880
    assert per_rank == [26_720, 26_720, 26_720, 26_656]
    for r in range(2):
        assert rows[f"stage {r}"]["weights"] >= 2 * count_parameters_per_rank(
            big.model, tp=2, pp=2, pp_rank=r)  # the padding only adds
    assert abs(sum(rows["stage 0"].values()) - megatron) / megatron < 0.01

# %% [markdown]
# ## Bytes per parameter, with and without the distributed optimizer
#
# Stage 0's ledger divided by its 2,007,629,824 parameters gives Megatron's bytes per parameter
# state by state. Without the distributed optimizer every DP rank holds all of them:
# 2 (bf16 weight) + 4 (fp32 grad) + 4 (fp32 master) + 8 (two Adam moments) = 18. With it the
# weights and the grad buffer stay whole on every rank, and only the master and the moments
# are split over the 64 DP ranks: $6 + 12/64 = 6.1875$. The optimizer state, the largest part
# of the first bar, almost vanishes from the second.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.memory._plots import plot_bytes_per_param

    n = count_parameters_per_rank(big.model, tp=2, pp=2, pp_rank=0)
    ledgers = {"replicated optimizer": state_ledger(big.replace(use_distributed_optimizer=False)),
               "distributed optimizer, DP 64": rows["stage 0"]}
    per_param = {name: {k: v / n for k, v in terms.items() if v} for name, terms in ledgers.items()}
    for name, terms in per_param.items():
        print(f"{name}: " + ", ".join(f"{k} {v:g}" for k, v in terms.items())
              + f" = {sum(terms.values()):g} bytes per parameter")
    plot_bytes_per_param(per_param, "bytes per parameter, 7B stage 0 (TP 2, PP 2), one GPU")
    plt.show()

    assert per_param["replicated optimizer"] == {"weights": 2, "grad_buffer": 4,
                                                 "master_params": 4, "optimizer_state": 8}
    assert abs(sum(per_param["distributed optimizer, DP 64"].values()) - (6 + 12 / 64)) < 1e-3
