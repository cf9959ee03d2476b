# %% [markdown]
# # B.4 · Model: the Llama-style GPT, one class for every layout
#
# Page [B.3](transformer_layer.py) built one decoder layer. The model the chapters train is $L$
# of those layers between an embedding and an output head, ending in the per-token loss. This
# page assembles it, and cuts it into pipeline stages.
#
# Why one class: every chapter builds the same model, whatever the layout (a single process,
# tensor parallel with or without sequence parallel, context parallel, pipeline stages with
# virtual stages for interleaving), and each layout is checked against the single process
# number for number. That only works if the layouts differ in where the model is cut, never in
# what it computes.
#
# You will build: `GPTModel`, `init_parameters`, `build_stage_models`, `stage_tensor_shape`,
# `global_parameter_name`.

# %%
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tinytron.kernels import use_triton
from tinytron.kernels import vocab_parallel_cross_entropy as fused_vocab_parallel_cross_entropy
from tinytron.model._checks import check_attention_mask, check_ids
from tinytron.model._checks import on_host as _on_host
from tinytron.model.config import ModelConfig, stage_layer_ranges
from tinytron.model.layers import ShardSpec, init_full_tensor, rope_cos_sin, shard_of
from tinytron.model.transformer_layer import TransformerLayer, _fork, _no_init, _rms_norm
from tinytron.parallel import (ParallelGrid, VocabParallelEmbedding, copy_to_tp_region,
                               gather_from_sequence_parallel_region, vocab_parallel_cross_entropy)
from tinytron.parallel.context_parallel import cp_positions
from tinytron.parallel.rng import get_rng_tracker

__all__ = [
    "GPTModel",
    "build_stage_models",
    "stage_tensor_shape",
    "init_parameters",
    "global_parameter_name",
    "check_ids",
    "check_attention_mask",
]

# %% [markdown]
# ## The forward pass, as shapes
#
# The activations are $[s, b, h]$, sequence first, as on [page B.3](transformer_layer.py). With
# $t$ TP ranks, $c$ CP ranks, $p$ pipeline stages and sequence parallelism on, a rank sees:
#
# ```mermaid
# flowchart TB
#   T["input_ids [b, s/c]"] --> E["embedding (vocab-parallel)<br/>[s/(c t), b, h]"]
#   E --> S0["first stage: its layers (B.3)"]
#   S0 -->|"send [s/(c t), b, h]"| S1["... last stage: its layers"]
#   S1 --> H["final norm, output layer<br/>logits [b, s/c, V/t]"]
#   H --> L["vocab-parallel CE<br/>loss [b, s/c]"]
# ```
#
# Parameter names follow Megatron's local spec (`megatron/core/models/gpt/gpt_layer_specs.py:467`):
# `embedding.word_embeddings.weight`, the layers' `decoder.layers.{i}.…`, then
# `decoder.final_layernorm.weight` and `output_layer.weight`. A chunk numbers its own layers
# from 0; `global_parameter_name` adds the chunk's offset, so a name means the same weight on
# every layout.

# %% [markdown]
# ## The model and its pipeline stages
#
# `GPTModel(config, grid, pre_process=…, post_process=…, layer_range=(start, end))` is one
# pipeline chunk (Megatron's `GPTModel`, `megatron/core/models/gpt/gpt_model.py:90`):
#
# - `pre_process` (first stage): it owns the embedding and reads `tokens`; otherwise the input
#   is the activation received from the previous stage, handed over by the schedule with
#   `set_input_tensor` (`gpt_model.py:289`).
# - `post_process` (last stage): it owns the final norm and the output layer and returns the
#   logits `[b, s, V/t]` or, with `labels`, the fp32 per-token loss `[b, s]` from the
#   vocab-parallel cross entropy (`gpt_model.py:765-767`, `language_module.py:144`). A middle
#   stage returns its hidden states `[s, b, h]` (`[s/t, b, h]` under SP) for the next send.
#
# **Tied embeddings across stages.** With $p = 1$ the output layer multiplies by the
# embedding table itself. With $p > 1$ the last stage keeps its own copy, initialized from the
# same seed and name as the embedding (Megatron zero-fills it and all-reduces it over the
# embedding group, `language_module.py:236-300`: the same result). The first-stage table is
# marked `shared_embedding`; the last-stage copy `shared` and `shared_embedding`, so that
# [chapter 05](../05_buffers/finalize_model_grads.py) sums their gradients over the embedding
# group and the grad norm counts the
# table once.
#
# `build_stage_models(config, grid, num_virtual_stages)` builds this pipeline rank's chunks:
# chunk $k$ of stage $r$ holds layers run $k p + r$ ([page B.1](config.py)), only the very first
# chunk has
# `pre_process` and only the very last `post_process`. `stage_tensor_shape` is the shape the
# schedule sends between stages, $[s/c, b, h]$, or $[s/(c t), b, h]$ under sequence
# parallelism (Megatron's `get_tensor_shapes`, `megatron/core/pipeline_parallel/schedules.py:2057`).
#
# **Activation recompute and offload** ([chapter 06](../06_recompute_offload/recompute.py)) plug in
# from outside: `tinytron.recompute.apply_recompute(model)` sets `GPTModel.layer_runner` (the
# decoder loop, full recompute) and `SelfAttention.attend_wrapper` (selective recompute,
# offload); a model whose config asks for them refuses to train until it has been called.

# %%
def global_parameter_name(name: str, layer_offset: int) -> str:
    """Rename decoder.layers.{local} to decoder.layers.{local + offset} (the layout-free name)."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}" if m else name


# %% [markdown]
# The output layer is a module of its own, called like every other layer, not a bare matrix the
# head reads: what must happen *before a layer's weights are used* is a forward pre-hook, such
# as [chapter 05's](../05_buffers/distributed_data_parallel.py) overlapped param all-gather, and
# a weight read outside a call slips past it (read directly, the output matrix was used while
# its all-gather still wrote it, and the losses changed from run to run). Tied on one stage,
# the embedding's earlier call has already waited for the table.

# %%
class OutputLayer(nn.Module):
    """Megatron's output_layer: [.., h] -> logits [.., V/t] against its own [V/t, h] weight."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


# %% [markdown]
# `GPTModel` is put together from five small whole classes, each one job of a chunk, and then
# the class itself with its constructor and forward. The first, `ChunkParts`, builds what the
# chunk needs: the embedding on the first chunk, its range of layers, the final norm and the
# output layer on the last.

# %%
class ChunkParts:
    """What a GPTModel chunk holds (embedding, layers, head) and the flags on its weights."""

    def _build(self, config, grid, start, end, rng_tracker):
        """Create the embedding, the layers [start, end), and the head, as this chunk needs."""
        h, v, tp = config.hidden_size, config.vocab_size, grid.size("tp")
        if self.pre_process:
            self.embedding = nn.Module()
            self.embedding.word_embeddings = VocabParallelEmbedding(
                v, h, grid, init_method=_no_init,
                reduce_scatter_embeddings=config.sequence_parallel)
            self.embedding.word_embeddings.weight.shard_spec = ShardSpec((v, h), dim=0,
                                                                         std=config.init_std)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(
            TransformerLayer(config, grid, i, rng_tracker) for i in range(start, end))
        if self.post_process:
            self.decoder.final_layernorm = _rms_norm(config, h, config.norm_epsilon)
            if not (config.tie_embeddings and self.pre_process):
                weight = nn.Parameter(torch.empty(v // tp, h))
                weight.tensor_model_parallel, weight.partition_dim = True, 0
                weight.partition_stride = 1
                weight.shard_spec = ShardSpec((v, h), dim=0, std=config.init_std)
                self.output_layer = OutputLayer(weight)
        self._mark_embedding_and_output()
        self._mark_shared_embedding()


# %% [markdown]
# Two kinds of flags go on the weights here. **`is_embedding_or_output_parameter`** marks the
# word embeddings on the first stage and the output layer's weight on the last: chapter 02's
# [parameter groups](../02_optimizer/algorithms.py) give these, and only these, the
# `decoupled_lr` / `decoupled_min_lr` schedule, and its Muon split keeps them on Adam. Tied on
# one stage, one table carries the flag; tied across stages the last stage's copy carries it
# too, so both copies step with the same lr and stay equal. Example: `decoupled_lr=1e-4` with
# `lr=3e-4` on one stage, tied: two groups, the `[V, h]` table at 1e-4 and every other weight
# at 3e-4.
#
# <details><summary>Megatron detail: where it sets the flag</summary>
#
# `LanguageModule.setup_embeddings_and_output_layer` sets it
# (`megatron/core/models/common/language_module/language_module.py:213` for the embedding on a
# `pre_process` chunk, `:219` for an output layer that has a weight of its own).
#
# </details>
#
# A table tied across two stages also carries the flags that tell the grad sync and the grad
# norm about it; a later stage receives its input instead of embedding tokens.

# %%
class StageFlags:
    """The weight flags Megatron's optimizer and grad sync read, and the stage's hand-over."""

    def _mark_embedding_and_output(self):
        """Megatron's is_embedding_or_output_parameter: the decoupled lr's parameters."""
        if self.pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and hasattr(self, "output_layer"):
            self.output_layer.weight.is_embedding_or_output_parameter = True

    def _mark_shared_embedding(self):
        """Megatron's shared_embedding / shared attributes for a table tied across stages."""
        if not self.config.tie_embeddings or (self.pre_process and self.post_process):
            return
        if self.pre_process:
            self.embedding.word_embeddings.weight.shared_embedding = True
        if self.post_process:
            self.output_layer.weight.shared = True
            self.output_layer.weight.shared_embedding = True

    def output_weight(self) -> torch.Tensor:
        """The [V/t, h] matrix of the output layer (the embedding table when tied on one stage)."""
        if hasattr(self, "output_layer"):
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def set_input_tensor(self, input_tensor) -> None:
        """Hand a non-first stage the activation received from the previous stage."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor


# %% [markdown]
# The third part is the stage's input: embedded tokens on the first stage (after checking them
# when they are in host memory), the activation the schedule handed over elsewhere. It also
# refuses to train when the config asks for recompute or offload that nobody installed, so a
# run cannot silently keep every activation it was told to drop.

# %%
class StageInput:
    """The input of a chunk: embedded, dropped-out tokens or the received activation."""

    def _check_activation_policy(self):
        """ValueError when the config asks for recompute/offload that nobody installed."""
        c = self.config
        wanted = c.recompute_granularity is not None or c.fine_grained_activation_offloading
        if wanted and self.training and torch.is_grad_enabled() and not self.activation_policy_applied:
            raise ValueError("recompute_granularity / fine_grained_activation_offloading are set: "
                             "call tinytron.recompute.apply_recompute(model) after building it")

    def _stage_input(self, tokens):
        """Embedded tokens on the first stage, the received activation elsewhere; [s, b, h]."""
        if not self.pre_process:
            if self.input_tensor is None:
                raise ValueError("a non-first pipeline stage needs set_input_tensor(t) before forward")
            return self.input_tensor
        if tokens is None or tokens.dim() != 2:
            raise ValueError(f"tokens must be [b, s] on the first stage, got "
                             f"{None if tokens is None else tuple(tokens.shape)}")
        if _on_host(tokens):
            check_ids(tokens, "input_ids", self.config.vocab_size)
        sp = self.config.sequence_parallel
        emb = self.embedding.word_embeddings(tokens)  # SP: reduce-scattered [s/t, b, h]
        if not sp:
            emb = emb.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        with _fork(self.rng_tracker, sp and self.config.dropout > 0 and self.training):
            return F.dropout(emb, self.config.dropout, self.training)


# %% [markdown]
# The positions of this rank's tokens (its CP chunks when $c > 1$) become the RoPE tables:
# [page B.2](layers.py)'s `rope_cos_sin`, in the activations' dtype. The default positions
# $0 \dots s-1$ (or this CP rank's chunks) are the same in every step, so their tables are
# built **once per sequence length** and cached, shaped $[s, 1, d]$ to broadcast over the
# batch (Megatron caches its `RotaryEmbedding` output per length too, an `lru_cache` on
# `forward`, `megatron/core/models/common/embeddings/rotary_pos_embedding.py:177`). Explicit
# `position_ids` that restart per document are data, built per batch, unless they are host
# tensors equal to the default (on a GPU that comparison would be a host sync).

# %%
class RopeTables:
    """cos/sin tables of this rank's positions, cached for the default positions."""

    def _rope_tables(self, hidden, position_ids):
        """cos/sin [s, b or 1, d] in the activations' dtype for this rank's tokens."""
        tp = self.grid.size("tp")
        s_local = hidden.shape[0] * (tp if self.config.sequence_parallel else 1)
        b = hidden.shape[1]
        if position_ids is not None and tuple(position_ids.shape) != (b, s_local):
            raise ValueError(f"position_ids must be [b, s] = {(b, s_local)}, "
                             f"got {tuple(position_ids.shape)}")
        if position_ids is None or self._default_positions(position_ids, s_local):
            return self._cached_rope_tables(s_local, hidden.device, hidden.dtype)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rotary_base,
                                hidden.dtype)
        return cos.transpose(0, 1), sin.transpose(0, 1)

    def _default_positions(self, position_ids, s_local) -> bool:
        """True for host ids equal to this rank's default positions (a device would sync: no)."""
        if position_ids.device.type != "cpu" or self.grid.size("cp") > 1:
            return False
        return bool((position_ids == torch.arange(s_local)).all())

    def _cached_rope_tables(self, s_local, device, dtype):
        """The tables of the default positions, built once per (length, device, dtype)."""
        key = (s_local, str(device), dtype)
        if key not in self._rope_cache:
            with torch.inference_mode(False):  # a cache filled under inference must train too
                self._rope_cache[key] = self._build_rope_tables(s_local, device, dtype)
        return self._rope_cache[key]

    def _build_rope_tables(self, s_local, device, dtype):
        cp = self.grid.size("cp")
        idx = (cp_positions(s_local * cp, cp, self.grid.rank("cp")) if cp > 1
               else torch.arange(s_local)).to(device)
        cos, sin = rope_cos_sin(idx, self.config.head_dim, self.config.rotary_base, dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)   # [s, 1, d]: broadcast over the batch


# %% [markdown]
# The head gathers the sequence-parallel sequence, computes logits against its vocabulary slice,
# and, given labels, the vocab-parallel per-token loss. Shapes for the tiny config at TP 2 with
# SP, $b = 2$: the final norm sees $[32, 2, 64]$, the gather makes it $[64, 2, 64]$, the output
# layer gives $[64, 2, 256]$ (half of $V = 512$), transposed to logits $[2, 64, 256]$; the loss
# is $[2, 64]$ and equal on both TP ranks.

# %%
class OutputHead:
    """Final norm, output layer and the per-token loss of the last chunk."""

    def _head(self, hidden, labels):
        """Final norm, output layer (gathering the SP sequence), and the loss when labels are given."""
        x = self.decoder.final_layernorm(hidden)
        if self.config.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.grid)
        else:
            x = copy_to_tp_region(x, self.grid)
        head = getattr(self, "output_layer", None)  # a call: its pre-hooks run (see OutputLayer)
        logits = head(x) if head is not None else F.linear(x, self.output_weight())  # [s, b, V/t]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        if tuple(labels.shape) != tuple(logits.shape[1::-1]):
            raise ValueError(f"labels must be [b, s] = {tuple(logits.shape[1::-1])}, "
                             f"got {tuple(labels.shape)}")
        if _on_host(labels):
            check_ids(labels, "labels", self.config.vocab_size)
        # the loss reads the logits where the output layer wrote them, [s, b, V/t] rows, and
        # only the small [s, b] loss is transposed to [b, s]
        if use_triton(self.config.kernels, logits.device):
            # appendix C: reads the logits in their dtype
            loss = fused_vocab_parallel_cross_entropy(logits, labels.t().contiguous(), self.grid)
        else:
            loss = vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous(), self.grid)
        return loss.t().contiguous()


# %% [markdown]
# The forward runs the parts in Megatron's argument order: check, the stage's input, the RoPE
# tables of this rank's positions, the layers (or
# [chapter 06's](../06_recompute_offload/recompute.py) recompute loop), and the head on the last
# stage. It refuses a mask under which some query sees no key, and ids outside
# `[0, vocab_size)` (`check_attention_mask`, `check_ids`), when these tensors are in host memory.
#
# <details><summary>Why these checks, and why only on the host</summary>
#
# Hugging Face masks use the opposite convention (1 = keep): passed here, such a mask hides
# every key from every query, and attention over nothing still returns finite numbers. On the
# host the check reads a few kilobytes; on a GPU it would stop the host until the device caught
# up (a host sync in every forward), so device tensors are checked by the code that made the
# batch, on the host before the copy (chapter 04's `get_batch` with `vocab_size=`,
# `check_token_ids`).
#
# </details>

# %%
class StageForward:
    """GPTModel's forward: input, RoPE tables, layers, head; reads what the other parts build."""

    def forward(self, input_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, s, V/t], per-token fp32 loss [b, s] (labels given), or hidden [s, b, h].

        The argument order and names are Megatron's (`GPTModel.forward(input_ids, position_ids,
        attention_mask, ..., labels=)`, `megatron/core/models/gpt/gpt_model.py`).
        """
        self._check_activation_policy()
        if attention_mask is not None and _on_host(attention_mask):
            check_attention_mask(attention_mask)
        hidden = self._stage_input(input_ids)
        cos, sin = self._rope_tables(hidden, position_ids)
        dropout_on = self.config.dropout > 0 and self.training
        with _fork(self.rng_tracker, dropout_on and self.config.sequence_parallel):
            if self.layer_runner is not None:
                hidden = self.layer_runner(self.decoder.layers, hidden, cos, sin, attention_mask)
            else:
                for layer in self.decoder.layers:
                    hidden = layer(hidden, cos, sin, attention_mask)
        if not self.post_process:
            return hidden
        return self._head(hidden, labels)


# %% [markdown]
# Finally the class itself. Its constructor checks the layout, keeps the grid, the stage's role
# and the hooks chapter 06 fills in, builds the parts and draws the init.

# %%
class GPTModel(ChunkParts, StageFlags, StageInput, RopeTables, OutputHead, StageForward,
               nn.Module):
    """One pipeline chunk of the Llama-style GPT (the whole model when pp = 1).

    Example::

        model = GPTModel(tiny_config())                     # one process, whole model
        loss = model(input_ids, labels=labels)              # per-token fp32 loss [b, s]
        logits = model(input_ids, position_ids, attention_mask)  # [b, s, V]; mask True = masked
    """

    def __init__(self, config: ModelConfig, grid: ParallelGrid | None = None, *,
                 pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, rng_tracker=None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 initialize: bool = True):
        super().__init__()
        grid = grid if grid is not None else ParallelGrid.single()
        config.check_layout(tp=grid.size("tp"), cp=grid.size("cp"))
        start, end = layer_range if layer_range is not None else (0, config.num_layers)
        if not 0 <= start <= end <= config.num_layers:
            raise ValueError(f"layer_range {layer_range} is outside [0, {config.num_layers}]")
        if rng_tracker is None and config.dropout > 0:
            rng_tracker = get_rng_tracker(grid.device)  # seeded by model_parallel_seed (app. A)
        self.config, self.grid, self.rng_tracker = config, grid, rng_tracker
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_offset, self.input_tensor = start, None
        # Chapter 06's apply_recompute installs the full-recompute loop here and sets the flag.
        self.layer_runner, self.activation_policy_applied = None, False
        self._rope_cache: dict = {}   # (length, device, dtype) -> RoPE tables of 0..s-1
        self._build(config, grid, start, end, rng_tracker)
        device = device if device is not None else grid.device
        self.to(device=device, dtype=dtype)  # e.g. bf16 params; the init is drawn in fp32
        if initialize:  # a loader that overwrites every weight skips the draw
            init_parameters(self)


# %% [markdown]
# Every parameter is drawn as its *full* tensor from (seed, global name) and then sharded, so
# the same seed gives the same model on any layout; and a pipeline rank builds its chunks.
#
# <details><summary>Megatron detail: the init is layout-free</summary>
#
# <p>Megatron's default GPU init draws each TP shard on its own rank under the
# <code>model-parallel-rng</code> fork (<code>_initialize_affine_weight_gpu</code>,
# <code>megatron/core/tensor_parallel/layers.py:137-148</code>), so its weights depend on the
# layout; only <code>--use-cpu-initialization</code> draws a full master weight and splits it
# (<code>:152-178</code>). tinytron always draws the full tensor from the seed and the global name,
# which is what lets every layout test compare with one process. The checks of the model's
# inputs (<code>check_ids</code>, <code>check_attention_mask</code>) live in
# <code>tinytron.model._checks</code> and are re-exported here.</p>
#
# </details>

# %%
@torch.no_grad()
def init_parameters(model: GPTModel) -> None:
    """Fill every parameter with its shard of the full tensor drawn from (seed, global name)."""
    grid, config = model.grid, model.config
    for name, param in model.named_parameters():
        full_name = global_parameter_name(name, model.layer_offset)
        if full_name == "output_layer.weight" and config.tie_embeddings:
            full_name = "embedding.word_embeddings.weight"  # the tied copy starts equal
        spec = param.shard_spec
        full = init_full_tensor(spec, config.seed, full_name)
        param.copy_(shard_of(full, spec, grid.rank("tp"), grid.size("tp")))


# %% [markdown]
# A pipeline rank needs two more things: the shape of the activation its stages send and receive,
# and its model chunks, one per virtual stage.

# %%
def stage_tensor_shape(config: ModelConfig, grid: ParallelGrid,
                       micro_batch_size: int) -> tuple[int, int, int]:
    """Shape [s/(c t if SP else c), b, h] of the activation sent between pipeline stages."""
    split = grid.size("cp") * (grid.size("tp") if config.sequence_parallel else 1)
    return (config.seq_length // split, micro_batch_size, config.hidden_size)


def build_stage_models(config: ModelConfig, grid: ParallelGrid | None = None,
                       num_virtual_stages: int = 1, rng_tracker=None,
                       device: torch.device | str | None = None,
                       dtype: torch.dtype | None = None,
                       initialize: bool = True) -> list[GPTModel]:
    """This pipeline rank's model chunks (one per virtual stage), in schedule order."""
    grid = grid if grid is not None else ParallelGrid.single()
    pp, rank = grid.size("pp"), grid.rank("pp")
    config.check_layout(tp=grid.size("tp"), cp=grid.size("cp"), pp=pp,
                        num_virtual_stages=num_virtual_stages)
    ranges = stage_layer_ranges(config.num_layers, pp, num_virtual_stages, rank)
    last = len(ranges) - 1
    return [GPTModel(config, grid, pre_process=(rank == 0 and k == 0),
                     post_process=(rank == pp - 1 and k == last), layer_range=r,
                     rng_tracker=rng_tracker, device=device, dtype=dtype,
                     initialize=initialize)
            for k, r in enumerate(ranges)]


# %% [markdown]
# ## Demo: the tiny model, trained for a moment, and its TP 2 twin
#
# The tiny config ($h = 64$, 2 layers, 4 query heads in 2 groups, $f = 128$, $V = 512$,
# $s = 64$): its parameters are exactly `count_parameters`, and at init the loss is close to
# $\ln V = 6.24$ (the logits are almost flat).

# %%
if __name__ == "__main__":
    import math

    import matplotlib.pyplot as plt

    from tinytron.launch import run_on_ranks
    from tinytron.model import _workers
    from tinytron.model.config import count_parameters, tiny_config

    config = tiny_config()
    model = GPTModel(config)
    for name, p in list(model.named_parameters())[:8]:
        print(f"{name:<48} {str(tuple(p.shape)):>10}")
    num_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {num_params:,} (count_parameters: {count_parameters(config):,})")

# %% [markdown]
# A few dozen Adam steps on a repeating sequence: the loss starts near $\ln V$ and falls.

# %%
if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    period = torch.randint(0, config.vocab_size, (16,), generator=g)
    seq = period.repeat(5)[: config.seq_length + 1].expand(4, -1)  # 4 rows of a period-16 text
    tokens, labels = seq[:, :-1], seq[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        loss = model(tokens, labels=labels).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"loss at init {losses[0]:.3f} (ln V = {math.log(config.vocab_size):.3f}), "
          f"after 40 steps {losses[-1]:.3f}")
    plt.figure(figsize=(5, 2.5))
    plt.plot(losses)
    plt.xlabel("step")
    plt.ylabel("mean token loss")
    plt.title("tiny GPT learns a period-16 sequence")
    plt.tight_layout()
    plt.show()

# %% [markdown]
# Then two ranks run the same model with TP 2 and sequence parallelism and compare logits, loss
# and every gradient with the single process on the same batch.

# %%
if __name__ == "__main__":
    gaps = run_on_ranks(_workers.layout_parity, 2, 2, 1, True, True, timeout=120)[0]
    print("TP2 + SP vs one process (packed batch):",
          {k: f"{v:.1e}" for k, v in gaps.items() if k.endswith("gap")})

    assert num_params == count_parameters(config)
    assert abs(losses[0] - math.log(config.vocab_size)) < 0.5 and losses[-1] < 1.0
    assert max(gaps["logits_gap"], gaps["loss_gap"], gaps["grad_gap"]) < 1e-5

# %% [markdown]
# ## Summary
#
# - One `GPTModel` class is every layout: `grid` decides TP/CP, `sequence_parallel` in the
#   config decides SP, and `pre_process` / `post_process` / `layer_range` cut pipeline chunks;
#   `build_stage_models` hands a pipeline rank its chunks, virtual stages included.
# - A table tied across stages is a second copy on the last stage, drawn from the same name and
#   flagged so that chapter 05 sums the two gradients and the grad norm counts it once.
# - The output layer is a module so that pre-forward hooks see its weight; the default RoPE
#   tables are built once per sequence length.
# - Because every weight is drawn in full from `(seed, name)`, the tests can demand that TP 2
#   (SP on and off), CP 2, TP 2 × CP 2 and PP 2 reproduce the single-process logits, losses and
#   gradients to fp32 rounding.
#
# ## How production does it
#
# - Megatron: `megatron/core/models/gpt/gpt_model.py` (the model, `_preprocess`, `_postprocess`),
#   `megatron/core/transformer/transformer_block.py` (the layer loop, the SP RNG fork,
#   `set_input_tensor`), `megatron/core/models/common/language_module/language_module.py`
#   (loss, tied embeddings) and `megatron/core/pipeline_parallel/schedules.py:2057` (the shapes
#   the stages exchange).
# - torchtitan: `torchtitan/models/llama3/model/model.py`, whose `Transformer` holds the
#   embedding, the layers and the output projection in one class; a pipeline stage is the same
#   class with the parts it does not own set to `None`.
#
# ## Exercises
#
# 1. The running example's chunk caches its default RoPE tables ($s = 4096$, $d = 128$, CP 1,
#    bf16). How many bytes does the cache hold, and how many would rebuilding the tables in
#    every forward allocate over a step of $m = 8$ micro-batches?
#
#    <details><summary>Answer</summary>
#
#    cos and sin are $[s, 1, d] = [4096, 1, 128]$ each: $4096 \cdot 128 \cdot 2$ B = 1 MiB, so
#    2 MiB cached, once. Rebuilt, every forward allocates those 2 MiB again (and computes the
#    powers, outer product and trigonometry): $8 \times 2 = 16$ MiB per step on each chunk.
#
#    </details>
#
# 2. What does `stage_tensor_shape` give for the running example (TP 2 with SP, CP 1,
#    $b = 2$, $s = h = 4096$, bf16), and how many bytes cross the one stage boundary per step?
#
#    <details><summary>Answer</summary>
#
#    $[s/(c t), b, h] = [2048, 2, 4096]$: 16,777,216 elements, 32 MiB in bf16. Each of the
#    $m = 8$ micro-batches sends its activation forward and receives its gradient (same shape)
#    back: $8 \times 2 \times 32 = 512$ MiB per step between each pair of neighboring ranks.
#
#    </details>
#
# 3. The running example ties the embedding ($V = 128256$, $h = 4096$) across PP 2 at TP 2.
#    How many elements of the table does a last-stage rank hold, and how many gradient
#    elements must it sum with a first-stage rank every step?
#
#    <details><summary>Answer</summary>
#
#    Its <code>output_layer.weight</code> is a $[V/t, h]$ shard of its own copy:
#    $64128 \times 4096 = 262{,}668{,}288$ elements. Chapter 05's
#    <code>finalize_model_grads</code> sums that shard's gradient over the <code>embd</code>
#    group (the first- and last-stage ranks with the same TP rank): the same 262,668,288
#    elements. With $p = 1$ the table is one tensor and nothing is summed.
#
#    </details>
