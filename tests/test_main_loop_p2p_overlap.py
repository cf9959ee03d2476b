"""Chapter 01's interleaved schedule with overlap_p2p_comm: posted p2p, Megatron's wait points.

The overlapped variant must compute exactly what the plain one computes (same messages, same
order on each rank, only the waits move): grads, losses and the recorded (stage, chunk,
micro-batch, kind) events are compared bit for bit on real gloo worlds. The config refuses the
plain variant for PP <= 2, as megatron/training/arguments.py:984-988 does.
"""

import pytest

from tinytron.config import ConfigError, load_config
from tinytron.launch import run_on_ranks
from tests import main_loop_schedule_workers as workers

CASES = ["dp2pp2", "dp2pp2_sync_keep", "example", "all_warmup", "forward_only", "pp4"]


@pytest.fixture(scope="module")
def world():
    return run_on_ranks(workers.overlap_world_checks, 4, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_overlapped_equals_plain_bitwise(world, case):
    for r in world:
        res = r[case]
        assert res["same_grads"] and res["same_losses"], (case, res)
        assert res["same_events"] and res["same_orders"], case
        assert res["unnamed_recvs"] == 0   # every posted receive was consumed and named
        assert res["num_events"] > 0


def test_overlapped_records_sends_and_receives(world):
    for r in world:
        assert {"forward", "backward", "send", "recv"} <= set(r["dp2pp2"]["kinds"])


TINY = ["--model.hidden_size=32", "--model.num_layers=4", "--model.num_attention_heads=2",
        "--model.num_query_groups=2", "--model.ffn_hidden_size=64", "--model.vocab_size=128",
        "--model.seq_length=32", "--training.train_iters=2", "--training.micro_batch_size=1",
        "--training.global_batch_size=4",
        "--parallel.pipeline_model_parallel_size=2",
        "--parallel.virtual_pipeline_model_parallel_size=2"]


def test_config_defaults_to_overlap_and_refuses_plain_for_pp2():
    cfg = load_config(None, TINY).resolve(2)
    assert cfg.parallel.overlap_p2p_comm is True   # arguments.py:2756-2758
    with pytest.raises(ConfigError) as e:
        load_config(None, TINY + ["--parallel.overlap_p2p_comm=false"]).resolve(2)
    assert "\n" not in str(e.value) and "overlap_p2p_comm" in str(e.value)
    four = [a.replace("pipeline_model_parallel_size=2", "pipeline_model_parallel_size=4")
            if "--parallel.pipeline" in a else a for a in TINY]
    four = [a.replace("num_layers=4", "num_layers=8") for a in four]
    assert load_config(None, four + ["--parallel.overlap_p2p_comm=false"]).resolve(4)
