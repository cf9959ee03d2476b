"""Chapter 07 without process groups: Megatron's estimate, the ledger's arithmetic, the command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tinytron.main_loop.memory_meter import saved_tensor_bytes
from tinytron.memory import (MemoryConfig, activation_peak, chunk_params, layer_saved,
                             megatron_theoretical_memory, rank_ledger, search_layouts,
                             stage_ledgers, state_ledger)
from tinytron.memory.activations import chunk_saved, saved_bytes
from tinytron.memory.peak import schedule_ops
from tinytron.memory.calculator import main, memory_config_from, parse_bytes, running_example
from tinytron.memory.ledger import megatron_args_from
from tinytron.memory.megatron_model import megatron_args
from tinytron.memory.states import buffer_layouts, owned_elements
from tinytron.model import GPTModel, llama_7b_config, tiny_config
from tinytron.model.gpt import TransformerLayer
from tinytron.model.layers import rope_cos_sin
from tinytron.parallel import ParallelGrid
from tinytron.parallel.rng import model_parallel_seed

LLAMA7B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
               num_query_groups=8, ffn_hidden_size=14336, swiglu=True, normalization="RMSNorm",
               padded_vocab_size=128256, seq_length=4096, micro_batch_size=2,
               tensor_model_parallel_size=2, sequence_parallel=True,
               pipeline_model_parallel_size=2, data_parallel_size=64,
               use_distributed_optimizer=True, recompute_granularity="selective")


# -- Megatron's estimate ------------------------------------------------------------------------
def test_megatron_running_example_exact():
    r = megatron_theoretical_memory(LLAMA7B, num_microbatches=8)
    assert r["weight_and_optimizer"] == 12_422_222_208
    assert r["activation"] == 17_213_489_152
    assert r["branch"] == "compute_activation_memory"
    assert round(r["weight_and_optimizer_mib"], 2) == 11846.75
    assert round(r["activation_mib"], 2) == 16416.06
    assert round(r["total_mib"], 2) == 28262.82
    no_sp = megatron_theoretical_memory(LLAMA7B, 8, recompute_granularity=None)
    assert no_sp["branch"] == "compute_activation_memory_without_sp"
    assert round(no_sp["activation"]) == 24_874_038_067  # the facts' "without selective" figure
    plain = megatron_theoretical_memory(LLAMA7B, 8, use_distributed_optimizer=False)
    assert plain["weight_and_optimizer"] == 2_007_631_872 * 18


SMALL = dict(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=32,
             padded_vocab_size=16, seq_length=4, micro_batch_size=1, data_parallel_size=2)


def test_megatron_small_cases_by_hand():
    # LayerNorm (n=2), no GQA, no SwiGLU: A = 2*64*(1+1)*1 = 256, M = 2*8*32 = 512, N = 32,
    # final norm 16, embedding 128 -> most loaded shard at p=1: 2*(256+512)+2*32+16+128 = 1744
    r = megatron_theoretical_memory(SMALL)
    assert r["weight_and_optimizer"] == 1744 * 18
    # without SP: per layer 4*1*8*(10+24) = 1088, x2 layers, + 8*4 + 32 (embedding terms),
    # + 2*(4*16 + 4*8) (p = 1 logits and final-norm output), x1.05
    assert r["activation"] == pytest.approx((2 * 1088 + 32 + 32 + 2 * (64 + 32)) * 1.05)
    dist = megatron_theoretical_memory(SMALL, use_distributed_optimizer=True)
    assert dist["weight_and_optimizer"] == 1744 * (6 + 12 / 2)
    untied = megatron_theoretical_memory(SMALL, untie_embeddings_and_output_weights=True)
    assert untied["weight_and_optimizer"] == (1744 + 128) * 18  # second table only at p = 1
    untied_pp = megatron_theoretical_memory(SMALL, untie_embeddings_and_output_weights=True,
                                            pipeline_model_parallel_size=2)
    tied_pp = megatron_theoretical_memory(SMALL, pipeline_model_parallel_size=2)
    assert untied_pp["weight_and_optimizer"] == tied_pp["weight_and_optimizer"]
    # (2*768/2 + 128) sharded + (2*32 + 16)/2 replicated = 936
    assert tied_pp["weight_and_optimizer"] == 936 * 18


def test_megatron_activation_branches_by_hand():
    sp_sel = dict(SMALL, sequence_parallel=True, recompute_granularity="selective",
                  tensor_model_parallel_size=2)
    r = megatron_theoretical_memory(sp_sel)
    # per layer 4*8*(18 + 4*32/8) = 1088, x2, + 32 + 32, + p=1 head 4*8*4*(1 + 16/8) = 384; / t
    assert r["branch"] == "compute_activation_memory"
    assert r["activation"] == (2 * 1088 + 64 + 384) / 2
    pp = megatron_theoretical_memory(sp_sel, 1, pipeline_model_parallel_size=2)
    assert pp["activation"] == (2 * 1088 + 64 * 2) * 0.5 / 2  # min(1, m/p) = 1/2, no head
    vpp = megatron_theoretical_memory(sp_sel, 4, pipeline_model_parallel_size=2,
                                      virtual_pipeline_model_parallel_size=2)
    assert vpp["activation"] == (2 * 1088 + 64 * 2) * 1.25 / 2
    for change in (dict(recompute_granularity="full"), dict(sequence_parallel=False)):
        other = megatron_theoretical_memory(sp_sel, **change)
        assert other["branch"] == "compute_activation_memory_without_sp"
        # per layer 4*8*(10 + 24/2) = 704 and no division by t at the end
        assert other["activation"] == pytest.approx((2 * 704 + 64 + 2 * (32 + 32)) * 1.05)


def test_megatron_moe_gqa_and_inputs():
    moe = megatron_theoretical_memory(SMALL, num_experts=4, moe_ffn_hidden_size=8,
                                      expert_model_parallel_size=2, world_size=2,
                                      data_parallel_size=None, use_distributed_optimizer=True,
                                      add_bias_linear=False)
    # experts 2*8*8*4 = 512 per layer on both layers, over ep 2: 512; expert DP = 2/(1*2*1) = 1
    # dense part: attention 256 per layer (no dense MLP), norms 32 + router 32 per layer
    tp_sharded, replicated, expert = 2 * 256 + 128, 2 * (32 + 32) + 16, 2 * 512 / 2
    assert moe["weight_and_optimizer"] == (tp_sharded + replicated) * (6 + 12 / 2) + expert * 18
    args = dict(SMALL, num_query_groups=1)  # GQA off: Megatron overwrites num_query_groups
    megatron_theoretical_memory(args)
    assert args["num_query_groups"] == 1, "the caller's arguments must not change"
    assert megatron_args(args).num_query_groups == 2
    with pytest.raises(ValueError, match="hidden_size"):
        megatron_theoretical_memory(dict(SMALL, hidden_size=None))
    with pytest.raises(ValueError, match="padded_vocab_size"):
        megatron_theoretical_memory({k: v for k, v in SMALL.items() if k != "padded_vocab_size"})
    for name in ("hybrid_layer_pattern", "hybrid_override_pattern"):  # Megatron's, its legacy
        with pytest.raises(ValueError, match="hybrid_layer_pattern"):
            megatron_theoretical_memory(SMALL, **{name: "M*"})


def test_megatron_expert_parallel_beyond_the_world():
    """etp * ep * pp > world: expert DP is 0; Megatron's number without distopt, an error with."""
    moe = dict(SMALL, num_experts=4, moe_ffn_hidden_size=8, expert_model_parallel_size=4,
               world_size=2, swiglu=True)
    plain = megatron_theoretical_memory(moe)["weight_and_optimizer"]
    dense = megatron_theoretical_memory(dict(moe, expert_model_parallel_size=1))
    assert plain > 0 and plain < dense["weight_and_optimizer"]  # experts over ep = 4, 18 B each
    with pytest.raises(ValueError, match="expert_model_parallel_size"):
        megatron_theoretical_memory(moe, use_distributed_optimizer=True)


# MiB that megatron/training/theoretical_memory_usage.py at e03878b5f returns for these args
# (run once on its unmodified functions; dense GQA/SwiGLU/VPP/SP, CP/untied, MoE + MTP, MLA).
MEGATRON_GOLDEN = [
    (dict(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=50257,
          seq_length=1024, micro_batch_size=2, data_parallel_size=8), 4,
     275.1416015625, 279.31640625),
    (dict(num_layers=8, hidden_size=512, num_attention_heads=8, group_query_attention=True,
          num_query_groups=2, swiglu=True, normalization="RMSNorm", vocab_size=32000,
          seq_length=2048, micro_batch_size=1, tensor_model_parallel_size=2,
          sequence_parallel=True, recompute_granularity="selective",
          pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          data_parallel_size=4, use_distributed_optimizer=True), 8,
     117.037353515625, 143.76953125),
    (dict(num_layers=6, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1000,
          vocab_size=1000, seq_length=512, micro_batch_size=3, tensor_model_parallel_size=2,
          pipeline_model_parallel_size=3, context_parallel_size=2, data_parallel_size=2,
          untie_embeddings_and_output_weights=True), 2, 26.74072265625, 53.180859375000004),
    (dict(num_layers=4, hidden_size=256, num_attention_heads=4, swiglu=True,
          normalization="RMSNorm", padded_vocab_size=4096, seq_length=256, micro_batch_size=1,
          num_experts=8, moe_ffn_hidden_size=128, moe_router_topk=2,
          moe_shared_expert_intermediate_size=256, moe_shared_expert_gate=True, moe_layer_freq=2,
          expert_model_parallel_size=2, data_parallel_size=4, use_distributed_optimizer=True,
          mtp_num_layers=1), 1, 45.34510803222656, 11.223925781250001),
    (dict(num_layers=4, hidden_size=512, num_attention_heads=8, multi_latent_attention=True,
          q_lora_rank=128, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16,
          v_head_dim=32, normalization="RMSNorm", padded_vocab_size=8192, seq_length=512,
          micro_batch_size=2, data_parallel_size=2, untie_embeddings_and_output_weights=True),
     None, 310.02978515625, 89.783203125),
]


@pytest.mark.parametrize("args,m,weights_mib,activation_mib", MEGATRON_GOLDEN)
def test_megatron_golden_values(args, m, weights_mib, activation_mib):
    r = megatron_theoretical_memory(args, m)
    assert r["weight_and_optimizer_mib"] == pytest.approx(weights_mib, rel=1e-12)
    assert r["activation_mib"] == pytest.approx(activation_mib, rel=1e-12)


# -- the resident ledger ------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("pre,post", [(True, True), (True, False), (False, True), (False, False)])
def test_chunk_params_are_the_model_parameters(pre, post, tie):
    model_cfg = tiny_config(num_layers=4, tie_embeddings=tie)
    cfg = MemoryConfig(model_cfg, pipeline_model_parallel_size=4)
    rank = {(True, True): None, (True, False): 0, (False, True): 3, (False, False): 1}[(pre, post)]
    if rank is None:  # one stage holding everything
        cfg, rank = MemoryConfig(model_cfg), 0
    ranges = {0: (0, 1), 1: (1, 2), 3: (3, 4)}
    start, end = ranges[rank] if cfg.pipeline_model_parallel_size > 1 else (0, 4)
    model = GPTModel(model_cfg, pre_process=pre, post_process=post, layer_range=(start, end),
                     initialize=False)
    got = [(p.name, p.count, p.shared_embedding) for p in chunk_params(cfg, rank, 0)]
    want = [(n, q.numel(), bool(getattr(q, "shared_embedding", False)))
            for n, q in model.named_parameters()]
    assert got == want


def test_state_ledger_padding_and_ownership():
    tiny = MemoryConfig(tiny_config(), data_parallel_size=4, use_distributed_optimizer=True)
    (params, layout), = buffer_layouts(tiny, 0)
    assert layout.numel == 106_880 and sum(p.count for p in params) == 106_816
    assert [sum(owned_elements(params, layout, 4, r)) for r in range(4)] == [26_720] * 3 + [26_656]
    s = state_ledger(tiny, 0, 3)
    assert s == {"weights": 2 * 106_880, "grad_buffer": 4 * 106_880, "master_params": 4 * 26_656,
                 "optimizer_state": 8 * 26_656, "host_optimizer": 0}
    plain = state_ledger(tiny.replace(use_distributed_optimizer=False))
    assert plain["grad_buffer"] == 4 * 106_816 and plain["master_params"] == 4 * 106_816
    fp32 = state_ledger(tiny.replace(bf16=False, use_distributed_optimizer=False))
    assert fp32["weights"] == 4 * 106_816 and fp32["master_params"] == 0
    half = state_ledger(tiny.replace(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5))
    # group order: the matrix group (embedding first) is offloaded until half the elements
    assert half["optimizer_state"] + half["host_optimizer"] // 2 == 8 * 26_720
    with pytest.raises(ValueError, match="dp_rank"):
        state_ledger(tiny, 0, 4)


def test_state_ledger_running_example():
    first, last = (state_ledger(running_example(), r) for r in (0, 1))
    assert sum(first.values()) == 12_422_209_536 and sum(last.values()) == 12_422_234_880
    assert first["weights"] == 4_015_259_648 and last["grad_buffer"] == 8_030_535_680


@pytest.mark.parametrize("field,value", [("tensor_model_parallel_size", 0),
                                         ("optimizer", "adagrad"), ("attention_kernel", "xformers"),
                                         ("optimizer_offload_fraction", 1.5)])
def test_memory_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        MemoryConfig(tiny_config(), **{field: value})
    with pytest.raises(ValueError, match="num_attention_heads"):
        MemoryConfig(tiny_config(), tensor_model_parallel_size=8)


# -- the activation ledger ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_layer_saved_equals_what_autograd_saves(dtype, dropout):
    """The per-layer table against saved-tensor hooks, tensor for tensor (flash and math)."""
    cfg = tiny_config(dropout=dropout)
    grid = ParallelGrid.single()
    tracker = model_parallel_seed(1, grid) if dropout else None
    layer = TransformerLayer(cfg, grid, 0, tracker).to(dtype).train()
    b, s = 3, cfg.seq_length
    x = torch.randn(s, b, cfg.hidden_size, dtype=dtype, requires_grad=True)
    # the tables GPTModel hands its layers: in the layer's dtype, [s, 1, d]
    cos, sin = (t.unsqueeze(1) for t in rope_cos_sin(torch.arange(s), cfg.head_dim,
                                                     dtype=dtype))
    _, saved = saved_tensor_bytes(layer, x, cos, sin, exclude=[x, cos, sin, *layer.parameters()])
    mem = MemoryConfig(cfg, micro_batch_size=b, bf16=dtype == torch.bfloat16, device="cpu")
    assert saved == saved_bytes(layer_saved(mem, input_is_received=True))


def test_math_kernel_is_fp32_and_the_mask_follows_the_device():
    """One rule: the math kernel keeps fp32 on both devices; dropout masks are bool on CUDA."""
    from tinytron.memory.activations import dropout_mask_bytes
    cfg = tiny_config(dropout=0.1)
    b, s, d, a = 2, cfg.seq_length, cfg.head_dim, cfg.num_attention_heads
    for device, mask in (("cuda", 1), ("cpu", 4)):
        mem = MemoryConfig(cfg, micro_batch_size=b, device=device, attention_kernel="math")
        core = [e for e in layer_saved(mem) if e.module == "core_attn"]
        assert all(e.itemsize == 4 for e in core if "mask" not in e.what)
        assert saved_bytes(core) == b * a * (4 * s * d + 8 * s * d + (8 + mask) * s * s)
        residual = [e for e in layer_saved(mem) if e.module == "bda"]
        assert [e.itemsize for e in residual] == [dropout_mask_bytes(mem, 2)] == \
            [1 if device == "cuda" else 2]


def test_kernel_and_recompute_formulas_order():
    base = MemoryConfig(tiny_config(num_layers=4), micro_batch_size=2, device="cuda")

    def with_model(**changes):
        return base.replace(model=base.model.replace(**changes))
    kept = {name: saved_bytes(chunk_saved(cfg, 0, 0)["layers"]) for name, cfg in {
        "none": base, "selective": with_model(recompute_granularity="selective"),
        "block2": with_model(recompute_granularity="full", recompute_method="block",
                             recompute_num_layers=2),
        "uniform1": with_model(recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1)}.items()}
    assert kept["uniform1"] < kept["block2"] < kept["selective"] < kept["none"]
    math = base.replace(model=tiny_config(num_layers=4, dropout=0.1), device="cpu")
    flash = math.replace(attention_kernel="flash", device="cuda")
    assert saved_bytes(layer_saved(math)) > saved_bytes(layer_saved(flash))


def test_rng_snapshots_per_checkpoint():
    from tinytron.memory.activations import CPU_RNG_STATE

    def snapshots(device="cpu", **model):
        cfg = MemoryConfig(tiny_config(num_layers=4, **model), device=device)
        return {e.what: e.elements for e in chunk_saved(cfg, 0, 0)["layers"]
                if e.what.startswith("RNG snapshots")}
    assert snapshots(recompute_granularity="selective") == {CPU_RNG_STATE: 1,
                                                            f"{CPU_RNG_STATE} (x3 layers)": 3}
    assert snapshots(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=3, dropout=0.1) == {
        CPU_RNG_STATE: 2, "RNG snapshots: tracker streams": 6}  # 2 runs, 3 tracker streams
    assert snapshots("cuda", recompute_granularity="selective") == {}


@pytest.mark.parametrize("p,m", [(2, 1), (2, 5), (4, 3), (4, 8)])
def test_schedule_ops_in_flight(p, m):
    cfg = MemoryConfig(tiny_config(num_layers=8), pipeline_model_parallel_size=p,
                       num_microbatches=m)
    for r in range(p):
        ops = schedule_ops(cfg, r)
        assert sorted(o for o in ops if o[0] == "F") == [("F", 0, i) for i in range(m)]
        assert [o[2] for o in ops if o[0] == "B"] == list(range(m))  # backward in forward order
        assert activation_peak(cfg, r)["max_in_flight"] == min(p - r, m)
    vpp = MemoryConfig(tiny_config(num_layers=8), pipeline_model_parallel_size=2,
                       virtual_pipeline_model_parallel_size=2, num_microbatches=8)
    assert [activation_peak(vpp, r)["max_in_flight"] for r in range(2)] == [5, 3]


# -- the whole ledger -------------------------------------------------------------------------
def test_rank_ledger_running_example_and_megatron_args():
    cfg = running_example()
    first, last = stage_ledgers(cfg)
    assert first.resident == 12_422_209_536 and last.resident == 12_422_234_880
    assert first.peak["max_in_flight"] == 2 and last.peak["max_in_flight"] == 1
    assert megatron_theoretical_memory(megatron_args_from(cfg), 8)["activation"] == 17_213_489_152
    assert rank_ledger(cfg, 1).total == last.total


# -- the command ------------------------------------------------------------------------------
TOML = """
[model]
hidden_size = 64
num_layers = 4
num_attention_heads = 4
num_query_groups = 2
ffn_hidden_size = 128
vocab_size = 512
seq_length = 64
sequence_parallel = true

[parallel]
tensor_model_parallel_size = 2
pipeline_model_parallel_size = 2

[training]
micro_batch_size = 2
global_batch_size = 16
bf16 = true
train_iters = 10

[optimizer]
lr = 0.001
use_distributed_optimizer = true
"""


def _run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_command_prints_the_functions_numbers(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    rc, out, _ = _run(capsys, ["--config", str(path), "--world-size", "8", "--json"])
    assert rc == 0
    got = json.loads(out)
    from tinytron.config import load_config

    cfg = memory_config_from(load_config(path), 8)
    assert cfg.data_parallel_size == 2 and cfg.num_microbatches == 4 and cfg.grad_reduce_in_fp32
    for stage, led in zip(got["stages"], stage_ledgers(cfg)):
        assert stage["device"] == led.device and stage["total"] == led.total
    meg = megatron_theoretical_memory(megatron_args_from(cfg), 4)
    assert got["megatron"]["weight_and_optimizer"] == meg["weight_and_optimizer"]
    rc, out, _ = _run(capsys, ["--config", str(path), "--world-size", "8",
                               "--plot", str(tmp_path / "l.png")])
    assert rc == 0 and "stage 0 (first)" in out and "stage 1 (last)" in out
    assert (tmp_path / "l.png").stat().st_size > 1000
    rc, out, _ = _run(capsys, ["--config", str(path), "--world-size", "8", "--json",
                               "--model.recompute_granularity", "full",
                               "--model.recompute_method", "uniform",
                               "--model.recompute_num_layers", "1"])
    full = json.loads(out)
    assert rc == 0 and full["stages"][0]["device"]["activations"] < got["stages"][0]["device"][
        "activations"]
    assert full["megatron"]["branch"] == "compute_activation_memory_without_sp"
    rc, out, _ = _run(capsys, ["--example", "--json"])
    ex = json.loads(out)
    want = [led.total for led in stage_ledgers(running_example())]
    assert [s["total"] for s in ex["stages"]] == want


@pytest.mark.parametrize("argv,field", [
    (["--model.hiden_size", "8"], "model.hiden_size"),
    (["--parallel.tensor_model_parallel_size", "3", "--world-size", "6"], "num_attention_heads"),
    (["--training.global_batch_size", "15"], "training.global_batch_size"),
    (["--world-size", "6"], "world size 6"),
    (["--model.num_layers", "two"], "model.num_layers"),
])
def test_command_bad_config_names_the_field(tmp_path, capsys, argv, field):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    rc, out, err = _run(capsys, ["--config", str(path), "--world-size", "8", *argv])
    assert rc == 2 and out == ""
    assert field in err and err.count("\n") == 1 and "Traceback" not in err


def test_command_bad_flags(capsys):
    for argv, field in ((["--example", "--search", "--gpu-memory", "lots"], "--gpu-memory"),
                        (["--example", "--world-size", "4"], "--world-size"),
                        ([], "--config"), (["--config", "/nonexistent.toml"], "does not exist"),
                        (["--example", "--gpus", "64"], "--gpus only apply with --search")):
        rc, _, err = _run(capsys, argv)
        assert rc == 2 and field in err and err.count("\n") == 1


def test_search_finds_fitting_layouts_fastest_first():
    found = search_layouts(running_example(), 256, parse_bytes("80GiB"), 1024, top=20)
    assert len(found) == 20
    assert all(f["peak_bytes"] <= 80 * 2**30 for f in found)
    times = [f["time"]["total"] for f in found]
    assert times == sorted(times)
    for f in found[:3]:  # the reported peak is the ledger's
        cfg = f["config"]
        assert f["peak_bytes"] == max(led.total for led in stage_ledgers(cfg))
        assert cfg.world_size == 256
        assert cfg.micro_batch_size * cfg.data_parallel_size * cfg.num_microbatches == 1024
    assert search_layouts(running_example(), 256, parse_bytes("256MiB"), 1024) == []
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("80GB") == 80 * 10**9


def test_console_script_runs():
    """The installed entry point (or the same main() through python -c) answers a search."""
    import shutil

    exe = shutil.which("tinytron-memory")
    cmd = ([exe] if exe else [sys.executable, "-c", "import sys; from tinytron.memory.calculator "
                                                     "import main; sys.exit(main())"])
    proc = subprocess.run([*cmd, "--example", "--search", "--gpu-memory", "80GiB", "--top", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(" peak ") == 3
