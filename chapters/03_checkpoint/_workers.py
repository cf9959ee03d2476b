"""A small real training run (tiny GPT, DDP, DistributedOptimizer, scheduler, sampler, dropout)
for the checkpoint demos and tests, and the rank functions that save, reload and compare it."""

from __future__ import annotations

import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
from tinytron.buffers.finalize_model_grads import finalize_model_grads
from tinytron.checkpoint._common import main_state
from tinytron.checkpoint.resharding import optimizer_pieces
from tinytron.checkpoint.resume import (CheckpointConfig, CheckpointManager, TrainStateFallback,
                                        _train_state_class)
from tinytron.data.samplers import MegatronPretrainingSampler
from tinytron.model import build_stage_models, tiny_config
from tinytron.model.gpt import global_parameter_name, stage_tensor_shape
from tinytron.optimizer import (OptimizerConfig, SchedulerConfig, get_megatron_optimizer,
                                get_optimizer_param_scheduler)
from tinytron.parallel import ParallelGrid
from tinytron.parallel.pipeline_p2p import communicate
from tinytron.parallel.rng import get_rng_tracker, set_random_seed

_GRIDS: dict = {}
TOTAL_SAMPLES = 4096


def grid_for(tp: int = 1, pp: int = 1, cp: int = 1) -> ParallelGrid:
    """One grid per layout per process (building one creates every group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        if (tp, pp, cp) not in _GRIDS:
            _GRIDS[(tp, pp, cp)] = ParallelGrid(tp=tp, pp=pp, cp=cp)
        return _GRIDS[(tp, pp, cp)]
    return ParallelGrid.single()


def sample(index: int, seq: int, vocab: int) -> torch.Tensor:
    """Sample `index` of a deterministic dataset: seq + 1 tokens."""
    g = torch.Generator().manual_seed(10_000 + index)
    return torch.randint(0, vocab, (seq + 1,), generator=g)


class Run:
    """The tiny GPT on one layout, trained step by step with the real chapter parts."""

    # With virtual stages (vpp > 1), context parallelism (cp > 1) or scheduled=True a step is
    # chapter 01's train_step over chapter 04's get_batch (the trainer's path); otherwise the
    # hand-written pipeline below. `models`: the DDP-wrapped chunks, what a checkpoint saves.
    def __init__(self, tp: int = 1, pp: int = 1, cp: int = 1, vpp: int = 1, *,
                 distopt: bool = True, scheduled: bool = False, seed: int = 1234,
                 lr: float = 3e-3, mbs: int = 2, gbs: int = 8, train_iters: int = 20,
                 dropout: float = 0.1, config=None, bf16: bool = False):
        self.grid = grid = grid_for(tp, pp, cp)
        set_random_seed(seed, grid)
        # h = 48: 48-element rows against 64-aligned DP ranges, so DP shards cut rows
        self.config = config or tiny_config(num_layers=4, seq_length=32, hidden_size=48,
                                            ffn_hidden_size=96, dropout=dropout)
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        chunks = build_stage_models(self.config, grid, num_virtual_stages=vpp, dtype=self.dtype)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=6000,
                                                use_distributed_optimizer=distopt)
        # as chapter 01's wrap_with_ddp: one DDP per chunk, only the first one bucketed
        self.models = [DistributedDataParallel(c, grid, ddp_cfg, disable_bucketing=i > 0)
                       for i, c in enumerate(chunks)]
        self.model, self.ddp, self.vpp = chunks[0], self.models[0], vpp
        self.scheduled = scheduled or vpp > 1 or cp > 1
        opt_cfg = OptimizerConfig(lr=lr, min_lr=lr / 10, weight_decay=0.1, clip_grad=1.0,
                                  use_distributed_optimizer=distopt, bf16=bf16)
        if vpp > 1:   # one optimizer over all chunks (and all their buffers), as the trainer's
            self.optimizer = get_megatron_optimizer(opt_cfg, torch.nn.ModuleList(chunks), grid,
                                                    self.models)
        else:
            self.optimizer = get_megatron_optimizer(opt_cfg, self.model, grid, self.ddp)
        self.scheduler = get_optimizer_param_scheduler(
            SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=2), self.optimizer, opt_cfg,
            train_iters, gbs)
        self.state = _train_state_class()()
        self.mbs, self.gbs, self.dp = mbs, gbs, grid.size("dp")

    def _batch(self, indices):
        rows = torch.stack([sample(i, self.config.seq_length, self.config.vocab_size)
                            for i in indices])
        return rows[:, :-1], rows[:, 1:]

    def _microbatch(self, tokens, labels, scale: float):
        """Forward + backward of one micro-batch through this rank's stage; its mean loss or None."""
        model, grid = self.model, self.grid
        recv, loss = None, None
        if not model.pre_process:
            recv, _ = communicate(grid, recv_prev_shape=stage_tensor_shape(self.config, grid,
                                                                           self.mbs),
                                  dtype=self.dtype)
            model.set_input_tensor(recv)
        out = model(tokens if model.pre_process else None,
                    labels=labels if model.post_process else None)
        if model.post_process:
            loss = out.mean()
            self.optimizer.scale_loss(loss * scale).backward()
        else:
            communicate(grid, send_next=out)
            _, grad = communicate(grid, recv_next_shape=tuple(out.shape), dtype=self.dtype)
            out.backward(grad)
        if recv is not None:
            communicate(grid, send_prev=recv.grad)
        return None if loss is None else loss.detach()

    def _iterator(self):
        """This DP rank's micro-batches of the step as get_batch reads them (chapter 04's keys)."""
        seq = self.config.seq_length
        sampler = MegatronPretrainingSampler(TOTAL_SAMPLES, self.state.consumed_train_samples,
                                             self.mbs, self.grid.rank("dp"), self.dp)
        for indices in sampler:
            tokens, labels = self._batch(indices)
            yield {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(tokens.shape),
                   "position_ids": torch.arange(seq).expand(len(indices), seq)}

    def _scheduled_step(self) -> float:
        """One iteration through chapter 01's train_step and schedule; the global mean loss."""
        from functools import partial

        from tinytron.main_loop.loop import build_schedule_config, gpt_forward_step, train_step
        from tinytron.main_loop.schedules import get_forward_backward_func

        grid, seq = self.grid, self.config.seq_length
        iters = [self._iterator() for _ in self.models]   # one per chunk, as the trainer's
        result = train_step(
            partial(gpt_forward_step, micro_batch_size=self.mbs, seq_length=seq),
            iters if self.vpp > 1 else iters[0], self.models, self.optimizer, self.scheduler,
            get_forward_backward_func(grid.size("pp"), self.vpp if self.vpp > 1 else None),
            num_microbatches=self.gbs // (self.mbs * self.dp), micro_batch_size=self.mbs,
            seq_length=seq, grid=grid,
            config=build_schedule_config(self.models, self.optimizer, grid,
                                         pipeline_dtype=self.dtype))
        self.state.iteration += 1
        self.state.consumed_train_samples += self.gbs
        total = torch.zeros(1)
        if grid.is_last_stage():
            total += result.loss_dict["lm loss"].float().cpu()
        grid.all_reduce(total, "pp")
        return float(total.item())

    def step(self) -> float:
        """One training iteration; the global mean loss (on every rank)."""
        if self.scheduled:
            return self._scheduled_step()
        grid, num_micro = self.grid, self.gbs // (self.mbs * self.dp)
        sampler = MegatronPretrainingSampler(TOTAL_SAMPLES, self.state.consumed_train_samples,
                                             self.mbs, grid.rank("dp"), self.dp)
        batches = iter(sampler)
        self.ddp.zero_grad_buffer()
        total = torch.zeros(1)
        for _ in range(num_micro):
            tokens, labels = self._batch(next(batches))
            loss = self._microbatch(tokens, labels, 1.0 / num_micro)
            if loss is not None:
                total += loss / num_micro
        finalize_model_grads([self.ddp], grid)
        ok, _, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(self.gbs)
        self.state.iteration += 1
        self.state.consumed_train_samples += self.gbs
        grid.all_reduce(total, "dp")
        grid.all_reduce(total, "pp")
        return float(total.item() / self.dp)

    def snapshot(self) -> dict:
        """Local params and optimizer pieces (by global name), cloned."""
        out = {}
        for name, p in self.model.named_parameters():
            out["w." + global_parameter_name(name, self.model.layer_offset)] = p.detach().clone()
        pieces, _ = optimizer_pieces(self.optimizer)
        names = {id(p): n for n, p in self.model.named_parameters()}
        for pc in pieces:
            name = names[id(pc.model_param)]
            out[f"o.{name}.param"] = pc.main.detach().clone()
            for k, v in main_state(self.optimizer, pc.main).items():
                out[f"o.{name}.{k}"] = v.clone() if torch.is_tensor(v) else v
        out["lr"] = [g["lr"] for g in self.optimizer.param_groups]
        return out


def random_draws(grid) -> list:
    """One draw from every generator a resume restores (Python, NumPy, torch, the tracker)."""
    with get_rng_tracker(grid.device).fork():
        tracked = torch.rand(2).tolist()
    return [random.random(), float(np.random.rand()), torch.rand(2).tolist(), tracked]


def same(a: dict, b: dict) -> bool:
    """Bitwise equality of two snapshots."""
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _manager(grid, **kw) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(**kw), grid)


def resume_same_layout(root: str, tp: int, pp: int, n: int = 3, m: int = 3, **ckpt) -> dict:
    """N steps, save, M more steps (uninterrupted); rebuild, load, M steps: must be bitwise equal."""
    run = Run(tp, pp)
    manager = _manager(run.grid, save=root, load=root, **ckpt)
    before = []
    for _ in range(n):
        manager.finalize(blocking=False)
        before.append(run.step())
    manager.save(run.state, [run.ddp], run.optimizer, run.scheduler)
    losses = []
    for _ in range(m):
        manager.finalize(blocking=False)
        losses.append(run.step())
    manager.finalize(blocking=True)
    final, draws = run.snapshot(), random_draws(run.grid)
    resumed = Run(tp, pp, seed=999)   # different seed: everything must come from the checkpoint
    state = manager.load([resumed.ddp], resumed.optimizer, resumed.scheduler)
    resumed.state = state
    consumed = state.consumed_train_samples
    losses_r = [resumed.step() for _ in range(m)]
    return {"losses_before": before, "losses": losses, "losses_resumed": losses_r,
            "params_and_state": same(final, resumed.snapshot()),
            "draws": draws == random_draws(resumed.grid), "consumed": consumed,
            "iteration": state.iteration, "stats": manager.stats}


def _plain(directory: str) -> dict:
    """Every tensor of a torch_dist checkpoint as one plain dict, with PyTorch's tools only."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = os.path.join(directory, "plain.pt")
    dcp_to_torch_save(directory, target)
    out = torch.load(target, weights_only=True)
    os.remove(target)
    return out


def _train_and_save(run: Run, directory: str, n: int, m: int) -> list:
    """N steps, save, M more steps: the M losses of continuing on the saved layout."""
    manager = _manager(run.grid, save=directory)
    for _ in range(n):
        run.step()
    manager.save(run.state, run.models, run.optimizer, run.scheduler)
    return [run.step() for _ in range(m)]


def _load_resave_train(run: Run, load: str, save: str, m: int) -> list:
    """Load on the run's layout, re-save at once, M steps: the M losses of resuming there."""
    import warnings

    manager = _manager(run.grid, save=save, load=load)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "RNG states not restored": expected across layouts
        run.state = manager.load(run.models, run.optimizer, run.scheduler)
    manager.save(run.state, run.models, run.optimizer, run.scheduler)
    return [run.step() for _ in range(m)]


def _compare_saves(a: str, b: str, iteration: int) -> dict:
    """Two torch_dist checkpoints of one iteration: tensor by tensor, steps, train state."""
    it = f"iter_{iteration:07d}"
    pa, pb = _plain(f"{a}/{it}"), _plain(f"{b}/{it}")
    keys = sorted(k for k in pa if torch.is_tensor(pa[k]))   # objects are per layout
    out = {"differ": [k for k in keys if k not in pb or not torch.equal(pa[k], pb[k])],
           "num_tensors": len(keys),
           "extra": sorted(k for k in pb if torch.is_tensor(pb[k]) and k not in pa)}
    out["equal"] = not out["extra"] and not out["differ"]
    # masters b added (an fp32 optimizer saved none): each must equal its fp32 weight
    prefix = "optimizer.state.param."
    out["extra_are_masters"] = all(k.startswith(prefix) and torch.equal(pb[k], pa[k[len(prefix):]])
                                   for k in out["extra"])
    ca = torch.load(f"{a}/{it}/common.pt", weights_only=True)
    cb = torch.load(f"{b}/{it}/common.pt", weights_only=True)
    out["steps_equal"] = ca["optimizer"]["steps"] == cb["optimizer"]["steps"]
    out["train_state_equal"] = ca["train_state"] == cb["train_state"]
    return out


def reshard_roundtrip(root: str, layout_a, layout_b, n: int = 3, m: int = 2,
                      bf16: bool = False, distopt: bool = True, distopt_b: bool | None = None
                      ) -> dict:
    """Train at A, save; load at B and re-save at once (must equal A's checkpoint); train on."""
    # a layout is (tp, pp) or (tp, pp, cp, vpp); with cp or vpp > 1 on either side both runs
    # step through chapter 01's schedules, so that A and B compute their losses the same way
    scheduled = any(math.prod(lay[2:]) > 1 for lay in (layout_a, layout_b))
    # dropout off: its streams depend on the layout (and are not restored across layouts)
    kw = dict(dropout=0.0, bf16=bf16, scheduled=scheduled)
    losses_a = _train_and_save(Run(*layout_a, distopt=distopt, **kw), f"{root}/a", n, m)
    other = Run(*layout_b, seed=77, distopt=distopt if distopt_b is None else distopt_b, **kw)
    losses_b = _load_resave_train(other, f"{root}/a", f"{root}/b", m)
    out = {"losses_a": losses_a, "losses_b": losses_b}
    if dist.get_rank() == 0:
        out.update(_compare_saves(f"{root}/a", f"{root}/b", n))
    return out


def dp_only_save(root: str, n: int = 3, m: int = 2) -> list:
    """One process (DP 1, DistributedOptimizer): N steps, save to root/a, M more: their losses."""
    return _train_and_save(Run(1, 1, dropout=0.0), f"{root}/a", n, m)


def dp_only_load(root: str, source: str, target: str, n: int = 3, m: int = 2) -> dict:
    """TP 1 PP 1 on however many ranks run this: load root/source, re-save to root/target, train."""
    losses = _load_resave_train(Run(1, 1, seed=77, dropout=0.0), f"{root}/{source}",
                                f"{root}/{target}", m)
    out = {"losses": losses}
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.update(_compare_saves(f"{root}/{source}", f"{root}/{target}", n))
    return out


def legacy_refuses_tp_change(root: str) -> str:
    """Save legacy at TP 2, load at TP 1: the error text."""
    run = Run(2, 1)
    _manager(run.grid, save=root, ckpt_format="torch").save(run.state, [run.ddp], run.optimizer,
                                                           run.scheduler)
    other = Run(1, 1)
    try:
        _manager(other.grid, load=root, ckpt_format="torch").load([other.ddp], other.optimizer,
                                                                  other.scheduler)
    except ValueError as e:
        return str(e)
    return "no error"


def fully_parallel_both(root: str, tp: int = 2, config=None) -> dict:
    """One TP x DP state (DistributedOptimizer) saved with and without the fully parallel save."""
    run = Run(tp, 1, config=config)
    run.step()
    for name, on in (("on", True), ("off", False)):
        _manager(run.grid, save=f"{root}/{name}", ckpt_fully_parallel_save=on).save(
            run.state, [run.ddp], run.optimizer, run.scheduler)
    _manager(run.grid, save=f"{root}/dp_random", data_parallel_random_init=True).save(
        run.state, [run.ddp], run.optimizer, run.scheduler)
    return {"dp_rank": run.grid.rank("dp_cp"), "tp_rank": run.grid.rank("tp")}


def rng_over_dp(root: str) -> dict:
    """CP 2 x DP 2 with data_parallel_random_init, both formats: each rank draws its own stream,
    saves, scrambles it and loads; what it gets back is the state of its DP rank (at CP rank 0,
    the rank whose list the checkpoint stores), as Megatron indexes it (checkpointing.py:1993)."""
    run = Run(1, 1, 2)
    grid = run.grid
    torch.manual_seed(100 + grid.global_rank)   # a different stream on every rank
    mine = torch.get_rng_state()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (grid.rank("dp"), grid.rank("cp"), mine))
    expected = next(s for d, c, s in everyone if d == grid.rank("dp") and c == 0)
    restored = {}
    for fmt in ("torch_dist", "torch"):
        torch.set_rng_state(mine)
        _manager(grid, save=f"{root}/{fmt}", ckpt_format=fmt, data_parallel_random_init=True
                 ).save(run.state, run.models, run.optimizer, run.scheduler)
        torch.manual_seed(0)
        _manager(grid, load=f"{root}/{fmt}", ckpt_format=fmt, data_parallel_random_init=True
                 ).load(run.models, run.optimizer, run.scheduler)
        restored[fmt] = torch.equal(torch.get_rng_state(), expected)
    return {"restored": restored, "dp": grid.rank("dp"), "cp": grid.rank("cp")}


def _every_rank(root: str, fn) -> list:
    """fn's result on every rank, gathered (each rank's view of the same check)."""
    got = fn(root)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, got)
    return everyone


def checkpoint_suite(root: str) -> dict:
    """Every multi-rank check of the tests, in one 4-rank world (seconds per check included)."""
    checks = {
        "dist_tp2_sync": (resume_same_layout, 2, 1),
        "dist_pp2_async_process": (resume_same_layout, 1, 2, 3, 3),
        "legacy_tp2_pp2": (resume_same_layout, 2, 2),
        "reshard_tp2_to_tp1": (reshard_roundtrip, (2, 1), (1, 1)),
        "reshard_tp1_to_tp2": (reshard_roundtrip, (1, 1), (2, 1)),
        "reshard_pp2_to_pp1": (reshard_roundtrip, (1, 2), (1, 1)),
        "reshard_pp1_to_pp2": (reshard_roundtrip, (1, 1), (1, 2)),
        "reshard_bf16_tp2_to_pp2": (reshard_roundtrip, (2, 1), (1, 2), 3, 2, True),
        # (tp, pp, cp, vpp); virtual stages: one optimizer over the chunks, as the trainer's
        "reshard_vpp2_to_pp2": (reshard_roundtrip, (1, 2, 1, 2), (1, 2)),
        "reshard_vpp2_to_pp1": (reshard_roundtrip, (1, 2, 1, 2), (1, 1)),
        "reshard_pp1_to_vpp2": (reshard_roundtrip, (1, 1), (1, 2, 1, 2)),
        "reshard_vpp2_to_pp2_distopt": (reshard_roundtrip, (1, 2, 1, 2), (1, 2)),
        "reshard_cp2_to_cp1": (reshard_roundtrip, (1, 1, 2, 1), (1, 1)),
        "reshard_cp1_to_cp2": (reshard_roundtrip, (1, 1), (1, 1, 2, 1)),
        "reshard_pp2_cp2_to_dp4": (reshard_roundtrip, (1, 2, 2, 1), (1, 1)),   # 2 -> 4 shards
        "dp_only": (dp_only_load, "a", "b"),   # root/dp_only/a: dp_only_save in one process
        "legacy_refuses": (legacy_refuses_tp_change,),
        "both_formats": (save_both_formats, tiny_config(num_layers=4, seed=11)),
        "load_errors": (_every_rank, load_errors),
        "fully_parallel": (_every_rank, fully_parallel_both),
        "rng_cp2_dp2": (_every_rank, rng_over_dp),
        # one DistributedOptimizer over the two chunks of each stage -> no pipeline, one chunk
        "reshard_vpp2_distopt_to_pp1": (reshard_roundtrip, (1, 2, 1, 2), (1, 1)),
    }
    fp32_optimizer = {"distopt": False}   # the mixed-precision optimizer: fp32 weights, no masters
    options = {"dist_pp2_async_process": {"async_save": True},
               "legacy_tp2_pp2": {"ckpt_format": "torch"},
               "reshard_vpp2_to_pp2": fp32_optimizer, "reshard_vpp2_to_pp1": fp32_optimizer,
               "reshard_pp1_to_vpp2": fp32_optimizer,
               "reshard_vpp2_to_pp2_distopt": {**fp32_optimizer, "distopt_b": True}}
    out, seconds = {}, {}
    for name, (fn, *args) in checks.items():
        t0 = time.perf_counter()
        out[name] = fn(f"{root}/{name}", *args, **options.get(name, {}))
        seconds[name] = round(time.perf_counter() - t0, 2)
    out["seconds"] = seconds
    return out


# -- demos -------------------------------------------------------------------------------------
def legacy_demo_save(root: str) -> dict:
    """DP 2, DistributedOptimizer: 3 steps, legacy save, one more step."""
    run = Run(1, 1, dropout=0.0)
    for _ in range(3):
        run.step()
    _manager(run.grid, save=root, ckpt_format="torch").save(run.state, [run.ddp], run.optimizer,
                                                           run.scheduler)
    files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root)
                   for f in fs)
    return {"files": files, "next_loss": run.step(),
            "num_params": sum(p.numel() for p in run.model.parameters()),
            "num_tensors": len(list(run.model.parameters())),
            "buffer_numel": sum(b.numel for b in run.ddp.buffers)}


def legacy_demo_load(root: str) -> dict:
    """DP 1: load the DP 2 legacy checkpoint and take the next step."""
    run = Run(1, 1, dropout=0.0, seed=5)
    run.state = _manager(run.grid, load=root, ckpt_format="torch").load(
        [run.ddp], run.optimizer, run.scheduler)
    return {"next_loss": run.step()}


class _Timeline:
    """Spans (label, row, start, end) in seconds since construction."""

    def __init__(self):
        self.t0, self.events = time.perf_counter(), []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def span(self, label: str, fn, row: str = "training"):
        start = self.now()
        result = fn()
        self.events.append((label, row, start, self.now()))
        return result


def _timeline_model():
    """A 5.5M-parameter GPT (66 MB with AdamW state) and a closure taking one training step."""
    from tinytron.model import GPTModel
    from tinytron.optimizer import AdamW
    from tinytron.optimizer.mixed_precision import MixedPrecisionOptimizer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = tiny_config(hidden_size=256, num_layers=6, num_attention_heads=8,
                         num_query_groups=4, ffn_hidden_size=704, vocab_size=4096, seq_length=64)
    model = GPTModel(config)
    opt = MixedPrecisionOptimizer(AdamW(model.parameters(), lr=1e-3), clip_grad=1.0)
    state = TrainStateFallback()

    def step():
        tokens = torch.randint(0, config.vocab_size, (4, config.seq_length + 1))
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        opt.step()
        opt.zero_grad()
        state.iteration += 1

    return config, model, opt, state, step


def async_timeline_demo(root: str, steps: int = 8) -> dict:
    """One process: a sync save, then an async one overlapping training; spans for a timeline."""
    from tinytron.checkpoint.formats import read_tracker
    from tinytron.checkpoint.torch_dist import load_model_weights
    from tinytron.model import GPTModel

    config, model, opt, state, step = _timeline_model()
    grid, tl = ParallelGrid.single(), _Timeline()
    sync = CheckpointManager(CheckpointConfig(save=f"{root}/sync"), grid)
    asyn = CheckpointManager(CheckpointConfig(save=f"{root}/async", async_save=True), grid)
    tl.span("train step", step)
    tl.span("sync save", lambda: sync.save(state, model, opt))
    sync_s, sync_ref = tl.events[-1][3] - tl.events[-1][2], _weights(model)
    tl.span("train step", step)
    stats = tl.span("async: blocking", lambda: asyn.save(state, model, opt))
    async_iteration, async_ref = state.iteration, _weights(model)
    done = None
    for _ in range(steps):
        if done is None:   # the per-iteration poll; drawn only when it completes the save
            done = tl.span("finalize", lambda: asyn.finalize(blocking=False))
            if done is None:
                tl.events.pop()
        tl.span("train step", step)
    done = done or tl.span("finalize", lambda: asyn.finalize(blocking=True))
    begin = stats["scheduled_at"] - tl.t0 + stats["blocking_s"]
    tl.events.append(("async: background write", "writer process", begin,
                      begin + done["background_s"]))
    fresh = GPTModel(config.replace(seed=3))
    load_model_weights(f"{root}/async", fresh)
    ok = _weights(fresh) == async_ref
    load_model_weights(f"{root}/sync", fresh)
    return {"events": tl.events, "sync_s": sync_s, "async_blocking_s": stats["blocking_s"],
            "async_background_s": done["background_s"], "visible_after_s": done["visible_after_s"],
            "same_tensors": ok and _weights(fresh) == sync_ref,
            "tracker": read_tracker(f"{root}/async")[0], "async_iteration": async_iteration}


def _weights(model) -> "_Snapshot":
    return _Snapshot({n: p.detach().clone() for n, p in model.named_parameters()})


class _Snapshot(dict):
    """A dict of tensors whose == is bitwise equality of every entry."""

    def __eq__(self, other):
        return self.keys() == other.keys() and all(torch.equal(self[k], other[k]) for k in self)


def save_both_formats(root: str, config, tp: int = 2, pp: int = 2) -> None:
    """The model saved as a full checkpoint in both formats (no optimizer) at TP x PP."""
    grid = grid_for(tp, pp)
    model = build_stage_models(config, grid)[0]
    for fmt in ("torch_dist", "torch"):
        CheckpointManager(CheckpointConfig(save=f"{root}/{fmt}", ckpt_format=fmt), grid).save(
            TrainStateFallback(), [model])


def load_errors(root: str) -> dict:
    """Bad loads at TP 1 x PP 2 (DP 2): the message each rank raises, or 'no error'."""
    from tinytron.checkpoint.torch_dist import load_model_weights, save_model_weights

    grid = grid_for(1, 2)
    config = tiny_config(num_layers=4, seed=5)
    save_model_weights(build_stage_models(config, grid)[0], f"{root}/tied", grid)
    save_model_weights(build_stage_models(config.replace(tie_embeddings=False), grid)[0],
                       f"{root}/untied", grid)
    cases = {"shape": ("tied", config.replace(ffn_hidden_size=2 * config.ffn_hidden_size)),
             # only the last stage holds the output layer: the other ranks see nothing wrong
             "missing": ("tied", config.replace(tie_embeddings=False)),
             "extra": ("untied", config)}
    out = {}
    for name, (source, cfg) in cases.items():
        model = build_stage_models(cfg, grid)[0]
        before = _weights(model)
        try:
            load_model_weights(f"{root}/{source}", model, grid)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
        out[name + "_unchanged"] = _weights(model) == before
    return out
