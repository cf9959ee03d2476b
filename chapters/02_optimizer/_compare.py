"""Run two optimizers on the same gradients, for chapter 02's algorithms page (not a page)."""

from __future__ import annotations

import torch


def _run_pair(make_ours, make_ref, steps: int = 5, seed: int = 0) -> float:
    """Max |difference| of params after `steps` steps of two optimizers on the same grads."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 7), (7,), (3, 2, 4)]
    a = [torch.randn(s, generator=gen) for s in shapes]
    b = [t.clone() for t in a]
    opt_a, opt_b = make_ours(a), make_ref(b)
    for _ in range(steps):
        for x, y in zip(a, b):
            g = torch.randn(x.shape, generator=gen)
            x.grad, y.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    return max((x - y).abs().max().item() for x, y in zip(a, b))
