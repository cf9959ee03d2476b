# %% [markdown]
# # 07.3 · Memory: the flowing part — what one layer saves, and how many are in flight
#
# Activations are what autograd keeps from the forward pass for the backward pass. They are
# created by every micro-batch and freed by its backward, so what counts is how much *one*
# micro-batch leaves behind on a stage and how many micro-batches the schedule keeps in flight
# at once. This page lists, tensor by tensor, what a layer of appendix B's model saves — for
# GQA, SwiGLU, RMSNorm, RoPE, the attention kernel in use, dropout, SP, CP and recompute —
# then the embedding, the head, and the pipeline's in-flight count.
#
# You will build: `Saved`, `attention_kernel`, `layer_saved`, `embedding_saved`, `head_saved`,
# `chunk_saved`, `schedule_ops` and `activation_peak`.

# %%
from __future__ import annotations

import math
from dataclasses import dataclass

from tinytron.main_loop.interleaved import get_pp_rank_microbatches, get_schedule_table
from tinytron.main_loop.schedules import num_warmup_microbatches_1f1b
from tinytron.memory.states import MemoryConfig
from tinytron.model.config import stage_layer_ranges

__all__ = ["Saved", "Dims", "attention_kernel", "layer_saved", "embedding_saved", "head_saved",
           "chunk_saved", "schedule_ops", "activation_peak", "p2p_buffers", "saved_bytes"]

# %% [markdown]
# ## What one layer saves, tensor by tensor
#
# Notation for one rank: $s_c = s/c$ tokens of the sequence (context parallel), $s_r = s_c/t$
# with sequence parallelism (else $s_c$) for the residual stream, $b$ the micro-batch, $d$ the
# head size, $a_t = a/t$ query heads and $g_t = g/t$ key/value groups on this rank,
# $f_t = f/t$, $P$ bytes per parameter-dtype element (2 in bf16). Reading the model of page B.3
# op by op (`torch.autograd.graph.saved_tensors_hooks` lists the same thing; the tests compare
# the two):
#
# | module | saved tensor | bytes |
# |---|---|---|
# | RMSNorm (×2) | fp32 copy of the input, $1/\mathrm{rms}$, normalised input in $P$ | $4 s_r b h + 4 s_r b + P s_r b h$ |
# | `linear_qkv`, `linear_fc1` | their input — **all-gathered** under SP | $P s_c b h$ each |
# | RoPE | cos and sin cast to $P$, for q and for k | $4 \cdot P s_c b d$ |
# | flash attention | q, k, the whole QKV output (v is a view of it), out, logsumexp | $P s_c b (a_t + g_t + (a_t + 2 g_t) + a_t) d + 4 b a_t s_c$ |
# | SwiGLU | fc1 output ($2 f_t$), silu(gate), the product (fc2's input) | $P s_c b \cdot 4 f_t$ |
# | dropout (×2, if $p > 0$) | the mask | $M s_r b h$ |
#
# Three things differ from the paper count (Korthikanti et al., Table 2) and from Megatron's
# formula, and each is visible in the table:
#
# - **GQA** shrinks K and V: $g_t d$ instead of $h/t$.
# - **SwiGLU** stores $4 f_t$ per token, not the $2 \cdot 4h/t$ of a GELU MLP; RMSNorm keeps an
#   fp32 copy of its input (4 bytes, not 2).
# - **SP saves less than it could here.** Appendix A's column-parallel layer all-gathers the
#   sequence and hands the gathered tensor to the matmul, which saves it: the linear inputs stay
#   $P s_c b h$ per rank. Megatron saves only the local $s_r$ slice and all-gathers it again in
#   backward (`LinearWithGradAccumulationAndAsyncCommunication`,
#   `megatron/core/tensor_parallel/layers.py`); SP here shrinks the norms, dropout masks and
#   residuals only.
#
# **The kernel.** `scaled_dot_product_attention` picks a kernel. The flash kernels (CPU, and
# CUDA's FlashAttention-2) save q, k, v, the output and one fp32 logsumexp per query and head —
# nothing of size $s^2$. When the CPU flash kernel cannot run (dropout on the attention
# probabilities), the math path runs: it casts to fp32 on CPU, repeats K and V to all $a_t$
# heads (GQA is undone) and saves the scaled q, $K^T$, V, the probabilities, the dropout mask
# and the dropped probabilities: $E\,b\,a_t (s_c d + 2 s d + 3 s_c s)$ with $E = 4$ on CPU —
# the paper's $5 a s/h$ term, in fp32.
#
# **CP.** A CP rank holds $s_c$ queries but gathers the keys and values of the whole sequence:
# the flash kernel then saves the gathered K and V ($P s b g_t d$ each) instead of the QKV
# output, and an additive mask $P s_c s$ (the causal rule in global positions).
#
# **Dropout masks.** On CPU, `F.dropout` multiplies by a mask in the input's dtype ($M = P$);
# CUDA's fused kernel saves a bool mask ($M = 1$).

# %%
@dataclass(frozen=True)
class Saved:
    """One tensor autograd keeps: which module, what, how many elements of how many bytes."""

    module: str
    what: str
    elements: int
    itemsize: int
    view_elements: int | None = None
    """Elements of the saved view when it is smaller than its storage (v inside the QKV output)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's storage."""
        return self.elements * self.itemsize

    @property
    def saved_numel(self) -> int:
        """Elements of what autograd holds (what offload compares with its threshold and copies)."""
        return self.view_elements if self.view_elements is not None else self.elements

    def times(self, n: int) -> "Saved":
        """The same tensor kept by n layers (one entry, n times the elements)."""
        return Saved(self.module, f"{self.what} (x{n} layers)", self.elements * n, self.itemsize)


def saved_bytes(entries: list[Saved]) -> int:
    """Total bytes of a list of saved tensors."""
    return sum(e.nbytes for e in entries)


@dataclass(frozen=True)
class Dims:
    """The per-rank sizes every activation formula uses."""

    s_c: int
    s_r: int
    s: int
    b: int
    h: int
    d: int
    a_t: int
    g_t: int
    f_t: int
    v_t: int
    P: int

    @classmethod
    def of(cls, cfg: MemoryConfig) -> "Dims":
        """Sizes for this layout: local sequence (CP, SP), local heads and widths (TP)."""
        m, t, c = cfg.model, cfg.tensor_model_parallel_size, cfg.context_parallel_size
        s_c = m.seq_length // c
        return cls(s_c=s_c, s_r=s_c // t if m.sequence_parallel else s_c, s=m.seq_length,
                   b=cfg.micro_batch_size, h=m.hidden_size, d=m.head_dim,
                   a_t=m.num_attention_heads // t, g_t=m.num_query_groups // t,
                   f_t=m.ffn_hidden_size // t, v_t=m.vocab_size // t, P=cfg.param_bytes)


def attention_kernel(cfg: MemoryConfig) -> str:
    """The SDPA kernel that runs: flash, or math (CPU with attention dropout, or forced)."""
    if cfg.attention_kernel != "auto":
        return cfg.attention_kernel
    if cfg.device == "cpu" and cfg.model.dropout > 0:
        return "math"
    return "flash"


def _norm(module: str, x: Dims) -> list[Saved]:
    """RMSNorm: fp32 copy of the input, 1/rms, the normalised input in the param dtype."""
    n = x.s_r * x.b
    return [Saved(module, "fp32 input", n * x.h, 4), Saved(module, "1/rms", n, 4),
            Saved(module, "normalised input", n * x.h, x.P)]


def _core_attention(cfg: MemoryConfig, x: Dims) -> list[Saved]:
    """What the attention kernel saves (and the proj input when it is a separate tensor)."""
    n, c = x.s_c * x.b, cfg.context_parallel_size
    if attention_kernel(cfg) == "flash":
        kv = ([Saved("core_attn", "k (after RoPE)", n * x.g_t * x.d, x.P),
               Saved("core_attn", "qkv output (v is a view)", n * (x.a_t + 2 * x.g_t) * x.d, x.P,
                     n * x.g_t * x.d)]
              if c == 1 else
              [Saved("core_attn", "k gathered over CP", x.s * x.b * x.g_t * x.d, x.P),
               Saved("core_attn", "v gathered over CP", x.s * x.b * x.g_t * x.d, x.P),
               Saved("core_attn", "additive causal mask", x.s_c * x.s, x.P)])
        return [Saved("core_attn", "q (after RoPE)", n * x.a_t * x.d, x.P), *kv,
                Saved("core_attn", "logsumexp", x.b * x.a_t * x.s_c, 4),
                Saved("core_attn", "output (= linear_proj input)", n * x.a_t * x.d, x.P)]
    e = 4 if cfg.device == "cpu" else x.P  # the CPU math path computes in fp32
    heads = x.b * x.a_t
    probs = 3 if cfg.model.dropout > 0 else 1  # probabilities, mask, dropped probabilities
    return [Saved("core_attn", "q scaled", heads * x.s_c * x.d, e),
            Saved("core_attn", "K^T repeated to all heads", heads * x.s * x.d, e),
            Saved("core_attn", "V repeated to all heads", heads * x.s * x.d, e),
            Saved("core_attn", "scores: probs (+ dropout mask, dropped)", probs * heads * x.s_c * x.s, e),
            Saved("attn_proj", "linear_proj input", n * x.a_t * x.d, x.P)]


def _selective_core_attention(cfg: MemoryConfig, x: Dims) -> list[Saved]:
    """Core attention recomputed: only its inputs (q, k, v's QKV storage) and output stay."""
    n = x.s_c * x.b
    return [Saved("core_attn", "q (checkpoint input)", n * x.a_t * x.d, x.P),
            Saved("core_attn", "k (checkpoint input)", n * x.g_t * x.d, x.P),
            Saved("core_attn", "qkv output (v is a view)", n * (x.a_t + 2 * x.g_t) * x.d, x.P,
                  n * x.g_t * x.d),
            Saved("attn_proj", "linear_proj input", n * x.a_t * x.d, x.P)]


# %% [markdown]
# The layer, assembled. In fp32 RMSNorm's `x.float()` is the input itself: the "fp32 copy" of
# the first norm of a chunk that received its input from the previous stage *is* the received
# tensor, counted once as the stage input. RoPE's `cos.to(x.dtype)` is then a view too, so
# fp32 keeps the two fp32 tables once per chunk instead of four cast copies per layer.
#
# **Recompute** (chapter 06, the model config's `recompute_*` switches, Megatron's names):
#
# | switch | what a layer keeps instead |
# |---|---|
# | selective `core_attn` (`attention.py:426-468`) | the checkpoint's inputs q, k and v (the QKV output): the flash kernel's logsumexp goes, the math kernel's whole $s^2$ term goes |
# | selective `mlp` | the MLP's input only (fc1's output, silu and the product go) |
# | selective `layernorm` | the norm's input; its internals and (without SP) its output are freed by `CheckpointWithoutOutput` |
# | full, `uniform` $n$ | nothing per layer: each run of $n$ layers keeps its input (`recompute.py:139`) |
# | full, `block` $n$ | the first $n$ layers of the stage keep their input, the rest everything (`:149`) |
# | `distribute_saved_activations` | each run input split over TP: $1/t$ of it per rank |
#
# Every checkpoint also keeps an RNG snapshot so that its replay draws the same dropout masks:
# on CPU a 5,056-byte state of the CPU generator, plus one per tracker stream (3) when the
# model uses dropout; on CUDA small host tensors, nothing on the device. The CPU generator's
# copy is made outside PyTorch's dispatcher, so chapter 01's meter cannot see it; the ledger
# counts it, and page 07.5 leaves it out of the comparison by name. During backward a
# recompute re-creates what it dropped — a run of layers, or the module's inside — on top of
# what is kept (the transient of the next section).
#
# **Activation offload** (chapter 06, `fine_grained_activation_offloading`, `offload_modules`)
# copies the tensors saved inside the chosen regions (`attn_norm`, `qkv_linear`, `core_attn`,
# `attn_proj`, `mlp_norm`) to host memory when they have at least `min_offloaded_tensor_size`
# elements. A storage leaves the device only when every holder is offloaded: attention's
# output is saved by the kernel *and* by `linear_proj`, so it moves only with both regions
# (hence Megatron's rule that `attn_proj` needs `core_attn`); v is a view of the QKV output, so
# its group copies v's elements and frees the whole QKV storage. The head's chunk keeps its
# last layer on the device (the offload margin).

# %%
def _mlp(x: Dims) -> list[Saved]:
    """SwiGLU MLP: fc1 input, fc1 output (gate and up), silu(gate), the product."""
    n = x.s_c * x.b
    return [Saved("mlp", "linear_fc1 input", n * x.h, x.P),
            Saved("mlp", "fc1 output (gate, up)", n * 2 * x.f_t, x.P),
            Saved("mlp", "silu(gate)", n * x.f_t, x.P),
            Saved("mlp", "silu(gate) * up (= linear_fc2 input)", n * x.f_t, x.P)]


CPU_RNG_STATE = "RNG snapshots: CPU generator"


def _snapshots(cfg: MemoryConfig, count: int) -> list[Saved]:
    """RNG snapshots of `count` checkpoints: the CPU generator and the tracker's streams.

    On CPU each state is a 5,056-byte Mersenne-twister tensor; on CUDA the snapshots are small
    host tensors, none on the device. The CPU generator's copy is made outside PyTorch's
    dispatcher, so chapter 01's meter does not see it (page 07.5 leaves it out of the
    comparison); the tracker streams' copies it does see.
    """
    if cfg.device == "cuda" or not count:
        return []
    out = [Saved("recompute", CPU_RNG_STATE, count, 5056)]
    if cfg.model.dropout > 0:  # the model forks its tracker (3 streams) only with dropout
        out.append(Saved("recompute", "RNG snapshots: tracker streams", 3 * count, 5056))
    return out


def _selected(cfg: MemoryConfig, module: str) -> bool:
    """Whether selective recompute checkpoints this module."""
    return cfg.recompute_granularity == "selective" and module in cfg.recompute_modules


def _selective_norms(x: Dims, norms: list[Saved], linear_input: Saved, module: str):
    """Output-discarding norm: its input stays; internals and (without SP) the output go."""
    n = x.s_r * x.b * x.h
    keep = [Saved(module, "norm input (checkpoint input)", n, x.P)]
    return keep, (linear_input if x.s_r != x.s_c else None)


def layer_saved(cfg: MemoryConfig, input_is_received: bool = False) -> list[Saved]:
    """Every tensor one transformer layer saves for backward on one rank (no full recompute)."""
    x = Dims.of(cfg)
    n = x.s_c * x.b
    norm1, norm2 = _norm("attn_norm", x), _norm("mlp_norm", x)
    if input_is_received and x.P == 4:  # x.float() is the received tensor itself
        norm1 = norm1[1:]
    qkv_in = Saved("qkv_linear", "linear_qkv input", n * x.h, x.P)
    mlp = _mlp(x)
    snapshots = 0
    if _selected(cfg, "layernorm"):
        norm1, qkv_in = _selective_norms(x, norm1, qkv_in, "attn_norm")
        norm2, fc1_in = _selective_norms(x, norm2, mlp[0], "mlp_norm")
        mlp = ([fc1_in] if fc1_in else []) + mlp[1:]
        snapshots += 2
    rope = [] if x.P == 4 else [Saved("rope", "RoPE cos/sin cast", 4 * n * x.d, x.P)]
    core = _core_attention(cfg, x)
    if _selected(cfg, "core_attn"):
        core, snapshots = _selective_core_attention(cfg, x), snapshots + 1
    if _selected(cfg, "mlp"):
        mlp = [Saved("mlp", "MLP input (checkpoint input)", n * x.h, x.P)]
        snapshots += 1
    out = [*norm1, *([qkv_in] if qkv_in else []), *rope, *core, *norm2, *mlp]
    out += _snapshots(cfg, snapshots)
    if cfg.model.dropout > 0:
        mask = 1 if cfg.device == "cuda" else x.P
        out += [Saved("bda", "dropout mask (attention, mlp)", 2 * x.s_r * x.b * x.h, mask)]
    return out


# %% [markdown]
# ## The ends of the model
#
# **Embedding** (first stage): the token ids, 8 bytes each; with TP the vocab-parallel lookup
# also keeps its local ids (int64) and the out-of-range mask (bool) (appendix A). With dropout,
# one more mask of the residual size.
#
# **Head** (last stage): the final norm, the output layer's input ($P s_c b h$, gathered under
# SP), and the vocab-parallel cross-entropy's saved softmax in fp32 — $4 b s_c V/t$, the
# largest single activation of a small model — plus its target ids and mask, and the per-token
# loss it returns.
#
# **Between stages**: a non-first chunk keeps the received activation ($P s_r b h$) until its
# backward; a non-last chunk returns its output, which the schedule pseudo-frees once sent
# (chapter 01's `deallocate_output_tensor`). In fp32 each chunk also keeps the two RoPE tables
# (fp32 $[b, s_c, d]$) that every layer's RoPE saved a view of.

# %%
def embedding_saved(cfg: MemoryConfig) -> list[Saved]:
    """What the first chunk's embedding keeps: ids (and local ids + mask with TP), dropout."""
    x = Dims.of(cfg)
    n = x.b * x.s_c
    out = [Saved("embedding", "token ids (int64)", n, 8)]
    if cfg.tensor_model_parallel_size > 1:
        out = [Saved("embedding", "local token ids (int64)", n, 8),
               Saved("embedding", "out-of-range mask (bool)", n, 1)]
    if cfg.model.dropout > 0:
        out.append(Saved("embedding", "dropout mask", x.s_r * x.b * x.h,
                         1 if cfg.device == "cuda" else x.P))
    return out


def head_saved(cfg: MemoryConfig) -> list[Saved]:
    """What the last chunk's head keeps: final norm, output-layer input, CE softmax, loss."""
    x = Dims.of(cfg)
    n = x.b * x.s_c
    return [*_norm("head", x), Saved("head", "output layer input", n * x.h, x.P),
            Saved("head", "cross-entropy softmax (fp32)", n * x.v_t, 4),
            Saved("head", "target ids (int64)", n, 8), Saved("head", "target mask (bool)", n, 1),
            Saved("head", "per-token loss (the output)", n, 4)]


def _full_recompute_groups(cfg: MemoryConfig, num_layers: int) -> tuple[int, int]:
    """(checkpointed groups, layers kept normally) of one chunk under full recompute."""
    if cfg.recompute_granularity != "full":
        return 0, num_layers
    n = cfg.recompute_num_layers or 1
    if cfg.recompute_method == "block":
        return min(n, num_layers), num_layers - min(n, num_layers)
    return math.ceil(num_layers / n), 0


def _full_recompute_saved(cfg: MemoryConfig, x: Dims, groups: int, first: bool) -> list[Saved]:
    """Each checkpointed run keeps its input (1/t with distribute_saved_activations) + RNG."""
    resid = x.s_r * x.b * x.h
    if cfg.model.distribute_saved_activations and cfg.tensor_model_parallel_size > 1:
        out = [Saved("recompute", "run inputs, this rank's 1/t", groups * resid
                     // cfg.tensor_model_parallel_size, x.P)]
    else:  # the chunk's own input is the received tensor, counted as the stage input
        out = [Saved("recompute", "checkpointed run inputs", (groups - (0 if first else 1))
                     * resid, x.P)]
    return out + _snapshots(cfg, groups)


def _offloaded(cfg: MemoryConfig, layer: list[Saved]) -> tuple[list[Saved], list[Saved]]:
    """(stays on the device, copied to the host) for one layer's saved tensors (chapter 06)."""
    m = cfg.model
    if not m.fine_grained_activation_offloading:
        return layer, []
    chosen, stay, host = set(m.offload_modules), [], []
    for e in layer:
        big = e.saved_numel >= m.min_offloaded_tensor_size
        copy = Saved(e.module, e.what, e.saved_numel, e.itemsize)
        if e.what.startswith("output (= linear_proj input)"):  # saved by attention and proj
            host += [copy] * (big * (("core_attn" in chosen) + ("attn_proj" in chosen)))
            if not (big and {"core_attn", "attn_proj"} <= chosen):
                stay.append(e)  # one holder left on the device keeps the storage alive
        elif big and e.module in chosen:
            host.append(copy)
        else:
            stay.append(e)
    return stay, host


def _kept_layers(cfg: MemoryConfig, normal: int, received: bool, last: bool):
    """(device, host) saved tensors of `normal` plain layers; the head's chunk keeps its last."""
    first, plain = layer_saved(cfg, input_is_received=received), layer_saved(cfg)
    if not cfg.model.fine_grained_activation_offloading:
        return first + ([e.times(normal - 1) for e in plain] if normal > 1 else []), []
    device, host = (first, []) if (last and normal == 1) else _offloaded(cfg, first)
    device, host = list(device), list(host)
    moved = max(0, normal - 1 - (1 if last else 0))  # the offload margin: the last layer stays
    if moved:
        d, h = _offloaded(cfg, plain)
        device += [e.times(moved) for e in d]
        host += [e.times(moved) for e in h]
    if normal - 1 - moved:
        device += [e.times(normal - 1 - moved) for e in plain]
    return device, host


def chunk_saved(cfg: MemoryConfig, pp_rank: int, chunk: int) -> dict[str, list[Saved]]:
    """Saved tensors of one micro-batch on one model chunk, by part ("host": offloaded)."""
    x = Dims.of(cfg)
    start, end = stage_layer_ranges(cfg.model.num_layers, cfg.pipeline_model_parallel_size,
                                    cfg.num_chunks, pp_rank)[chunk]
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == cfg.pipeline_model_parallel_size - 1 and chunk == cfg.num_chunks - 1
    groups, normal = _full_recompute_groups(cfg, end - start)
    layers = _full_recompute_saved(cfg, x, groups, first) if groups else []
    host: list[Saved] = []
    if normal:  # the first kept layer may differ (fp32 and a received input); the rest repeat
        device, host = _kept_layers(cfg, normal, not first and not groups, last)
        layers += device
    if groups or (x.P == 4 and normal):  # checkpoint inputs, or what fp32 RoPE saved views of
        layers.append(Saved("rope", "RoPE cos/sin tables (fp32)", 2 * x.b * x.s_c * x.d, 4))
    return {"layers": layers,
            "embedding": embedding_saved(cfg) if first else [],
            "head": head_saved(cfg) if last else [],
            "stage_input": [] if first else [Saved("p2p", "received activation",
                                                   x.s_r * x.b * x.h, x.P)],
            "host": host}


# %% [markdown]
# ## How many micro-batches are in flight
#
# Without pipelining each micro-batch runs forward and backward back to back: one in flight.
# With 1F1B stage $r$ runs $\min(p - r - 1, m)$ warmup forwards before its first backward, so
# it holds up to $\min(p - r, m)$ micro-batches (chapter 01). Interleaved, rank $r$ runs
# $2(p - r - 1) + (v - 1)\,g$ forwards first, each of a chunk of $L/(p v)$ layers, in the
# order of chapter 01's schedule table. Rather than a factor, the ledger replays that order —
# `F` adds a chunk's activations, `B` removes them — and takes the maximum, so the first
# chunk's embedding and the last chunk's head are counted exactly as often as they are live.
#
# The peak is not reached *between* operations but inside one, so each step adds what is
# alive only while it runs (found op by op with chapter 01's meter, then written down):
#
# | moment | what is alive on top of the kept tensors |
# |---|---|
# | end of a layer's forward | fc2's output and the new residual; in bf16 also the layer input, the mid-layer residual and the fp32 RoPE tables |
# | TP collective after fc2 | fc2's partial sum over the whole local sequence and the collective's output |
# | math attention | $q k^\top$ and its masked copy, q, k, v cast to fp32 — before the layer's MLP half is kept |
# | cross-entropy forward | bf16 logits, their fp32 copy, the shifted logits, their exponential: 14 bytes per logit (8 in fp32), 4 of which stay as the softmax |
# | SwiGLU backward | the incoming grad and the grads of gate, up and fc1's output, once the product and silu are freed |
# | attention backward | the grads of the output, q, and the (gathered) k and v |
# | fc1 / output-layer backward | the weight gradient (`.grad`, until DDP's hook adds it to `main_grad` and frees it) |
# | end of the first chunk's backward | the embedding's weight gradient, $P\,V h / t$ |
#
# With one stage holding both ends of tied embeddings, the output layer's weight gradient waits
# in `.grad` until the embedding adds its share at the very end of the backward. With
# pipelining, a stage that sends activations forward still holds the previous micro-batch's
# output in its send while the next forward runs (`p2p_buffers`); the received inputs and
# gradients are already counted (as kept stage inputs, and as the incoming grad of each
# backward event).
#
# Measured on the 42-case grid of page 07.5, this replay is within 2.7% of the measured peak
# (median 0.29%; the CPU math-attention cases within 8%); what remains is the timing of small
# buffers inside one operation.

# %%
def schedule_ops(cfg: MemoryConfig, pp_rank: int,
                 max_steady_rounds: int | None = None) -> list[tuple[str, int, int]]:
    """("F" or "B", chunk, micro-batch) in the order this pipeline rank runs them.

    `max_steady_rounds` keeps only that many 1F1B rounds of the steady state (its live set
    repeats with period p·v rounds, so 2·p·v rounds already hold its maximum).
    """
    p, v, m = cfg.pipeline_model_parallel_size, cfg.num_chunks, cfg.num_microbatches
    if p == 1:
        rounds = m if max_steady_rounds is None else min(m, max_steady_rounds)
        return [op for mb in range(rounds) for op in (("F", 0, mb), ("B", 0, mb))]
    if v == 1:
        warmup = num_warmup_microbatches_1f1b(p, pp_rank, m)
        table = [(mb, 0) for mb in range(m)]
    else:
        table = get_schedule_table(m, v, p)
        _, _, warmup, _ = get_pp_rank_microbatches(m, v, p, p, pp_rank)
    fwd = [("F", chunk, mb) for mb, chunk in table]
    bwd = [("B", v - 1 - chunk, mb) for mb, chunk in table]
    ops = fwd[:warmup]
    steady = len(table) - warmup
    for i in range(steady if max_steady_rounds is None else min(steady, max_steady_rounds)):
        ops += [fwd[warmup + i], bwd[i]]
    return ops + bwd[steady:]


def _forward_transient(cfg: MemoryConfig, x: Dims, head: bool) -> int:
    """Bytes alive in a chunk's forward on top of what it keeps, at its largest moment."""
    unit = x.P * x.s_r * x.b * x.h  # one residual-stream tensor
    rope = 0 if x.P == 4 else 2 * 4 * x.b * x.s_c * x.d  # the fp32 cos/sin tables
    # bf16: the layer's input and the mid-layer residual are alive (fp32 norms save them)
    resid = 0 if x.P == 4 else 2 * unit
    end_of_layer = resid + 2 * unit + rope  # fc2's output and the new residual
    t = cfg.tensor_model_parallel_size
    # TP: fc2's partial sum (the whole local sequence) and the collective's output
    collective = resid + (t if cfg.model.sequence_parallel else 1) * unit + unit + rope \
        if t > 1 else 0
    layer = max(end_of_layer, collective)
    if attention_kernel(cfg) == "math":  # q k^T (and its masked copy under CP), q/k/v cast
        e = 4 if cfg.device == "cpu" else x.P  # to fp32, while the MLP half is not kept yet
        copies = 2 if cfg.context_parallel_size > 1 else 1
        scores = copies * e * x.b * x.a_t * x.s_c * x.s + e * x.b * x.d * (x.a_t * x.s_c
                                                                           + 2 * x.g_t * x.s)
        later = saved_bytes([s for s in layer_saved(cfg) if s.module in ("mlp_norm", "mlp")])
        layer = max(layer, scores + unit + rope - later)
    if not head:
        return layer
    logits = x.b * x.s_c * x.v_t
    chain = (2 + 4 + 4 if x.P == 2 else 4 + 4) * logits  # logits (, fp32 copy), z, exp(z)
    return max(layer, chain + (0 if x.P == 4 else unit) + rope)


def _backward_transient(cfg: MemoryConfig, x: Dims, head: bool, tied_here: bool,
                        head_kept: int = 0, recomputed: int = 0) -> int:
    """Bytes alive in a chunk's backward on top of what it kept, at its largest moment."""
    unit = x.P * x.s_r * x.b * x.h
    table_grad = x.P * x.v_t * x.h  # the .grad of an embedding or output matrix
    # SwiGLU backward: grads of gate, up and fc1's output while the product and silu are freed
    mlp = unit + 2 * x.P * x.s_c * x.b * x.f_t
    # attention backward: grads of the output, q, and (gathered) k and v; the math kernel
    # holds one more s x s tensor (a probability grad arrives as a saved one is released)
    attn = unit + x.P * x.b * (2 * x.a_t * x.s_c + 2 * x.g_t * x.s) * x.d
    if attention_kernel(cfg) == "math":
        attn = unit + (4 if cfg.device == "cpu" else x.P) * x.b * x.a_t * x.s_c * x.s
    # fc1's backward: its input grad and its weight grad, once the MLP's saved tensors are gone
    fc1 = unit + x.P * x.s_c * x.b * x.h + x.P * 2 * x.f_t * x.h - 2 * x.P * x.s_c * x.b * x.f_t
    # one stage holding embedding and head with tied weights: the output layer's weight grad
    # waits in .grad through the layers' backward until the embedding adds its own
    held = table_grad if tied_here else 0
    # on the last chunk the layers' backward starts after the head's saved tensors are freed
    freed = head_kept if head else 0
    # a recompute re-creates its run's (or module's) saved tensors before their backward
    events = [e + held - freed + recomputed for e in (mlp, attn, fc1)]
    if head:  # softmax.clone() as the gradient; then the output layer's weight gradient, with
        logits = x.b * x.s_c * x.v_t  # the softmax freed and the logits' grad in P bytes
        events += [4 * logits, table_grad + (x.P - 4) * logits]
    return max(events)


def _late_backward(cfg: MemoryConfig, x: Dims, parts: dict) -> int:
    """First chunk, end of backward: the embedding's saved ids, the grad in, its weight grad."""
    if not parts["embedding"]:
        return 0
    unit = x.P * x.s_r * x.b * x.h
    held = x.P * x.v_t * x.h if parts["head"] and cfg.model.tie_embeddings else 0
    # the grad arriving at the embedding, its [b, s, h] copy, and the table's weight grad
    return (saved_bytes(parts["embedding"]) + unit + x.P * x.s_c * x.b * x.h
            + x.P * x.v_t * x.h + held)


def _recomputed(cfg: MemoryConfig) -> int:
    """Bytes a recompute re-creates inside one backward: a run of layers, or a module's inside."""
    if cfg.recompute_granularity is None:
        return 0
    plain = cfg.replace(model=cfg.model.replace(recompute_granularity=None, recompute_method=None,
                                                recompute_num_layers=None))
    layer = saved_bytes(layer_saved(plain))
    if cfg.recompute_granularity == "full":
        return layer * (cfg.recompute_num_layers if cfg.recompute_method == "uniform" else 1)
    return layer - saved_bytes(layer_saved(cfg))


def _transients(cfg: MemoryConfig, parts: dict) -> tuple[int, int, int]:
    """(forward, backward, end-of-backward) bytes of a chunk beyond what it keeps."""
    x = Dims.of(cfg)
    head = bool(parts["head"])
    tied_here = head and bool(parts["embedding"]) and cfg.model.tie_embeddings
    backward = _backward_transient(cfg, x, head, tied_here, saved_bytes(parts["head"]),
                                   _recomputed(cfg))
    return _forward_transient(cfg, x, head), backward, _late_backward(cfg, x, parts)


def p2p_buffers(cfg: MemoryConfig, pp_rank: int) -> int:
    """A sent activation still held by its send while the next forward runs (not the last stage)."""
    p = cfg.pipeline_model_parallel_size
    if p == 1 or (pp_rank == p - 1 and cfg.num_chunks == 1):
        return 0
    x = Dims.of(cfg)
    return x.P * x.s_r * x.b * x.h


def activation_peak(cfg: MemoryConfig, pp_rank: int, leave_out: tuple[str, ...] = ()) -> dict:
    """Replay the schedule: the most activation bytes live at once on this rank, and when.

    `leave_out` drops saved entries whose name starts with one of these strings (page 07.5
    leaves out what the meter cannot see).
    """
    kept, transient = {}, {}
    for chunk in range(cfg.num_chunks):
        parts = {k: [e for e in v if not e.what.startswith(leave_out or ("\0",))]
                 for k, v in chunk_saved(cfg, pp_rank, chunk).items()}
        kept[chunk] = sum(saved_bytes(v) for k, v in parts.items() if k != "host")
        transient[chunk] = _transients(cfg, parts)
    live, peak, in_flight, most, when = 0, 0, 0, 0, None
    p2p = p2p_buffers(cfg, pp_rank)
    period = 2 * cfg.pipeline_model_parallel_size * cfg.num_chunks
    for kind, chunk, mb in schedule_ops(cfg, pp_rank, max_steady_rounds=period):
        if kind == "F":  # the previous micro-batch's output may still be in its send
            during = live + kept[chunk] + transient[chunk][0] + p2p
            live, in_flight = live + kept[chunk], in_flight + 1
        else:
            during = max(live + transient[chunk][1], live - kept[chunk] + transient[chunk][2])
            live, in_flight = live - kept[chunk], in_flight - 1
        most = max(most, in_flight + (kind == "B"))
        if during > peak:
            peak, when = during, (kind, chunk, mb)
    return {"peak": peak, "activations": peak - p2p * (when[0] == "F"),
            "p2p_buffers": p2p * (when[0] == "F"), "at": when,
            "max_in_flight": most, "per_chunk": kept, "transient": transient}


# %% [markdown]
# ## Demo: the tiny layer, the 7B layer, and the in-flight count of the running example
#
# The demo prints the per-layer table for the running example at TP 2 with SP and selective
# recompute, compares it with Megatron's per-layer term, and replays the 1F1B and interleaved
# schedules to show the in-flight counts per stage.

# %%
if __name__ == "__main__":
    from tinytron.model.config import llama_7b_config

    big = MemoryConfig(llama_7b_config(sequence_parallel=True, recompute_granularity="selective"),
                       tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                       data_parallel_size=64, micro_batch_size=2, num_microbatches=8,
                       use_distributed_optimizer=True)
    rows = layer_saved(big)
    for e in rows:
        print(f"{e.module:>10}  {e.what:<40} {e.nbytes / 2**20:>9,.1f} MiB")
    ours = saved_bytes(rows)
    s, b, h, f = 4096, 2, 4096, 14336
    megatron_layer = s * b * h * (18 + 4 * f / h) / 2
    print(f"one layer, one rank: {ours / 2**20:,.1f} MiB here, Megatron's term "
          f"{megatron_layer / 2**20:,.1f} MiB")
    for v in (None, 2):
        cfg = big.replace(virtual_pipeline_model_parallel_size=v)
        for r in range(2):
            pk = activation_peak(cfg, r)
            print(f"vpp={v}, stage {r}: max in flight {pk['max_in_flight']} chunk-micro-batches, "
                  f"peak {pk['peak'] / 2**30:,.2f} GiB at {pk['at']}")
    assert [activation_peak(big, r)["max_in_flight"] for r in range(2)] == [2, 1]
    assert activation_peak(big.replace(virtual_pipeline_model_parallel_size=2), 0)[
        "max_in_flight"] == 5
    assert ours > megatron_layer  # the all-gathered linear inputs and the fp32 norm copies

# %% [markdown]
# ## Summary
#
# - A layer's activations are a list of tensors, each with a shape that the layout cuts:
#   TP divides the heads and the MLP width, SP the residual-stream tensors (norms, masks), CP
#   the sequence of everything but the gathered K and V.
# - The kernel matters more than any other choice: the flash path saves $O(s)$ per head, the
#   math path $O(s^2)$ in fp32 on CPU.
# - The schedule decides the multiplier: one micro-batch without pipelining, $\min(p - r, m)$
#   with 1F1B, and the replayed interleaved order with virtual stages.
#
# ## How production does it
#
# - Megatron: `megatron/core/tensor_parallel/layers.py` (SP linears that save the local slice),
#   `megatron/core/transformer/attention.py:426-468` (selective recompute),
#   `megatron/core/pipeline_parallel/schedules.py` (warmup counts),
#   `megatron/training/theoretical_memory_usage.py:280` (the paper's per-layer count).
# - PyTorch: `torch.nn.functional.scaled_dot_product_attention` kernel selection
#   (`torch.backends.cuda.sdp_kernel` / `torch.nn.attention.sdpa_kernel`).
#
# ## Exercises
#
# 1. Make `ColumnParallelLinear` save only its local slice under SP and all-gather it in
#    backward. Which rows of the table change, and by how much at TP 8?
# 2. With `recompute_granularity="full"` and `recompute_method="block"`, find the
#    `recompute_num_layers` that fits a 16 GiB budget on the first stage of the running example.
