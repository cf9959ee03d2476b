"""Which checkpoint a training run resumes from, decided before any process group exists.

`[checkpoint] load` names a root (with `latest_checkpointed_iteration.txt`) or one of its
`iter_NNNNNNN` directories (what `tinytron-convert` accepts too); `save` is where the run writes.
The rules, checked on the files before the world is joined:

- a `load` that was given and is not the save directory must hold a checkpoint: a root with a
  tracker, or a complete iteration directory (then: that iteration of its root); anything else
  is a one-line error naming what was looked for, never a silent start from scratch;
- the save directory (`load` unset, or equal to `save`) without a tracker is a first run: the
  run starts fresh and says so;
- `load` is read only while the save directory holds no checkpoint: once the run has saved one,
  a relaunch with the same command line (torchrun's `--max-restarts`, a job requeued by a
  scheduler) continues from the save directory's latest, not from `load` again, which would
  retrain the iterations already done and overwrite their checkpoints. The options that say how
  to take `load`'s checkpoint (`ckpt_step`, `finetune`, `no_load_optim`, `no_load_rng`) do not
  apply to the run's own checkpoint;
- the checkpoint's saved model config must equal the run's `[model]`: a one-line error naming
  every field that differs, before anything is written.

Megatron warns and trains from random weights when `--load` holds no tracker, and with
`--exit-on-missing-checkpoint` exits (status 0) instead
(`megatron/training/checkpointing.py:1340-1349`). tinytron differs on purpose: a `load` that
differs from `save` names a checkpoint the user wants, so its absence is an error. Megatron also
reads `--load` on every launch, whatever `--save` holds (`load_dir = getattr(args, load_arg)`
with `load_arg='load'`, `megatron/training/checkpointing.py:1613-1625`, called from
`megatron/training/training.py:2045`); tinytron continues from `save` once it holds one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from tinytron.checkpoint.formats import (LEGACY_MODEL_FILENAME, METADATA_FILENAME,
                                         TRACKER_FILENAME, detect_format,
                                         resolve_checkpoint_dir)

__all__ = ["LoadPlan", "plan_load", "saved_model_config", "model_config_differences",
           "saved_parts"]

_ITER_DIR = re.compile(r"iter_(\d{7,})")


@dataclass
class LoadPlan:
    """Where the run resumes: root + ckpt_step for the loader, and the directory it will read."""

    load: Optional[str]
    """The root the loader is given (None: start fresh)."""
    ckpt_step: Optional[int]
    """The iteration to load (None: the tracker's)."""
    directory: Optional[Path] = None
    """The iteration directory that will be read (None: start fresh)."""
    iteration: Optional[int] = None
    release: bool = False
    """The tracker says 'release': a model-only checkpoint, loaded as a finetune start."""
    fresh_reason: str = ""
    """Why the run starts fresh (printed on the console)."""
    continues_save: bool = False
    """A `load` was given but the save directory already holds a checkpoint: that one is read."""
    note: str = ""
    """Which directory is read and why, when `load` and `save` differ (printed on the console)."""


def _same(a, b) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def _is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and ((path / METADATA_FILENAME).is_file()
                              or any(path.glob("mp_rank_0*")))


def plan_load(load: Optional[str], save: Optional[str], ckpt_step: Optional[int] = None,
              exit_on_missing: bool = False) -> LoadPlan:
    """The load decision for `[checkpoint] load/save/ckpt_step`; a one-line ValueError if none."""
    if load is not None and save is not None and not _same(load, save) \
            and (Path(save) / TRACKER_FILENAME).is_file():
        plan = plan_load(None, save)  # the run's own checkpoint: its tracker's iteration
        plan.continues_save = True
        plan.note = (f"{save} already holds this run's checkpoint (iteration {plan.iteration}): "
                     f"continuing from it, not from checkpoint.load {load}")
        return plan
    root = load if load is not None else save
    if root is None:
        return LoadPlan(None, None, fresh_reason="no checkpoint.load or checkpoint.save")
    path = Path(root)
    is_save_dir = load is None or _same(load, save)
    what = "checkpoint.save" if load is None else "checkpoint.load"
    tracker = path / TRACKER_FILENAME
    if tracker.is_file() or (ckpt_step is not None and path.is_dir()):
        found = resolve_checkpoint_dir(path, ckpt_step)  # ValueError: names the missing dir
        if not _is_checkpoint_dir(found[0]):
            detect_format(found[0])  # raises, naming what is missing
        plan = LoadPlan(str(path), ckpt_step, found[0], found[1], release=found[2])
        if not is_save_dir:
            plan.note = (f"loading checkpoint.load {path} (checkpoint.save {save} holds no "
                         "checkpoint yet)")
        return plan
    m = _ITER_DIR.fullmatch(path.name)
    if m and _is_checkpoint_dir(path):
        step = int(m.group(1))
        if ckpt_step is not None and ckpt_step != step:
            raise ValueError(f"checkpoint.load is {path} (iteration {step}) but "
                             f"checkpoint.ckpt_step is {ckpt_step}: give one of them")
        return LoadPlan(str(path.parent), step, path, step,
                        note=f"loading checkpoint.load {path} (checkpoint.save {save} holds no "
                             "checkpoint yet)" if save is not None else "")
    if is_save_dir and not exit_on_missing:
        state = "does not exist yet" if not path.exists() else f"has no {TRACKER_FILENAME}"
        return LoadPlan(None, None, fresh_reason=f"{path} {state} (first run of this directory)")
    if is_save_dir:  # exit_on_missing_checkpoint
        raise ValueError(f"{what}: {path} holds no checkpoint (no {tracker}) and "
                         "checkpoint.exit_on_missing_checkpoint is set")
    if not path.exists():
        raise ValueError(f"{what}: {path} does not exist (looked for {path / TRACKER_FILENAME} "
                         "or an iter_NNNNNNN checkpoint directory)")
    if m or path.name == "release":
        raise ValueError(f"{what}: {path} is not a complete checkpoint directory (no "
                         f"{METADATA_FILENAME} and no mp_rank_* files)")
    raise ValueError(f"{what}: {path} holds no checkpoint (looked for {tracker}, or a complete "
                     "iter_NNNNNNN directory with metadata.json or mp_rank_*); "
                     "training from scratch needs no checkpoint.load")


def saved_model_config(directory: Path) -> Optional[dict]:
    """The ModelConfig fields a tinytron checkpoint saved (None for one that has none)."""
    from tinytron.checkpoint.convert import read_common

    directory = Path(directory)
    fmt = detect_format(directory)
    if fmt == "torch_dist":
        try:
            common = read_common(directory)
        except ValueError:
            return None  # a Megatron checkpoint that needs pickle: the loader checks shapes
    elif fmt == "torch":
        files = sorted(directory.glob(f"mp_rank_*/{LEGACY_MODEL_FILENAME}"))
        if not files:
            return None
        common = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
    else:
        return None
    args = common.get("args") if isinstance(common, dict) else None
    return args.get("model_config") if isinstance(args, dict) else None


def model_config_differences(saved: Optional[dict], config) -> list[str]:
    """'name saved vs wanted' for every architecture field that differs."""
    from tinytron.checkpoint.resume import ARCH_FIELDS

    if not saved:
        return []
    return [f"{name} {saved[name]!r} vs {getattr(config, name)!r}" for name in ARCH_FIELDS
            if name in saved and saved[name] != getattr(config, name)]




def saved_parts(directory) -> dict:
    """What an iteration directory holds besides weights: optimizer, scheduler, RNG, position."""
    from tinytron.checkpoint.convert import read_common

    directory = Path(directory)
    fmt = detect_format(directory)
    common, rng = None, False
    if fmt == "torch_dist":
        try:
            common = read_common(directory)
        except ValueError:
            common = None
        from torch.distributed.checkpoint import FileSystemReader

        try:
            keys = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
            rng = any(k.startswith("rng_state") for k in keys)
        except Exception:  # noqa: BLE001 - a report only; the loader names real problems
            rng = False
    elif fmt == "torch":
        files = sorted(directory.glob(f"mp_rank_*/{LEGACY_MODEL_FILENAME}"))
        if files:
            common = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
            rng = common.get("rng_state") is not None
    common = common if isinstance(common, dict) else {}
    train_state = common.get("train_state") or {}
    args = common.get("args") if isinstance(common.get("args"), dict) else {}
    consumed = train_state.get("consumed_train_samples", args.get("consumed_train_samples", 0))
    return {"optimizer": "optimizer" in common,
            "scheduler": common.get("opt_param_scheduler") is not None,
            "rng": rng, "consumed_train_samples": consumed}
