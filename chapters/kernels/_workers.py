"""Rank functions for the appendix C demos and tests (spawned processes need them importable)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tinytron.parallel import ParallelGrid


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    scale = b.float().abs().max().item()
    return (a.float() - b.float()).abs().max().item() / (scale if scale > 0 else 1.0)


def vocab_parallel_parity(dtype_name: str = "float32", num_tokens: int = 6,
                          vocab: int = 200, seed: int = 0) -> dict:
    """TP = world: the fused vocab-parallel CE vs appendix A's and vs F.cross_entropy on full logits."""
    from tinytron.kernels.cross_entropy import (vocab_parallel_cross_entropy,
                                                vocab_parallel_cross_entropy_reference)

    dtype = getattr(torch, dtype_name)
    grid = ParallelGrid(tp=dist.get_world_size())
    tp, rank = grid.size("tp"), grid.rank("tp")
    gen = torch.Generator().manual_seed(seed)
    full = (3 * torch.randn(num_tokens, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, (num_tokens,), generator=gen)
    labels[0], labels[-1] = 0, vocab - 1  # targets on the first and on the last rank
    dloss = torch.rand(num_tokens, generator=gen)
    local = full.chunk(tp, dim=-1)[rank].contiguous()
    out = {}
    for name, fn, cast in (("fused", vocab_parallel_cross_entropy, False),
                           ("unfused", vocab_parallel_cross_entropy_reference, True)):
        z = local.clone().requires_grad_()
        loss = fn(z.float() if cast else z, labels, grid)
        loss.backward(dloss)
        out[name] = (loss.detach(), z.grad)
    ref_z = full.float().clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_z, labels, reduction="none")
    ref_loss.backward(dloss)
    ref_grad = ref_z.grad.to(dtype).chunk(tp, dim=-1)[rank]
    return {"loss_vs_unfused": _relative_gap(out["fused"][0], out["unfused"][0]),
            "grad_vs_unfused": _relative_gap(out["fused"][1], out["unfused"][1]),
            "loss_vs_full": _relative_gap(out["fused"][0], ref_loss.detach()),
            "grad_vs_full": _relative_gap(out["fused"][1], ref_grad),
            "loss_dtype": str(out["fused"][0].dtype)}
