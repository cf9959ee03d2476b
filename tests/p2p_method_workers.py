"""Rank functions for tests/test_main_loop_p2p_methods.py: which method moved each p2p message.

Under NCCL, `torch.distributed.batch_isend_irecv` runs on the process group's communicator
and a single `isend`/`irecv` on a separate communicator of the two ranks, so a message sent by
one method and received by the other never matches (gloo matches by peer and hides it). The
recorder below wraps torch's public p2p entry points in the worker, with no knowledge of
tinytron, and logs every message posted on this rank: batched or single, send or receive,
the two global ranks and the ranks of the group it was posted on.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist

from tinytron.main_loop import _workers as w
from tinytron.main_loop.schedules import ScheduleConfig, get_forward_backward_func
from tinytron.model.gpt import build_stage_models

# name: (pp, vpp, overlap_p2p_comm, batch_p2p_comm or None for the default, forward_only)
LAYOUTS = {
    "1f1b_pp2": (2, None, False, None, False),
    "1f1b_pp2_single": (2, None, False, False, False),
    "1f1b_pp4": (4, None, False, None, False),
    "1f1b_pp4_single": (4, None, False, False, False),
    "vpp_pp2_plain": (2, 2, False, None, False),
    "vpp_pp2_overlap": (2, 2, True, None, False),
    "vpp_pp2_overlap_eval": (2, 2, True, None, True),
    "vpp_pp4_plain": (4, 2, False, None, False),
    "vpp_pp4_plain_single": (4, 2, False, False, False),
    "vpp_pp4_overlap": (4, 2, True, None, False),
}


def _group_ranks(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


@contextlib.contextmanager
def recorded_p2p(log: list):
    """Wrap torch.distributed's isend, irecv, P2POp and batch_isend_irecv; append one entry
    (method, kind, src, dst, group ranks) per message posted on this rank."""
    names = ("isend", "irecv", "P2POp", "batch_isend_irecv")
    orig = {n: getattr(dist, n) for n in names}

    def single(kind):
        fn, sig = orig[kind], inspect.signature(orig[kind])
        peer_key = "dst" if kind == "isend" else "src"

        def wrapper(*args, **kwargs):
            a = sig.bind(*args, **kwargs).arguments
            group, peer = a.get("group"), a.get(peer_key)
            if peer is None:
                peer = dist.get_global_rank(group, a["group_" + peer_key])
            me = dist.get_rank()
            src, dst = (me, peer) if kind == "isend" else (peer, me)
            log.append(("single", kind, src, dst, _group_ranks(group)))
            return fn(*args, **kwargs)
        return wrapper

    wrapped = {"isend": single("isend"), "irecv": single("irecv")}
    unwrap = {id(wrapped[k]): orig[k] for k in wrapped}

    def p2p_op(op, *args, **kwargs):  # P2POp accepts torch's own isend/irecv only
        return orig["P2POp"](unwrap.get(id(op), op), *args, **kwargs)

    def batch_isend_irecv(ops):
        me = dist.get_rank()
        for op in ops:
            kind = "isend" if op.op is orig["isend"] else "irecv"
            src, dst = (me, op.peer) if kind == "isend" else (op.peer, me)
            log.append(("batched", kind, src, dst, _group_ranks(op.group)))
        return orig["batch_isend_irecv"](ops)

    patches = dict(wrapped, P2POp=p2p_op, batch_isend_irecv=batch_isend_irecv)
    for n, f in patches.items():
        setattr(dist, n, f)
    try:
        yield log
    finally:
        for n, f in orig.items():
            setattr(dist, n, f)


def _layout_run(pp, vpp, overlap, batch, forward_only, m: int = 4) -> dict:
    """One iteration of the schedule for this layout, every p2p message logged."""
    grid = w.grid_for(1, pp)
    chunks = vpp or 1
    config = w.tiny_config(num_layers=pp * chunks, tie_embeddings=False)
    torch.manual_seed(0)
    models = build_stage_models(config, grid, num_virtual_stages=chunks)
    batches = w.make_microbatches(config, m, seed=5)
    extra = {} if batch is None else {"batch_p2p_comm": batch}
    try:
        cfg = ScheduleConfig(overlap_p2p_comm=overlap, **extra)
    except TypeError as e:  # a ScheduleConfig without the key
        return {"error": f"{type(e).__name__}: {e}", "log": []}
    iters = [iter(batches) for _ in models]
    log: list = []
    with recorded_p2p(log):
        get_forward_backward_func(pp, vpp)(
            forward_step_func=w.forward_step_func, data_iterator=iters if vpp else iters[0],
            model=models if vpp else models[0], num_microbatches=m,
            seq_length=config.seq_length, micro_batch_size=1, grid=grid,
            forward_only=forward_only, config=cfg)
    return {"error": None, "log": log}


def p2p_method_world() -> dict:
    """Every layout of LAYOUTS in one 4-rank world (PP 2 runs as two pipelines, dp = 2)."""
    return {"rank": dist.get_rank(),
            **{name: _layout_run(*args) for name, args in LAYOUTS.items()}}
