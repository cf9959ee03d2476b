"""Chapter 03 in one process: names, tracker, sharded keys, flat-range rectangles, the torch_dist
files (readable with PyTorch alone), async == sync, bad checkpoints refused with nothing loaded,
the converter, the hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.checkpoint_workers import tiny_training
from tinytron.checkpoint import (CheckpointConfig, CheckpointManager, checkpoint_dir_name,
                                 flat_range_boxes, load_checkpoint, load_model_weights,
                                 make_checkpoint_hooks, read_tracker, save_checkpoint,
                                 save_model_weights, write_tracker)
from tinytron.checkpoint.formats import MEGATRON_METADATA, legacy_rank_dir
from tinytron.checkpoint.resume import TrainStateFallback
from tinytron.checkpoint.sharded_keys import (TensorLayout, extra_state_objects,
                                              model_sharded_state_dict)
from tinytron.model import GPTModel, tiny_config
from tinytron.parallel import ParallelGrid

SINGLE = ParallelGrid.single()


def _trained(steps: int = 2, seed: int = 0):
    """A tiny model + optimizer after `steps` AdamW steps, and its TrainState."""
    config, model, opt, step = tiny_training(seed)
    for i in range(steps):
        step(i)
    return model, opt, TrainStateFallback(iteration=steps, consumed_train_samples=2 * steps)


def _state_of(model, opt) -> dict:
    """Weights and every optimizer state tensor, cloned, by position."""
    out = {f"w{i}": p.detach().clone() for i, p in enumerate(model.parameters())}
    for i, (_, main) in enumerate(opt.pairs):
        for k, v in opt._state_of[id(main)].get(main, {}).items():
            out[f"o{i}.{k}"] = v.clone() if torch.is_tensor(v) else v
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


# -- names ---------------------------------------------------------------------------------------
def test_megatron_names_and_tracker(tmp_path):
    assert checkpoint_dir_name(123) == "iter_0000123" and checkpoint_dir_name(0, True) == "release"
    assert legacy_rank_dir(1, 3, 4) == "mp_rank_01_003" and legacy_rank_dir(0, 0, 1) == "mp_rank_00"
    assert read_tracker(tmp_path) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("456\n")
    assert read_tracker(tmp_path) == (456, False)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert read_tracker(tmp_path) == (0, True)
    write_tracker(tmp_path, 7)
    assert read_tracker(tmp_path) == (7, False)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("iter7")
    with pytest.raises(ValueError, match="latest_checkpointed_iteration.txt.*'iter7'"):
        read_tracker(tmp_path)


@pytest.mark.parametrize("shape", [(7,), (5, 4), (3, 4, 5), (2, 3, 2, 3)])
def test_flat_range_boxes_tile_the_range_in_order(shape):
    n = torch.Size(shape).numel()
    index = torch.arange(n).view(shape)
    for start in range(n):
        for end in range(start, n + 1, max(1, n // 9)):
            boxes = flat_range_boxes(shape, start, end)
            flat = [index[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
                    for off, size in boxes]
            got = torch.cat(flat) if flat else torch.empty(0, dtype=torch.long)
            assert torch.equal(got, torch.arange(start, end)), (shape, start, end, boxes)
            assert len(boxes) <= 2 * (len(shape) - 1) + 1
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        flat_range_boxes(shape, 0, n + 1)


def test_tensor_layout_maps_fc1_halves_and_layer_axis():
    lay = TensorLayout("k", (4, 256, 64), 3, (256, 64), 0, 2, 1, 2, False)
    assert lay.boxes((0, 0), (128, 64)) == [((0, 0), (1, 64, 64), (3, 64, 0)),
                                            ((64, 0), (1, 64, 64), (3, 192, 0))]
    row_parallel = TensorLayout("p", (4, 64, 64), 0, (64, 64), 1, 1, 1, 2, False)
    assert row_parallel.boxes((3, 5), (1, 7)) == [((3, 5), (1, 1, 7), (0, 3, 37))]


MEGATRON_KEYS = {   # megatron-core 0.16.1, local spec, 2 layers, untied: sharded keys and shapes
    "embedding.word_embeddings.weight": (512, 64),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 64),
    "decoder.layers.self_attention.linear_qkv.weight": (2, 128, 64),
    "decoder.layers.self_attention.linear_proj.weight": (2, 64, 64),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 64),
    "decoder.layers.mlp.linear_fc1.weight": (2, 256, 64),
    "decoder.layers.mlp.linear_fc2.weight": (2, 64, 128),
    "decoder.final_layernorm.weight": (64,),
    "output_layer.weight": (512, 64),
}


def test_sharded_keys_are_megatron_cores():
    model = GPTModel(tiny_config(tie_embeddings=False))
    keys = {t.key: t.global_shape for t in model_sharded_state_dict(model, SINGLE)}
    assert keys == MEGATRON_KEYS
    objects = {o.unique_key for o in extra_state_objects(model, SINGLE)}
    assert "decoder.layers.mlp.linear_fc1._extra_state/shard_1_2" in objects and len(objects) == 8
    tied = GPTModel(tiny_config())
    assert "output_layer.weight" not in {t.key for t in model_sharded_state_dict(tied, SINGLE)}


# -- the files -------------------------------------------------------------------------------------
def test_torch_dist_files_open_with_pytorch_alone(tmp_path):
    model, opt, state = _trained()
    save_checkpoint(tmp_path, state, model, opt)
    d = tmp_path / "iter_0000002"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(d)) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert json.loads((d / "metadata.json").read_text()) == MEGATRON_METADATA
    mtimes = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    assert mtimes["metadata.json"] == max(mtimes.values())   # written last
    common = torch.load(d / "common.pt", weights_only=True)
    assert common["iteration"] == 2 and common["train_state"]["consumed_train_samples"] == 4
    torch.save(model.decoder.layers[1].self_attention.linear_qkv.weight.detach(), tmp_path / "qkv.pt")
    script = textwrap.dedent(f"""
        import sys, warnings, torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        warnings.simplefilter("ignore")
        dcp_to_torch_save({str(d)!r}, {str(tmp_path / 'plain.pt')!r})
        plain = torch.load({str(tmp_path / 'plain.pt')!r}, weights_only=True)
        qkv = torch.load({str(tmp_path / 'qkv.pt')!r}, weights_only=True)
        assert torch.equal(plain["decoder.layers.self_attention.linear_qkv.weight"][1], qkv)
        assert not any(m.startswith("tinytron") for m in sys.modules)
        print(sorted(k for k in plain if k.startswith("optimizer.state.exp_avg.")))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight" in out.stdout


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_async_save_writes_what_sync_save_writes(tmp_path, mode):
    from tests.test_checkpoint_dist import plain_tensors

    model, opt, state = _trained()
    save_checkpoint(tmp_path / "sync", state, model, opt)
    manager = CheckpointManager(CheckpointConfig(save=str(tmp_path / "async"), async_save=True,
                                                 async_mode=mode), SINGLE)
    manager.save(state, model, opt)
    assert manager.saver.in_flight and read_tracker(tmp_path / "async") is None
    stats = manager.finalize(blocking=True)
    assert stats["background_s"] > 0 and read_tracker(tmp_path / "async") == (2, False)
    a, b = (plain_tensors(tmp_path / p / "iter_0000002") for p in ("sync", "async"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _trainer(out: Path, *argv: str, timeout: int = 300) -> str:
    """`python -m tinytron.train ARGV` with two OpenMP threads, in its own session: on a timeout
    the whole group (a forked writer too) is killed and the test fails instead of hanging."""
    proc = subprocess.Popen([sys.executable, "-m", "tinytron.train", *argv],
                            cwd=Path(__file__).resolve().parents[1], start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="2"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        log, _ = proc.communicate()
        pytest.fail(f"the trainer did not finish within {timeout} s: {log[-1500:]}")
    assert proc.returncode == 0, log[-3000:]
    return log


def test_trainer_async_save_in_process_mode_finishes_and_its_checkpoint_resumes(tmp_path):
    """A forked writer with OpenMP threads in the parent: the save completes and loads."""
    from tests.train_workers import corpus, read_losses

    job = ["--config", "configs/tiny.toml", "--data.data_path", corpus(tmp_path, 4),
           "--training.train_iters", "4", "--training.save_interval", "2",
           "--training.micro_batch_size", "2", "--training.global_batch_size", "2",
           "--training.eval_interval", "none", "--training.log_interval", "1",
           "--scheduler.lr_warmup_iters", "0", "--logging.progress_bar", "false",
           "--optimizer.use_distributed_optimizer", "true", "--checkpoint.async_save", "true",
           "--checkpoint.async_mode", "process"]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    log = _trainer(first, *job, "--checkpoint.save", str(first))
    assert "iteration 2 queued" in log and read_tracker(first) == (4, False)
    assert all((first / checkpoint_dir_name(i) / "metadata.json").is_file() for i in (2, 4))
    _trainer(resumed, *job, "--checkpoint.save", str(resumed), "--checkpoint.load", str(first),
             "--checkpoint.ckpt_step", "2")
    a, b = read_losses(str(first / "log.jsonl")), read_losses(str(resumed / "log.jsonl"))
    assert sorted(b) == [3, 4] and all(b[i] == a[i] for i in b), (a, b)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_writer_stuck_in_the_file_system_fails_the_save_in_one_line(tmp_path, mode):
    """common.pt is a FIFO nobody reads: the writer's open() blocks, as on a hung mount."""
    from tinytron.checkpoint import AsyncSaver, CheckpointSaveError
    from tinytron.checkpoint._common import CheckpointGroups
    from tinytron.checkpoint.sharded_keys import ShardedTensor
    from tinytron.checkpoint.torch_dist import SaveRequest

    stuck = tmp_path / "iter_0000002.tmp"
    stuck.mkdir()
    os.mkfifo(stuck / "common.pt")
    saver = AsyncSaver(CheckpointGroups(SINGLE), mode, timeout_s=1.0)
    request = SaveRequest(stuck, [ShardedTensor("w", torch.ones(5), (5,), (0,))], [],
                          saver.comm, common={"iteration": 2})
    saver.schedule(request)
    pid = saver.pending.writer.pid if mode == "process" else None
    try:
        with pytest.raises(CheckpointSaveError) as e:
            saver.finalize(blocking=True)
    finally:   # a reader lets a writer still blocked in open() go (it then sees a broken pipe)
        os.close(os.open(stuck / "common.pt", os.O_RDONLY | os.O_NONBLOCK))
    message = str(e.value)
    assert "\n" not in message and message.startswith("timed out"), message
    assert str(stuck) in message and "within 1 s" in message and "async_timeout_s" in message
    assert not saver.in_flight and not (stuck / ".metadata").exists()
    if pid is not None:
        assert "killed" in message
        with pytest.raises(ChildProcessError):   # killed and reaped: no process is left behind
            os.waitpid(pid, os.WNOHANG)
    again = SaveRequest(tmp_path / "next", [ShardedTensor("w", torch.ones(5), (5,), (0,))], [],
                        saver.comm, common={"iteration": 3})
    (tmp_path / "next").mkdir()
    saver.schedule(again)
    assert saver.finalize(blocking=True)["background_s"] > 0   # the saver works on


# -- bad input ---------------------------------------------------------------------------------------
def _corrupt(d: Path, what: str) -> str:
    """Damage one iteration directory; return the text the error must contain."""
    shard = d / "__0_0.distcp"
    if what == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return "__0_0.distcp: truncated"
    if what == "corrupted":
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        shard.write_bytes(bytes(raw))
        return "__0_0.distcp: content does not match checksums.json"
    if what == "no_common":
        (d / "common.pt").unlink()
        return "common.pt: missing"
    if what == "tracker":
        (d.parent / "latest_checkpointed_iteration.txt").write_text("9")
        return "names iteration 9, but .*iter_0000009 does not exist"
    raise AssertionError(what)


@pytest.mark.parametrize("what", ["truncated", "corrupted", "no_common", "tracker"])
def test_bad_checkpoint_is_refused_and_nothing_is_loaded(tmp_path, what):
    model, opt, state = _trained()
    save_checkpoint(tmp_path, state, model, opt, crc_checksums=what == "corrupted")
    message = _corrupt(tmp_path / "iter_0000002", what)
    fresh, fresh_opt, _ = _trained(steps=1, seed=3)
    before = _state_of(fresh, fresh_opt)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path, fresh, fresh_opt)
    assert _equal(before, _state_of(fresh, fresh_opt))


def test_config_mismatch_names_the_field(tmp_path):
    model, opt, state = _trained()
    save_checkpoint(tmp_path, state, model, opt)
    other = GPTModel(model.config.replace(rotary_base=500000))
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ValueError, match="rotary_base is 10000 in the checkpoint and 500000"):
        load_checkpoint(tmp_path, other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


def test_legacy_corrupted_file_names_it(tmp_path):
    model, opt, state = _trained()
    save_checkpoint(tmp_path, state, model, opt, ckpt_format="torch")
    path = tmp_path / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="mp_rank_00/model_optim_rng.pt: cannot be read"):
        load_checkpoint(tmp_path, GPTModel(model.config))


def test_legacy_round_trip_one_process(tmp_path):
    model, opt, state = _trained()
    save_checkpoint(tmp_path, state, model, opt, ckpt_format="torch")
    fresh, fresh_opt, _ = _trained(steps=1, seed=3)
    loaded = load_checkpoint(tmp_path, fresh, fresh_opt)
    assert loaded.iteration == 2 and _equal(_state_of(model, opt), _state_of(fresh, fresh_opt))


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_finetune_loads_weights_only(tmp_path, ckpt_format):
    """Weights only; the iteration and the samples restart, the FLOPs done are kept, as
    Megatron's load_checkpoint returns them in every case (checkpointing.py:1877)."""
    model, opt, state = _trained()
    state.num_floating_point_operations_so_far = 1.5e12
    save_checkpoint(tmp_path, state, model, opt, ckpt_format=ckpt_format)
    fresh, fresh_opt, _ = _trained(steps=0, seed=3)
    loaded = load_checkpoint(tmp_path, fresh, fresh_opt, finetune=True)
    assert loaded.iteration == 0 and loaded.consumed_train_samples == 0
    assert loaded.num_floating_point_operations_so_far == 1.5e12
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    assert not fresh_opt._state_of[id(fresh_opt.pairs[0][1])]   # fresh optimizer state


# -- configuration, hooks, converter ---------------------------------------------------------------
def test_checkpoint_config_refuses_bad_values():
    with pytest.raises(ValueError, match="ckpt_format must be"):
        CheckpointConfig(ckpt_format="zarr")
    with pytest.raises(ValueError, match="async_save needs ckpt_format='torch_dist'"):
        CheckpointConfig(ckpt_format="torch", async_save=True)
    with pytest.raises(ValueError, match="async_mode must be one of"):
        CheckpointConfig(async_mode="gpu")
    with pytest.raises(ValueError, match="async_timeout_s must be > 0 seconds, got 0"):
        CheckpointConfig(async_timeout_s=0)


def test_hooks_start_fresh_and_resume(tmp_path):
    save, load, finalize = make_checkpoint_hooks(CheckpointConfig(), SINGLE)
    model, opt, state = _trained()
    assert load(model, opt, None) is None and save(state, model, opt, None) is None
    finalize(True)
    hooks = make_checkpoint_hooks(CheckpointConfig(save=str(tmp_path), load=str(tmp_path),
                                                   async_save=True), SINGLE)
    assert hooks.load_checkpoint_fn(model, opt, None) is None   # empty root: start fresh
    hooks.save_checkpoint_fn(state, model, opt, None)
    hooks.finalize_async_save_fn(True)
    assert hooks.load_checkpoint_fn(model, opt, None).iteration == 2
    strict = make_checkpoint_hooks(CheckpointConfig(load=str(tmp_path / "none"),
                                                    exit_on_missing_checkpoint=True), SINGLE)
    with pytest.raises(ValueError, match="no checkpoint to load"):
        strict.load_checkpoint_fn(model, opt, None)


def test_convert_round_trip_and_errors(tmp_path, capsys):
    from tinytron.checkpoint.convert import main
    from tinytron.model.hf import load_hf_llama

    model, opt, state = _trained()
    save_checkpoint(tmp_path / "ckpt", state, model, opt)
    assert main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    hf, _ = load_hf_llama(tmp_path / "hf", seq_length=model.config.seq_length)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), hf.parameters()))
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = GPTModel(model.config.replace(seed=9))
    load_model_weights(tmp_path / "back", back)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), back.parameters()))
    save_model_weights(model, tmp_path / "weights")   # Megatron-style: no config inside
    assert main(["to-hf", str(tmp_path / "weights"), str(tmp_path / "x")]) == 2
    assert "--num-attention-heads" in capsys.readouterr().err
    assert main(["to-hf", str(tmp_path / "weights"), str(tmp_path / "hf2"),
                 "--num-attention-heads", "4"]) == 0
    assert main(["to-hf", str(tmp_path / "missing"), str(tmp_path / "y")]) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_async_save_of_cuda_state_stages_to_pinned_memory(tmp_path, mode):
    from tinytron.checkpoint.async_save import stage_tensors
    from tinytron.checkpoint.sharded_keys import ShardedTensor

    staged = stage_tensors([ShardedTensor("k", torch.ones(4, device="cuda"), (4,), (0,))], mode)
    assert staged[0].data.device.type == "cpu" and staged[0].data.is_pinned()
    _, model, opt, step = tiny_training()
    model.cuda()
    opt = type(opt)(torch.optim.AdamW(model.parameters(), lr=1e-2), clip_grad=1.0)
    tokens = torch.randint(0, 512, (2, 17), device="cuda")
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    opt.step()
    manager = CheckpointManager(CheckpointConfig(save=str(tmp_path), async_save=True,
                                                 async_mode=mode), SINGLE)
    manager.save(TrainStateFallback(iteration=1), model, opt)
    expected = [p.detach().clone() for p in model.parameters()]
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()   # training goes on
    opt.step()
    manager.finalize(blocking=True)
    fresh = GPTModel(model.config.replace(seed=9)).cuda()
    load_model_weights(tmp_path, fresh)
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), expected))


@pytest.mark.parametrize("chunks, message", [
    ([((0,), 3), ((2,), 3)], "overlapping chunks"),
    ([((0,), 2), ((3,), 2)], "cover 4 of 5 elements"),
])
def test_sharding_validation_catches_overlaps_and_gaps(tmp_path, chunks, message):
    from tinytron.checkpoint._common import CheckpointGroups
    from tinytron.checkpoint.formats import CheckpointSaveError
    from tinytron.checkpoint.sharded_keys import ShardedTensor
    from tinytron.checkpoint.torch_dist import SaveRequest

    tensors = [ShardedTensor("w", torch.ones(n), (5,), off) for off, n in chunks]
    tensors.append(ShardedTensor("w", torch.ones(5), (5,), (0,), is_main=False))   # not written
    with pytest.raises(CheckpointSaveError, match=message):
        SaveRequest(tmp_path, tensors, [], CheckpointGroups(SINGLE), {}).plan()


def _fake_megatron_class(qualified: str):
    """An Enum importable under one of Megatron's names, so a pickle names it as Megatron's does."""
    import enum
    import types

    module_name, _, name = qualified.rpartition(".")
    cls = enum.Enum(name, {"auto": 5, "flash": 1})
    cls.__module__ = module_name
    module = sys.modules.setdefault(module_name, types.ModuleType(module_name))
    setattr(module, name, cls)
    return cls, module_name


class _RunsCode:
    """A pickle that, when unpickled in full, creates a marker file (what a hostile file could do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_convert_reads_megatron_args_safely(tmp_path, capsys):
    """Megatron's common.pt holds an args Namespace with its own enums: read without pickle."""
    import argparse

    from tinytron.checkpoint.convert import main, read_checkpoint_model

    model = GPTModel(tiny_config())
    backend, module = _fake_megatron_class("megatron.core.transformer.enums.AttnBackend")
    try:
        args = argparse.Namespace(num_attention_heads=4, group_query_attention=True,
                                  num_query_groups=2, norm_epsilon=1e-5, rotary_base=10000,
                                  seq_length=64, attention_backend=backend.auto,
                                  params_dtype=torch.bfloat16)
        for name, extra in (("megatron", {}), ("unknown", {"new": _fake_megatron_class(
                "megatron.core.future.NewThing")[0].flash}), ("hostile", {
                "x": _RunsCode(tmp_path / "ran")})):
            save_model_weights(model, tmp_path / name)
            torch.save({"args": argparse.Namespace(**vars(args), **extra), "iteration": 5,
                        "checkpoint_version": 3.0}, tmp_path / name / "common.pt")
        got = read_checkpoint_model(tmp_path / "megatron")   # no flags: the heads come from args
        assert (got.config.num_attention_heads, got.config.num_query_groups) == (4, 2)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), got.parameters()))
        assert main(["to-hf", str(tmp_path / "unknown"), str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert "megatron.core.future.NewThing" in err and "--trust-pickle" in err
        assert read_checkpoint_model(tmp_path / "unknown", trust_pickle=True).config.num_query_groups == 2
        assert read_checkpoint_model(tmp_path / "unknown", num_attention_heads=4).config.num_query_groups == 2
    finally:
        for name in [m for m in sys.modules if m.startswith("megatron.core.")
                     and not hasattr(sys.modules[m], "__file__")]:
            del sys.modules[name]
    with pytest.raises(ValueError, match="makedirs"):   # refused, and nothing was run
        read_checkpoint_model(tmp_path / "hostile")
    assert not (tmp_path / "ran").exists()
