"""Chapter 01's param_sync_func: when the schedules launch each chunk's parameter all-gather.

The real schedules run on a 4-rank gloo world with one recording callable per chunk; the calls
each rank made, as (chunk, virtual micro-batch step), are compared with Megatron's rule, written
out below from megatron/core/pipeline_parallel/schedules.py at e03878b5f:

- :1161-1163, chunks 0 and 1 are launched before the warmup (step 0, before any forward);
- :1283-1296, before the forward of virtual micro-batch k, rank r takes j = k + r; if j is below
  m*v and is the first micro-batch of its chunk (micro-batch id 0 in the table), chunk id(j) + 1
  is launched when 1 < id(j) + 1 < v;
- :1062-1067 and :2043-2045, a forward-only call sets grad_sync_func and param_sync_func to None
  for its duration and puts them back at the end;
- forward_backward_no_pipelining (:634) and forward_backward_pipelining_without_interleaving
  (:2089) never read param_sync_func.
"""

from __future__ import annotations

import pytest

from tinytron.launch import run_on_ranks

from tests import main_loop_schedule_workers as workers


def megatron_schedule_table(m: int, v: int, g: int) -> list[tuple[int, int]]:
    """(micro-batch id, chunk id) per forward virtual micro-batch (schedules.py:916-944)."""
    table = []
    for start in range(0, m, g):
        end = min(start + g, m)
        table += [(mb, c) for c in range(v) for mb in range(start, end)]
    return table


def megatron_param_sync_calls(p: int, r: int, v: int, m: int, g: int | None) -> list:
    """Megatron's (chunk, step) launches on pipeline rank r of an interleaved training call."""
    g = g or p  # microbatch_group_size_per_vp_stage defaults to the pipeline size
    table, total = megatron_schedule_table(m, v, g), m * v
    calls = [(0, 0), (1, 0)]  # schedules.py:1161-1163, before the warmup
    for k in range(total):  # forward_step_helper_preprocess of virtual micro-batch k
        j = k + r
        if j < total and table[j][0] == 0:  # is_first_microbatch_for_model_chunk(j)
            chunk = table[j][1] + 1
            if 1 < chunk < v:
                calls.append((chunk, k))
    return calls


@pytest.fixture(scope="module")
def world():
    return run_on_ranks(workers.param_sync_world_checks, 4, timeout=600)


TRAINING = [n for n, a in workers.PARAM_SYNC_CASES.items() if a[1] and not a[5]]
FORWARD_ONLY = [n for n, a in workers.PARAM_SYNC_CASES.items() if a[1] and a[5]]


def test_the_rule_launches_inside_the_schedule():
    """The settings below reach the in-schedule launches, not only the two before the warmup."""
    assert megatron_param_sync_calls(2, 0, 4, 4, None) == [(0, 0), (1, 0), (2, 2), (3, 4)]
    assert megatron_param_sync_calls(2, 1, 4, 4, None) == [(0, 0), (1, 0), (2, 1), (3, 3)]
    assert megatron_param_sync_calls(4, 3, 3, 8, None) == [(0, 0), (1, 0), (2, 1)]


@pytest.mark.parametrize("case", TRAINING)
def test_interleaved_launches_where_megatron_does(world, case):
    p, v, m, g, _, _ = workers.PARAM_SYNC_CASES[case]
    for res in world:
        got = [(c, k) for c, k, _ in res[case]["calls"]]
        assert got == megatron_param_sync_calls(p, res[case]["rank"], v, m, g), (case, res[case])
        assert all(n == 0 for *_, n in res[case]["calls"])  # start_param_sync takes no args
        assert res[case]["forwards"] == m * v
        assert res[case]["restored"]


@pytest.mark.parametrize("case", FORWARD_ONLY)
def test_forward_only_launches_none_and_restores_the_callbacks(world, case):
    _, v, m, _, _, _ = workers.PARAM_SYNC_CASES[case]
    for res in world:
        assert res[case]["calls"] == []
        assert res[case]["forwards"] == m * v
        assert not any(res[case]["held_during_forwards"])  # off while the forwards ran
        assert res[case]["restored"]  # the same list objects are back on the config


@pytest.mark.parametrize("case", ["1f1b_pp2", "1f1b_pp4", "no_pipelining"])
def test_non_interleaved_schedules_never_call_it(world, case):
    _, _, m, _, _, _ = workers.PARAM_SYNC_CASES[case]
    for res in world:
        assert res[case]["calls"] == []
        assert res[case]["forwards"] == m
        assert all(res[case]["held_during_forwards"]) and res[case]["restored"]


@pytest.mark.parametrize("case", ["loop_interleaved", "loop_1f1b"])
def test_the_loops_start_param_sync_runs_through_the_schedule(world, case):
    """build_schedule_config hands each DDP chunk's start_param_sync (the bare one for one chunk)
    and the real all-gathers it launches leave the gradients bit for bit as without it."""
    for res in world:
        assert res[case]["handed"] and res[case]["same_grads"], res[case]


def test_distributed_optimizer_over_chunks_gathers_through_the_schedule(world):
    """Chapter 02's DistributedOptimizer over the v = 3 chunks of PP 2 x DP 2, with overlapped,
    aligned gathers: after the first step (which runs without pre-hooks, as Megatron's does)
    every bucket group's all-gather of every chunk is dispatched by the schedule's
    param_sync_func — none on demand by a forward pre-hook — and three steps give the plain
    optimizer's weights bit for bit (fp32, no clipping: the same sums, elementwise Adam)."""
    for res in world:
        r = res["loop_distopt"]
        assert (r["type"], r["plain_type"]) == ("DistributedOptimizer", "MixedPrecisionOptimizer")
        assert r["same_params"], r["max_diff"]
        for it in (1, 2):
            launched = [(c, sched) for i, c, is_async, sched in r["gathers"] if i == it and is_async]
            expected = [(c, True) for c, n in enumerate(r["groups"]) for _ in range(n)]
            assert sorted(launched) == expected, (it, r["gathers"])
        assert not [g for g in r["gathers"] if g[0] == 0 and g[2]]  # the first step: none
