"""Shared settings and rank functions for tests/test_main_loop*.py (spawned ranks need them by name)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch

from tinytron.buffers import DistributedDataParallelConfig
from tinytron.main_loop._loop_workers import synthetic_iterators
from tinytron.main_loop.loop import (gpt_forward_step, megatron_optimizer_provider,
                                     megatron_scheduler_provider)
from tinytron.main_loop.run import pretrain
from tinytron.model import build_stage_models, global_parameter_name, tiny_config
from tinytron.optimizer import OptimizerConfig, SchedulerConfig
from tinytron.parallel import ParallelGrid

CFG = tiny_config(seq_length=16)
MBS = 2
FORWARD_STEP = partial(gpt_forward_step, micro_batch_size=MBS, seq_length=CFG.seq_length)
OPT_CONFIG = OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0)


def training(**overrides) -> SimpleNamespace:
    """The [training] section's names (tinytron.config.TrainingConfig) with small values."""
    base = dict(micro_batch_size=MBS, global_batch_size=8, step_batch_size_schedule=None,
                decrease_batch_size_if_needed=False, train_iters=4, train_samples=None,
                eval_interval=None, eval_iters=1, save_interval=None, exit_interval=None,
                exit_duration_in_mins=None, exit_signal_handler=False, log_interval=1, seed=1234)
    base.update(overrides)
    return SimpleNamespace(**base)


CFG4 = CFG.replace(num_layers=4)   # interleaving: layers divisible by pp * vpp = 4


def _per_chunk_iterators(cfg, vpp, grid, state):
    """One (train, valid) iterator pair per model chunk, as the interleaved schedule reads them."""
    pairs = [synthetic_iterators(cfg, grid, state, micro_batch_size=MBS) for _ in range(vpp)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def pretrain_tiny(grid_provider, ddp_config, opt_config, iters, cfg=CFG, vpp=None):
    """pretrain the tiny GPT for iters iterations on this grid; (run, train log records)."""
    logs = []
    data = (partial(synthetic_iterators, cfg, micro_batch_size=MBS) if vpp is None
            else partial(_per_chunk_iterators, cfg, vpp))
    run = pretrain(training(train_iters=iters),
                   model_provider=lambda g: build_stage_models(cfg, g, vpp or 1),
                   forward_step_func=FORWARD_STEP, data_iterators_provider=data,
                   optimizer_provider=megatron_optimizer_provider(opt_config),
                   scheduler_provider=megatron_scheduler_provider(
                       SchedulerConfig(lr_decay_style="cosine"), opt_config),
                   grid_provider=grid_provider, ddp_config=ddp_config,
                   seq_length=cfg.seq_length, vpp_size=vpp, log_fn=logs.append)
    return run, [r["losses"]["lm loss"] for r in logs if r.get("losses")]


def _global_params(run) -> dict:
    """This rank's parameters under their layout-free names."""
    out = {}
    for chunk in run.model:
        module = chunk.module
        for name, p in module.named_parameters():
            full = global_parameter_name(name, module.layer_offset)
            if full == "output_layer.weight" and module.config.tie_embeddings:
                full = "embedding.word_embeddings.weight"  # the last stage's tied copy
            out[full] = p.detach().clone()
    return out


def dp2_and_pp2(iters: int) -> dict:
    """Three runs on the same 2 ranks: DP 2 + distributed optimizer, PP 2 (1F1B), PP 2 x VPP 2."""
    dist_opt = OptimizerConfig(**{**OPT_CONFIG.__dict__, "use_distributed_optimizer": True})
    run, losses = pretrain_tiny(lambda: ParallelGrid(dp=2), DistributedDataParallelConfig(
        use_distributed_optimizer=True), dist_opt, iters)
    out = {"dp2": {"params": _global_params(run), "losses": losses}}
    run, losses = pretrain_tiny(lambda: ParallelGrid(pp=2), DistributedDataParallelConfig(),
                            OPT_CONFIG, iters)
    out["pp2"] = {"params": _global_params(run), "losses": losses,
                  "state": run.state.state_dict()}
    run, losses = pretrain_tiny(lambda: ParallelGrid(pp=2), DistributedDataParallelConfig(),
                                OPT_CONFIG, iters, cfg=CFG4, vpp=2)
    out["vpp2"] = {"params": _global_params(run), "losses": losses}
    torch.distributed.barrier()
    return out
