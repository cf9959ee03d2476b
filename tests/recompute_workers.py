"""Rank functions for the recompute tests: one TP world runs every multi-rank check."""

from __future__ import annotations

import torch

from tinytron.model.config import tiny_config
from tinytron.model.gpt import GPTModel
from tinytron.parallel.rng import model_parallel_seed
from tinytron.recompute import _workers
from tinytron.recompute.recompute import FullRecompute


def _grads_without_rng_replay(grid) -> float:
    """Max |grad - reference| when full recompute does not restore the RNG (TP + SP)."""
    config = tiny_config(num_layers=2, dropout=0.1, sequence_parallel=True)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length),
                           generator=torch.Generator().manual_seed(0))
    grads = []
    for replay in (None, False):
        model_parallel_seed(1234, grid)
        model = GPTModel(config, grid)
        if replay is not None:
            model.layer_runner = FullRecompute("uniform", 1, grid=grid, tracker=model.rng_tracker,
                                               preserve_rng_state=replay)
        model(tokens, labels=tokens).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    return max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0])


def _caller_input_holds_the_slice(grid) -> dict:
    """distribute_saved_activations on a tensor the caller keeps: its data is the slice until
    backward, then the full values again; the gradients equal the undistributed checkpoint's."""
    from tinytron.recompute.checkpoint import checkpoint

    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))

    def block(t):
        return torch.tanh(t @ w)

    grads, sizes = [], []
    for distribute in (False, True):
        base = torch.randn(8, 4, 64, generator=torch.Generator().manual_seed(0),
                           requires_grad=True)
        x = base * 1.0                        # a non-leaf, as a layer's input is
        full = x.detach().clone()
        y = checkpoint(block, distribute, x, grid=grid)
        sizes.append((x.untyped_storage().nbytes(), tuple(x.shape)))
        y.sum().backward()
        sizes.append((x.untyped_storage().nbytes(), bool(torch.equal(x, full))))
        grads.append(base.grad)
    return {"sizes": sizes, "grads_equal": bool(torch.equal(*grads))}


def tp_checks(tp: int) -> dict:
    """Parity of every mode at TP+SP and TP, distributed inputs, memory per mode, the failing check."""
    grid = _workers._grid(tp)
    return {
        "parity_sp": _workers.mode_parity(tp, True),
        "parity_tp": _workers.mode_parity(tp, False, modes=["full uniform k=3", "offload"]),
        "distributed": _workers.distributed_inputs(tp),
        "caller_input": _caller_input_holds_the_slice(grid),
        "memory_sp": _workers.memory_by_mode(tp, True, micro_batch_size=8),
        "no_replay_gap": _grads_without_rng_replay(grid),
    }
