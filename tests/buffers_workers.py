"""Rank functions for tests/test_buffers*.py (spawned ranks need module-level functions)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
from tinytron.buffers import _comm as comm
from tinytron.buffers._workers import TinyNet, lm_loss, make_batches
from tinytron.parallel import ParallelGrid

LR = 0.1


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _reference_grads(ref, batches_step, dtype) -> dict:
    """Grads of the global-mean loss over every rank's micro-batches, in one process."""
    world, num_micro = batches_step.shape[:2]
    for p in ref.parameters():
        p.grad = None
    if dtype == torch.float32:  # the combined batch in one forward
        lm_loss(ref, batches_step.reshape(-1, batches_step.shape[-1])).backward()
        return {n: p.grad.clone() for n, p in ref.named_parameters()}
    acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref.named_parameters()}
    for r in range(world):  # bf16: same micro-batches, fp32 accumulation like main_grad
        for m in range(num_micro):
            (lm_loss(ref, batches_step[r, m]) / (num_micro * world)).backward()
            for n, p in ref.named_parameters():
                acc[n] += p.grad.float()
                p.grad = None
    return acc


def _sgd_reference(ref, grads) -> None:
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_((p.float() - LR * grads[n]).to(p.dtype))


def _sgd_ddp(ddp, cfg) -> None:
    """SGD on what this rank owns: its shard of each bucket (DistOpt) or every param."""
    with torch.no_grad():
        if not cfg.use_distributed_optimizer:
            for p in ddp.params_with_grad:
                p.copy_((p.float() - LR * p.main_grad).to(p.dtype))
            return
        for buf in ddp.buffers:
            for b in buf.buckets:
                ps, gs = b.param_shard(), b.grad_shard()
                for sr in b.shard_param_ranges():
                    sl = slice(sr.shard_start, sr.shard_end)
                    ps[sl] = (ps[sl].float() - LR * gs[sl]).to(ps.dtype)
        if not cfg.overlap_param_gather:
            ddp.start_param_sync()  # with overlap the next forward's pre-hooks gather


def _compare_grads(ddp, ref_grads, names, cfg) -> float:
    """Worst relative error of the synced grads this rank is responsible for."""
    worst = 0.0
    if not cfg.use_distributed_optimizer:
        for p in ddp.params_with_grad:
            worst = max(worst, _rel_err(p.main_grad, ref_grads[names[p]]))
        return worst
    for buf in ddp.buffers:
        for b in buf.buckets:
            for sr in b.shard_param_ranges():
                mine = sr.param.main_grad.reshape(-1)[sr.param_start:sr.param_end]
                ref = ref_grads[names[sr.param]].reshape(-1)[sr.param_start:sr.param_end]
                worst = max(worst, _rel_err(mine, ref))
    return worst


def _install_read_checks(ddp, ref, violations: list) -> None:
    """Pre-hooks (after DDP's) asserting each module's params already hold the new values."""
    ref_params = dict(ref.named_parameters())
    for mod_name, m in ddp.module.named_modules():
        direct = [(n, p) for n, p in m.named_parameters(recurse=False)]
        if not direct:
            continue

        def check(module, args, direct=direct, prefix=mod_name):
            for n, p in direct:
                full = f"{prefix}.{n}" if prefix else n
                if not torch.equal(p.data, ref_params[full].data):
                    violations.append(full)
        m.register_forward_pre_hook(check)


def run_case(grid, case: dict) -> dict:
    """Train ``case['steps']`` steps with DDP and the reference side by side; report errors."""
    dtype = case.get("dtype", torch.float32)
    num_micro, steps = case.get("num_micro", 2), case.get("steps", 2)
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, **case["ddp"])
    torch.manual_seed(0)
    model = TinyNet().to(device=grid.device, dtype=dtype)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, grid, cfg)
    names = {p: n for n, p in model.named_parameters()}
    violations: list = []
    if cfg.overlap_param_gather:
        if case.get("no_prehook"):  # negative control: nobody waits for the all-gather
            ddp.disable_forward_pre_hook(param_sync=False)
        _install_read_checks(ddp, ref, violations)
    batches = make_batches(1, steps, grid.size("dp"), num_micro, micro_bs=2).to(grid.device)
    r = grid.rank("dp")
    errs = []
    for step in range(steps):
        ddp.zero_grad_buffer()
        for m in range(num_micro):
            ctx = ddp.no_sync() if m < num_micro - 1 else contextlib.nullcontext()
            with ctx:
                (lm_loss(ddp, batches[step, r, m]) / num_micro).backward()
        ddp.finish_grad_sync()
        assert all(p.grad is None for p in model.parameters())
        ref_grads = _reference_grads(ref, batches[step], dtype)
        errs.append(_compare_grads(ddp, ref_grads, names, cfg))
        _sgd_ddp(ddp, cfg)
        _sgd_reference(ref, ref_grads)
    if cfg.overlap_param_gather:
        ddp.disable_forward_pre_hook()  # gathers the last update synchronously
    elif cfg.use_distributed_optimizer:
        ddp.start_param_sync(force_sync=True)
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    ref_flat = torch.cat([p.detach().float().reshape(-1) for p in ref.parameters()])
    return {"name": case["name"], "grad_err": max(errs), "param_err": _rel_err(flat, ref_flat),
            "params": flat.cpu(), "violations": violations,
            "num_buckets": sum(len(b.buckets) for b in ddp.buffers)}


def parity_cases(cases: list[dict], with_shard_check: bool = True) -> dict:
    """Rank function: every parity case on a dp-only grid, plus the shard checks."""
    grid = ParallelGrid()
    out = {"cases": []}
    for case in cases:
        comm.native_gloo_reduce_scatter = case.get("native_rs", False)
        try:
            out["cases"].append(run_case(grid, case))
        finally:
            comm.native_gloo_reduce_scatter = False
    out["per_token"] = per_token_dp(grid)
    out["broadcast_equal"] = broadcast_check(grid)
    out["qk_norm"] = qk_norm_tp_sum()
    if with_shard_check:
        for native in (False, True):
            comm.native_gloo_reduce_scatter = native
            out[f"shard_native={native}"] = shard_vs_allreduce(grid)
        comm.native_gloo_reduce_scatter = False
    return out


def shard_vs_allreduce(grid) -> dict:
    """Each rank's reduce-scatter shard equals its slice of the all-reduced (mean) buffer."""
    dp, r = grid.size("dp"), grid.rank("dp")
    torch.manual_seed(0)
    model = TinyNet().to(grid.device)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                        bucket_size=1500)
    ddp = DistributedDataParallel(model, grid, cfg)
    batches = make_batches(2, 1, dp, 1, micro_bs=2).to(grid.device)
    lm_loss(ddp, batches[0, r, 0]).backward()  # first step: nothing launched until finish
    expected = []
    for buf in ddp.buffers:
        full = buf.grad_data.clone()
        dist.all_reduce(full, group=grid.group("dp"))
        full /= dp
        expected.append([full[b.offset:b.offset + b.numel][slice(*b.shard_range())]
                         for b in buf.buckets])
    ddp.finish_grad_sync()
    worst = 0.0
    for buf, exp in zip(ddp.buffers, expected):
        for b, e in zip(buf.buckets, exp):
            worst = max(worst, (b.grad_shard() - e).abs().max().item())
    return {"max_abs_diff": worst, "num_buckets": len(ddp.buffers[0].buckets)}


def _gpt_reference(cfg, tokens, labels, mask) -> dict:
    """Single-process grads of the masked per-token mean loss, by global parameter name."""
    import dataclasses

    from tinytron.model import GPTModel

    ref = GPTModel(dataclasses.replace(cfg, sequence_parallel=False), device="cpu")
    per_token = ref(tokens, labels=labels)
    ((per_token * mask).sum() / mask.sum()).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def finalize_gpt_tp2_pp2() -> list[dict]:
    """TP2+SP x PP2 (tied embeddings): finalize_model_grads gives the single-process grads."""
    from tinytron.buffers import finalize_model_grads
    from tinytron.model import build_stage_models, global_parameter_name, shard_of, tiny_config

    grid = ParallelGrid(tp=2, pp=2)
    cfg = tiny_config(sequence_parallel=True, tie_embeddings=True, seq_length=16)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    mask = (torch.rand(2, cfg.seq_length, generator=g) > 0.25).float()
    ref_grads = _gpt_reference(cfg, tokens, labels, mask)
    chunk = build_stage_models(cfg, grid)[0]
    ddp = DistributedDataParallel(chunk, grid, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, calculate_per_token_loss=True))
    peer = grid.ranks("pp")[1 - grid.rank("pp")]
    act_shape = (cfg.seq_length // 2, 2, cfg.hidden_size)  # [s/tp, b, h] under SP
    num_tokens = torch.zeros(1)
    if grid.is_first_stage():
        out = ddp(tokens)
        dist.send(out.detach().contiguous(), dst=peer)
        grad = torch.empty(act_shape)
        dist.recv(grad, src=peer)
        out.backward(grad)
    else:
        x = torch.empty(act_shape)
        dist.recv(x, src=peer)
        x.requires_grad_()
        chunk.set_input_tensor(x)
        (ddp(labels=labels) * mask).sum().backward()  # a sum: DDP must not average
        dist.send(x.grad, dst=peer)
        num_tokens = mask.sum().reshape(1)
    tp_rank = grid.rank("tp")

    def errors():
        out = {}
        for name, p in chunk.named_parameters():
            full = global_parameter_name(name, chunk.layer_offset)
            if full == "output_layer.weight":
                full = "embedding.word_embeddings.weight"  # tied: the same single-process grad
            ref = ref_grads[full]
            if getattr(p, "tensor_model_parallel", False) or hasattr(p, "shard_spec"):
                ref = shard_of(ref, p.shard_spec, tp_rank, 2)
            out[name] = ((p.main_grad - ref).abs().max() / ref.abs().max()).item()
        return out

    before = {n: p.main_grad.clone() for n, p in chunk.named_parameters()}
    info = finalize_model_grads([ddp], grid, num_tokens=num_tokens)
    after = errors()
    sp_names = [n for n, p in chunk.named_parameters() if getattr(p, "sequence_parallel", False)]
    emb = [n for n, p in chunk.named_parameters() if getattr(p, "shared_embedding", False)]
    # before finalize: the SP norm grads are partial (only my half of the sequence)
    n_tok = info["num_tokens"].item()
    partial = {}
    for n in sp_names + emb:  # relative error had finalize only divided by the token count
        full = global_parameter_name(n, chunk.layer_offset)
        ref = ref_grads["embedding.word_embeddings.weight" if n in emb else full]
        if n in emb:
            ref = shard_of(ref, dict(chunk.named_parameters())[n].shard_spec, tp_rank, 2)
        partial[n] = ((before[n] / n_tok - ref).abs().max() / ref.abs().max()).item()
    return [{"rank": grid.global_rank, "stage": grid.rank("pp"), "errors": after,
             "sp_names": sp_names, "embedding": emb, "partial_before": partial,
             "num_tokens": n_tok, "mask_sum": mask.sum().item()}]


def per_token_dp(grid) -> dict:
    """DP ranks with different real-token counts: summed losses, finalize divides by the total."""
    from tinytron.buffers import finalize_model_grads

    from torch.nn import functional as F

    dp, r = grid.size("dp"), grid.rank("dp")
    torch.manual_seed(0)
    model = TinyNet().to(grid.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, grid, DistributedDataParallelConfig(
        calculate_per_token_loss=True, overlap_grad_reduce=True, bucket_size=1000))
    tokens = make_batches(7, 1, dp, 1, micro_bs=2)[0, :, 0].to(grid.device)  # [dp, b, s]
    lengths = torch.arange(dp) * 3 + 2  # rank r has 3r+2 real tokens per sequence
    masks = (torch.arange(tokens.shape[-1] - 1) < lengths[:, None, None]).float().to(grid.device)

    def summed(m, t, mask):
        logits = m(t[:, :-1]).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1),
                             reduction="none")
        return (ce * mask.expand(t.shape[0], -1).reshape(-1)).sum()

    summed(ddp, tokens[r], masks[r]).backward()
    info = finalize_model_grads(ddp, grid, num_tokens=masks[r].expand(2, -1).sum().reshape(1))
    total = sum(summed(ref, tokens[k], masks[k]) for k in range(dp))
    (total / masks.expand(dp, 2, -1).sum()).backward()
    err = max(_rel_err(p.main_grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    return {"err": err, "num_tokens": info["num_tokens"].item(),
            "expected_tokens": masks.expand(dp, 2, -1).sum().item()}


def broadcast_check(grid) -> bool:
    """broadcast_params makes every DP rank hold DP rank 0's (different) initial weights."""
    torch.manual_seed(100 + grid.rank("dp"))  # deliberately different on every rank
    ddp = DistributedDataParallel(TinyNet().to(grid.device), grid, DistributedDataParallelConfig(
        use_distributed_optimizer=True))
    ddp.broadcast_params()
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(grid.size("dp"))]
    dist.all_gather(gathered, flat, group=grid.group("dp"))
    return all(torch.equal(g, gathered[0]) for g in gathered)


def qk_norm_tp_sum() -> dict:
    """finalize_model_grads on a TP grid: QK-norm grads are summed over TP, others untouched."""
    from tinytron.buffers import finalize_model_grads

    grid = ParallelGrid(tp=dist.get_world_size())
    block = torch.nn.Module()
    block.q_layernorm = torch.nn.Linear(2, 1, bias=False)
    block.k_layernorm = torch.nn.Linear(2, 1, bias=False)
    block.proj = torch.nn.Linear(2, 1, bias=False)
    for i, p in enumerate(block.parameters()):
        p.grad = torch.full_like(p, float(grid.rank("tp") + 1 + 10 * i))
    finalize_model_grads([block], grid)
    return {name: p.grad.tolist() for name, p in block.named_parameters()}
