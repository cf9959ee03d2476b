"""Module-level functions the harness test runs on its ranks (they must be importable by name)."""

import os
import time

import torch
import torch.distributed as dist


def collectives():
    """all_reduce, all_gather, broadcast and a ring send/recv; return what this rank saw."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    b = torch.tensor([float(rank * 10)])
    dist.broadcast(b, src=world - 1)
    recv = torch.zeros(1)
    ops = [dist.P2POp(dist.isend, torch.tensor([float(rank)]), (rank + 1) % world),
           dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return {"rank": rank, "world": world, "sum": x.item(), "gathered": [g.item() for g in gathered],
            "bcast": b.item(), "from_left": recv.item(), "env_rank": int(os.environ["RANK"])}


def raise_on(bad_rank):
    """Rank ``bad_rank`` raises; the others block in a collective that can never complete."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()
    return "unreachable"


def sleep_forever():
    time.sleep(3600)


def die_on(bad_rank):
    """Rank ``bad_rank`` leaves at once with exit code 3 and no report (as a segfault would)."""
    if dist.get_rank() == bad_rank:
        os._exit(3)
    dist.barrier()
    return "unreachable"


def environment(name):
    """What a rank starts with: one variable's value, every variable's name, cwd, torch's seed."""
    return {"value": os.environ.get(name), "names": sorted(os.environ), "cwd": os.getcwd(),
            "initial_seed": torch.initial_seed()}
