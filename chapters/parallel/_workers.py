"""Rank functions for the Appendix A demos (spawned processes need them importable by name)."""

from __future__ import annotations

import torch

from tinytron.parallel.grid import ParallelGrid


def grid_views(tp: int, pp: int, cp: int = 1) -> dict:
    """Build a grid; all-reduce the global rank over tp and embd; report what this rank sees."""
    grid = ParallelGrid(tp=tp, cp=cp, pp=pp)
    x = torch.tensor([float(grid.global_rank)])
    grid.all_reduce(x, "tp")
    return {"describe": grid.describe(), "tp_sum": int(x.item()), "embd": grid.ranks("embd"),
            "first": grid.is_first_stage(), "last": grid.is_last_stage()}


def _dense_mlp_reference(x, dy, h, f, seeds):
    """The dense fc1 -> gelu -> fc2 with the same full weights; returns y, x.grad and the modules."""
    from tinytron.parallel.tensor_parallel import normal_init

    fc1, fc2 = torch.nn.Linear(h, f), torch.nn.Linear(f, h)
    for lin, seed in ((fc1, seeds[0]), (fc2, seeds[1])):
        normal_init(0.5, seed)(lin.weight.data)
        torch.nn.init.zeros_(lin.bias)
    x = x.clone().requires_grad_(True)
    y = fc2(torch.nn.functional.gelu(fc1(x)))
    (y * dy).sum().backward()
    return y.detach(), x.grad, fc1, fc2


def tp_mlp_parity(sequence_parallel: bool, grid: ParallelGrid | None = None, gathered: bool = False,
                  s: int = 8, b: int = 2, h: int = 16, f: int = 32) -> float:
    """Column -> gelu -> row on a TP grid vs the dense MLP; return the largest abs difference.

    `gathered=True` uses column(gather_output=True) -> row(input_is_parallel=False) instead.
    """
    from tinytron.parallel._comm import all_reduce
    from tinytron.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                   gather_shards, normal_init)

    grid = grid or ParallelGrid(tp=torch.distributed.get_world_size())
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(s, b, h, generator=gen), torch.randn(s, b, h, generator=gen)
    y_ref, dx_ref, fc1_ref, fc2_ref = _dense_mlp_reference(x, dy, h, f, (1, 2))
    fc1 = ColumnParallelLinear(h, f, grid, sequence_parallel=sequence_parallel, gather_output=gathered,
                               init_method=normal_init(0.5, 1))
    fc2 = RowParallelLinear(f, h, grid, sequence_parallel=sequence_parallel, input_is_parallel=not gathered,
                            init_method=normal_init(0.5, 2))
    tp, r = grid.size("tp"), grid.rank("tp")
    slice_ = (lambda t: t.chunk(tp, 0)[r]) if sequence_parallel else (lambda t: t)
    x_in = slice_(x).clone().requires_grad_(True)
    y = fc2(torch.nn.functional.gelu(fc1(x_in)))
    (y * slice_(dy)).sum().backward()
    bias2_grad = all_reduce(fc2.bias.grad, grid, "tp") if sequence_parallel else fc2.bias.grad
    pairs = [(y, slice_(y_ref)), (x_in.grad, slice_(dx_ref)),
             (gather_shards(fc1.weight.grad, grid, 0), fc1_ref.weight.grad),
             (gather_shards(fc1.bias.grad, grid, 0), fc1_ref.bias.grad),
             (gather_shards(fc2.weight.grad, grid, 1), fc2_ref.weight.grad),
             (bias2_grad, fc2_ref.bias.grad)]
    return max((a.detach() - e).abs().max().item() for a, e in pairs)


def vocab_parity(sequence_parallel: bool = False, grid: ParallelGrid | None = None,
                 b: int = 2, s: int = 4, h: int = 8, v: int = 16) -> dict:
    """Vocab-parallel embedding and CE vs nn.Embedding / F.cross_entropy; return max abs errors."""
    import torch.nn.functional as F

    from tinytron.parallel.tensor_parallel import gather_shards, normal_init
    from tinytron.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

    grid = grid or ParallelGrid(tp=torch.distributed.get_world_size())
    tp, r = grid.size("tp"), grid.rank("tp")
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, v, (b, s), generator=gen)
    logits = torch.randn(b, s, v, generator=gen) * 3
    labels = torch.randint(0, v, (b, s), generator=gen)
    ref_emb = torch.nn.Embedding(v, h)
    normal_init(1.0, 7)(ref_emb.weight.data)
    emb = VocabParallelEmbedding(v, h, grid, init_method=normal_init(1.0, 7),
                                 reduce_scatter_embeddings=sequence_parallel)
    out, ref_full = emb(tokens), ref_emb(tokens)
    ref = ref_full
    if sequence_parallel:  # [s/tp, b, h]: compare with my sequence slice of the reference
        ref = ref_full.transpose(0, 1).chunk(tp, 0)[r]
    (out * ref.detach().cos()).sum().backward()
    (ref_full * ref_full.detach().cos()).sum().backward()
    full = logits.clone().requires_grad_(True)
    local = logits.chunk(tp, -1)[r].clone().requires_grad_(True)
    loss, loss_ref = vocab_parallel_cross_entropy(local, labels, grid), F.cross_entropy(
        full.transpose(1, 2), labels, reduction="none")
    weights = torch.arange(b * s, dtype=torch.float32).reshape(b, s)  # uneven upstream grads
    (loss * weights).sum().backward()
    (loss_ref * weights).sum().backward()
    return {"emb_out": (out - ref).abs().max().item(),
            "emb_grad": (gather_shards(emb.weight.grad, grid, 0) - ref_emb.weight.grad).abs().max().item(),
            "ce": (loss - loss_ref).abs().max().item(),
            "ce_grad": (local.grad - full.grad.chunk(tp, -1)[r]).abs().max().item()}


def dropout_masks(grid: ParallelGrid | None = None, n: int = 12) -> dict:
    """Dropout masks drawn outside a fork, in the TP stream, in the DP stream, and replayed."""
    from tinytron.parallel.rng import DATA_PARALLEL_RNG, RNGStatesTracker, model_parallel_seed

    grid = grid or ParallelGrid(tp=torch.distributed.get_world_size())
    tracker = model_parallel_seed(1234, grid, RNGStatesTracker("cpu"))

    def mask() -> str:
        keep = torch.nn.functional.dropout(torch.ones(n), p=0.5) > 0
        return "".join("1" if k else "0" for k in keep.tolist())

    default = mask()
    saved = tracker.get_states()
    with tracker.fork():
        tp = mask()
    with tracker.fork(DATA_PARALLEL_RNG):
        dp = mask()
    tracker.set_states(saved)
    with tracker.fork():
        replayed = mask()
    return {"default": default, "tp": tp, "dp": dp, "replayed": replayed}


def cp_attention_parity(grid: ParallelGrid | None = None, causal: bool = True, b: int = 2, hq: int = 4,
                        hkv: int = 2, s: int = 16, d: int = 8) -> list[float]:
    """CP attention (all-gather, and ring when causal) vs full attention; max abs error of out and q/k/v grads."""
    from tinytron.parallel.context_parallel import (context_parallel_attention, ring_attention,
                                                    split_for_context_parallel)

    grid = grid or ParallelGrid(cp=torch.distributed.get_world_size())
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, n, s, d, generator=gen) for n in (hq, hkv, hkv))
    w = torch.randn(b, hq, s, d, generator=gen)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    # the reference is torch's SDPA on the whole sequence (kv heads expanded for GQA), not the
    # function under test, for the causal and the non-causal path alike
    rep = hq // hkv
    out_ref = torch.nn.functional.scaled_dot_product_attention(
        full[0], full[1].repeat_interleave(rep, 1), full[2].repeat_interleave(rep, 1),
        is_causal=causal)
    (out_ref * w).sum().backward()
    variants = [lambda *t: context_parallel_attention(*t, grid, causal=causal)]
    if causal:
        variants.append(lambda *t: ring_attention(*t, grid))
    errors = []
    for attend in variants:
        local = [split_for_context_parallel(t, grid, 2).requires_grad_(True) for t in (q, k, v)]
        out = attend(*local)
        (out * split_for_context_parallel(w, grid, 2)).sum().backward()
        pairs = [(out, out_ref)] + [(loc.grad, ref.grad) for loc, ref in zip(local, full)]
        errors.append(max((a.detach() - split_for_context_parallel(e, grid, 2)).abs().max().item()
                          for a, e in pairs))
    return errors


def pipeline_parity(grid: ParallelGrid | None = None, h: int = 8, b: int = 4,
                    batch_p2p_comm: bool = True) -> dict:
    """One micro-batch through a pp-stage chain of Linear+tanh vs the unsplit chain on every rank."""
    from tinytron.parallel import pipeline_p2p as p2p
    from tinytron.parallel.tensor_parallel import normal_init

    grid = grid or ParallelGrid(pp=torch.distributed.get_world_size())
    num_stages, me = grid.size("pp"), grid.rank("pp")
    layers = [torch.nn.Linear(h, h) for _ in range(num_stages)]
    for i, lin in enumerate(layers):
        normal_init(0.5, 10 + i)(lin.weight.data)
        normal_init(0.5, 20 + i)(lin.bias.data)  # nn.Linear's own init would differ per process
    gen = torch.Generator().manual_seed(4)
    x, target = torch.randn(b, h, generator=gen), torch.randn(b, h, generator=gen)
    y = x
    for lin in layers:  # the unsplit reference, run on every rank
        y = torch.tanh(lin(y))
    loss_ref = ((y - target) ** 2).mean()
    loss_ref.backward()
    ref_grad = layers[me].weight.grad.clone()
    layer = layers[me]
    layer.weight.grad = None
    batch = {"batch_p2p_comm": batch_p2p_comm}
    inp = x if grid.is_first_stage() else p2p.recv_forward((b, h), grid, **batch)
    out = torch.tanh(layer(inp))
    loss = None
    if grid.is_last_stage():
        loss = ((out - target) ** 2).mean()
        loss.backward()
    else:
        out.backward(p2p.send_forward_recv_backward(out, (b, h), grid, **batch))
    if not grid.is_first_stage():
        p2p.send_backward(inp.grad, grid, **batch)
    return {"grad_err": (layer.weight.grad - ref_grad).abs().max().item(),
            "loss": None if loss is None else round(loss.item(), 6), "loss_ref": loss_ref.item(),
            "grad": layer.weight.grad.clone()}


def pipeline_parity_both_methods() -> list[dict]:
    """pipeline_parity with the messages batched, then as single isend/irecv (one world)."""
    grid = ParallelGrid(pp=torch.distributed.get_world_size())
    return [pipeline_parity(grid, batch_p2p_comm=batch) for batch in (True, False)]


def tp_mlp_both_modes() -> list[float]:
    """tp_mlp_parity without and with sequence parallelism, on one TP grid over the whole world."""
    grid = ParallelGrid(tp=torch.distributed.get_world_size())
    return [tp_mlp_parity(False, grid), tp_mlp_parity(True, grid)]
