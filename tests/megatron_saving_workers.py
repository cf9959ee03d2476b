"""Rank function for the tests of what the SP linears and RMSNorm keep for backward."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from tinytron.model import layers as model_layers
from tinytron.parallel import tensor_parallel as tp_mod
from tinytron.parallel.grid import ParallelGrid


def _old_column_forward(self, x):
    """ColumnParallelLinear.forward before the change: gather, then F.linear keeps the result."""
    if self.sequence_parallel:
        x = tp_mod.gather_from_sequence_parallel_region(x, self.grid, self.sequence_dim)
    else:
        x = tp_mod.copy_to_tp_region(x, self.grid)
    y = F.linear(x, self.weight, self.bias)
    return tp_mod.gather_from_tp_region(y, self.grid) if self.gather_output else y


def _old_norm_forward(self, x):
    """RMSNorm.forward before the change: autograd keeps the fp32 copy and the normalized input."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * normed.to(x.dtype)


@contextlib.contextmanager
def _old_code(linear: bool = True, norm: bool = True):
    saved = (tp_mod.ColumnParallelLinear.forward, model_layers.RMSNorm.forward)
    if linear:
        tp_mod.ColumnParallelLinear.forward = _old_column_forward
    if norm:
        model_layers.RMSNorm.forward = _old_norm_forward
    try:
        yield
    finally:
        tp_mod.ColumnParallelLinear.forward, model_layers.RMSNorm.forward = saved


def _saved_bytes(fn):
    """Run fn() and return (its result, bytes of the distinct storages autograd saved)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def _linear_case(grid, dtype, dim, bias):
    """Old (gather + F.linear) vs new SP linear: outputs and grads, and the bytes each saves."""
    tp, r = grid.size("tp"), grid.rank("tp")
    gen = torch.Generator().manual_seed(7)
    shape = [8, 3, 16] if dim == 0 else [3, 8, 16]
    x_full = torch.randn(*shape, generator=gen).to(dtype)
    w = torch.randn(12, 16, generator=gen).to(dtype)
    b = torch.randn(12, generator=gen).to(dtype) if bias else None
    dy = torch.randn(*shape[:-1], 12, generator=gen).to(dtype)
    grads, nbytes = [], []
    for new in (False, True):
        x = x_full.chunk(tp, dim)[r].clone().requires_grad_(True)
        wl = w.clone().requires_grad_(True)
        bl = b.clone().requires_grad_(True) if bias else None

        def fwd():
            if new:
                return tp_mod.linear_with_sequence_parallel_gather(x, wl, bl, grid, dim)
            return F.linear(tp_mod.gather_from_sequence_parallel_region(x, grid, dim), wl, bl)
        y, n = _saved_bytes(fwd)
        (y * dy).sum().backward()
        grads.append([y.detach(), x.grad, wl.grad] + ([bl.grad] if bias else []))
        nbytes.append(n)
    equal = all(torch.equal(a, c) for a, c in zip(*grads))
    return {"equal": equal, "old_bytes": nbytes[0], "new_bytes": nbytes[1],
            "slice_bytes": x.numel() * x.element_size(), "weight_bytes": w.numel() * w.element_size()}


def _model_case(grid, dtype):
    """The tiny GPT on TP2 + SP under the old code, the new linear alone, and all new code."""
    from tinytron.model.config import tiny_config
    from tinytron.model.gpt import GPTModel

    config = tiny_config(sequence_parallel=True)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=gen)
    labels = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=gen)
    runs = {}
    for name, old in (("old", dict()), ("new_linear", dict(linear=False)), ("new", None)):
        model = GPTModel(config, grid, dtype=dtype)
        with _old_code(**old) if old is not None else contextlib.nullcontext():
            loss, n = _saved_bytes(lambda: model(tokens, labels=labels))
            loss.sum().backward()
        runs[name] = ({k: p.grad.clone() for k, p in model.named_parameters()}, loss.detach(), n)
    g_old, l_old, n_old = runs["old"]
    out = {"old_bytes": n_old, "params": len(g_old)}
    for name in ("new_linear", "new"):
        g, l_new, n = runs[name]
        out[f"{name}_bytes"] = n
        out[f"{name}_equal"] = torch.equal(l_old, l_new) and all(
            torch.equal(g_old[k], g[k]) for k in g_old)
        out[f"{name}_rel"] = max(float((g_old[k] - g[k]).abs().max() / g_old[k].abs().max())
                                 for k in g_old)
    return out


def megatron_saving(world: int) -> dict:
    grid = ParallelGrid(tp=world)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for dim in (0, 1):
            for bias in (False, True):
                out[f"linear_{dtype}_{dim}_{bias}"] = _linear_case(grid, dtype, dim, bias)
        out[f"model_{dtype}"] = _model_case(grid, dtype)
    return out
