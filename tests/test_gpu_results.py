"""The pages' "measured on <device>" tables: from gpu_check's JSON, or a line saying there is none.

The fixture JSON is written the way scripts/gpu_check.sh writes it (benchmarks/gpu_check.py's
`trainer` and `record` on outputs shaped like the benchmarks'), so a change to either side
that the other does not follow fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinytron._gpu_results import PAGES, gpu_table
from tests.test_gpu_check import ROOT, TINY, _jsonl, gpu_check_helper

PAGE_FILES = {"training_log": "01_main_loop/training_log.py", "measured": "07_memory/measured.py",
              "step_time": "07_memory/step_time.py", "kernels": "kernels/roofline.py",
              "recompute": "06_recompute_offload/recompute.py",
              "async_save": "03_checkpoint/staged_copy.py"}
ENV = {"schema": 1, "device": "NVIDIA H200", "slug": "h200", "device_count": 1,
       "torch": "2.11.0+cu128", "triton": "3.6.0", "cuda": "12.8", "python": "3.12.3",
       "dry_run": False, "date": "2026-12-02T10:30Z"}


def _kernels_raw() -> dict:
    def impl(ms, frac):
        return {"fwd_bwd_ms": ms, "fraction_of_peak": {"fwd": frac, "fwd_bwd": frac}}
    row = {"triton": impl(0.1, 0.62), "eager": impl(0.3, 0.21), "compile": impl(0.12, 0.55)}
    return {"peak_bytes_per_s_datasheet": 4.8e12, "copy_bytes_per_s_measured": 4.1e12,
            "rmsnorm": row, "swiglu": row, "cross_entropy": row,
            "attention": {"shape": [1, 32, 8, 2048, 64], "sdpa_backend": "flash",
                          "triton": {"TFLOP_per_s": {"fwd_bwd": 310.0}},
                          "sdpa": {"TFLOP_per_s": {"fwd_bwd": 400.0}},
                          "triton_over_sdpa": {"fwd_bwd": 0.775}}}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """One device's JSON: the trainer (eager ok, compile timed out), kernels, recompute, staging."""
    folder = tmp_path_factory.mktemp("gpu")
    helper, report = gpu_check_helper(), folder / "h200.json"
    report.write_text(json.dumps({**ENV, "steps": {}}))
    _jsonl(folder / "log.jsonl", 30)
    helper.main(["trainer", "--variant", "torch", "--rc", "0", "--jsonl", str(folder / "log.jsonl"),
                 "--iters", "30", "--out", str(folder / "trainer.json"), "--", *TINY])
    raws = {"kernels": _kernels_raw(),
            "recompute": {"model": "GPTModel h256", "micro_batch": 4, "modes": {
                "none": {"ratio_median": 1.0, "peak_bytes": 64 * 2**20},
                "selective core_attn": {"ratio_median": 1.031, "goal": 1.05,
                                        "peak_bytes": 40 * 2**20}}},
            "staging": {"parameters": 100_092_672, "checkpoint_bytes": 1_201_593_072,
                        "ratios_of_medians": {"thread_staged_blocking_over_sync": 0.012,
                                              "thread_staged_step_over_reference": 1.07,
                                              "sync_step_over_reference": 4.5},
                        "median_seconds": {"sync_s": 1.5, "reference_step_s": 0.1,
                                           "thread_staged_blocking_s": 0.018,
                                           "thread_staged_step_s": 0.107}}}
    for name, raw in raws.items():
        (folder / f"{name}.json").write_text(json.dumps(raw))
    (folder / "memory.log").write_text("1 passed in 3.10s\n")
    steps = [("trainer_torch", "ok", folder / "trainer.json"),
             ("trainer_compile", "timed out", None), ("memory", "ok", None)] + [(n, "ok", folder / f"{n}.json") for n in raws]
    for name, status, raw in steps:
        helper.main(["record", "--json", str(report), "--step", name, "--status", status,
                     "--seconds", "12", "--limit", "170", "--log", str(folder / f"{name}.log"),
                     *(["--raw", str(raw)] if raw else [])])
    # a dry run's file beside it is never shown as a GPU's
    (folder / "cpu-dry-run.json").write_text(json.dumps({**ENV, "device": "CPU", "dry_run": True,
                                                         "steps": {}}))
    return folder


def test_the_tables_show_the_device_and_its_values(results):
    head = ("Measured on NVIDIA H200 (torch 2.11.0+cu128, Triton 3.6.0, CUDA 12.8; "
            "2026-12-02T10:30Z) by `bash scripts/gpu_check.sh 1`:")
    text = gpu_table("training_log", results)
    assert text.startswith(head) and "CPU" not in text
    assert "| torch | 21-30 | 50,030 | 40.0% | 396 | 650 |" in text
    assert "| torch + compile | timed out (limit 170 s) |" in text  # an outcome, not a number
    measured = gpu_table("measured", results)
    assert "| torch | 30.00 | " in measured
    assert "(`test_ledger_against_cuda_allocator`): 1 passed." in measured
    assert "| rmsnorm: fraction of HBM peak | 62% | 21% | 55% |" in gpu_table("kernels", results)
    assert "Flash attention / SDPA: 0.78." in gpu_table("kernels", results)
    assert "| selective core_attn | 1.031 | 1.05 | 40.0 |" in gpu_table("recompute", results)
    assert "| thread, staged | 0.018 | 0.012 | 1.07 |" in gpu_table("async_save", results)
    assert "| 650 | " in gpu_table("step_time", results)


def test_without_results_each_page_says_so(tmp_path):
    for page, (command, _) in PAGES.items():
        assert gpu_table(page, tmp_path / "none") == (
            f"Not yet measured on a GPU: run `bash scripts/gpu_check.sh {command}` on a CUDA "
            "machine and commit the `benchmarks/results/gpu/<device>.json` it writes.")
    with pytest.raises(ValueError, match="page 'roofline' has no GPU table"):
        gpu_table("roofline", tmp_path)


def test_each_page_that_makes_a_gpu_claim_renders_its_table():
    assert set(PAGE_FILES) == set(PAGES)
    for page, path in PAGE_FILES.items():
        assert (ROOT / "chapters" / path).read_text().count(f'print(gpu_table("{page}"))') == 1
