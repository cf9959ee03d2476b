"""The multi-rank harness: real gloo worlds on loopback, failures reported, hangs bounded."""

import os
import time

import pytest

from tinytron.launch import RankError, run_on_ranks
from tests import _rank_fns


def test_collectives_on_four_ranks():
    out = run_on_ranks(_rank_fns.collectives, 4, timeout=90)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    for o in out:
        assert o["world"] == 4 and o["env_rank"] == o["rank"]
        assert o["sum"] == 1 + 2 + 3 + 4
        assert o["gathered"] == [0.0, 1.0, 2.0, 3.0]
        assert o["bcast"] == 30.0
        assert o["from_left"] == (o["rank"] - 1) % 4


def test_failing_rank_is_reported_not_hung():
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        run_on_ranks(_rank_fns.raise_on, 3, 1, timeout=120)
    assert time.monotonic() - t0 < 60, "a failing rank must not leave the world hanging"
    assert 1 in err.value.failures
    assert "deliberate failure on rank 1" in err.value.failures[1]
    assert "ValueError" in str(err.value)


def test_rank_that_dies_without_a_report_is_named():
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        run_on_ranks(_rank_fns.die_on, 2, 1, timeout=120)
    assert time.monotonic() - t0 < 60
    assert "process exited with code 3 without a report" in err.value.failures[1]
    assert str(err.value).splitlines()[0].startswith("rank 1:"), str(err.value)[:300]


def test_timeout_names_unfinished_ranks():
    with pytest.raises(RankError) as err:
        run_on_ranks(_rank_fns.sleep_forever, 2, timeout=8)
    assert set(err.value.failures) == {0, 1}
    assert "timed out" in err.value.failures[0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        run_on_ranks(_rank_fns.collectives, 0)
    with pytest.raises(ValueError, match="backend"):
        run_on_ranks(_rank_fns.collectives, 2, backend="mpi")


def test_ranks_see_the_callers_environment_at_the_call(monkeypatch):
    """Ranks fork from a server started at the first world: they still get the environment as
    it is when run_on_ranks is called (a variable set or removed since) and, like fresh
    processes, torch seeds of their own (a fork would share the server's)."""
    monkeypatch.setenv("TINYTRON_LAUNCH_PROBE_GONE", "set before the server started")
    first = run_on_ranks(_rank_fns.environment, 2, "TINYTRON_LAUNCH_PROBE", timeout=90)
    monkeypatch.setenv("TINYTRON_LAUNCH_PROBE", "set after")
    monkeypatch.delenv("TINYTRON_LAUNCH_PROBE_GONE")
    out = run_on_ranks(_rank_fns.environment, 2, "TINYTRON_LAUNCH_PROBE", timeout=90)
    for o in out:
        assert o["value"] == "set after" and "TINYTRON_LAUNCH_PROBE_GONE" not in o["names"], o
        assert o["cwd"] == os.getcwd()
    seeds = [o["initial_seed"] for o in first + out]
    assert len(set(seeds)) == len(seeds), seeds
