"""Chapter 03 on a real 4-rank gloo world (one launch, every check).

- Resume == uninterrupted: bitwise, both formats, sync and async.
- torch_dist resharding: TP 2<->1; PP 2<->1 with DP 2<->4; virtual stages (PP 2 x VPP 2, one
  layer per chunk, -> PP 2 and -> PP 1, PP 1 -> PP 2 x VPP 2, and interleaving off with the
  DistributedOptimizer on); context parallelism (CP 2<->1; PP 2 x CP 2 -> DP 4, which takes the
  DistributedOptimizer, sharded over dp x cp, from 2 to 4 shards); DP shards alone (DP 1 -> 4
  -> 1: the DP 1 ends run in the test process, as 4 ranks cannot change DP alone). Each case:
  the re-saved checkpoint equals the saved one tensor by tensor, optimizer steps and train
  state equal, the next losses within 1e-6 of continuing on the old layout (fp32).
- bf16 weights with fp32 masters across TP 2 -> PP 2; the legacy format refusing a TP change;
  who writes which file; legacy/torch_dist TP2 x PP2 -> one model."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tinytron.checkpoint import _workers
from tinytron.launch import run_on_ranks
from tinytron.model import GPTModel, tiny_config


def plain_tensors(directory) -> dict:
    """Every tensor of a torch_dist directory, with PyTorch's DCP tools."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = os.path.join(directory, "..", "plain.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(directory, target)
    out = torch.load(target, weights_only=True)
    os.remove(target)
    return {k: v for k, v in out.items() if torch.is_tensor(v)}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_suite")
    # DP 1 in this process (no world): the checkpoint the suite's "dp_only" case loads at DP 4
    dp1_losses = _workers.dp_only_save(str(root / "dp_only"))
    out = run_on_ranks(_workers.checkpoint_suite, 4, str(root), timeout=600)
    out[0]["dp_only"]["losses_dp1"] = dp1_losses
    return root, out


@pytest.mark.parametrize("case", ["dist_tp2_sync", "dist_pp2_async_process", "legacy_tp2_pp2"])
def test_resume_equals_uninterrupted_bitwise(suite, case):
    _, out = suite
    for rank in out:
        r = rank[case]
        assert r["losses"] == r["losses_resumed"]      # dropout on: masks equal too
        assert r["params_and_state"] and r["draws"]    # weights, masters, moments, steps, lr, RNG
        assert r["consumed"] == 24 and r["iteration"] == 6   # sampler restarts at sample 24


# 8 model keys (layers stacked) x weight, exp_avg, exp_avg_sq (+ fp32 masters "param" when the
# optimizer keeps them apart: the DistributedOptimizer; not the fp32 mixed-precision one)
@pytest.mark.parametrize("case, tol, num_tensors", [
    ("reshard_tp2_to_tp1", 1e-6, 32), ("reshard_tp1_to_tp2", 1e-6, 32),
    ("reshard_pp2_to_pp1", 1e-6, 32), ("reshard_pp1_to_pp2", 1e-6, 32),
    ("reshard_bf16_tp2_to_pp2", 2e-2, 32),
    ("reshard_vpp2_to_pp2", 1e-6, 24), ("reshard_vpp2_to_pp1", 1e-6, 24),
    ("reshard_pp1_to_vpp2", 1e-6, 24), ("reshard_vpp2_distopt_to_pp1", 1e-6, 32),
    ("reshard_cp2_to_cp1", 1e-6, 32), ("reshard_cp1_to_cp2", 1e-6, 32),
    ("reshard_pp2_cp2_to_dp4", 1e-6, 32)])
def test_resharded_resume(suite, case, tol, num_tensors):
    _, out = suite
    r = out[0][case]
    assert r["equal"] and not r["differ"] and r["num_tensors"] == num_tensors   # re-save == saved
    assert r["steps_equal"] and r["train_state_equal"]
    # fp32: the next steps agree to rounding; bf16 weights round differently under TP and PP
    assert max(abs(a - b) for a, b in zip(r["losses_a"], r["losses_b"])) < tol


def test_interleaving_off_and_distributed_optimizer_on(suite):
    """PP 2 x VPP 2, fp32 mixed-precision optimizer -> PP 2 with the DistributedOptimizer."""
    _, out = suite
    r = out[0]["reshard_vpp2_to_pp2_distopt"]
    assert not r["differ"] and r["num_tensors"] == 24 and r["steps_equal"]
    # the re-save adds the DistributedOptimizer's fp32 masters, taken from the fp32 weights
    assert len(r["extra"]) == 8 and r["extra_are_masters"]
    assert max(abs(a - b) for a, b in zip(r["losses_a"], r["losses_b"])) < 1e-6


def test_distributed_optimizer_dp_shards_alone_change(suite):
    """DP 1 -> DP 4 (in the suite) -> DP 1 (here): the same 4 ranks cannot change DP alone."""
    root, out = suite
    r = out[0]["dp_only"]
    assert r["equal"] and r["num_tensors"] == 32 and r["steps_equal"] and r["train_state_equal"]
    back = _workers.dp_only_load(str(root / "dp_only"), "b", "c")   # DP 4 save -> DP 1 here
    assert back["equal"] and back["steps_equal"] and back["train_state_equal"]
    for resumed in (r["losses"], back["losses"]):   # continuing at DP 1 == resuming at 4, at 1
        assert max(abs(a - b) for a, b in zip(r["losses_dp1"], resumed)) < 1e-6


def test_legacy_format_refuses_another_tp(suite):
    _, out = suite
    message = out[0]["legacy_refuses"]
    assert "tensor_model_parallel_size=2, this run has 1" in message and "cannot reshard" in message


def test_who_writes_what(suite):
    root, _ = suite
    dist_dir = root / "dist_tp2_sync" / "iter_0000003"
    assert sorted(os.listdir(dist_dir)) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                            "__2_0.distcp", "__3_0.distcp",
                                            "common.pt", "metadata.json"]
    legacy_dir = root / "legacy_tp2_pp2" / "iter_0000003"
    assert sorted(os.listdir(legacy_dir)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                              "mp_rank_01_001"]
    assert all(sorted(os.listdir(legacy_dir / d)) == ["distrib_optim.pt", "model_optim_rng.pt"]
               for d in os.listdir(legacy_dir))
    assert not list(root.glob("*/iter_*.tmp"))   # every staging directory was committed


def test_both_formats_merge_into_one_model(suite):
    from tinytron.checkpoint.convert import read_checkpoint_model

    root, _ = suite
    reference = GPTModel(tiny_config(num_layers=4, seed=11))
    for fmt in ("torch_dist", "torch"):
        merged = read_checkpoint_model(root / "both_formats" / fmt)
        assert all(torch.equal(p, q) for p, q in zip(merged.parameters(), reference.parameters()))


def test_load_errors_are_one_line_on_every_rank(suite):
    """A shape mismatch, a key only the last stage misses, an extra key: the same one-line
    ValueError on all 4 ranks (naming key and shapes), and no rank's model changed."""
    _, out = suite
    views = out[0]["load_errors"]
    assert len(views) == 4 and all(v == views[0] for v in views[1:]), views
    got = views[0]
    assert all(got[f"{case}_unchanged"] for case in ("shape", "missing", "extra"))
    assert all("\n" not in got[case] for case in ("shape", "missing", "extra"))
    assert ("'decoder.layers.mlp.linear_fc1.weight' has global shape (4, 256, 64) in the "
            "checkpoint, the model needs (4, 512, 64)") in got["shape"]
    assert "has no tensor 'output_layer.weight' (the model needs global shape (" in got["missing"]
    assert "has tensor 'output_layer.weight' of global shape (" in got["extra"]
    assert "which the model does not have" in got["extra"]


def test_fully_parallel_save_spreads_the_weights_over_dp(suite):
    """TP 2 x DP 2: on (the default), the four ranks write similar shares; off, DP rank 0 of each
    position writes the weights. Both directories hold the same tensors."""
    root, out = suite
    ranks = out[0]["fully_parallel"]
    sizes = {name: [os.path.getsize(root / "fully_parallel" / name / "iter_0000001" /
                                    f"__{r}_0.distcp") for r in range(4)] for name in ("on", "off")}
    dp0 = [r for r in range(4) if ranks[r]["dp_rank"] == 0]
    dp1 = [r for r in range(4) if ranks[r]["dp_rank"] == 1]
    # off: DP rank 0 writes the weights and its optimizer shard, DP rank 1 its shard alone
    assert all(sizes["off"][a] > 1.5 * sizes["off"][b] for a, b in zip(dp0, dp1)), sizes
    spread = {k: max(v) - min(v) for k, v in sizes.items()}
    assert spread["on"] < 0.5 * spread["off"] and max(sizes["on"]) < max(sizes["off"]), sizes
    assert sum(sizes["on"]) == pytest.approx(sum(sizes["off"]), rel=0.02)
    a, b = (plain_tensors(root / "fully_parallel" / n / "iter_0000001") for n in ("on", "off"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_legacy_optimizer_entry_has_megatrons_structure(suite):
    """DistributedOptimizer, legacy format: model_optim_rng.pt's `optimizer` entry is Megatron's
    {'optimizer': {'param_groups'}, 'grad_scaler'} (with tinytron's per-name steps beside it),
    distrib_optim.pt holds world tensors under buffer index and (param, grad) dtypes."""
    root, _ = suite
    rank_dir = root / "legacy_tp2_pp2" / "iter_0000003" / "mp_rank_00_000"
    sd = torch.load(rank_dir / "model_optim_rng.pt", weights_only=True)
    entry = sd["optimizer"]
    assert set(entry) == {"optimizer", "grad_scaler", "steps"} and set(entry["optimizer"]) == {
        "param_groups"}
    assert all(g["step"] == 3 and "lr" in g and "params" not in g
               for g in entry["optimizer"]["param_groups"])
    assert set(entry["steps"].values()) == {3}
    world = torch.load(rank_dir / "distrib_optim.pt", weights_only=True)
    assert world["buckets_coalesced"] is True
    (dtypes, tensors), = world[0].items()
    assert dtypes == (torch.float32, torch.float32)
    assert {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"} <= set(tensors)
    assert tensors["exp_avg"].numel() == tensors["numel_unpadded"]


def test_rng_states_gathered_over_dp_only_with_data_parallel_random_init(suite):
    """TP 2 x DP 2: the rng_state object of a position holds DP rank 0's state alone by default,
    every DP rank's with data_parallel_random_init (Megatron, checkpointing.py:382-391)."""
    from tinytron.checkpoint._common import CheckpointGroups
    from tinytron.checkpoint.sharded_keys import ShardedObject
    from tinytron.checkpoint.torch_dist import read_sharded
    from tinytron.parallel import ParallelGrid

    root, _ = suite
    objects = [ShardedObject("rng_state", None, (1, 2), (0, tp)) for tp in (0, 1)]
    lengths = {}
    for name in ("on", "dp_random"):
        got = read_sharded(root / "fully_parallel" / name / "iter_0000001", [], objects,
                           CheckpointGroups(ParallelGrid.single()))
        lengths[name] = [len(got[o.unique_key]) for o in objects]
    assert lengths == {"on": [1, 1], "dp_random": [2, 2]}, lengths


def test_rng_states_listed_and_restored_by_dp_rank_under_context_parallelism(suite):
    """CP 2 x DP 2 with data_parallel_random_init: Megatron gathers the RNG states over DP only
    and restores entry [dp rank] (checkpointing.py:382-391, 1993-1996). So each position's list
    has 2 entries, not 4, in both formats, and every rank gets back its DP rank's state."""
    from tinytron.checkpoint._common import CheckpointGroups
    from tinytron.checkpoint.sharded_keys import ShardedObject
    from tinytron.checkpoint.torch_dist import read_sharded
    from tinytron.parallel import ParallelGrid

    root, out = suite
    ranks = out[0]["rng_cp2_dp2"]
    assert sorted((r["dp"], r["cp"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["restored"] == {"torch_dist": True, "torch": True} for r in ranks), ranks
    obj = ShardedObject("rng_state", None, (1, 1), (0, 0))
    got = read_sharded(root / "rng_cp2_dp2" / "torch_dist" / "iter_0000000", [], [obj],
                       CheckpointGroups(ParallelGrid.single()))
    legacy = torch.load(root / "rng_cp2_dp2" / "torch" / "iter_0000000" / "mp_rank_00" /
                        "model_optim_rng.pt", weights_only=False)
    assert (len(got[obj.unique_key]), len(legacy["rng_state"])) == (2, 2)
