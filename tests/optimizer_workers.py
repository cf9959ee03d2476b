"""Rank functions for the chapter 02 multi-rank tests: many checks per world launch."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
from tinytron.optimizer import _workers
from tinytron.optimizer.algorithms import SGD
from tinytron.optimizer.mixed_precision import MixedPrecisionOptimizer, get_grad_norm_fp32, grads_for_norm
from tinytron.optimizer.muon import Muon, newton_schulz, orthogonalize_tp
from tinytron.parallel import ParallelGrid

# name: (shape, stage, partition_dim or None, flags); "emb" is tied with "out" on the last stage.
_PARAMS = {
    "emb": ((10, 6), 0, 0, {"shared_embedding": True}),
    "w1": ((8, 6), 0, 0, {}),
    "b1": ((8,), 0, 0, {}),
    "norm": ((6,), 0, None, {"sequence_parallel": True}),
    "w2": ((6, 8), 1, 1, {}),
    "b2": ((6,), 1, None, {}),
    "final_norm": ((6,), 1, None, {}),
}


def _full_grads() -> dict:
    """The same random full gradients on every rank."""
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(shape, generator=g) for n, (shape, *_rest) in _PARAMS.items()}


def _reference_norm(full: dict) -> float:
    """Norm one process holding the whole (untied-once) model would compute."""
    return math.sqrt(sum(float(t.pow(2).sum()) for t in full.values()))


def _local_params(grid, full: dict) -> list[torch.nn.Parameter]:
    """This rank's (TP-sharded, stage-local) params with their grads and Megatron flags."""
    tp, tp_rank = grid.size("tp"), grid.rank("tp")
    pp, stage = grid.size("pp"), grid.rank("pp")
    out = []
    for name, (shape, st, pdim, flags) in _PARAMS.items():
        if (st if pp > 1 else 0) != stage:
            continue
        grad = full[name] if pdim is None else full[name].chunk(tp, dim=pdim)[tp_rank]
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        if pdim is not None:
            p.tensor_model_parallel, p.partition_dim = True, pdim
        for k, v in flags.items():
            setattr(p, k, v)
        out.append(p)
    if grid.is_last_stage():   # the output layer's copy of the tied embedding
        out_w = torch.nn.Parameter(torch.zeros(full["emb"].chunk(tp, 0)[tp_rank].shape))
        out_w.grad = full["emb"].chunk(tp, 0)[tp_rank].clone()
        out_w.tensor_model_parallel, out_w.partition_dim = True, 0
        out_w.shared_embedding = True
        if grid.size("pp") > 1:
            out_w.shared = True            # the first stage's copy is the one counted
            out.append(out_w)
    return out


def clip_norm_layouts(layouts: list[tuple[int, int]]) -> list[dict]:
    """For each (tp, pp): plain-optimizer norm, DistOpt-style norm, clipped norm vs one process."""
    full = _full_grads()
    ref = _reference_norm(full)
    results = []
    for tp, pp in layouts:
        grid = ParallelGrid(tp=tp, pp=pp)
        params = _local_params(grid, full)
        opt = MixedPrecisionOptimizer(SGD(params, lr=0.1, momentum=0.0), clip_grad=ref / 2, grid=grid)
        opt.copy_model_grads_to_main_grads()
        plain = opt.get_grad_norm()
        # distributed-optimizer style: each DP rank keeps a disjoint chunk, reduce over the world
        dp, dp_rank = grid.size("dp"), grid.rank("dp")
        chunks = []
        for p in params:
            piece = torch.nn.Parameter(p.detach().view(-1).chunk(dp)[dp_rank].clone()) \
                if p.numel() >= dp else torch.nn.Parameter(torch.zeros(0))
            piece.grad = p.grad.view(-1).chunk(dp)[dp_rank].clone() if p.numel() >= dp else \
                torch.zeros(0)
            for k in ("tensor_model_parallel", "shared"):
                if hasattr(p, k):
                    setattr(piece, k, getattr(p, k))
            chunks.append(piece)
        sharded = get_grad_norm_fp32(grads_for_norm(chunks, grid.rank("tp")), 2.0, None)
        opt.clip_grad_norm(ref / 2)
        clipped = opt.get_grad_norm()
        results.append(dict(tp=tp, pp=pp, dp=dp, ref=ref, plain=plain, sharded=sharded,
                            clipped=clipped, target=ref / 2))
    return results


def muon_tp_modes() -> dict:
    """TP=2: duplicated == distributed == my chunk of full NS; blockwise differs; Muon step agrees."""
    grid = ParallelGrid(tp=dist.get_world_size())
    tp, r = grid.size("tp"), grid.rank("tp")
    g = torch.Generator().manual_seed(3)
    full = torch.randn(16, 12, generator=g)
    out = {}
    for pdim in (0, 1):
        mine = full.chunk(tp, dim=pdim)[r]
        kw = dict(tp_group=grid.group("tp"), partition_dim=pdim, scale_mode="spectral")
        dup = orthogonalize_tp(mine, tp_mode="duplicated", **kw)
        dis = orthogonalize_tp(mine, tp_mode="distributed", **kw)
        blk = orthogonalize_tp(mine, tp_mode="blockwise", **kw)
        ref = (newton_schulz(full) * math.sqrt(16)).chunk(tp, dim=pdim)[r]
        out[pdim] = dict(dup_vs_ref=(dup - ref).abs().max().item(),
                         dis_vs_ref=(dis - ref).abs().max().item(),
                         blk_vs_ref=(blk - ref).abs().max().item())
    # a Muon step on a column-parallel shard in duplicated mode == my chunk of the full step
    w_full = torch.randn(16, 12, generator=g)
    shard = torch.nn.Parameter(w_full.chunk(tp, 0)[r].clone())
    shard.tensor_model_parallel, shard.partition_dim = True, 0
    shard.grad = full.chunk(tp, 0)[r].clone()
    Muon([shard], lr=0.1, tp_mode="duplicated", tp_group=grid.group("tp"),
         fp32_matmul_prec="highest").step()
    whole = torch.nn.Parameter(w_full.clone())
    whole.grad = full.clone()
    Muon([whole], lr=0.1, fp32_matmul_prec="highest").step()
    out["step_diff"] = (shard.detach() - whole.detach().chunk(tp, 0)[r]).abs().max().item()
    return out


def gpt_distopt_tp_dp(steps: int = 3, clip: float = 0.3) -> dict:
    """Appendix B's GPT at TP=2 x DP=2 with the DistributedOptimizer vs one process, plain AdamW."""
    from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
    from tinytron.model import GPTModel, tiny_config
    from tinytron.model.layers import unshard
    from tinytron.optimizer.algorithms import AdamW, build_param_groups
    from tinytron.optimizer.distributed import DistributedOptimizer

    config = tiny_config(seq_length=16)
    grid = ParallelGrid(tp=2)
    dp, dp_rank = grid.size("dp"), grid.rank("dp")
    model, ref = GPTModel(config, grid), GPTModel(config)

    def adamw(m):
        return AdamW(build_param_groups(m.named_parameters(), lr=3e-3, weight_decay=0.1), lr=3e-3)

    ddp = DistributedDataParallel(model, grid, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    opt = DistributedOptimizer(adamw(model), ddp, clip_grad=clip)
    ref_opt = MixedPrecisionOptimizer(adamw(ref), clip_grad=clip)
    norms = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, config.vocab_size, (4, 16), generator=g)
        labels = torch.randint(0, config.vocab_size, (4, 16), generator=g)
        ddp.zero_grad_buffer()
        ddp(tokens.chunk(dp)[dp_rank], labels=labels.chunk(dp)[dp_rank]).mean().backward()
        ddp.finish_grad_sync()
        _, norm, _ = opt.step()
        ref(tokens, labels=labels).mean().backward()
        _, ref_norm, _ = ref_opt.step()
        ref_opt.zero_grad()
        norms.append((norm, ref_norm))
    ref_params = dict(ref.named_parameters())
    gap = 0.0
    for name, p in model.named_parameters():
        pieces = [torch.empty_like(p) for _ in range(2)]
        dist.all_gather(pieces, p.detach().contiguous(), group=grid.group("tp"))
        full = unshard(pieces, p.shard_spec)
        gap = max(gap, (full - ref_params[name].detach()).abs().max().item())
    return dict(norms=norms, max_param_diff=gap)


class _CopyingDistributedOptimizer(_workers.DistributedOptimizer):
    """The DistributedOptimizer with a separate fp32 copy even for fp32 params (the old layout)."""

    def _build_main_params(self) -> None:
        super()._build_main_params()
        for i, (p, main) in enumerate(self.pairs):
            copy = torch.nn.Parameter(main.detach().clone())
            for group in self.optimizer.param_groups:
                group["params"] = [copy if q is main else q for q in group["params"]]
            self.pairs[i] = (p, copy)


def _owns_no_storage(opt) -> bool:
    """Every fp32 master piece is the param buffer's own memory at the piece's range."""
    return all(main.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr()
               and main.data_ptr() == buf.param_data[piece.buffer_start:].data_ptr()
               for (_, main), (piece, buf) in zip(opt.pairs, opt.pieces))


def fp32_shard_views(steps: int = 5) -> dict:
    """fp32 params: the DistributedOptimizer's masters are views, and train as the copies did."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = ParallelGrid(dp=world)
    runs = {}
    for name, cls in (("views", _workers.DistributedOptimizer),
                      ("copies", _CopyingDistributedOptimizer)):
        model = _workers.small_mlp(torch.float32)
        cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=300,
                                            use_distributed_optimizer=True)
        ddp = DistributedDataParallel(model, grid, cfg)
        opt = cls(_workers._adamw(model), ddp, clip_grad=0.5)
        losses, norms = [], []
        for step in range(steps):
            x, y = _workers.batch(step, 4 * world)
            loss, ok, norm = _workers.data_parallel_step(
                ddp, opt, [(x.chunk(world)[rank], y.chunk(world)[rank])],
                lambda m, b: F.mse_loss(m(b[0]), b[1]))
            losses.append(float(loss)), norms.append(norm)
        runs[name] = dict(no_storage=_owns_no_storage(opt), pieces=len(opt.pairs),
                          losses=losses, norms=norms,
                          params=[p.detach().clone() for p in model.parameters()],
                          state=opt.state_dict())
    v, c = runs["views"], runs["copies"]
    return dict(views_no_storage=v["no_storage"], copies_no_storage=c["no_storage"],
                pieces=v["pieces"], losses=v["losses"], ref_losses=c["losses"],
                norms=v["norms"], ref_norms=c["norms"],
                params_equal=all(torch.equal(a, b) for a, b in zip(v["params"], c["params"])),
                state_diff=_workers._max_diff(v["state"], c["state"]))


def world_checks(dp_parity: bool = True) -> dict:
    """Everything one world checks: DistOpt parity (fp32, bf16), clip layouts, Muon TP, layer-wise."""
    world = dist.get_world_size()
    out = {}
    out["fp32"] = _workers.distopt_parity("float32", 6, 0.5, True, (2,))
    # bf16 with the param all-gather deferred to the forward pre-hooks (overlap_param_gather)
    out["bf16"] = _workers.distopt_parity("bfloat16", 6, 0.5, False, (), overlap_param_gather=True)
    layouts = [(2, 1), (1, 2), (1, 1)] if world == 2 else [(2, 1), (1, 2), (2, 2), (4, 1)]
    out["clip"] = clip_norm_layouts(layouts)
    if world == 2:
        out["muon_tp"] = muon_tp_modes()
        out["fp32_views"] = fp32_shard_views()
    else:
        out["gpt_tp2_dp2"] = gpt_distopt_tp_dp()
    out["layer_wise"] = _workers.layer_wise_parity(4)
    return out
