"""The SP column-parallel linear keeps its local slice and RMSNorm its input and 1/rms, as
Megatron's do; the gradients are those of the previous (autograd-saved) code, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.megatron_saving_workers import _old_norm_forward, megatron_saving
from tinytron.launch import run_on_ranks
from tinytron.model.layers import RMSNorm


@pytest.fixture(scope="module")
def tp2():
    return run_on_ranks(megatron_saving, 2, 2, timeout=240)


def test_sp_linear_grads_bitwise_equal_to_gather_then_linear(tp2):
    for rank in tp2:
        for key, r in rank.items():
            if key.startswith("linear"):
                assert r["equal"], key


def test_sp_linear_saves_the_local_slice_not_the_gathered_input(tp2):
    for rank in tp2:
        for key, r in rank.items():
            if key.startswith("linear"):
                # old: gathered input (2 slices) + weight; new: the slice + weight
                assert r["old_bytes"] == 2 * r["slice_bytes"] + r["weight_bytes"], (key, r)
                assert r["new_bytes"] == r["slice_bytes"] + r["weight_bytes"], (key, r)


def test_tp2_sp_model_grads_bitwise_equal_to_old_code_and_it_saves_less(tp2):
    for rank in tp2:
        for dtype in ("torch.float32", "torch.bfloat16"):
            r = rank[f"model_{dtype}"]
            assert r["params"] > 10 and r["new_linear_equal"], (dtype, r)
            assert r["new_bytes"] < r["new_linear_bytes"] < r["old_bytes"], (dtype, r)
        # bf16 (the training dtype): the norm's x.float() sums its two input-gradient terms
        # in fp32 before the residual's is added, old and new alike: bitwise equal
        assert rank["model_torch.bfloat16"]["new_equal"], rank["model_torch.bfloat16"]
        # fp32: x.float() is x itself, so autograd used to add the norm's two terms and the
        # residual's in arrival order; the norm now adds its two first (one rounding apart)
        assert rank["model_torch.float32"]["new_rel"] < 1e-6, rank["model_torch.float32"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_keeps_input_and_rstd_and_grads_match_the_formula(dtype):
    gen = torch.Generator().manual_seed(0)
    x0 = (3 * torch.randn(16, 2, 64, generator=gen)).to(dtype)
    g = torch.randn(16, 2, 64, generator=gen).to(dtype)
    norm = RMSNorm(64, dtype=dtype)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(64, generator=gen).to(dtype))
    out = []
    for forward in (_old_norm_forward, RMSNorm.forward):
        x = x0.clone().requires_grad_(True)
        norm.weight.grad = None
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = forward(norm, x)
        y.backward(g)
        out.append((y.detach(), x.grad, norm.weight.grad.clone(), saved))
    (y0, gx0, gw0, _), (y1, gx1, gw1, saved) = out
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    # what it keeps: x in its dtype, the weight, one fp32 1/rms per row
    assert [(tuple(t.shape), t.dtype) for t in saved] == [
        ((16, 2, 64), dtype), ((64,), dtype), ((16, 2, 1), torch.float32)]
