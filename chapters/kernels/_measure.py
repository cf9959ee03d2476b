"""What the kernel pages measure: bytes the eager ops move, bytes saved for backward, roofline times."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["EagerTraffic", "saved_tensor_bytes", "GPU", "H100_SXM", "A100_SXM", "H200_SXM",
           "roofline_seconds"]


def _tensors(tree) -> list[torch.Tensor]:
    """Every tensor inside a pytree of op arguments or results."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(tensors) -> int:
    """Bytes of the elements the tensors view (what an op reads or writes of them)."""
    return sum(t.numel() * t.element_size() for t in tensors)


class EagerTraffic(TorchDispatchMode):
    """Counts, per aten op, the bytes of its tensor inputs (read) and outputs (written).

    This is the traffic of eager PyTorch when each op streams its operands through memory once
    (no cache reuse between ops): view ops (`split`, `transpose`, `detach`) move nothing and are
    skipped. `phase` labels the ops, e.g. "forward" and "backward".
    """

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str, int, int]] = []
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            # In-place ops write their mutated arguments (`_foreach_mul_` returns nothing);
            # an output that is one of them (`add_` returns self) is not counted twice.
            mutated = [t for arg, value in zip(func._schema.arguments, args)
                       if arg.alias_info is not None and arg.alias_info.is_write
                       for t in _tensors(value)]
            ptrs = {t.data_ptr() for t in mutated}
            written = mutated + [t for t in _tensors(out) if t.data_ptr() not in ptrs]
            self.ops.append((self.phase, str(func.overloadpacket.__name__),
                             _nbytes(_tensors((args, kwargs))), _nbytes(written)))
        return out

    def total(self, phase: str | None = None) -> int:
        """Bytes read + written by the counted ops of one phase (all phases when None)."""
        return sum(r + w for p, _, r, w in self.ops if phase in (None, p))

    def op_names(self, phase: str | None = None) -> list[str]:
        """The ops counted, in order."""
        return [name for p, name, _, _ in self.ops if phase in (None, p)]


def saved_tensor_bytes(fn, *args) -> tuple[torch.Tensor, int]:
    """Run fn(*args); return its output and the bytes autograd keeps for its backward.

    Storages are counted once (a view of an input costs what its storage costs), so a kernel
    that saves its input and an op that saves a fresh fp32 copy show the difference.
    """
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(seen.values())


@dataclass(frozen=True)
class GPU:
    """Peak numbers of one accelerator, from its datasheet (dense, no sparsity)."""

    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    notes: dict = field(default_factory=dict)
    sms: int = 132
    """Streaming multiprocessors: how many GEMM tiles run at once (one wave)."""

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound."""
        return self.bf16_flops / self.hbm_bytes_per_s


H100_SXM = GPU("H100 SXM", 989e12, 3.35e12)
"""NVIDIA H100 SXM5: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 132 SMs (NVIDIA H100 datasheet)."""

A100_SXM = GPU("A100 SXM", 312e12, 2.039e12, sms=108)
"""NVIDIA A100 SXM4 80 GB: 312 TFLOP/s dense bf16, 2.0 TB/s HBM2e, 108 SMs (A100 datasheet)."""

H200_SXM = GPU("H200 SXM", 989e12, 4.8e12, sms=132)
"""NVIDIA H200 SXM: the H100's 132 SMs and 989 TFLOP/s with 4.8 TB/s HBM3e (H200 datasheet)."""


def roofline_seconds(flops: float, bytes_moved: float, gpu: GPU = H100_SXM) -> float:
    """Lower bound on a kernel's time: the slower of its compute and its memory traffic."""
    return max(flops / gpu.bf16_flops, bytes_moved / gpu.hbm_bytes_per_s)
