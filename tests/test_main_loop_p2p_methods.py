"""Every pipeline message is sent and received by the same p2p method, in every schedule.

NCCL runs `batch_isend_irecv` on the process group's communicator and a single `isend`/`irecv`
on another one, so a message posted batched at one end and single at the other never arrives;
gloo matches by peer and hides it. One 4-rank gloo world runs 1F1B and the interleaved
schedule (plain and overlapped, PP 2 and 4, batched and single) with torch's p2p entry points
wrapped (tests/p2p_method_workers.py), and every message's method and group are compared at
its two ends, in posting order per (sender, receiver). The method must also be the one
Megatron's config picks: `batch_isend_irecv` with `batch_p2p_comm` (its default), single ops
otherwise and always under `overlap_p2p_comm`
(megatron/core/pipeline_parallel/p2p_communication.py:374-378).
"""

from collections import defaultdict

import pytest
import torch

from tinytron.launch import run_on_ranks
from tests import p2p_method_workers as workers


@pytest.fixture(scope="module")
def world():
    return run_on_ranks(workers.p2p_method_world, 4, timeout=300)


def _messages(world, name):
    """{(src, dst): [(method, group ranks), ...]} as sent, and as received, in posting order."""
    sent, received = defaultdict(list), defaultdict(list)
    for r in world:
        for method, kind, src, dst, group in r[name]["log"]:
            (sent if kind == "isend" else received)[src, dst].append((method, group))
    return sent, received


def _expected_method(name) -> str:
    _, _, overlap, batch, _ = workers.LAYOUTS[name]
    return "single" if overlap or batch is False else "batched"


@pytest.mark.parametrize("name", list(workers.LAYOUTS))
def test_each_message_uses_one_method_at_both_ends(world, name):
    errors = {r[name]["error"] for r in world} - {None}
    assert not errors, errors
    sent, received = _messages(world, name)
    assert sent and sent.keys() == received.keys(), (sorted(sent), sorted(received))
    total = sum(len(v) for v in sent.values())
    assert all(len(sent[p]) == len(received[p]) for p in sent), "unequal message counts"
    mixed = [(src, dst, i, s[0], r[0]) for (src, dst), msgs in sent.items()
             for i, (s, r) in enumerate(zip(msgs, received[src, dst])) if s != r]
    assert not mixed, (f"{len(mixed)} of {total} messages posted differently at the two ends "
                       f"(src, dst, index, sent by, received by): {mixed[:4]}")
    methods = {m for msgs in sent.values() for m, _ in msgs}
    assert methods == {_expected_method(name)}, methods


@pytest.mark.parametrize("name", [n for n, a in workers.LAYOUTS.items() if a[0] == 2
                                  and _expected_method(n) == "single"])
def test_pp2_single_ops_give_each_direction_its_own_group(world, name):
    """Two stages: the two directions between a pair never share a communicator.

    Megatron posts one direction on the pipeline group and the other on the world group
    (p2p_communication.py:66-77), so NCCL cannot queue a send behind a receive of the other
    direction on one stream and deadlock.
    """
    sent, _ = _messages(world, name)
    directions = defaultdict(set)
    for (src, dst), msgs in sent.items():
        for _, group in msgs:
            directions[group, frozenset((src, dst))].add((src, dst))
    assert directions and all(len(d) == 1 for d in directions.values()), dict(directions)


def test_the_combination_megatron_forbids_is_refused():
    """batch_p2p_comm and overlap_p2p_comm both true: a ValueError naming both keys, at
    construction, at the schedule call (a config changed after construction) and in the p2p
    function itself."""
    from tinytron.main_loop import _schedule_checks as checks
    from tinytron.main_loop.schedules import ScheduleConfig
    from tinytron.parallel import ParallelGrid, communicate

    with pytest.raises(ValueError, match="batch_p2p_comm.*overlap_p2p_comm"):
        ScheduleConfig(overlap_p2p_comm=True, batch_p2p_comm=True)
    cfg = ScheduleConfig(overlap_p2p_comm=True)
    assert checks.batch_p2p(cfg) is False                     # overlapped: single ops
    assert checks.batch_p2p(ScheduleConfig()) is True          # Megatron's default: batched
    assert checks.batch_p2p(ScheduleConfig(batch_p2p_comm=False)) is False
    cfg.batch_p2p_comm = True
    with pytest.raises(ValueError, match="batch_p2p_comm.*overlap_p2p_comm"):
        checks.batch_p2p(cfg)
    with pytest.raises(ValueError, match="batch_p2p_comm.*overlap_p2p_comm"):
        communicate(ParallelGrid.single(), send_next=torch.ones(1), wait_on_reqs=False)


def test_trainer_configs_give_each_schedule_one_method():
    """Every configs/*.toml resolves; interleaved with overlap gets single ops, the rest the
    batch; parallel.batch_p2p_comm = true with overlap is one line naming both keys."""
    from pathlib import Path

    from tinytron.config import ConfigError, load_config

    seen = {}
    for path in sorted(Path(__file__).parents[1].glob("configs/*.toml")):
        cfg = load_config(path, [])
        tp, pp, vpp, cp = cfg.parallel.sizes()
        opts = cfg.resolve(tp * pp * cp).parallel.p2p_schedule_options()
        assert opts == {"overlap_p2p_comm": vpp > 1, "batch_p2p_comm": vpp == 1}, (path, opts)
        seen[path.name] = opts
    assert seen["pp2_vpp2.toml"] == {"overlap_p2p_comm": True, "batch_p2p_comm": False}
    with pytest.raises(ConfigError) as e:
        load_config(Path(__file__).parents[1] / "configs/pp2_vpp2.toml",
                    ["--parallel.batch_p2p_comm=true"]).resolve(2)
    assert "\n" not in str(e.value)
    assert "batch_p2p_comm" in str(e.value) and "overlap_p2p_comm" in str(e.value)
