"""Appendix A on real gloo worlds: every TP layer == dense (2 and 4 ranks, SP on/off), vocab CE ==
F.cross_entropy, CP attention (all-gather and ring) == full attention, p2p round trips, grids == the pure layout, RNG streams.

Each world is started once (a module-scoped fixture) and runs all its checks in one launch.
"""

from __future__ import annotations

import pytest

from tests.parallel_workers import world_of_2, world_of_4
from tinytron.launch import run_on_ranks

TOL = 1e-5


@pytest.fixture(scope="module")
def two():
    return run_on_ranks(world_of_2, 2, timeout=180)


@pytest.fixture(scope="module")
def four():
    return run_on_ranks(world_of_4, 4, timeout=240)


@pytest.mark.parametrize("world", ["two", "four"])
def test_tp_mlp_equals_dense_with_and_without_sp(world, request):
    for res in request.getfixturevalue(world):
        assert max(res["mlp"]) < TOL, res["mlp"]


@pytest.mark.parametrize("world", ["two", "four"])
def test_vocab_embedding_and_cross_entropy_equal_dense(world, request):
    for res in request.getfixturevalue(world):
        for key in ("vocab", "vocab_sp"):
            assert max(res[key].values()) < TOL, (key, res[key])


@pytest.mark.parametrize("world", ["two", "four"])
def test_parameter_attributes_and_layout_invariant_init(world, request):
    tp = {"two": 2, "four": 4}[world]
    for res in request.getfixturevalue(world):
        flags = res["attrs"]["flags"]
        assert flags["col.weight"] == (True, 0, (12 // tp, 8))
        assert flags["col.bias"] == (True, 0, (12 // tp,))
        assert flags["row.weight"] == (True, 1, (8, 12 // tp))
        assert flags["row.bias.sp"] == (False, True)  # replicated, grad all-reduced under SP
        assert flags["emb.weight"] == (True, 0, (16 // tp, 8))
        assert res["attrs"]["init_invariant"]


@pytest.mark.parametrize("world", ["two", "four"])
def test_sequence_parallel_regions_backward(world, request):
    for res in request.getfixturevalue(world):
        assert res["sp_regions"] == 0.0


@pytest.mark.parametrize("world", ["two", "four"])
def test_context_parallel_attention_equals_full(world, request):
    """All-gather (causal and not) and ring attention: out and q/k/v grads equal full attention."""
    for res in request.getfixturevalue(world):
        assert len(res["cp"]) == {"two": 3, "four": 4}[world] and max(res["cp"]) < TOL, res["cp"]


def test_cp_gather_restores_natural_order(two):
    assert all(res["cp_gather"] for res in two)


@pytest.mark.parametrize("world", ["two", "four"])
def test_pipeline_stages_reproduce_unsplit_model(world, request):
    results = request.getfixturevalue(world)
    assert all(res["pp"]["grad_err"] < 1e-6 for res in results)
    assert abs(results[-1]["pp"]["loss"] - results[-1]["pp"]["loss_ref"]) < 1e-6


@pytest.mark.parametrize("world,n", [("two", 2), ("four", 4)])
def test_p2p_round_trip_wraps_around_the_ring(world, n, request):
    for r, res in enumerate(request.getfixturevalue(world)):
        for method in ("batched", "single"):  # one batch; single isend/irecv, even/odd order
            from_prev, from_next, ring = res["p2p"][method]
            assert from_prev == (r - 1) % n  # the activation of the previous stage
            assert from_next == -float((r + 1) % n)  # the gradient of the next stage
            assert ring == (r - 1) % n
        ring, grad, names = res["p2p"]["posted"]  # overlap_p2p_comm: handles, waited later
        assert ring == (r - 1) % n and grad == -float((r + 1) % n)
        assert names == ["recv_prev", "send_next", "recv_next", "send_prev"]


def test_grid_with_sizes_not_fitting_the_world_raises(two):
    for res in two:
        assert res["bad_grid"] == "world_size 2 is not divisible by tp*cp*pp = 2*1*2 = 4"


def test_grids_match_pure_layout(two, four):
    assert all(res["grid"] for res in two + four)
    assert [res["first_last"] for res in two] == [(True, False), (False, True)]
    assert [res["embd"] for res in four] == [[0, 2], [1, 3], [0, 2], [1, 3]]


@pytest.mark.parametrize("world", ["two", "four"])
def test_rng_streams_across_tp_ranks(world, request):
    results = request.getfixturevalue(world)
    tp_ranks = [res["rng"] for res in results[:2]]  # ranks 0, 1: the first TP group in both worlds
    assert tp_ranks[0]["default"] == tp_ranks[1]["default"]
    assert tp_ranks[0]["dp"] == tp_ranks[1]["dp"]
    assert tp_ranks[0]["tp"] != tp_ranks[1]["tp"]
    assert all(res["rng"]["replayed"] == res["rng"]["tp"] for res in results)
    if world == "four":  # tp2 x cp2: CP ranks 0 and 2 share tp rank 0, so the same TP stream
        assert results[0]["rng"]["tp"] == results[2]["rng"]["tp"]
