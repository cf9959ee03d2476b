"""Rank functions for the Appendix A demos (spawned processes need them importable by name)."""

from __future__ import annotations

import torch

from tinytron.parallel.grid import ParallelGrid


def grid_views(tp: int, pp: int, cp: int = 1) -> dict:
    """Build a grid; all-reduce the global rank over tp and embd; report what this rank sees."""
    grid = ParallelGrid(tp=tp, cp=cp, pp=pp)
    x = torch.tensor([float(grid.global_rank)])
    grid.all_reduce(x, "tp")
    return {"describe": grid.describe(), "tp_sum": int(x.item()), "embd": grid.ranks("embd"),
            "first": grid.is_first_stage(), "last": grid.is_last_stage()}
