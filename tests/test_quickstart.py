"""The README's quickstart runs as written: preprocess, split and blend, 2-rank DDP + ZeRO-1, HF export."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = ROOT / "examples" / "quickstart.py"


def test_quickstart_script_runs_and_learns(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("loss per step"))
    rank0, rank1 = ast.literal_eval(line.split(":", 1)[1].strip())
    assert len(rank0) == len(rank1) == 4
    assert rank0[-1] < rank0[0] and rank1[-1] < rank1[0], line  # it trains
    assert rank0 != rank1, "both ranks read the same micro-batches: the data is not split over DP"
    assert "vocab 262, eod 256, pad 257" in proc.stdout
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and (tmp_path / "hf" / "model.safetensors").exists()


def test_readme_shows_the_quickstart_as_it_is():
    """The README's code block is the script itself, so the two cannot drift apart."""
    readme = (ROOT / "README.md").read_text()
    body = SCRIPT.read_text().split('"""', 2)[2].strip()  # the code after the docstring
    assert body in readme, "README.md's quickstart differs from examples/quickstart.py"
