# %% [markdown]
# # 03 · Checkpoint: what a resume restores
#
# [What a checkpoint holds](saved_state.py) listed the whole training state and where each part
# is written. This page reads it back: a resumed run must continue as if it had never stopped —
# the same weights, the same optimizer moments and step counts, the same learning rate, the
# next sample of the data, and the same random draws for dropout. It checks a checkpoint
# against the run before touching anything, and hands the loop its three hooks.
#
# Why the order matters: a load that fails halfway is worse than one that fails at once. If
# rank 0 has applied the new weights when rank 1 finds a truncated file, the ranks hold two
# different models and the run goes on from neither checkpoint. So every rank reads
# everything first, the ranks agree that all reads succeeded, and only then is anything
# applied. The test of this page is strict: the resumed run must equal the uninterrupted one
# bit for bit.
#
# A worked example in small numbers, the demo at the end of this page: 2 ranks, 2 pipeline
# stages, 8 samples per step. After 3 steps the run saves: `iteration = 3`,
# `consumed_train_samples = 24`, the scheduler at 24 samples (past its 2-step, 16-sample
# warmup, into the cosine decay), and one `rng_state` object per (PP, TP) position, here
# 2 × 1 = 2 of them. A restart with another seed reads all of it, and step 4 sees sample 24
# on, at the same learning rate, with the same dropout masks.
#
# ```mermaid
# flowchart LR
#     S[save: state at iteration 3] --> C[(checkpoint: tensors,<br/>common.pt, objects)]
#     C --> R["read all of it on every rank<br/>(staging buffers)"]
#     R --> E{any rank failed?<br/>first_error}
#     E -- yes --> X[every rank raises,<br/>the run unchanged]
#     E -- no --> A["apply: weights, optimizer,<br/>scheduler, RNG, TrainState"]
# ```
#
# The bookkeeping (the loop's counters, the dictionaries of `common.pt`, the legacy save, the
# async finalize, the one-call API) lives in the private module
# `tinytron.checkpoint._resume_plumbing` (`chapters/03_checkpoint/_resume_plumbing.py`, named
# `_resume_plumbing.py` below); the page keeps what decides the outcome of a resume.
#
# You will build: `CheckpointConfig`, `check_model_config`, `CheckpointManager` (`save`,
# `load`, `finalize`), `make_checkpoint_hooks`.

# %%
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from functools import partialmethod
from pathlib import Path

import torch

from tinytron.checkpoint._checks import check_checkpoint_config
from tinytron.checkpoint._common import CheckpointGroups, LoadedState, set_main_state
from tinytron.checkpoint._resume_plumbing import (CheckpointHooks, ManagerPlumbing,
                                                  TrainStateFallback, _check_scheduler,
                                                  _load_rerun, _position_object, _rerun_object,
                                                  _train_state_class, _train_state_dict,
                                                  load_checkpoint, save_checkpoint)
from tinytron.checkpoint.async_save import ASYNC_MODES, WRITER_TIMEOUT_S
from tinytron.checkpoint.formats import (CheckpointSaveError, commit_checkpoint, detect_format,
                                         rotate_checkpoints, prepare_staging,
                                         resolve_checkpoint_dir, staging_dir, unwrap_chunks)
from tinytron.checkpoint.legacy import legacy_param_groups, read_legacy
from tinytron.checkpoint.resharding import (checkpoint_quantities, optimizer_pieces,
                                            optimizer_sharded_state_dict, piece_states,
                                            rederive_masters, wanted_quantities)
from tinytron.checkpoint.saved_state import _save_request, set_rng_state
from tinytron.checkpoint.sharded_keys import model_sharded_state_dict, param_layouts
from tinytron.checkpoint.staged_copy import StagedAsyncSaver
from tinytron.checkpoint.torch_dist import SaveRequest, read_common, read_sharded

__all__ = ["CheckpointConfig", "TrainStateFallback", "check_model_config", "CheckpointManager",
           "CheckpointHooks", "make_checkpoint_hooks", "save_checkpoint", "load_checkpoint",
           "ARCH_FIELDS"]

# %% [markdown]
# ## Does this checkpoint belong to this run?
#
# The fields that decide the shape and the meaning of the weights must match; anything else
# (sequence length, dropout, sequence parallelism, recomputation) may change between runs.
# Megatron's `check_checkpoint_args` (`checkpointing.py:137`) compares `num_layers`,
# `hidden_size`, `num_attention_heads` and the vocabulary; here the error names the field and
# both values, and it is raised before anything is loaded.

# %%
ARCH_FIELDS = ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
               "ffn_hidden_size", "vocab_size", "norm_epsilon", "rotary_base", "tie_embeddings")


def check_model_config(saved: dict | None, config, where) -> None:
    """ValueError naming the first architecture field that differs."""
    if saved is None:
        return
    for name in ARCH_FIELDS:
        if name in saved and saved[name] != getattr(config, name):
            raise ValueError(f"{where}: model config differs: {name} is {saved[name]!r} in the "
                             f"checkpoint and {getattr(config, name)!r} in this run")


# %% [markdown]
# ## The manager
#
# The manager holds what lives as long as the run: the options, the grid and its
# checkpoint process groups, and the background saver ([`StagedAsyncSaver`](staged_copy.py))
# when saves are asynchronous. `save`
# follows the order of [the formats page](formats.py): rank 0 prepares the staging
# directory, all ranks wait for it, then the state is written in the chosen format and
# committed (at once, or at a later `finalize` for an async save). `commit` is a closure that
# binds the iteration now: an async save of iteration 100 may be committed during iteration
# 103, and it must still write `100` into the tracker.
#
# <details><summary>The manager's bookkeeping: <code>ManagerPlumbing</code></summary>
#
# The rest of the manager is bookkeeping, in the mixin `ManagerPlumbing`
# (`_resume_plumbing.py`): finding the RNG tracker and gathering the
# RNG states (every DP rank's under `data_parallel_random_init`, else a one-entry list), the
# per-(PP, TP) objects, the legacy save (every rank writes its file, the first error is agreed
# on, rank 0 commits) and `finalize`, which hands over to the [background saver](async_save.py)
# and logs the blocking and background seconds of a completed save.
#
# </details>
#
# A synchronous `torch_dist` save runs the request's three phases at once (plan, write,
# finalize) and records the seconds training was blocked.

# %%
def _save_sync(manager, request: SaveRequest, commit, iteration: int, t0: float) -> dict:
    """Plan, write and finalize `request` now; raise CheckpointSaveError on failure."""
    request.plan()
    error = request.finalize(request.write(), commit)
    if error:
        raise CheckpointSaveError(error)
    stats = {"label": f"iteration {iteration}", "blocking_s": time.perf_counter() - t0}
    manager.stats.append(stats)
    return stats


# %% [markdown]
# The manager itself: `save` prepares the staging directory, binds the commit, and hands the
# state to the legacy writer, or builds the request ([`_save_request`](saved_state.py)) for
# the background saver or the synchronous save above.

# %%
class CheckpointManager(ManagerPlumbing):
    """Save, load and finalize the full training state on every rank of one run."""

    def __init__(self, config: CheckpointConfig, grid, rng_tracker=None, rerun_state_machine=None):
        self.config, self.grid, self.rng_tracker = config, grid, rng_tracker
        self.rerun_state_machine = rerun_state_machine
        self.comm = CheckpointGroups(grid)
        self.saver = (StagedAsyncSaver(self.comm, config.async_mode, config.async_timeout_s)
                      if config.async_save else None)
        self.stats: list[dict] = []

    def save(self, state, model, optimizer=None, scheduler=None, root: str | None = None) -> dict:
        """Save the full state at state.iteration (sync, or scheduled when async_save)."""
        root, iteration = Path(root or self.config.save), state.iteration
        chunks, t0 = unwrap_chunks(model), time.perf_counter()
        if self.config.no_save_optim:   # Megatron saves the scheduler with the optimizer only
            optimizer = scheduler = None
        if self.comm.rank == 0:
            prepare_staging(root, iteration)
        self.comm.barrier()
        staging = staging_dir(root, iteration)

        def commit():   # runs later for an async save: bind the iteration now
            commit_checkpoint(root, iteration)
            if self.config.keep_latest_k:  # only once the tracker names the new save
                rotate_checkpoints(root, self.config.keep_latest_k)

        if self.config.ckpt_format == "torch":
            return self._save_legacy(staging, state, chunks, optimizer, scheduler, commit, t0)
        request = _save_request(self, staging, state, chunks, optimizer, scheduler)
        if self.config.async_save:
            return self.saver.schedule(request, commit, label=f"iteration {iteration}")
        return _save_sync(self, request, commit, iteration, t0)

    def load(self, model, optimizer=None, scheduler=None, root: str | None = None):
        """Resume from `root` (default config.load): a TrainState, or None when there is nothing."""
        return _load(self, model, optimizer, scheduler, root)


# %% [markdown]
# ## Loading: check everything, then apply
#
# `load` resolves the directory (the tracker's iteration, or `ckpt_step`), detects the format,
# reads `common.pt` and checks the model config, then reads every tensor this layout needs into
# **staging buffers** — the model's weights, and for each optimizer piece its master weight and
# moments, asking for the model-space rectangles of the new layout. Only when all of that
# succeeded is anything applied, in Megatron's order: the weights, the optimizer
# (hyperparameters, loss scale, pieces and steps), the scheduler (which writes its lr and
# weight decay into every param group), the RNG states, and a fresh `TrainState` — whose
# `consumed_train_samples` tells chapter 04's sampler where to continue.
# A missing, truncated or corrupted file, a missing key or a mismatched field leaves the model
# exactly as it was.
#
# | state | stored as (`torch_dist`) | restored |
# |---|---|---|
# | weights | the model's sharded keys | always, on any layout |
# | fp32 masters, moments | `optimizer.state.{param,exp_avg,…}.<key>` | on any layout, unless `no_load_optim` / `finetune` |
# | step counts, loss scale | `common.pt` → `optimizer` | with the optimizer state |
# | param groups' hyperparameters | object `optimizer.param_groups` per (PP, TP) | same TP and PP only; lr and wd are then overwritten by the scheduler |
# | scheduler | `common.pt` → `opt_param_scheduler` | with the optimizer: not under `no_load_optim` / `finetune` (it restarts at step 0, as in Megatron, `checkpointing.py:1919-1952`) |
# | iteration, consumed samples, FLOPs | `common.pt` → `train_state` (and Megatron's `args`) | unless `finetune` |
# | RNG states | object `rng_state` per (PP, TP), a list over DP | same TP and PP, unless `no_load_rng` / `finetune` |
#
# The code goes from the bottom up. `_read_dist` reads this layout's share of a `torch_dist`
# directory: it builds the same sharded state dict a save of this layout would, but pointing
# into empty staging buffers, and lets DCP fill them. The param groups' hyperparameters are
# asked for only on an unchanged layout, since another layout may group its params
# differently.

# %%
def _read_dist(manager, directory, common, chunks, optimizer, load_optim, load_rng, same_layout,
               load_rerun=False):
    """Read this layout's share of a torch_dist checkpoint into a LoadedState."""
    grid = manager.grid
    layouts = param_layouts(chunks, grid)
    staged = {p: torch.empty_like(p, device="cpu") for p in layouts}
    tensors = model_sharded_state_dict(chunks, grid, staged)
    pieces, quantities, staging = [], [], {}
    if optimizer is not None and load_optim and "optimizer" in common:
        pieces, _ = optimizer_pieces(optimizer)
        quantities = sorted(checkpoint_quantities(directory))
        staging = {(id(pc.main), q): torch.empty(pc.main.numel(), dtype=pc.main.dtype)
                   for pc in pieces for q in wanted_quantities(pc, quantities)}
        tensors += optimizer_sharded_state_dict(optimizer, layouts, grid, quantities, staging)
    objects = {}
    if load_rng:
        objects["rng"] = _position_object(grid, "rng_state", None)
    if pieces and same_layout:   # another layout may group its params differently
        objects["groups"] = _position_object(grid, "optimizer.param_groups", None)
    if load_rerun:
        objects["rerun"] = _rerun_object(manager.comm, None)
    got = read_sharded(directory, tensors, list(objects.values()), manager.comm)
    loaded = LoadedState(common=common, model=[(p.data, t) for p, t in staged.items()])
    steps = common.get("optimizer", {}).get("steps", {})
    loaded.optimizer_pieces = piece_states(pieces, quantities, staging, staged, layouts, steps)
    if "rng" in objects:
        states, r = got[objects["rng"].unique_key], grid.rank("dp")
        own = manager.config.data_parallel_random_init and len(states) == grid.size("dp")
        loaded.rng = states[r] if own else states[0]   # checkpointing.py:1993-1996
    if "groups" in objects:
        loaded.param_groups = got[objects["groups"].unique_key]
    if "rerun" in objects:
        loaded.rerun = got[objects["rerun"].unique_key]
    return loaded


# %% [markdown]
# `_apply` is the only function that writes into the run, and it runs only after every rank
# has read everything. The order is Megatron's (`checkpointing.py:1919-1952`): the weights,
# then the optimizer (a plain state dict, or pieces: hyperparameters, loss scale, masters,
# moments, steps), then the scheduler, then the RNG states. The order matters for the
# learning rate: the scheduler's `load_state_dict` ends in `step(num_steps)`
# (`optimizer_param_scheduler.py:390`), which writes its lr and weight decay into every param
# group, over the values the optimizer just restored. With `override_opt_param_scheduler` and
# a new `max_lr`, the first resumed step runs at the new schedule's lr, not the saved one.
# Nothing here can refuse halfway: the scheduler's own checks ran during the read.
#
# <details><summary>How the scheduler is checked before anything is applied</summary>
#
# The scheduler's own checks (a changed `max_lr` without override, say) ran already during
# the read, on a copy (`_check_scheduler`, `_resume_plumbing.py`: the
# saved state is loaded into a shallow copy of the scheduler that drives copies of the param
# groups), so nothing here can refuse halfway.
#
# </details>
#
# A worked example of that order: the run saved at lr 3e-4 after warmup; the relaunch sets
# `override_opt_param_scheduler` with `max_lr = 1e-4`. The optimizer's `load_state_dict` first
# puts 3e-4 back into every param group; the scheduler's load then calls `step(24)`, which
# writes the new schedule's lr at sample 24 over it. Swap the two and the first resumed step
# would run at the old 3e-4, at least 3 times the new schedule's lr (which never exceeds 1e-4).

# %%
@torch.no_grad()
def _apply(manager, loaded: LoadedState, chunks, optimizer, scheduler, where):
    """Apply a fully read checkpoint: weights, optimizer, scheduler, RNG (Megatron's order)."""
    common = loaded.common
    loaded.apply_model()
    if optimizer is not None and loaded.optimizer_state_dict is not None:
        optimizer.load_state_dict(loaded.optimizer_state_dict)
    elif optimizer is not None and "optimizer" in common and loaded.optimizer_pieces:
        opt = common["optimizer"]
        groups = loaded.param_groups
        if groups is not None and len(groups) == len(optimizer.param_groups):
            for g, saved in zip(optimizer.param_groups, groups):
                g.update({k: v for k, v in saved.items()
                          if k not in ("params", "param_names", "step")})
        scaler = getattr(optimizer, "grad_scaler", None)
        if scaler is not None and opt.get("grad_scaler") is not None:
            scaler.load_state_dict(opt["grad_scaler"])
        for main, state in loaded.optimizer_pieces:
            param = state.pop("param", None)
            if param is not None and main.data_ptr() != param.data_ptr():
                main.copy_(param.view(main.shape))
            set_main_state(optimizer, main, {k: (v.to(main.device) if torch.is_tensor(v) else v)
                                             for k, v in state.items()})
    if scheduler is not None and common.get("opt_param_scheduler") is not None:
        scheduler.load_state_dict(common["opt_param_scheduler"])   # lr, wd -> every group
    if loaded.rerun is not None and manager.rerun_state_machine is not None:
        try:   # Megatron: "Unable to restore RerunMachine from checkpoint ... Skipping."
            manager.rerun_state_machine.load_state_dict(loaded.rerun)
        except (KeyError, ValueError, TypeError) as e:
            warnings.warn(f"{where}: rerun state machine not restored ({e})")
    if loaded.rng is not None:
        set_rng_state(loaded.rng, manager._tracker(chunks))



# %% [markdown]
# `_read` is where a load may fail: detect the format, read the common part and check the
# model config, decide whether the RNG states can be restored (only on the same TP and PP),
# then hand over to the format's reader. Two rules it uses live in
# `_resume_plumbing.py`: `_load_rerun`, Megatron's condition for
# restoring the rerun machine (same world size, TP, PP and DP, and a rerun pending,
# `checkpointing.py:1758-1772`), and `_train_state_dict`, which fills the loop's counters,
# from Megatron's saved `args` when a checkpoint carries no `train_state` (a checkpoint written
# by Megatron itself has none).

# %%
def _read(manager, directory, chunks, optimizer, scheduler, load_optim, finetune):
    """Common part, config and scheduler checks, every tensor: a LoadedState, or ValueError."""
    cfg, grid = manager.config, manager.grid
    fmt = detect_format(directory)
    if fmt == "torch_dcp":
        raise ValueError(f"{directory}: a plain DCP directory (no metadata.json) is not a "
                         "Megatron/tinytron checkpoint")
    if fmt == "torch":
        loaded = read_legacy(directory, grid, chunks, optimizer, manager.comm, load_optim)
        common = loaded.common
    else:
        common = read_common(directory)
    args = common.get("args", {})
    check_model_config(args.get("model_config"), chunks[0].config, directory)
    if scheduler is not None and common.get("opt_param_scheduler") is not None:
        _check_scheduler(scheduler, common["opt_param_scheduler"], directory)
    # what the checkpoint's args say was not saved is not asked for (checkpointing.py:1694-1695)
    load_rng = not (cfg.no_load_rng or finetune or args.get("no_save_rng", False))
    saved = (args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size"))
    if fmt == "torch" and load_optim:
        loaded.param_groups = legacy_param_groups(loaded.common.get("optimizer", {}))
    if load_rng and saved != (grid.size("tp"), grid.size("pp")):
        if manager.comm.rank == 0:
            warnings.warn(f"{directory}: written with (tp, pp) = {saved}, this run has "
                          f"{(grid.size('tp'), grid.size('pp'))}: RNG states not restored")
        load_rng = False
    if fmt == "torch_dist":
        same = saved == (grid.size("tp"), grid.size("pp"))
        return _read_dist(manager, directory, common, chunks, optimizer, load_optim, load_rng,
                          same, _load_rerun(manager, common, same, finetune))
    if not load_rng:
        loaded.rng = None
    return loaded



# %% [markdown]
# `_load` puts the steps in order. Its one decisive collective is `first_error`: every rank
# learns whether any rank failed to read, so either all ranks apply the checkpoint or none
# does, and a failed load leaves the run as it was.

# %%
logger = logging.getLogger("tinytron.checkpoint")


def _load(manager, model, optimizer, scheduler, root):
    """CheckpointManager.load."""
    cfg = manager.config
    root = Path(root or cfg.load)
    chunks = unwrap_chunks(model)
    found = resolve_checkpoint_dir(root, cfg.ckpt_step)
    if found is None:
        if cfg.exit_on_missing_checkpoint:
            raise ValueError(f"{root}: no checkpoint to load (no latest_checkpointed_iteration.txt)")
        return None
    directory, iteration, release = found
    finetune = cfg.finetune or release
    load_optim = optimizer is not None and not (cfg.no_load_optim or finetune)
    # Megatron loads the scheduler inside the optimizer's branch: no_load_optim restarts it
    scheduler = None if (cfg.no_load_optim or finetune) else scheduler
    error, loaded = None, None
    try:
        loaded = _read(manager, directory, chunks, optimizer, scheduler, load_optim, finetune)
    except ValueError as e:
        error = str(e)
    error = manager.comm.first_error(error)   # nobody applies anything unless everyone read it all
    if error:
        raise ValueError(error)
    _apply(manager, loaded, chunks, optimizer if load_optim else None, scheduler, directory)
    if optimizer is not None and not (loaded.optimizer_pieces or loaded.optimizer_state_dict):
        rederive_masters(optimizer)   # no optimizer state read: masters from the weights
    state = _train_state_class()()
    if not finetune:
        state.load_state_dict(_train_state_dict(state, loaded.common, iteration))
    else:   # a finetune restarts the counters but keeps the FLOPs done (checkpointing.py:1877)
        state.num_floating_point_operations_so_far = loaded.common.get(
            "num_floating_point_operations_so_far", 0)
    if manager.comm.rank == 0:
        logger.info("loaded %s (iteration %d)", directory, iteration)
    return state


# %% [markdown]
# ## The options
#
# Every choice made above (the format, async or not, what to skip on save and on load, which
# iteration to read) comes from one record of options, read by the manager and the load.
# Megatron's names and defaults (`megatron/training/config/training_config.py`, the
# checkpoint options), the ones tinytron implements. `data_parallel_random_init` is Megatron's
# training flag, here only for what it changes in a checkpoint: every DP rank's RNG state is
# saved, not just DP rank 0's (`checkpointing.py:382-391`).
#
# <details><summary>Megatron detail: three options of tinytron's own</summary>
#
# Three options are tinytron's own: `async_mode`, how the background writer takes its snapshot,
# and `async_timeout_s`, how long a save waits for that writer before it fails
# ([saving in the background](async_save.py)); and `crc_checksums`, a `checksums.json` with
# every file's CRC-32 that a load then checks. It is off by default, so that a default save is
# file for file what Megatron-Core writes. Megatron has a flag of its own for this,
# `verify_integrity` (off by default, `training_config.py:596`), which writes a SHA-256
# manifest `integrity.json` after `metadata.json` (`serialization.py:409-424`); tinytron does
# not implement that one.
#
# </details>

# %%
@dataclass
class CheckpointConfig:
    """Checkpoint options (Megatron's names where Megatron has them)."""
    save: str | None = None
    """Root directory to save to (None = never save)."""
    load: str | None = None
    """Root directory to resume from (None = start fresh)."""
    ckpt_format: str = "torch_dist"
    """'torch_dist' (sharded, reshardable) or 'torch' (legacy, one file per TP/PP rank)."""
    async_save: bool = False
    """Write in the background; only with torch_dist."""
    async_mode: str = "process"
    """'process' (fork: copy-on-write snapshot) or 'thread' (clone, then write from a thread)."""
    async_timeout_s: float = WRITER_TIMEOUT_S
    """tinytron's own: the longest wait for a background writer, then the save fails."""
    no_save_optim: bool = False
    """Do not save the optimizer state."""
    no_save_rng: bool = False
    """Do not save the RNG states."""
    no_load_optim: bool = False
    """Do not load the optimizer state (fp32 masters are re-derived from the weights)."""
    no_load_rng: bool = False
    """Do not restore the RNG states."""
    finetune: bool = False
    """Load weights only: iteration, progress, optimizer and RNG start fresh."""
    ckpt_step: int | None = None
    """Load this iteration instead of the tracker's."""
    exit_on_missing_checkpoint: bool = False
    """Raise when `load` is set but holds no checkpoint (default: start fresh)."""
    crc_checksums: bool = False
    """tinytron's own: write checksums.json (a CRC-32 of every file); a load checks it when present."""
    ckpt_fully_parallel_save: bool = True
    """Spread the DP-replicated tensors over the DP ranks (Megatron's default); False: DP rank 0."""
    thread_count: int = 1
    """Writer threads per rank (files __R_0 … __R_{n-1}.distcp)."""
    data_parallel_random_init: bool = False
    """The DP ranks draw different streams: save every DP rank's RNG state (else DP rank 0's)."""
    keep_latest_k: int = 0
    """After each save keep only the k newest iter_* directories (torchtitan's name); 0 = keep all."""
    __post_init__ = partialmethod(check_checkpoint_config, async_modes=ASYNC_MODES)  # ValueErrors


# %% [markdown]
# The range checks of these options (a format that is neither `torch_dist` nor `torch`, an
# async save of the legacy format, which Megatron refuses too, `checkpointing.py:598`, an unknown
# `async_mode`, `thread_count < 1`) are one-line `ValueError`s naming the option, in the
# chapter's private module `tinytron.checkpoint._checks`
# (`chapters/03_checkpoint/_checks.py`).
#
# A load hands the loop back its `TrainState` (chapter 01): iteration, consumed and skipped
# samples, FLOPs so far. This package is importable without the loop, so a stand-in with the
# same fields and the same `state_dict()`, `TrainStateFallback`
# (`_resume_plumbing.py`), takes its place when the loop is not there.

# %% [markdown]
# ## The plain API and the loop's hooks
#
# `save_checkpoint` / `load_checkpoint` do one save or one load with a throw-away manager
# (call them on every rank). A training loop keeps one manager and uses its hooks, which have
# the shapes chapter 01's loop calls:
#
# - `save_checkpoint_fn(state, model, optimizer, scheduler)` — at `save_interval` and at exit;
# - `load_checkpoint_fn(model, optimizer, scheduler) -> TrainState | None` — once, before
#   training (`None`: nothing to resume, start fresh);
# - `finalize_async_save_fn(blocking)` — at the start of every iteration with
#   `blocking=False`, and once at exit with `blocking=True`.
#
# `make_checkpoint_hooks` returns them in a `CheckpointHooks` record (it unpacks as the three
# functions and also carries the manager); the record and the one-call functions are in
# `_resume_plumbing.py`. A hook whose directory is not set does nothing:
# a run without `save` never writes, one without `load` always starts fresh.

# %%
def make_checkpoint_hooks(config: CheckpointConfig, grid, rng_tracker=None,
                          rerun_state_machine=None) -> CheckpointHooks:
    """save_checkpoint_fn, load_checkpoint_fn, finalize_async_save_fn for one run (every rank)."""
    manager = CheckpointManager(config, grid, rng_tracker, rerun_state_machine)

    def save_checkpoint_fn(state, model, optimizer, scheduler):
        if config.save is not None:
            manager.save(state, model, optimizer, scheduler)

    def load_checkpoint_fn(model, optimizer, scheduler):
        if config.load is None:
            return None
        return manager.load(model, optimizer, scheduler)

    def finalize_async_save_fn(blocking: bool = False):
        manager.finalize(blocking)

    return CheckpointHooks(save_checkpoint_fn, load_checkpoint_fn, finalize_async_save_fn, manager)


# %% [markdown]
# ## Demo: stop, resume, and nobody can tell
#
# Two ranks train the tiny GPT (4 layers, dropout 0.1) as two pipeline stages with the
# DistributedOptimizer, a cosine schedule with warmup and chapter 04's sampler. After 3 steps
# they save, then train 3 more steps: the uninterrupted run. Then each rank builds everything
# anew with a *different* seed, loads the checkpoint through the hooks' manager and trains the
# same 3 steps. Losses, weights, fp32 masters, both Adam moments, step counts, the learning
# rate, the next draws of Python's, NumPy's, torch's and the tracker's generators — all equal,
# bit for bit. The sampler continues at sample 24 = 3 steps × 8.

# %%
if __name__ == "__main__":
    import tempfile

    import matplotlib.pyplot as plt

    from tinytron.checkpoint import _workers
    from tinytron.launch import run_on_ranks

    with tempfile.TemporaryDirectory() as root:
        out = run_on_ranks(_workers.resume_same_layout, 2, root, 1, 2, timeout=300)[0]
    n, m = len(out["losses_before"]), len(out["losses"])
    print(f"uninterrupted steps {n + 1}..{n + m}: {[round(x, 6) for x in out['losses']]}")
    print(f"resumed       steps {n + 1}..{n + m}: {[round(x, 6) for x in out['losses_resumed']]}")
    print(f"resumed at iteration {out['iteration'] - m}, sampler restarted at sample "
          f"{out['consumed']}; weights + optimizer state bitwise equal: "
          f"{out['params_and_state']}; next random draws equal: {out['draws']}")
    fig, ax = plt.subplots(figsize=(6.5, 2.6))
    steps = range(1, n + m + 1)
    ax.plot(steps, out["losses_before"] + out["losses"], "o-", label="uninterrupted")
    ax.plot(range(n + 1, n + m + 1), out["losses_resumed"], "x", ms=10, label="resumed")
    ax.axvline(n + 0.5, color="gray", ls=":", label="save / restart")
    ax.set(xlabel="iteration", ylabel="loss", title="PP 2, DistributedOptimizer, dropout 0.1")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    assert out["losses"] == out["losses_resumed"]
    assert out["params_and_state"] and out["draws"] and out["consumed"] == n * 8

# %% [markdown]
# ## Summary
#
# - A resume restores model, optimizer (masters, moments, steps, hyperparameters, loss scale),
#   scheduler, iteration and consumed samples, and every RNG; the run continues bit for bit.
# - The order is Megatron's: weights, optimizer, then the scheduler, which writes its lr and
#   weight decay into the param groups; `no_load_optim` leaves the scheduler at step 0.
# - What a checkpoint's args say was not saved (RNG, optimizer) is not asked for; the rerun
#   state machine is restored only on the same layout, with a rerun pending.
# - Across a TP or PP change the tensors reshard but the RNG streams do not, and are not
#   restored (with a warning), as in Megatron.
# - Everything is read and checked before anything is applied: a bad checkpoint leaves the run
#   as it was, and all ranks raise the same error naming the file or the field.
#
# ## How production does it
#
# - Megatron: `megatron/training/checkpointing.py` (`load_checkpoint:1613`, RNG `:1974-2027`,
#   progress from the saved args `:1880-1890`, the load order `:1919-1952`) and
#   `megatron/training/training.py` (`save_checkpoint_and_time:2773`, the async finalize call
#   `:3416`, consumed samples back-filled from iterations `:4177`).
# - torchtitan: `torchtitan/components/checkpoint.py` (`CheckpointManager.load`) loads the same
#   `Stateful` objects it saved (model, optimizer, scheduler, data loader, train state) with
#   DCP, each restoring itself.
#
# ## Exercises
#
# 1. Turn `no_load_rng` on in the demo: which of the compared quantities still agree after the
#    resume, and which do not?
#
#    <details><summary>Hint</summary>
#
#    The demo compares the losses, the parameters and optimizer
#    state, the random draws and the consumed samples. With `no_load_rng`, `_read` leaves the
#    RNG states out and `set_rng_state` is never called: ask which of the four depend on the
#    generators' state after the resume, and whether the tiny model draws any random number in
#    its forward.
#
#    </details>
#
# 2. Resume with `finetune=True`: what does the loop start from, and what does the optimizer?
#
#    <details><summary>Answer</summary>
#
#    In `_load`, `finetune` turns `load_optim` off and drops the
#    scheduler. The loop gets a fresh `TrainState` (iteration 0, no consumed samples) that keeps
#    only `num_floating_point_operations_so_far`. The optimizer state is not read, so
#    `rederive_masters` starts the fp32 masters from the loaded weights, with fresh moments.
#
#    </details>

