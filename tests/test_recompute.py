"""Chapter 06 on one process: config checks, the RNG replay, bitwise parity of every mode,
measured activation bytes against the per-layer count, offload details."""

from __future__ import annotations

import pytest
import torch

from tinytron.model.config import tiny_config
from tinytron.model.gpt import GPTModel
from tinytron.parallel import ParallelGrid
from tinytron.parallel.rng import model_parallel_seed
from tinytron.recompute import (CheckpointWithoutOutput, FullRecompute, apply_recompute,
                                checkpoint)
from tinytron.recompute._workers import memory_by_mode
from tinytron.recompute.checkpoint import dropout_masks
from tinytron.recompute.recompute import MODES, train_steps


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
OFFLOAD = dict(fine_grained_activation_offloading=True, offload_modules=["core_attn"])


@pytest.mark.parametrize("fields, field", [
    (dict(recompute_granularity="partial"), "recompute_granularity"),
    (dict(recompute_granularity="full", recompute_method="random", recompute_num_layers=1),
     "recompute_method"),
    (dict(recompute_granularity="full", recompute_method="block"), "recompute_num_layers"),
    (dict(FULL, recompute_num_layers=3), "recompute_num_layers"),  # the model has 2 layers
    (dict(recompute_granularity="selective", recompute_method="uniform"), "recompute_method"),
    (dict(recompute_granularity="selective", recompute_num_layers=1), "recompute_num_layers"),
    (dict(recompute_method="uniform"), "recompute_method"),
    (dict(recompute_granularity="selective", recompute_modules=["moe"]), "recompute_modules"),
    (dict(recompute_granularity="selective", recompute_modules=["attention"]), "recompute_modules"),
    (dict(recompute_modules="core_attn"), "recompute_modules"),
    (dict(FULL, distribute_saved_activations=True, sequence_parallel=True),
     "distribute_saved_activations"),
    (dict(fine_grained_activation_offloading=True), "offload_modules"),
    (dict(OFFLOAD, offload_modules=["expert_fc1"]), "offload_modules"),
    (dict(OFFLOAD, offload_modules=["attn_proj"]), "offload_modules"),
    (dict(OFFLOAD, **FULL), "fine_grained_activation_offloading"),
    (dict(OFFLOAD, min_offloaded_tensor_size=-1), "min_offloaded_tensor_size"),
    (dict(recompute_granularity="selective", recompute_modules=["layernorm"],
          fine_grained_activation_offloading=True, offload_modules=["qkv_linear"]),
     "offload_modules"),
])
def test_bad_switches_raise_naming_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**fields)


def test_recompute_num_layers_beyond_a_stage_or_chunk_raises():
    config = tiny_config(num_layers=4, **dict(FULL, recompute_num_layers=3))
    config.check_layout(pp=1)
    with pytest.raises(ValueError, match="recompute_num_layers"):
        config.check_layout(pp=2)  # 2 layers per stage
    chunk = GPTModel(config, layer_range=(0, 2))
    with pytest.raises(ValueError, match="recompute_num_layers"):
        apply_recompute(chunk)


def test_model_refuses_to_train_without_apply_and_apply_only_once():
    config = tiny_config(num_layers=2, recompute_granularity="selective")
    model = GPTModel(config)
    tokens = torch.zeros(1, config.seq_length, dtype=torch.long)
    with pytest.raises(ValueError, match="apply_recompute"):
        model(tokens, labels=tokens)
    model.eval()
    model(tokens)  # evaluation stores nothing: no policy needed
    model.train()
    apply_recompute(model)
    model(tokens, labels=tokens).mean().backward()
    with pytest.raises(ValueError, match="already"):
        apply_recompute(model)


def test_checkpoint_replays_dropout_masks_and_leaves_the_rng_untouched():
    fwd, again, grad, state = dropout_masks(preserve_rng_state=True)
    assert torch.equal(fwd, again) and torch.equal(grad, fwd.float() * 2.0)
    torch.manual_seed(0)
    torch.nn.functional.dropout(torch.ones(12, 32), p=0.5, training=True)
    torch.rand(1000)
    assert torch.equal(state, torch.get_rng_state())


def test_without_the_rng_replay_the_masks_and_grads_differ():
    fwd, again, grad, _ = dropout_masks(preserve_rng_state=False)
    assert int((fwd != again).sum()) > 100
    assert not torch.equal(grad, fwd.float() * 2.0)
    # The same failure in the model: full recompute without the replay changes the grads.
    config = tiny_config(num_layers=2, dropout=0.1)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length))
    grads = []
    for replay in (None, False, True):
        model_parallel_seed(1234, ParallelGrid.single())
        model = GPTModel(config)
        if replay is not None:
            model.layer_runner = FullRecompute("uniform", 1, tracker=model.rng_tracker,
                                               preserve_rng_state=replay)
        model(tokens, labels=tokens).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert any(not torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert all(torch.equal(grads[0][n], grads[2][n]) for n in grads[0])


def test_every_mode_is_bitwise_equal_to_no_recompute_over_three_steps():
    base = tiny_config(num_layers=4, dropout=0.1)
    ref_losses, ref_grads, _ = train_steps(base, steps=3)
    ref_rng = torch.get_rng_state()
    for name, fields in MODES.items():
        losses, grads, _ = train_steps(base.replace(**fields), steps=3)
        assert torch.equal(losses, ref_losses), name
        assert torch.equal(torch.get_rng_state(), ref_rng), name  # the replay left no trace
        if name == "selective all three":
            # layernorm recompute sums the layer input's gradient in another order (page 2)
            for n in ref_grads:
                torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-7)
        else:
            assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads), name


def test_checkpoint_without_output_frees_and_refills_the_output():
    torch.manual_seed(0)
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    ref = torch.nn.functional.linear(torch.nn.functional.silu(x), w)
    ref.sum().backward()
    ref_gx, ref_gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(torch.nn.functional.silu, x)
    out = torch.nn.functional.linear(y, w)
    ckpt.discard_output_and_register_recompute(out)
    assert y.untyped_storage().nbytes() == 0
    out.sum().backward()
    assert torch.equal(x.grad, ref_gx) and torch.equal(w.grad, ref_gw)


def test_checkpoint_without_output_keeps_one_copy_of_the_recomputed_output():
    """After the recompute hook: the freed output and the recomputed one share one storage."""
    torch.manual_seed(0)
    x = torch.randn(256, 1024, requires_grad=True)        # 1 MiB of fp32 output
    w = torch.randn(16, 1024, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(lambda t: torch.nn.functional.silu(t) * 2.0, x)
    out = torch.nn.functional.linear(y, w)
    ctx = ckpt.ctx
    ckpt.discard_output_and_register_recompute(out)
    seen = {}

    def after_the_recompute(_grad):  # registered second: runs right after the recompute hook
        recomputed = ctx.outputs[0]
        seen["storages"] = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for t in (y, recomputed)}
        seen["values_equal"] = torch.equal(y, recomputed)

    out.register_hook(after_the_recompute)
    out.sum().backward()
    assert seen["values_equal"]
    assert list(seen["storages"].values()) == [256 * 1024 * 4], seen["storages"]


def test_checkpoint_passes_non_tensor_arguments_and_refuses_autograd_grad():
    x = torch.randn(5, requires_grad=True)
    y = checkpoint(lambda t, scale, none: t * scale, False, x, 3.0, None)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((5,), 3.0))
    y = checkpoint(lambda t: t.sin(), False, x)
    with pytest.raises(RuntimeError, match="backward"):
        torch.autograd.grad(y.sum(), x)


def test_measured_bytes_match_the_count_and_fall_in_order():
    measured = memory_by_mode(tp=1, micro_batch_size=4)
    for name, r in measured.items():
        assert abs(r["decoder"] / r["predicted"] - 1) < 0.03, (name, r)
    held = {n: r["decoder"] for n, r in measured.items()}
    peak = {n: r["peak"] for n, r in measured.items()}
    assert held["full uniform k=1"] < held["selective core_attn"] < held["none"]
    assert peak["full uniform k=1"] < peak["selective core_attn"] < peak["none"]
    # Offload keeps on the device exactly what it did not move, and the count agrees to the byte.
    assert held["none"] - held["offload"] == measured["offload"]["offloaded"] > 0
    assert measured["offload"]["decoder"] == measured["offload"]["predicted"]
    assert measured["none"]["decoder"] == measured["none"]["predicted"]


def test_offload_margin_threshold_pool_reuse_and_eval():
    config = tiny_config(num_layers=3, dropout=0.1, fine_grained_activation_offloading=True,
                         min_offloaded_tensor_size=1024,
                         offload_modules=["attn_norm", "core_attn", "mlp_norm"])
    model_parallel_seed(1234, ParallelGrid.single())
    model = GPTModel(config)
    manager = apply_recompute(model)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length))
    model(tokens, labels=tokens).mean().backward()
    groups, allocated = manager.last.groups, manager.pool.bytes_allocated
    assert [g.name for g in groups[:3]] == ["attn_norm", "core_attn", "mlp_norm"]
    assert all(g.offloaded == (g.layer != 2) for g in groups)  # the last layer is the margin
    # a norm keeps its input and 1/rms (B.2): the input goes, 1/rms (128 elements) stays
    assert all(len(g.slots) == 1 for g in groups if g.name != "core_attn")
    assert all(s is None for g in groups for s in g.slots)  # every slot released after use
    model(tokens, labels=tokens).mean().backward()
    assert manager.pool.bytes_allocated == allocated  # host buffers reused
    model.eval()
    with torch.no_grad():
        model(tokens)
    assert manager.current is None and not manager.waiting
