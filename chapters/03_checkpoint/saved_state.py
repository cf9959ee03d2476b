# %% [markdown]
# # 03 · Checkpoint: what a checkpoint holds
#
# The pages so far saved tensors: the model's weights, the optimizer's masters and moments, in
# any layout, [in the background](staged_copy.py). A run is more than its tensors. It has an
# iteration count, a position in the data, a learning-rate schedule, Adam's step counts and
# five random number generators, and a resumed run must continue as if it had never stopped.
# This page lists everything a checkpoint holds besides the tensors, and where each part goes;
# [the next page](resume.py) reads it back.
#
# Why it matters: a run that resumes "almost" right does not fail, it drifts. Forget the Adam
# moments and their step count, and the first update after the restart is about lr × sign(g)
# in every coordinate, as at the very first step of a run; forget the sampler's position and
# the model sees the first 24 samples twice; forget the tracker's RNG and every dropout mask
# changes. None of these crashes, and a loss curve hides them.
#
# A worked example in small numbers, the resume page's demo: 2 ranks, 2 pipeline stages, DP 1,
# 8 samples per step, a checkpoint saved after 3 steps:
#
# | state | where it goes | at iteration 3 |
# |---|---|---|
# | weights, fp32 masters, Adam moments | sharded tensors, the optimizer's under `optimizer.state.<quantity>.<key>` | every parameter, each written once |
# | iteration, consumed samples | `common.pt`: `iteration`, `args`, `train_state` | 3 and 3 × 8 = 24 |
# | scheduler | `common.pt`: `opt_param_scheduler` | `num_steps = 24` (it counts samples): past its 16-sample warmup |
# | Adam step counts, loss scale | `common.pt`: `optimizer` | 3 steps |
# | param groups' hyperparameters | object `optimizer.param_groups` per (PP, TP) | 2 × 1 = 2 objects |
# | RNG states | object `rng_state` per (PP, TP), a list over DP | 2 objects, each a one-entry list |
# | rerun state machine | `common.pt`: `rerun_state_machine`, and one object per rank | 2 objects, when a machine is attached |
#
# ```mermaid
# flowchart TB
#     S["the run at iteration 3"] --> T["sharded tensors<br/>weights, masters, moments"]
#     S --> C["common.pt<br/>args, iteration, scheduler,<br/>optimizer steps, rerun"]
#     S --> O["objects per (PP, TP)<br/>rng_state, param_groups"]
#     T --> D[("iter_0000003/")]
#     C --> D
#     O --> D
# ```
#
# You will build: `get_rng_state`, `set_rng_state`, and `_save_request`, the whole state as
# one DCP save.

# %%
from __future__ import annotations

import random

import numpy as np
import torch

from tinytron.checkpoint._resume_plumbing import _common, _rerun_object, _rerun_state
from tinytron.checkpoint.resharding import (optimizer_pieces, optimizer_sharded_state_dict,
                                            optimizer_state_keys, optimizer_steps)
from tinytron.checkpoint.sharded_keys import (extra_state_objects, model_sharded_state_dict,
                                              param_layouts)
from tinytron.checkpoint.torch_dist import SaveRequest, distribute_main_replicas
from tinytron.parallel.rng import set_random_seed

__all__ = ["get_rng_state", "set_rng_state"]

# %% [markdown]
# ## Every random number generator
#
# Megatron saves five generators per rank (`get_rng_state`, `checkpointing.py:371`): Python's
# `random`, NumPy's, torch's CPU generator, the current CUDA device's, and the named states of
# the RNG tracker (appendix A: `model-parallel-rng`, `data-parallel-rng`, …). Dropout inside a
# TP region draws from the tracker's TP-forked stream, dropout outside from the default one:
# restoring all of them makes the masks after a resume identical to an uninterrupted run.
#
# They are stored as one object per (PP, TP) position — Megatron's
# `ShardedObject('rng_state', shape (pp, tp))` — holding a list: with the default seeding all
# DP ranks of a position share their streams, and the list holds DP rank 0's state alone;
# with `data_parallel_random_init` the states of all DP ranks are gathered into it
# (`checkpointing.py:382-391`), and on load a rank takes its own DP entry (entry 0 if DP
# changed, or without the flag, `:1993-1996`). When TP or PP changed the streams mean something else —
# a TP rank's model-parallel seed is `seed + 2718 + tp_rank` — so, as in Megatron
# (`checkpointing.py:1693-1706`), they are **not** restored and a warning says so.
#
# NumPy's state holds an array; it is stored as a list so that the checkpoint stays loadable
# with `torch.load(weights_only=True)`.
#
# <details><summary>Megatron detail: the RNG list under context parallelism</summary>
#
# The gather runs over DP alone, not DP × CP: with CP 2 × DP 2 the list has 2 entries, written
# by CP rank 0's DP group, and both CP ranks of DP rank $d$ restore entry $d$.
#
# </details>

# %%
def get_rng_state(tracker=None) -> dict:
    """Python, NumPy, torch CPU, CUDA and tracker states of this process."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"random_rng_state": random.getstate(),
            "np_rng_state": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "rng_tracker_states": None if tracker is None else tracker.get_states()}


def set_rng_state(state: dict, tracker=None) -> None:
    """Restore what get_rng_state returned."""
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x)
                          for x in state["random_rng_state"]))
    name, keys, pos, has_gauss, cached = state["np_rng_state"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if tracker is not None and state.get("rng_tracker_states") is not None:
        tracker.set_states(state["rng_tracker_states"])


# %% [markdown]
# ## What is not a tensor: `common.pt`
#
# `common.pt` (or each legacy file) holds what is not a sharded tensor, Megatron's content
# (`generate_state_dict`, `checkpointing.py:993`): `args` (the model config, the layout, the
# consumed-sample counters Megatron reads back from its saved args), `checkpoint_version`,
# `iteration`, `opt_param_scheduler` (only when the optimizer is saved, as in Megatron,
# `:1032-1058`), `num_floating_point_operations_so_far`, the optimizer's loss scale and step
# counts, `rerun_state_machine` (below), and `content_metadata`
# (`distrib_optim_sharding_type = "fully_reshardable"`: the optimizer state is in model space,
# see [resharding](resharding.py)); `args` also records `no_save_rng` and `no_save_optim`, so
# that a load does not ask for what was not saved (`checkpointing.py:1694-1695, 1713-1714`).
# The loop's `train_state` is tinytron's addition. The param groups' hyperparameters are not
# here but in a per-(PP, TP) object, `optimizer.param_groups`, next to the RNG states.
#
# In numbers, for the worked example's checkpoint at iteration 3: `args` says
# `tensor_model_parallel_size = 1`, `pipeline_model_parallel_size = 2`,
# `data_parallel_size = 1`, `consumed_train_samples = 24`; `opt_param_scheduler` holds `num_steps = 24` (the scheduler counts samples);
# `optimizer["steps"]` holds Adam's step counts (3 after three steps). Those dictionaries are
# put together by `_common` and `_args` in `_resume_plumbing.py`, and
# the per-(PP, TP) object by `_position_object` there: `ShardedObject(key, data, (pp, tp),
# (pp_rank, tp_rank))`, written by DP rank 0 alone, so a DP 8 run writes each of them once,
# not eight times.

# %% [markdown]
# The rerun state machine of [chapter 08](../08_reliability/rerun_state_machine.py) goes into every
# `torch_dist` checkpoint, as in Megatron (`checkpointing.py:563-566, 1061-1062`;
# `rerun_state_machine.py:858-871`): its mode, state and iteration in `common.pt` under
# `rerun_state_machine`, and each rank's part as the object `rerun_state_machine_state` of
# shape `(world,)` at offset `(rank,)`, written in steady state too, so that successive
# checkpoints have the same keys. A disabled machine saves nothing (`:806-807`), and the
# legacy format carries none (`:809-816`). `_rerun_state` and `_rerun_object`
# (`_resume_plumbing.py`) build the two parts.
#
# <details><summary>Megatron detail: the per-rank rerun content</summary>
#
# The per-rank part is chapter 08's `state_dict()`, not Megatron's dict
# (`rerun_state_machine.py:858-871`): tinytron's machine keeps its flags in its own layout, so
# the object has Megatron's key and shape, `(world,)` at `(rank,)`, but its own content.
#
# </details>

# %% [markdown]
# A `torch_dist` save is one DCP request, and `_save_request` lists what goes into it (the
# checkpoint manager of [the next page](resume.py) calls it, and the RNG states and param
# groups come from its bookkeeping, `ManagerPlumbing` in `_resume_plumbing.py`): the
# model's sharded tensors, the optimizer's in model space (masters and moments under
# `optimizer.state.<quantity>.<key>`, so that any other layout can read them back, see
# [resharding](resharding.py)), the objects (each layer's extra state, the RNG states and the
# param groups per (PP, TP) position, the rerun machine per rank) and `common.pt`. With
# `ckpt_fully_parallel_save` (the default, as in Megatron) the DP-replicated chunks are first
# spread over the DP ranks ([torch_dist](torch_dist.py)), so that every rank writes a similar
# share: with DP 4, each rank writes about a quarter of the model instead of DP rank 0 writing
# all of it.

# %%
def _save_request(manager, staging, state, chunks, optimizer, scheduler) -> SaveRequest:
    """Every sharded tensor and object of the full state, as one DCP save."""
    layouts = param_layouts(chunks, manager.grid)
    tensors = model_sharded_state_dict(chunks, manager.grid)
    steps = None
    if optimizer is not None:
        pieces, _ = optimizer_pieces(optimizer)
        keys = optimizer_state_keys(optimizer, pieces, manager.comm) + ["param"]
        tensors += optimizer_sharded_state_dict(optimizer, layouts, manager.grid, keys)
        steps = optimizer_steps(optimizer, pieces, layouts, manager.comm)
    objects = (extra_state_objects(chunks, manager.grid)
               + manager._position_objects(chunks, optimizer))
    common = _common(chunks[0].config, manager.grid, state, optimizer, scheduler, steps,
                     manager.config)
    if manager.config.ckpt_fully_parallel_save:
        distribute_main_replicas(tensors, manager.comm)
    rerun = _rerun_state(manager.rerun_state_machine, manager.comm)
    if rerun is not None:
        common["rerun_state_machine"], machine = rerun
        objects.append(_rerun_object(manager.comm, machine))
    return SaveRequest(staging, tensors, objects, manager.comm, common,
                       manager.config.thread_count, checksums=manager.config.crc_checksums)


# %% [markdown]
# ## Demo: the dropout masks come back with the generators
#
# One process, the tiny GPT with dropout 0.1 in train mode. The run saves its generators with
# `get_rng_state` and takes its next forward (the reference logits) and its next Python and
# NumPy draws. Then three restarts: each reseeds every generator with another seed, as a new
# process would, restores some of the saved state, and repeats the forward and the draws.
# Residual dropout draws from torch's default generator; attention dropout draws inside the
# tracker's TP fork. Only restoring all five brings back the very same masks.

# %%
def _replay(model, tokens, grid, state=None, tracker=None) -> tuple[torch.Tensor, tuple]:
    """A restarted process: reseed with another seed, restore `state`, forward and draw."""
    set_random_seed(999, grid)
    if state is not None:
        set_rng_state(state, tracker)
    logits = model(tokens).detach()
    return logits, (random.random(), float(np.random.random()))


# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.model import GPTModel, tiny_config
    from tinytron.parallel import ParallelGrid
    from tinytron.parallel.rng import get_rng_tracker

    grid = ParallelGrid.single()
    set_random_seed(1234, grid)
    tracker, model = get_rng_tracker(), GPTModel(tiny_config(dropout=0.1), grid).train()
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    saved = get_rng_state(tracker)                  # what the checkpoint stores
    reference = model(tokens).detach(), (random.random(), float(np.random.random()))
    cases = {"nothing restored": _replay(model, tokens, grid),
             "all but the tracker": _replay(model, tokens, grid, saved),
             "all five": _replay(model, tokens, grid, saved, tracker)}
    diff = {name: (logits - reference[0]).abs().max().item() for name, (logits, _) in cases.items()}
    for name, (_, draws) in cases.items():
        print(f"{name:20s} max |logits - reference| = {diff[name]:.2e}, "
              f"Python and NumPy draws equal: {draws == reference[1]}")
    fig, ax = plt.subplots(figsize=(6.5, 2.2))
    ax.barh(list(diff), list(diff.values()), color=["#de2d26", "#fc9272", "#31a354"])
    ax.set(xlabel="max |logits − uninterrupted logits|", title="the next forward after a restart")
    plt.tight_layout()
    plt.show()
    assert diff["all five"] == 0 and cases["all five"][1] == reference[1]
    assert diff["all but the tracker"] > 0 and diff["nothing restored"] > 0

# %% [markdown]
# ## Summary
#
# - Besides the tensors a checkpoint holds the loop's counters, the scheduler, Adam's step
#   counts and loss scale, the param groups' hyperparameters, every RNG state and the rerun
#   state machine; each has one place (`common.pt`, an object per (PP, TP) or per rank).
# - Five generators per rank: Python's, NumPy's, torch's CPU and CUDA ones, and the tracker's
#   named streams; restoring fewer changes the dropout masks after a resume.
# - What every rank of a (PP, TP) position shares is written once, by DP rank 0; with
#   `ckpt_fully_parallel_save` the DP-replicated tensors are spread over the DP ranks.
#
# ## How production does it
#
# - Megatron: `megatron/training/checkpointing.py` (`get_rng_state:371`, the DP gather
#   `:382-391`, `generate_state_dict:993`, the rerun state `:563-566`) and
#   `megatron/core/rerun_state_machine.py` (its sharded state, `:858-871`).
# - torchtitan: `torchtitan/components/checkpoint.py` keeps the model, optimizer, scheduler,
#   data loader and train state as `Stateful` objects and saves them with DCP; its data loader
#   state replaces Megatron's consumed-samples counter.
#
# ## Exercises
#
# 1. The running example (TP 2, PP 2, DP 64): how many `rng_state` objects does a checkpoint
#    hold, and how many generator states in all, with and without
#    `data_parallel_random_init`?
#
#    <details><summary>Answer</summary>
#
#    One object per (PP, TP) position: 2 × 2 = 4, each written by DP rank 0 of its position.
#    Without the flag each list holds DP rank 0's state alone: 4 states. With it each list
#    holds all 64 DP ranks' states: 4 × 64 = 256.
#
#    </details>
#
# 2. A run with a global batch of 1024 saves at iteration 500. What do `iteration`,
#    `consumed_train_samples` and the scheduler's `num_steps` hold?
#
#    <details><summary>Answer</summary>
#
#    `iteration = 500`; `consumed_train_samples = 500 × 1024 = 512,000`; the scheduler counts
#    samples, so `num_steps = 512,000` too (the demo's 24 = 3 × 8 is the same count).
#
#    </details>
#
# 3. Why is NumPy's state stored as a list and not as the array `np.random.get_state()`
#    returns?
#
#    <details><summary>Hint</summary>
#
#    A resume reads `common.pt` and the objects with `torch.load(weights_only=True)`. Ask which
#    types that loader accepts.
#
#    </details>
