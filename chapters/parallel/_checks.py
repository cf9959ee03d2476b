"""Argument checks of appendix A's pages, kept off the pages (same messages, same exceptions)."""

from __future__ import annotations

import torch


def check_seq_for_cp(seq_len: int, cp_size: int) -> int:
    """The chunk length seq_len / (2 cp); a ValueError when it does not divide."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp_size}")
    return seq_len // (2 * cp_size)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v as [b, heads, s, d] with equal s, query heads a multiple of kv heads."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[-2] != k.shape[-2]:
        raise ValueError(f"expected q, k, v as [b, heads, s, d] with equal s, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")


def _parse_order(order: str, sizes: dict) -> list[str]:
    """Split an order string into base axes; `ep` is dropped (size 1 here), unnamed size-1 axes go last."""
    tokens = [t for t in order.lower().split("-") if t != "ep"]
    if len(set(tokens)) != len(tokens) or not set(tokens) <= set(sizes):
        raise ValueError(f"order must name each of tp, cp, dp, pp at most once, got {order!r}")
    for axis in ("tp", "cp", "dp", "pp"):  # as RankGenerator (parallel_state.py:475-482)
        if axis not in tokens:
            if sizes[axis] != 1:
                raise ValueError(f"order {order!r} does not name {axis}, whose size is {sizes[axis]}")
            tokens.append(axis)
    return tokens


def _check_sizes(world_size: int, tp: int, cp: int, pp: int, dp: int | None) -> int:
    """Validate sizes against the world size; return dp (inferred when None)."""
    for name, value in (("world_size", world_size), ("tp", tp), ("cp", cp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    model = tp * cp * pp
    if dp is None:
        if world_size % model:
            raise ValueError(f"world_size {world_size} is not divisible by tp*cp*pp = "
                             f"{tp}*{cp}*{pp} = {model}")
        return world_size // model
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive int, got {dp!r}")
    if model * dp != world_size:
        raise ValueError(f"tp*cp*dp*pp = {tp}*{cp}*{dp}*{pp} = {model * dp} does not equal "
                         f"world_size {world_size}")
    return dp
