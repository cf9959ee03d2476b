"""Run a function on N ranks of a real process group, on one machine.

Used by the tests and by the chapters' multi-process demos. Each rank is a new process (forked
from a server that has imported torch once, so that a world starts in a fraction of a second;
``spawn`` where there is no fork), joins a gloo (CPU) or NCCL (CUDA) world through a TCPStore
that the parent hosts on a free loopback port, calls ``fn(*args)`` and sends back its return
value. A rank that raises is reported with its traceback; the other ranks are then stopped
instead of being left to hang in a collective that will never complete; a world that runs past
``timeout`` is killed and the ranks that had not finished are named.

``fn`` must be importable by name: a module-level function of an installed module, or a
top-level function of the script being run (each rank re-imports the script, as spawn does,
so its own work must sit under ``if __name__ == "__main__":``). A function defined in a
notebook cell or in ``python -c`` cannot be sent to a rank.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

__all__ = ["run_on_ranks", "RankError"]


# What a rank reports when it failed only because a peer left the world (or the world stopped):
# a consequence, never the root cause to name first.
_SECONDARY = ("Connection closed by peer", "Connection reset", "Broken pipe", "connection closed",
              "timed out", "Timed out", "still running", "without a report")


def _last_line(report: str) -> str:
    """The exception line of a traceback (its last non-empty line)."""
    lines = [line.strip() for line in report.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no report)"


def _root_cause_rank(failures: dict[int, str]) -> int:
    """A rank that raised on its own; else one that died without a report; else the first."""
    for r, tb in failures.items():
        if not any(s in tb for s in _SECONDARY):
            return r
    for r, tb in failures.items():  # a segfault or os._exit: its peers only saw the socket close
        if "without a report" in tb:
            return r
    return next(iter(failures))


@contextlib.contextmanager
def _no_main_module_rerun():
    """In a Jupyter kernel, stop a rank from re-running the kernel's `__main__.__file__`.

    A rank runs the parent's main file again (spawn's preparation, which the forkserver's ranks
    go through too) unless `__main__` has none. A notebook has no main file of its own, and a
    library may have left one there (Triton's interpreter does), which the rank would then
    execute. The workers are imported by name, so nothing is lost.
    """
    main = sys.modules.get("__main__")
    saved = None
    if main is not None and "ipykernel" in sys.modules and getattr(main, "__spec__", None) is None:
        saved = main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        if saved is not None:
            main.__file__ = saved


class RankError(RuntimeError):
    """One or more ranks raised (or died); line one names the root cause, then every traceback."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures  # in the order the reports arrived
        self.root_rank = _root_cause_rank(failures)
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]
        super().__init__(f"rank {self.root_rank}: {_last_line(failures[self.root_rank])} "
                         f"({len(failures)} rank(s) failed: {sorted(failures)}; tracebacks below)\n"
                         + "\n".join(parts))


# Four ranks that each start a Python and import torch cost seconds of CPU per world (~10 s
# for four on a busy 2-core machine), and the tests and demos start hundreds of worlds.
# multiprocessing's forkserver imports torch once in a server process and forks every rank
# from it: 0.2 s for a world of four after the first. The server has imported modules only (no
# thread pool, no CUDA context, no process group), so a fork of it is clean. What spawn gave a
# rank that a fork of the server would not is restored: the caller's environment as it is now
# (the server keeps its own from its start), a random seed of the rank's own for torch's default
# generator (every fork would share the server's), and the working directory, sys.path and the
# main script (multiprocessing's preparation data, as for spawn).
_PRELOAD = ["torch", "torch.distributed"]


def _context():
    """The forkserver with torch preloaded where the platform forks; spawn elsewhere."""
    if sys.platform.startswith("linux"):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def _rank_main(fn, args, kwargs, rank, world_size, port, backend, timeout_s, num_threads, results,
               environ=None):
    """Body of one rank: join the world, run ``fn``, report the result or the traceback."""
    try:
        if environ is not None:  # the caller's environment, not the one the server started with
            os.environ.clear()
            os.environ.update(environ)
        import torch
        import torch.distributed as dist

        torch.seed()  # a seed of its own, as a fresh process draws one (a fork shares the server's)
        torch.set_num_threads(num_threads)  # N ranks on few cores: one thread each avoids thrashing
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            out = fn(*args, **kwargs)
        except BaseException:  # noqa: BLE001
            # Report before leaving the world: peers blocked in a collective with this rank fail
            # as soon as it leaves, and their "connection closed" must not arrive first.
            results.put((rank, False, traceback.format_exc()))
            _leave(dist)
            return
        _leave(dist)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - everything a rank raises must reach the parent
        results.put((rank, False, traceback.format_exc()))


def _leave(dist) -> None:
    """Destroy the process group; a failure here must not hide the rank's own report."""
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                 timeout: float = 120.0, num_threads: int = 1, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results in rank order.

    Example (in a script; ``fn`` is a top-level function of it or of an installed module)::

        def all_ranks_sum():
            t = torch.ones(1) * torch.distributed.get_rank()
            torch.distributed.all_reduce(t)
            return t.item()

        if __name__ == "__main__":
            print(run_on_ranks(all_ranks_sum, 2))     # [1.0, 1.0]; a failure raises RankError
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    import torch.distributed as dist

    # The parent hosts the rendezvous store on port 0 (the OS picks a free port), so two test
    # worlds started at once can never collide on a port.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                          timeout=timedelta(seconds=timeout), wait_for_workers=False)
    ctx = _context()
    results = ctx.Queue()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, name=f"rank{r}", daemon=True,
                         args=(fn, args, kwargs, r, world_size, store.port, backend, timeout,
                               num_threads, results, environ))
             for r in range(world_size)]
    with _no_main_module_rerun():
        for p in procs:
            p.start()
    try:
        outputs, failures = _collect(procs, results, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        del store
    if failures:
        raise RankError(failures)
    return [outputs[r] for r in range(world_size)]


def _collect(procs: Sequence, results, timeout: float, grace_s: float = 10.0):
    """Gather every rank's report; stop early (after a grace period) once one rank has failed."""
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) + len(failures) < len(procs):
        now = time.monotonic()
        if now > deadline:
            missing = [r for r in range(len(procs)) if r not in outputs and r not in failures]
            why = (f"stopped: still running {grace_s:.0f} s after rank(s) {sorted(failures)} failed"
                   if failures else f"timed out after {timeout:.0f} s")
            for r in missing:
                failures[r] = f"{why} (unfinished ranks: {missing})"
            break
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            for r, p in enumerate(procs):
                if r not in outputs and r not in failures and not p.is_alive() and p.exitcode != 0:
                    # Died without reporting (segfault, os._exit, OOM kill). Drain first: the
                    # report may still be in the pipe.
                    time.sleep(0.2)
                    if results.empty():
                        failures[r] = f"process exited with code {p.exitcode} without a report"
            continue
        if ok:
            outputs[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
            # The survivors are likely blocked in a collective with the dead rank: give them a
            # short grace period to report their own errors, then stop waiting.
            deadline = min(deadline, time.monotonic() + grace_s)
    return outputs, failures
