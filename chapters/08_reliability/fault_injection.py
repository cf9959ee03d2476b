# %% [markdown]
# # 08 · Fault injection: breaking a run on purpose, at a chosen iteration and rank
#
# Every safety net of this chapter is only as trustworthy as the test that watched it catch a
# real fault. This page builds the injector those tests drive: **value faults** (the loss or a
# gradient becomes NaN, Inf or a spike) that behave like a transient glitch, a bad GPU, or bad
# data, and **process faults** (a rank is killed, hangs, or freezes; a rank dies in the middle
# of writing a checkpoint) — each at a chosen iteration, on a chosen rank, optionally only in a
# chosen restart attempt.

# %%
from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

from tinytron.reliability.rerun_diagnoses import RerunStateMachine
from tinytron.reliability.rerun_state_machine import RerunDiagnostic, RerunState, default_identity

__all__ = ["VALUE_FAULTS", "PROCESS_FAULTS", "Fault", "parse_fault", "restart_attempt",
           "FaultInjector", "CHECKPOINT_FAULT_ENV"]

# %% [markdown]
# ## What a fault looks like from the inside
#
# | fault | how it is made | what should catch it |
# |---|---|---|
# | `nan`, `inf` in the loss | multiply the micro-batch loss by NaN / $\infty$ (gradients follow) | loss check → rerun → exit 16/17 |
# | `nan`, `inf` in a gradient | write NaN / $\infty$ into one bucket's gradient | bucket grad-norm check |
# | `spike` | multiply the value by `factor` (default 1000) | spiky-loss / large-grad check (non-fatal) |
# | `kill` | `SIGKILL` to itself at the start of the step | `torchrun --max-restarts`: restart, resume |
# | `hang` | the main thread sleeps forever inside the step | section timeout names the rank and section |
# | `freeze` | `SIGSTOP` to itself (the whole process stops, heartbeats too) | stale heartbeat names the rank |
# | `raise` | a `RuntimeError` at the start of the step | in-process restart (restarts page) |
# | `kill_in_save` | `SIGKILL` at a named point inside chapter 03's save | the tracker still names a complete checkpoint |
#
# A value fault's `diagnostic` says which hardware (or data) story it plays, and therefore
# which verdict the rerun machine must reach:
#
# - `transient_error`: only the first pass of the iteration is corrupted (a bit flip); the rerun
#   in place computes the right value → *not reproducible* → exit 17.
# - `persistent_error`: every pass is corrupted **while running on the faulty node** — the one
#   named by `node=`, or else the node where the fault first fires *in this process* (a
#   relaunch is a new process: name the node when the test spans launches); a relaunch on
#   another node computes the right value → second rerun *not reproducible* → persistent error.
# - `correct_result`: every pass is corrupted everywhere (the batch itself is poison) → both
#   reruns reproduce it → correct result; the iteration is skipped on the next launch.
#
# A fault spec is one string, so that it passes through a command line and through
# `torchrun`: `kind@iteration[:key=value...]`, e.g. `nan@5:rank=1:diagnostic=persistent_error`,
# `kill@3:rank=1:attempt=0`, `kill_in_save@6:point=before_tracker`. `attempt` matches
# torchrun's `TORCHELASTIC_RESTART_COUNT`, so a fault can fire in the first life of the job and
# not in the restarted one — otherwise a restart would meet the same fault forever.

# %%
VALUE_FAULTS = ("nan", "inf", "spike")
PROCESS_FAULTS = ("kill", "hang", "freeze", "raise", "kill_in_save")
CHECKPOINT_FAULT_ENV = "TINYTRON_CHECKPOINT_FAULT"  # read by chapter 03's fault_point


# %% [markdown]
# One planned fault is a frozen record of the spec's fields; a wrong kind, iteration,
# diagnostic or target is refused when the record is made.

# %%
@dataclass(frozen=True)
class Fault:
    """One planned fault."""

    kind: str
    """nan | inf | spike | kill | hang | freeze | raise | kill_in_save."""
    iteration: int
    """1-based number of the iteration in which it strikes."""
    rank: int = 0
    """The global rank it strikes."""
    diagnostic: str = "transient_error"
    """Value faults: transient_error | persistent_error | correct_result."""
    target: str = "loss"
    """Value faults: loss | grad."""
    attempt: Optional[int] = None
    """Only in this restart attempt (TORCHELASTIC_RESTART_COUNT); None = every attempt."""
    factor: float = 1000.0
    """Spike: the value is multiplied by this."""
    point: str = "before_tracker"
    """kill_in_save: chapter 03's fault point (before_rename, before_tracker, ...)."""
    node: Optional[str] = None
    """persistent_error: the faulty node (None: where it first fires in this process)."""

    def __post_init__(self):
        if self.kind not in VALUE_FAULTS + PROCESS_FAULTS:
            raise ValueError(f"fault kind must be one of {VALUE_FAULTS + PROCESS_FAULTS}, "
                             f"got {self.kind!r}")
        if self.iteration < 1:
            raise ValueError(f"fault iteration is 1-based, got {self.iteration}")
        if self.diagnostic not in {d.value for d in RerunDiagnostic}:
            raise ValueError(f"fault diagnostic must be one of "
                             f"{[d.value for d in RerunDiagnostic]}, got {self.diagnostic!r}")
        if self.target not in ("loss", "grad"):
            raise ValueError(f"fault target must be 'loss' or 'grad', got {self.target!r}")


# %% [markdown]
# A spec string becomes a `Fault` by splitting at `@` and `:`; every option must be a field of
# `Fault`, so a typo fails at launch, naming the bad part, instead of silently planning nothing.
# `restart_attempt` counts the lives of the job, torchrun's and in-process restarts together.

# %%
def parse_fault(spec: str) -> Fault:
    """`kind@iteration[:key=value...]` -> Fault (ValueError naming the bad part)."""
    head, *options = spec.strip().split(":")
    kind, sep, it = head.partition("@")
    if not sep or not it.isdigit():
        raise ValueError(f"fault spec {spec!r}: expected kind@iteration[:key=value...]")
    types = {f.name: f.type for f in fields(Fault)}
    kwargs: dict = {"kind": kind, "iteration": int(it)}
    for opt in options:
        key, eq, value = opt.partition("=")
        if not eq or key not in types or key in ("kind", "iteration"):
            raise ValueError(f"fault spec {spec!r}: unknown option {opt!r} "
                             f"(known: {sorted(set(types) - {'kind', 'iteration'})})")
        kwargs[key] = (int(value) if key in ("rank", "attempt") else
                       float(value) if key == "factor" else value)
    return Fault(**kwargs)


def restart_attempt() -> int:
    """Which life of the job this is: torchrun's restarts plus in-process restarts (0 at first)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + \
        int(os.environ.get("TINYTRON_INPROCESS_ATTEMPT", "0"))


# %% [markdown]
# ## The injector
#
# `FaultInjector` holds the faults for *this* rank and attempt and is called at three places
# of the step:
#
# - `corrupt(value, target, rsm)` — just before a value is validated: the loss function calls
#   it on each micro-batch's loss, the gradient check on each bucket's gradient. It reads the
#   iteration and the pass (initial run or rerun) from the rerun state machine, and the node
#   from the machine's identity function, so the three diagnostics above come out of the same
#   code path a real fault takes.
# - `at_step_start(iteration)` — process faults that strike inside the step (`kill`, `hang`,
#   `freeze`). The step's heartbeat section (next pages) is already open, so a hang is a hang
#   *in the step*.
# - `around_save(iteration)` — a context manager for the save of `iteration`: it arms chapter
#   03's `fault_point` (`TINYTRON_CHECKPOINT_FAULT=point@rank`) for this save only.
#
# Rank and attempt are settled once, when the injector is built: a fault planned for another
# rank or another life of the job is dropped there. Iteration, pass and node are asked at every
# call, and for a value fault the diagnostic decides which passes it corrupts:
#
# ```mermaid
# flowchart TD
#   S["fault specs, e.g.<br/>nan@3:rank=1:<br/>diagnostic=persistent_error"] --> K{"rank == this rank and<br/>attempt None or<br/>== restart_attempt()?"}
#   K -- no --> D["dropped at<br/>construction"]
#   K -- yes --> P["planned for<br/>this process"]
#   P --> I{"iteration ==<br/>current<br/>iteration?"}
#   I -- no --> N["value passes<br/>untouched"]
#   I -- yes --> T{kind}
#   T -- "nan, inf,<br/>spike" --> G{diagnostic}
#   G -- transient_error --> G1{"pass ==<br/>INITIAL_RUN?"}
#   G -- persistent_error --> G2{"node ==<br/>faulty node?<br/>(node= or the first<br/>node it fired on)"}
#   G -- "correct_result<br/>(every pass,<br/>every node)" --> C1["corrupt<br/>the value"]
#   G1 -- yes --> C1
#   G1 -- no --> N
#   G2 -- yes --> C1
#   G2 -- no --> N
#   T -- "kill, freeze" --> SIG["SIGKILL or<br/>SIGSTOP<br/>to itself"]
#   T -- hang --> H["main thread<br/>sleeps<br/>forever"]
#   T -- raise --> R["RuntimeError<br/>in the step"]
#   T -- kill_in_save --> A["arm<br/>TINYTRON_CHECKPOINT_FAULT<br/>for this save only"]
# ```
#
# The injector is three whole parts: `Stories` decides which passes a value fault strikes,
# `ValueFaults` holds the plan and corrupts a value (a loss or a gradient) when a planned
# fault strikes, and `ProcessFaults` turns the process faults into the real thing; the class
# `FaultInjector` below them is the three together. A
# worked example: the plan `nan@3:rank=1` with the default `transient_error` on a two-rank job
# corrupts rank 1's loss in iteration 3's first pass only; the rerun in place computes the true
# loss, the comparison reports a mismatch, and the job exits 17 with the tracker naming
# iteration 3 as transient.
#
# First the heart of the three stories: whether a planned value fault corrupts *this* pass.

# %%
class Stories:
    """Which passes a value fault corrupts, by the story its diagnostic tells."""

    def _strikes(self, f: Fault, rsm: RerunStateMachine) -> bool:
        """Does fault f corrupt this pass, given the story its diagnostic tells?"""
        if f.diagnostic == RerunDiagnostic.TRANSIENT_ERROR.value:
            return rsm.state == RerunState.INITIAL_RUN
        if f.diagnostic == RerunDiagnostic.CORRECT_RESULT.value:
            return True
        node = rsm.identity_func()
        faulty = self._faulty_node.setdefault(f, f.node or node[0])
        return node[0] == faulty


# %% [markdown]
# Then the plan, filtered to this rank and attempt, and `corrupt`, which applies the faults
# that strike: a spike scales the value, a NaN or Inf multiplies a loss or is written into a
# gradient in place.

# %%
class ValueFaults:
    """The planned faults of this rank and attempt, and the value faults they strike."""

    def __init__(self, faults: list[Fault] | list[str], rank: int = 0,
                 attempt: int | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        faults = [parse_fault(f) if isinstance(f, str) else f for f in faults]
        attempt = restart_attempt() if attempt is None else attempt
        self.rank, self.attempt, self._sleep = rank, attempt, sleep
        self.faults = [f for f in faults
                       if f.rank == rank and (f.attempt is None or f.attempt == attempt)]
        self._faulty_node: dict[Fault, str] = {}
        self.fired: list[tuple[str, int, str]] = []  # (kind, iteration, pass) for reports

    def _value_faults(self, iteration: int, target: str):
        return [f for f in self.faults
                if f.kind in VALUE_FAULTS and f.iteration == iteration and f.target == target]

    def corrupt(self, value: torch.Tensor, target: str, rsm: RerunStateMachine) -> torch.Tensor:
        """The value as this rank's (possibly faulty) hardware computes it."""
        for f in self._value_faults(rsm.current_iteration, target):
            if not self._strikes(f, rsm):
                continue
            self.fired.append((f.kind, rsm.current_iteration, rsm.state.name))
            if f.kind == "spike":
                value = value * f.factor
            elif target == "grad":  # a bucket's gradient data: corrupt in place, like bad memory
                with torch.no_grad():
                    value.view(-1)[0] = float(f.kind)  # float("nan") / float("inf")
            else:
                value = value * float(f.kind)
        return value


# %% [markdown]
# The two process-fault hooks: `at_step_start` turns a planned `kill`, `freeze`, `hang` or
# `raise` into the real thing, and `around_save` arms chapter 03's kill point for one save
# and restores whatever was armed before.

# %%
class ProcessFaults:
    """The process faults: kill, freeze, hang or raise at a step; kill points around a save."""

    def at_step_start(self, iteration: int) -> None:
        """Kill, hang or freeze this process if a fault is planned for this step."""
        for f in self.faults:
            if f.iteration != iteration or f.kind not in ("kill", "hang", "freeze", "raise"):
                continue
            self.fired.append((f.kind, iteration, "step"))
            print(f"[fault] rank {self.rank}: {f.kind} at iteration {iteration} "
                  f"(attempt {self.attempt}) t={time.time():.3f}", flush=True)
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif f.kind == "raise":  # a recoverable error in Python: in-process restart territory
                raise RuntimeError(f"injected fault: rank {self.rank}, iteration {iteration}")
            else:
                while True:  # a hung kernel or a dead-locked loader: the main thread never returns
                    self._sleep(3600)

    @contextlib.contextmanager
    def around_save(self, iteration: int):
        """Arm chapter 03's fault point for the save of `iteration` on this rank."""
        planned = [f for f in self.faults if f.kind == "kill_in_save" and f.iteration == iteration]
        if not planned:
            yield
            return
        previous = os.environ.get(CHECKPOINT_FAULT_ENV)
        os.environ[CHECKPOINT_FAULT_ENV] = f"{planned[0].point}@{self.rank}"
        self.fired.append(("kill_in_save", iteration, planned[0].point))
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(CHECKPOINT_FAULT_ENV, None)
            else:
                os.environ[CHECKPOINT_FAULT_ENV] = previous


# %% [markdown]
# The injector is the parts together.

# %%
class FaultInjector(ProcessFaults, ValueFaults, Stories):
    """Applies the planned faults of this rank and restart attempt."""


# %% [markdown]
# ## Demo: one loss, three stories
#
# A tiny model trains with Megatron's loss checks; the same `nan@3` fault is injected with each
# diagnostic, and each launch ends with the exit code the rerun machine decides. Then a child
# process plans `kill@2` for attempt 0 only: its first life dies by SIGKILL at iteration 2; the
# second life (attempt 1, run here in-process) has no fault planned and runs to the end.

# %%
def _demo_train(injector: FaultInjector, node: str, ckpt=None, iters: int = 4):
    """Tiny train loop with loss checks and the injector; returns (exit code, checkpoint, rsm)."""
    from tinytron.reliability.result_checks import RerunConfig, check_loss
    from tinytron.reliability.rerun_state_machine import RerunDataIterator

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    rsm = RerunStateMachine(identity_func=lambda: (node, -1))
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        rsm.load_state_dict(ckpt["rsm"])
        rsm.current_iteration = ckpt["iteration"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = RerunDataIterator(iter([torch.randn(8, 4, generator=g) for _ in range(iters)]))
    for _ in range(rsm.current_iteration, iters):
        while rsm.should_run_forward_backward(data):
            opt.zero_grad()
            loss = injector.corrupt(model(next(data)).pow(2).mean(), "loss", rsm)
            check_loss(rsm, loss, RerunConfig())
            loss.backward()
        save, leave, code = rsm.should_checkpoint_and_exit()
        if save:
            ckpt = {"model": model.state_dict(), "rsm": rsm.state_dict(),
                    "iteration": rsm.current_iteration - 1}
        if leave:
            return code, ckpt, rsm
        opt.step()
    return 0, ckpt, rsm


# %% [markdown]
# And a stand-in for one rank of a job, to be run in a child process: it plans `kill@2` for
# attempt 0 only.

# %%
def _demo_child(attempt: int) -> None:
    """A 'rank' that plans kill@2 for attempt 0 and prints each step it completes."""
    inj = FaultInjector(["kill@2:rank=0:attempt=0"], rank=0, attempt=attempt)
    for it in range(1, 4):
        inj.at_step_start(it)
        print(f"attempt {attempt}: iteration {it} done", flush=True)


# %% [markdown]
# The three stories, one launch each (two when the first one saved a checkpoint to relaunch
# from, on another node); then which passes a persistent fault fired on.

# %%
if __name__ == "__main__":
    for diagnostic in ("transient_error", "persistent_error", "correct_result"):
        fault = f"nan@3:diagnostic={diagnostic}:node=node-A"
        code, ckpt, rsm = _demo_train(FaultInjector([fault]), node="node-A")
        codes = [code]
        if ckpt is not None:  # relaunch from the checkpoint on another node
            code, _, rsm = _demo_train(FaultInjector([fault]), node="node-B", ckpt=ckpt)
            codes.append(code)
        print(f"{fault:48s} -> exit codes {codes}, diagnosis {rsm.diagnosis.value}")
        assert rsm.diagnosis.value == diagnostic
        assert codes == ([17] if diagnostic == "transient_error" else [16, 17])

    inj = FaultInjector(["nan@3:diagnostic=persistent_error"])
    _demo_train(inj, node="node-A")
    print("persistent fault fired on passes:", inj.fired)
    assert [p for _, _, p in inj.fired] == ["INITIAL_RUN", "RERUNNING_IN_PLACE"]

# %% [markdown]
# A process fault, for real: a child process dies by SIGKILL in its first life; the second
# life runs to the end. Last, specs that must be refused, and the error each one gets.

# %%
if __name__ == "__main__":
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "from tinytron.reliability.fault_injection "
                           "import _demo_child; _demo_child(0)"],
                          capture_output=True, text=True, timeout=60)
    print(f"attempt 0 (a child process): exit {proc.returncode}:",
          proc.stdout.strip().replace("\n", " | "))
    assert proc.returncode == -signal.SIGKILL and "iteration 2 done" not in proc.stdout
    _demo_child(1)  # the restarted life: no fault planned for attempt 1, runs to the end

    for bad in ("nan", "nan@x", "melt@3", "nan@3:color=red", "nan@3:diagnostic=cosmic"):
        try:
            parse_fault(bad)
            raise AssertionError(f"{bad} was accepted")
        except ValueError as e:
            print(f"{bad!r:28s} -> ValueError: {e}")

# %% [markdown]
# ## Summary
#
# - A fault spec names kind, iteration, rank, story (`diagnostic`) and restart attempt, and
#   travels as a string through any launcher.
# - Value faults enter exactly where a real one would be seen — right before the check — so
#   the rerun machine's verdict is tested end to end, with real NaNs in real gradients.
# - Process faults are real signals (`SIGKILL`, `SIGSTOP`) or a real hang; checkpoint faults
#   are chapter 03's own kill points, armed for one save.
#
# ## How production does it
#
# - `megatron/core/rerun_state_machine.py:1264` (`RerunErrorInjector`: random rejection with a
#   forced verdict; previous page).
# - `megatron/core/fault_injector.py` (`FaultInjectorConfig` `:48`, target ranks sampled from
#   `1..world-1` `:104`, exponential delay `offset − ln(1−U)·MTTI` `:174`, one broadcast of the
#   plan `:192`); faults are dispatched through NVIDIA's `nvidia-resiliency-ext`.
# - `megatron/training/ft_integration.py:300` (`FT_SIM_FAULT_DESC =
#   "<rank_hung|rank_killed|random>;<rank>;<base_delay>"`: `SIGSTOP` or `SIGKILL` after
#   `base_delay·(1 + 0.2·U)` seconds, from a daemon thread).
#
# ## Exercises
#
# 1. Megatron's simulated faults strike after a random *delay*, this injector at an
#    *iteration*. What does each make easy to test, and what does each miss?
#
#    <details><summary>Hint</summary>
#
#    An iteration makes a test repeatable: the fault lands in
#    a known step, on a known pass, so the assert can name the exit code and the tracker line.
#    A delay lands anywhere: inside a save, an evaluation, a collective, the start-up. Compare
#    `at_step_start` and `around_save` with the daemon thread of
#    `megatron/training/ft_integration.py:300`.
#
#    </details>
#
# 2. Why does a `persistent_error` fault need to remember the node where it first fired
#    instead of striking on "rank 1" wherever rank 1 runs?
#
#    <details><summary>Hint</summary>
#
#    A relaunch keeps the rank numbers but may land on other
#    machines. The story is a bad GPU, so the fault must follow the hardware: read
#    `Stories._strikes` and what the second rerun compares in
#    [08.2](rerun_state_machine.py)'s `_second_rerun_verdict`.
#
#    </details>
