"""Recording a schedule from the outside: wrappers around a stage's communicator and its steps.

The schedules of `tinytron.main_loop.schedules` and `.interleaved` call two objects: a
communicator (appendix A's point-to-point helpers bound to the stage) and the steps (one
micro-batch's forward or backward through one model chunk). When `ScheduleConfig.recorder` is
set, `instrument` wraps both, and every forward, backward, send and receive becomes one
`ScheduleEvent` stamped with `time.perf_counter()`; the schedule's own code does not change.

The wrappers name each event's (chunk, micro-batch) without being told:

- forwards and backwards of one chunk run in micro-batch order (every schedule does), so the
  n-th forward (backward) of chunk c is micro-batch n;
- a sent tensor is the output of a forward (an activation) or of a backward (an input
  gradient), and carries that step's (chunk, micro-batch);
- a received tensor carries the (chunk, micro-batch) of the step that consumes it: its event
  is written when it arrives and named when a forward takes it as input or a backward as the
  gradient of its output.

A combined exchange is one event per tensor it moved, all with the exchange's start and end;
a helper that is a no-op at this end of the pipeline (nothing before the first stage, nothing
after the last) records nothing. An exchange the overlapped interleaved schedule posts without
waiting (`recorded_handles`) is one event per tensor too, each from the post to the end of
its own wait.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict

# Which neighbor a named helper talks to; at the pipeline's end on that side it does nothing.
_SIDE = {"recv_forward": "prev", "send_backward": "prev", "send_backward_recv_forward": "prev",
         "recv_backward": "next", "send_forward": "next", "send_forward_recv_backward": "next"}


def instrument(comm, steps, recorder, stage: int):
    """(comm, steps) as given without a recorder, else both wrapped to record into it."""
    if recorder is None:
        return comm, steps
    tags = _Tags(recorder, stage)
    return (None if comm is None else RecordedP2P(comm, tags)), RecordedSteps(steps, tags)


class _Tags:
    """The (chunk, micro-batch) of the tensors in flight, and the events written so far."""

    def __init__(self, recorder, stage: int):
        self.recorder, self.stage = recorder, stage
        self.produced: dict = {}  # id(tensor) -> (weakref, chunk, micro-batch)
        self.unnamed: dict = {}  # id(received tensor) -> (weakref, index of its event)
        self.count: defaultdict = defaultdict(int)  # (kind, chunk) -> steps run so far

    def step(self, kind: str, chunk: int, start: float, end: float, consumed, output) -> None:
        mb = self.count[kind, chunk]
        self.count[kind, chunk] += 1
        self.recorder.record(self.stage, chunk, mb, kind, start, end)
        for t in consumed:  # a received input (forward) or output gradient (backward)
            entry = self.unnamed.pop(id(t), None) if t is not None else None
            if entry is not None and entry[0]() is t:
                events = self.recorder.events
                events[entry[1]] = events[entry[1]]._replace(chunk=chunk, microbatch=mb)
        if output is not None:
            self.produced[id(output)] = (weakref.ref(output), chunk, mb)

    def sent(self, t, start: float, end: float) -> None:
        ref, chunk, mb = self.produced.pop(id(t), (None, None, None))
        if ref is None or ref() is not t:
            raise RuntimeError("a schedule sent a tensor no forward or backward produced")
        self.recorder.record(self.stage, chunk, mb, "send", start, end)

    def received(self, t, start: float, end: float) -> None:
        self.recorder.record(self.stage, -1, -1, "recv", start, end)  # named when consumed
        self.unnamed[id(t)] = (weakref.ref(t), len(self.recorder.events) - 1)


class RecordedSteps:
    """The steps, with one event per forward and per backward."""

    def __init__(self, steps, tags: _Tags):
        self.inner, self.tags = steps, tags

    def __getattr__(self, name):  # store, total_num_tokens, ...
        return getattr(self.inner, name)

    def forward(self, chunk: int, x):
        start = time.perf_counter()
        y = self.inner.forward(chunk, x)
        self.tags.step("forward", chunk, start, time.perf_counter(), (x,), y)
        return y

    def backward(self, chunk: int, x, y, dy):
        start = time.perf_counter()
        dx = self.inner.backward(chunk, x, y, dy)
        self.tags.step("backward", chunk, start, time.perf_counter(), (dy,), dx)
        return dx


class RecordedP2P:
    """The communicator, with one event per tensor each exchange moved."""

    def __init__(self, comm, tags: _Tags):
        self.inner, self.tags = comm, tags

    def __getattr__(self, name):  # rank, size, first, last, shape, ...
        return getattr(self.inner, name)

    def _call(self, name: str, sends, *args):
        side = _SIDE.get(name)
        idle = (side == "prev" and self.inner.first) or (side == "next" and self.inner.last)
        start = time.perf_counter()
        out = getattr(self.inner, name)(*args)
        if idle:
            return out
        end = time.perf_counter()
        for t in sends:
            if t is not None:
                self.tags.sent(t, start, end)
        for t in out if isinstance(out, tuple) else (out,):
            if t is not None:
                self.tags.received(t, start, end)
        return out

    def recv_forward(self):
        return self._call("recv_forward", ())

    def recv_backward(self):
        return self._call("recv_backward", ())

    def send_forward(self, y):
        return self._call("send_forward", (y,), y)

    def send_backward(self, dx):
        return self._call("send_backward", (dx,), dx)

    def send_forward_recv_backward(self, y):
        return self._call("send_forward_recv_backward", (y,), y)

    def send_backward_recv_forward(self, dx):
        return self._call("send_backward_recv_forward", (dx,), dx)

    def exchange(self, y, dx, recv_prev: bool, recv_next: bool):
        return self._call("exchange", (y, dx), y, dx, recv_prev, recv_next)


class _RecordedHandle:
    """A posted send or receive; its event (post to completion) is written when it is waited."""

    def __init__(self, work, tags: _Tags, tensor, sent: bool, start: float):
        self.work, self.tags, self.tensor, self.sent, self.start = work, tags, tensor, sent, start
        self.done = False

    def wait(self) -> None:
        self.work.wait()
        if self.done:
            return
        self.done = True
        end = time.perf_counter()
        if self.sent:
            self.tags.sent(self.tensor, self.start, end)
        else:
            self.tags.received(self.tensor, self.start, end)


def recorded_handles(comm, handles: dict, sends: dict, received, start: float) -> dict:
    """The handles of one posted exchange; with a recorder, each records itself when waited.

    `sends` maps "send_next"/"send_prev" to the tensor sent; `received` is the receive buffer.
    A posted send is one "send" event and a posted receive one "recv" event, both spanning
    from the post to the end of their wait (named like the blocking exchange's).
    """
    tags = getattr(comm, "tags", None)
    if tags is None:
        return handles
    return {name: _RecordedHandle(work, tags, sends.get(name, received),
                                  name.startswith("send"), start)
            for name, work in handles.items()}
