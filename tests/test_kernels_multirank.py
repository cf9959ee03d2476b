"""Appendix C on a two-rank gloo world (kernels under Triton's interpreter): the vocab-parallel
cross-entropy at TP 2 equals appendix A's and F.cross_entropy; the DistributedOptimizer's fused AdamW
at DP 2 equals its _foreach_ step; the model with kernels='triton' at TP 2 + SP equals the
one-process torch model. One world runs every check.
"""

from __future__ import annotations

import pytest

from tinytron.kernels import HAS_TRITON, INTERPRET
from tinytron.launch import run_on_ranks

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the `kernels` extra)"),
              pytest.mark.skipif(not INTERPRET, reason="CPU ranks need Triton's interpreter")]


@pytest.fixture(scope="module")
def two():
    from tests.kernels_workers import world_of_2

    return run_on_ranks(world_of_2, 2, timeout=300)


def test_vocab_parallel_cross_entropy_tp2_equals_unfused(two):
    for res in two:
        fp32, bf16 = res["ce_fp32"], res["ce_bf16"]
        assert max(fp32[k] for k in ("loss_vs_unfused", "grad_vs_unfused", "loss_vs_full",
                                     "grad_vs_full")) < 1e-5, fp32
        assert bf16["loss_dtype"] == "torch.float32"
        assert bf16["loss_vs_unfused"] < 1e-5 and bf16["grad_vs_unfused"] < 2 ** -6, bf16


def test_distributed_optimizer_fused_adamw_dp2(two):
    for res in two:
        d = res["distopt"]
        assert d["fused"] and d["steps_equal"]
        assert d["state_gap"] < 1e-5, d
        assert d["param_gap"] < 2 ** -7, d  # bf16 params: at most a rounding apart


def test_model_triton_kernels_tp2_sp_equal_single_process_torch(two):
    for res in two:
        assert res["model_tp"]["loss_gap"] < 1e-5 and res["model_tp"]["grad_gap"] < 1e-5, res
