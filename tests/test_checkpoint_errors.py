"""Chapter 03 in one process: a bad load is one ValueError line naming the key and both shapes
(not DCP's CheckpointException, which is a BaseException), and a torch_dist checkpoint saved
without an optional part (RNG, optimizer) loads by default, as Megatron's does."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint_workers import tiny_training
from tinytron.checkpoint import load_checkpoint, load_model_weights, save_checkpoint, save_model_weights
from tinytron.checkpoint.resume import TrainStateFallback
from tinytron.model import GPTModel, tiny_config


@pytest.mark.parametrize("case", ["shape", "missing", "extra"])
def test_load_model_weights_error_is_one_line(tmp_path, case):
    config = tiny_config(tie_embeddings=case != "extra")
    save_model_weights(GPTModel(config), tmp_path)
    other = {"shape": config.replace(ffn_hidden_size=2 * config.ffn_hidden_size),
             "missing": config.replace(tie_embeddings=False), "extra": config.replace(
                 tie_embeddings=True)}[case]
    model = GPTModel(other.replace(seed=3))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as info:
        load_model_weights(tmp_path, model)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path) in message
    expected = {"shape": "'decoder.layers.mlp.linear_fc1.weight' has global shape (2, 256, 64) in "
                         "the checkpoint, the model needs (2, 512, 64)",
                "missing": "the checkpoint has no tensor 'output_layer.weight' (the model needs "
                           f"global shape ({config.vocab_size}, {config.hidden_size}))",
                "extra": f"the checkpoint has tensor 'output_layer.weight' of global shape "
                         f"({config.vocab_size}, {config.hidden_size}), which the model does not "
                         "have"}[case]
    assert expected in message, message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if case == "extra":   # Megatron's default strictness (assume_ok_unexpected) with strict=False
        load_model_weights(tmp_path, model, strict=False)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("skipped", ["no_save_rng", "no_save_optim"])
def test_checkpoint_without_an_optional_part_loads_by_default(tmp_path, fmt, skipped):
    _, model, opt, step = tiny_training()
    step(0)
    save_checkpoint(tmp_path, TrainStateFallback(iteration=1, consumed_train_samples=2), model,
                    opt, ckpt_format=fmt, **{skipped: True})
    _, model2, opt2, _ = tiny_training(seed=1)
    state = load_checkpoint(tmp_path, model2, opt2, ckpt_format=fmt)   # default options
    assert state.iteration == 1 and state.consumed_train_samples == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def _machine():
    from tinytron.reliability import RerunStateMachine

    return RerunStateMachine("validate_results")


def test_rerun_state_goes_into_every_torch_dist_checkpoint(tmp_path):
    """Steady state and a pending rerun both write Megatron's rerun_state_machine_state object;
    only a pending rerun is restored (checkpointing.py:1758-1772), through chapter 08's API."""
    import torch.distributed.checkpoint as dcp

    from tinytron.checkpoint import CheckpointConfig, CheckpointManager
    from tinytron.parallel import ParallelGrid
    from tinytron.reliability import RerunState

    _, model, opt, step = tiny_training()
    step(0)
    machine = _machine()
    for it, state in ((1, RerunState.NOT_RUNNING_YET), (2, RerunState.WILL_RERUN_FROM_CHECKPOINT)):
        machine.state, machine.current_iteration = state, it
        machine.suspicious_node, machine.max_values = "node-A", {"loss": 3.5}
        CheckpointManager(CheckpointConfig(save=str(tmp_path)), ParallelGrid.single(),
                          rerun_state_machine=machine).save(TrainStateFallback(iteration=it),
                                                            model, opt)
        d = tmp_path / f"iter_{it:07d}"
        keys = dcp.FileSystemReader(d).read_metadata().state_dict_metadata
        assert "rerun_state_machine_state/shard_0_1" in keys
        common = torch.load(d / "common.pt", weights_only=True)["rerun_state_machine"]
        assert common["state"] == int(state) and common["current_iteration"] == it
    for it, restored in ((1, False), (2, True)):
        fresh = _machine()
        CheckpointManager(CheckpointConfig(load=str(tmp_path), ckpt_step=it),
                          ParallelGrid.single(), rerun_state_machine=fresh).load(model, opt)
        assert (fresh.state == RerunState.WILL_RERUN_FROM_CHECKPOINT) == restored
        assert (fresh.state_dict() == machine.state_dict()) == restored
    disabled = tmp_path / "disabled"   # a disabled machine saves nothing, as in Megatron
    from tinytron.reliability import RerunStateMachine
    save_checkpoint(disabled, TrainStateFallback(iteration=1), model, opt)
    CheckpointManager(CheckpointConfig(save=str(disabled)), ParallelGrid.single(),
                      rerun_state_machine=RerunStateMachine("disabled")).save(
                          TrainStateFallback(iteration=2), model, opt)
    for it in (1, 2):
        keys = dcp.FileSystemReader(disabled / f"iter_{it:07d}").read_metadata().state_dict_metadata
        assert not any(k.startswith("rerun_state_machine") for k in keys)
