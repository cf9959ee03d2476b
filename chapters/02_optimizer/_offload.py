"""Plumbing of the hybrid CPU/device optimizer (chapter 02's offload page; not a page).

The side streams (no-ops on a CPU) and the bookkeeping that keeps the sub-optimizers'
hyperparameters and state in step with the outer optimizer's `param_groups` and `state`.
"""

from __future__ import annotations

import contextlib

import torch


class _Streams:
    """D2H/H2D side streams on CUDA; no-ops on CPU (same call structure)."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if cuda else None
        self.h2d = torch.cuda.Stream(device) if cuda else None
        self.after_compute_names: tuple[str, ...] = ()   # the last call's streams, by name

    def on(self, stream):
        """Context: run the enclosed copies on `stream` (nothing on CPU)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def event(self, stream):
        """An event recorded on `stream` (None on CPU)."""
        return stream.record_event() if stream is not None else None

    def join(self, stream) -> None:
        """Make the default stream wait for `stream`."""
        if stream is not None:
            torch.cuda.current_stream(stream.device).wait_stream(stream)

    def after_compute(self, *names: str) -> None:
        """Make each named side stream wait for the work queued so far on the compute stream.

        D2H reads the grads that the backward wrote; H2D overwrites parameters that work queued
        before the step may still read (chapter 03's staged checkpoint copies wait there)."""
        for name in names:
            stream = getattr(self, name)
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(stream.device))
        self.after_compute_names = names


class SubOptimizerState:
    """Mixin for HybridDeviceOptimizer: groups pushed down, state published up."""

    def _sub_optimizers(self) -> list:
        """The device optimizer (if any) and the CPU optimizers."""
        return ([self.device_optimizer] if self.device_optimizer else []) + self.cpu_optimizers

    def _sync_hyperparams_and_state(self) -> None:
        """Push group hyperparameters down; share state dicts (a loaded state moves to the host)."""
        for opt in self._sub_optimizers():
            for g in opt.param_groups:
                outer = self.param_groups[g["_outer"]]
                g.update({k: v for k, v in outer.items() if k not in ("params", "param_names")})
        for g in self.param_groups:
            for p in g["params"]:
                q = self.host_of.get(p, p)
                opt_state = (self._owner(q) if q is not p else self.device_optimizer).state
                if self.state.get(p) and self.state[p] is not opt_state.get(q):
                    opt_state[q] = {k: v.to(q.device) if torch.is_tensor(v) else v
                                    for k, v in self.state[p].items()}

    def _owner(self, host) -> torch.optim.Optimizer:
        """The CPU optimizer that steps `host`."""
        return self._owner_of[id(host)]

    def _publish_state(self) -> None:
        """This optimizer's state[p] is the sub-optimizer's state of p (or of its host copy)."""
        for opt in self._sub_optimizers():
            for g in opt.param_groups:
                for q in g["params"]:
                    if q in opt.state:
                        self.state[self._outer_of.get(id(q), q)] = opt.state[q]
