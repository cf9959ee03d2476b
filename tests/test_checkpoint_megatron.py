"""Megatron-Core interop with megatron-core 0.16.1 itself (in a subprocess: its saver starts a
multiprocessing Manager and needs three CUDA calls stubbed): a model checkpoint written by
Megatron-Core loads into tinytron's GPTModel, one written by tinytron loads into Megatron-Core
(strict), and Megatron-Core -> Hugging Face through tinytron-convert — same logits to 1e-5,
tied and untied, GQA and MHA; a default save (weights alone, or a whole training checkpoint)
writes the same files as megatron-core's save of the same model."""

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
        # the default output is file for file what megatron-core's dist_checkpointing.save writes
        # (one writer thread per rank, Megatron's default at e03878b5f; megatron-core 0.16.1's
        # own default is two, and tinytron with thread_count=2 writes the same two files)
        assert gaps[f"files_tinytron_{name}"] == gaps[f"files_mcore1_{name}"] == [
            ".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
        assert gaps[f"files_tinytron2_{name}"] == gaps[f"files_mcore_{name}"] == [
            ".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "metadata.json"]
    assert gaps["files_full_checkpoint"] == gaps["files_mcore1_tie1_g2"]
