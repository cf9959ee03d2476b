"""A recorder of host reads: every place Python asks a tensor for a value it must wait for.

On a GPU, ``.item()``, ``float(t)``, ``bool(t)`` (an ``if`` on a tensor), ``int(t)``,
``.tolist()``, ``.numpy()`` and ``.cpu()`` each block the host until the device has produced
that value: a host sync. On a CPU they cost nothing, but they are the same calls at the same
places, so recording them on a CPU run lists the syncs the same run has on a GPU (those made
on host tensors excepted: the page says which). ``record_host_reads`` replaces these methods
of ``torch.Tensor`` for the duration of a ``with`` block, counts each call by the tinytron
function that made it (the nearest frame inside the package: a call from inside torch is
charged to the tinytron function that called torch), and restores them afterwards.

What it cannot see: a sync inside one C++ operator (``torch.nonzero``, boolean-mask indexing,
``repeat_interleave`` without an output size) never passes through these methods. On CUDA,
``torch.cuda.set_sync_debug_mode("warn")`` reports those too.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

import torch

__all__ = ["READS", "record_host_reads", "site_of_caller", "trainer_host_reads"]

READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__")
_PACKAGE = Path(__file__).resolve().parent.parent   # the folder that holds the chapters
_HERE = Path(__file__).resolve()


def site_of_caller() -> str:
    """'NN_chapter/file.py:function' of the nearest frame in tinytron outside this module,
    then by ' <- file.py:function' of the nearest tinytron frame in another file, the
    code that asked for it (the loss function that called the rerun machine's check)."""
    sites, frame = [], sys._getframe(1)
    while frame is not None and len(sites) < 2:
        path = Path(frame.f_code.co_filename).resolve()
        if path != _HERE and _PACKAGE in path.parents:
            name = path.relative_to(_PACKAGE).as_posix()
            if not sites or sites[0][0] != name:
                sites.append((name, frame.f_code.co_name))
        frame = frame.f_back
    if not sites:
        return "outside tinytron"
    return " <- ".join(f"{name}:{function}" for name, function in sites)


@contextlib.contextmanager
def record_host_reads():
    """Count host reads of tensors by (site, method) inside the block; yields the Counter."""
    counts: collections.Counter = collections.Counter()
    own = {name: torch.Tensor.__dict__.get(name) for name in READS}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name, method):
        def read(self, *args, **kwargs):
            counts[(site_of_caller(), name)] += 1
            return method(self, *args, **kwargs)
        return read

    for name, method in originals.items():
        setattr(torch.Tensor, name, counting(name, method))
    try:
        yield counts
    finally:
        for name, method in own.items():
            if method is None:
                delattr(torch.Tensor, name)     # it was inherited from the C base: inherit again
            else:
                setattr(torch.Tensor, name, method)


def trainer_host_reads(config: str, overrides: list[str], iters: int = 2) -> dict:
    """{(site, method): reads per iteration} of `tinytron.train` on this rank (a run_on_ranks worker).

    Two in-process runs of the trainer from scratch, of 2 and 2 + `iters` iterations, each
    under the recorder; their difference over `iters` is what one iteration adds, with the
    start-up, the final save and the final validation canceled out.
    """
    import io
    import os
    import shutil
    import tempfile

    import torch.distributed as dist

    import tinytron.train as train

    shared = [tempfile.mkdtemp(prefix="tinytron_host_reads_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)          # one folder for every rank's runs
    prefix = train.prepare_embedded_corpus(os.path.join(shared[0], "data"))
    counts = []
    for n in (2, 2 + iters):
        argv = ["--config", config, *overrides, "--training.train_iters", str(n),
                "--data.data_path", prefix,
                "--data.data_cache_path", os.path.join(shared[0], "data", "cache"),
                "--checkpoint.save", os.path.join(shared[0], f"run_{n}")]
        cfg = train.resolve_config(argv, dist.get_world_size())
        console = io.StringIO()
        with record_host_reads() as reads, contextlib.redirect_stdout(console):
            code = train.run(cfg, argv, "host_reads")
        if code != 0:
            raise RuntimeError(f"tinytron.train exited {code}:\n{console.getvalue()[-2000:]}")
        counts.append(reads)
    dist.barrier()                                     # every rank is done with the folder
    if dist.get_rank() == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
    short, long = counts
    return {key: (long[key] - short.get(key, 0)) / iters for key in long
            if long[key] != short.get(key, 0)}
