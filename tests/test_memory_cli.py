"""`tinytron-memory` as a user runs it: what it assumed, and the gap to Megatron's estimate by term.

The command prints, per stage, the ledger beside Megatron's formula and the difference taken
apart into named terms. These tests hold the terms to adding up to the difference (in bytes,
to within the floating-point rounding of Megatron's formula, and in the printed MiB to within
the printed rounding), check single terms against hand-computed values of the 7B example, and
run the installed console script from the repository root, as the README does, to read the
assumption lines it prints.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinytron.memory.calculator import (main, megatron_gap, peak_parts, resolve_device,
                                        running_example)
from tinytron.memory.ledger import megatron_args_from, stage_ledgers
from tinytron.memory.megatron_model import megatron_theoretical_memory
from tinytron.model.config import llama_7b_config

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
EXAMPLE = "configs/llama7b_tp2_pp2_dp64.toml"
# (config, --world-size or None): the 7B example, the README's CPU job with no world size,
# and the 4-rank layouts that pipeline, interleave, shard over TP+SP and over CP.
CONFIGS = [(EXAMPLE, 256), ("configs/tiny.toml", None), ("configs/pp2_vpp2.toml", 4),
           ("configs/tp2_pp2.toml", 4), ("configs/cp2.toml", 4),
           ("configs/pp2_dp2_distopt.toml", 4), ("configs/pp2_vpp2_dp2_distopt.toml", 4),
           ("configs/gpt_1b.toml", 8)]


def _command() -> list[str]:
    exe = shutil.which("tinytron-memory")
    return [exe] if exe else [sys.executable, "-c", "import sys; from tinytron.memory.calculator "
                                                    "import main; sys.exit(main())"]


def _tinytron_memory(*argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([*_command(), *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def _json(capsys, path: str, world: int | None) -> dict:
    argv = ["--config", str(ROOT / path), "--json"] + (["--world-size", str(world)] if world else [])
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("path,world", CONFIGS)
def test_gap_terms_add_up_to_the_difference(capsys, path, world):
    got = _json(capsys, path, world)
    meg = got["megatron"]
    for stage in got["stages"]:
        gap = stage["megatron_gap"]
        assert gap["difference"] == stage["total"] - (meg["weight_and_optimizer"]
                                                      + meg["activation"])
        # Megatron's side is a float formula: the terms add up to the difference within a byte
        assert abs(math.fsum(gap["terms"].values()) - gap["difference"]) < 1.0, gap


def _printed_gap(out: str) -> tuple[dict[str, list[float]], list[float]]:
    """The printed difference-by-term rows (label -> MiB per stage) and the printed sum."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("difference by term"))
    rows = {}
    for line in lines[start + 1:]:
        m = re.fullmatch(r"  (.+?)\s+((?:[+-][\d,]+\.\d\d\s*)+)", line)
        assert m, f"not a term row: {line!r}"
        rows[m.group(1)] = [float(v.replace(",", "")) for v in m.group(2).split()]
    total = rows.pop("sum of the terms = the difference")
    return rows, total


@pytest.mark.parametrize("path,world", [CONFIGS[0], CONFIGS[1], CONFIGS[2]])
def test_printed_terms_add_up_within_the_printed_rounding(path, world, capsys):
    """The command's printed rows (its main(), in process: the subprocess tests below run the
    installed command itself) add up to its printed difference."""
    assert main(["--config", str(ROOT / path),
                 *(["--world-size", str(world)] if world else [])]) == 0
    out = capsys.readouterr().out
    rows, total = _printed_gap(out)
    assert len(rows) >= 5
    for stage, want in enumerate(total):
        printed = sum(values[stage] for values in rows.values())
        # each printed term is rounded to 0.01 MiB, at most 0.005 off, and so is the sum
        assert abs(printed - want) <= 0.005 * (len(rows) + 1), (stage, printed, want)


def test_running_example_terms_by_hand(capsys):
    """The 7B example's terms against values worked out by hand from its shapes."""
    got = _json(capsys, EXAMPLE, 256)
    first, last = (s["megatron_gap"]["terms"] for s in got["stages"])
    s, b, h, t, vocab = 4096, 2, 4096, 2, 128256
    unit = s * b * h // t  # elements of one [s, b, h] tensor split by TP: 16 Mi
    # Megatron: (18 + 4 f/h) bytes per element of it per layer, 32 layer-micro-batches on stage
    # 0 (2 micro-batches x 16 layers) for every stage; stage 1 holds 16
    assert last["in_flight"] == -16 * (18 + 4 * 14336 / 4096) * unit == -8192 * MIB
    assert first["in_flight"] == 0
    # the last stage's fp32 softmax over its half of the vocabulary; Megatron has no head at p=2
    assert last["logits"] == 4 * b * s * vocab // t and first["logits"] == 0
    # the final norm's 4096 parameters: on stage 1 here, spread over both stages by Megatron,
    # at 6 + 12/64 bytes each
    assert first["params"] == -12_672 and last["params"] == 12_672
    assert first["padding"] == first["bytes_per_param"] == first["optimizer"] == 0
    # a layer's MLP: fc1 input (2 bytes x 1 unit: the SP slice, as Megatron's) + SwiGLU's 4 f/t
    # per token, against Megatron's (2 + 4 f/h) bytes per unit; 32 layer-micro-batches on stage 0
    mlp = 2 * unit + 2 * 4 * (14336 // t) * s * b
    assert first["MLP"] == 32 * (mlp - (2 + 4 * 14336 / 4096) * unit) == 7168 * MIB
    # the norms keep their bf16 input as Megatron's do, plus 1/rms (4 bytes per row) it leaves
    # out; the linear_qkv input is the SP slice on both sides: no term
    assert first["norms"] == 32 * 2 * 4 * s * b // t and first.get("linear_qkv input", 0) == 0
    # no dropout in the model, two 1-byte masks per layer in Megatron's formula
    assert first["dropout masks"] == -32 * 2 * unit
    diffs = [s["megatron_gap"]["difference"] / MIB for s in got["stages"]]
    assert [round(d, 2) for d in diffs] == [6_121.57, 1_862.57]  # what the page quotes


@pytest.mark.parametrize("change", [
    dict(context_parallel_size=2, data_parallel_size=32, num_microbatches=16),
    dict(virtual_pipeline_model_parallel_size=2),
    dict(use_distributed_optimizer=False),
    dict(pipeline_model_parallel_size=1, data_parallel_size=128, num_microbatches=4),
    dict(model="full"), dict(model="no SP"), dict(model="offload"),
    dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5, device="cpu"),
    dict(bf16=False, grad_reduce_in_fp32=False, device="cpu", model="dropout"),
])
def test_gap_adds_up_under_every_switch(change):
    models = {"full": llama_7b_config(sequence_parallel=True, recompute_granularity="full",
                                      recompute_method="uniform", recompute_num_layers=1),
              "no SP": llama_7b_config(recompute_granularity="selective"),
              "offload": llama_7b_config(sequence_parallel=True,
                                         recompute_granularity="selective",
                                         fine_grained_activation_offloading=True,
                                         offload_modules=["core_attn", "attn_proj"]),
              "dropout": llama_7b_config(dropout=0.1, num_layers=4, seq_length=512)}
    change = dict(change)
    if "model" in change:
        change["model"] = models[change["model"]]
    cfg = running_example().replace(**change)
    meg = megatron_theoretical_memory(megatron_args_from(cfg), cfg.num_microbatches)
    for led in stage_ledgers(cfg):
        gap = megatron_gap(cfg, led.pp_rank)
        assert gap["difference"] == led.total - (meg["weight_and_optimizer"] + meg["activation"])
        assert abs(math.fsum(gap["terms"].values()) - gap["difference"]) < 1.0, gap["terms"]
        parts = peak_parts(cfg, led.pp_rank)
        assert parts["at"] == led.peak["at"] and len(parts["in_flight"]) >= 1


def test_cpu_config_says_cpu_and_what_it_assumed():
    """The README's CPU job without --world-size: the assumption lines, and no 'cuda'."""
    out = _tinytron_memory("--config", "configs/tiny.toml").stdout
    assert "assumed: world size 1 (not given: --world-size defaults to TP · PP · CP = 1)" in out
    assert "assumed: 4 micro-batches of 8 per step and DP rank (global batch 32" in out
    assert "assumed: fp32 params, grads, activations and adam moments" in out
    assert "micro-batches in flight at the peak: 1 on stage 0" in out
    device, why = resolve_device("auto")
    assert f"assumed: device {device} ({why})" in out
    if not torch.cuda.is_available():  # the trainer would run this config on the CPU here
        assert device == "cpu" and "cuda" not in out.lower()
    out = _tinytron_memory("--config", "configs/tiny.toml", "--training.device", "cpu",
                           "--world-size", "2").stdout
    assert "device cpu (training.device in the config)" in out and "cuda" not in out.lower()
    assert "assumed: world size 2 (--world-size), so DP 2" in out


def test_gpu_config_says_where_its_device_came_from():
    out = _tinytron_memory("--config", EXAMPLE, "--world-size", "256").stdout
    assert "assumed: device cuda (training.device in the config); attention kernel flash" in out
    assert "assumed: world size 256 (--world-size), so DP 64 = 256 / (TP 2 · PP 2 · CP 1)" in out
    assert ("micro-batches in flight at the peak: 2 on stage 0 (backward of micro-batch 0), "
            "1 on stage 1 (forward of micro-batch 0); Megatron's formula takes 2") in out
    out = _tinytron_memory("--config", EXAMPLE, "--world-size", "256", "--device", "cpu").stdout
    assert "assumed: device cpu (--device)" in out and "cuda" not in out.lower()
    searched = _tinytron_memory("--example", "--search", "--top", "1").stdout
    assert searched.startswith("assumed: device cuda (the running example's); 256 GPUs")
