"""Megatron-Core interop with megatron-core 0.16.1 itself (in a subprocess: its saver starts a
multiprocessing Manager and needs three CUDA calls stubbed): a model checkpoint written by
Megatron-Core loads into tinytron's GPTModel, one written by tinytron loads into Megatron-Core
(strict), and Megatron-Core -> Hugging Face through tinytron-convert — same logits to 1e-5,
tied and untied, GQA and MHA."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (pip install tinytron[oracles])")


def test_megatron_core_checkpoints_both_ways(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tests.checkpoint_workers", "megatron",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    gaps = json.loads(out.stdout.splitlines()[-1])
    for name in ("tie1_g2", "tie0_g2", "tie0_g4"):
        assert gaps[f"logit_scale_{name}"] > 1.0   # the logits are not trivially small
        assert gaps[f"convert_status_{name}"] == 0
        for direction in ("mcore_to_tinytron", "tinytron_to_mcore", "mcore_to_hf"):
            assert gaps[f"{direction}_{name}"] < 1e-5, (direction, name, gaps)
