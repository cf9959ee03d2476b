"""Plumbing behind the resume page (chapters/03_checkpoint/resume.py).

The loop's counters when the loop is not importable, the dictionaries that go into `common.pt`,
the per-(PP, TP) and per-rank objects, the manager's RNG gathering, legacy save and async
finalize, the scheduler's trial load, the rerun-restore rule, and the one-call
`save_checkpoint` / `load_checkpoint`. The page explains each of them; the code lives here so
that the page shows the mechanism.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass

from tinytron.checkpoint.formats import CheckpointSaveError
from tinytron.checkpoint.legacy import CHECKPOINT_VERSION, save_legacy
from tinytron.checkpoint.sharded_keys import ShardedObject

logger = logging.getLogger("tinytron.checkpoint")


# -- the loop's counters -------------------------------------------------------------------

@dataclass
class TrainStateFallback:
    """The loop's TrainState fields, used when tinytron.main_loop.loop is not importable."""

    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    num_floating_point_operations_so_far: float = 0.0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        for f in dataclasses.fields(self):
            if f.name in sd:
                setattr(self, f.name, sd[f.name])


def _train_state_class():
    """chapter 01's TrainState when it is there."""
    try:
        from tinytron.main_loop.loop import TrainState
        return TrainState
    except ImportError:
        return TrainStateFallback


def _train_state_dict(state, common: dict, iteration: int) -> dict:
    """The loop's counters from a checkpoint; older or foreign ones via Megatron's saved args."""
    out = state.state_dict()
    args = common.get("args", {})
    out.update({k: args[k] for k in out if k in args})
    out.update(iteration=iteration, num_floating_point_operations_so_far=common.get(
        "num_floating_point_operations_so_far", 0))
    out.update({k: v for k, v in common.get("train_state", {}).items() if k in out})
    return out


# -- what common.pt holds ------------------------------------------------------------------

def _hparams(optimizer) -> list[dict]:
    """Each param group's hyperparameters (no params)."""
    return [{k: v for k, v in g.items() if k not in ("params", "param_names")}
            for g in optimizer.param_groups]


def _args(config, grid, state, options=None) -> dict:
    no_save_rng = getattr(options, "no_save_rng", False)
    no_save_optim = getattr(options, "no_save_optim", False)
    return {"model_config": dataclasses.asdict(config),
            "no_save_rng": no_save_rng, "no_save_optim": no_save_optim,
            "tensor_model_parallel_size": grid.size("tp"),
            "pipeline_model_parallel_size": grid.size("pp"),
            "context_parallel_size": grid.size("cp"), "data_parallel_size": grid.size("dp"),
            "consumed_train_samples": getattr(state, "consumed_train_samples", 0),
            "skipped_train_samples": getattr(state, "skipped_train_samples", 0),
            "consumed_valid_samples": getattr(state, "consumed_valid_samples", 0)}


def _common(config, grid, state, optimizer, scheduler, steps, options=None) -> dict:
    """The non-tensor part of a checkpoint."""
    common = {"args": _args(config, grid, state, options), "checkpoint_version": CHECKPOINT_VERSION,
              "iteration": state.iteration, "train_state": state.state_dict(),
              "num_floating_point_operations_so_far":
                  getattr(state, "num_floating_point_operations_so_far", 0.0),
              "opt_param_scheduler": None if scheduler is None else scheduler.state_dict(),
              "content_metadata": {"distrib_optim_sharding_type": "fully_reshardable",
                                   "singleton_local_shards": False,
                                   "chained_optim_avoid_prefix": True}}
    if optimizer is not None and steps is not None:
        scaler = getattr(optimizer, "grad_scaler", None)
        common["optimizer"] = {"steps": steps,
                               "grad_scaler": None if scaler is None else scaler.state_dict()}
    return common


# -- objects: per (PP, TP) position, per rank ----------------------------------------------

def _position_object(grid, key: str, data, ) -> ShardedObject:
    """Megatron's per-(PP, TP) object, written by DP rank 0."""
    return ShardedObject(key, data, (grid.size("pp"), grid.size("tp")),
                         (grid.rank("pp"), grid.rank("tp")), is_main=grid.rank("dp_cp") == 0)


def _rerun_state(machine, comm) -> tuple[dict, dict] | None:
    """(common part, this rank's part) of a rerun state machine, or None when there is none."""
    from tinytron.reliability import RerunMode

    if machine is None or machine.mode == RerunMode.DISABLED:
        return None
    sd = machine.state_dict()
    return ({"mode": sd["mode"], "state": sd["state"], "current_iteration": sd["current_iteration"],
             "world_size": comm.world_size}, sd)


def _rerun_object(comm, data) -> ShardedObject:
    """Megatron's `rerun_state_machine_state` object: one per rank."""
    return ShardedObject("rerun_state_machine_state", data, (comm.world_size,), (comm.rank,))


def _load_rerun(manager, common: dict, same_layout: bool, finetune: bool) -> bool:
    """Megatron's rule (`checkpointing.py:1758-1772`): same world, TP, PP and DP, a rerun pending."""
    from tinytron.reliability import RerunState

    saved = common.get("rerun_state_machine")
    return (manager.rerun_state_machine is not None and saved is not None and not finetune
            and same_layout and saved.get("world_size") == manager.comm.world_size
            and common.get("args", {}).get("data_parallel_size") == manager.grid.size("dp")
            and saved.get("state") != int(RerunState.NOT_RUNNING_YET))


# -- the scheduler's trial load ------------------------------------------------------------

class _GroupsOnly:
    """What a scheduler drives, without the params: copies of the optimizer's param groups."""

    def __init__(self, groups):
        self.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _check_scheduler(scheduler, sd: dict, where) -> None:
    """Load `sd` into a copy of the scheduler (and of its groups): ValueError if it refuses."""
    trial = copy.copy(scheduler)
    trial.optimizer = _GroupsOnly(getattr(scheduler.optimizer, "param_groups", []))
    try:
        trial.load_state_dict(sd)
    except (ValueError, KeyError, AssertionError) as e:
        raise ValueError(f"{where}: scheduler state does not fit: {e}") from e


# -- the manager's bookkeeping -------------------------------------------------------------

class ManagerPlumbing:
    """The parts of CheckpointManager that are bookkeeping: the RNG tracker and gathered states,
    the per-position objects, the legacy save and the async finalize. Expects `config`, `grid`,
    `comm`, `rng_tracker`, `saver` and `stats` on the instance."""

    def _tracker(self, chunks):
        if self.rng_tracker is not None:
            return self.rng_tracker
        from tinytron.parallel.rng import get_rng_tracker
        return getattr(chunks[0], "rng_tracker", None) or get_rng_tracker(self.grid.device)

    def _rng_states(self, chunks) -> list | None:
        """A list of RNG states per (PP, TP) position: every DP rank's, or only this one's."""
        from tinytron.checkpoint.saved_state import get_rng_state

        if self.config.no_save_rng:
            return None
        mine, gather = get_rng_state(self._tracker(chunks)), self.config.data_parallel_random_init
        # over DP alone, not DP x CP (checkpointing.py:382-391): one entry per DP rank
        return self.comm.all_gather_object(mine, group="dp_only") if gather else [mine]

    def _position_objects(self, chunks, optimizer) -> list[ShardedObject]:
        """Objects stored once per (PP, TP) position: RNG states, the param groups' hyperparameters."""
        g, out = self.grid, []
        rng = self._rng_states(chunks)
        if rng is not None:
            out.append(_position_object(g, "rng_state", rng))
        if optimizer is not None:
            out.append(_position_object(g, "optimizer.param_groups", _hparams(optimizer)))
        return out

    def _save_legacy(self, staging, state, chunks, optimizer, scheduler, commit, t0) -> dict:
        common = _common(chunks[0].config, self.grid, state, None, scheduler, None, self.config)
        error = save_legacy(staging, self.grid, chunks, optimizer, common,
                            self._rng_states(chunks), self.comm)
        error = self.comm.first_error(error)
        if error is None and self.comm.rank == 0:
            try:
                commit()
            except OSError as e:
                error = f"committing {staging} failed: {type(e).__name__}: {e}"
        error = self.comm.broadcast_object(error)
        if error:
            raise CheckpointSaveError(error)
        stats = {"label": f"iteration {state.iteration}", "blocking_s": time.perf_counter() - t0}
        self.stats.append(stats)
        return stats

    def finalize(self, blocking: bool = False) -> dict | None:
        """Complete a pending async save when every rank's writer is done (or wait for it)."""
        stats = None if self.saver is None else self.saver.finalize(blocking)
        if stats is not None:
            self.stats.append(stats)
            if self.comm.rank == 0:
                logger.info("saved %s: blocking %.3f s, background %.3f s", stats["label"],
                            stats["blocking_s"], stats["background_s"])
        return stats


# -- the one-call API and the hooks' record --------------------------------------------------

def save_checkpoint(root, state, model, optimizer=None, scheduler=None, grid=None,
                    **options) -> dict:
    """Save the full training state under `root` (sync); options are CheckpointConfig fields."""
    from tinytron.checkpoint.formats import unwrap_chunks
    from tinytron.checkpoint.resume import CheckpointConfig, CheckpointManager

    chunks = unwrap_chunks(model)
    manager = CheckpointManager(CheckpointConfig(save=str(root), **options),
                                grid or chunks[0].grid)
    stats = manager.save(state, model, optimizer, scheduler)
    manager.finalize(blocking=True)
    return stats


def load_checkpoint(root, model, optimizer=None, scheduler=None, grid=None, **options):
    """Load the newest (or `ckpt_step`) checkpoint under `root`: a TrainState, or None."""
    from tinytron.checkpoint.formats import unwrap_chunks
    from tinytron.checkpoint.resume import CheckpointConfig, CheckpointManager

    chunks = unwrap_chunks(model)
    manager = CheckpointManager(CheckpointConfig(load=str(root), **options),
                                grid or chunks[0].grid)
    return manager.load(model, optimizer, scheduler)


@dataclass
class CheckpointHooks:
    """The loop's three hooks (unpack as save, load, finalize) and the manager behind them."""

    save_checkpoint_fn: object
    load_checkpoint_fn: object
    finalize_async_save_fn: object
    manager: CheckpointManager  # noqa: F821  (the page's class; annotations are strings here)

    def __iter__(self):
        return iter((self.save_checkpoint_fn, self.load_checkpoint_fn, self.finalize_async_save_fn))
