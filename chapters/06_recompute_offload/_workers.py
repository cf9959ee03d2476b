"""Rank functions for the recompute pages and tests: every mode against no recompute under TP."""

from __future__ import annotations

import torch

from tinytron.model.config import tiny_config
from tinytron.parallel import ParallelGrid
from tinytron.recompute.activation_memory import (decoder_activation_bytes,
                                                  measure_activation_bytes, rng_snapshot_bytes)
from tinytron.recompute.recompute import MODES, train_steps

_GRIDS: dict = {}


def _grid(tp: int) -> ParallelGrid:
    """One grid per TP size per process (building one creates every group)."""
    if tp not in _GRIDS:
        _GRIDS[tp] = ParallelGrid(tp=tp)
    return _GRIDS[tp]


def memory_config(**overrides):
    """The tiny model, wider and longer, so per-layer tensors dwarf the 5 KB RNG snapshots."""
    base = dict(num_layers=4, hidden_size=128, ffn_hidden_size=256, seq_length=128, dropout=0.1)
    base.update(overrides)
    return tiny_config(**base)


def mode_parity(tp: int, sequence_parallel: bool, steps: int = 3, modes=None) -> dict:
    """Per mode: (losses bitwise equal to none, max |grad - none| on this rank's shards)."""
    grid = _grid(tp)
    base = tiny_config(num_layers=4, dropout=0.1, sequence_parallel=sequence_parallel)
    ref_losses, ref_grads, _ = train_steps(base, steps, grid)
    out = {}
    for name in modes or MODES:
        losses, grads, _ = train_steps(base.replace(**MODES[name]), steps, grid)
        gap = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
        out[name] = (bool(torch.equal(losses, ref_losses)), gap)
    return out


def distributed_inputs(tp: int, steps: int = 2) -> dict:
    """Full recompute with distribute_saved_activations (no SP): the stored bytes and parity."""
    grid = _grid(tp)
    base = memory_config(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1)
    kept = measure_activation_bytes(base, grid, 4)["held"]
    kept_distributed = measure_activation_bytes(base.replace(distribute_saved_activations=True),
                                                grid, 4)["held"]
    plain = train_steps(tiny_config(num_layers=4, dropout=0.1), steps, grid)
    cfg = tiny_config(num_layers=4, dropout=0.1, recompute_granularity="full",
                      recompute_method="uniform", recompute_num_layers=1,
                      distribute_saved_activations=True)
    dist = train_steps(cfg, steps, grid)
    gap = max(float((dist[1][n] - plain[1][n]).abs().max()) for n in plain[1])
    return {"losses_equal": bool(torch.equal(dist[0], plain[0])), "grad_gap": gap,
            "held": kept, "held_distributed": kept_distributed}


MEMORY_MODES = ["none", "selective core_attn", "full uniform k=1", "full uniform k=3",
                "full block k=2", "offload", "selective + offload"]
"""The modes of the measured chart (mlp/layernorm recompute: see page 4)."""

_EXTRA = {"full uniform k=1": dict(recompute_granularity="full", recompute_method="uniform",
                                   recompute_num_layers=1)}


def memory_by_mode(tp: int = 1, sequence_parallel: bool = False, micro_batch_size: int = 4) -> dict:
    """Per mode: measured held/peak bytes and the count's prediction for the decoder."""
    grid = _grid(tp) if tp > 1 else None
    base = memory_config(sequence_parallel=sequence_parallel)
    empty = measure_activation_bytes(base, grid, micro_batch_size, layer_range=(0, 0))
    out = {}
    for name in MEMORY_MODES:
        config = base.replace(**(_EXTRA.get(name) or MODES[name]))
        m = measure_activation_bytes(config, grid, micro_batch_size)
        predicted = decoder_activation_bytes(
            config, config.num_layers, tp, micro_batch_size, dtype_bytes=4, mask_bytes=4,
            snapshot_bytes=rng_snapshot_bytes())
        out[name] = {"held": m["held"], "peak": m["peak"], "decoder": m["held"] - empty["held"],
                     "predicted": predicted, "offloaded": m["offloaded"]}
    return out
