"""`[model] compile`: torch.compile each transformer layer of every model chunk, in place.

One compiled region per layer, as torchtitan compiles per transformer block: all layers of a
chunk run the same code with the same shapes, so dynamo traces and inductor compiles one graph
(forward and backward) and every other layer reuses it; the embedding, the output head and the
loss stay eager. `nn.Module.compile` compiles the layer's call in place, so the module tree,
the parameter names (and with them checkpoints and chapter 05's buffers) stay as they are;
`torch.compile(layer)` would insert an `_orig_mod.` level into every name.

It composes with the rest of a chunk because it changes nothing outside a layer's call:

- chapter 06's full recompute (`GPTModel.layer_runner`) calls the layers inside its checkpoint:
  the compiled layer runs there once without grad (forward) and once with (the recompute);
- selective recompute and offload live inside the layer (`attend_wrapper`, module wrappers,
  saved-tensor hooks): dynamo breaks the graph around what it cannot trace (the RNG snapshots
  of the checkpoint, the hooks' context) and those parts run eagerly;
- TP/SP collectives inside the layers and PP (each stage compiles the layers it holds).

`kernels = "triton"` (or "auto") with compile is refused where the config is made
(`ModelConfig`): inductor generates its own fused kernels for the norms and SwiGLU, and one switch
should decide which kernels run.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["check_compile", "compile_layers", "reset_compiled"]


def check_compile(c) -> None:
    """ValueError when `compile` is on with a switch it cannot serve (ModelConfig calls this)."""
    if not c.compile:
        return
    if c.kernels != "torch":  # one switch decides who writes the fused kernels
        raise ValueError(f'compile = true needs kernels = "torch", got {c.kernels!r}: '
                         "inductor generates the fused kernels itself")
    if c.fine_grained_activation_offloading:  # the saved-tensor hooks would see one graph's saves
        raise ValueError("compile = true cannot run with fine_grained_activation_offloading: "
                         "a compiled layer saves its activations as one graph, not per module")


def compile_layers(models, **options) -> int:
    """Compile every TransformerLayer of each chunk in place (`layer.compile(**options)`); the count."""
    chunks = [models] if isinstance(models, nn.Module) else list(models)
    count = 0
    for model in chunks:
        for layer in model.decoder.layers:
            if getattr(layer, "_compiled_call_impl", None) is not None:
                raise ValueError(f"layer {layer.layer_number} is already compiled")
            layer.compile(**options)
            count += 1
    return count


def reset_compiled() -> None:
    """Forget every compiled graph (dynamo's caches), e.g. between two runs in one process."""
    torch._dynamo.reset()
