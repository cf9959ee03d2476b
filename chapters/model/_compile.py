"""`[model] compile`: torch.compile each transformer layer of every model chunk, in place.

One compiled region per layer, as torchtitan compiles per transformer block: all layers of a
chunk run the same code with the same shapes, so dynamo traces and inductor compiles one graph
(forward and backward) and every other layer reuses it; the embedding, the output head and the
loss stay eager. `nn.Module.compile` compiles the layer's call in place, so the module tree,
the parameter names (and with them checkpoints and chapter 05's buffers) stay as they are;
`torch.compile(layer)` would insert an `_orig_mod.` level into every name.

It composes with the rest of a chunk because it changes nothing outside a layer's call
(checked on the CPU: losses against eager in tests/test_model_compile.py):

- chapter 06's full recompute (`GPTModel.layer_runner`) calls the layers inside its checkpoint:
  the compiled layer runs there once without grad (forward) and once with (the recompute);
- selective recompute lives inside the layer (`attend_wrapper`, module wrappers): dynamo breaks
  the graph at the checkpoint's RNG snapshots, which run eagerly, and compiles the pieces
  between them;
- TP/SP: the collectives inside a layer are traced (no graph break at TP 2 with sequence
  parallelism, losses bit-identical to eager); PP: each stage compiles the layers it holds.

Refused where the config is made (`check_compile`, called by `ModelConfig`): `kernels =
"triton"` or "auto" (inductor generates its own fused kernels for the norms and SwiGLU, and one
switch decides which kernels run) and activation offloading (its saved-tensor hooks would be
traced into the graph, and a compiled layer saves its activations as one graph, not per module).
Dropout under compile draws its masks from inductor's own random-number code, so with dropout > 0
the losses differ from eager's (measured: 6.2604 against 6.2620 at the tiny config, dropout 0.1);
inductor's `fallback_random = True` calls eager's generator and gives eager's losses back.
"""

from __future__ import annotations

from torch import nn

__all__ = ["check_compile", "compile_layers"]


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

