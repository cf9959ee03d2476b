"""Chapter 06 on CUDA: the RNG replay with CUDA generators, and offload through pinned buffers and
side streams (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tinytron.main_loop.memory_meter import LiveBytesMeter
from tinytron.model.config import tiny_config
from tinytron.model.gpt import GPTModel
from tinytron.parallel import ParallelGrid
from tinytron.parallel.rng import RNGStatesTracker, model_parallel_seed
from tinytron.recompute import apply_recompute, checkpoint
from tinytron.recompute.recompute import MODES


@pytest.mark.gpu
def test_cuda_dropout_masks_replay_and_the_cuda_rng_is_left_alone():
    torch.cuda.manual_seed(0)
    x = torch.ones(64, 64, device="cuda", requires_grad=True)
    masks = []

    def block(t):
        y = torch.nn.functional.dropout(t, 0.5, training=True)
        masks.append(y != 0)
        return y

    checkpoint(block, False, x).sum().backward()
    after = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(0)
    torch.nn.functional.dropout(torch.ones(64, 64, device="cuda"), 0.5, training=True)
    assert torch.equal(masks[0], masks[1])
    assert torch.equal(after, torch.cuda.get_rng_state())


def _run(config, steps=2):
    grid = ParallelGrid.single()
    tracker = model_parallel_seed(1234, grid, RNGStatesTracker("cuda"))
    model = GPTModel(config, grid, device="cuda", rng_tracker=tracker)
    manager = apply_recompute(model)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length),
                           generator=torch.Generator().manual_seed(0)).cuda()
    for _ in range(steps):
        with LiveBytesMeter("cuda") as meter:
            loss = model(tokens, labels=tokens).mean()
            held = meter.current
            loss.backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, held, manager


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["selective core_attn", "full uniform k=3", "full block k=2",
                                  "offload", "selective + offload"])
def test_cuda_modes_match_no_recompute(mode):
    base = tiny_config(num_layers=4, dropout=0.1)
    ref_loss, ref_grads, ref_held, _ = _run(base)
    loss, grads, held, manager = _run(base.replace(**MODES[mode]))
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), mode
    if manager is not None:
        assert manager.streams.cuda and manager.pool.pinned
        moved = sum(manager.offloaded_bytes.values()) // 2  # two micro-batches counted
        assert held < ref_held and ref_held - held >= moved // 2
