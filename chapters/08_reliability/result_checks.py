# %% [markdown]
# # 08 · Result checks: what is validated, where, and what the next launch skips
#
# The rerun state machine of [08.2](rerun_state_machine.py) and [08.3](rerun_diagnoses.py)
# judges whatever it is handed. This page decides *what* it is handed, with Megatron's settings: the loss of every micro-batch (NaN, Inf, a
# spike), the norm of every gradient bucket before it is reduced (NaN, Inf, unexpectedly large),
# the configuration that switches each check, Megatron's own random error injector, and the
# bookkeeping that lets a relaunched job skip an iteration whose data is bad.

# %%
from __future__ import annotations

import itertools
import random
import re
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Optional

import torch

from tinytron.reliability.rerun_diagnoses import RerunStateMachine
from tinytron.reliability.rerun_state_machine import (COMPARISON_MATCH, COMPARISON_MISMATCH,
                                                      RerunDiagnostic, RerunMode, RerunState,
                                                      default_identity)

__all__ = ["SPIKY_LOSS_FACTOR", "LARGE_GRAD_FACTOR", "RerunConfig", "RerunErrorInjector",
           "build_rerun_state_machine", "check_loss", "check_grad_norms", "bucket_grad_norms",
           "checked_loss_func", "parse_tracker_file", "get_skipped_iterations_from_tracker_file",
           "dummy_train_step"]

# %% [markdown]
# ## The checks and their settings
#
# | value | check | tolerance | fatal | switch (default) | Megatron |
# |---|---|---|---|---|---|
# | micro-batch loss | NaN, Inf | 0 | yes | `check_for_nan_in_loss_and_grad` (on) | `pretrain_gpt.py:150-166` |
# | micro-batch loss | $\ge 10\times$ running max | 0 | no | `check_for_spiky_loss` (off) | `pretrain_gpt.py:167-178` |
# | bucket grad norm | NaN, Inf | 0.001 | yes | `check_for_nan_in_loss_and_grad` (on) | `param_and_grad_buffer.py:313-348` |
# | bucket grad norm | $\ge 10\times$ running max | 0.001 | no | `check_for_large_grads` (off) | same |
#
# The loss is checked **locally**, per micro-batch and before any data-parallel reduction, so
# the rank whose GPU produced the NaN is the rank that reports it. The gradient norm is checked
# per bucket, right before the bucket's reduce-scatter or all-reduce, for the same reason:
# after the collective every rank holds the NaN and nobody knows where it came from.
# The gradient tolerance is 0.001 because a rerun of a backward with non-deterministic kernels
# (flash attention's dK/dV accumulation) legitimately differs in the last bits.
#
# **When a spike check arms.** `check_for_spiky_loss` and `check_for_large_grads` judge
# nothing until each rank has learned its threshold: 10 × the largest of its first 100
# values (`is_unexpectedly_large`, `megatron/core/rerun_state_machine.py:697-765`). One value
# is one micro-batch's summed loss, or one bucket's norm; a process's first iteration and the
# reruns add none, and every relaunch learns again. The README's job (`configs/tiny.toml`:
# global batch 32, micro-batch 8, two data-parallel ranks) runs $m = 32 / (8 \cdot 2) = 2$
# micro-batches per rank, so its first judged loss is the 101st, in iteration
# $1 + \lceil 101 / 2 \rceil = 52$; a 300-iteration run is judged from 52 to 300.
#
# <div class="admonition note"><p class="admonition-title">tinytron differs here</p>
#
# Megatron learns in silence: a spike during those first 100 values becomes the running max,
# the threshold rises tenfold with it, and the only line is "Max value for loss: …" once the
# warm-up ends (`:762`). tinytron keeps the arithmetic — the same values counted, the same
# max, so the threshold is Megatron's number — and tells the console: once, after the first
# validated iteration, that the check is not armed yet and the iteration of the first value it
# will judge; a warm-up value at or above 10 × the running max, with the threshold it raises;
# the iteration it arms in; and each rejection, in its iteration, with the value, the
# threshold and the rerun's verdict ([the diagnoses page](rerun_diagnoses.py) lists the
# four lines). The warm-up value is still not rejected: a loss that falls for its first
# hundred values is the usual case, but a gradient norm may rise tenfold legitimately while
# the learning rate warms up, and a check that refused to learn from it would reject every
# later step.
#
# </div>
#
# `RerunConfig` carries Megatron's names and defaults
# (`megatron/training/config/resilience_config.py:8-29`, `arguments.py:2535-2541`). Note the
# default: **validation is on** (`rerun_mode = "validate_results"`). One spelling differs
# inside Megatron itself: its config lists the third mode as `report_stats`
# (`resilience_config.py:21`), but the machine's enum value is `report_determinism_stats`
# (`megatron/core/rerun_state_machine.py:78`) and `initialize.py:80` converts with
# `RerunMode(args.rerun_mode)`, so `report_stats` fails there. tinytron takes the enum's
# spelling; its error for `report_stats` says which one to use.

# %%
SPIKY_LOSS_FACTOR = 10.0  # pretrain_gpt.py:118
LARGE_GRAD_FACTOR = 10.0  # param_and_grad_buffer.py


@dataclass
class RerunConfig:
    """Result validation settings (Megatron's names and defaults)."""

    rerun_mode: str = "validate_results"
    """disabled | validate_results | report_determinism_stats."""
    check_for_nan_in_loss_and_grad: bool = True
    """Reject NaN/Inf losses and bucket grad norms (fatal)."""
    check_for_spiky_loss: bool = False
    """Reject a micro-batch loss >= 10x the max of this rank's first 100 (non-fatal; the console
    says from which iteration it judges)."""
    check_for_large_grads: bool = False
    """Reject a bucket grad norm >= 10x the max of this rank's first 100 (non-fatal; the
    console says from which iteration it judges)."""
    error_injection_rate: int = 0
    """Megatron's random injector: about one rejection per N validations (0 = off)."""
    error_injection_type: str = "transient_error"
    """The verdict it forces: transient_error | persistent_error | correct_result."""
    result_rejected_tracker_filename: Optional[str] = None
    """Append-only file of validation events; read back to skip bad iterations."""

    def __post_init__(self):
        if self.rerun_mode not in {m.value for m in RerunMode}:
            hint = (" (Megatron's config spells it 'report_stats'; its RerunMode, and tinytron, "
                    "say 'report_determinism_stats')" if self.rerun_mode == "report_stats" else "")
            raise ValueError(f"rerun_mode must be one of {[m.value for m in RerunMode]}, "
                             f"got {self.rerun_mode!r}{hint}")
        if self.error_injection_type not in {d.value for d in RerunDiagnostic}:
            raise ValueError(f"error_injection_type must be one of "
                             f"{[d.value for d in RerunDiagnostic]}, "
                             f"got {self.error_injection_type!r}")
        if self.error_injection_rate < 0:
            raise ValueError(f"error_injection_rate must be >= 0, got {self.error_injection_rate}")


# %% [markdown]
# ## Megatron's random error injector
#
# To test the machinery on a healthy run, `RerunErrorInjector` (`rerun_state_machine.py:1264`)
# rejects a result about once per `error_injection_rate` validations — it draws
# `randint(0, rate-1)` and adds the rank, so that ranks are hit at different times — and then
# *forces* the rerun's comparison to the verdict it was told
# to fake: `transient_error` mismatches in place, `persistent_error` matches in place and
# mismatches from the checkpoint, `correct_result` always matches (`maybe_miscompare`, `:1306`).
# While one injection waits for its verdict no other is drawn; the verdict re-arms the
# injector (`:1323-1337`): a transient error once the in-place rerun has mismatched, a
# persistent error or a correct result once the rerun from the checkpoint has compared. So a
# long run with a non-fatal check, or one relaunched after each exit 16, sees about one
# injection per `rate` validations, not one per job — and a real rejection later in the run
# is compared for real, not forced to the old verdict.
#
# Megatron draws from Python's global `random`, whose state the machine saves at the start of
# every step and restores before each rerun (`:963-988`): after an in-place rerun the state is
# back to *before* the draw that injected, so the next step draws the same number and injects
# again — with a non-fatal check every step after the first injection is rejected.
#
# <div class="admonition note"><p class="admonition-title">tinytron differs here</p>
#
# The injector draws from a generator of its own (seeded by `seed`, kept in the checkpoint),
# which no rerun rewinds, so the rate is the rate. And a non-fatal check's in-place verdict is
# final (the step continues, no checkpoint rerun follows), so tinytron re-arms there too;
# Megatron keeps a persistent or correct-result injection armed — and every later comparison
# forced — waiting for a rerun from a checkpoint that never comes (`:1323-1337`).
#
# </div>
#
# In numbers: at `error_injection_rate = 8` a 64-step run with one validation per step sees
# about $64 / 8 = 8$ injections here; with Megatron's rewound draw and a non-fatal check, the
# first injection at step $k$ repeats at every step after it, $64 - k + 1$ in all.
#
# It only exercises the control flow: the values are never corrupted. The next page's
# `FaultInjector` corrupts real values at a chosen iteration and rank.

# %%
class InjectionDraws:
    """The injector's draw and its forced verdict: when to reject, what the rerun then finds."""

    def __init__(self, error_injection_rate: int = 0,
                 error_injection_type: RerunDiagnostic | str = RerunDiagnostic.TRANSIENT_ERROR,
                 seed: int = 0):
        if error_injection_rate < 0:
            raise ValueError(f"error_injection_rate must be >= 0, got {error_injection_rate}")
        self.rate = error_injection_rate
        self.type = RerunDiagnostic(error_injection_type)
        self.injected_error_type: Optional[RerunDiagnostic] = None
        self.draws = random.Random(seed)   # not the global `random`: reruns rewind that one

    def maybe_inject(self, rank: int) -> bool:
        """True about once per `rate` calls, never while an injection awaits its verdict."""
        if self.rate == 0 or self.injected_error_type is not None:
            return False
        if (self.draws.randint(0, self.rate - 1) + rank) % self.rate != 0:
            return False
        self.injected_error_type = self.type
        return True

    def maybe_miscompare(self, comparison_func, initial, result, state: RerunState) -> float:
        """The real comparison, unless an injected error dictates the outcome."""
        kind = self.injected_error_type
        if kind is None:
            return comparison_func(initial, result)
        if state == RerunState.RERUNNING_IN_PLACE:
            if kind == RerunDiagnostic.TRANSIENT_ERROR:
                self.injected_error_type = None       # verdict reached: re-armed
                return COMPARISON_MISMATCH
            return COMPARISON_MATCH
        if state == RerunState.RERUNNING_FROM_CHECKPOINT and kind != RerunDiagnostic.TRANSIENT_ERROR:
            self.injected_error_type = None           # verdict reached: re-armed
            return (COMPARISON_MISMATCH if kind == RerunDiagnostic.PERSISTENT_ERROR
                    else COMPARISON_MATCH)
        raise RuntimeError(f"an injected {kind.value} compared in state {state.name}")


# %% [markdown]
# The injector's checkpoint: the armed verdict (it must survive the exit-16 relaunch) and the
# position of its own generator. Without the generator's position a relaunched job would draw
# the same numbers its first launch drew, and inject at the same validations again; without
# the armed verdict, the rerun from the checkpoint would compare for real and find the values
# equal (they were never corrupted), so an injected persistent error would read as a correct
# result. The injector is these two parts, `RerunErrorInjector` below.

# %%
class InjectorCheckpoint:
    """The injector's checkpoint: its settings, the armed verdict and its generator's state."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps (the forced verdict must survive the relaunch)."""
        kind = self.injected_error_type
        version, internal, gauss = self.draws.getstate()
        return {"rate": self.rate, "type": self.type.value,
                "injected_error_type": None if kind is None else kind.value,
                "draws": [version, list(internal), gauss]}

    def load_state_dict(self, sd: dict) -> None:
        """Restore from `state_dict()`."""
        self.rate, self.type = sd["rate"], RerunDiagnostic(sd["type"])
        kind = sd["injected_error_type"]
        self.injected_error_type = None if kind is None else RerunDiagnostic(kind)
        if "draws" in sd:
            version, internal, gauss = sd["draws"]
            self.draws.setstate((version, tuple(internal), gauss))


class RerunErrorInjector(InjectorCheckpoint, InjectionDraws):
    """Reject about one result in `rate` and force the rerun's verdict (values are untouched)."""


def build_rerun_state_machine(config: RerunConfig, group=None, state_save_func=None,
                              state_restore_func=None,
                              identity_func=default_identity) -> RerunStateMachine:
    """The machine `initialize_megatron` builds (`megatron/training/initialize.py:69-86`)."""
    injector = None
    if config.error_injection_rate > 0:
        injector = RerunErrorInjector(config.error_injection_rate, config.error_injection_type)
    return RerunStateMachine(config.rerun_mode, error_injector=injector,
                             tracker_path=config.result_rejected_tracker_filename, group=group,
                             state_save_func=state_save_func,
                             state_restore_func=state_restore_func, identity_func=identity_func)


# %% [markdown]
# ## Wiring the checks
#
# Why per micro-batch and per bucket, and not once on the reduced loss and the global norm:
# after the data-parallel all-reduce every rank holds the same NaN, and nobody can tell which
# GPU produced it. Checked before the collective, the value is still this rank's own, so the
# rank that rejects it is the one the tracker file names, and the rerun in place is judged by
# the GPU that computed it. With the default switches, 8 micro-batches and 4 buckets make
# $8 \cdot 2 + 4 \cdot 2 = 24$ validations per step (NaN and Inf on each value).
#
# `check_loss` is what `loss_func` calls on each micro-batch's loss; `checked_loss_func` wraps
# any loss function with chapter 00's contract `(loss, num_tokens, report)` so that the schedule
# does not change. `check_grad_norms` takes one norm per bucket, with Megatron's messages
# ("found NaN in local grad norm for bucket #0 in backward pass before data-parallel
# communication collective"); `bucket_grad_norms` computes them for a list of flat gradient
# tensors. Chapter 05's DDP calls a check installed with `set_grad_check` on each bucket
# group's local grads right before its collective; [08.8](loop_hooks.py) installs
# these two there. `corrupt` is the hook the fault injector uses to play the hardware:
# it sees the value before it is checked and may return a different one.

# %%
def check_loss(rsm: RerunStateMachine, loss: torch.Tensor, config: RerunConfig) -> None:
    """Megatron's loss checks on one micro-batch's local loss."""
    if config.check_for_nan_in_loss_and_grad:
        rsm.validate_result(loss, torch.isnan, "loss is NaN", tolerance=0.0, fatal=True)
        rsm.validate_result(loss, torch.isinf, "loss is Inf", tolerance=0.0, fatal=True)
    if config.check_for_spiky_loss:
        spiky = partial(rsm.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss")
        rsm.validate_result(loss, spiky, "Spiky loss", tolerance=0.0, fatal=False)


def checked_loss_func(loss_func: Callable, rsm: RerunStateMachine, config: RerunConfig,
                      corrupt: Callable[[torch.Tensor, str], torch.Tensor] | None = None):
    """Wrap a `(output) -> (loss, num_tokens, report)` loss function with the loss checks."""
    def wrapped(output_tensor):
        loss, num_tokens, report = loss_func(output_tensor)
        if corrupt is not None:
            loss = corrupt(loss, "loss")
            report = {k: torch.stack([loss.detach(), v[1]]) if k == "lm loss" else v
                      for k, v in report.items()}
        check_loss(rsm, loss, config)
        return loss, num_tokens, report
    return wrapped


# %% [markdown]
# The gradient side: one fp32 norm per bucket, and on each norm the NaN and Inf checks
# (tolerance 0.001, fatal) and the large-gradient check (non-fatal).

# %%
def bucket_grad_norms(grads: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm (fp32) of each bucket's gradient data."""
    return [g.detach().float().norm(p=2) for g in grads]


def check_grad_norms(rsm: RerunStateMachine, norms: Iterable[torch.Tensor],
                     config: RerunConfig, where: Iterable[str] | None = None) -> None:
    """Megatron's per-bucket gradient checks; `where` names each bucket in the messages."""
    for norm, at in zip(norms, where if where is not None else itertools.repeat("")):
        if config.check_for_nan_in_loss_and_grad:
            rsm.validate_result(norm, torch.isnan, f"found NaN in local grad norm{at}",
                                tolerance=0.001, fatal=True)
            rsm.validate_result(norm, torch.isinf, f"found Inf in local grad norm{at}",
                                tolerance=0.001, fatal=True)
        if config.check_for_large_grads:
            large = partial(rsm.is_unexpectedly_large, threshold=LARGE_GRAD_FACTOR, context="grads")
            rsm.validate_result(norm, large, f"found unexpected large grads{at}", tolerance=0.001,
                                fatal=False)


# %% [markdown]
# ## Skipping an iteration on the next launch
#
# When two GPUs agree that iteration $k$ gives NaN, the data or the model is to blame and
# rerunning it again will not help. The tracker file holds the evidence; the next launch reads
# it (`arguments.py:1550-1555` appends the result to `iterations_to_skip`) and the train loop
# replaces step $k$ by `dummy_train_step` (`training.py:2115`): it pulls the step's
# micro-batches from the iterator without computing anything and adds
# $dp \cdot mbs \cdot m$ to both `consumed_train_samples` and `skipped_train_samples`, so the
# data order of every later step is unchanged.
#
# Rule (`get_skipped_iterations_from_tracker_file`, `:1042`): count the lines with status
# `rerun_disabled`, `first_rerun_reproducible` or `second_rerun_reproducible` per
# `(rank, iteration)`; two or more → skip, unless more than one rank reported that iteration
# within one job (a bad batch shows up on one DP rank; a diverging model on all of them).
#
# First the reader: one regular expression per tracker line, each event a dict.

# %%
_TRACKER_LINE = re.compile(r"node=(?P<node>\S+) device=(?P<device>\S+) jobID=(?P<job>\S+) "
                           r"rank=(?P<rank>\d+) iteration=(?P<iteration>-?\d+) "
                           r"status=(?P<status>\S+) result=(?P<result>\S+) "
                           r"message='(?P<message>.*)'")
_SKIP_STATUSES = {"RERUN_DISABLED", "FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_REPRODUCIBLE"}


def parse_tracker_file(path: str | None) -> list[dict[str, Any]]:
    """Every event of a tracker file as a dict (status normalized to upper case)."""
    events = []
    if not path:
        return events
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        return events
    for line in lines:
        m = _TRACKER_LINE.search(line)
        if m:
            events.append(dict(m.groupdict(), rank=int(m["rank"]), iteration=int(m["iteration"]),
                               result=float(m["result"]),
                               status=m["status"].rsplit(".", 1)[-1].upper()))
    return events


# %% [markdown]
# The rule on those events, and the step that takes a skipped iteration's place: it reads the
# step's micro-batches and computes nothing.

# %%
def get_skipped_iterations_from_tracker_file(path: str | None) -> list[int]:
    """Iterations rejected twice on one rank with a reproducible verdict, by no other rank."""
    counts: dict[tuple[int, int], int] = defaultdict(int)
    ranks: dict[tuple[str, int], set] = defaultdict(set)
    for e in parse_tracker_file(path):
        if e["status"] in _SKIP_STATUSES:
            counts[(e["rank"], e["iteration"])] += 1
            ranks[(e["job"], e["iteration"])].add(e["rank"])
    several = {it for (_, it), rs in ranks.items() if len(rs) > 1}
    return sorted({it for (_, it), n in counts.items() if n >= 2 and it not in several})


def dummy_train_step(data_iterator, num_microbatches: int) -> None:
    """Consume one step's micro-batches without computing (a skipped iteration)."""
    for _ in range(num_microbatches):
        next(data_iterator)


# %% [markdown]
# ## Demo: a spike against the running threshold, and the injector at rate 4
#
# A synthetic loss curve falls from 10 towards 2 with noise; at step 130 one value jumps to 150.
# The first 100 values only set the running max (about 10); from then on anything at or above
# 100 is rejected. The spike is caught although the loss around it is 2; a drop to 0.2 or a
# rise to 50 would not be. Then the random injector at `error_injection_rate = 4`: how often it
# fires and what verdict it forces.

# %%
if __name__ == "__main__":
    import math
    import tempfile

    import matplotlib.pyplot as plt

    rsm = RerunStateMachine("validate_results")
    g = torch.Generator().manual_seed(0)
    steps = torch.arange(200)
    curve = 2 + 8 * torch.exp(-steps / 40.0) + 0.2 * torch.randn(200, generator=g)
    curve[130] = 150.0
    flags = []
    for step, v in enumerate(curve):   # one value per iteration, numbered as on the plot
        rsm.current_iteration = step
        flags.append(rsm.is_unexpectedly_large(v, SPIKY_LOSS_FACTOR, "loss"))
    threshold = rsm.max_values["loss"] * SPIKY_LOSS_FACTOR
    print(f"running max after 100 values: {rsm.max_values['loss']:.2f} -> threshold "
          f"{threshold:.1f}; flagged steps: {[i for i, f in enumerate(flags) if f]}")
    assert [i for i, f in enumerate(flags) if f] == [130]
    assert not any(flags[:100])                       # warm-up: never rejects
    assert not rsm.is_unexpectedly_large(torch.tensor(math.nan), 10, "loss")  # NaN: not its job

# %% [markdown]
# The curve, the threshold and the one rejected value:

# %%
if __name__ == "__main__":
    fig, ax = plt.subplots(figsize=(6.4, 2.6))
    ax.semilogy(steps, curve, lw=1, label="loss")
    ax.axhline(threshold, color="tab:red", ls="--", lw=1, label="10 × max of first 100")
    ax.axvspan(0, 99, color="gray", alpha=0.15, label="warm-up (max only)")
    ax.plot([130], [150], "rx", ms=8, label="rejected: spiky loss")
    ax.set_xlabel("iteration")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The injector at rate 4 fires once, waits for its verdict while forcing the comparison the
# verdict needs, and is armed again afterwards.

# %%
if __name__ == "__main__":
    inj = RerunErrorInjector(4, "persistent_error", seed=1234)
    draws = [inj.maybe_inject(rank=0) for _ in range(20)]
    first = draws.index(True)
    print(f"rate 4: first injection at validation #{first + 1}, none while it awaits its verdict")
    assert sum(draws) == 1 and inj.injected_error_type == RerunDiagnostic.PERSISTENT_ERROR
    cmp = lambda a, b: 0.5  # noqa: E731 - whatever the real comparison says, the verdict is forced
    assert inj.maybe_miscompare(cmp, 1.0, 1.0, RerunState.RERUNNING_IN_PLACE) == COMPARISON_MATCH
    assert inj.maybe_miscompare(cmp, 1.0, 1.0,
                                RerunState.RERUNNING_FROM_CHECKPOINT) == COMPARISON_MISMATCH
    again = [inj.maybe_inject(rank=0) for _ in range(20)]   # the verdict re-armed it
    print(f"after the verdict: next injection at validation #{again.index(True) + 1}")
    assert sum(again) == 1

# %% [markdown]
# Last, the skip rule on a hand-written tracker file.

# %%
if __name__ == "__main__":
    # The tracker rule: twice on rank 1 -> skip 7; iteration 9 seen by two ranks -> keep.
    path = tempfile.mktemp(suffix=".txt")
    with open(path, "w") as f:
        for rank, it, status in [(1, 7, "first_rerun_reproducible"),
                                 (1, 7, "second_rerun_reproducible"),
                                 (0, 9, "rerun_disabled"), (0, 9, "rerun_disabled"),
                                 (1, 9, "rerun_disabled"), (2, 11, "initial_run")]:
            f.write(f"ts=t node=n device=0 jobID=42 rank={rank} iteration={it} "
                    f"status={status} result=nan message='loss is NaN'\n")
    print("iterations to skip:", get_skipped_iterations_from_tracker_file(path))
    assert get_skipped_iterations_from_tracker_file(path) == [7]

# %% [markdown]
# ## Summary
#
# - Loss checks run per micro-batch on the local loss; gradient checks per bucket before the
#   collective — so the rank that produced a bad value is the one that reports it.
# - NaN/Inf are fatal (exit 16/17 after the reruns); spikes and large gradients are non-fatal
#   (one rerun in place, diagnosis logged, training continues on the rerun's gradients).
# - Two reproducible rejections of one iteration on one rank make the next launch skip it,
#   consuming its data so that every later step sees the same samples.
#
# ## How production does it
#
# - `pretrain_gpt.py:118,150-178` (loss checks), `megatron/core/distributed/param_and_grad_buffer.py:313-348,599-603`
#   (bucket checks in `start_grad_sync`), `megatron/training/training.py:1910-1911` (the switches).
# - `megatron/core/rerun_state_machine.py:1264` (`RerunErrorInjector`), `:1042` (tracker parse),
#   `megatron/training/arguments.py:1550-1555`, `megatron/training/training.py:2115,3473-3485`
#   (skipping).
#
# ## Exercises
#
# 1. With DP 64 and a NaN in one rank's batch, why would a check *after* the gradient
#    all-reduce make every rank report it — and what would the skip rule then do?
#
#    <details><summary>Hint</summary>
#
#    The all-reduce sums the 64 ranks' gradients, and a sum
#    with one NaN is NaN on every rank. Then read the last line of
#    `get_skipped_iterations_from_tracker_file`: an iteration reported by more than one rank of
#    a job is read as a diverging model, not a bad batch.
#
#    </details>
#
# 2. A loss that legitimately rises 10× after a data-blend change trips the spike check. Which
#    argument of `is_unexpectedly_large` lets you re-learn the threshold, and when would you
#    call it?
#
#    <details><summary>Hint</summary>
#
#    Look at `resample` in `Spikes.is_unexpectedly_large` on the
#    previous page: it sets the context's count back to 0, so the next `num_samples` values
#    are learned again and only warned about (the max starts from the old one and can only
#    rise). Pass it once, at the first step on the new blend.
#
#    </details>
