# %% [markdown]
# # 06 · Recompute (2/4): full and selective recompute on the model
#
# Page 1 built a checkpoint that replays a block exactly. This page decides *which* blocks of
# the model go through it — whole layers (full recompute, Megatron's `uniform` and `block`
# methods) or only the expensive-to-store parts of a layer (selective recompute) — and installs
# that choice, read from the model config, on appendix B's model. The same call installs the
# activation offload of page 3.
#
# You will build: `FullRecompute` (the decoder loop with checkpointed chunks),
# `recompute_core_attention`, `recompute_module`, `recompute_norm_output`, and
# `apply_recompute(model)`, the one call the trainer makes.

# %%
from __future__ import annotations

import functools

import torch
from torch import nn

from tinytron.recompute.checkpoint import CheckpointWithoutOutput, checkpoint
from tinytron.recompute.offload import OffloadManager, install_offload

__all__ = ["FullRecompute", "recompute_core_attention", "recompute_module",
           "recompute_norm_output", "apply_recompute"]

# %% [markdown]
# ## The trade, in numbers
#
# In a Llama-style layer most stored bytes are intermediate results: the norm outputs, the
# q/k/v projections, the attention probabilities, the MLP's $2f$-wide input to SwiGLU. Page 4
# counts them exactly; for the running example (Llama-7B-like, $h = 4096$, $a = 32$,
# $f = 14336$, $s = 4096$, micro-batch $b = 2$, bf16) at TP 2 with sequence parallelism, with
# attention probabilities materialized (no flash attention) and dropout, a layer stores
# 3.4 GiB per rank, of which the three $a b s^2/t$-sized attention tensors are 2.5 GiB. Three
# choices:
#
# | mode | stores per layer | extra work in backward |
# |---|---|---|
# | none | everything: 3.4 GiB | none |
# | selective `core_attn` | everything but the attention probabilities: 0.9 GiB | one attention forward ($\approx 4 b s^2 h / t$ flops) |
# | full | the layer input only, $s b h/t$: 32 MiB | the whole layer forward (≈ 1/3 of fwd+bwd) |
#
# Selective recompute targets what is big to store and cheap to compute: attention's
# $O(s^2)$ tensors cost memory quadratic in $s$ but few flops: $4 b s^2 h$ against the
# linear layers' $26 b s h^2$ for this layer shape, about 13% of a layer's forward at
# $s = h = 4096$ (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
# 2022). Full recompute is the last resort, when even that does not fit: a layer then keeps
# 32 MiB instead of gigabytes, and the step runs one extra forward.
#
# ## Full recompute: `uniform` and `block`
#
# Megatron's `TransformerBlock` calls `checkpointed_forward` when
# `recompute_granularity == "full"` and the model is training (`transformer_block.py:621`;
# the loop is `megatron/core/recompute.py:21`, uniform at `:139`, block at `:149`):
#
# - **uniform**: cut the stage's $n$ layers into runs of `recompute_num_layers` $k$ —
#   $[0, k), [k, 2k), \dots$, the last one shorter — and checkpoint each run. Only each run's
#   input is stored; in backward the whole run is recomputed, so the peak holds one run's full
#   activations. $k = 1$ stores least; larger $k$ stores fewer inputs but recomputes (and holds)
#   more at once.
# - **block**: checkpoint the first $k$ layers of the stage one by one and run the others
#   normally. A pipeline stage that is short of memory only for its first few layers (early
#   stages hold more micro-batches in flight, chapter 01) recomputes just those.
#
# With 5 layers and $k = 2$: uniform checkpoints $[0, 2), [2, 4), [4, 5)$; block checkpoints
# layers 0 and 1 and runs 2, 3, 4 normally.
#
# ```mermaid
# flowchart LR
#   subgraph U["uniform, k = 2: only each run's input is stored"]
#     direction LR
#     u0["run: L0 L1"] --> u1["run: L2 L3"] --> u2["run: L4"]
#   end
#   subgraph B["block, k = 2: L0 and L1 checkpointed, the rest stored"]
#     direction LR
#     b0["run: L0"] --> b1["run: L1"] --> b2["L2"] --> b3["L3"] --> b4["L4"]
#   end
# ```
#
# The model's decoder loop calls `GPTModel.layer_runner` when one is installed; that is all
# appendix B had to offer for this page. The floors forbid the model to import a chapter, so
# the chapter installs itself into the model, not the other way around.

# %%
def _run_layers(layers, hidden, cos, sin, attention_mask):
    """The plain decoder loop over `layers`."""
    for layer in layers:
        hidden = layer(hidden, cos, sin, attention_mask)
    return hidden


class FullRecompute:
    """The decoder loop of one model chunk with Megatron's uniform/block full recompute."""

    def __init__(self, method: str, num_layers: int, distribute_saved_activations: bool = False,
                 grid=None, tracker=None, preserve_rng_state: bool = True):
        if method not in ("uniform", "block"):
            raise ValueError(f"recompute_method must be 'uniform' or 'block', got {method!r}")
        self.method, self.num_layers = method, num_layers
        self.distribute, self.grid, self.tracker = distribute_saved_activations, grid, tracker
        self.preserve_rng_state = preserve_rng_state  # False only to show what goes wrong

    def chunks(self, n: int) -> list[tuple[int, int, bool]]:
        """(start, end, checkpointed) runs of a stage with n layers."""
        k = self.num_layers
        if self.method == "uniform":
            return [(s, min(s + k, n), True) for s in range(0, n, k)]
        return [(i, i + 1, i < k) for i in range(n)]

    def __call__(self, layers, hidden, cos, sin, attention_mask):
        if not (torch.is_grad_enabled() and len(layers) and layers[0].training):
            return _run_layers(layers, hidden, cos, sin, attention_mask)  # eval: nothing to save
        for start, end, checkpointed in self.chunks(len(layers)):
            run = functools.partial(_run_layers, layers[start:end])
            if checkpointed:
                hidden = checkpoint(run, self.distribute, hidden, cos, sin, attention_mask,
                                    tracker=self.tracker, grid=self.grid,
                                    preserve_rng_state=self.preserve_rng_state)
            else:
                hidden = run(hidden, cos, sin, attention_mask)
        return hidden

# %% [markdown]
# ## Selective recompute
#
# Megatron's `recompute_modules` (default `["core_attn"]`) names the parts of a layer to
# checkpoint. Three of its names exist in this dense model:
#
# - `core_attn` — softmax$(q k^\top / \sqrt d + \text{mask})$, dropout, $\cdot\, v$, wrapped in a
#   checkpoint whose inputs are $q, k, v$ and the mask (`attention.py:373`, `:426-468`). The
#   $a b s^2$-sized scores, dropout mask and dropped probabilities are never stored. The
#   attention dropout draws from the TP tracker stream, which is why page 1's replay covers it.
# - `mlp` — the whole SwiGLU MLP, checkpointed on its input: fc1's $2f$-wide output, the SiLU
#   output and the product are recomputed (the most flops per byte saved: rarely worth it).
# - `layernorm` — both RMSNorms through `CheckpointWithoutOutput`: the norm's internals *and*
#   its output are freed once the next linear layer has saved the output, and refilled by a
#   hook on that linear layer's output in backward (Megatron uses output-discarding for
#   `layernorm`, `moe_act`, `mla_up_proj`).
#
# All three are installed from outside: core attention through `SelfAttention.attend_wrapper`
# (appendix B calls it with the attention function and its inputs), the MLP and the norms by
# replacing the module instance's `forward` with a checkpointing one. Parameter names, the
# state dict and the module tree are untouched, so checkpoints (chapter 03) and optimizers
# (chapter 02) see the same model.

# %%
def recompute_core_attention(attn, tracker=None) -> None:
    """Checkpoint SelfAttention's softmax(qk^T)v part in training (q, k, v, mask are stored)."""
    def wrapper(attend, q, k, v, attention_mask):
        if not (attn.training and torch.is_grad_enabled()):
            return attend(q, k, v, attention_mask)
        return checkpoint(attend, False, q, k, v, attention_mask, tracker=tracker)
    attn.attend_wrapper = wrapper


def recompute_module(module: nn.Module, tracker=None) -> None:
    """Checkpoint a single-input module (the MLP) on its input in training."""
    original = module.forward

    @functools.wraps(original)
    def forward(x):
        if not (module.training and torch.is_grad_enabled()):
            return original(x)
        return checkpoint(original, False, x, tracker=tracker)
    module.forward = forward


def recompute_norm_output(norm: nn.Module, consumer: nn.Module, tracker=None) -> None:
    """Run `norm` without saving anything and free its output once `consumer` has run."""
    original, pending = norm.forward, []

    @functools.wraps(original)
    def forward(x):
        if not (norm.training and torch.is_grad_enabled()):
            return original(x)
        pending.append(CheckpointWithoutOutput(tracker))
        return pending[-1].checkpoint(original, x)

    def after_consumer(_module, _args, output):
        if pending and torch.is_grad_enabled():
            pending.pop().discard_output_and_register_recompute(output)

    norm.forward = forward
    consumer.register_forward_hook(after_consumer)

# %% [markdown]
# The norm before the MLP has the MLP's `linear_fc1` as its consumer — or the whole MLP when
# `mlp` is recomputed too, because the MLP's checkpoint is then what saves the norm's output.
#
# ## One call for the trainer
#
# `apply_recompute(models)` reads every switch from `model.config` (Megatron's names,
# appendix B's `ModelConfig`) and installs the matching pieces on each model chunk of the
# rank. It returns the `OffloadManager` when offload is on, so that the trainer and the tests
# can read how many bytes moved. A model whose config asks for recompute or offload and was
# never passed through `apply_recompute` refuses to train (`ValueError` from its forward):
# a forgotten call cannot silently cost the memory the config promised to save.

# %%
def _install_selective(model, tracker) -> None:
    """The recompute_modules of model.config on every layer of the chunk."""
    names = model.config.recompute_modules
    for layer in model.decoder.layers:
        if "core_attn" in names:
            recompute_core_attention(layer.self_attention, tracker)
        if "mlp" in names:
            recompute_module(layer.mlp, tracker)
        if "layernorm" in names:
            recompute_norm_output(layer.input_layernorm, layer.self_attention.linear_qkv, tracker)
            consumer = layer.mlp if "mlp" in names else layer.mlp.linear_fc1
            recompute_norm_output(layer.pre_mlp_layernorm, consumer, tracker)


def apply_recompute(models, manager: OffloadManager | None = None) -> OffloadManager | None:
    """Install the config's recompute and offload choices on each model chunk; return the manager."""
    chunks = [models] if isinstance(models, nn.Module) else list(models)
    for model in chunks:
        c, tracker = model.config, model.rng_tracker
        if model.activation_policy_applied:
            raise ValueError("apply_recompute was already applied to this model chunk")
        if c.recompute_granularity == "full":
            n = len(model.decoder.layers)
            if c.recompute_num_layers > n:
                raise ValueError(f"recompute_num_layers ({c.recompute_num_layers}) must be <= the "
                                 f"chunk's layers ({n})")
            model.layer_runner = FullRecompute(c.recompute_method, c.recompute_num_layers,
                                               c.distribute_saved_activations, model.grid, tracker)
        elif c.recompute_granularity == "selective":
            _install_selective(model, tracker)
        if c.fine_grained_activation_offloading:
            device = next(model.parameters()).device  # where the activations live
            manager = manager if manager is not None else OffloadManager(device)
            install_offload(model, manager)
        model.activation_policy_applied = True
    return manager

# %% [markdown]
# ## Demo: every mode trains the same model
#
# The tiny model with four layers and dropout 0.1 everywhere (embedding, attention
# probabilities, both residual branches) trains three SGD steps under seven settings. Each
# run seeds the generators the same way (appendix A's `model_parallel_seed`). The claim: the
# losses of every step and every gradient are **bitwise** equal to the run without recompute —
# not close, equal, because the recompute replays the same operations on the same numbers with
# the same random masks. The tests repeat this at TP 2 with sequence parallelism.
#
# One setting is an instructive exception. With `layernorm` in `recompute_modules`, the
# layer input's gradient has two sources: the residual add and the norm, whose own two
# contributions (through $x^2$ and through $x \cdot \mathrm{rsqrt}$) are now summed *inside* the
# checkpoint's backward before they meet the residual's. Floating-point addition is not
# associative, so the gradients come out one or two ulps away (about $10^{-8}$ here); the
# losses of all three steps are still bitwise equal. A full-layer checkpoint does not have
# this: the whole residual branch is inside it and the sums happen in the original order.

# %%
def train_steps(config, steps: int = 3, grid=None, batch_seed: int = 0, lr: float = 0.1):
    """Losses of each step and the grads of the last, for one recompute/offload setting."""
    from tinytron.model.gpt import GPTModel
    from tinytron.parallel import ParallelGrid
    from tinytron.parallel.rng import model_parallel_seed

    grid = grid if grid is not None else ParallelGrid.single()
    model_parallel_seed(1234, grid)
    model = GPTModel(config, grid)
    manager = apply_recompute(model)
    g = torch.Generator().manual_seed(batch_seed)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=g)
    labels = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return torch.stack(losses), grads, manager


# %% [markdown]
# The seven settings, as `ModelConfig` fields on top of the tiny model; the demo trains each
# one and compares it with the run without recompute.

# %%
MODES = {
    "none": {},
    "selective core_attn": dict(recompute_granularity="selective"),
    "selective all three": dict(recompute_granularity="selective",
                                recompute_modules=["core_attn", "mlp", "layernorm"]),
    "full uniform k=3": dict(recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=3),
    "full block k=2": dict(recompute_granularity="full", recompute_method="block",
                           recompute_num_layers=2),
    "offload": dict(fine_grained_activation_offloading=True, min_offloaded_tensor_size=1024,
                    offload_modules=["attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                     "mlp_norm"]),
    "selective + offload": dict(recompute_granularity="selective", min_offloaded_tensor_size=1024,
                                fine_grained_activation_offloading=True,
                                offload_modules=["core_attn", "attn_proj", "mlp_norm"]),
}
"""The settings the demo and the tests compare (tiny model fields on top of dropout 0.1)."""


if __name__ == "__main__":
    from tinytron.model.config import tiny_config

    torch.set_num_threads(1)
    base = tiny_config(num_layers=4, dropout=0.1)
    ref_losses, ref_grads, _ = train_steps(base)
    print(f"{'mode':<22}{'losses of 3 steps':<34}{'max |grad - none|':>18}")
    results = {}
    for name, fields in MODES.items():
        losses, grads, manager = train_steps(base.replace(**fields))
        gap = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
        results[name] = (torch.equal(losses, ref_losses), gap)
        moved = "" if manager is None else f"  (offloaded {sum(manager.offloaded_bytes.values()):,} B)"
        print(f"{name:<22}{str([round(x, 5) for x in losses.tolist()]):<34}{gap:>18.1e}{moved}")
    assert all(same for same, _ in results.values())
    assert all(gap == 0.0 for name, (_, gap) in results.items() if name != "selective all three")
    assert results["selective all three"][1] < 1e-6

# %% [markdown]
# ## Measured on a GPU
#
# `bash scripts/gpu_check.sh 2` runs `benchmarks/bench_recompute.py --device cuda`: each mode's
# step time over no recompute, against the goals (selective at most 1.05×, full at most 1.40×),
# and the peak activation bytes of one micro-batch. The model is the benchmark's small one
# (hidden 256, 4 layers, sequence 256). `chapters/_gpu_results.py` renders the table from
# `benchmarks/results/gpu/<device>.json`.

# %%
if __name__ == "__main__":
    from tinytron._gpu_results import gpu_table

    print(gpu_table("recompute"))

# %% [markdown]
# ## Summary
#
# - Full recompute checkpoints runs of layers (`uniform`) or the first layers of a stage
#   (`block`) and stores only each run's input; selective recompute checkpoints core
#   attention (and, on request, the MLP or the norms, the latter without keeping their output).
# - Everything is installed from outside the model by `apply_recompute`, from
#   `ModelConfig`'s Megatron-named fields; the model only offers a layer-loop hook and a
#   core-attention hook.
# - With the RNG replay of page 1, every mode gives bitwise the same losses and gradients.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/transformer/transformer_block.py:621` (full recompute entry),
#   `megatron/core/recompute.py:21` (`checkpointed_forward`, uniform `:139`, block `:149`),
#   `megatron/core/transformer/attention.py:373, 426, 1268` (core attention),
#   `megatron/core/transformer/transformer_layer.py` (layernorm/MLP recompute),
#   the checks in `transformer_config.py:1546-1665`; flags `--recompute-granularity`,
#   `--recompute-method`, `--recompute-num-layers`, `--recompute-modules`,
#   `--distribute-saved-activations`.
# - torchtitan: `activation_checkpoint.mode = "full" | "selective"` with
#   `selective_ac_option = "op"` (save the outputs of a list of ops, recompute the rest, via
#   `torch.utils.checkpoint.create_selective_checkpoint_contexts`) or an integer $k$ (checkpoint
#   every $k$-th block).
#
# ## Exercises
#
# 1. With 6 layers per stage and `uniform`, which $k$ minimizes the *peak* (stored inputs plus
#    one recomputed run)? Check with page 4's meter.
#    <details><summary>Answer</summary>
#
#    $k = 1$. The peak is $\lceil 6/k \rceil$ stored inputs
#    plus $k$ layers' full activations during one run's recompute. With the running example's
#    32 MiB per input and 3.4 GiB per layer: $k = 1$ gives $6 \cdot 32$ MiB + 3.4 GiB ≈ 3.6 GiB,
#    $k = 2$ about 6.9 GiB, $k = 3$ about 10.3 GiB, $k = 6$ about 20.4 GiB. A layer's activations
#    are a hundred times its input, so fewer stored inputs never pay for a longer run.
#
#    </details>
#
# 2. Why does `block` suit the first pipeline stage of a 1F1B schedule better than the last?
#    <details><summary>Hint</summary>
#
#    Count the micro-batches whose activations a stage holds at
#    the peak of 1F1B ([chapter 01](../01_main_loop/pipeline_orders.py)): the first stage holds one
#    per pipeline stage, the last only one. Then ask which stage is short of memory, and how
#    few of its layers `block` can recompute while the rest run at full speed.
#
#    </details>
