"""ChainedOptimizer's bookkeeping: merged state, zero_grad, state dicts (chapter 02; not a page)."""

from __future__ import annotations


class ChainSurface:
    """Mixin for ChainedOptimizer: what a trainer calls besides step, forwarded to each child."""

    @property
    def state(self) -> dict:
        """The union of the children's per-param state."""
        merged: dict = {}
        for opt in self.chained_optimizers:
            merged.update(opt.state)
        return merged

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the grads of every child."""
        for opt in self.chained_optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> list[dict]:
        """One state dict per child, in order."""
        return [opt.state_dict() for opt in self.chained_optimizers]

    def load_state_dict(self, state_dicts: list[dict]) -> None:
        """Load one state dict per child."""
        if len(state_dicts) != len(self.chained_optimizers):
            raise ValueError(f"expected {len(self.chained_optimizers)} state dicts, "
                             f"got {len(state_dicts)}")
        for opt, sd in zip(self.chained_optimizers, state_dicts):
            opt.load_state_dict(sd)
