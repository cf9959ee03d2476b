"""The step batch-size schedule under Megatron's name and units (tokens for a GPT run).

Megatron's flag is `--step-batch-size-schedule`; its calculator gets `seq_length`
(megatron/training/global_vars.py:127-135), reads numbers as `int(float(x) * mult)`
(megatron/core/num_microbatches_calculator.py:499), and an explicit global batch size beside a
schedule is refused (megatron/training/arguments.py:696-699).
"""

import pytest

from tinytron.config import ConfigError, load_config
from tinytron.main_loop.microbatches import (build_num_microbatches_calculator,
                                             parse_numeric_value,
                                             parse_step_batch_size_schedule)

TINY = ["--model.hidden_size=32", "--model.num_layers=1", "--model.num_attention_heads=2",
        "--model.num_query_groups=2", "--model.ffn_hidden_size=64", "--model.vocab_size=128",
        "--model.seq_length=64", "--training.train_samples=4096", "--training.micro_batch_size=2"]


def test_numbers_parse_as_megatron_float_rule():
    # 2.01 is stored as 2.00999...: Megatron's int(float('2.01') * 1000) is 2009
    assert parse_numeric_value("2.01K") == 2009 == int(float("2.01") * 1000)
    assert parse_numeric_value("1.5K") == 1500
    assert parse_numeric_value("250B") == 250 * 10 ** 9
    assert parse_numeric_value(" 7 ") == 7
    with pytest.raises(ValueError, match=r"not a number .*'x1K'"):
        parse_numeric_value("x1K")


def test_thresholds_are_tokens_with_seq_length():
    assert parse_step_batch_size_schedule("0:256 1M:512 2M:1024", 4096) == \
        [(0, 256), (244, 512), (488, 1024)]
    assert parse_step_batch_size_schedule("0:4 1K:8") == [(0, 4), (1000, 8)]  # samples


def test_config_takes_megatron_name_and_the_trainer_passes_seq_length():
    from tinytron.train import train_iters_of

    cfg = load_config(None, TINY + ["--training.step_batch_size_schedule=0:4 2K:8"]).resolve(1)
    assert cfg.training.step_batch_size_schedule == "0:4 2K:8"
    # 2000 tokens at seq_length 64 = 31 samples: steps of 4 up to 32 consumed, then 8
    calc = build_num_microbatches_calculator(None, 2, 1, False, "0:4 2K:8", 64)
    assert calc.schedule == [(0, 4), (31, 8)]
    assert train_iters_of(cfg, 1) == 8 + (4096 - 32) // 8


def test_schedule_beside_global_batch_size_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config(None, TINY + ["--training.step_batch_size_schedule=0:4 2K:8",
                                  "--training.global_batch_size=8"]).resolve(1)
    assert "\n" not in str(e.value)
    assert "step_batch_size_schedule" in str(e.value) and "global_batch_size" in str(e.value)


def test_old_key_names_the_new_one():
    with pytest.raises(ConfigError) as e:
        load_config(None, TINY + ["--training.rampup_batch_size=0:4 8:8"])
    assert "\n" not in str(e.value)
    assert "training.rampup_batch_size" in str(e.value)
    assert "training.step_batch_size_schedule" in str(e.value)


def test_a_saved_schedule_config_loads_again(tmp_path):
    cfg = load_config(None, TINY + ["--training.step_batch_size_schedule=0:4 2K:8"]).resolve(1)
    path = tmp_path / "config.toml"
    path.write_text(cfg.to_toml())
    again = load_config(path).resolve(1)
    assert again.training.step_batch_size_schedule == "0:4 2K:8"
    assert again.training.global_batch_size == cfg.training.global_batch_size == 2
