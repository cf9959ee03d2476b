"""The DDP wrapper's module surface: loss-scale multiply, rank-0 broadcast, state dicts (not a page).

These methods make `DistributedDataParallel` usable by the other chapters (chapter 02 scales
the grads by the loss scale's inverse, training starts from rank 0's weights, chapter 03 saves
the wrapped module); none of them is part of the grad or param synchronization the page teaches.
"""

from __future__ import annotations

import torch.distributed as dist


class ModuleSurface:
    """Mixin for DistributedDataParallel: what other chapters call besides the sync itself."""

    def scale_gradients(self, factor) -> None:
        """Multiply all grad buffers by ``factor`` (a float or a 1-element tensor)."""
        for buf in self.buffers:
            buf.scale_gradients(factor)

    def broadcast_params(self) -> None:
        """Copy DP rank 0's parameters to every DP rank (call once after init)."""
        if self.dp_size == 1:
            return
        src = dist.get_global_rank(self.dp_group, 0)
        for p in self.module.parameters():
            dist.broadcast(p.data, src=src, group=self.dp_group)

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (no ``module.`` prefix), as Megatron does."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the wrapped module (in-place copies, so the values land in the buffers)."""
        return self.module.load_state_dict(state_dict, strict=strict)
