"""Small models and rank functions for the buffers chapter's demos and tests (not a page)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class TinyNet(torch.nn.Module):
    """Embedding, residual MLP blocks, a weight used twice per forward, norm, output head."""

    def __init__(self, vocab: int = 64, hidden: int = 32, ffn: int = 48, num_layers: int = 3):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.RMSNorm(hidden), torch.nn.Linear(hidden, ffn),
                                torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
            for _ in range(num_layers))
        self.shared = torch.nn.Linear(hidden, hidden, bias=False)  # applied twice, one hook call
        self.final_norm = torch.nn.RMSNorm(hidden)
        self.output = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, vocab] for tokens [b, s]."""
        x = self.embedding(tokens)
        for block in self.blocks:
            x = x + block(x)
        x = x + self.shared(torch.tanh(self.shared(x)))
        return self.output(self.final_norm(x))


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32) of ``model`` on ``tokens``."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def make_batches(seed: int, num_steps: int, world: int, num_micro: int, micro_bs: int,
                 seq: int = 9, vocab: int = 64) -> torch.Tensor:
    """Token ids [step, dp rank, micro-batch, b, s], identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num_steps, world, num_micro, micro_bs, seq), generator=g)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def _demo_data(V: int = 12, h: int = 6, s: int = 8):
    """The finalize demo's inputs (same on every rank): table, gain, tokens, labels, mask."""
    g = torch.Generator().manual_seed(0)
    return dict(table=torch.randn(V, h, generator=g) * 0.5,
                gain=1 + 0.1 * torch.randn(h, generator=g), x=torch.randn(s, h, generator=g),
                tokens=torch.randint(0, V, (s,), generator=g),
                labels=torch.randint(0, V, (s,), generator=g),
                mask=(torch.arange(s) < 6).float())  # 6 real tokens, 2 padding


def _demo_loss_terms(d, emb_out, out_table, gain, rows):
    """Summed per-token loss: tied-embedding LM term + a norm term on sequence ``rows``."""
    logits = emb_out @ out_table.t()
    ce = F.cross_entropy(logits, d["labels"], reduction="none")
    norm_term = (_rms(d["x"][rows]) * gain).sum(-1)
    return (d["mask"] * ce).sum() + (d["mask"][rows] * norm_term).sum()


def finalize_reference() -> dict:
    """Single-process grads of the per-token mean loss (one table used twice, full sequence)."""
    d = _demo_data()
    table = d["table"].clone().requires_grad_()
    gain = d["gain"].clone().requires_grad_()
    s = d["x"].shape[0]
    loss = _demo_loss_terms(d, table[d["tokens"]], table, gain, slice(0, s)) / d["mask"].sum()
    loss.backward()
    return {"table": table.grad, "gain": gain.grad}


def finalize_demo() -> dict:
    """TP2 x PP2 world: tied table split over 2 stages, SP norm on the last stage, token count."""
    import torch.distributed as dist

    from tinytron.buffers.finalize_model_grads import finalize_model_grads
    from tinytron.parallel import ParallelGrid

    grid = ParallelGrid(tp=2, pp=2)
    tp_rank, stage = grid.rank("tp"), grid.rank("pp")
    d = _demo_data()
    s = d["x"].shape[0]
    peer = grid.ranks("pp")[1 - stage]
    chunk = torch.nn.Module()
    chunk.word = torch.nn.Parameter(d["table"].clone())
    chunk.word.shared_embedding = True
    if stage == 0:
        h0 = chunk.word[d["tokens"]]
        dist.send(h0.detach().contiguous(), dst=peer)
        grad = torch.empty_like(h0)
        dist.recv(grad, src=peer)
        h0.backward(grad)
        num_tokens = torch.zeros(1)  # filled by the broadcast from the last stage
    else:
        chunk.word.shared = True  # the last-stage copy: not counted twice in the grad norm
        chunk.gain = torch.nn.Parameter(d["gain"].clone())
        chunk.gain.sequence_parallel = True
        h = torch.empty(s, d["table"].shape[1])
        dist.recv(h, src=peer)
        h.requires_grad_()
        rows = slice(tp_rank * s // 2, (tp_rank + 1) * s // 2)  # my sequence-parallel slice
        _demo_loss_terms(d, h, chunk.word, chunk.gain, rows).backward()
        dist.send(h.grad, dst=peer)
        num_tokens = d["mask"].sum().reshape(1)
    before = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    info = finalize_model_grads([chunk], grid, num_tokens=num_tokens)
    return {"stage": stage, "tp_rank": tp_rank, "before": before,
            "after": {n: p.grad.clone() for n, p in chunk.named_parameters()},
            "num_tokens": info["num_tokens"].item(), "tp_reduced": info["tp_reduced_params"]}


def timeline_case(overlap: bool, bucket_size: int = 200_000, hidden: int = 256, ffn: int = 1024,
                  num_layers: int = 6, micro_bs: int = 8, seq: int = 64) -> dict:
    """DP world: record the second step's backward (grad arrivals, collectives) on every rank."""
    from tinytron.buffers._comm import CommTimeline
    from tinytron.buffers.distributed_data_parallel import (DistributedDataParallel,
                                                            DistributedDataParallelConfig)
    from tinytron.parallel import ParallelGrid

    grid = ParallelGrid()
    torch.manual_seed(0)
    timeline = CommTimeline()
    cfg = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=bucket_size,
                                        use_distributed_optimizer=True)
    ddp = DistributedDataParallel(TinyNet(256, hidden, ffn, num_layers), grid, cfg,
                                  timeline=timeline)
    batches = make_batches(3, 2, grid.size("dp"), 1, micro_bs, seq=seq, vocab=256)
    for step in range(2):  # step 0 records the golden counts; step 1 launches from the hooks
        ddp.zero_grad_buffer()
        loss = lm_loss(ddp, batches[step, grid.rank("dp"), 0])
        timeline.reset()
        loss.backward()
        timeline.record("backward_end", -1)
        ddp.finish_grad_sync()
        timeline.record("synced", -1)
    sizes = [b.numel for buf in ddp.buffers for b in buf.buckets]
    return {"events": list(timeline.events), "bucket_numels": sizes, "overlap": overlap}


def timeline_runs(overlaps=(False, True), **kwargs) -> list[dict]:
    """Rank function: ``timeline_case`` for each overlap setting, in one world."""
    return [timeline_case(o, **kwargs) for o in overlaps]


def param_gather_case(hidden: int = 256, ffn: int = 1024, num_layers: int = 6,
                      bucket_size: int = 200_000, micro_bs: int = 8, seq: int = 64) -> dict:
    """DP world, distributed optimizer + overlap_param_gather: record the forward after a step."""
    from tinytron.buffers._comm import CommTimeline
    from tinytron.buffers.distributed_data_parallel import (DistributedDataParallel,
                                                            DistributedDataParallelConfig)
    from tinytron.parallel import ParallelGrid

    grid = ParallelGrid()
    torch.manual_seed(0)
    timeline = CommTimeline()
    cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=bucket_size,
                                        use_distributed_optimizer=True, overlap_param_gather=True)
    ddp = DistributedDataParallel(TinyNet(256, hidden, ffn, num_layers), grid, cfg,
                                  timeline=timeline)
    stale_reads = []

    def on_forward(module, args):  # runs after DDP's pre-hook on the same module
        for p in module.parameters(recurse=False):
            group = ddp.param_to_bucket_group[p]
            timeline.record("forward", group.buckets[0].bucket_id)
            if group.param_gather_handle is not None or not group.param_gather_dispatched:
                stale_reads.append(group.buckets[0].bucket_id)
    for m in ddp.module.modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.register_forward_pre_hook(on_forward)
    batches = make_batches(4, 2, grid.size("dp"), 1, micro_bs, seq=seq, vocab=256)
    r = grid.rank("dp")
    ddp.zero_grad_buffer()
    lm_loss(ddp, batches[0, r, 0]).backward()
    ddp.finish_grad_sync()
    with torch.no_grad():  # an SGD "optimizer step" on my shard of every bucket
        for buf in ddp.buffers:
            for b in buf.buckets:
                b.param_shard().add_(b.grad_shard(), alpha=-0.1)
    timeline.reset()
    lm_loss(ddp, batches[1, r, 0])  # the next forward: pre-hooks gather bucket by bucket
    timeline.record("forward_end", -1)
    return {"events": list(timeline.events), "stale_reads": stale_reads,
            "num_buckets": len(ddp.bucket_groups)}


def timeline_and_gather_runs() -> dict:
    """Rank function for the timeline page: backward timelines (overlap off/on), a gathered forward."""
    off, on = timeline_runs()
    return {"off": off, "on": on, "gather": param_gather_case()}


def grad_shard_vs_mean(num_micro: int = 2, bucket_size: int = 4000, steps: int = 2) -> dict:
    """DP world, reduce-scatter: my grad shard vs the single-process mean over all ranks' data."""
    from tinytron.buffers.distributed_data_parallel import (DistributedDataParallel,
                                                            DistributedDataParallelConfig)
    from tinytron.parallel import ParallelGrid

    grid = ParallelGrid()
    world, rank = grid.size("dp"), grid.rank("dp")
    torch.manual_seed(0)
    net, ref = TinyNet(), TinyNet()
    ref.load_state_dict(net.state_dict())
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                        overlap_grad_reduce=True, bucket_size=bucket_size)
    ddp = DistributedDataParallel(net, grid, cfg)
    batches = make_batches(5, steps, world, num_micro, micro_bs=2)
    for step in range(steps):  # step 0 learns the golden counts, step 1 launches from the hooks
        ddp.zero_grad_buffer()
        ref.zero_grad()
        for m in range(num_micro):
            last = m == num_micro - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                (lm_loss(ddp, batches[step, rank, m]) / num_micro).backward()
            for r in range(world):  # one process, every rank's data: the mean to match
                (lm_loss(ref, batches[step, r, m]) / (num_micro * world)).backward()
        ddp.finish_grad_sync()
    ref_of = dict(zip(net.parameters(), ref.parameters()))
    worst, owned = 0.0, 0
    for bucket in ddp.buffers[0].buckets:
        shard = bucket.grad_shard()
        for piece in bucket.shard_param_ranges():
            mine = shard[piece.shard_start:piece.shard_end]
            want = ref_of[piece.param].grad.reshape(-1)[piece.param_start:piece.param_end]
            worst = max(worst, float((mine - want).abs().max()))
            owned += piece.param_end - piece.param_start
    return {"rank": rank, "num_buckets": len(ddp.buffers[0].buckets), "owned": owned,
            "total": sum(p.numel() for p in net.parameters()), "max_abs_diff": worst,
            "shard_size": ddp.buffers[0].buckets[0].shard_size}
