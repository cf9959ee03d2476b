"""Rank functions for the model demos and tests: every layout against the single-process model."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tinytron.model.config import count_parameters_per_rank, tiny_config
from tinytron.model.gpt import (GPTModel, build_stage_models, global_parameter_name,
                                stage_tensor_shape)
from tinytron.model.layers import unshard
from tinytron.parallel import ParallelGrid
from tinytron.parallel.context_parallel import cp_positions
from tinytron.parallel.pipeline_p2p import communicate


_GRIDS: dict = {}


def _grid(tp: int = 1, cp: int = 1, pp: int = 1) -> ParallelGrid:
    """One grid per layout per process: building one creates every group (~0.5 s on gloo)."""
    if (tp, cp, pp) not in _GRIDS:
        _GRIDS[(tp, cp, pp)] = ParallelGrid(tp=tp, cp=cp, pp=pp)
    return _GRIDS[(tp, cp, pp)]


def packed_batch(config, b: int = 2, seed: int = 0):
    """Tokens, labels, and an EOD-reset mask (True = masked) with matching position ids."""
    g = torch.Generator().manual_seed(seed)
    s = config.seq_length
    tokens = torch.randint(0, config.vocab_size, (b, s), generator=g)
    labels = torch.randint(0, config.vocab_size, (b, s), generator=g)
    doc = torch.zeros(b, s, dtype=torch.long)
    doc[0, s // 3:] += 1
    doc[0, 2 * s // 3 + 5:] += 1
    doc[1, s // 2 - 3:] += 1
    starts = torch.stack([torch.searchsorted(doc[i], doc[i], right=False) for i in range(b)])
    position_ids = torch.arange(s).expand(b, s) - starts
    mask = (doc[:, :, None] != doc[:, None, :]) | torch.ones(s, s, dtype=torch.bool).triu(1)
    return tokens, labels, position_ids, mask.unsqueeze(1)


def reference(config, tokens, labels, position_ids=None, mask=None):
    """Single-process logits, per-token loss and full grads by global parameter name."""
    model = GPTModel(config)
    logits = model(tokens, position_ids=position_ids, attention_mask=mask).detach()
    loss = model(tokens, position_ids=position_ids, labels=labels, attention_mask=mask)
    loss.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits, loss.detach(), grads


def _full_grad(param, grid, sequence_parallel: bool) -> torch.Tensor:
    """Sum a local grad over CP (and TP for SP-replicated weights), then gather TP shards."""
    g = param.grad.clone()
    if grid.size("cp") > 1:
        dist.all_reduce(g, group=grid.group("cp"))
    spec = param.shard_spec
    if spec.dim is None:
        if sequence_parallel and grid.size("tp") > 1:
            dist.all_reduce(g, group=grid.group("tp"))
        return g
    pieces = [torch.empty_like(g) for _ in range(grid.size("tp"))]
    if grid.size("tp") > 1:
        dist.all_gather(pieces, g.contiguous(), group=grid.group("tp"))
    else:
        pieces = [g]
    return unshard(pieces, spec)


def _gather_vocab(logits, grid):
    """Local vocab slices [b, s, V/t] -> [b, s, V]."""
    if grid.size("tp") == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(grid.size("tp"))]
    dist.all_gather(parts, logits.contiguous(), group=grid.group("tp"))
    return torch.cat(parts, dim=-1)


def _max_grad_gap(models, grid, ref_grads, sequence_parallel) -> float:
    """Largest |grad - reference grad| over this rank's parameters (tied copies summed)."""
    gap = 0.0
    for model in models:
        for name, p in model.named_parameters():
            full_name = global_parameter_name(name, model.layer_offset)
            full = _full_grad(p, grid, sequence_parallel)
            if full_name == "output_layer.weight" and model.config.tie_embeddings:
                # Tied across stages: the embedding group sums the two copies' grads.
                group = grid.group("embd")
                if grid.size("embd") > 1:
                    dist.all_reduce(full, group=group)
                full_name = "embedding.word_embeddings.weight"
            elif full_name == "embedding.word_embeddings.weight" and grid.size("embd") > 1 \
                    and model.config.tie_embeddings and not model.post_process:
                dist.all_reduce(full, group=grid.group("embd"))
            gap = max(gap, float((full - ref_grads[full_name]).abs().max()))
    return gap


def layout_parity(tp: int, cp: int, sequence_parallel: bool, packed: bool, seed: int = 0) -> dict:
    """Logits, loss and grads of a TP/CP layout vs the single-process model on the same batch."""
    config = tiny_config(sequence_parallel=sequence_parallel)
    tokens, labels, pos, mask = packed_batch(config, seed=seed)
    pos, mask = (pos, mask) if packed else (None, None)
    ref_logits, ref_loss, ref_grads = reference(config, tokens, labels, pos, mask)
    grid = _grid(tp=tp, cp=cp)
    idx = cp_positions(config.seq_length, cp, grid.rank("cp"))
    local = lambda t: None if t is None else t[:, idx]  # noqa: E731
    mask_local = None if mask is None else mask[:, :, idx, :]
    model = GPTModel(config, grid)
    logits = model(local(tokens), position_ids=local(pos), attention_mask=mask_local).detach()
    loss = model(local(tokens), position_ids=local(pos), labels=local(labels),
                 attention_mask=mask_local)
    loss.sum().backward()
    return {
        "logits_gap": float((_gather_vocab(logits, grid) - ref_logits[:, idx]).abs().max()),
        "loss_gap": float((loss.detach() - ref_loss[:, idx]).abs().max()),
        "grad_gap": _max_grad_gap([model], grid, ref_grads, sequence_parallel),
        "num_params": sum(p.numel() for p in model.parameters()),
        "expected_params": count_parameters_per_rank(config, tp=tp),
    }


def run_pipeline(models, grid, tokens, labels, shape):
    """All chunks forward then backward, one micro-batch, with p2p between ranks; the loss."""
    inputs, outputs, loss = [], [], None
    for model in models:  # chunk k of stage 0, of stage 1, then chunk k+1 ...
        recv = None
        if not model.pre_process:  # from the previous rank, wrapping around for chunk k > 0
            recv, _ = communicate(grid, recv_prev_shape=shape)
            model.set_input_tensor(recv)
        out = model(tokens if model.pre_process else None,
                    labels=labels if model.post_process else None)
        inputs.append(recv)
        outputs.append(out)
        if model.post_process:
            loss = out
        else:
            communicate(grid, send_next=out)
    for k in reversed(range(len(models))):
        if models[k].post_process:
            outputs[k].sum().backward()
        else:
            _, grad = communicate(grid, recv_next_shape=outputs[k].shape)
            outputs[k].backward(grad)
        if inputs[k] is not None:
            communicate(grid, send_prev=inputs[k].grad)
    return loss


def pipeline_parity(tp: int, sequence_parallel: bool, num_layers: int = 2,
                    num_virtual_stages: int = 1, tie: bool = True) -> dict:
    """A PP2 split (optionally with virtual stages) with appendix A's p2p vs the unsplit model."""
    config = tiny_config(sequence_parallel=sequence_parallel, num_layers=num_layers,
                         tie_embeddings=tie)
    tokens, labels, _, _ = packed_batch(config, seed=1)
    ref_logits, ref_loss, ref_grads = reference(config, tokens, labels)
    grid = _grid(tp=tp, pp=2)
    models = build_stage_models(config, grid, num_virtual_stages=num_virtual_stages)
    rank, pp = grid.rank("pp"), grid.size("pp")
    loss = run_pipeline(models, grid, tokens, labels,
                        stage_tensor_shape(config, grid, tokens.shape[0]))
    result = {
        "grad_gap": _max_grad_gap(models, grid, ref_grads, sequence_parallel),
        "num_params": sum(p.numel() for m in models for p in m.parameters()),
        "expected_params": count_parameters_per_rank(config, tp=tp, pp=pp, pp_rank=rank,
                                                     num_virtual_stages=num_virtual_stages),
        "shared": [(n, getattr(p, "shared", False), getattr(p, "shared_embedding", False))
                   for m in models for n, p in m.named_parameters() if "embedding" in n
                   or "output_layer" in n],
    }
    if loss is not None:
        result["loss_gap"] = float((loss.detach() - ref_loss).abs().max())
    return result


def dropout_consistency(tp: int, sequence_parallel: bool) -> dict:
    """With dropout on, both TP ranks must still compute one loss (replicated draws agree)."""
    from tinytron.parallel.rng import RNGStatesTracker, model_parallel_seed

    config = tiny_config(sequence_parallel=sequence_parallel, dropout=0.2)
    tokens, labels, _, _ = packed_batch(config, seed=2)
    grid = _grid(tp=tp)
    tracker = model_parallel_seed(1234, grid, tracker=RNGStatesTracker("cpu"))
    model = GPTModel(config, grid, rng_tracker=tracker)
    train_loss = model(tokens, labels=labels).detach()
    model.eval()
    eval_loss = model(tokens, labels=labels).detach()
    plain = GPTModel(config.replace(dropout=0.0), grid)(tokens, labels=labels).detach()
    peers = [torch.empty_like(train_loss) for _ in range(tp)]
    dist.all_gather(peers, train_loss, group=grid.group("tp"))
    model.train()
    # The loss is all-reduced over TP, so equal losses alone would hide differing masks. Compare
    # what each rank really computed: the decoder output (replicated when SP is off) and the
    # embedding-dropout mask (one stream for all TP ranks without SP; a per-rank stream with SP,
    # where each rank drops its own sequence chunk).
    captured = {}
    hook = model.decoder.layers[-1].register_forward_hook(
        lambda mod, args, out: captured.__setitem__("hidden", out.detach()))
    model(tokens, labels=labels)
    hook.remove()
    mask = (model._stage_input(tokens) != 0).to(torch.uint8)
    return {"tp_ranks_agree": all(torch.equal(peers[0], p) for p in peers),
            "train_differs": not torch.allclose(train_loss, eval_loss),
            "eval_gap": float((eval_loss - plain).abs().max()),
            "decoder_outputs_agree": _same_on_all_tp_ranks(captured["hidden"], grid),
            "embedding_masks_agree": _same_on_all_tp_ranks(mask, grid),
            "dropped_fraction": float(1 - mask.float().mean())}


def _same_on_all_tp_ranks(t: torch.Tensor, grid) -> bool:
    """True when every TP rank holds a bit-identical tensor."""
    peers = [torch.empty_like(t) for _ in range(grid.size("tp"))]
    dist.all_gather(peers, t.contiguous(), group=grid.group("tp"))
    return all(torch.equal(peers[0], p) for p in peers)


def hf_roundtrip(folder: str) -> dict:
    """Export from TP2 x PP2 stages, then import into TP2: bit-identical to the one-process model."""
    from safetensors.torch import load_file

    from tinytron.model.hf import gather_full_state, load_hf_llama, save_hf_llama, to_hf_tensors
    from tinytron.model.layers import shard_of

    config = tiny_config(seed=99, tie_embeddings=True)
    save_hf_llama(build_stage_models(config, _grid(tp=2, pp=2)), folder)
    single = GPTModel(config)
    expected = {}
    for name, full in gather_full_state(single).items():
        expected.update(to_hf_tensors(config, name, full))
    written = load_file(f"{folder}/model.safetensors")
    grid = _grid(tp=2)
    model, _ = load_hf_llama(folder, grid, seq_length=config.seq_length)
    shards_equal = all(
        torch.equal(p, shard_of(q.detach(), p.shard_spec, grid.rank("tp"), 2))
        for p, q in zip(model.parameters(), single.parameters()))
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gap = float((_gather_vocab(model(tokens), grid) - single(tokens)).abs().max())
    # ... and into TP2 x PP2 stages: the pipelined loss equals the one-process loss.
    stages, _ = load_hf_llama(folder, _grid(tp=2, pp=2), seq_length=config.seq_length)
    labels = tokens.roll(-1, dims=1)
    pp_loss = run_pipeline([stages], stages.grid, tokens, labels,
                           (16, 2, config.hidden_size))
    pp_gap = 0.0 if pp_loss is None else float(
        (pp_loss.detach() - single(tokens, labels=labels).detach()).abs().max())
    return {"file_equal": set(written) == set(expected)
            and all(torch.equal(written[k], expected[k]) for k in expected),
            "shards_equal": shards_equal, "logits_gap": gap, "pp_loss_gap": pp_gap}


def all_layouts(hf_folder: str | None = None) -> dict:
    """Every parity check the model tests need, in one 4-rank world (with seconds per check)."""
    checks = {f"tp{tp}_cp{cp}_sp{int(sp)}_packed{int(pk)}": (layout_parity, tp, cp, sp, pk)
              for tp, cp, sp, pk in [(2, 1, False, False), (2, 1, True, True), (1, 2, False, True),
                                     (2, 2, True, True), (2, 2, False, False)]}
    checks["pp2"] = (pipeline_parity, 1, False)
    checks["pp2_tp2_sp"] = (pipeline_parity, 2, True, 2, 1, False)
    checks["pp2_vpp2"] = (pipeline_parity, 1, False, 4, 2)
    checks["dropout_sp0"] = (dropout_consistency, 2, False)
    checks["dropout_sp1"] = (dropout_consistency, 2, True)
    if hf_folder is not None:
        checks["hf"] = (hf_roundtrip, hf_folder)
    out, seconds = {}, {}
    for name, (fn, *args) in checks.items():
        t0 = time.perf_counter()
        out[name] = fn(*args)
        seconds[name] = round(time.perf_counter() - t0, 2)
    out["seconds"] = seconds
    return out
