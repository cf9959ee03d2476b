"""Helpers and rank functions for chapter 01's schedule pages and tests (not a page).

A case builds the tiny GPT on a (tp, pp, dp) grid, runs a few training iterations through a
schedule of `tinytron.main_loop.schedules`, and compares every loss report and every gradient
with one process running the whole global batch micro-batch by micro-batch.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from tinytron.buffers._comm import CommTimeline
from tinytron.buffers import (DistributedDataParallel, DistributedDataParallelConfig,
                              finalize_model_grads, main_grad_of)
from tinytron.main_loop.schedules import (ScheduleConfig, ScheduleRecorder, _unwrap,
                                          get_forward_backward_func)
from tinytron.model.config import tiny_config
from tinytron.model.gpt import GPTModel, build_stage_models, global_parameter_name
from tinytron.model.layers import unshard
from tinytron.overview.loss import lm_loss_func
from tinytron.parallel import ParallelGrid

_GRIDS: dict = {}


def grid_for(tp: int = 1, pp: int = 1) -> ParallelGrid:
    """One grid per layout per process (building one creates every group)."""
    if (tp, pp) not in _GRIDS:
        _GRIDS[(tp, pp)] = ParallelGrid(tp=tp, pp=pp)
    return _GRIDS[(tp, pp)]


def make_microbatches(config, num_microbatches: int, micro_batch_size: int = 1,
                      seed: int = 0) -> list[dict]:
    """Random tokens/labels; loss masks keep a different number of tokens in each micro-batch."""
    g = torch.Generator().manual_seed(seed)
    s, out = config.seq_length, []
    for i in range(num_microbatches):
        tokens = torch.randint(0, config.vocab_size, (micro_batch_size, s), generator=g)
        labels = torch.randint(0, config.vocab_size, (micro_batch_size, s), generator=g)
        keep = s - int(torch.randint(0, s // 2, (1,), generator=g))
        mask = (torch.arange(s) < keep).float().expand(micro_batch_size, s).contiguous()
        out.append({"tokens": tokens, "labels": labels, "loss_mask": mask, "id": i})
    return out


def forward_step_func(data_iterator, model):
    """Megatron-style forward_step: the first chunk reads tokens, the last computes the loss."""
    batch = next(data_iterator)
    inner = _unwrap(model)
    _CURRENT["microbatch"] = (inner.layer_offset, batch["id"])  # (which chunk, micro-batch)
    device = next(inner.parameters()).device
    out = model(batch["tokens"].to(device) if inner.pre_process else None,
                labels=batch["labels"].to(device) if inner.post_process else None)
    return out, partial(lm_loss_func, batch["loss_mask"].to(device))


def make_optimizer(params, kind: str = "adamw"):
    """The optimizer both sides use: AdamW (default) or SGD with momentum."""
    params = list(params)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def reference_run(config, steps: list[list[dict]], optimizer: str = "adamw") -> list[dict]:
    """One process, whole model: per step, sum-loss backward per micro-batch, / tokens, step."""
    model = GPTModel(config)
    opt = make_optimizer(model.parameters(), optimizer)
    out = []
    for batches in steps:
        opt.zero_grad(set_to_none=True)
        total, reports = torch.zeros((), dtype=torch.int), []
        for b in batches:
            loss_sum, n, report = lm_loss_func(b["loss_mask"], model(b["tokens"], labels=b["labels"]))
            loss_sum.backward()
            total += n
            reports.append(report["lm loss"])
        scale = 1.0 / torch.clamp(total.float(), min=1)  # the same op finalize_model_grads runs
        for p in model.parameters():
            p.grad.mul_(scale)
        out.append({"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                    "reports": torch.stack(reports)})
        opt.step()
    return out


def full_grads(models, grid) -> dict[str, torch.Tensor]:
    """This rank's gradients by global parameter name, TP shards gathered."""
    out = {}
    for m in models:
        inner = _unwrap(m)
        for name, p in inner.named_parameters():
            g = main_grad_of(p).detach().clone()  # on the grid's device (NCCL: CUDA)
            if grid.size("tp") > 1 and p.shard_spec.dim is not None:
                pieces = [torch.empty_like(g) for _ in range(grid.size("tp"))]
                dist.all_gather(pieces, g.contiguous(), group=grid.group("tp"))
                g = unshard(pieces, p.shard_spec)
            full = global_parameter_name(name, inner.layer_offset)
            if full == "output_layer.weight" and inner.config.tie_embeddings:
                full = "embedding.word_embeddings.weight"  # the tied copy on the last stage
            out[full] = g.cpu()
    return out


def compare(grads: dict, ref: dict) -> tuple[float, bool]:
    """(max |grad - reference|, all bitwise equal) over this rank's parameters."""
    gap = max(float((g - ref[n]).abs().max()) for n, g in grads.items())
    return gap, all(torch.equal(g, ref[n]) for n, g in grads.items())


def wrap_ddp(models, grid, overlap: bool = True, timelines=None):
    """Chapter 05's DDP around each chunk: per-token scaling, collectives from the hooks."""
    cfg = DistributedDataParallelConfig(calculate_per_token_loss=True, overlap_grad_reduce=overlap,
                                        bucket_size=20_000)
    timelines = timelines or [None] * len(models)
    return [DistributedDataParallel(m, grid, cfg, timeline=t) for m, t in zip(models, timelines)]


def _step_with_grads(models, opt):
    """A plain torch optimizer reads .grad: point it at DDP's main_grad buffers."""
    for m in models:
        for p in _unwrap(m).parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad
    opt.step()


def run_case(tp: int = 1, pp: int = 2, vpp: int | None = None, num_microbatches: int = 4,
             num_steps: int = 2, ddp: bool = False, tie: bool = False, num_layers: int = 4,
             optimizer: str = "adamw", group_size: int | None = None, seed: int = 0,
             record: bool = False, deallocate: bool = True, comm: bool = False,
             grad_sync: bool = False, p2p: dict | None = None) -> dict:
    """Train num_steps iterations through the layout's schedule; gaps against one process.

    `p2p`: ScheduleConfig's overlap_p2p_comm / batch_p2p_comm, when not the defaults."""
    grid = grid_for(tp, pp)
    dp, dp_rank = grid.size("dp"), grid.rank("dp")
    if dp > 1 and not ddp:
        raise ValueError(f"dp = {dp}: grads need chapter 05's DDP to be averaged (ddp=True)")
    config = tiny_config(num_layers=num_layers, tie_embeddings=tie)
    m = num_microbatches
    steps = [make_microbatches(config, dp * m, seed=seed + 100 * k) for k in range(num_steps)]
    ref = reference_run(config, steps, optimizer)
    models = build_stage_models(config, grid, num_virtual_stages=vpp or 1)
    opt = make_optimizer([p for c in models for p in c.parameters()], optimizer)
    timelines = [CommTimeline() for _ in models] if comm else None
    models = wrap_ddp(models, grid, timelines=timelines) if ddp else models
    fb = get_forward_backward_func(pp, vpp)
    # gaps: max |grad - reference|; loss_gaps: max relative error of the [sum, count] reports
    res = {"gaps": [], "bitwise": [], "loss_gaps": [], "orders": [], "events": [], "comm": []}
    for k, batches in enumerate(steps):
        for c in models:
            c.zero_grad_buffer() if ddp else c.zero_grad(set_to_none=True)
        rec = ScheduleRecorder() if record else None
        cfg = ScheduleConfig(finalize_model_grads_func=finalize_model_grads, recorder=rec,
                             no_sync_func=[c.no_sync for c in models] if ddp else None,
                             microbatch_group_size_per_vp_stage=group_size,
                             deallocate_pipeline_outputs=deallocate,
                             grad_sync_func=[c.start_grad_sync for c in models] if grad_sync
                             else None, **(p2p or {}))
        mine = batches[dp_rank * m:(dp_rank + 1) * m]
        iters = [iter(mine) for _ in models]
        reports = fb(forward_step_func=forward_step_func, data_iterator=iters if vpp else iters[0],
                     model=models, num_microbatches=m, seq_length=config.seq_length,
                     micro_batch_size=1, grid=grid, config=cfg)
        gap, same = compare(full_grads(models, grid), ref[k]["grads"])
        res["gaps"].append(gap)
        res["bitwise"].append(same)
        if reports:
            mine_ref = ref[k]["reports"][dp_rank * m:(dp_rank + 1) * m]
            got = torch.stack([r["lm loss"].cpu() for r in reports])  # [sum, count] pairs
            res["loss_gaps"].append(float(((got - mine_ref).abs()
                                           / mine_ref.abs().clamp(min=1)).max()))
        if rec is not None:
            res["orders"].append(rec.order())
            res["events"].append(list(rec.events))
        if timelines:  # absolute perf_counter times, comparable with the recorder's
            res["comm"].append([(c, ev, t.t0 + sec) for c, t in enumerate(timelines)
                                for ev, _, sec in t.events])
            for t in timelines:
                t.reset()
        _step_with_grads(models, opt)
    res.update(stage=grid.rank("pp"), tp_rank=grid.rank("tp"), dp_rank=dp_rank,
               num_reports=len(reports))
    return res


def timed_case(pp: int, vpp: int | None, num_microbatches: int, group_size: int | None = None,
               hidden: int = 256, num_layers: int = 4, repeats: int = 2,
               seq_length: int = 128) -> list:
    """ScheduleEvents of the last of `repeats` training iterations on this rank."""
    grid = grid_for(1, pp)
    config = tiny_config(hidden_size=hidden, ffn_hidden_size=2 * hidden, num_layers=num_layers,
                         tie_embeddings=False, seq_length=seq_length)
    models = build_stage_models(config, grid, num_virtual_stages=vpp or 1)
    batches = make_microbatches(config, num_microbatches)
    fb = get_forward_backward_func(pp, vpp)
    for _ in range(repeats):  # the first run pays one-time costs (allocator, first messages)
        rec = ScheduleRecorder()
        cfg = ScheduleConfig(recorder=rec, microbatch_group_size_per_vp_stage=group_size)
        dist.barrier()
        iters = [iter(batches) for _ in models]
        fb(forward_step_func=forward_step_func, data_iterator=iters if vpp else iters[0],
           model=models, num_microbatches=num_microbatches, seq_length=config.seq_length,
           micro_batch_size=1, grid=grid, config=cfg)
    return list(rec.events)  # perf_counter times: one clock for all processes of a machine


_CURRENT = {"microbatch": None}


class SavedByMicrobatch:
    """Which micro-batches still have a tensor saved for backward alive (autograd's own view)."""

    def __init__(self, params):
        self.params = {p.untyped_storage()._cdata for p in params}
        self.refs: list[tuple[int, StorageWeakRef]] = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        # Only tensors the forward computed (a grad_fn, not a view of a weight): parameters,
        # tokens, labels and received inputs outlive the micro-batch for other reasons.
        storage = t.untyped_storage()
        if (t.grad_fn is not None and storage._cdata not in self.params
                and _CURRENT["microbatch"] is not None):
            self.refs.append((_CURRENT["microbatch"], StorageWeakRef(storage)))
        return t

    def alive(self) -> set:
        """Micro-batch ids with at least one saved storage not yet freed."""
        self.refs = [(mb, ref) for mb, ref in self.refs if not ref.expired()]
        return {mb for mb, _ in self.refs}


class MarkingRecorder(ScheduleRecorder):
    """A recorder that stamps a LiveBytesMeter (and the saved-tensor count) after each F and B."""

    def __init__(self, meter, saved: SavedByMicrobatch | None = None):
        super().__init__()
        self.meter, self.saved, self.marks = meter, saved, []

    def record(self, stage, chunk, microbatch, kind, start, end):
        super().record(stage, chunk, microbatch, kind, start, end)
        if kind in ("forward", "backward"):
            live = self.meter.mark(f"{kind[0].upper()}{microbatch}")
            alive = len(self.saved.alive()) if self.saved is not None else None
            self.marks.append((kind, chunk, microbatch, live, alive))


def inflight_case(num_microbatches: int = 8, deallocate: bool = True, num_layers: int = 4,
                  vpp: int | None = None) -> dict:
    """Live activation bytes of this stage through one iteration, measured by LiveBytesMeter."""
    from tinytron.main_loop.memory_meter import LiveBytesMeter

    grid = grid_for(1, dist.get_world_size())
    config = tiny_config(num_layers=num_layers, tie_embeddings=False)
    models = build_stage_models(config, grid, num_virtual_stages=vpp or 1)
    batches = make_microbatches(config, num_microbatches)
    fb = get_forward_backward_func(grid.size("pp"), vpp)

    def run(recorder=None):
        cfg = ScheduleConfig(recorder=recorder, deallocate_pipeline_outputs=deallocate)
        iters = [iter(batches) for _ in models]
        fb(forward_step_func=forward_step_func, data_iterator=iters if vpp else iters[0],
           model=models, num_microbatches=num_microbatches, seq_length=config.seq_length,
           micro_batch_size=1, grid=grid, config=cfg)

    run()  # allocates every .grad before the meter starts: they are resident, not flowing
    saved = SavedByMicrobatch([p for c in models for p in c.parameters()])
    with LiveBytesMeter(record_every_op=False) as meter, saved.hooks:
        rec = MarkingRecorder(meter, saved)
        run(rec)
    lives = [live for _, _, _, live, _ in rec.marks]
    per_microbatch = lives[0]  # after the first forward: its input, saved tensors and output
    return {"stage": grid.rank("pp"), "pp": grid.size("pp"), "per_microbatch": per_microbatch,
            "marks": rec.marks, "peak_at_marks": max(lives),
            "max_in_flight_bytes": max(lives) / per_microbatch,
            "max_in_flight_saved": max(alive for *_, alive in rec.marks),
            "message_bytes": config.seq_length * config.hidden_size * 4}


def schedules_demo(num_microbatches: int = 8) -> dict:
    """PP2: one training step (order, parity), live bytes with and without pseudo-freeing."""
    m = num_microbatches
    return {"case": run_case(pp=2, num_microbatches=m, num_steps=1, record=True),
            "on": inflight_case(m // 2, deallocate=True, num_layers=2),  # the meter is slow:
            "off": inflight_case(m // 2, deallocate=False, num_layers=2)}  # half the steps


def interleaved_demo() -> dict:
    """PP2 x v2: Megatron's documented example (order, parity); live bytes vs plain 1F1B."""
    return {"example": run_case(pp=2, vpp=2, num_microbatches=5, group_size=3, num_steps=1,
                                record=True),
            "interleaved": inflight_case(4, vpp=2, num_layers=4),
            "1f1b": inflight_case(4, num_layers=4)}


def timeline_cases(cases: list[tuple]) -> list[list]:
    """timed_case for each (pp, vpp, m, group_size, num_layers) of this world (pp = world size)."""
    return [timed_case(pp, vpp, m, group_size=g, num_layers=layers)
            for pp, vpp, m, g, layers in cases]


def _recording_order(order: list):
    """forward_step_func that also notes F<id> at each forward and B<id> when the gradient of
    its output arrives: the start of that micro-batch's backward on this stage."""
    def step(data_iterator, model):
        batch = next(data_iterator)
        out, loss_func = forward_step_func(iter([batch]), model)
        order.append(f"F{batch['id']}")
        out.register_hook(lambda grad: order.append(f"B{batch['id']}"))
        return out, loss_func
    return step


def naive_case(num_microbatches: int = 6, num_layers: int = 4) -> dict:
    """GPipe and the bare 1F1B against the trainer's 1F1B on the same weights and batches:
    gradients, losses, the order each ran in, and the peak live bytes of the naive two."""
    from tinytron.main_loop.pipeline_orders import (forward_backward_1f1b_bare,
                                                    forward_backward_gpipe)
    from tinytron.main_loop.schedules import forward_backward_pipelining_without_interleaving

    m, grid = num_microbatches, grid_for(1, dist.get_world_size())
    config = tiny_config(num_layers=num_layers, tie_embeddings=False)
    (model,) = build_stage_models(config, grid)
    batches = make_microbatches(config, m)
    ref = reference_run(config, [batches])[0]
    shape = (config.seq_length, 1, config.hidden_size)

    def real(func):
        return forward_backward_pipelining_without_interleaving(
            forward_step_func=func, data_iterator=iter(batches), model=[model],
            num_microbatches=m, seq_length=config.seq_length, micro_batch_size=1, grid=grid,
            config=ScheduleConfig(finalize_model_grads_func=finalize_model_grads))

    runs = {"real": real,
            "gpipe": lambda func: forward_backward_gpipe(func, iter(batches), model, m, shape,
                                                         grid),
            "bare": lambda func: forward_backward_1f1b_bare(func, iter(batches), model, m,
                                                            shape, grid)}
    out = {}
    for name, run in runs.items():
        model.zero_grad(set_to_none=True)
        order: list[str] = []
        reports = run(_recording_order(order))
        grads = full_grads([model], grid)
        out[name] = {"grads": grads, "losses": [r["lm loss"] for r in reports],
                     "vs_reference": compare(grads, ref["grads"]), "order": " ".join(order)}
    from tinytron.main_loop.memory_meter import LiveBytesMeter

    peaks = {}  # grads exist by now and accumulate in place: the peaks are activations
    for name in ("gpipe", "bare"):
        with LiveBytesMeter(record_every_op=False) as meter:
            runs[name](forward_step_func)
        peaks[name] = meter.peak
    real_run = out["real"]
    return {"stage": grid.rank("pp"), "num_reports": len(real_run["losses"]), "peaks": peaks,
            **{name: {"grads_bitwise": all(torch.equal(g, real_run["grads"][n])
                                           for n, g in res["grads"].items()),
                      "losses_equal": len(res["losses"]) == len(real_run["losses"]) and all(
                          torch.equal(a, b) for a, b in zip(res["losses"], real_run["losses"])),
                      "vs_reference": res["vs_reference"], "order": res["order"]}
               for name, res in out.items()}}
