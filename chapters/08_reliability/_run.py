"""A tiny resilient training job: chapter 01's loop + chapter 03's checkpoints + chapter 08's nets.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 2 \\
        -m tinytron.reliability._run --save /tmp/run --train-iters 8 --save-interval 2 \\
        --fault kill@5:rank=1:attempt=0

Exit codes: 0 (done, or stopped by SIGTERM/SIGINT after a save), 16/17 (the rerun state
machine), 18 (a hang detected by the rank monitor). The log records go to <save>/losses.jsonl
(last rank, every iteration) and each rank's exact per-micro-batch loss sums to
<save>/step_losses_rank<r>.jsonl. Not a page: the tests and the benchmark drive it;
tinytron.train is the real trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tinytron.reliability.observability import LoggingConfig, MetricsLogger
from tinytron.reliability.restarts import Reliability, ReliabilityConfig

MBS = 2
MODELS = {  # tiny: the tests; small: a step long enough to see what the safety nets cost
    "tiny": dict(seq_length=32),
    "small": dict(hidden_size=256, num_layers=4, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=688, vocab_size=8192, seq_length=128),
}


class _Tokens(torch.utils.data.Dataset):
    """Deterministic learnable sequences: start + 7k (mod V), the start drawn from the index."""

    def __init__(self, vocab: int, seq: int, num_samples: int = 100_000, seed: int = 1234):
        self.vocab, self.seq, self.num_samples, self.seed = vocab, seq, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(idx))
        start = int(torch.randint(0, self.vocab, (1,), generator=g))
        seq = (start + 7 * torch.arange(self.seq + 1)) % self.vocab
        return {"tokens": seq[:-1], "labels": seq[1:], "position_ids": torch.arange(self.seq),
                "loss_mask": torch.ones(self.seq, dtype=torch.float32)}


def parse_args(argv=None) -> argparse.Namespace:
    """The job's options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save", required=True, help="checkpoint root (also resumed from)")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--train-iters", type=int, default=8)
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--fault", action="append", default=[], help="fault spec (repeatable)")
    p.add_argument("--node", default=None, help="this launch's node name (rerun diagnosis)")
    p.add_argument("--rerun-mode", default="validate_results")
    p.add_argument("--check-for-spiky-loss", action="store_true")
    p.add_argument("--no-safety-nets", action="store_true",
                   help="rerun machine disabled, no heartbeats, no timers (the benchmark's 'off')")
    p.add_argument("--ft-step-timeout", type=float, default=60.0)
    p.add_argument("--ft-heartbeat-interval", type=float, default=0.25)
    p.add_argument("--ft-num-warmup-iters", type=int, default=1)
    p.add_argument("--timing-log-level", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds of extra work per step (gives a signal time to arrive)")
    return p.parse_args(argv)


def _init_distributed() -> None:
    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ:   # torchrun
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    else:                            # a one-rank world in this process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _reliability(args) -> Reliability:
    off = args.no_safety_nets
    config = ReliabilityConfig(
        rerun_mode="disabled" if off else args.rerun_mode,
        check_for_nan_in_loss_and_grad=not off, check_for_spiky_loss=args.check_for_spiky_loss,
        exit_signal_handler=True, enable_ft=not off and "MASTER_PORT" in os.environ,
        ft_step_timeout=args.ft_step_timeout, ft_num_warmup_iters=args.ft_num_warmup_iters,
        ft_heartbeat_interval=args.ft_heartbeat_interval,
        ft_heartbeat_timeout=max(10.0, 20 * args.ft_heartbeat_interval), faults=args.fault)
    return Reliability(config, save_dir=args.save, timing_log_level=args.timing_log_level)


def run(argv=None) -> int:
    """Train (or resume) the tiny job; return the process exit code."""
    from tinytron.buffers import DistributedDataParallelConfig
    from tinytron.checkpoint.resume import CheckpointConfig, make_checkpoint_hooks
    from tinytron.data.samplers import build_pretraining_data_loader
    from tinytron.main_loop.loop import (gpt_forward_step, megatron_optimizer_provider,
                                         megatron_scheduler_provider, pretrain)
    from tinytron.model import build_stage_models, tiny_config
    from tinytron.optimizer import OptimizerConfig, SchedulerConfig
    from tinytron.parallel import ParallelGrid

    args = parse_args(argv)
    if args.node:
        os.environ["TINYTRON_NODE_NAME"] = args.node
    _init_distributed()
    torch.set_num_threads(1)
    grid = ParallelGrid()
    os.makedirs(os.path.join(args.save, "pids"), exist_ok=True)
    with open(os.path.join(args.save, "pids", f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))   # so that a test can signal one rank
    rel = _reliability(args)
    cfg = tiny_config(**MODELS[args.model])
    seq = cfg.seq_length
    ckpt = make_checkpoint_hooks(CheckpointConfig(save=args.save, load=args.save), grid)
    save, load = rel.checkpoint_hooks(ckpt.save_checkpoint_fn, ckpt.load_checkpoint_fn)
    timer_names = ["forward-backward", "optimizer", "save-checkpoint"]
    logger = MetricsLogger(LoggingConfig(jsonl_path=os.path.join(args.save, "losses.jsonl"),
                                         progress_bar=False, log_memory_to_tensorboard=False),
                           args.train_iters, timers=None if args.no_safety_nets else rel.timers,
                           timer_names=timer_names)
    opt_cfg = OptimizerConfig(lr=3e-3, weight_decay=0.0, clip_grad=1.0)

    def data(grid_, state):
        ds = _Tokens(cfg.vocab_size, seq)
        loader = build_pretraining_data_loader(ds, state.consumed_train_samples, MBS,
                                               max(grid_.rank("dp"), 0), grid_.size("dp"))
        return rel.data_iterator(iter(loader)), None

    def step_sleep(fb):
        if not args.step_sleep:
            return fb

        def slow(**kw):
            out = fb(**kw)
            time.sleep(args.step_sleep)  # stands for a longer step: time for a signal to land
            return out
        return slow

    step_log = open(os.path.join(args.save, f"step_losses_rank{dist.get_rank()}.jsonl"), "a",
                    buffering=1)

    def record_losses(fb):
        """Each pass's local per-micro-batch loss sums, exactly (the tests compare them bitwise)."""
        def recorded(**kw):
            out = fb(**kw)
            sums = [float(torch.as_tensor(r["lm loss"]).reshape(-1)[0]) for r in out]
            step_log.write(json.dumps({"iteration": rel.rsm.current_iteration,
                                       "pass": rel.rsm.state.name, "sums": sums}) + "\n")
            return out
        return recorded

    training = SimpleNamespace(
        micro_batch_size=MBS, global_batch_size=args.global_batch_size, rampup_batch_size=None,
        decrease_batch_size_if_needed=False, train_iters=args.train_iters, train_samples=None,
        eval_interval=None, eval_iters=0, save_interval=args.save_interval, exit_interval=None,
        exit_duration_in_mins=None, exit_signal_handler=True, log_interval=1, seed=1234)
    handler, built = rel.signal_handler, []

    def model_provider(g):
        built.extend(build_stage_models(cfg, g))
        return list(built)

    try:
        with handler:
            result = pretrain(
                training, model_provider=model_provider,
                forward_step_func=rel.forward_step_func(
                    partial(gpt_forward_step, micro_batch_size=MBS, seq_length=seq)),
                data_iterators_provider=data,
                optimizer_provider=lambda m, g: rel.wrap_optimizer(
                    megatron_optimizer_provider(opt_cfg)(m, g)),
                scheduler_provider=megatron_scheduler_provider(
                    SchedulerConfig(lr_decay_style="cosine"), opt_cfg),
                grid_provider=lambda: grid, ddp_config=DistributedDataParallelConfig(),
                seq_length=seq, load_checkpoint_fn=load, save_checkpoint_fn=save,
                finalize_async_save_fn=ckpt.finalize_async_save_fn, log_fn=logger,
                exit_signal=handler, rerun_state_machine=rel.rsm, step_hooks=rel,
                iterations_to_skip=rel.iterations_to_skip,
                wrap_forward_backward_func=lambda fb: record_losses(step_sleep(
                    fb if args.no_safety_nets else rel.forward_backward_func(fb))))
    except BaseException:
        _release(built)
        raise
    finally:
        rel.shutdown()
        logger.close()
        step_log.close()
    code = rel.exit_code(result.exit_reason)
    if dist.get_rank() == 0:
        print(f"[run] stopped at iteration {result.state.iteration} "
              f"(reason: {result.exit_reason}), exit code {code}", flush=True)
    return code


def _release(chunks) -> None:
    """Break the param -> DDP hook cycles that autograd's C++ side hides from the garbage
    collector, so that a failed attempt's process groups can really be freed (in-process
    restart: their gloo connections must close for blocked peers to fail fast)."""
    for chunk in chunks:
        for p in chunk.parameters():
            hooks = getattr(p, "_post_accumulate_grad_hooks", None)
            if hooks:
                hooks.clear()


def main() -> None:
    """Entry point under torchrun (or plain python for one rank)."""
    code = run()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
