# %% [markdown]
# # 08 · Rerun diagnoses: spikes, the tracker file and three faults
#
# [08.2](rerun_state_machine.py) built the rerun state machine's states, transitions and
# verdicts: a rejected value is rerun in place, then from a checkpoint on another GPU, and the
# two comparisons name the cause. What it left to this page is what the machine *remembers*:
# across steps, the spike check's running threshold and the determinism statistics; across
# launches, the tracker file a scheduler and the next launch read, and the payload that rides
# in the exit-16 checkpoint. Then the parts become one class, `RerunStateMachine`, and three
# faults run through it to their three diagnoses.
#
# The persistent fault of the demo, launch by launch — the tracker file gains a line at each
# verdict, and the checkpoint carries the rejected step to the next GPU:
#
# ```mermaid
# sequenceDiagram
#   participant A as launch 1<br/>node-A
#   participant C as exit-16<br/>checkpoint
#   participant A2 as launch 2<br/>node-A
#   participant B as launch 3<br/>node-B
#   participant T as tracker<br/>file
#   A->>T: iteration 3 rejected<br/>initial_run
#   A->>T: the rerun in place<br/>reproduces it<br/>first_rerun_reproducible
#   A->>C: start-of-step RNG states,<br/>machine state, the step's<br/>micro-batches (exit 16)
#   C->>A2: loaded on the<br/>suspect GPU again
#   Note over A2: proves nothing<br/>exit 16 again<br/>no line written
#   C->>B: loaded on<br/>another GPU
#   B->>T: a finite loss<br/>second_rerun_not_reproducible<br/>(exit 17)
# ```

# %%
from __future__ import annotations

import datetime
import math
import os
import re

from tinytron.reliability._rerun_plumbing import (checkpoint_fields, gather_to_first_rank,
                                                  is_last_rank, load_plain_fields,
                                                  rejection_detail, say, switch_name)
from tinytron.reliability.rerun_state_machine import (
    REPORTING_INTERVAL_ITERATIONS, Call, Caller, ExitDecision, Judging, MachineState, NoRerun,
    PassStarts, Replay, RerunDiagnostic, RerunMode, RerunState, RerunValidationStatus,
    Transitions, Verdicts, _detach, _to_float)

__all__ = ["Spikes", "DeterminismStats", "SpikeLines", "Tracker", "Records",
           "RerunStateMachine"]

# %% [markdown]
# ## Spikes against a running threshold
#
# `is_unexpectedly_large` (`rerun_state_machine.py:697`) is a rejection function with memory:
# for the first `num_samples = 100` values of a context ("loss", "grads") it only records the
# largest magnitude; afterwards it rejects $|v| \ge 10 \cdot \max$. NaN and Inf return False
# (their own checks catch them). The max is frozen after the warm-up: a loss that falls from 10
# to 2 still has its spike threshold at 100. The state is checkpointed with the machine.
#
# Worked example: the loss of the first 100 iterations peaks at 10.4, so with
# `SPIKY_LOSS_FACTOR = 10` (`pretrain_gpt.py:150-178`) the threshold is 104. A loss of 50 at
# iteration 5 000 passes; 120 is rejected, rerun in place once, and training carries on with
# the rerun's gradients (the check is non-fatal). Only a value that grows tenfold trips it,
# which is why it catches a blow-up and not the ordinary noise of a falling loss.

# %%
class Spikes:
    """`is_unexpectedly_large` and its warm-up."""

    def is_unexpectedly_large(self, result: Any, threshold: float, context: str,
                              num_samples: int = 100, resample: bool = False) -> bool:
        """True once `|result|` reaches `threshold` x the max of the first `num_samples` values."""
        value = abs(_to_float(result))
        if math.isnan(value) or math.isinf(value):
            return False
        if resample or context not in self.large_value_counts:
            self.large_value_counts[context] = 0
        console = self.spike_console
        console.calls[context] += 1
        console.settings[context] = (num_samples, threshold)
        if self.large_value_counts[context] < num_samples:
            self._learn(context, value, threshold, num_samples)
            return False
        if value >= self.max_values[context] * threshold:
            console.last_large = (context, value, self.max_values[context], threshold)
            return True
        return False

    def _learn(self, context: str, value: float, factor: float, num_samples: int) -> None:
        """One warm-up value: the running max takes it (Megatron's rule), never silently."""
        before, seen = self.max_values.get(context, 0.0), self.large_value_counts[context]
        if before > 0 and value >= factor * before:   # armed, this would have been rejected
            say(f"iteration {self.current_iteration}, rank {self.rank}: {context} {value:.6g} "
                f">= {factor:g} x its running max {before:.6g}, but {switch_name(context)} is "
                f"not armed yet ({seen} of {num_samples} values learned): not rejected, and "
                f"the threshold it arms with rises to {factor * value:.6g}")
        self.large_value_counts[context] = seen + 1
        self.max_values[context] = max(before, value)
        if seen + 1 == num_samples and is_last_rank():   # Megatron logs the max here (:762)
            peak = self.max_values[context]
            say(f"{switch_name(context)} armed in iteration {self.current_iteration}: threshold "
                f"{factor:g} x {peak:.6g} = {factor * peak:.6g} (the largest of the first "
                f"{num_samples} {context} values)")


# %% [markdown]
# In `report_determinism_stats` mode every step is rerun in place and every validated value is
# compared with its first-pass twin: the differences are collected per message and, every
# `REPORTING_INTERVAL_ITERATIONS`, gathered from all ranks of the machine's group to rank 0,
# which prints them; the other ranks then start their collection afresh (Megatron's
# `gather_object` of its `QuickStats`, `:995-1020`). A nondeterministic kernel on rank 3 shows
# in the report even though rank 0's own values were bitwise stable.

# %%
class DeterminismStats:
    """`report_determinism_stats`: collect each rerun's differences, print them every 2 steps."""

    def _record_determinism(self, call: Call, result, compare) -> None:
        if self.state == RerunState.INITIAL_RUN:
            self.rerun_requested = True
            self.saved_results[call] = _detach(result)
        elif self.state == RerunState.RERUNNING_IN_PLACE:
            diff = compare(self.saved_results[call], result)
            self.determinism_diffs[call.caller.message].append(diff)

    def _maybe_report_stats(self) -> None:
        if self.current_iteration % REPORTING_INTERVAL_ITERATIONS != 0:
            return
        if not gather_to_first_rank(self.determinism_diffs, self.group, self.rank):
            return   # not the printing rank (what it sent is cleared)
        for message, diffs in self.determinism_diffs.items():
            nonzero = sorted(d for d in diffs if d > 0)
            print(f"determinism [{message}]: {len(diffs)} samples, "
                  f"{len(diffs) - len(nonzero)} identical, max {max(diffs, default=0):.3e}")


# %% [markdown]
# ### What the console says about a spike check
#
# A user who switched the check on wants to know when it starts to judge, and whether a spike
# in the warm-up slipped through. The machine prints four kinds of line, each prefixed
# `reliability:`:
#
# <details><summary>Megatron detail: what Megatron prints</summary>
#
# The threshold is silent in Megatron until it is set ("Max value for loss: …", `:762`), and
# a rejection is one `logger.error` line without the threshold (`:604-610`). A user who
# switched the check on cannot tell from that when it starts to judge, nor whether a spike
# in the warm-up slipped through. tinytron keeps Megatron's arithmetic — the same values
# counted, the same frozen max, so a threshold means the same number in both — and adds the
# lines below.
#
# </details>
#
# | when | where | says |
# |---|---|---|
# | after the first validated iteration, once per process | last rank | not armed yet; the iteration of the first value it judges |
# | a warm-up value $\ge$ factor × the running max | the rank that saw it | not rejected, and the threshold it raises |
# | the `num_samples`-th value | last rank | armed: factor × max = threshold |
# | a rejection, once its rerun in place has compared | the rank that rejected | iteration, value, factor × max, the verdict |
#
# **When the check arms.** It counts one value per validated call: one loss per micro-batch,
# one norm per gradient bucket; nothing in a process's first iteration (it is not validated,
# `:591-594`) and nothing in a rerun. A relaunch learns again: the machine's state is restored
# from a checkpoint only when a rerun is pending (`:885-887`). The loss is the micro-batch's
# *summed* loss, as `pretrain_gpt.py:144` computes it. With $m$ micro-batches per rank per
# iteration, a fresh run's 101st loss, the first one judged, falls in iteration
# $1 + \lceil 101/m \rceil$: iteration 27 at $m = 4$, iteration 8 at $m = 16$. The forecast
# line computes it from the values still to learn, $r$, and the values of the iteration just
# done, $m$: the first judged value is in iteration $k + \lceil (r + 1)/m \rceil$, and is
# value $r + 1 - (\lceil (r + 1)/m \rceil - 1)\,m$ of the $m$ there. At $m = 16$, after
# iteration 2: $r = 84$, iteration $2 + \lceil 85/16 \rceil = 8$, value $85 - 5 \cdot 16 = 5$
# — a spike in one of that iteration's first four micro-batches is still learned.
#
# **The rejection's line** waits for the rerun in place, so that it can carry the verdict:
# the rejecting rank knows the value, the factor and the frozen max when it rejects, and the
# rerun's value one pass later. From a real run of the trainer (16 micro-batches per
# iteration, the fault injector multiplying iteration 9's losses by $10^6$):
#
# ```text
# reliability: iteration 9, rank 0: Spiky loss: 3.01874e+08 >= 10 x 375349 = 3.75349e+06
#   (check_for_spiky_loss: 10 x the largest of the first 100 loss values); the rerun in place
#   gave 301.874: not reproduced, a transient error; training continues with the rerun's gradients
# ```
#
# Its max, 375 349, is the 1000× spike of iteration 4, learned during the warm-up; the
# largest ordinary summed loss before it was 398.8 (64 tokens at about 6.2 each), so without
# that spike the threshold would have been about 4 000. A fatal check prints nothing here: its
# step ends the job, and the trainer's exit line says what was found. The sentences are put
# together in the chapter's `_rerun_plumbing.py`; this class decides when each is due.

# %%
class SpikeLines:
    """The spike check's console lines: the forecast, and a rejection with its verdict."""

    def _announce_warm_up(self) -> None:
        """After a step: once per context, say that it is not armed yet and from when it is."""
        console = self.spike_console
        calls, console.calls = dict(console.calls), type(console.calls)(int)
        for context, m in calls.items():
            num_samples, factor = console.settings[context]
            left = num_samples - self.large_value_counts.get(context, 0)
            if context in console.announced or left <= 0:
                continue
            console.announced.add(context)
            if is_last_rank():
                ahead = math.ceil((left + 1) / m)   # iterations until the first judged value
                nth = left + 1 - (ahead - 1) * m     # its place among that iteration's m
                say(f"{switch_name(context)} is not armed yet: it learns its threshold "
                    f"({factor:g} x the largest of the first {num_samples} {context} values "
                    f"of each rank, {left} still to learn at {m} per iteration) and judges "
                    f"its first value in iteration {self.current_iteration + ahead} (value "
                    f"{nth} of {m} there); a spike before then is only warned about, and "
                    f"raises the threshold")

    def _describe_rejection(self, result, message: str, injected: bool) -> str:
        return rejection_detail(self.spike_console, message, _to_float(result), injected)

    def _say_rejection(self, outcome: str) -> None:
        say(f"iteration {self.current_iteration}, rank {self.rank}: "
            f"{self.spike_console.detail}; {outcome}")


# %% [markdown]
# ## The tracker file and the checkpoint payload
#
# Every event appends one line `ts=… node=… device=… jobID=… rank=… iteration=… status=…
# result=… message='…'` (`_log_validation_error_to_file`, `:1022`); the next page,
# [08.4](result_checks.py), reads it back to skip bad iterations. Its `iteration=` is the
# 1-based number of the iteration being run, the one whose step was rejected. The machine's
# state goes into every checkpoint, per rank, even in steady state, so that successive
# checkpoints have the same structure.
#
# <details><summary>Megatron detail: the iteration number and the checkpoint key</summary>
#
# Megatron writes `current_iteration + 1` (`:1035`) because its counter starts at −1 and
# counts from 0 (`:196`); tinytron's counts from 1 and writes it as it is — the same number,
# the one the training log shows and `training.py:3474` skips as `iteration + 1`. Megatron's
# per-rank state is a `ShardedObject` keyed `rerun_state_machine_state`, shape `(world,)`,
# offset `(rank,)`, written even in steady state so that successive checkpoints have the
# same structure.
#
# </details>
#
# With a rerun pending it also carries the step's buffered micro-batches. The relaunch replays
# them in the rerun (`replay_from`), so the second opinion sees the rejected step's very data.
#
# <details><summary>Megatron detail: the relaunch replays the saved data</summary>
#
# Megatron writes them into the exit-16 checkpoint (`data_iterator_checkpoints`,
# `:818-829, 853`), but loads them back only in the `NOT_RUNNING_YET` branch of the *next*
# step (`:304-310`), right before `advance()` empties the buffer (`:311-314`); its rerun from
# the checkpoint (`WILL_RERUN_FROM_CHECKPOINT`, `:372-374`) reads the data loader,
# repositioned by the checkpoint's consumed-sample count — the same data only if the loader's
# order depends on nothing but that count. tinytron's relaunch replays the saved
# micro-batches in the rerun (`replay_from`) and reads past them in the repositioned loader,
# so the second opinion sees the rejected step's very data even when the order comes from
# worker timing or an unseeded shuffle (the test uses a loader whose order is new in every
# launch). Megatron's rerun from the checkpoint reads the loader
# (`megatron/core/rerun_state_machine.py:372-374`).
#
# </details>
#
# In numbers: with $m = 4$ micro-batches of $4 \times 2\,048$ int64 token ids, the ids alone
# are $4 \cdot 4 \cdot 2\,048 \cdot 8 = 262\,144$ bytes per data-parallel rank,
# written once, only into the exit-16 checkpoint; every other checkpoint carries
# `data_iterators = None` and the same keys.

# %%
class Tracker:
    """The tracker line."""

    def _track(self, status: RerunValidationStatus, result, message: str) -> None:
        if self.tracker_path is None:
            return
        node, device = self.identity_func()
        ts = datetime.datetime.now().isoformat()
        line = (f"ts={ts} node={node} device={device} "
                f"jobID={os.environ.get('SLURM_JOBID', 'N/A')} rank={self.rank} "
                f"iteration={self.current_iteration} status={status.value} "
                f"result={_to_float(result)} message='{message}'\n")
        with open(self.tracker_path, "a") as f:
            f.write(line)


# %% [markdown]
# The checkpoint payload: the same keys in every state, the step's micro-batches only when the
# machine is about to exit with 16, and nothing restored into a run whose mode is `disabled`.

# %%
class Records:
    """The checkpoint payload."""

    def state_dict(self, data_iterator=None) -> dict:
        """This rank's machine state, for the checkpoint (same keys in every state); with a
        rerun pending, the step's micro-batches of `data_iterator` too."""
        fvc = self.failed_validation_call
        # steady state: nothing to replay, so any iterator is accepted and none is read, as
        # Megatron does (rerun_state_machine.py:823-824); otherwise it must be replayable
        steady = self.state == RerunState.NOT_RUNNING_YET
        its = [] if data_iterator is None or steady else self._iterators(data_iterator)
        data = ([d.state_dict() for d in its]   # the step's micro-batches, only with exit 16
                if its and self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT else None)
        return checkpoint_fields(
            self, data,
            None if fvc is None else [fvc.caller.message, fvc.caller.rank, fvc.sequence],
            None if self.initial_result is None else _to_float(self.initial_result))

    def load_state_dict(self, sd: dict) -> None:
        """Restore `state_dict()`; ignored when this run, or the saved one, is disabled."""
        if self.mode == RerunMode.DISABLED or sd["mode"] == RerunMode.DISABLED.value:
            return
        self.mode, self.state = RerunMode(sd["mode"]), RerunState(sd["state"])
        load_plain_fields(self, sd)   # iteration, flags, injector, suspect, spike thresholds
        fvc = sd["failed_validation_call"]
        self.failed_validation_call = None if fvc is None else Call(Caller(fvc[0], fvc[1]), fvc[2])
        self.initial_result = sd["initial_result"]
        self.data_iterator_checkpoints = sd.get("data_iterators")  # replayed by the next pass


# %% [markdown]
# ## The whole machine
#
# The parts share nothing but the fields `MachineState.__init__` sets, so the order of the
# bases only decides where Python looks first; `MachineState` comes last because it is the one
# with the constructor. A reader looking for a method finds it in the part named after its job.
# Megatron's `RerunStateMachine` is one class body of almost a thousand lines
# (`megatron/core/rerun_state_machine.py:128-1108`); the public methods keep its names here,
# only grouped, and `help(RerunStateMachine)` still lists them all on the one class.

# %%
class RerunStateMachine(Transitions, PassStarts, ExitDecision, Judging, NoRerun, Verdicts,
                        Spikes, DeterminismStats, SpikeLines, Tracker, Records, Replay,
                        MachineState):
    """Validate results; rerun a step in place or from a checkpoint to diagnose a rejection."""


# %% [markdown]
# ## Demo: three faults, three diagnoses
#
# A deterministic two-layer model with dropout trains on fixed micro-batches. A `corrupt`
# function plays the hardware: it turns the loss of iteration 3 into NaN — on the first pass
# only (a transient bit flip), on every pass of "node-A" (a bad GPU), or on every pass anywhere
# (the data itself). Each "launch" (`demo_launch`, a 20-line train loop in the chapter's
# `_workers.py` with the `while should_run_forward_backward` body of
# [08.2](rerun_state_machine.py)) builds a fresh machine, optionally loads the checkpoint dict
# the previous launch wrote, and runs on the node we choose.

# %%
if __name__ == "__main__":
    import tempfile

    from tinytron.reliability._workers import demo_launch
    from tinytron.reliability.result_checks import get_skipped_iterations_from_tracker_file

    nan = float("nan")
    tmp = tempfile.mkdtemp()

    def statuses(path):
        return [re.search(r"status=(\S+)", line)[1] for line in open(path)]

    # 1. A transient fault: NaN on the first pass of iteration 3 only.
    def transient(loss, rsm):
        hit = rsm.current_iteration == 3 and rsm.state == RerunState.INITIAL_RUN
        return loss * nan if hit else loss

    tracker = f"{tmp}/transient.txt"
    code, ckpt, log, rsm = demo_launch("node-A", tracker, transient)
    print("transient:", [(it, st, round(v, 4)) for it, st, v in log if it == 3])
    assert (code, ckpt, rsm.diagnosis) == (17, None, RerunDiagnostic.TRANSIENT_ERROR)
    assert statuses(tracker) == ["initial_run", "first_rerun_not_reproducible"]

# %% [markdown]
# The transient fault ended at the first rerun: exit 17, no checkpoint. A bad GPU needs the
# second opinion. Node-A exits with 16, is handed the job again and exits 16 again (a rerun on
# the suspect proves nothing); node-B then disagrees with it.

# %%
if __name__ == "__main__":
    # 2. A persistent fault: node-A's GPU gets iteration 3 wrong every time.
    node_of_this_launch = {"node": "node-A"}

    def bad_gpu(loss, rsm):
        hit = rsm.current_iteration == 3 and rsm.identity_func()[0] == "node-A"
        return loss * nan if hit else loss

    tracker = f"{tmp}/persistent.txt"
    codes = []
    code, ckpt, _, _ = demo_launch("node-A", tracker, bad_gpu)
    codes.append(code)
    code, _, _, _ = demo_launch("node-A", tracker, bad_gpu, ckpt)  # rescheduled on the same GPU
    codes.append(code)
    code, _, log, rsm = demo_launch("node-B", tracker, bad_gpu, ckpt)
    codes.append(code)
    print("persistent: exit codes", codes, "->", rsm.diagnosis.value)
    assert codes == [16, 16, 17] and rsm.diagnosis == RerunDiagnostic.PERSISTENT_ERROR
    assert statuses(tracker) == ["initial_run", "first_rerun_reproducible",  # launch 2: none
                                 "second_rerun_not_reproducible"]

# %% [markdown]
# Bad data gives the same NaN on any GPU: node-B agrees with node-A, the verdict is a correct
# result, and the tracker file names the iteration the next launch should skip.

# %%
if __name__ == "__main__":
    # 3. A correct result: the data of iteration 3 gives NaN on any GPU.
    def bad_data(loss, rsm):
        return loss * nan if rsm.current_iteration == 3 else loss

    tracker = f"{tmp}/correct.txt"
    code1, ckpt, _, _ = demo_launch("node-A", tracker, bad_data)
    code2, _, _, rsm = demo_launch("node-B", tracker, bad_data, ckpt)
    print("correct result: exit codes", [code1, code2], "->", rsm.diagnosis.value,
          "| skip on relaunch:", get_skipped_iterations_from_tracker_file(tracker))
    assert [code1, code2] == [16, 17] and rsm.diagnosis == RerunDiagnostic.CORRECT_RESULT
    assert get_skipped_iterations_from_tracker_file(tracker) == [3]  # defined on the next page

# %% [markdown]
# Last, the premise of it all: a rerun replays the same data and the same dropout masks. In
# `report_determinism_stats` mode every step is rerun, and every difference is zero.

# %%
if __name__ == "__main__":
    # 4. Reruns replay data and dropout exactly: determinism stats see only zeros.
    code, _, log, rsm = demo_launch("node-A", None, lambda loss, rsm: loss,
                                     mode="report_determinism_stats")
    diffs = rsm.determinism_diffs["loss is NaN"]
    print(f"determinism: {len(diffs)} rerun comparisons, max relative difference {max(diffs)}")
    assert code == 0 and len(diffs) == 2 * 4 and max(diffs) == 0.0

# %% [markdown]
# ## Summary
#
# - The spike check learns a threshold from the first 100 values of a context and then
#   rejects a tenfold jump; the console says when it arms and what each rejection concluded.
# - Every verdict appends one line to the tracker file; the next launch reads it back to skip
#   an iteration two GPUs agreed on.
# - The machine's state goes into every checkpoint with the same keys; the exit-16 checkpoint
#   also carries the rejected step's micro-batches, so the second opinion sees its very data.
# - Three faults, three diagnoses: transient (exit 17 at once), persistent (16, 16 on the same
#   GPU, 17 elsewhere), a correct result (16, then 17 and an iteration to skip).
#
# ## How production does it
#
# - `megatron/core/rerun_state_machine.py`: `is_unexpectedly_large` `:697`, `state_dict`
#   `:767`, `_save_state` `:963`, tracker `:1022/1042`, `RerunErrorInjector` `:1264`.
# - Callers: `pretrain_gpt.py:150-178` (loss checks: NaN/Inf fatal, spiky loss non-fatal with
#   `SPIKY_LOSS_FACTOR = 10`), `megatron/core/distributed/param_and_grad_buffer.py:313`
#   (per-bucket grad-norm checks, tolerance 0.001), `megatron/training/training.py:2178`
#   (`train_step`), `:3545` (save and exit), `megatron/training/checkpointing.py:563,1758`.
# - Next page: [08.4](result_checks.py) builds these checks from the trainer's config, and
#   [08.5](fault_injection.py) drives them, with kills and hangs, inside a real run.
#
# ## Exercises
#
# 1. In the persistent-fault demo the second launch lands on node-A again. Why does it exit
#    with 16 and not 17, and why does the tracker file gain no line from it?
#
#    <details><summary>Answer</summary>
#
#    Its rerun from the checkpoint reaches `_second_rerun_verdict`, which finds
#    `identity_func()` equal to the suspect node and device saved in the checkpoint: a rerun
#    on the suspect GPU proves nothing, so it sets `restart_again_requested` and returns
#    before any `_track`. `Transitions` then moves to `RERUNNING_AGAIN_FROM_CHECKPOINT`, which
#    `ExitDecision` answers with exit 16: try again, elsewhere.
#
#    </details>
#
# 2. With 16 micro-batches per iteration, in which iteration does the spike check judge its
#    first loss, and why is nothing learned in iteration 1?
#
#    <details><summary>Answer</summary>
#
#    A process's first iteration is not validated (`first_iteration_complete` is False until
#    its first `should_checkpoint_and_exit`), so iterations 2-7 learn $6 \cdot 16 = 96$ values
#    and iteration 8 learns 4 more; its 5th loss, the 101st value, is the first judged:
#    iteration $1 + \lceil 101/16 \rceil = 8$.
#
#    </details>
