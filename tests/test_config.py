"""tinytron.config: TOML + dotted overrides -> typed sections, one-line errors naming the field."""

import pytest

from tinytron.config import ConfigError, load_config, parse_overrides

TOML = """
[model]
hidden_size = 64
num_layers = 4
num_attention_heads = 4
num_query_groups = 2
ffn_hidden_size = 128
vocab_size = 512
seq_length = 64
[parallel]
tensor_model_parallel_size = 2
pipeline_model_parallel_size = 2
[training]
train_iters = 10
micro_batch_size = 2
global_batch_size = 8
[optimizer]
lr = 3e-4
"""


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text(TOML)
    return p


def test_sections_are_typed_and_overrides_apply(path):
    cfg = load_config(path, ["--optimizer.lr", "1e-3", "--training.train_iters=3",
                             "--model.sequence_parallel", "true"]).resolve(8)
    assert cfg.optimizer.lr == 1e-3 and cfg.training.train_iters == 3
    assert cfg.model.sequence_parallel is True and cfg.data_parallel_size(8) == 2
    assert cfg.training.global_batch_size == 8


def test_resolved_config_round_trips_through_toml(path, tmp_path):
    cfg = load_config(path).resolve(4)
    again = tmp_path / "again.toml"
    again.write_text(cfg.to_toml())
    assert load_config(again).resolve(4).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("overrides, world, message", [
    (["--model.hiden_size", "3"], 4, "unknown config key model.hiden_size; did you mean model.hidden_size?"),
    (["--optimzer.lr", "1"], 4, "unknown config section [optimzer]; did you mean [optimizer]?"),
    (["--model.hidden_size", "abc"], 4, "model.hidden_size must be int, got 'abc'"),
    (["--optimizer.lr", '"3e-4"'], 4, "optimizer.lr must be float | None, got '3e-4'"),
    (["--model.num_attention_heads", "6"], 4, "[model] hidden_size (64) must be divisible by num_attention_heads (6)"),
    (["--model.num_query_groups", "1", "--parallel.tensor_model_parallel_size", "4"], 8,
     "model: num_query_groups (1) must be divisible by tp (4)"),
    ([], 6, "world size 6 is not divisible by tp·pp·cp = 2·2·1 = 4"),
    (["--training.global_batch_size", "6"], 8, "global_batch_size (6) must be divisible by micro_batch_size·dp = 2·2 = 4"),
    (["--training.train_samples", "100"], 4, "exactly one of training.train_iters"),
    (["model.hidden_size", "3"], 4, "must look like --section.key value"),
    (["--ddp.overlap_param_gather", "true"], 4, "overlap_param_gather=True needs use_distributed_optimizer"),
    (["--optimizer.use_distributed_optimizer", "true", "--ddp.use_distributed_optimizer", "false"], 4,
     "ddp.use_distributed_optimizer (False) disagrees with optimizer.use_distributed_optimizer (True)"),
])
def test_bad_input_names_the_field(path, overrides, world, message):
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides).resolve(world)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_file_and_missing_model(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="no \\[model\\] section"):
        load_config(None, ["--training.train_iters", "3"])
    assert parse_overrides(["--a.b", "none"]) == {"a": {"b": None}}


def test_ddp_takes_the_distributed_optimizer_switch_from_optimizer(path):
    """Megatron has one --use-distributed-optimizer; [ddp] follows [optimizer] unless told otherwise."""
    cfg = load_config(path, ["--optimizer.use_distributed_optimizer", "true",
                             "--ddp.overlap_param_gather", "true"])
    assert cfg.ddp.use_distributed_optimizer is True and cfg.ddp.overlap_param_gather is True
    assert load_config(path).ddp.use_distributed_optimizer is False
    with pytest.raises(ConfigError, match="disagrees"):  # [optimizer]'s default counts too
        load_config(path, ["--ddp.use_distributed_optimizer", "true"])


def test_align_param_gather_is_off_without_virtual_stages(path):
    """Only the interleaved schedule dispatches aligned gathers (param_sync_func); without virtual
    stages the aligned pre-hooks would prefetch nothing, so Megatron sets it off
    (arguments.py:990-992). With virtual stages it is kept."""
    on = ["--optimizer.use_distributed_optimizer", "true", "--ddp.overlap_param_gather", "true",
          "--ddp.align_param_gather", "true"]
    assert load_config(path, on).resolve(8).ddp.align_param_gather is False
    interleaved = load_config(path, on + ["--parallel.virtual_pipeline_model_parallel_size", "2"])
    assert interleaved.resolve(8).ddp.align_param_gather is True


def test_eval_global_batch_size_sets_the_evaluation_batch(path):
    """Megatron's eval_global_batch_size: the loop's evaluation batch, defaulting to the training one."""
    from tinytron.main_loop.loop import eval_batch

    default = load_config(path).resolve(8).training
    assert eval_batch(default, 2) == (2, 8)  # 8 samples = 2 micro-batches of 2 on each of 2 DP ranks
    smaller = load_config(path, ["--training.eval_global_batch_size", "4"]).resolve(8).training
    assert eval_batch(smaller, 2) == (1, 4)
    odd = load_config(path, ["--training.eval_global_batch_size", "6"]).resolve(8).training
    with pytest.raises(ValueError, match="eval_global_batch_size"):
        eval_batch(odd, 2)
