"""Chapter 02's OptimizerParamScheduler against megatron-core's own (installed as a test oracle).

megatron-core 0.16.1's `optimizer_param_scheduler.py` has the same constructor, the same
decay styles and the same state dict as e03878b5f for everything compared here.
"""

from __future__ import annotations

import warnings

import pytest

from tinytron.optimizer.scheduler import OptimizerParamScheduler

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": expected on CPU
    warnings.simplefilter("ignore")
    megatron_scheduler = pytest.importorskip(
        "megatron.core.optimizer_param_scheduler",
        reason="megatron-core (a test dependency) is not installed")


class _Groups:
    """The one thing a scheduler touches: `param_groups` (here: a decoupled-lr and a no-wd group)."""

    def __init__(self):
        self.param_groups = [{"wd_mult": 1.0}, {"max_lr": 2e-3, "min_lr": 1e-5},
                             {"wd_mult": 0.0}]


CASES = [
    dict(lr_decay_style="linear", wd_incr_style="constant"),
    dict(lr_decay_style="cosine", wd_incr_style="linear"),
    dict(lr_decay_style="inverse-square-root", wd_incr_style="cosine"),
    dict(lr_decay_style="constant", wd_incr_style="constant"),
    dict(lr_decay_style="WSD", lr_wsd_decay_style="exponential", wsd_decay_steps=300),
    dict(lr_decay_style="WSD", lr_wsd_decay_style="linear", wsd_decay_steps=300),
    dict(lr_decay_style="WSD", lr_wsd_decay_style="cosine", wsd_decay_steps=300),
    dict(lr_decay_style="WSD", lr_wsd_decay_style="minus_sqrt", wsd_decay_steps=300),
]


def _both(case: dict):
    kwargs = dict(init_lr=1e-5, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=100,
                  lr_decay_steps=1000, start_wd=0.01, end_wd=0.1, wd_incr_steps=1000,
                  wd_incr_style="constant")
    kwargs.update(case)
    if kwargs["wd_incr_style"] == "constant":
        kwargs["end_wd"] = kwargs["start_wd"]
    ours, theirs = _Groups(), _Groups()
    return (OptimizerParamScheduler(ours, **kwargs), ours,
            megatron_scheduler.OptimizerParamScheduler(theirs, **kwargs), theirs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["lr_decay_style"] + "-" +
                         c.get("lr_wsd_decay_style", c.get("wd_incr_style", "")))
def test_lr_and_wd_equal_megatron_core_at_every_step(case):
    """Increments of 7 samples walk through warmup, decay and past the end, group by group."""
    ours, our_groups, theirs, their_groups = _both(case)
    for _ in range(180):
        ours.step(7)
        theirs.step(7)
        for a, b in zip(our_groups.param_groups, their_groups.param_groups):
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-12, abs=1e-15), (ours.num_steps, a, b)
            assert a["weight_decay"] == pytest.approx(b["weight_decay"], rel=1e-12, abs=1e-15)


def test_state_dict_loads_across_implementations():
    ours, _, theirs, their_groups = _both(dict(lr_decay_style="cosine", wd_incr_style="linear"))
    for _ in range(30):
        ours.step(11)
    theirs.load_state_dict(ours.state_dict())
    assert theirs.num_steps == ours.num_steps == 330
    theirs.step(5)
    ours.step(5)
    assert their_groups.param_groups[0]["lr"] == pytest.approx(ours.optimizer.param_groups[0]["lr"],
                                                               rel=1e-12)


def test_load_into_a_used_scheduler_adds_steps_as_megatron_core_does():
    """Megatron does not reset num_steps on load: loading into a stepped scheduler adds up."""
    src, _, _, _ = _both(dict(lr_decay_style="linear", wd_incr_style="linear"))
    src.step(200)
    ours, our_groups, theirs, their_groups = _both(dict(lr_decay_style="linear",
                                                        wd_incr_style="linear"))
    ours.step(50), theirs.step(50)
    ours.load_state_dict(src.state_dict())
    theirs.load_state_dict(src.state_dict())
    assert ours.num_steps == theirs.num_steps == 250
    for a, b in zip(our_groups.param_groups, their_groups.param_groups):
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        assert a["weight_decay"] == pytest.approx(b["weight_decay"], rel=1e-12)
