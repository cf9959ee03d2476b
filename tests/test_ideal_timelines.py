"""The book's ideal timelines, drawn beside the recorded CPU traces: the pipeline schedule's own
order played out with unit costs has exactly the bubble of Narayanan et al. (2021) (01
schedule_timeline); the unit-cost DDP backward leaves all of the reduce-scatter after backward
without overlap and only the queue's end with it (05 overlap_timeline)."""

from __future__ import annotations

import pytest

from tinytron.buffers.overlap_timeline import ideal_overlap, timeline_summary
from tinytron.main_loop.schedule_timeline import (bubble_formula, ideal_events, measured_bubble,
                                                  stage_order)


@pytest.mark.parametrize("pp,m,v", [(2, 8, 1), (2, 8, 2), (4, 8, 1), (4, 8, 2), (4, 12, 3),
                                    (8, 16, 2), (3, 3, 1)])
def test_ideal_bubble_is_the_formula(pp, m, v):
    assert measured_bubble(ideal_events(pp, m, v)) == pytest.approx(bubble_formula(pp, m, v))


def test_stage_order_runs_each_chunk_forward_then_backward_once():
    for rank in range(4):
        order = stage_order(4, 8, 2, rank)
        assert len(order) == 2 * 8 * 2
        for kind in ("forward", "backward"):
            assert sorted((c, i) for k, c, i in order if k == kind) == [
                (c, i) for c in range(2) for i in range(8)]
    assert stage_order(2, 3, 1, 0) == [("forward", 0, 0), ("forward", 0, 1), ("backward", 0, 0),
                                       ("forward", 0, 2), ("backward", 0, 1), ("backward", 0, 2)]



def test_ideal_overlap_leaves_only_the_queue_end():
    numels = [400, 260, 260, 260, 60]
    off = timeline_summary(ideal_overlap(numels, False))
    on = timeline_summary(ideal_overlap(numels, True))
    assert set(off) == {0, -1} and set(on) == {0, 1, 2, 3, 4, -1}
    assert off[-1]["synced"] - off[-1]["backward_end"] == pytest.approx(1.0)
    left = on[-1]["synced"] - on[-1]["backward_end"]
    assert 0 < left <= (260 + 60) / sum(numels)
    assert all(on[b]["start"] == pytest.approx(on[b]["ready"]) for b in range(4))  # net keeps up
