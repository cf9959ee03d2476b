# %% [markdown]
# # B.1 · Model: the config and its exact parameter count
#
# The dataclass that describes the Llama-style GPT every chapter trains, the checks that
# reject a shape no layout can hold, and a parameter count that is exact to the last weight,
# for the whole model and for any one rank of a TP × PP layout.
#
# You will build: `ModelConfig` (with `check_layout` and its field group `DecoderFields`),
# `tiny_config`, `llama_7b_config`, `stage_layer_ranges`, `parameter_breakdown`,
# `count_parameters` and `count_parameters_per_rank`.

# %%
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tinytron._fields import check_fields, document_fields
from tinytron.model._checks import (check_activation_fields, check_kernels, check_shape,
                                    divides as _divides)
from tinytron.model._compile import check_compile

# Megatron's vocabulary padding rule lives with the vocab-parallel layers of appendix A.
from tinytron.parallel.vocab_parallel import padded_vocab_size

__all__ = [
    "ModelConfig",
    "DecoderFields",
    "tiny_config",
    "llama_7b_config",
    "padded_vocab_size",
    "stage_layer_ranges",
    "parameter_breakdown",
    "count_parameters",
    "count_parameters_per_rank",
]

# %% [markdown]
# ## What a Llama-style decoder is made of
#
# A token id becomes a row of the embedding table ($V \times h$). Then $L$ identical layers, each
#
# 1. `input_layernorm` (RMSNorm, a weight of $h$) → self-attention: one fused projection
#    `linear_qkv` of shape $(a + 2g)\,d \times h$ ($a$ query heads, $g$ key/value groups, head
#    size $d = h / a$), RoPE on queries and keys, causal attention, output projection
#    `linear_proj` of $h \times a d$; add the residual;
# 2. `pre_mlp_layernorm` (RMSNorm) → SwiGLU MLP: `linear_fc1` ($2f \times h$, the gate and the up
#    projection stacked) → $\mathrm{silu}(\text{gate}) \cdot \text{up}$ → `linear_fc2`
#    ($h \times f$); add the residual.
#
# After the last layer a `final_layernorm` and the output layer ($V \times h$), which is the
# embedding table itself when the embeddings are tied. No linear layer has a bias.
#
# The names follow Megatron's `TransformerConfig` (`megatron/core/transformer/transformer_config.py`):
# `num_query_groups` is GQA's number of key/value heads, `ffn_hidden_size` is $f$. Megatron
# splits `hidden_dropout` and `attention_dropout`; here one `dropout` drives both.
#
# ## Which shapes a layout can hold
#
# Tensor parallelism over $t$ ranks gives each rank whole heads, whole key/value groups, a slice
# of the MLP width and a slice of the vocabulary, so $t$ must divide $a$, $g$, $f$ and $V$.
#
# <details><summary>Megatron detail: where it checks the heads</summary>
#
# Megatron checks the heads at `transformer_config.py:1202` and the groups at `:1214-1224`
# (it also lets $g < t$ by replicating key/value heads; this book keeps $t \mid g$).
#
# </details>
#
# Context parallelism over $c$ ranks cuts the sequence into $2c$ chunks
# ([appendix A](../parallel/context_parallel.py)), so
# $2c \mid s$; sequence parallelism then splits each rank's $s / c$ tokens over $t$ ranks.
# Pipeline parallelism over $p$ stages with $v$ virtual stages each hands out $L / (p v)$ layers
# per model chunk.
#
# A shape that breaks one of these rules must fail *before* any process group exists, with the
# name of the field to change: `ValueError: num_attention_heads (6) must be divisible by tp (4)`.
#
# The vocabulary is padded once, before the model is built, to a multiple of $128 t$
# (`megatron/core/tokenizers/utils/build_tokenizer.py:124`): 32,000 tokens at $t = 2$ stay 32,000;
# 50,257 (GPT-2) become 50,432.

# %%
class ShapeMethods:
    """ModelConfig's methods: the head size, a checked copy, and the layout check."""

    @property
    def head_dim(self) -> int:
        """Size d of one attention head."""
        return self.hidden_size // self.num_attention_heads

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def check_layout(self, tp: int = 1, cp: int = 1, pp: int = 1, num_virtual_stages: int = 1):
        """Raise ValueError naming the field when this shape cannot be cut into the given layout."""
        for axis, size in (("tp", tp), ("cp", cp), ("pp", pp), ("num_virtual_stages",
                                                                 num_virtual_stages)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis} must be a positive int, got {size!r}")
        _divides(tp, self.num_attention_heads, "num_attention_heads", "tp")
        _divides(tp, self.num_query_groups, "num_query_groups", "tp")
        _divides(tp, self.ffn_hidden_size, "ffn_hidden_size", "tp")
        _divides(tp, self.vocab_size, "vocab_size", "tp")
        if cp > 1:
            _divides(2 * cp, self.seq_length, "seq_length", "2 * cp")
        if self.sequence_parallel:
            _divides(tp, self.seq_length // cp, "seq_length // cp", "tp (sequence_parallel)")
        if num_virtual_stages > 1 and pp == 1:
            raise ValueError(f"num_virtual_stages ({num_virtual_stages}) > 1 needs pp > 1")
        _divides(pp * num_virtual_stages, self.num_layers, "num_layers",
                 "pp * num_virtual_stages")
        stage_layers = self.num_layers // (pp * num_virtual_stages)
        if self.recompute_num_layers is not None and self.recompute_num_layers > stage_layers:
            raise ValueError(f"recompute_num_layers ({self.recompute_num_layers}) must be <= the "
                             f"layers of one pipeline chunk ({stage_layers})")


# %% [markdown]
# That check, with the head size and a checked copy, is a small class of its own, so the rule
# reads as one piece; the config below inherits it. Example: the tiny config of the tests ($a = 4$, $g = 2$, $f = 128$,
# $V = 512$, $s = 64$, $L = 2$) passes `check_layout(tp=2, cp=2, pp=2)`: $2 \mid 4, 2, 128, 512$;
# $2 \cdot 2 = 4 \mid 64$; $2 \mid 2$ layers. At `tp=4` it stops at the first rule it breaks,
# `num_query_groups (2) must be divisible by tp (4)`; at `pp=2, num_virtual_stages=2` at
# `num_layers (2) must be divisible by pp * num_virtual_stages (4)`.
#
# ## The config
#
# Every field carries its Megatron name and a one-line docstring under it (`help(ModelConfig)`
# shows them). Construction checks the shape itself, whatever the layout: every size a positive
# int, heads dividing the width and groups dividing the heads, an even head size (RoPE rotates
# pairs), ranges for the rest; then the recompute and offload switches
# ([chapter 06](../06_recompute_offload/recompute.py)) against Megatron's module names and
# combinations (`transformer_config.py:1546-1698`), and the kernels switch against what
# [appendix C's](../kernels/roofline.py) Triton kernels can serve. Those walls of checks live in
# `tinytron.model._checks`; each message names the field to change. The last field, `compile`,
# says how the layers run, not what they hold: a resume may switch it (chapter 03 compares the
# architecture fields only), and it refuses appendix C's kernels and activation offloading
# ([C.6](../kernels/inductor.py) says why). After it, `max_position_embeddings` is the context
# the model was made for, apart from the length a run trains at (Megatron keeps the two apart,
# `--max-position-embeddings` beside `--seq-length`): an imported Llama made for 256 positions
# and fine-tuned at 128 still exports `max_position_embeddings: 256`.
#
# The fields come in two groups. The first, `DecoderFields`, is the decoder itself: the seven
# sizes, then the norm, RoPE, tying, dropout and init.

# %%
@document_fields
@dataclass
class DecoderFields:
    """ModelConfig's first fields, the decoder itself: sizes, norm, RoPE, tying, dropout, init."""

    hidden_size: int
    """Width h of the residual stream."""
    num_layers: int
    """Number L of transformer layers."""
    num_attention_heads: int
    """Query heads a; the head size is hidden_size // num_attention_heads."""
    num_query_groups: int
    """Key/value heads g of grouped-query attention (g == a is plain multi-head attention)."""
    ffn_hidden_size: int
    """Width f of the SwiGLU MLP (fc1 is 2f wide: gate and up)."""
    vocab_size: int
    """Rows V of the embedding table (already padded, see padded_vocab_size)."""
    seq_length: int
    """Training sequence length s; RoPE tables are built for it."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon (Megatron --norm-epsilon)."""
    rotary_base: int = 10000
    """RoPE theta (Megatron --rotary-base)."""
    tie_embeddings: bool = True
    """Output layer reuses the embedding table (Megatron: not --untie-embeddings-and-output-weights)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and both residual branches."""
    init_std: float = 0.02
    """Std of the normal init; fc2 and proj use init_std / sqrt(2 L) (Megatron's scaled init)."""
    seed: int = 1234
    """Seed of the parameter init; the same seed gives the same full weights on any layout."""


# %% [markdown]
# `ModelConfig` adds how a run executes that decoder (sequence parallelism, recompute, offload,
# kernels, compile) and, last, `max_position_embeddings`; construction checks them all. The
# fields keep one order, the group above first, which is the order of the constructor's
# arguments.

# %%
@document_fields
@dataclass
class ModelConfig(DecoderFields, ShapeMethods):
    """Shape and hyper-parameters of the Llama-style decoder (Megatron's names)."""

    sequence_parallel: bool = False
    """Split norms, dropout and residuals along the sequence over the TP ranks."""
    recompute_granularity: str | None = None
    """Activation recompute (chapter 06): None (store all), "full" (layer inputs only) or "selective"."""
    recompute_method: str | None = None
    """Full recompute: "uniform" (chunks of recompute_num_layers) or "block" (first N layers of a stage)."""
    recompute_num_layers: int | None = None
    """Full recompute: layers per checkpointed chunk (uniform) or layers recomputed per stage (block)."""
    distribute_saved_activations: bool = False
    """Full recompute: each TP rank keeps 1/tp of every checkpointed input (not with sequence_parallel)."""
    recompute_modules: list[str] | None = None
    """Selective recompute: any of core_attn, mlp, layernorm (None means Megatron's ["core_attn"])."""
    fine_grained_activation_offloading: bool = False
    """Move the saved activations of offload_modules to host memory in forward (chapter 06)."""
    offload_modules: list[str] | None = None
    """Any of attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm (Megatron's names)."""
    min_offloaded_tensor_size: int = 1024 * 1024
    """Saved tensors with fewer elements stay on the device (Megatron's default, 1024 * 1024)."""
    kernels: str = "torch"
    """Norms, SwiGLU, attention and loss: "torch", "triton" (appendix C) or "auto" (triton on CUDA)."""
    compile: bool = False
    """torch.compile each transformer layer (appendix C); how the layers run, not their shape."""
    max_position_embeddings: int | None = None
    """The context the model was made for (Megatron --max-position-embeddings); None = seq_length."""

    def __post_init__(self):
        check_fields(self)  # a str, float or None where the annotation says otherwise
        for check in (check_shape, check_activation_fields, check_kernels, check_compile):
            check(self)


# %% [markdown]
# <details><summary>Megatron detail: one dropout, whole groups</summary>
#
# <p>Megatron's <code>TransformerConfig</code> has separate <code>hidden_dropout</code> and
# <code>attention_dropout</code>; here one <code>dropout</code> drives both. Megatron also accepts
# fewer key/value groups than TP ranks and replicates them
# (<code>transformer_config.py:1214-1224</code>); this book requires $t \mid g$, so every TP
# rank owns whole groups and the count below stays a plain division.</p>
#
# </details>
#
# Two configs serve the whole book: `tiny_config`, small enough that every layout of the tests
# runs on two CPU cores in seconds, and `llama_7b_config`, the running example whose counts
# the next sections work out by hand.

# %%
def tiny_config(**overrides) -> ModelConfig:
    """A CPU-sized config: h 64, 2 layers, 4 heads / 2 kv groups, ffn 128, vocab 512, seq 64."""
    base = dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, vocab_size=512, seq_length=64)
    base.update(overrides)
    return ModelConfig(**base)


def llama_7b_config(**overrides) -> ModelConfig:
    """The book's running example (Llama-3-8B shape): h 4096, L 32, 32/8 heads, f 14336, V 128256."""
    base = dict(hidden_size=4096, num_layers=32, num_attention_heads=32, num_query_groups=8,
                ffn_hidden_size=14336, vocab_size=128256, seq_length=4096, rotary_base=500000)
    base.update(overrides)
    return ModelConfig(**base)


# %% [markdown]
# ## Cutting the layers into pipeline stages
#
# With $p$ stages and $v$ virtual stages (model chunks) per stage, the $L$ layers are cut into
# $p v$ equal runs. Chunk $k$ of stage $r$ holds run number $k p + r$: with $L = 8$, $p = 2$,
# $v = 2$, stage 0 holds layers 0-1 and 4-5, stage 1 holds 2-3 and 6-7, so a micro-batch
# visits stage 0, stage 1, stage 0, stage 1 (the
# [interleaved schedule of chapter 01](../01_main_loop/interleaved.py)). This is
# Megatron's `get_transformer_layer_offset` (`megatron/core/transformer/transformer_layer.py:46`)
# for an even split.

# %%
def stage_layer_ranges(num_layers: int, pp: int = 1, num_virtual_stages: int = 1,
                       pp_rank: int = 0) -> list[tuple[int, int]]:
    """The [start, end) global layer range of each model chunk held by pipeline rank `pp_rank`."""
    chunks = pp * num_virtual_stages
    if num_layers % chunks:
        raise ValueError(f"num_layers ({num_layers}) must be divisible by "
                         f"pp * num_virtual_stages ({chunks})")
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank must be in [0, {pp}), got {pp_rank}")
    per_chunk = num_layers // chunks
    return [((k * pp + pp_rank) * per_chunk, (k * pp + pp_rank + 1) * per_chunk)
            for k in range(num_virtual_stages)]


# %% [markdown]
# ## The count, exactly
#
# Per layer, with $d$ the head size:
#
# - attention: `linear_qkv` $(a + 2g) d \cdot h$ plus `linear_proj` $h \cdot a d$;
# - MLP: `linear_fc1` $2f \cdot h$ plus `linear_fc2` $h \cdot f$, so $3 h f$;
# - norms: two RMSNorm weights, $2h$.
#
# The model adds the embedding $V h$, the final norm $h$ and, when untied, an output layer $V h$.
#
# Worked example, the book's running model ($h = 4096$, $L = 32$, $a = 32$, $g = 8$, $d = 128$,
# $f = 14336$, $V = 128256$):
#
# | part | formula | count |
# |---|---|---|
# | attention / layer | $(32 + 16) \cdot 128 \cdot 4096 + 4096 \cdot 4096$ | 41,943,040 |
# | MLP / layer | $3 \cdot 4096 \cdot 14336$ | 176,160,768 |
# | norms / layer | $2 \cdot 4096$ | 8,192 |
# | 32 layers + final norm | | 6,979,588,096 |
# | embedding | $128256 \cdot 4096$ | 525,336,576 |
# | **tied total** | | **7,504,924,672** |
# | **untied total** | + output layer | **8,030,261,248** |
#
# These are the numbers of Megatron's memory model (`megatron/training/theoretical_memory_usage.py:12`,
# attention at `:82-93`, embeddings at `:95-100`).
#
# **Per rank.** A TP rank holds $1/t$ of every matrix and a full copy of every norm weight. The
# first pipeline stage holds the embedding; the last holds the final norm and an output layer —
# its own when untied, and *also* when tied but $p > 1$: the last stage then keeps a duplicate
# of the embedding table (`language_module.py:191-300`; its gradient is summed with the first
# stage's over the embedding group). For TP 2 × PP 2 the first stage holds 2,007,629,824
# parameters and the last 2,007,633,920.
#
# <details><summary>Megatron detail: its most loaded shard</summary>
#
# Megatron's memory model reports 2,007,631,872 for its
# "most loaded shard" because it spreads the final norm evenly over the stages
# (`theoretical_memory_usage.py:219-239`) — an approximation; the count below is what a rank
# really allocates, and the tests compare it with `sum(p.numel())` of the built model.
#
# </details>

# %%
def parameter_breakdown(config: ModelConfig) -> dict[str, int]:
    """Full (unsharded) parameter count of each kind of weight, per layer and model-wide."""
    h, d, f, v = config.hidden_size, config.head_dim, config.ffn_hidden_size, config.vocab_size
    a, g = config.num_attention_heads, config.num_query_groups
    return {
        "linear_qkv": (a + 2 * g) * d * h,
        "linear_proj": h * a * d,
        "linear_fc1": 2 * f * h,
        "linear_fc2": h * f,
        "layer_norms": 2 * h,
        "embedding": v * h,
        "final_layernorm": h,
        "output_layer": 0 if config.tie_embeddings else v * h,
    }


# %% [markdown]
# The model's total adds the layers and the embedding once; a tied output layer adds nothing.

# %%
def count_parameters(config: ModelConfig) -> int:
    """Total parameters of the model, each tied weight counted once."""
    parts = parameter_breakdown(config)
    per_layer = sum(parts[k] for k in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                                       "layer_norms"))
    return (config.num_layers * per_layer + parts["embedding"] + parts["final_layernorm"]
            + parts["output_layer"])


# %% [markdown]
# Per rank, the matrices divide by $t$, the norms do not, and the stages take their layers from
# `stage_layer_ranges`. The last stage also holds the output layer, or the tied duplicate when $p
# > 1$.

# %%
def count_parameters_per_rank(config: ModelConfig, tp: int = 1, pp: int = 1, pp_rank: int = 0,
                              num_virtual_stages: int = 1) -> int:
    """Parameters one rank of (tp, pp) allocates, including the last stage's tied duplicate."""
    config.check_layout(tp=tp, pp=pp, num_virtual_stages=num_virtual_stages)
    parts = parameter_breakdown(config)
    sharded = (parts["linear_qkv"] + parts["linear_proj"] + parts["linear_fc1"]
               + parts["linear_fc2"]) // tp
    num_local_layers = sum(e - s for s, e in
                           stage_layer_ranges(config.num_layers, pp, num_virtual_stages, pp_rank))
    total = num_local_layers * (sharded + parts["layer_norms"])
    if pp_rank == 0:
        total += parts["embedding"] // tp
    if pp_rank == pp - 1:
        total += parts["final_layernorm"]
        if not config.tie_embeddings or pp > 1:
            total += parts["embedding"] // tp  # own output layer, or the tied duplicate
    return total


# %% [markdown]
# ## Demo: the running example, counted
#
# The demo prints the breakdown of the running example, checks the totals above, shows the
# per-rank numbers of a TP 2 × PP 2 layout and draws where the parameters live.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    big = llama_7b_config()
    parts = parameter_breakdown(big)
    for name, n in parts.items():
        print(f"{name:>16}: {n:>15,}")
    tied, untied = count_parameters(big), count_parameters(big.replace(tie_embeddings=False))
    print(f"tied total {tied:,}   untied total {untied:,}")
    per_rank = [count_parameters_per_rank(big, tp=2, pp=2, pp_rank=r) for r in range(2)]
    print(f"TP2 x PP2, per rank: first stage {per_rank[0]:,}, last stage {per_rank[1]:,}")

# %% [markdown]
# Where the parameters live: the MLP holds most of them, the norms almost none.

# %%
if __name__ == "__main__":
    layers = big.num_layers
    labels = ["attention", "MLP", "norms", "embedding"]
    sizes = [layers * (parts["linear_qkv"] + parts["linear_proj"]),
             layers * (parts["linear_fc1"] + parts["linear_fc2"]),
             layers * parts["layer_norms"] + parts["final_layernorm"], parts["embedding"]]
    fig, ax = plt.subplots(figsize=(6, 2.4))
    ax.barh(labels, [s / 1e9 for s in sizes], color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"])
    ax.set_xlabel("parameters (billions), tied 7.50 B model")
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The totals and per-rank numbers must be those of the tables above. Then `check_layout` must
# refuse, by field name, layouts that cannot cut the model evenly.

# %%
if __name__ == "__main__":
    assert tied == 7_504_924_672 and untied == 8_030_261_248
    assert per_rank == [2_007_629_824, 2_007_633_920]
    assert padded_vocab_size(50257, tp=2) == 50432 and padded_vocab_size(32000, tp=2) == 32000
    assert stage_layer_ranges(8, pp=2, num_virtual_stages=2, pp_rank=0) == [(0, 2), (4, 6)]
    try:
        tiny_config(num_attention_heads=6, num_query_groups=6, hidden_size=96).check_layout(tp=4)
        raise AssertionError("a 6-head model must not split over 4 TP ranks")
    except ValueError as err:
        print("rejected:", err)
        assert "num_attention_heads" in str(err)
    tiny_config().check_layout(tp=2, cp=2, pp=2)   # the worked example of check_layout
    for layout, message in (({"tp": 4}, "num_query_groups (2) must be divisible by tp (4)"),
                            ({"pp": 2, "num_virtual_stages": 2}, "num_layers (2) must be "
                             "divisible by pp * num_virtual_stages (4)")):
        try:
            tiny_config().check_layout(**layout)
            raise AssertionError(f"{layout} must be rejected")
        except ValueError as err:
            assert str(err) == message, err

# %% [markdown]
# ## Summary
#
# - `ModelConfig` carries Megatron's names; `check_layout` refuses, by field name, any shape a
#   TP / CP / PP layout cannot cut evenly.
# - Per layer a GQA + SwiGLU layer holds $(a + 2g) d h + a d h + 3 h f + 2h$ weights; the running
#   example has 7,504,924,672 tied and 8,030,261,248 untied.
# - A rank allocates its $1/t$ of each matrix, every norm in its layers, and on the last stage an
#   output layer — a duplicate of the embedding when tied and $p > 1$.
#
# ## How production does it
#
# - Megatron: `megatron/core/transformer/transformer_config.py` (fields and checks),
#   `megatron/training/theoretical_memory_usage.py` (the count inside the memory model),
#   `megatron/core/transformer/transformer_layer.py:46` (layer offsets per stage),
#   `megatron/core/models/common/language_module/language_module.py:191` (tied embeddings
#   across stages).
# - torchtitan: `torchtitan/models/llama3/model/args.py` (the config) and the parameter count in
#   its `get_nparams_and_flops`.
#
# ## Exercises
#
# 1. Allow $g < t$ by replicating key/value heads as Megatron does: which checks and which counts
#    change?
#
#    <details><summary>Hint</summary>
#
#    Start from the check in <code>check_layout</code> that names
#    <code>num_query_groups</code>. With replication each TP rank holds one key/value head shared
#    by $t/g$ ranks, so the $2gdh$ of <code>linear_qkv</code> no longer divides by $t$ in
#    <code>count_parameters_per_rank</code>: a rank holds $2dh$ of it, and the replicas' gradients
#    must be summed.
#
#    </details>
#
# 2. Pad the vocabulary with `padded_vocab_size` for $V = 32000$, $t = 3$: how many rows are
#    padding, and what does it cost in parameters at $h = 4096$?
#
#    <details><summary>Answer</summary>
#
#    The rule rounds up to a multiple of $128 \cdot 3 = 384$:
#    <code>padded_vocab_size(32000, tp=3)</code> = 32,256, so 256 rows are padding. At $h = 4096$
#    that is $256 \cdot 4096 = 1{,}048{,}576$ parameters in the embedding, twice that with an
#    untied output layer.
#
#    </details>
#
# 3. Derive the count of a LayerNorm model (a weight and a bias per norm) and compare with the
#    bracketed numbers of [chapter 07](../07_memory/megatron_model.py).
#
#    <details><summary>Answer</summary>
#
#    Each norm gains a bias: $4h$ per layer instead of $2h$, and
#    $2h$ for the final norm. The running example then counts
#    $7{,}504{,}924{,}672 + 32 \cdot 2 \cdot 4096 + 4096 = 7{,}505{,}190{,}912$ tied, 266,240
#    more. Chapter 07's formula carries the same change as its $n = 2$ for LayerNorm.
#
#    </details>
