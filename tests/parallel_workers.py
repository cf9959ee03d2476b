"""Rank functions for the Appendix A tests: each builds several grids in one world and runs many checks."""

from __future__ import annotations

import time

import torch

from tinytron.parallel import (ColumnParallelLinear, ParallelGrid, RowParallelLinear,
                               VocabParallelEmbedding, gather_from_context_parallel,
                               gather_from_sequence_parallel_region, gather_shards, normal_init,
                               rank_layout, scatter_to_sequence_parallel_region,
                               send_backward_recv_backward,
                               send_forward_backward_recv_forward_backward, send_forward_recv_forward,
                               split_for_context_parallel)
from tinytron.parallel._workers import (cp_attention_parity, dropout_masks, pipeline_parity,
                                        tp_mlp_parity, vocab_parity)


def _attrs_and_init(grid: ParallelGrid) -> dict:
    """Parameter flags, and the full weights equal those of the same layers on one rank."""
    col = ColumnParallelLinear(8, 12, grid, init_method=normal_init(0.02, 1), sequence_parallel=True)
    row = RowParallelLinear(12, 8, grid, init_method=normal_init(0.02, 2), sequence_parallel=True)
    emb = VocabParallelEmbedding(16, 8, grid, init_method=normal_init(0.02, 3))
    single = ParallelGrid.single()
    full = {"col": ColumnParallelLinear(8, 12, single, init_method=normal_init(0.02, 1)).weight,
            "row": RowParallelLinear(12, 8, single, init_method=normal_init(0.02, 2)).weight,
            "emb": VocabParallelEmbedding(16, 8, single, init_method=normal_init(0.02, 3)).weight}
    flags = {
        "col.weight": (col.weight.tensor_model_parallel, col.weight.partition_dim, tuple(col.weight.shape)),
        "col.bias": (col.bias.tensor_model_parallel, col.bias.partition_dim, tuple(col.bias.shape)),
        "row.weight": (row.weight.tensor_model_parallel, row.weight.partition_dim, tuple(row.weight.shape)),
        "row.bias.sp": (getattr(row.bias, "tensor_model_parallel", False), row.bias.sequence_parallel),
        "emb.weight": (emb.weight.tensor_model_parallel, emb.weight.partition_dim, tuple(emb.weight.shape)),
    }
    same = all(torch.equal(gather_shards(m.weight, grid, m.weight.partition_dim), full[k])
               for k, m in (("col", col), ("row", row), ("emb", emb)))
    return {"flags": flags, "init_invariant": same}


def _sp_regions(grid: ParallelGrid) -> float:
    """scatter_to_sequence_parallel_region and the split-backward gather, against hand-computed grads."""
    tp, r = grid.size("tp"), grid.rank("tp")
    x = torch.arange(24.0).reshape(4, 3, 2).requires_grad_(True)
    y = scatter_to_sequence_parallel_region(x, grid)
    (y * (r + 1)).sum().backward()  # each rank's grad lands on its own slice only
    expect = torch.cat([torch.full((4 // tp, 3, 2), float(i + 1)) for i in range(tp)])
    err = (x.grad - expect).abs().max().item() + (y - x.detach().chunk(tp)[r]).abs().max().item()
    z = x.detach().chunk(tp)[r].clone().requires_grad_(True)
    g = gather_from_sequence_parallel_region(z, grid, tensor_parallel_output_grad=False)
    (g * 2).sum().backward()  # replicated consumer: the grad is split, not summed
    return err + (g - x.detach()).abs().max().item() + (z.grad - 2).abs().max().item()


def _p2p_both_ways(grid: ParallelGrid) -> dict:
    """All four directions in one exchange between wrap-around neighbors, batched, as single
    operations and posted without waiting (overlap_p2p_comm); what arrived, per method."""
    me = float(grid.global_rank)
    out, grad = torch.full((2,), me), torch.full((2,), -me)
    arrived = {}
    for name, batch in (("batched", True), ("single", False)):
        from_prev, from_next = send_forward_backward_recv_forward_backward(
            out, grad, True, True, (2,), grid, batch_p2p_comm=batch)
        ring = send_forward_recv_forward(torch.full((3,), me), True, (3,), grid,
                                         batch_p2p_comm=batch)
        arrived[name] = [from_prev[0].item(), from_next[0].item(), ring[0].item()]
    ring, handles = send_forward_recv_forward(torch.full((3,), me), True, (3,), grid,
                                              overlap_p2p_comm=True, batch_p2p_comm=False)
    grad_back, more = send_backward_recv_backward(grad, True, (2,), grid, overlap_p2p_comm=True,
                                                  batch_p2p_comm=False)
    for h in [*handles.values(), *more.values()]:
        h.wait()
    arrived["posted"] = [ring[0].item(), grad_back[0].item(), sorted(handles) + sorted(more)]
    return arrived


def _grid_matches_layout(grid: ParallelGrid, **sizes) -> bool:
    """Real groups equal the pure layout; a tp all-reduce sums exactly the tp ranks."""
    layout = rank_layout(grid.world_size, **sizes)
    ok = all(grid.ranks(a) == layout.group_of(a, grid.global_rank) for a in layout.groups)
    for axis in ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "mp"):
        x = torch.tensor([float(grid.global_rank)])
        grid.all_reduce(x, axis)
        ok &= x.item() == sum(grid.ranks(axis))
    return ok


def _bad_grid_message() -> str:
    """The ValueError a grid whose sizes do not fit the world raises."""
    try:
        ParallelGrid(tp=2, pp=2)
    except ValueError as err:
        return str(err)
    return "no error"


def world_of_2() -> dict:
    """Every 2-rank check: TP2 layers, vocab, CP2 attention, PP2 p2p, RNG, grids."""
    t0 = time.perf_counter()
    bad = _bad_grid_message()  # before any group exists: a failed grid must create none
    tp, cp, pp = ParallelGrid(tp=2), ParallelGrid(cp=2), ParallelGrid(pp=2)
    x = torch.arange(8.0).reshape(1, 8, 1)
    return {
        "mlp": [tp_mlp_parity(False, tp), tp_mlp_parity(True, tp), tp_mlp_parity(False, tp, gathered=True)],
        "vocab": vocab_parity(False, tp), "vocab_sp": vocab_parity(True, tp),
        "attrs": _attrs_and_init(tp), "sp_regions": _sp_regions(tp),
        "cp": cp_attention_parity(cp, True) + cp_attention_parity(cp, False),
        "cp_gather": torch.equal(gather_from_context_parallel(split_for_context_parallel(x, cp), cp), x),
        "pp": pipeline_parity(pp), "p2p": _p2p_both_ways(pp), "rng": dropout_masks(tp),
        "grid": _grid_matches_layout(tp, tp=2), "first_last": (pp.is_first_stage(), pp.is_last_stage()),
        "bad_grid": bad,
        "seconds": time.perf_counter() - t0,
    }


def world_of_4() -> dict:
    """Every 4-rank check: TP4 layers, TP2xCP2 layers and attention, CP4 (ring) attention, PP4 p2p, grids."""
    t0 = time.perf_counter()
    tp4, tpcp, pp4, cp4 = ParallelGrid(tp=4), ParallelGrid(tp=2, cp=2), ParallelGrid(pp=4), ParallelGrid(cp=4)
    tppp = ParallelGrid(tp=2, pp=2)
    return {
        "mlp": [tp_mlp_parity(False, tp4), tp_mlp_parity(True, tp4), tp_mlp_parity(True, tpcp)],
        "vocab": vocab_parity(False, tp4), "vocab_sp": vocab_parity(True, tp4),
        "attrs": _attrs_and_init(tp4), "sp_regions": _sp_regions(tp4),
        "cp": cp_attention_parity(tpcp, True) + cp_attention_parity(cp4, True),
        "pp": pipeline_parity(pp4), "p2p": _p2p_both_ways(pp4),
        "grid": _grid_matches_layout(tpcp, tp=2, cp=2) and _grid_matches_layout(tppp, tp=2, pp=2),
        "embd": tppp.ranks("embd"), "rng": dropout_masks(tpcp),
        "seconds": time.perf_counter() - t0,
    }
