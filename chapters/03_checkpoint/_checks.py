"""Validation of chapter 03's pages: one-line ValueErrors naming the option, key or shape.

The checkpoint options (`CheckpointConfig.__post_init__`, the resume page), the tiling of a
save plan and the keys and shapes a read asks for (the torch_dist page). The messages are the
same wherever they are raised from.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType


def check_checkpoint_config(cfg, async_modes) -> None:
    """ValueError naming the first CheckpointConfig option that is out of range."""
    if cfg.ckpt_format not in ("torch_dist", "torch"):
        raise ValueError(f"ckpt_format must be 'torch_dist' or 'torch', got {cfg.ckpt_format!r}")
    if cfg.async_save and cfg.ckpt_format != "torch_dist":
        raise ValueError("async_save needs ckpt_format='torch_dist' (Megatron: "
                         f"checkpointing.py:598), got ckpt_format={cfg.ckpt_format!r}")
    if cfg.async_mode not in async_modes:
        raise ValueError(f"async_mode must be one of {async_modes}, got {cfg.async_mode!r}")
    if not cfg.async_timeout_s > 0:
        raise ValueError(f"async_timeout_s must be > 0 seconds, got {cfg.async_timeout_s}")
    if cfg.thread_count < 1:
        raise ValueError(f"thread_count must be >= 1, got {cfg.thread_count}")
    if cfg.keep_latest_k < 0:
        raise ValueError(f"keep_latest_k must be >= 0 (0 = keep every save), got "
                         f"{cfg.keep_latest_k}")


def _check_tiling(plans: list[SavePlan]) -> None:
    """Every tensor fully covered by its written chunks (DCP itself checks only overlaps)."""
    covered, size = {}, {}
    for plan in plans:
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                covered[item.index.fqn] = covered.get(item.index.fqn, 0) + \
                    item.tensor_data.chunk.sizes.numel()
                size[item.index.fqn] = item.tensor_data.size.numel()
    for key, n in covered.items():
        if n < size[key]:
            raise ValueError(f"key {key!r}: the written chunks cover {n} of {size[key]} elements "
                             "(no rank wrote the rest)")



def _check_request(directory: Path, metadata, tensors, objects,
                   asked_anywhere: set | None = None) -> str | None:
    """The first key that is missing, has another global shape, or (given the keys every rank
    asks for) that no rank asks for."""
    md = metadata.state_dict_metadata
    for t in tensors:
        meta = md.get(t.key)
        if not isinstance(meta, TensorStorageMetadata):
            return (f"{directory}: the checkpoint has no tensor {t.key!r} (the model needs "
                    f"global shape {tuple(t.global_shape)})")
        if tuple(meta.size) != tuple(t.global_shape):
            return (f"{directory}: {t.key!r} has global shape {tuple(meta.size)} in the "
                    f"checkpoint, the model needs {tuple(t.global_shape)}")
    for o in objects:
        if not isinstance(md.get(o.unique_key), BytesStorageMetadata):
            return f"{directory}: the checkpoint has no object {o.unique_key!r}"
    if asked_anywhere is not None:
        for key, meta in sorted(md.items()):
            if (isinstance(meta, TensorStorageMetadata) and key not in asked_anywhere
                    and not key.startswith("optimizer.")):
                return (f"{directory}: the checkpoint has tensor {key!r} of global shape "
                        f"{tuple(meta.size)}, which the model does not have")
    return None
