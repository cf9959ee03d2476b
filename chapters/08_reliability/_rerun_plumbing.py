"""The rerun state machine's argument checks, rank gathering and checkpoint fields (not a page).

The pages `rerun_state_machine.py` and `rerun_diagnoses.py` keep the mechanism: the states,
the transitions, the verdicts and the tracker line. What is here only checks arguments, moves a dict between ranks,
copies plain fields in and out of a checkpoint, or prints a line the page decided to print.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist


def checked_mode(mode: Any, modes: type[enum.Enum]):
    """`modes(mode)`, or a ValueError that lists the valid spellings."""
    try:
        return modes(mode)
    except ValueError:
        raise ValueError(f"rerun_mode must be one of {[m.value for m in modes]}, "
                         f"got {mode!r}") from None


def replayable_iterators(data_iterator, cls: type) -> list:
    """The non-None iterators of `data_iterator` (one or a list), each an instance of `cls`."""
    its = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    its = [d for d in its if d is not None]
    for d in its:
        if not isinstance(d, cls):
            raise TypeError(f"the data iterator must be a RerunDataIterator to be replayed, "
                            f"got {type(d).__name__}")
    return its


def gather_to_first_rank(diffs, group, world_rank: int) -> bool:
    """Merge every rank's `diffs` (message -> list) into the group's first rank's `diffs`.

    Returns True on the rank that should print. The other ranks clear what they sent, so no
    sample is counted twice. Without a multi-rank group, only world rank 0 prints.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        first = dist.get_rank(group) == 0
        gathered = [None] * dist.get_world_size(group) if first else None
        dist.gather_object(dict(diffs), gathered, group=group, group_dst=0)
        if not first:   # rank 0 keeps what it was sent: never count a sample twice
            diffs.clear()
            return False
        for other in gathered[1:]:
            for message, values in other.items():
                diffs[message].extend(values)
        return True
    return world_rank == 0


def checkpoint_fields(m, data, failed_call, initial_result) -> dict:
    """The machine's checkpoint dict: the step's data, the failed call and its first value as
    the page computed them, every other field copied as it is (the same keys in every state)."""
    return {"mode": m.mode.value, "state": int(m.state),
            "data_iterators": data,
            "current_iteration": m.current_iteration,
            "flags": [m.rerun_requested, m.checkpoint_requested,
                      m.restart_again_requested, m.continue_requested],
            "error_injector": m.error_injector and m.error_injector.state_dict(),
            "failed_validation_call": failed_call,
            "initial_result": initial_result,
            "suspicious_node": m.suspicious_node,
            "suspicious_device": m.suspicious_device,
            "large_value_counts": dict(m.large_value_counts),
            "max_values": dict(m.max_values)}


def load_plain_fields(m, sd: dict) -> None:
    """Restore the fields `checkpoint_fields` copied (the error injector's state only into an injector)."""
    m.current_iteration = sd["current_iteration"]
    (m.rerun_requested, m.checkpoint_requested, m.restart_again_requested,
     m.continue_requested) = sd["flags"]
    if m.error_injector is not None and sd["error_injector"] is not None:
        m.error_injector.load_state_dict(sd["error_injector"])
    m.suspicious_node = sd["suspicious_node"]
    m.suspicious_device = sd["suspicious_device"]
    m.large_value_counts = dict(sd["large_value_counts"])
    m.max_values = dict(sd["max_values"])


# -- the console lines about a running threshold (the page decides when; this prints) -------

SWITCHES = {"loss": "check_for_spiky_loss", "grads": "check_for_large_grads"}


def switch_name(context: str) -> str:
    """The setting that turns on the check of `context` (Megatron's argument names)."""
    return SWITCHES.get(context, f"the unexpectedly-large check on {context!r}")


@dataclass
class SpikeConsole:
    """What the console has been told about each context's threshold, in this process."""

    calls: dict = field(default_factory=lambda: defaultdict(int))
    """context -> values judged or learned in the current iteration."""
    settings: dict = field(default_factory=dict)
    """context -> (num_samples, factor) of its last call."""
    announced: set = field(default_factory=set)
    """contexts whose 'not armed yet' line was printed."""
    last_large: Optional[tuple] = None
    """(context, value, running max, factor) of the last value found too large."""
    detail: Optional[str] = None
    """How the pending rejection reads in its line."""


def rejection_detail(console: SpikeConsole, message: str, value: float, injected: bool) -> str:
    """A rejected value in words: with its threshold when a running-max check rejected it."""
    if injected:
        return f"'{message}' forced by the error injector (value {value:.6g})"
    if console.last_large is None:
        return f"'{message}' (value {value:.6g})"
    context, value, peak, factor = console.last_large
    num_samples = console.settings[context][0]
    return (f"{message}: {value:.6g} >= {factor:g} x {peak:.6g} = {factor * peak:.6g} "
            f"({switch_name(context)}: {factor:g} x the largest of the first {num_samples} "
            f"{context} values)")


def say(line: str) -> None:
    """One console line of the rerun machine."""
    print(f"reliability: {line}", flush=True)


def is_last_rank() -> bool:
    """True on the world's last rank (it holds the loss: the last pipeline stage), or alone."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == dist.get_world_size() - 1
    return True


# -- the job's sharding, as Megatron compares it before restoring a rerun state -------------

def job_sharding(model, world_size: int) -> dict:
    """World size, [TP, PP] and DP of this job (`checkpointing.py:1676-1688`), read from the
    grid its DDP chunks were built on; a model without one is all data parallel."""
    grid = next((c.grid for c in model or [] if getattr(c, "grid", None) is not None), None)
    if grid is None:
        return {"world_size": world_size, "tp_pp": [1, 1], "dp": world_size}
    return {"world_size": world_size, "tp_pp": [grid.size("tp"), grid.size("pp")],
            "dp": grid.size("dp")}


def same_sharding(saved: dict, run: dict) -> bool:
    """Megatron's rule (`checkpointing.py:1757-1778`): equal world size, (TP, PP) and DP, a
    missing field read with its defaults (TP = PP = 1, world size and DP 0). A mismatch says
    so on rank 0, in Megatron's words."""
    ckpt = (saved.get("world_size", 0), list(saved.get("tp_pp", [1, 1])), saved.get("dp", 0))
    same = ckpt == (run["world_size"], list(run["tp_pp"]), run["dp"])
    if not same and (not dist.is_initialized() or dist.get_rank() == 0):
        print("Job sharding has changed: Rerun state will be ignored", flush=True)
    return same
