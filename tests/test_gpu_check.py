"""scripts/gpu_check.sh fits a device lease, and its report says what each step did (on CPU).

The lease: two commands of at most 360 s each; every step's limit plus its kill grace plus the
set-up must fit its command, and an overrun must stop the dry run loudly. The report: a step
that did not finish stays visible as such, and a trainer run that stopped short of its asked
iterations (a time-out, a signal) is never reported as a result.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def gpu_check_helper():
    """benchmarks/gpu_check.py, imported by path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_check_helper",
                                                  ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _budget(script: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), "budget"], capture_output=True, text=True,
                          timeout=60)


def test_each_command_fits_its_six_minutes():
    out = _budget(SCRIPT)
    assert out.returncode == 0, out.stderr
    commands = re.findall(r"command (\d) \(budget (\d+) s\): setup (\d+) s\n"
                          r"((?:  \S+: limit .*\n)+)", out.stdout)
    assert [c[0] for c in commands] == ["1", "2"]
    steps = {}
    for number, budget, setup, rows in commands:
        limits = re.findall(r"  (\S+): limit (\d+) s \+ (\d+) s kill grace", rows)
        worst = int(setup) + sum(int(lim) + int(grace) for _, lim, grace in limits)
        assert int(budget) <= 360 and worst <= int(budget), (number, worst, budget)
        steps[number] = [name for name, _, _ in limits]
    # the headline first, pytest -m gpu last with what is left
    assert steps["1"][:2] == ["trainer_torch", "trainer_compile"]
    assert steps["2"][0] == "kernels" and steps["2"][-1] == "pytest_gpu"


def test_an_overrun_stops_the_check_loudly(tmp_path):
    source = SCRIPT.read_text()
    longer = source.replace("trainer_compile:170:", "trainer_compile:200:")
    assert longer != source
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "gpu_check.sh").write_text(longer)
    out = _budget(tmp_path / "scripts" / "gpu_check.sh")
    assert out.returncode == 1
    assert "OVER BUDGET: command 1's steps add up to 390 s, more than its 360 s" in out.stderr


def _jsonl(path: Path, last: int, every: int = 10) -> None:
    recs = [{"type": "start", "iteration": 0}]
    recs += [{"type": "train", "iteration": it, "tokens_per_second": 50_000.0 + it,
              "mfu": 0.4, "tflops_per_device": 395.6, "ms_per_iteration": 650.0,
              "global_batch_size": 16, "losses": {"lm loss": 6.0 - it / 10},
              "memory": {"mem-max-allocated-bytes": 30 * 2**30 + it,
                         "mem-max-reserved-bytes": 32 * 2**30}}
             for it in range(every, last + 1, every)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


TINY = ["--config", str(ROOT / "configs" / "tiny.toml"), "--training.train_iters", "30",
        "--scheduler.lr_warmup_iters", "1"]


def test_a_trainer_run_counts_only_when_it_reached_its_iterations(tmp_path):
    helper = gpu_check_helper()
    out = tmp_path / "summary.json"

    def summary(last: int, rc: int) -> tuple[int, dict]:
        _jsonl(tmp_path / "log.jsonl", last)
        code = helper.main(["trainer", "--variant", "torch", "--rc", str(rc), "--jsonl",
                            str(tmp_path / "log.jsonl"), "--iters", "30", "--out", str(out),
                            "--", *TINY])
        return code, json.loads(out.read_text())

    # a run that saved on SIGTERM and exited 0 at iteration 20: not a result
    code, d = summary(20, 0)
    assert code == 3 and "tokens_per_second" not in d
    assert d["why"] == "exit 0: its log's last iteration is 20 of 30"
    code, d = summary(20, 124)
    assert code == 124 and d["why"].startswith("timed out")
    code, d = summary(30, 0)
    assert code == 0 and d["interval"] == [21, 30] and d["tokens_per_second"] == 50_030.0
    assert d["peak_allocated_bytes"] == 30 * 2**30 + 30 and d["ledger_total_bytes"] > 0
    assert d["peak_over_ledger"] == d["peak_allocated_bytes"] / d["ledger_total_bytes"]
    # without a GPU the prediction is made with the H100's kernel law, and says so
    assert d["predicted"]["law"].startswith("H100") and d["predicted_step_s"] > 0


def test_a_cut_off_command_still_reports_how_far_it_got(tmp_path):
    helper = gpu_check_helper()
    helper.main(["start", "--dest", str(tmp_path), "--command", "1", "--dry", "--plan",
                 "trainer_torch:110:the trainer;memory:45:the ledger"])
    report_path = tmp_path / "cpu-dry-run.json"
    log = tmp_path / "trainer_torch.log"
    log.write_text("iteration 7\nTerminated\n")
    helper.main(["record", "--json", str(report_path), "--step", "trainer_torch", "--status",
                 "timed out", "--seconds", "110", "--limit", "110", "--log", str(log)])
    report = json.loads(report_path.read_text())
    assert report["dry_run"] is True
    assert {k: s["status"] for k, s in report["steps"].items()} == {
        "trainer_torch": "timed out", "memory": "pending"}
    assert report["steps"]["trainer_torch"]["log_tail"] == ["iteration 7", "Terminated"]
    text = (tmp_path / "gpu_check.md").read_text()
    assert "| trainer_torch: the trainer | timed out | 110 (110) | Terminated |" in text
    assert "| memory: the ledger | pending |" in text


def test_pytest_cut_off_before_its_summary_still_counts_its_tests(tmp_path):
    log = tmp_path / "pytest_gpu.log"
    log.write_text("tests/test_a.py::test_x[1] PASSED   [ 2%]\n"
                   "tests/test_a.py::test_x[2] FAILED   [ 4%]\n"
                   "tests/test_b.py::test_y SKIPPED (no CUDA)   [ 6%]\n")
    data, headline = gpu_check_helper()._extract_pytest(None, str(log))
    assert data == {"counts": {"passed": 1, "failed": 1, "skipped": 1},
                    "failed": ["tests/test_a.py::test_x[2]"]}
    log.write_text(log.read_text() + "FAILED tests/test_a.py::test_x[2] - assert 1 == 2\n"
                   "1 failed, 1 passed, 1 skipped in 3.20s\n")
    assert gpu_check_helper()._extract_pytest(None, str(log))[1] == "1 failed, 1 passed, 1 skipped"


def test_the_report_is_named_after_the_device():
    slug = gpu_check_helper().device_slug
    assert [slug(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
                              "NVIDIA GeForce RTX 4090")] == [
        "h200", "h100", "a100", "nvidia-geforce-rtx-4090"]
