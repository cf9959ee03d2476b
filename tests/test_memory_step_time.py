"""tinytron.memory.step_time: the overlap rules on small hand-computed cases (no timings)."""

from __future__ import annotations

import math

import pytest

from tinytron.main_loop.training_log import num_floating_point_operations
from tinytron.memory.calculator import running_example, step_time
from tinytron.memory.states import MemoryConfig, buffer_layouts
from tinytron.memory.step_published import cpu_links
from tinytron.memory.step_time import (Links, StepOptions, aligned_gather_exposed,
                                       all_gather_exposed, p2p_seconds, stage_compute,
                                       tp_layer_seconds,
                                       best_offload_modules, checkpoint_bytes, checkpoint_items,
                                       collective_seconds, dp_buckets, estimate_step,
                                       offload_table, pipeline_seconds, reduce_scatter_exposed,
                                       schedule_1f1b, stage_flops)
from tinytron.model import tiny_config


def _tiny(**kw) -> MemoryConfig:
    model = tiny_config(hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=128, vocab_size=512, seq_length=32)
    base = dict(data_parallel_size=2, micro_batch_size=2, num_microbatches=4,
                use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=20_000)
    return MemoryConfig(model, **{**base, **kw})


def test_collective_bytes_per_link():
    # a ring reduce-scatter of 160 MB over 64 ranks sends 63/64 of it: 3.15 ms at 50 GB/s
    assert collective_seconds("reduce_scatter", 160e6, 64, 50e9) == pytest.approx(3.15e-3)
    assert collective_seconds("all_gather", 160e6, 64, 50e9) == pytest.approx(3.15e-3)
    assert collective_seconds("all_reduce", 160e6, 64, 50e9) == pytest.approx(6.3e-3)
    assert collective_seconds("p2p", 1e9, 2, 50e9, latency=1e-3) == pytest.approx(0.021)
    assert collective_seconds("all_reduce", 1e9, 1, 50e9) == 0.0
    with pytest.raises(ValueError, match="kind must be one of"):
        collective_seconds("broadcast", 1, 2, 1.0)


def test_reduce_scatter_only_behind_the_last_backward_bucket_by_bucket():
    # buckets ready at 4, 7, 10 ms of a 10 ms backward, 3 ms each: 4-7, 7-10, 10-13
    exposed, spans = reduce_scatter_exposed([3, 3, 3], [0.4, 0.7, 1.0], backward=10)
    assert exposed == 3 and spans == [(4, 7), (7, 10), (10, 13)]
    assert reduce_scatter_exposed([3, 3, 3], [0.4, 0.7, 1.0], 10, slack=5)[0] == 0
    assert reduce_scatter_exposed([3, 3, 3], [0.4, 0.7, 1.0], 10, slack=2)[0] == 1
    # a queue: ready at 1, 2, 3 ms, but one stream: 1-6, 6-11, 11-16
    assert reduce_scatter_exposed([5, 5, 5], [0.1, 0.2, 0.3], 10)[0] == 6
    # without overlap everything starts after the backward
    assert reduce_scatter_exposed([3, 3, 3], [0.4, 0.7, 1.0], 10, overlap=False)[0] == 9


def test_all_gather_first_bucket_exposed_then_one_ahead():
    assert all_gather_exposed([3, 3, 3], [4, 4, 4])[0] == 3
    assert all_gather_exposed([6, 6, 6], [4, 4, 4])[0] == 6 + 2 + 2
    exposed, spans = all_gather_exposed([6, 6, 6], [4, 4, 4])
    assert spans == [(0, 6), (6, 12), (12, 18)]  # each dispatched when the previous wait returns
    assert all_gather_exposed([3, 3, 3], [4, 4, 4], overlap=False)[0] == 9


def test_pipeline_closed_form_and_the_played_schedule():
    got = pipeline_seconds([(1.0, 2.0)] * 2, 4, p2p=0.1)
    assert got["compute"] == 12 and got["bubble"] == 3 and got["p2p"] == pytest.approx(0.8)
    assert pipeline_seconds([(1.0, 2.0)], 4, p2p=0.1) == {"compute": 12, "bubble": 0.0,
                                                           "p2p": 0.0}
    # unequal stages: the slowest sets the pace, the others add to the bubble once
    got = pipeline_seconds([(1.0, 2.0), (2.0, 4.0)], 3)
    assert got["compute"] == 18 and got["bubble"] == 3
    assert pipeline_seconds([(1.0, 2.0)] * 4, 8, num_chunks=2)["bubble"] == 4.5
    # overlap_p2p_comm: rank 0's warm-up (2(p-1) + (v-1)p = 4 forwards) and cool-down (4
    # backwards) exchanges stay blocking, 8 x 0.1; the steady ones hide in a 0.5 chunk forward
    assert pipeline_seconds([(1.0, 2.0)] * 2, 4, 2, p2p=0.1, overlap_p2p_comm=True)["p2p"] == \
        pytest.approx(0.8)
    for p, m in ((2, 4), (4, 8), (3, 5)):
        stages = [(1.0, 2.0)] * p
        played = schedule_1f1b(stages, m, 0.0)
        closed = pipeline_seconds(stages, m)
        assert max(end for *_, end in played[0]) == pytest.approx(closed["compute"]
                                                                  + closed["bubble"])
        assert [k for k, *_ in played[0]].count("F") == m
        with_p2p = max(end for *_, end in schedule_1f1b(stages, m, 0.1)[0])
        assert closed["compute"] + closed["bubble"] < with_p2p <= \
            sum(pipeline_seconds(stages, m, p2p=0.1).values()) + 1e-12


def test_stage_flops_add_up_to_chapter_01s_count():
    for kw in ({}, {"pipeline_model_parallel_size": 2, "data_parallel_size": 1},
               {"tensor_model_parallel_size": 2, "data_parallel_size": 1}):
        cfg = _tiny(**kw)
        ranks = cfg.tensor_model_parallel_size
        total = sum(sum(stage_flops(cfg, r)) for r in range(cfg.pipeline_model_parallel_size))
        assert total * ranks == pytest.approx(num_floating_point_operations(cfg.model, 2))
        forward, backward = stage_flops(cfg, 0)
        assert backward == pytest.approx(2 * forward)  # no recompute: one GEMM becomes two


def test_dp_buckets_follow_chapter_05s_layout_in_backward_order():
    cfg = _tiny()
    buckets = dp_buckets(cfg, 0)
    (_, layout), = buffer_layouts(cfg, 0)
    assert [b["numel"] for b in buckets] == [e - s for s, e in layout.bucket_indices]
    assert len(buckets) > 2
    ready = [b["ready"] for b in buckets]
    assert ready == sorted(ready) and ready[-1] == pytest.approx(1.0)
    assert sum(b["share"] for b in buckets) == pytest.approx(1.0)
    one = dp_buckets(cfg.replace(overlap_grad_reduce=False), 0)
    assert len(one) == 1 and one[0]["ready"] == pytest.approx(1.0)


def test_checkpoint_copy_blocking_or_staged_and_the_write():
    cfg = _tiny()
    links = Links(pcie=1e6, disk=1e5)
    nbytes = checkpoint_bytes(cfg)
    copy, write = checkpoint_items(cfg, links, StepOptions(save_interval=10), 1.0, 0.5)
    assert copy["exposed"] == copy["seconds"] == pytest.approx(nbytes / 1e6)
    assert write["exposed"] == pytest.approx(max(0.0, nbytes / 1e5 - 10.0))
    staged = checkpoint_items(cfg, links, StepOptions(checkpoint="staged"), 1.0, 100.0)[0]
    assert staged["exposed"] == 0.0
    short = checkpoint_items(cfg, links, StepOptions(checkpoint="staged"), 1.0, 1e-6)[0]
    assert short["exposed"] == pytest.approx(nbytes / 1e6 - 1e-6)
    assert checkpoint_items(cfg, links, StepOptions(checkpoint="none"), 1.0, 1.0) == []
    with pytest.raises(ValueError, match="checkpoint must be"):
        checkpoint_items(cfg, links, StepOptions(checkpoint="later"), 1.0, 1.0)


def test_offload_fits_by_bandwidth():
    cfg = running_example()
    assert best_offload_modules(cfg, Links(pcie=1e15)) == ["attn_norm", "qkv_linear",
                                                           "core_attn", "attn_proj", "mlp_norm"]
    assert best_offload_modules(cfg, Links(pcie=1e6)) == []
    rows = {r["module"]: r for r in offload_table(cfg)}
    assert rows["all five"]["bytes"] == sum(rows[m]["bytes"] for m in
                                            ("attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                             "mlp_norm"))
    for combo in (best_offload_modules(cfg, Links(pcie=p)) for p in (20e9, 30e9, 60e9)):
        assert "attn_proj" not in combo or "core_attn" in combo


def test_step_is_compute_plus_exposed_and_overlap_only_helps():
    cfg = _tiny()
    links = Links(peak_flops=1e9, mfu=1.0, network=1e8, nvlink=1e8)
    on = estimate_step(cfg, links, StepOptions(checkpoint="none"))
    off = estimate_step(cfg, links, StepOptions(overlap_grad_reduce=False,
                                                overlap_param_gather=False, checkpoint="none"))
    assert on.total == pytest.approx(on.compute + on.bubble + on.optimizer + on.exposed)
    assert off.item("DP grad").exposed == pytest.approx(off.item("DP grad").seconds)
    assert off.item("DP param").exposed == pytest.approx(off.item("DP param").seconds)
    assert on.item("DP grad").exposed < off.item("DP grad").exposed
    assert on.total < off.total and on.compute == off.compute
    gloo = estimate_step(cfg, Links(peak_flops=1e9, mfu=1.0, network=1e8, nvlink=1e8,
                                    reduce_scatter_as_all_reduce=True), StepOptions())
    assert gloo.item("DP grad all-reduce").seconds == pytest.approx(
        2 * on.item("DP grad reduce-scatter").seconds)


def test_calculator_step_time_reports_the_models_parts():
    parts = step_time(running_example())
    assert set(parts) == {"compute", "bubble", "tp", "cp", "dp", "pp", "optimizer",
                          "interference", "total"}
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    # the same model and constants as 07.13, with the search's tp_comm_overlap
    from tinytron.memory.calculator import search_options
    step = estimate_step(running_example().replace(overlap_grad_reduce=True), Links(),
                         search_options(running_example()))
    assert parts["total"] == pytest.approx(step.total) and parts["bubble"] == step.bubble


def test_cpu_links_fit_latency_and_bandwidth():
    calibration = {"microbatch_s": 0.5, "memory_bandwidth": 1e10,
                   "microbatch_with_comm_s": 0.55, "background_numel": 25e6,
                   "collectives": [{"numel": n, "reduce_scatter": 1e-3 + 4 * n / 1e9}
                                   for n in (1e4, 1e6, 4e6)]}
    links = cpu_links(calibration, flops_per_microbatch=1e9)
    assert links.flops == pytest.approx(2e9) and links.mfu == 1.0
    assert links.network == pytest.approx(1e9) and links.latency == pytest.approx(1e-3)
    assert links.interference == pytest.approx(0.05 / (1e-3 + 0.1))  # lost per hidden second
    assert links.reduce_scatter_as_all_reduce and not math.isinf(links.pcie)


def test_search_ranks_by_the_overlap_aware_step():
    from tinytron.memory.calculator import Hardware, parse_bytes, search_layouts

    found = search_layouts(running_example(), 256, parse_bytes("80GiB"), 1024, top=5)
    hw = Hardware()
    for f in found:
        cfg = f["config"]
        assert f["time"] == step_time(cfg, hw)
        options = StepOptions(overlap_param_gather=cfg.use_distributed_optimizer,
                              checkpoint="none", overlap_p2p_comm=cfg.num_chunks > 1,
                              tp_comm_overlap=cfg.model.sequence_parallel
                              and cfg.tensor_model_parallel_size > 1)
        model = estimate_step(cfg.replace(overlap_grad_reduce=True), hw.links(), options)
        assert f["time"]["total"] == pytest.approx(model.total)
        assert f["time"]["dp"] < model.item("DP grad").seconds  # some of it hidden
    assert found[0]["config"].pipeline_model_parallel_size == 1


def test_overlap_p2p_comm_keeps_warmup_and_cooldown_blocking():
    # Megatron's interleaved warm-up on rank 0 is 2(p-1) + (v-1)p forwards (schedules.py:891),
    # exchanged blocking, as are the cool-down's; at PP8 v5 m64 that is 46 of 320 each way
    got = pipeline_seconds([(1.0, 2.0)] * 8, 64, 5, p2p=1.0, overlap_p2p_comm=True)
    assert got["p2p"] == pytest.approx(2 * 46 * 1.0 + 2 * (320 - 46) * 0.8)
    assert 2 * 46 / (2 * 320) == pytest.approx(0.144, abs=1e-3)  # the ~14% of the transfers


def test_param_gather_with_virtual_stages_is_aligned_not_summed_along_the_fill():
    # p = 2, two chunks, chunk forward 1 ms, 3 ms per chunk's gather (the page's worked case)
    assert aligned_gather_exposed([3, 3], 1, 2, 0) == 4
    assert aligned_gather_exposed([3, 3], 1, 2, 1) == 3
    # chunk 2 is launched when rank 0 starts chunk 1 (2 ms), queued behind chunks 0 and 1
    assert aligned_gather_exposed([3, 3, 3], 1, 2, 0) == 4 + 1
    # the step pays the largest rank's wait, where the old rule added every stage's first wait
    cfg = _tiny(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                data_parallel_size=4)
    links = Links(peak_flops=1e9, mfu=1.0, law=None, network=1e7, nvlink=1e7, interference=0)
    step = estimate_step(cfg, links, StepOptions(checkpoint="none"))
    ag = step.item("DP param")
    assert ag.exposed == pytest.approx(max(ag.per_stage))
    summed = estimate_step(cfg, links, StepOptions(checkpoint="none", align_param_gather=False))
    assert summed.item("DP param").exposed > ag.exposed


def test_tp_comm_overlap_hides_tp_behind_its_gemms():
    cfg = running_example()
    links = Links()
    seconds, exposed = tp_layer_seconds(cfg, links, StepOptions())
    assert exposed == seconds > 0  # on the compute stream
    seconds2, hidden = tp_layer_seconds(cfg, links, StepOptions(tp_comm_overlap=True))
    assert seconds2 == seconds and hidden < 0.1 * seconds
    # by hand: one all-gather of 2 x 4096 x 2 x 4096 bf16 bytes over 2 NVLink ranks
    gather = 0.5 * 2 * 4096 * 2 * 4096 / 450e9  # bytes x (t - 1) / t
    assert seconds == pytest.approx(4 * 2 * gather)
    # the GEMMs cut into t pieces pay for it in compute
    on = stage_compute(cfg, links, StepOptions(tp_comm_overlap=True))
    assert all(a[0] >= b[0] for a, b in zip(on, stage_compute(cfg, links)))


def test_collectives_across_nodes_use_every_nic_of_the_group():
    links = Links()
    assert links.link(64) == 50e9 and links.link(4) == 450e9
    assert links.link(64, per_node=4) == 200e9 and links.link(64, per_node=8) == 400e9
    # TP1 DP48: all 8 GPUs of a node are in the DP group, their 8 NICs carry its rings
    tp1 = _tiny(data_parallel_size=48)
    tp8 = _tiny(data_parallel_size=48, tensor_model_parallel_size=2)
    l = Links(law=None, peak_flops=1e9, mfu=1.0, gpus_per_node=8)
    one = estimate_step(tp1, l, StepOptions(checkpoint="none")).item("DP grad")
    four = estimate_step(tp8, l, StepOptions(checkpoint="none")).item("DP grad")
    assert one.seconds < four.seconds
    # p2p between stages crosses one NIC, never more
    assert p2p_seconds(_tiny(pipeline_model_parallel_size=2, data_parallel_size=8), l) == \
        pytest.approx(2 * 32 * 2 * 64 / 50e9)  # bf16 x s x b x h over one NIC


def test_the_published_table_within_its_stated_bounds():
    from tinytron.memory.step_published import (PUBLISHED, finest_virtual_stages,
                                                predict_published)

    rows = [predict_published(run, finest_virtual_stages(run)) for run in PUBLISHED]
    # the README's superlinear claim: 1.7B (TP1) below 16B (TP4), per GPU
    assert rows[2]["predicted_tflops"] > rows[0]["predicted_tflops"]
    assert all(0.80 < r["ratio"] < 1.20 for r in rows), [r["ratio"] for r in rows]
    assert sum(abs(r["ratio"] - 1) <= 0.10 for r in rows) >= 6
    # the old model, one efficiency for every shape, predicts the opposite trend
    flat = Links(law=None)
    small, big = (predict_published(PUBLISHED[i], None, flat)["predicted_tflops"] for i in (0, 2))
    assert small > big


def test_the_trainers_report_uses_the_runs_own_options(tmp_path):
    from tinytron.config import load_config
    from tinytron.memory._step_report import (StepReport, measured_step_seconds, run_options,
                                              step_report_at_end)

    vpp = load_config("configs/pp2_vpp2.toml", [])
    assert run_options(vpp).overlap_p2p_comm  # interleaved: the config's overlap_p2p_comm
    one = load_config("configs/pp2_vpp2.toml",
                      ["--parallel.virtual_pipeline_model_parallel_size", "1"])
    assert not run_options(one).overlap_p2p_comm  # Megatron allows it only when interleaved
    log = tmp_path / "log.jsonl"
    log.write_text("".join(f'{{"iteration": {i}, "ms_per_iteration": {ms}}}\n'
                           for i, ms in ((1, 900.0), (2, 100.0), (3, 120.0), (4, 110.0))))
    assert measured_step_seconds(str(log)) == (pytest.approx(0.110), 3)  # the first left out
    step = estimate_step(_tiny(), Links(law=None, peak_flops=1e9, mfu=1.0), StepOptions())
    line = step_report_at_end(StepReport("", step), str(log))
    assert line.startswith(f"step time: predicted {step.total * 1e3:.3g} ms at the start, "
                           "measured 110 ms (median of 3 logged intervals): ")
    assert step_report_at_end(StepReport("not predicted"), str(log)) is None


def test_one_running_example_one_step_time():
    """01, 07.9 and 07.13 quote the same model; 07.9 says which assumption differs."""
    import re
    from pathlib import Path

    from tinytron.memory.calculator import search_options

    root = Path(__file__).resolve().parents[1] / "chapters"
    ex = running_example().replace(overlap_grad_reduce=True)
    page = estimate_step(ex, Links(), StepOptions(save_interval=500)).total  # 07.13, its config
    search = step_time(running_example())["total"]  # 07.9: tp_comm_overlap on
    assert search == pytest.approx(estimate_step(ex, Links(), search_options(ex)).total)
    log = (root / "01_main_loop" / "training_log.py").read_text()
    assert f"predicts {page:.2f} s per" in log and f"in 07.13's {page:.2f} s/iter" in log
    calc = (root / "07_memory" / "calculator.py").read_text()
    assert re.search(rf"estimates {search:.2f} s per step", calc)
    assert f"(07.13: {page:.2f} s with TP's traffic" in calc
    step = (root / "07_memory" / "step_time.py").read_text()
    assert f"model gives {page:.2f} s per step" in step and f"{search:.2f} s, the number 07.9" in step


def test_memory_json_carries_the_step_time_and_its_exposed_terms(capsys):
    import json

    from tinytron.memory.calculator import main

    assert main(["--example", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["step_time"]
    assert got["total_s"] == pytest.approx(step_time(running_example())["total"])
    items = {i["item"]: i for i in got["items"]}
    assert {"DP grad reduce-scatter", "DP param all-gather", "PP p2p"} <= set(items)
    assert got["exposed_s"] == pytest.approx(sum(i["exposed"] for i in got["items"]))
    assert main(["--example", "--search", "--json", "--top", "2"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert len(ranked) == 2 and ranked[0]["step_time"]["total_s"] <= \
        ranked[1]["step_time"]["total_s"]


def test_a_gpu_run_is_reported_with_its_own_gpus_law():
    from tinytron.kernels.roofline import LAWS
    from tinytron.memory._step_report import links_for_gpu

    for name, key in (("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA A100-SXM4-80GB", "A100"),
                      ("NVIDIA H200", "H200")):
        links, words = links_for_gpu(name)
        assert links.law == LAWS[key] and links.memory == LAWS[key].gpu.hbm_bytes_per_s
        assert words == f"{LAWS[key].gpu.name} (appendix C's kernel law)"
    links, words = links_for_gpu("NVIDIA L4")
    assert links.law == LAWS["H100"] and "no law for this GPU" in words


def test_p2p_is_split_over_tp_only_by_sequence_parallelism():
    # Megatron at e03878b5f has no scatter/gather of the p2p tensor over TP ranks: each TP
    # rank sends the whole (s, b, h) tensor, divided by t only with SP (schedules.py:2080-2085)
    links = Links(law=None, peak_flops=1e9, mfu=1.0)
    full = p2p_seconds(_tiny(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                             data_parallel_size=1), links)
    sp = _tiny(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
               data_parallel_size=1)
    sp = sp.replace(model=sp.model.replace(sequence_parallel=True))
    assert full == pytest.approx(2 * 32 * 2 * 64 / links.nvlink)  # stages 2 ranks apart
    assert p2p_seconds(sp, links) == pytest.approx(full / 2)
