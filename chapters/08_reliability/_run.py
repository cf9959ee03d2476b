"""A tiny resilient training job: chapter 01's loop + chapter 03's checkpoints + chapter 08's nets.

    torchrun --nproc-per-node 2 --max-restarts 2 \\
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
from tinytron.reliability.loop_hooks import Reliability, ReliabilityConfig
from tinytron.reliability.restarts import init_torchrun_process_group

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
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--fault", action="append", default=[], help="fault spec (repeatable)")
    p.add_argument("--node", "--node-name", dest="node", default=None,
                   help="this launch's node name (rerun diagnosis; under torchrun spell it "
                        "--node-name, which torchrun's own --node-rank does not shadow)")
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
        init_torchrun_process_group("gloo", timedelta(seconds=120))
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


class _Job:
    """The parts of one launch, each wrapped by chapter 08's Reliability."""

    def __init__(self, args, rel: Reliability, grid):
        from tinytron.checkpoint.resume import CheckpointConfig, make_checkpoint_hooks
        from tinytron.model import tiny_config

        self.args, self.rel, self.grid, self.built = args, rel, grid, []
        self.cfg = tiny_config(**MODELS[args.model])
        self.ckpt = make_checkpoint_hooks(CheckpointConfig(save=args.save, load=args.save), grid)
        self.logger = MetricsLogger(
            LoggingConfig(jsonl_path=os.path.join(args.save, "losses.jsonl"), progress_bar=False,
                          log_memory_to_tensorboard=False),
            args.train_iters, timers=None if args.no_safety_nets else rel.timers,
            timer_names=["forward-backward", "optimizer", "save-checkpoint"])
        self.step_log = open(os.path.join(args.save, f"step_losses_rank{dist.get_rank()}.jsonl"),
                             "a", buffering=1)

    def model(self, grid):
        """Appendix B's chunks, remembered so that a failed attempt can release them."""
        from tinytron.model import build_stage_models
        self.built.extend(build_stage_models(self.cfg, grid))
        return list(self.built)

    def data(self, grid, state):
        """(train, valid) iterators from the consumed samples; train replayable for reruns."""
        from tinytron.data.samplers import build_pretraining_data_loader
        ds = _Tokens(self.cfg.vocab_size, self.cfg.seq_length)
        loader = build_pretraining_data_loader(ds, state.consumed_train_samples, MBS,
                                               max(grid.rank("dp"), 0), grid.size("dp"))
        return self.rel.data_iterator(iter(loader)), None

    def schedule(self, fb):
        """The schedule with the checks and timers (unless off), a sleep, and the loss record."""
        inner = fb if self.args.no_safety_nets else self.rel.forward_backward_func(fb)

        def wrapped(**kw):
            out = inner(**kw)
            if self.args.step_sleep:
                time.sleep(self.args.step_sleep)  # a longer step: time for a signal to land
            sums = [float(torch.as_tensor(r["lm loss"]).reshape(-1)[0]) for r in out]
            self.step_log.write(json.dumps({"iteration": self.rel.rsm.current_iteration,
                                            "pass": self.rel.rsm.state.name, "sums": sums}) + "\n")
            return out
        return wrapped

    def pretrain_kwargs(self) -> dict:
        """Everything pretrain() takes, with the reliability hooks installed."""
        from tinytron.buffers import DistributedDataParallelConfig
        from tinytron.main_loop.loop import (gpt_forward_step, megatron_optimizer_provider,
                                             megatron_scheduler_provider)
        from tinytron.optimizer import OptimizerConfig, SchedulerConfig

        rel, seq = self.rel, self.cfg.seq_length
        opt_cfg = OptimizerConfig(lr=3e-3, weight_decay=0.0, clip_grad=1.0)
        save, load = rel.checkpoint_hooks(self.ckpt.save_checkpoint_fn,
                                          self.ckpt.load_checkpoint_fn)
        return dict(
            model_provider=self.model, data_iterators_provider=self.data,
            forward_step_func=rel.forward_step_func(
                partial(gpt_forward_step, micro_batch_size=MBS, seq_length=seq)),
            optimizer_provider=lambda m, g: rel.wrap_optimizer(
                megatron_optimizer_provider(opt_cfg)(m, g)),
            scheduler_provider=megatron_scheduler_provider(
                SchedulerConfig(lr_decay_style="cosine"), opt_cfg),
            grid_provider=lambda: self.grid, ddp_config=DistributedDataParallelConfig(),
            seq_length=seq, load_checkpoint_fn=load, save_checkpoint_fn=save,
            finalize_async_save_fn=self.ckpt.finalize_async_save_fn, log_fn=self.logger,
            exit_signal=rel.signal_handler, rerun_state_machine=rel.rsm, step_hooks=rel,
            iterations_to_skip=rel.iterations_to_skip, wrap_forward_backward_func=self.schedule)

    def close(self) -> None:
        """Flush the logs."""
        self.logger.close()
        self.step_log.close()


def _training(args) -> SimpleNamespace:
    """The [training] section of the job (tinytron.config.TrainingConfig's names)."""
    return SimpleNamespace(
        micro_batch_size=MBS, global_batch_size=args.global_batch_size, step_batch_size_schedule=None,
        decrease_batch_size_if_needed=False, train_iters=args.train_iters, train_samples=None,
        eval_interval=None, eval_iters=0, save_interval=args.save_interval, exit_interval=None,
        exit_duration_in_mins=None, exit_signal_handler=True, log_interval=1, seed=1234)


def run(argv=None) -> int:
    """Train (or resume) the tiny job; return the process exit code."""
    from tinytron.main_loop.run import pretrain
    from tinytron.parallel import ParallelGrid

    args = parse_args(argv)
    if args.node:
        os.environ["TINYTRON_NODE_NAME"] = args.node
    _init_distributed()
    torch.set_num_threads(1)
    grid = ParallelGrid(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size)
    os.makedirs(os.path.join(args.save, "pids"), exist_ok=True)
    with open(os.path.join(args.save, "pids", f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))   # so that a test can signal one rank
    rel = _reliability(args)
    job = _Job(args, rel, grid)
    try:
        with rel.signal_handler:
            result = pretrain(_training(args), **job.pretrain_kwargs())
    except BaseException:
        _release(job.built)
        raise
    finally:
        rel.shutdown()
        job.close()
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
