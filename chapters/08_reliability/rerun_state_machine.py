# %% [markdown]
# # 08 · The rerun state machine: is it the data, the model or the hardware?
#
# A NaN loss at iteration 41 237 of a month-long run has three possible causes, and each asks
# for a different action: a **transient** hardware glitch (a bit flip; just redo the step), a
# **persistent** hardware fault (a bad GPU; get it out of the job), or a **correct result** of
# the computation (bad data or a diverging model; a person has to look). Megatron tells them
# apart with one idea: *run the same iteration again* — first in place on the same GPU, then,
# if it reproduces, from a checkpoint on a different GPU — and compare. This page builds that
# machine's modes, states, transitions and verdicts, the data iterator that can replay a step,
# and the exit codes a job scheduler acts on; [08.3](rerun_diagnoses.py) adds what it
# remembers across steps and launches (the spike threshold, the tracker file, the checkpoint
# payload), assembles `RerunStateMachine` and runs three faults to their diagnoses.
#
# Why a machine at all, and not `if math.isnan(loss): sys.exit(1)`? Because the exit is the
# expensive part. A month-long job on 1 024 GPUs that stops on every NaN loses its queue slot
# and the progress since its last checkpoint each time, and a person still has to guess the
# cause. A rerun costs one extra forward-backward pass in place (and, when that reproduces the
# value, one relaunch from a checkpoint), and turns the guess into a line in a file. The argument checks, the gathering of statistics between ranks and the copying of
# plain fields into a checkpoint live in the chapter's private module
# `tinytron.reliability._rerun_plumbing` (`chapters/08_reliability/_rerun_plumbing.py`); this
# page keeps the states, the transitions and the verdicts.

# %%
from __future__ import annotations

import enum
import math
import os
import random
import socket
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from tinytron.reliability._rerun_plumbing import (SpikeConsole, checked_mode,
                                                  replayable_iterators)

__all__ = [
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE", "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "RerunDiagnostic", "RerunMode", "RerunState", "RerunValidationStatus", "COMPARISON_MATCH",
    "COMPARISON_MISMATCH", "compare_floats", "Caller", "Call", "RerunDataIterator",
    "default_identity", "MachineState", "Replay", "PassStarts", "Transitions", "ExitDecision",
    "NoRerun", "Judging", "Verdicts",
]

# %% [markdown]
# ## Three diagnoses from two reruns
#
# | initial run | rerun in place (same GPU) | rerun from checkpoint (other GPU) | diagnosis | exit |
# |---|---|---|---|---|
# | rejected | differs | — | transient error | 17, resume from the *previous* checkpoint |
# | rejected | same | — | need a second opinion | 16 + checkpoint of this step |
# | (resumed) | — | landed on the same GPU again | undecided | 16 again |
# | (resumed) | — | differs | persistent error: the first GPU was wrong | 17 |
# | (resumed) | — | same | correct result: data or model | 17 (fatal check) / continue |
#
# "Same" means the relative difference `compare_floats(a, b)` $= |2(a-b)/(a+b)|$ is at most the
# tolerance: 0 for the loss (a deterministic recomputation must match bit for bit), 0.001 for
# gradient norms (flash-attention's backward is not bit-deterministic). Two NaNs compare equal
# (0), a NaN against a number is a mismatch ($\infty$)
# (`megatron/core/rerun_state_machine.py:1398`).
#
# <details><summary>Megatron detail: opposite signs</summary>
#
# Two cases of `_compare_floats` (`:1406-1417`): $+\infty$ against $-\infty$, and
# $a = -b \ne 0$. Megatron's formula gives NaN for the first ($\infty/\text{NaN}$), and
# `NaN > tolerance` is false, so opposite infinities read as reproducible; the second divides
# by zero and raises `ZeroDivisionError` in the middle of a rerun. tinytron calls both a
# mismatch ($\infty$): a value that changed sign was not reproduced.
#
# </details>
#
# A worked example in small numbers. A bucket's gradient norm is 2.000 in the initial run and
# 2.002 in the rerun: $|2 \cdot (2.000 - 2.002) / 4.002| = 0.0009995$, under the 0.001
# tolerance of a gradient norm, so the two passes agree. The same two numbers as a *loss* would
# be a mismatch, since the loss's tolerance is 0. A loss of NaN twice is a match (0): the NaN
# reproduced, which is what sends the machine on to the second GPU.
#
# The exit codes are Megatron's: `EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16` ("relaunch me from the
# checkpoint I just wrote, preferably elsewhere") and `EXIT_CODE_FAILED_ON_RESULT_VALIDATION =
# 17` ("stop: read the tracker file") (`rerun_state_machine.py:36,39`). A scheduler wrapper
# that relaunches on 16 and pages someone on 17 is the whole integration.
#
# A check can be **fatal** (NaN, Inf: the job cannot usefully continue) or **non-fatal** (a
# spiky loss or an unexpectedly large gradient: note the diagnosis, rerun once in place and
# carry on with the rerun's gradients).

# %%
EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
COMPARISON_MATCH = 0.0
COMPARISON_MISMATCH = math.inf
REPORTING_INTERVAL_ITERATIONS = 2  # determinism stats are printed every 2 iterations


# %% [markdown]
# The words the machine speaks: what a rerun concluded (`RerunDiagnostic`), which of its three
# modes it runs in (`RerunMode`), and where it stands within one iteration (`RerunState`, the
# states of the diagram further down, with Megatron's values).

# %%
class RerunDiagnostic(str, enum.Enum):
    """What a rerun concluded about a rejected result."""
    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, enum.Enum):
    """disabled (checks raise at once), validate_results (rerun), report_determinism_stats."""
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunState(enum.IntEnum):
    """Where the machine is within one iteration (values as in Megatron)."""
    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


# %% [markdown]
# Every event the tracker file records carries one of six status words: the rejection of the
# initial run, then whether the first and the second rerun reproduced it.

# %%
class RerunValidationStatus(str, enum.Enum):
    """The status word written to the tracker file."""
    RERUN_DISABLED = "rerun_disabled"
    INITIAL_RUN = "initial_run"
    FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
    FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
    SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
    SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"


# %% [markdown]
# The comparison itself, with the rule of the table above: equal or both NaN is a match (0),
# a NaN or an infinity against anything else is a mismatch ($\infty$), and otherwise the
# relative difference $|2(a-b)/(a+b)|$.

# %%
def _to_float(x: Any) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def _detach(result):
    return result.detach().clone() if isinstance(result, torch.Tensor) else result


def compare_floats(a: Any, b: Any) -> float:
    """Relative difference of two scalars: 0 if equal or both NaN, inf if one is NaN or Inf."""
    a, b = _to_float(a), _to_float(b)
    if a == b or (math.isnan(a) and math.isnan(b)):
        return COMPARISON_MATCH
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return COMPARISON_MISMATCH
    return abs((a - b) / (a + b) * 2.0) if a + b != 0 else COMPARISON_MISMATCH


# %% [markdown]
# ## Replaying the same step
#
# A rerun must see the same micro-batches and draw the same random numbers (dropout masks), or
# "differs" means nothing. Two pieces make that true:
#
# - `RerunDataIterator` (`rerun_state_machine.py:1110`) wraps the training iterator and keeps
#   every micro-batch it hands out during the step; `rewind()` replays them from the first,
#   `advance()` drops them when the next step starts. One global batch per data-parallel rank is
#   held for the whole step — a few MB of token ids. In `disabled` mode nothing is ever
#   replayed and the machine never calls `advance()`, so the iterator keeps nothing at all
#   (Megatron asks its global machine's mode before each append, `:1146-1147`; here the
#   iterator is handed its machine) — buffering there would hold every micro-batch of the run.
# - at the start of every step the machine saves Python's, NumPy's and torch's CPU and CUDA RNG
#   states plus whatever `state_save_func` returns (Megatron: the tensor-parallel RNG tracker's
#   named streams) and restores them before each rerun (`_save_state`/`_restore_state`, `:963`).
#
# Each `validate_result` call is identified by `Call(Caller(message, rank), sequence)`, the
# k-th call with that message in this pass; the k-th call of the rerun is compared with the
# k-th call of the initial run. That needs deterministic *control flow*, not deterministic
# numerics.

# %%
@dataclass(frozen=True)
class Caller:
    """Who validated: the check's message and the rank."""
    message: str
    rank: int


@dataclass(frozen=True)
class Call:
    """The sequence-th validation by one caller within the current pass."""
    caller: Caller
    sequence: int


# %% [markdown]
# The iterator holds the step's micro-batches in a list and, when rewound, hands them out again
# in order. With $m = 4$ micro-batches a step reads batches 0-3 from the loader and keeps them;
# a rerun reads `saved[0]` … `saved[3]` and the loader is not touched; `advance()` at the next
# step drops the four and reads batch 4. For a relaunch (the checkpoint payload of
# [08.3](rerun_diagnoses.py)) the four go into the exit-16 checkpoint: `state_dict()` hands
# them out, `replay_from()` takes them back in the new process.
#
# First the four moves on that list, in a small base class: `rewind`, `advance`, and the two
# halves of a relaunch.

# %%
class _SavedStep:
    """The step's saved micro-batches: rewind, advance, and hand over to a relaunch."""

    def rewind(self) -> None:
        """Replay this step's micro-batches from the first."""
        self.replaying, self.replay_pos = True, 0

    def advance(self) -> None:
        """A new step: forget the saved micro-batches and read fresh ones."""
        self.replaying, self.replay_pos, self.saved_microbatches = False, 0, []

    def state_dict(self) -> dict:
        """The step's micro-batches, for the exit-16 checkpoint."""
        return {"saved_microbatches": list(self.saved_microbatches)}

    def replay_from(self, state: dict) -> None:
        """After a relaunch: replay the saved step and read past it in the repositioned loader."""
        self.saved_microbatches = list(state["saved_microbatches"])
        self.replaying, self.replay_pos = True, 0
        self.drain = len(self.saved_microbatches)


# %% [markdown]
# Then the iterator: a step reads from the loader and keeps what it read; a rerun reads the
# kept batches back (and, after a relaunch, reads past them in the loader, `drain`).

# %%
class RerunDataIterator(_SavedStep):
    """Wraps a data iterator so that the current step's micro-batches can be replayed.

    With `machine` given, micro-batches are kept only while its mode is not `disabled`.
    """

    def __init__(self, iterable, machine=None):
        self.iterable: Iterator = iter(iterable)
        self.machine = machine
        self.saved_microbatches: list = []
        self.replaying = False
        self.replay_pos = 0
        self.drain = 0   # replayed batches still to be read past in `iterable` (a relaunch)

    def __iter__(self):
        return self

    def __next__(self):
        if self.replaying:
            if self.replay_pos >= len(self.saved_microbatches):
                raise RuntimeError(f"the rerun asked for micro-batch {self.replay_pos + 1} but the "
                                   f"step only used {len(self.saved_microbatches)}")
            batch = self.saved_microbatches[self.replay_pos]
            self.replay_pos += 1
            if self.drain:   # keep the loader in step: it repositioned to this step's start
                self.drain -= 1
                next(self.iterable)
            return batch
        batch = next(self.iterable)
        if self.machine is None or self.machine.mode != RerunMode.DISABLED:
            self.saved_microbatches.append(batch)
        return batch


# %% [markdown]
# Where a result was computed is the node's name and the CUDA device; a test can set the node
# name with `TINYTRON_NODE_NAME` to play two machines on one.

# %%
def default_identity() -> tuple[str, int]:
    """(node name, CUDA device index or -1): where a suspicious result was computed."""
    node = os.environ.get("TINYTRON_NODE_NAME") or socket.gethostname()
    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    return node, device


# %% [markdown]
# ## The machine
#
# The training step becomes a loop whose body is one forward-backward pass
# (`train_step`, `megatron/training/training.py:2178`):
#
# ```python
# while rsm.should_run_forward_backward(data_iterator):
#     zero the grad buffers; losses = forward_backward_func(...)   # validate_result inside
# should_checkpoint, should_exit, exit_code = rsm.should_checkpoint_and_exit()
# if should_exit: (save if asked) and sys.exit(exit_code)   # no optimizer step
# optimizer.step()   # on the gradients of the *last* pass
# ```
#
# ```mermaid
# stateDiagram-v2
#   [*] --> NOT_RUNNING_YET
#   NOT_RUNNING_YET --> INITIAL_RUN: save RNG, advance data
#   INITIAL_RUN --> NOT_RUNNING_YET: nobody rejected
#   INITIAL_RUN --> RERUNNING_IN_PLACE: any rank rejected → restore RNG, rewind data
#   RERUNNING_IN_PLACE --> NOT_RUNNING_YET: continue (non-fatal check)
#   RERUNNING_IN_PLACE --> RERUNNING_IN_PLACE: differs → exit 17
#   RERUNNING_IN_PLACE --> WILL_RERUN_FROM_CHECKPOINT: same → checkpoint, exit 16
#   WILL_RERUN_FROM_CHECKPOINT --> RERUNNING_FROM_CHECKPOINT: after the relaunch loads it
#   RERUNNING_FROM_CHECKPOINT --> RERUNNING_AGAIN_FROM_CHECKPOINT: same GPU again → exit 16
#   RERUNNING_FROM_CHECKPOINT --> NOT_RUNNING_YET: continue (non-fatal)
#   RERUNNING_FROM_CHECKPOINT --> RERUNNING_FROM_CHECKPOINT: verdict logged → exit 17
# ```
#
# Every decision is a logical OR over **all ranks** (one int32 all-reduce with MAX,
# `_reduce_any`, `:253`), so every rank takes the same branch and the collectives inside the
# rerun still match. The first iteration of a process is not validated (a checkpoint cannot be
# written before the optimizer has stepped once); in `disabled` mode a rejected result raises
# at once, as it always did (`validate_result`, `:463`).
#
# The machine is put together from whole parts, each a small class with one job: its state
# (`MachineState`), the tools it uses to replay a step (`Replay`), the ways a pass begins
# (`PassStarts`), the transitions (`Transitions`), the exit decision (`ExitDecision`), the
# judging of a value (`NoRerun`, `Judging`), the two verdicts (`Verdicts`), the spike
# threshold (`Spikes`), the determinism statistics (`DeterminismStats`), and what it writes
# down (`Tracker`, `Records`). The last four are [08.3](rerun_diagnoses.py)'s, where
# `RerunStateMachine` puts all of them together; the methods of this page call theirs
# (`_track`, `_maybe_report_stats`) by name.

# %%
class MachineState:
    """The rerun state machine's fields: mode, state, flags and what the first pass saw."""

    def __init__(self, mode: RerunMode | str = RerunMode.VALIDATE_RESULTS, *,
                 error_injector=None,
                 tracker_path: str | None = None, group=None,
                 state_save_func: Callable[[], Any] | None = None,
                 state_restore_func: Callable[[Any], None] | None = None,
                 identity_func: Callable[[], tuple[str, int]] = default_identity):
        self.mode = checked_mode(mode, RerunMode)  # a ValueError lists the valid spellings
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = 0  # 1-based number of the iteration being run
        self.error_injector = error_injector  # result_checks.RerunErrorInjector, for tests
        self.tracker_path, self.group = tracker_path, group
        self.state_save_func, self.state_restore_func = state_save_func, state_restore_func
        self.identity_func = identity_func
        self.first_iteration_complete = False
        self._clear_flags()
        self.failed_validation_call: Optional[Call] = None
        self.initial_result: Any = None
        self.suspicious_node: Optional[str] = None
        self.suspicious_device: Optional[int] = None
        self.large_value_counts: dict[str, int] = {}
        self.max_values: dict[str, float] = {}
        self.spike_console = SpikeConsole()   # what the console is told about the threshold
        self.data_iterator_checkpoints: Optional[list] = None   # the step's data, after a load
        self.validation_counts: dict[Caller, int] = defaultdict(int)
        self.saved_state: Any = None
        self.saved_results: dict[Call, Any] = {}
        self.determinism_diffs: dict[str, list[float]] = defaultdict(list)
        self.diagnosis: Optional[RerunDiagnostic] = None  # the last verdict, for callers to read
        if tracker_path is not None:
            open(tracker_path, "a").close()  # fail now, not at the first fault

    def _clear_flags(self) -> None:
        self.rerun_requested = self.checkpoint_requested = False
        self.restart_again_requested = self.continue_requested = False


# %% [markdown]
# The tools of a replay: the process's rank, one all-reduce that ORs the flags of every rank,
# the RNG states saved before the first pass and restored before each rerun (Python's,
# NumPy's, torch's, CUDA's, and any other state the caller registers), and the iterators that
# can rewind to the step's first micro-batch.

# %%
class Replay:
    """The rank, one OR over ranks, the RNG states of a replay, the replayable iterators."""

    @property
    def rank(self) -> int:
        """This process's rank in the world (0 without a process group)."""
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _reduce_any(self, *flags: bool) -> list[bool]:
        """Logical OR of each flag over every rank of the group (one all-reduce)."""
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend(self.group) == "nccl":
                t = t.cuda()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in t.tolist()]

    def _save_state(self) -> None:
        self.saved_state = {
            "random": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "other": self.state_save_func() if self.state_save_func else None}

    def _restore_state(self) -> None:
        s = self.saved_state
        random.setstate(s["random"])
        np.random.set_state(s["numpy"])
        torch.set_rng_state(s["torch"])
        if s["cuda"] is not None:
            torch.cuda.set_rng_state(s["cuda"])
        if self.state_restore_func is not None:
            self.state_restore_func(s["other"])

    @staticmethod
    def _iterators(data_iterator) -> list[RerunDataIterator]:
        return replayable_iterators(data_iterator, RerunDataIterator)  # a TypeError otherwise


# %% [markdown]
# The transitions (`:271-397`): one branch per state of the diagram above. Each call says
# whether to run the forward-backward pass (again); a rerun first restores the RNG states and
# rewinds the data, so the pass sees exactly what the first one saw.
#
# A trace, the transient fault of [08.3](rerun_diagnoses.py)'s first demo (iteration 3, two
# micro-batches, NaN on the first pass only):
#
# 1. `NOT_RUNNING_YET`: save the RNG states, `advance()` the data, go to `INITIAL_RUN`, return
#    True. The pass runs; the first micro-batch's loss is NaN, so `validate_result` records
#    the call `("loss is NaN", rank 0), 1` with its value and sets `rerun_requested`.
# 2. `INITIAL_RUN`: the OR over ranks is 1 on every rank, so restore the RNG, `rewind()`, go
#    to `RERUNNING_IN_PLACE`, return True. The pass runs again on the same micro-batches; the
#    same call now gives 3.1412, `compare_floats(nan, 3.1412)` is $\infty > 0$: transient. The
#    tracker gets `first_rerun_not_reproducible`; the check is fatal, so no flag is set.
# 3. `RERUNNING_IN_PLACE`: neither "continue" nor "checkpoint", so stay and return False; the
#    loop ends, and `should_checkpoint_and_exit` answers (no save, exit, 17).
#
# The job leaves without an optimizer step; relaunched, it resumes from the previous
# checkpoint and runs iteration 3 on a GPU that is now fine.
#
# Three ways a pass can begin, each its own method: a fresh iteration (save the RNG states,
# `advance()` the data), a rerun in the same process (restore, `rewind()`), and the rerun of a
# relaunch (replay the micro-batches the exit-16 checkpoint carried).

# %%
class PassStarts:
    """How a pass begins: a fresh iteration, a rewound rerun, or a relaunched one."""

    def _begin_iteration(self, its) -> bool:
        if self.mode != RerunMode.DISABLED:
            self._save_state()
            for d in its:
                d.advance()
            self._clear_flags()
        self.current_iteration += 1
        self.state = RerunState.INITIAL_RUN
        return True

    def _rewind(self, its, next_state: RerunState, result: bool) -> bool:
        self._restore_state()
        for d in its:
            d.rewind()
        self.state = next_state
        return result

    def _resume_rejected_step(self, its) -> bool:
        self.current_iteration += 1  # the checkpoint holds the iterations *before* this one
        saved, self.data_iterator_checkpoints = self.data_iterator_checkpoints, None
        if saved is not None:   # the very micro-batches the rejected step read
            if len(saved) != len(its):
                raise RuntimeError(f"the checkpoint holds {len(saved)} data iterators' "
                                   f"micro-batches, this run has {len(its)}")
            for d, state in zip(its, saved):
                d.replay_from(state)
        self.state = RerunState.RERUNNING_FROM_CHECKPOINT
        return True


# %% [markdown]
# The transitions proper: the branch of each state, in the diagram's order.

# %%
class Transitions:
    """`should_run_forward_backward`: one branch per state of the diagram."""

    def should_run_forward_backward(self, data_iterator) -> bool:
        """Whether to run (or rerun) the forward-backward pass of this step."""
        self.validation_counts = defaultdict(int)
        its = [] if self.mode == RerunMode.DISABLED else self._iterators(data_iterator)
        s = self.state
        if s == RerunState.NOT_RUNNING_YET:
            return self._begin_iteration(its)
        if s == RerunState.INITIAL_RUN:
            if self.mode == RerunMode.DISABLED or not self._reduce_any(self.rerun_requested)[0]:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            return self._rewind(its, RerunState.RERUNNING_IN_PLACE, True)
        if s == RerunState.RERUNNING_IN_PLACE:
            if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
                self._maybe_report_stats()
                self.saved_results = {}
                self.state = RerunState.NOT_RUNNING_YET
                return False
            cont, ckpt = self._reduce_any(self.continue_requested, self.checkpoint_requested)
            if cont:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            nxt = RerunState.WILL_RERUN_FROM_CHECKPOINT if ckpt else RerunState.RERUNNING_IN_PLACE
            return self._rewind(its, nxt, False)
        if s == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            return self._resume_rejected_step(its)
        if s == RerunState.RERUNNING_FROM_CHECKPOINT:
            again, cont = self._reduce_any(self.restart_again_requested, self.continue_requested)
            if again:
                self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
            elif cont:
                self.state = RerunState.NOT_RUNNING_YET
            return False
        raise RuntimeError(f"should_run_forward_backward called in state {s.name}")


# %% [markdown]
# The exit decision (`:399-461`): after the last pass of the step, the state the machine ended
# in says whether to save, whether to leave, and with which code (16: resume elsewhere to
# disambiguate, 17: failed on result validation).

# %%
class ExitDecision:
    """`should_checkpoint_and_exit`: save? exit? with which code?"""

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """(save a checkpoint?, exit?, exit code) after the last pass of the step."""
        self.first_iteration_complete = True
        self._announce_warm_up()   # a spike check not armed yet says so, once
        if self.mode in (RerunMode.DISABLED, RerunMode.REPORT_DETERMINISM_STATS):
            return False, False, 0
        return {
            RerunState.RERUNNING_IN_PLACE: (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION),
            RerunState.WILL_RERUN_FROM_CHECKPOINT: (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE),
            RerunState.RERUNNING_FROM_CHECKPOINT: (False, True,
                                                   EXIT_CODE_FAILED_ON_RESULT_VALIDATION),
            RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT: (False, True,
                                                         EXIT_CODE_RESUME_TO_DISAMBIGUATE),
        }.get(self.state, (False, False, 0))


# %% [markdown]
# Judging a value (`:463`): in the initial run, the first rejection is recorded (which call,
# counted per message, and its value); in a rerun, only that same call is compared with the
# recorded value. Nothing is judged before the process has completed one step
# (`first_iteration_complete`).
#
# In `disabled` mode there is nothing to rerun: a rejected value is written to the tracker
# file, and then a fatal check raises at once while a non-fatal one only says so.

# %%
class NoRerun:
    """`validate_result` in `disabled` mode: track, then raise (fatal) or say (non-fatal)."""

    def _judge_without_rerun(self, result, rejection_func, message: str, fatal: bool) -> None:
        self.spike_console.last_large = None
        if bool(rejection_func(result)):
            self._track(RerunValidationStatus.RERUN_DISABLED, result, message)
            if not fatal:
                self.spike_console.detail = self._describe_rejection(result, message, False)
                self._say_rejection("rerun_mode is disabled: not rerun, training continues")
            if fatal:
                node, device = self.identity_func()
                raise RuntimeError(f"Rank {self.rank}, node {node}, device {device}, "
                                   f"iteration {self.current_iteration}: unexpected result "
                                   f"{_to_float(result)} (message='{message}')")


# %% [markdown]
# With reruns on, each call is numbered per message; the initial run records its first
# rejection, and a rerun compares only that same call.

# %%
class Judging:
    """`validate_result`: record the first rejection, compare the same call in a rerun."""

    def validate_result(self, result: Any, rejection_func: Callable[[Any], Any],
                        message: str = "unexpected result",
                        comparison_func: Callable[[Any, Any], float] | None = None,
                        tolerance: float = 0.0, fatal: bool = True) -> None:
        """Check `result`; on rejection, drive the rerun that diagnoses it."""
        if self.mode == RerunMode.DISABLED:
            return self._judge_without_rerun(result, rejection_func, message, fatal)
        if self.state == RerunState.NOT_RUNNING_YET:
            raise RuntimeError("validate_result called outside of a forward-backward pass")
        compare = comparison_func or compare_floats
        caller = Caller(message, self.rank)
        self.validation_counts[caller] += 1
        call = Call(caller, self.validation_counts[caller])
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            self._record_determinism(call, result, compare)
        elif self.state == RerunState.INITIAL_RUN:
            if not self.rerun_requested and self.first_iteration_complete:
                self._initial_check(call, result, rejection_func, message)
        elif call == self.failed_validation_call:
            diff = (compare(self.initial_result, result) if self.error_injector is None else
                    self.error_injector.maybe_miscompare(compare, self.initial_result, result,
                                                         self.state))
            if self.state == RerunState.RERUNNING_IN_PLACE:
                self._first_rerun_verdict(diff > tolerance, result, message, fatal)
            elif self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
                self._second_rerun_verdict(diff > tolerance, result, message, fatal)

    def _initial_check(self, call: Call, result, rejection_func, message: str) -> None:
        injected = self.error_injector is not None and self.error_injector.maybe_inject(self.rank)
        self.spike_console.last_large = None
        if injected or bool(rejection_func(result)):
            self.spike_console.detail = self._describe_rejection(result, message, injected)
            self.failed_validation_call, self.initial_result = call, _detach(result)
            self.rerun_requested = True
            self._track(RerunValidationStatus.INITIAL_RUN, result, message)


# %% [markdown]
# The two verdicts. In place, a different value means a transient fault; the same value makes
# this GPU a suspect, and a fatal check asks for a checkpoint to rerun elsewhere. From the
# checkpoint, a rerun on the suspect GPU proves nothing (exit 16 again); on another GPU a
# different value convicts the first GPU, the same value acquits it (the data is at fault).

# %%
class Verdicts:
    """What the reruns conclude: transient, persistent, or a correct result."""

    def _first_rerun_verdict(self, differs: bool, result, message: str, fatal: bool) -> None:
        if not fatal:   # the step goes on: the console hears of it now, not at an exit
            self._say_rejection(f"the rerun in place gave {_to_float(result):.6g}: "
                                + ("not reproduced, a transient error" if differs else
                                   "reproduced") + "; training continues with the rerun's "
                                "gradients")
        if differs:  # not reproducible on the same GPU: a transient fault
            self.diagnosis = RerunDiagnostic.TRANSIENT_ERROR
            self._track(RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE, result, message)
            self.continue_requested = not fatal
            return
        self.suspicious_node, self.suspicious_device = self.identity_func()
        self._track(RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, result, message)
        if fatal:
            self.checkpoint_requested = True
        else:
            self.continue_requested = True
            if self.error_injector is not None:  # a non-fatal verdict is final: re-arm
                self.error_injector.injected_error_type = None

    def _second_rerun_verdict(self, differs: bool, result, message: str, fatal: bool) -> None:
        if self.identity_func() == (self.suspicious_node, self.suspicious_device):
            self.restart_again_requested = True  # same GPU: this rerun proves nothing
            return
        if differs:  # the other GPU disagrees: the first one was wrong
            self.diagnosis = RerunDiagnostic.PERSISTENT_ERROR
            self._track(RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE, result, message)
        else:  # two GPUs agree: the value is what the computation gives
            self.diagnosis = RerunDiagnostic.CORRECT_RESULT
            self._track(RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE, result, message)
        self.continue_requested = not fatal


# %% [markdown]
# ## Demo: the comparison and the replay
#
# The machine's verdicts rest on two things this page built, and both are checked here in the
# small numbers of the text. First the comparison: 2.000 against 2.002 is a relative difference
# of 0.0009995, within a gradient norm's tolerance of 0.001 but not the loss's 0; two NaNs
# match; a NaN against a number, or a value that changed sign, does not.

# %%
if __name__ == "__main__":
    d = compare_floats(2.000, 2.002)
    print(f"compare_floats(2.000, 2.002) = {d:.7f}: a gradient-norm match {d <= 0.001}, "
          f"a loss match {d <= 0.0}")
    assert abs(d - 0.0009995) < 1e-7 and d <= 0.001 and d > 0.0
    nan, inf = float("nan"), float("inf")
    assert compare_floats(nan, nan) == COMPARISON_MATCH
    assert compare_floats(nan, 3.1412) == COMPARISON_MISMATCH
    assert compare_floats(inf, -inf) == COMPARISON_MISMATCH == compare_floats(1.0, -1.0)

# %% [markdown]
# Then the replay, with $m = 4$ micro-batches per step: the step reads batches 0-3 from the
# loader and keeps them, a rerun gets the same four back without touching the loader, and the
# next step drops them and reads batch 4.

# %%
if __name__ == "__main__":
    loader = iter(range(100))
    it = RerunDataIterator(loader)
    first = [next(it) for _ in range(4)]
    it.rewind()
    rerun = [next(it) for _ in range(4)]
    it.advance()
    print("step:", first, "| rerun:", rerun, "| next step starts at", next(it))
    assert first == rerun == [0, 1, 2, 3] and it.saved_microbatches == [4]

# %% [markdown]
# ## Summary
#
# - A rejected loss or gradient norm is rerun in place (transient if it differs), then from a
#   checkpoint on another GPU (persistent if it differs, a correct result if it agrees).
# - Decisions are global (an OR over ranks), reruns replay the same micro-batches and RNG
#   states, and the k-th validation call of a pass is matched with the k-th of the rerun.
# - Exit code 16 means "relaunch from the checkpoint just written", 17 "stop and read the
#   tracker file".
#
# ## How production does it
#
# - `megatron/core/rerun_state_machine.py`: enums `:59-113`, `should_run_forward_backward`
#   `:271`, `should_checkpoint_and_exit` `:399`, `validate_result` `:463`,
#   `RerunDataIterator` `:1110`, `_compare_floats` `:1398`.
# - The loop around it: `megatron/training/training.py:2178,2271` (`train_step`).
# - Next page: [08.3](rerun_diagnoses.py) completes the machine and runs it.
#
# ## Exercises
#
# 1. Why must the checkpoint written at exit 16 hold the RNG state of the *start* of the
#    step, and what would a relaunched rerun compare if it held the end-of-step state?
#
#    <details><summary>Hint</summary>
#
#    Look at the `RERUNNING_IN_PLACE` branch of
#    `Transitions`: on its way to `WILL_RERUN_FROM_CHECKPOINT` it still calls `_rewind`, which
#    restores the RNG states `_save_state` took before the first pass, so the save that follows
#    writes those. With the end-of-step state the relaunched pass would draw other dropout
#    masks, and the comparison (tolerance 0 for the loss) would measure dropout, not the
#    GPU.
#
#    </details>
#
# 2. `compare_floats(inf, -inf)` here returns inf (a mismatch). What does a formula
#    $|2(a-b)/(a+b)|$ give, and why would that be read as a match?
#
#    <details><summary>Answer</summary>
#
#    $a - b = \infty$ but $a + b = \infty - \infty =$ NaN,
#    so the formula gives $|\infty / \text{NaN}| =$ NaN. The verdict asks `diff > tolerance`,
#    and every comparison with NaN is false, so `NaN > 0` reads as "not different": the
#    reproduced value, a match.
#
#    </details>
