# %% [markdown]
# # 07.1 · Memory: Megatron's own estimate, exactly as it computes it
#
# Before a single GPU allocates anything, Megatron prints a line such as
# `Theoretical memory footprints: weight and optimizer=11846.75 MB, activation=16416.06 MB`.
# This page rebuilds that number, branch for branch, so that the rest of the chapter can say
# precisely where it is right and where it is not.
#
# You will build: `megatron_args`, `megatron_param_counts`,
# `compute_weight_and_optimizer_memory`, `compute_activation_memory`,
# `compute_activation_memory_without_sp` and `megatron_theoretical_memory`.

# %%
from __future__ import annotations

import math
from types import SimpleNamespace

__all__ = [
    "NUM_BYTES_IN_MEGABYTE",
    "megatron_args",
    "megatron_param_counts",
    "compute_weight_and_optimizer_memory",
    "compute_activation_memory",
    "compute_activation_memory_without_sp",
    "megatron_theoretical_memory",
]

NUM_BYTES_IN_MEGABYTE = 1024 * 1024

# %% [markdown]
# ## Where the estimate lives and when it is printed
#
# `megatron/training/theoretical_memory_usage.py` (all line numbers below are in that file at
# `e03878b5f`) has three functions and a reporter:
#
# | function | line | what it returns |
# |---|---|---|
# | `compute_weight_and_optimizer_memory` | `:12` | bytes of params + grads + optimizer state on the most loaded rank |
# | `compute_activation_memory` | `:280` | activation bytes, "Table 2" of Korthikanti et al. 2022, first stage |
# | `compute_activation_memory_without_sp` | `:354` | activation bytes, a second formula |
# | `report_theoretical_memory` | `:428` | picks one activation formula (`:438`) and prints MiB |
#
# The trainer calls the reporter once, on rank 0, at the first logged iteration
# (`megatron/training/training.py:2698`), passing the number of micro-batches. The reporter
# takes Megatron's parsed command-line `args`, so this page speaks in those names:
# `hidden_size`, `num_layers`, `num_attention_heads`, `group_query_attention`,
# `num_query_groups`, `kv_channels`, `ffn_hidden_size`, `swiglu`, `padded_vocab_size`,
# `seq_length`, `micro_batch_size`, `tensor_model_parallel_size`, `sequence_parallel`,
# `pipeline_model_parallel_size`, `virtual_pipeline_model_parallel_size`,
# `context_parallel_size`, `data_parallel_size`, `use_distributed_optimizer`,
# `untie_embeddings_and_output_weights`, `recompute_granularity`, `normalization`, and the
# MoE / MLA / MTP arguments for the models that have them.
#
# `megatron_args` fills the arguments a caller leaves out with the values Megatron's argument
# parser and `validate_args` would give them (`megatron/training/arguments.py`): `kv_channels =
# h / a`, `normalization = "LayerNorm"`, `add_bias_linear = True`,
# `expert_tensor_parallel_size = tensor_model_parallel_size`, `data_parallel_size = world /
# (t · p · c)`, `padded_vocab_size` = the vocabulary rounded up to a multiple of $128\,t$.
# It works on a copy: Megatron's function overwrites `args.num_query_groups` when GQA is off
# (`:17-18`), and the caller's object should not change.

# %%
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size")

_DEFAULTS = dict(
    group_query_attention=False, num_query_groups=1, kv_channels=None, ffn_hidden_size=None,
    swiglu=False, normalization="LayerNorm", untie_embeddings_and_output_weights=False,
    padded_vocab_size=None, vocab_size=None, make_vocab_size_divisible_by=128,
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
    data_parallel_size=None, world_size=None, sequence_parallel=False,
    use_distributed_optimizer=False, recompute_granularity=None, num_experts=None,
    moe_layer_freq=1, moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None,
    moe_shared_expert_gate=False, moe_router_topk=2, add_bias_linear=True,
    expert_tensor_parallel_size=None, expert_model_parallel_size=1, mtp_num_layers=None,
    multi_latent_attention=False, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128,
    qk_pos_emb_head_dim=64, v_head_dim=128, hybrid_layer_pattern=None,
    hybrid_override_pattern=None,
)

# %% [markdown]
# `megatron_args` merges what the caller gives over those defaults, then derives the values
# `validate_args` would derive: `kv_channels`, the FFN width, the data-parallel size or the
# world, and the padded vocabulary.

# %%
def megatron_args(args=None, **overrides) -> SimpleNamespace:
    """A copy of `args` (object or dict) plus overrides, with Megatron's defaults filled in."""
    given = dict(args or {}) if args is None or isinstance(args, dict) else dict(vars(args))
    given.update(overrides)
    missing = [k for k in _REQUIRED if given.get(k) is None]
    if missing:
        raise ValueError(f"megatron args: {missing[0]} is required")
    a = SimpleNamespace(**{**_DEFAULTS, **{k: v for k, v in given.items() if v is not None}})
    if a.kv_channels is None:
        a.kv_channels = a.hidden_size // a.num_attention_heads
    if a.ffn_hidden_size is None:  # validate_args: 4h, or 2/3 of it rounded to 64 for SwiGLU
        a.ffn_hidden_size = (int(4 * a.hidden_size * 2 / 3 / 64) * 64 if a.swiglu
                             else 4 * a.hidden_size)
    if a.moe_ffn_hidden_size is None:
        a.moe_ffn_hidden_size = a.ffn_hidden_size
    if a.expert_tensor_parallel_size is None:
        a.expert_tensor_parallel_size = a.tensor_model_parallel_size
    t, p, c = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
    if a.data_parallel_size is None and a.world_size is None:
        raise ValueError("megatron args: data_parallel_size (or world_size) is required")
    if a.data_parallel_size is None:
        a.data_parallel_size = a.world_size // (t * p * c)
    if a.world_size is None:
        a.world_size = a.data_parallel_size * t * p * c
    if a.padded_vocab_size is None:
        if a.vocab_size is None:
            raise ValueError("megatron args: padded_vocab_size (or vocab_size) is required")
        multiple = a.make_vocab_size_divisible_by * t
        a.padded_vocab_size = math.ceil(a.vocab_size / multiple) * multiple
    if not a.group_query_attention:  # Megatron does this in place (:17-18)
        a.num_query_groups = a.num_attention_heads
    return a


# %% [markdown]
# ## Weights and optimizer: a count, a most loaded shard, bytes per parameter
#
# **The count** (`:82-163`), with $h$ hidden, $a$ heads, $g$ query groups, $d_{kv}$
# `kv_channels`, $f$ FFN width, $V$ padded vocabulary, $\eta = 3/2$ for SwiGLU (1 otherwise),
# $n = 1$ for RMSNorm (2 for LayerNorm, which has a bias):
#
# - attention per layer $A = 2 h^2 (1 + g/a)\,(a d_{kv} / h)$ — Q and O are $h \times a d_{kv}$,
#   K and V together $2 h g d_{kv}$;
# - MLP per layer $M = 2 h f \eta$; two norms per layer $N = 2 h n$; final norm $n h$;
# - embedding $hV$, counted twice when untied.
#
# **The most loaded shard** (`:198-239`) is assumed to be the first pipeline stage: its $1/p$
# of the TP-sharded layer weights plus one whole embedding, all over $t$, plus its $1/p$ of the
# replicated weights (norms, routers), plus experts over `etp · ep`. A second $hV/t$ is added
# only when the embeddings are untied **and** $p = 1$ (`:237-239`).
#
# **Bytes per parameter** (`:265-268`): 18 without the distributed optimizer — 2 (bf16 weight) +
# 4 (fp32 grad) + 4 (fp32 master) + 4 + 4 (Adam moments) — and $6 + 12/d$ with it, where $d$
# is `data_parallel_size` (expert weights use the expert data-parallel size
# `world / (etp · ep · p)`, an integer division). When `etp · ep · p` exceeds the world that
# size is 0: without the distributed optimizer Megatron still returns its number (18 bytes per
# expert parameter, the size unused), and so does this function; with it Megatron divides by
# zero, and this function raises a `ValueError` naming the product instead.
#
# Worked example, the book's 7B model at TP 2 · PP 2 · DP 64 with the distributed optimizer:
#
# | quantity | value |
# |---|---|
# | $A$, $M$, $N$ per layer | 41,943,040 · 176,160,768 · 8,192 |
# | TP-sharded on the first stage | $(218{,}103{,}808 \cdot 32/2 + 525{,}336{,}576)/2$ = 2,007,498,752 |
# | replicated on the first stage | $(8{,}192 \cdot 32 + 4{,}096)/2$ = 133,120 |
# | bytes per parameter | $6 + 12/64 = 6.1875$ |
# | **weight + optimizer** | $2{,}007{,}631{,}872 \cdot 6.1875$ = **12,422,222,208 B** (11,846.75 MiB) |

# %%
def _moe_layer_pattern(a) -> list[int]:
    """1 for an MoE layer, 0 for a dense one (moe_layer_freq as an int or an explicit list)."""
    if a.num_experts is None:
        return [0] * a.num_layers
    if isinstance(a.moe_layer_freq, int):
        return [1 if i % a.moe_layer_freq == 0 else 0 for i in range(a.num_layers)]
    if len(a.moe_layer_freq) != a.num_layers:
        raise ValueError(f"moe_layer_freq has {len(a.moe_layer_freq)} entries, "
                         f"num_layers is {a.num_layers}")
    return list(a.moe_layer_freq)


def _attention_params(a, norm: int) -> float:
    """Parameters of one attention block: GQA (:82-93) or multi-latent attention (:62-80)."""
    h = a.hidden_size
    if not a.multi_latent_attention:
        ratio = a.kv_channels * a.num_attention_heads / h
        return 2 * h * h * ((1 + a.num_query_groups / a.num_attention_heads) * ratio)
    heads, rope = a.num_attention_heads, a.qk_pos_emb_head_dim
    q = (h * heads * (a.qk_head_dim + rope) if a.q_lora_rank is None
         else a.q_lora_rank * (h + heads * (a.qk_head_dim + rope) + norm))
    return (q + a.kv_lora_rank * (h + heads * (a.qk_head_dim + a.v_head_dim) + norm)
            + h * rope + heads * a.v_head_dim * h)

# %% [markdown]
# With the two helpers in place, the counts by kind follow Megatron's function line by line:
# first the parameters of one block of each kind, then how many of each the model has, and
# how they split into TP-sharded, replicated and expert parameters (the three scale differently
# below).

# %%
def megatron_param_counts(a) -> dict[str, float]:
    """Megatron's parameter counts by kind (:12-163), for args filled by megatron_args."""
    h, norm = a.hidden_size, (1 if a.normalization == "RMSNorm" else 2)
    glu = 3 / 2 if a.swiglu else 1
    pattern = _moe_layer_pattern(a)
    moe, dense = sum(pattern), a.num_layers - sum(pattern)
    mtp = a.mtp_num_layers or 0
    mtp_moe = pattern[-1] * mtp if a.num_experts is not None else 0
    experts = 1 if a.num_experts is None else a.num_experts
    shared = 2 * h * (a.moe_shared_expert_intermediate_size or 0) * glu
    c = dict(attention=_attention_params(a, norm), dense_mlp=2 * h * a.ffn_hidden_size * glu,
             shared_expert=shared, layernorm=2 * h * norm,
             routed_expert=2 * h * (a.moe_ffn_hidden_size if a.num_experts else 0) * experts * glu,
             router=(h * experts + (experts if a.add_bias_linear else 0)) if a.num_experts else 0,
             shared_gate=h if shared > 0 and a.moe_shared_expert_gate else 0,
             embedding=h * a.padded_vocab_size, final_layernorm=norm * h,
             num_dense_layers=dense, num_moe_layers=moe,
             mtp_dense_layers=mtp - mtp_moe, mtp_moe_layers=mtp_moe)
    c["tp_sharded_block"] = ((c["attention"] + c["dense_mlp"]) * dense
                             + (c["attention"] + shared) * moe)
    c["replicated_block"] = (c["layernorm"] * dense + (c["layernorm"] + c["router"]
                             + c["shared_gate"]) * moe + c["final_layernorm"])
    c["expert_block"] = c["routed_expert"] * moe
    c["tp_sharded_mtp"] = ((c["attention"] + c["dense_mlp"]) * (mtp - mtp_moe)
                           + (c["attention"] + shared) * mtp_moe)
    c["replicated_mtp"] = (c["layernorm"] * (mtp - mtp_moe)
                           + (c["layernorm"] + c["router"] + c["shared_gate"]) * mtp_moe)
    c["expert_mtp"] = c["routed_expert"] * mtp_moe
    layer_dense = c["attention"] + c["dense_mlp"] + c["layernorm"]
    layer_moe = (c["attention"] + shared + c["routed_expert"] + c["layernorm"] + c["router"]
                 + c["shared_gate"])
    embeddings = (2 if a.untie_embeddings_and_output_weights else 1) * c["embedding"]
    c["total"] = (layer_dense * (dense + mtp - mtp_moe) + layer_moe * (moe + mtp_moe)
                  + c["final_layernorm"] + embeddings)
    return c

# %% [markdown]
# The bytes of the most loaded shard: each of the three kinds is divided by the parallelism
# that cuts it, then multiplied by Megatron's bytes per parameter: 18 without the distributed
# optimizer, $6 + 12/d$ with it ($d$ the data-parallel size, or the expert data-parallel size
# for expert parameters).

# %%
def compute_weight_and_optimizer_memory(a) -> float:
    """Bytes of weights, grads and optimizer state on the most loaded shard (:12-277)."""
    c = megatron_param_counts(a)
    t, p = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    etp_ep = a.expert_tensor_parallel_size * a.expert_model_parallel_size
    tp_sharded = (c["tp_sharded_block"] / p + c["tp_sharded_mtp"] + c["embedding"]) / t
    replicated = c["replicated_block"] / p + c["replicated_mtp"]
    expert = (c["expert_block"] / p + c["expert_mtp"]) / etp_ep
    if a.untie_embeddings_and_output_weights and p == 1:
        tp_sharded += c["embedding"] / t

    def bytes_per_param(dp: int) -> float:
        return 18 if not a.use_distributed_optimizer else 6 + (12 / dp)

    expert_dp = a.world_size // (etp_ep * p)  # 0 when etp * ep * pp > world, as in Megatron
    if expert_dp == 0 and a.use_distributed_optimizer:  # Megatron: 12 / 0, ZeroDivisionError
        raise ValueError(f"expert_model_parallel_size: etp * ep * pp = {etp_ep * p} exceeds the "
                         f"world size {a.world_size}, so the expert DP size is 0 (Megatron "
                         "divides by it)")
    return ((tp_sharded + replicated) * bytes_per_param(a.data_parallel_size)
            + expert * bytes_per_param(expert_dp))


# %% [markdown]
# ## Activations: two formulas and a branch
#
# The reporter uses `compute_activation_memory` **only** when sequence parallelism is on
# *and* `recompute_granularity == "selective"` (`:438`); every other setting — no recompute,
# full recompute, TP without SP — goes to `compute_activation_memory_without_sp`.
#
# **With SP and selective recompute** (`:280-351`), the first stage, $s$ sequence, $b$
# micro-batch:
#
# 1. per layer $s b h\,(18 + 4 f/h)$ bytes (the paper's $34\,sbh$ for $f = 4h$; the attention
#    scores $5 a s / h$ are gone because selective recompute drops them), times $L$ — the
#    first stage holds $p$ micro-batches of $L/p$ layers each;
# 2. plus $8 s b p$ (the token ids) and $s b h p$ (the embedding dropout mask);
# 3. times $1 + (p-1)/(p v)$ with $v$ virtual stages, else times $\min(1, m/p)$ when $p > 1$;
# 4. plus $4 s b h (1 + V/h)$ for the output layer and cross-entropy, only when $p = 1$;
# 5. divided by $t$.
#
# **Otherwise** (`:354-425`): per layer $s b h (10 + 24/t)$, times $L$, the same embedding,
# interleaving and $\min(1, m/p)$ terms, plus $2 (s b V / t + s b h)$ when $p = 1$, times a
# 1.05 "overhead" factor, and **not** divided by $t$ at the end.
#
# Worked example (the 7B model, $s = 4096$, $b = 2$, $t = p = 2$, $m = 8$, SP + selective):
# per layer $4096 \cdot 2 \cdot 4096 \cdot (18 + 4 \cdot 3.5) = 1{,}073{,}741{,}824$; times 32 is
# 34,359,738,368; plus $131{,}072 + 67{,}108{,}864$; times $\min(1, 8/2) = 1$; over $t = 2$:
# **17,213,489,152 B** (16,416.06 MiB).

# %%
def _pipeline_factor(a, num_microbatches) -> float:
    """The interleaving penalty (:314-327) or the min(1, m/p) discount (:331-338)."""
    p, v = a.pipeline_model_parallel_size, a.virtual_pipeline_model_parallel_size
    if v is not None:
        return 1 + (p - 1) / (p * v)
    if p > 1 and num_microbatches is not None:
        return min(1, num_microbatches / p)
    return 1.0


def _embedding_terms(a) -> float:
    """Token ids (8 bytes each) and the embedding dropout mask, p micro-batches in flight."""
    s, b, p = a.seq_length, a.micro_batch_size, a.pipeline_model_parallel_size
    return 8 * s * b * p + s * b * a.hidden_size * p


def compute_activation_memory(a, num_microbatches=None) -> float:
    """Table 2 of Korthikanti et al. with SP and selective recompute, first stage (:280-351)."""
    s, b, h = a.seq_length, a.micro_batch_size, a.hidden_size
    memory = s * b * h * (18 + 4 * (a.ffn_hidden_size / h)) * a.num_layers
    memory += _embedding_terms(a)
    memory *= _pipeline_factor(a, num_microbatches)
    if a.pipeline_model_parallel_size == 1:
        memory += s * b * h * 4 * (1 + a.padded_vocab_size / h)
    return memory / a.tensor_model_parallel_size


def compute_activation_memory_without_sp(a, num_microbatches=None) -> float:
    """The second formula (:354-425): TP-only per-layer term, x1.05, not divided by t."""
    s, b, h, t = a.seq_length, a.micro_batch_size, a.hidden_size, a.tensor_model_parallel_size
    memory = s * b * h * (10 + 24 / t) * a.num_layers
    memory += _embedding_terms(a)
    memory *= _pipeline_factor(a, num_microbatches)
    if a.pipeline_model_parallel_size == 1:
        memory += (s * b * a.padded_vocab_size / t + s * b * h) * 2
    return memory * 1.05


# %% [markdown]
# **The reporter** (`report_theoretical_memory`, `:428-458`) adds the two parts. It first asks
# whether the model is a hybrid Mamba-Transformer: `is_hybrid_model` tests
# `args.hybrid_layer_pattern is not None` (`megatron/training/utils/common_utils.py:437-439`;
# `megatron/training/utils` is a package at this commit), and `validate_args` copies the legacy
# `hybrid_override_pattern` onto that name (`megatron/training/arguments.py:736-747`), so
# either name marks a hybrid model here too.
#
# <details><summary>Megatron detail: where tinytron raises instead</summary>
#
# For a hybrid model Megatron prints one line and returns `None` (`:429-431`); this function
# raises a `ValueError` naming `hybrid_layer_pattern`, because its callers (the ledger, the
# calculator) index the result and a `None` would surface far from its cause. tinytron
# builds no hybrid model, so no caller in the book reaches it. With the distributed optimizer
# and `etp · ep · p` larger than the world, Megatron divides by a zero expert DP size; this
# function raises instead (without the distributed optimizer both return the same number).
#
# </details>

# %%
def megatron_theoretical_memory(args=None, num_microbatches=None, **overrides) -> dict:
    """What report_theoretical_memory computes (:428-458): bytes, MiB and the branch taken."""
    a = megatron_args(args, **overrides)
    if a.hybrid_layer_pattern is not None or a.hybrid_override_pattern is not None:
        raise ValueError("hybrid_layer_pattern: Megatron has no estimate for hybrid models")
    weights = compute_weight_and_optimizer_memory(a)
    if a.sequence_parallel and a.recompute_granularity == "selective":
        branch, activation = "compute_activation_memory", compute_activation_memory(
            a, num_microbatches)
    else:
        branch, activation = "compute_activation_memory_without_sp", \
            compute_activation_memory_without_sp(a, num_microbatches)
    mib = NUM_BYTES_IN_MEGABYTE
    return {"weight_and_optimizer": weights, "activation": activation,
            "total": weights + activation, "branch": branch,
            "weight_and_optimizer_mib": weights / mib, "activation_mib": activation / mib,
            "total_mib": (weights + activation) / mib}


# %% [markdown]
# ## Demo: the running example, and the branch in action
#
# The demo feeds the book's 7B configuration in Megatron's argument names, prints the line
# Megatron would print, then flips one switch at a time to show which formula answers.

# %%
if __name__ == "__main__":
    llama7b = dict(num_layers=32, hidden_size=4096, num_attention_heads=32,
                   group_query_attention=True, num_query_groups=8, ffn_hidden_size=14336,
                   swiglu=True, normalization="RMSNorm", padded_vocab_size=128256,
                   seq_length=4096, micro_batch_size=2, tensor_model_parallel_size=2,
                   sequence_parallel=True, pipeline_model_parallel_size=2,
                   data_parallel_size=64, use_distributed_optimizer=True,
                   recompute_granularity="selective")
    ours = megatron_theoretical_memory(llama7b, num_microbatches=8)
    print(f"Theoretical memory footprints: weight and optimizer="
          f"{ours['weight_and_optimizer_mib']:.2f} MB, activation={ours['activation_mib']:.2f} MB,"
          f" total={ours['total_mib']:.2f} MB   ({ours['branch']})")
    counts = megatron_param_counts(megatron_args(llama7b))
    untied = megatron_param_counts(megatron_args(llama7b, untie_embeddings_and_output_weights=True))
    print(f"parameters: {counts['total']:,.0f} tied, {untied['total']:,.0f} untied")

    assert ours["weight_and_optimizer"] == 12_422_222_208
    assert ours["activation"] == 17_213_489_152
    assert counts["total"] == 7_504_924_672

# %% [markdown]
# Now one switch at a time. Full recompute and "no recompute" land in the same branch, and so
# does selective recompute without SP: only SP with selective recompute reaches the first formula.

# %%
if __name__ == "__main__":
    variants = {"SP + selective": {}, "no recompute": dict(recompute_granularity=None),
                "full recompute": dict(recompute_granularity="full"),
                "selective, no SP": dict(sequence_parallel=False),
                "VPP 2": dict(virtual_pipeline_model_parallel_size=2),
                "no DistOpt": dict(use_distributed_optimizer=False)}
    rows = {name: megatron_theoretical_memory(llama7b, 8, **change)
            for name, change in variants.items()}
    for name, r in rows.items():
        print(f"{name:>17}: weights+opt {r['weight_and_optimizer_mib']:>9,.1f} MiB   activation "
              f"{r['activation_mib']:>9,.1f} MiB   via {r['branch']}")

    assert rows["full recompute"]["activation"] == rows["no recompute"]["activation"], \
        "full recompute is not modelled: it lands in the same branch as no recompute"
    assert rows["selective, no SP"]["branch"] == "compute_activation_memory_without_sp"

# %% [markdown]
# The same six rows as bars: the recompute, SP and VPP switches move only the activation bar;
# dropping the distributed optimizer nearly triples the weight bar (18 bytes a parameter
# instead of 6.1875).

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.8))
    names = list(rows)
    ax.barh(names, [rows[n]["weight_and_optimizer"] / 2**30 for n in names],
            label="weights + optimizer")
    ax.barh(names, [rows[n]["activation"] / 2**30 for n in names],
            left=[rows[n]["weight_and_optimizer"] / 2**30 for n in names], label="activations")
    ax.set_xlabel("GiB per GPU (Megatron's estimate)")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## What the estimate leaves out
#
# The two formulas are a compact summary of one paper's table, and they inherit its
# assumptions. The next pages build the exact ledger and measure it; here is the list of the
# places where the two will disagree, each checked with numbers later in the chapter:
#
# - **GQA.** Activations use $h$ for K and V; with 8 KV groups of 32 heads they are 4× smaller.
# - **SwiGLU.** The MLP term is $4 f/h$ of a plain MLP; a SwiGLU layer stores a $2f$-wide fc1
#   output, an $f$-wide activation and an $f$-wide product.
# - **CP.** Neither formula divides by the context-parallel size, and the distributed
#   optimizer's divisor is `data_parallel_size` without CP, although Megatron's optimizer
#   shards over DP × CP.
# - **Full recompute** is not modelled: it falls into the second formula, which also assumes
#   no SP.
# - **Interleaving** is a single factor; **the last stage** (output layer, logits,
#   cross-entropy; the tied embedding copy for $p > 1$) is left out whenever $p > 1$.
# - **Padding** of the grad buffer, the attention kernel, temporary buffers of the optimizer
#   step, pipeline receive buffers and the allocator are not in it at all.
#
# ## How production does it
#
# - Megatron: `megatron/training/theoretical_memory_usage.py` (this page, line by line),
#   `megatron/training/training.py:2698` (when it prints), `docs/user-guide/features/dist_optimizer.md`
#   (the bytes-per-parameter table: 18 vs $6 + 12/d$ for bf16 with fp32 grads).
# - torchtitan does not estimate: it measures (`torchtitan/tools/utils.py`, the device memory
#   monitor) and leaves the arithmetic to the user.
#
# ## Exercises
#
# 1. Compute the estimate for the same model at TP 8 · PP 1 · DP 32. Which term grows, and why
#    does the second formula's $10\,sbh$ not shrink with $t$?
#
#    <details><summary>Answer</summary>
#
#    Weights and optimizer drop to 5,704.85 MiB and
#    activations to 4,617.01 MiB (SP + selective, first formula). The term that grows is the
#    output layer and cross-entropy, $4sbh(1 + V/h)$ = 4,336,910,336 B (517 MiB after $/t$),
#    counted only when $p = 1$. With SP off the second formula answers 14,341.49 MiB: its
#    $10\,sbh$ per layer (10,240 MiB over 32 layers) is the norms, dropout masks and residuals
#    outside the TP region, which every TP rank holds whole without SP; only $24\,sbh/t$
#    (3,072 MiB at $t = 8$) is split.
#
#    </details>
#
# 2. Switch to LayerNorm (`normalization="LayerNorm"`): by how many bytes does the weight term
#    change? Compare with the bracketed numbers of the facts in chapter B.1.
#
#    <details><summary>Answer</summary>
#
#    A LayerNorm has a bias, so each norm holds $2h$
#    instead of $h$: 65 norms add 266,240 parameters (7,505,190,912 in all). The first stage
#    holds $(8{,}192 \cdot 32 + 4{,}096)/2$ = 133,120 more replicated parameters, at
#    6.1875 bytes each: the weight term grows by 823,680 B (0.79 MiB). Chapter B.1 derives
#    the same count from a weight and a bias per norm.
#
#    </details>
#
# 3. Find a configuration where `min(1, m/p)` is below 1. What does the pipeline do in that case?
#
#    <details><summary>Answer</summary>
#
#    Any $m < p$: PP 4 · DP 32 with $m = 2$ gives
#    $2/4 = 0.5$, and the activation term halves, 8,623,554,560 B against 17,247,109,120 B at
#    $m = 8$. The pipeline never fills: the first stage can hold at most the $m$ micro-batches
#    that exist, and the stages wait on each other for most of the step (a large bubble).
#
#    </details>
