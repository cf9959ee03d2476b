"""The staged async save (chapter 03): the copy to host runs while the next forward and backward
do, and the loop waits for it only before the next optimizer step. Checked through chapter 01's
loop as a trainer runs it: every checkpoint is the one a synchronous save writes (the shard file
and common.pt byte for byte), and a SIGKILL during staging leaves the previous checkpoint the
latest; beside a step of the CPU-offload optimizer, whose upload stream waits for the staging
wait, the checkpoint still holds the pre-step state. The legacy format has no async path (`async_save` needs `torch_dist`, as in Megatron).

    python -m tests.test_checkpoint_staged kill ROOT     (the subprocess of the kill test)
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
ITERS, SAVE_INTERVAL = 6, 2


def _run(root: str, async_mode: str | None, wire_hook: bool = True, iters: int = ITERS,
         save_wrapper=None, dp: int = 1, overlap_param_gather: bool = False):
    """pretrain the tiny GPT with chapter 03's hooks saving every SAVE_INTERVAL iterations.

    With dp > 1 (inside a world of dp ranks): DP with the distributed optimizer."""
    from tests.main_loop_workers import CFG, FORWARD_STEP, MBS, OPT_CONFIG, training
    from tinytron.buffers import DistributedDataParallelConfig
    from tinytron.checkpoint import CheckpointConfig, make_checkpoint_hooks
    from tinytron.main_loop._loop_workers import synthetic_iterators
    from tinytron.main_loop.loop import megatron_optimizer_provider, megatron_scheduler_provider
    from tinytron.main_loop.run import pretrain
    from tinytron.model import build_stage_models
    from tinytron.optimizer import SchedulerConfig
    from tinytron.parallel import ParallelGrid

    torch.set_num_threads(1)
    grid = ParallelGrid.single() if dp == 1 else ParallelGrid(dp=dp)
    opt_config = OPT_CONFIG if dp == 1 else OPT_CONFIG.__class__(
        **{**OPT_CONFIG.__dict__, "use_distributed_optimizer": True})
    config = CheckpointConfig(save=root, async_save=async_mode is not None,
                              async_mode=async_mode or "process")
    hooks = make_checkpoint_hooks(config, grid)
    saver = hooks.manager.saver
    save = hooks.save_checkpoint_fn
    if save_wrapper is not None:
        save = save_wrapper(save)
    logs = []
    pretrain(training(train_iters=iters, save_interval=SAVE_INTERVAL),
             model_provider=lambda g: build_stage_models(CFG, g),
             forward_step_func=FORWARD_STEP,
             data_iterators_provider=partial(synthetic_iterators, CFG, micro_batch_size=MBS),
             optimizer_provider=megatron_optimizer_provider(opt_config),
             scheduler_provider=megatron_scheduler_provider(
                 SchedulerConfig(lr_decay_style="cosine"), opt_config),
             grid_provider=lambda: grid, ddp_config=DistributedDataParallelConfig(
                 use_distributed_optimizer=dp > 1, overlap_param_gather=overlap_param_gather),
             seq_length=CFG.seq_length, save_checkpoint_fn=save,
             finalize_async_save_fn=hooks.finalize_async_save_fn,
             before_optimizer_step_fn=(saver.before_optimizer_step
                                       if saver is not None and wire_hook else None),
             log_fn=logs.append)
    hooks.manager.comm.destroy()
    losses = [r["losses"]["lm loss"] for r in logs if r.get("losses")]
    return (hooks.manager.stats if saver is None else saver.completed), losses


def _files(d: Path) -> dict:
    """A checkpoint directory's bytes; .metadata as its tensor index (it holds a random save id)."""
    out = {f.name: f.read_bytes() for f in d.iterdir() if f.name not in (".metadata",
                                                                          "checksums.json")}
    with open(d / ".metadata", "rb") as f:
        meta = pickle.load(f)
    out[".metadata"] = (meta.state_dict_metadata, meta.storage_data)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("staged")
    out = {}
    for name, mode, wire in (("sync", None, True), ("thread", "thread", True),
                             ("process", "process", True), ("unwired", "thread", False)):
        out[name] = (root / name, *_run(str(root / name), mode, wire))
    return out


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_staged_checkpoints_are_the_sync_ones_while_training_goes_on(runs, mode):
    sync_root, _, sync_losses = runs["sync"]
    root, stats, losses = runs[mode]
    assert losses == sync_losses   # training is not disturbed
    assert [s["label"] for s in stats] == [f"iteration {i}" for i in (2, 4, 6)]
    # CPU: thread mode copies in the background (the loop wired the wait); fork needs no copy.
    assert all(s["staged"] == (mode == "thread") for s in stats)
    for i in (2, 4, 6):
        name = f"iter_{i:07d}"
        a, b = _files(sync_root / name), _files(root / name)
        assert a.keys() == b.keys() == {".metadata", "__0_0.distcp", "common.pt", "metadata.json"}
        assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]


DP2_RUNS = {"sync": (None, False), "thread": ("thread", False),   # name: (async mode, overlap)
            "sync_overlap": (None, True), "thread_overlap": ("thread", True)}


def _dp2(root: str) -> dict:
    """Rank function: sync and staged runs on DP 2 (distributed optimizer), with and without
    the param all-gather overlapped with the next forward."""
    out = {}
    for name, (mode, overlap) in DP2_RUNS.items():
        stats, out[f"{name}_losses"] = _run(f"{root}/{name}", mode, dp=2,
                                            overlap_param_gather=overlap)
        out[f"{name}_staged"] = [s.get("staged") for s in stats]
    torch.distributed.barrier()
    return out


def test_staged_checkpoints_are_the_sync_ones_on_dp2_with_the_distributed_optimizer(tmp_path):
    """With overlap_param_gather the loop finishes the all-gather before saving (Megatron's
    force_param_sync): the saved weights are the updated ones, as without the overlap."""
    from tinytron.launch import run_on_ranks

    results = run_on_ranks(_dp2, 2, str(tmp_path), timeout=600)
    for r in results:
        assert all(r[f"{n}_losses"] == r["sync_losses"] for n in DP2_RUNS)
        assert r["thread_staged"] == r["thread_overlap_staged"] == [True] * 3
    for i in (2, 4, 6):
        a = _files(tmp_path / "sync" / f"iter_{i:07d}")
        assert {"__0_0.distcp", "__1_0.distcp"} <= a.keys()
        for name in ("thread", "sync_overlap", "thread_overlap"):
            b = _files(tmp_path / name / f"iter_{i:07d}")
            assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), \
                (name, i, [k for k in a if a[k] != b[k]])


def test_without_the_loops_hook_the_snapshot_is_taken_before_save_returns(runs):
    _, stats, _ = runs["unwired"]
    assert not any(s["staged"] for s in stats) and all(s["staging_wait_s"] == 0 for s in stats)
    sync_root, root = runs["sync"][0], runs["unwired"][0]
    assert _files(sync_root / "iter_0000004") == _files(root / "iter_0000004")


def test_the_wait_leaves_the_copies_complete_and_is_not_repeated(tmp_path):
    from tests.checkpoint_workers import tiny_training
    from tinytron.checkpoint import CheckpointConfig, CheckpointManager
    from tinytron.checkpoint.resume import TrainStateFallback
    from tinytron.parallel import ParallelGrid

    _, model, opt, step = tiny_training()
    step(1)
    manager = CheckpointManager(CheckpointConfig(save=str(tmp_path), async_save=True,
                                                 async_mode="thread"), ParallelGrid.single())
    saver = manager.saver
    assert saver.before_optimizer_step() == 0.0   # nothing pending; arms the wait point
    stats = manager.save(TrainStateFallback(iteration=1), model, opt)
    staging = saver.pending.staging
    assert stats["staged"] and not staging.fenced
    saver.before_optimizer_step()
    assert staging.fenced and staging.done() and not staging.thread.is_alive()
    assert all(torch.equal(b, s) for b, s in zip(staging.buffers, staging.sources))
    waited = stats["staging_wait_s"]
    assert saver.before_optimizer_step() == 0.0 and stats["staging_wait_s"] == waited
    done = manager.finalize(blocking=True)
    assert done is stats and done["staging_s"] > 0 and done["blocking_s"] >= done["schedule_s"]


def test_sigkill_during_staging_keeps_the_previous_checkpoint(tmp_path):
    from tests.main_loop_workers import CFG
    from tinytron.checkpoint import load_checkpoint, read_tracker
    from tinytron.model import build_stage_models
    from tinytron.parallel import ParallelGrid

    root = tmp_path / "ckpt"
    out = subprocess.run([sys.executable, "-m", "tests.test_checkpoint_staged", "kill", str(root)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == -9, out.stderr[-2000:]
    assert read_tracker(root) == (2, False)
    assert (root / "iter_0000004.tmp").is_dir() and not (root / "iter_0000004").exists()
    model = build_stage_models(CFG.replace(seed=99), ParallelGrid.single())[0]
    assert load_checkpoint(root, model).iteration == 2
    expected = torch.load(str(root) + ".expected.pt", weights_only=True)
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())


def _kill(root: str) -> None:
    """Save iteration 2 (and keep its weights), then die in the staging of iteration 4's save."""
    from tinytron.checkpoint.formats import FAULT_ENV
    from tinytron.checkpoint.formats import unwrap_chunks

    def wrapper(save):
        def wrapped(state, model, optimizer, scheduler):
            if state.iteration == 2:
                weights = {n: p.detach().clone()
                           for n, p in unwrap_chunks(model)[0].named_parameters()}
                torch.save(weights, root + ".expected.pt")
            else:
                os.environ[FAULT_ENV] = "during_staging"
            save(state, model, optimizer, scheduler)
        return wrapped

    _run(root, "thread", iters=6, save_wrapper=wrapper)
    print(json.dumps({"survived": True}))


def _staged_save_beside_an_offloaded_step(root: Path, device: str):
    """Save at iteration 1 synchronously and staged (thread mode) while the next step runs
    with chapter 02's CPU-offload optimizer; both checkpoints' files and the optimizer."""
    from tests.checkpoint_workers import tiny_training
    from tinytron.checkpoint import CheckpointConfig, CheckpointManager
    from tinytron.checkpoint.resume import TrainStateFallback
    from tinytron.optimizer.offload import HybridDeviceOptimizer
    from tinytron.parallel import ParallelGrid

    _, model, opt, _ = tiny_training()
    model.to(device)
    inner = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=1e-2)
    opt = type(opt)(inner, clip_grad=1.0)
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))

    def forward_backward():
        model(tokens[:, :-1].to(device), labels=tokens[:, 1:].to(device)).mean().backward()

    forward_backward()
    opt.step()
    opt.zero_grad()
    state, grid = TrainStateFallback(iteration=1), ParallelGrid.single()
    CheckpointManager(CheckpointConfig(save=str(root / "sync")), grid).save(state, model, opt)
    manager = CheckpointManager(CheckpointConfig(save=str(root / "staged"), async_save=True,
                                                 async_mode="thread"), grid)
    manager.saver.before_optimizer_step()
    if device == "cuda":   # hold the staging copies back: they start after this on the stream
        torch.cuda._sleep(100_000_000)
    stats = manager.save(state, model, opt)
    forward_backward()
    manager.saver.before_optimizer_step()   # the compute stream waits for the copies
    opt.step()                              # H2D uploads overwrite the saved parameters
    manager.finalize(blocking=True)
    files = [_files(root / name / "iter_0000001") for name in ("sync", "staged")]
    return files, stats, inner


def test_offloaded_steps_order_the_upload_stream_after_the_staging_wait(tmp_path):
    """The rule on a CPU: both of the offload optimizer's copy streams wait for the compute
    stream, where `before_optimizer_step` queued the wait for the staged copies."""
    (sync, staged), stats, inner = _staged_save_beside_an_offloaded_step(tmp_path, "cpu")
    assert inner.streams.after_compute_names == ("d2h", "h2d")
    assert stats["staged"] and inner.host_of   # staged; the parameters stepped on the host
    assert sync.keys() == staged.keys() and all(sync[k] == staged[k] for k in sync)


@pytest.mark.gpu
def test_staged_save_with_cpu_offload_holds_the_pre_step_parameters_on_cuda(tmp_path):
    """The real streams: staging stream, compute stream, the offload optimizer's D2H/H2D."""
    (sync, staged), stats, inner = _staged_save_beside_an_offloaded_step(tmp_path, "cuda")
    assert stats["staged"] and inner.streams.h2d is not None
    assert sync["__0_0.distcp"] == staged["__0_0.distcp"]
    assert sync["common.pt"] == staged["common.pt"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_cuda_state_stages_on_a_side_stream_into_pinned_buffers(tmp_path, mode):
    from tests.checkpoint_workers import tiny_training
    from tinytron.checkpoint import CheckpointConfig, CheckpointManager
    from tinytron.checkpoint.resume import TrainStateFallback
    from tinytron.parallel import ParallelGrid

    _, model, opt, _ = tiny_training()
    model.cuda()
    opt = type(opt)(torch.optim.AdamW(model.parameters(), lr=1e-2), clip_grad=1.0)
    tokens = torch.randint(0, 512, (2, 17), device="cuda")

    def forward_backward():
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()

    forward_backward()
    opt.step()
    opt.zero_grad()
    state, grid = TrainStateFallback(iteration=1), ParallelGrid.single()
    CheckpointManager(CheckpointConfig(save=str(tmp_path / "sync")), grid).save(state, model, opt)
    manager = CheckpointManager(CheckpointConfig(save=str(tmp_path / mode), async_save=True,
                                                 async_mode=mode), grid)
    manager.saver.before_optimizer_step()
    stats = manager.save(state, model, opt)
    staging = manager.saver.pending.staging
    assert stats["staged"] and all(b.is_pinned() for b in staging.buffers)
    forward_backward()                     # training goes on while the copies run
    manager.saver.before_optimizer_step()  # the optimizer's kernels queue behind them
    opt.step()
    manager.finalize(blocking=True)
    a, b = _files(tmp_path / "sync" / "iter_0000001"), _files(tmp_path / mode / "iter_0000001")
    assert a["__0_0.distcp"] == b["__0_0.distcp"] and a["common.pt"] == b["common.pt"]


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        _kill(sys.argv[2])
